"""The low-host-cost launcher of our Triton kernels (rubin_compile/kernels/triton/launch.py) on a CPU.

- The host helpers equal Triton's ``cdiv`` / ``next_power_of_2``.
- The key a bound binary is found by separates every argument property Triton specialises on (a tensor's dtype and
  16-byte alignment, an int's value, keyword constexprs and launch options) and refuses what it cannot hold (a
  tensor or an unhashable value by keyword, a tuple argument); float values do not split it.
- The parameters after the positional ones are bound as ``JITFunction.run`` binds them (keyword, else default).
- Without CUDA (here) every launch takes Triton's own path: under the interpreter (a subprocess, since Triton reads
  TRITON_INTERPRET when imported) a kernel launched through the launcher computes what it launched directly does,
  with every launch counted as a miss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="the launcher wraps Triton kernels")
import triton.language as tl  # noqa: E402

from rubin_compile.kernels.triton import launch as L  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + y + SHIFT, mask=mask)


def test_host_helpers_equal_tritons():
    for a in range(0, 300):
        assert L.next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, 128):
            assert L.cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_key_separates_what_triton_specialises_on():
    lau = L.Launcher(_axpy)
    x = torch.empty(64, dtype=torch.float32)
    y = torch.empty(64, dtype=torch.float32)
    kw = {"BLOCK": 32, "num_warps": 4}
    base = lau.key((x, y, x, 64, 0.5), kw, 0)
    assert base is not None
    assert lau.key((x, y, x, 64, 0.5), dict(kw), 0) == base  # the same call again
    assert lau.key((x, y, x, 64, 2.0), kw, 0) == base  # floats are not specialised
    assert x[1:].data_ptr() % 16 != 0
    assert lau.key((x[1:], y, x, 64, 0.5), kw, 0) != base  # 16-byte alignment
    assert lau.key((x[4:], y, x, 64, 0.5), kw, 0) == base  # 16 bytes further: still aligned
    assert lau.key((x.half(), y, x, 64, 0.5), kw, 0) != base  # dtype
    for n in (1, 16, 65, 2**40):  # == 1, divisible by 16, other, 64-bit
        assert lau.key((x, y, x, n, 0.5), kw, 0) != base
    assert lau.key((x, y, x, 64, 0.5), {"BLOCK": 64, "num_warps": 4}, 0) != base  # a constexpr
    assert lau.key((x, y, x, 64, 0.5), {"BLOCK": 32, "num_warps": 8}, 0) != base  # a launch option
    assert lau.key((x, y, x, 64, 0.5), {**kw, "launch_pdl": True}, 0) != base
    assert lau.key((x, y, x, 64, 0.5), kw, 1) != base  # another device
    assert lau.key((x, y, None, 64, 0.5), kw, 0) != base  # None is a constexpr to Triton


def test_key_refuses_what_it_cannot_hold():
    lau = L.Launcher(_axpy)
    x = torch.empty(64)
    assert lau.key((x, x, x, 64, 0.5), {"BLOCK": 32, "SHIFT": x}, 0) is None  # a tensor by keyword
    assert lau.key((x, x, x, 64, 0.5), {"BLOCK": 32, "SHIFT": [1]}, 0) is None  # unhashable
    assert lau.key((x, x, x, (64, 1), 0.5), {"BLOCK": 32}, 0) is None  # a tuple argument
    assert lau.key((x, x, x, tl.constexpr(64), 0.5), {"BLOCK": 32}, 0) is None


def test_tail_binds_keywords_then_defaults():
    lau = L.Launcher(_axpy)
    assert lau._names == ("x_ptr", "y_ptr", "out_ptr", "n", "alpha", "BLOCK", "SHIFT")
    assert lau.tail(5, {"BLOCK": 32, "num_warps": 4}) == (32, 0)  # SHIFT's default; options are not parameters
    assert lau.tail(5, {"BLOCK": 32, "SHIFT": 3}) == (32, 3)
    assert lau.tail(4, {"BLOCK": 32, "alpha": 1.5}) == (1.5, 32, 0)  # a parameter passed by keyword
    assert lau.tail(5, {"num_warps": 4}) is None  # BLOCK has no default: Triton's path (which raises)


def test_hooks_are_set_only_when_a_chain_has_calls():
    from triton import knobs

    chain = knobs.HookChain()
    assert L.no_hooks(None, None) and L.no_hooks(chain, knobs.HookChain(reversed=True))
    assert L.no_hooks(knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)  # Triton's defaults
    chain.add(lambda metadata: None)
    assert not L.no_hooks(chain, None)
    assert not L.no_hooks(None, lambda metadata: None)  # a plain hook


def test_one_launcher_per_kernel():
    assert L.launcher(_axpy) is L.launcher(_axpy)
    assert L.launcher(_axpy).fn is _axpy


_INTERPRETED = r"""
import importlib.util, json, sys, torch
from rubin_compile.kernels.triton.launch import launcher

spec = importlib.util.spec_from_file_location("launch_test", sys.argv[1])  # this file: its _axpy, interpreted
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
axpy = mod._axpy

g = torch.Generator().manual_seed(0)
x, y = torch.randn(100, generator=g), torch.randn(100, generator=g)
out = {}
for shift in (0, 2):
    a, b = torch.zeros(100), torch.zeros(100)
    axpy[(4,)](x, y, a, 100, 0.5, BLOCK=32, SHIFT=shift)
    launcher(axpy)[(4,)](x, y, b, 100, 0.5, BLOCK=32, SHIFT=shift)
    launcher(axpy)[(4,)](x, y, b, 100, 0.5, BLOCK=32, SHIFT=shift)
    out[shift] = bool(torch.equal(a, b)) and bool(torch.equal(a, 0.5 * x + y + shift))
lau = launcher(axpy)
print(json.dumps({"equal": out, "hits": lau.hits, "misses": lau.misses}))
"""


def test_without_cuda_every_launch_takes_tritons_path():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, __file__], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"equal": {"0": True, "2": True}, "hits": 0, "misses": 4}


def test_a_gluon_kernel_is_not_traced_into_the_graph():
    """Recording a launch into the graph (passes/inline_kernels.py, through torch.library.wrap_triton) refuses a
    Gluon kernel with a reason, so its adapter stays an op call with that reason in the plan; a Triton kernel is not
    refused by that check."""
    gk = pytest.importorskip("rubin_compile.kernels.triton.moe_prefill_gluon")
    if not gk.GLUON:
        pytest.skip("this Triton has no Gluon")
    with L.into_graph():
        with pytest.raises(NotImplementedError, match="_fc2_w8a8_kernel is a Gluon kernel"):
            L.launcher(gk._fc2_w8a8_kernel).record((1,), (), {})
    assert not L.launcher(_axpy).fn.is_gluon()
