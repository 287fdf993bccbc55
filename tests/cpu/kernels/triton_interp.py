"""Triton's interpreter made to round as the GPU does, for the kernel tests that run kernels on the CPU
(``TRITON_INTERPRET=1``, in a subprocess of their own)."""

from __future__ import annotations

import torch


def gpu_rounding() -> None:
    """float32 -> e4m3 and -> bf16 in the interpreter as the GPU does it (round to nearest even, as torch does).

    Triton 3.9's interpreter (``interpreter._convert_float``) rounds half up and drops the carry when a
    mantissa rounds up into the next binade (-31.98 becomes -16, not -32): up to 2x off on a few activations. The
    same happens to float32 -> bf16 (a bf16 case of the GEMV form was 1e-2 off the emulated roundings before this,
    0 after). The kernel tests check FP8 activation paths and bf16 roundings, so the cast the GPU's
    cvt.rn(.satfinite) does is what the interpreter must do too. Other conversions are left to Triton."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    ours = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.uint16)}

    def convert_rne(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype in ours and input_dtype == tl.float32:
            to, bits = ours[output_dtype]
            src = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return src.to(to).view(bits).numpy().reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_rne
    _shape_independent_dots(np, interpreter)


def _shape_independent_dots(np, interpreter) -> None:
    """``tl.dot`` in the interpreter with each output element's products summed in one order whatever the shape of
    the tile, as on the GPU, where an MMA's column does not depend on how many columns the tile has.

    The interpreter's ``np.matmul`` goes to OpenBLAS, whose kernel for a block depends on the CPU and the block's
    width: on an AVX-512 machine (OpenBLAS 0.3.30, numpy 2.3) a [16, K] x [K, 2N] product differs in the last bit
    from its two [K, N] halves, for every K and N tried, while on the machine before it they were equal. The tests
    that compare kernels bitwise across tile shapes (the MoE's joined gate / up tiles against the halves) then passed
    or failed by the host. Here the float products (exact in float64) are summed in float64 along K in order and
    rounded once: the same value for an element at any tile shape. Integer dots keep Triton's."""
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out_dtype = d.data.dtype
        if not np.issubdtype(out_dtype, np.floating):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or (
            b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()
        ):  # as Triton's: FP8 operands through fp16 (exact)
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        a64, b64 = a_data.astype(np.float64), b_data.astype(np.float64)
        acc = np.zeros(np.broadcast_shapes(a64.shape[:-1] + (1,), b64.shape[:-2] + (1, b64.shape[-1])))
        for kk in range(a64.shape[-1]):
            acc += a64[..., :, kk : kk + 1] * b64[..., kk : kk + 1, :]
        return interpreter.TensorHandle((acc + d.data).astype(out_dtype), d.dtype.scalar)

    builder.create_dot = create_dot


def run_file(path, timeout: int = 900):
    """The JSON a kernel test file prints on its last line when run as a script under the interpreter: Triton must
    see TRITON_INTERPRET=1 before it is first imported, so the kernels run in a subprocess of their own (with this
    checkout on its path); its output tails are in the failure message when it exits non-zero."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, cwd=root, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def triton_version() -> tuple[int, ...]:
    """(major, minor) of the installed Triton; (0,) without one."""
    import importlib.util
    from importlib.metadata import version

    if importlib.util.find_spec("triton") is None:
        return (0,)
    return tuple(int(p) for p in version("triton").split(".")[:2])
