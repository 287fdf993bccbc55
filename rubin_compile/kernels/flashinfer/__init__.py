"""The ``flashinfer`` provider: FlashInfer 0.7.2 MoE, GEMM and attention kernels, registered onto the canonical ops.

    tables.py     which entry point runs each (op, kernel, quantisation), gated by FlashInfer's own capability
                  declarations (read without running anything), with dtype / shape rules and priorities
    adapter.py    what an adapter is: weights prepared once and cached, the call built and checked, then run
    moe.py        adapters for rubin.moe: cutlass_fused_moe, trtllm-gen routed MoE, CuTe-DSL fused MoE
    gemm.py       adapters for rubin.gemm: mm_bf16 / mm_fp8 / bmm_fp8 / mm_fp4 / groupwise FP8 / Hopper FP8 block
    attention.py  adapters for rubin.attention: FA2 / FA3 prefill and decode, trtllm-gen

A kernel (``flashinfer_cutlass``, ``flashinfer_trtllm``, ``flashinfer_cutedsl``, ``flashinfer_cudnn``,
``flashinfer_cublas``, ``flashinfer_fa2``, ``flashinfer_fa3``) supports a node when tables.py has an entry point
for its quantisation, that entry point's declaration and rule accept the target and the spec, and an adapter
exists for it (``adapter.ADAPTERS``); the plan's entry names the function and the adapter. An entry point
without an adapter is rejected with that reason, so no plan chooses a kernel that cannot be called.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch

from rubin_compile.kernels.flashinfer import attention, gemm, moe  # noqa: F401  (they register the adapters)
from rubin_compile.kernels.flashinfer import adapter as adapters
from rubin_compile.kernels.flashinfer.tables import (  # noqa: F401  (re-exported: tests and docs read them)
    ANY_CUDA,
    ATTENTION,
    CUTLASS_MOE_CCS,
    GEMM,
    MOE,
    KNOWN_CCS,
    PACKAGES,
    PRIORITIES,
    TABLES,
    EntryPoint,
    check_entry,
    check_target,
    declared_ccs,
    entry_point,
    resolve,
    _missing,
)
from rubin_compile.ops.registry import CANONICAL_OPS, QUANT_LABELS, Kernel, KernelSpec, Launch
from rubin_compile.target import Target


TESTED_ON_H200 = "runs, tested on H200"
CALL_CHECKED_SM100 = "call checked, needs sm_100+ hardware"
CALL_CHECKED = "call checked, not yet run on a GPU"
PLAN_ONLY = "plan only"


def status(op: str, kernel: str, quant: str) -> str:
    """How far the FlashInfer candidate for (op, kernel, quant) is verified, as docs/kernels/selection.md marks it:
    run and checked against the reference on the H200 (the adapter's ``tested_on``), its call built and checked
    against FlashInfer's signature and checks on the CPU only (sm_100+ kernels, or sm_90 ones not run yet), or a plan
    with no adapter."""
    adapter = adapters.adapter_for(op, kernel, quant)
    if adapter is None:
        return PLAN_ONLY
    if "H200" in adapter.tested_on:
        return TESTED_ON_H200
    entry = entry_point(op, kernel, quant)
    try:
        ccs = declared_ccs(entry)
    except Exception:  # FlashInfer missing or not importable: nothing to tell
        ccs = None
    if ccs is not None and 90 not in ccs:
        return CALL_CHECKED_SM100
    return CALL_CHECKED


def _supports(op: str, kernel: str) -> Callable[[Target, KernelSpec], Optional[str]]:
    def supports(target: Target, spec: KernelSpec) -> Optional[str]:
        entry = entry_point(op, kernel, spec.quant)
        if entry is None:
            have = [QUANT_LABELS[q] for q in TABLES[op][kernel]]
            what = QUANT_LABELS[spec.quant] if spec.quant != "none" else f"unquantised {spec.act_dtype}"
            return f"FlashInfer has no {kernel} {op} kernel for {what} (only {', '.join(have)})"
        reason = check_entry(entry, target, spec)
        if reason:
            return reason
        adapter = adapters.adapter_for(op, kernel, spec.quant)
        if adapter is None:
            return f"no adapter from rubin.{op} to {entry.describe()} in this version (plan only)"
        return adapter.supports(target, spec)

    return supports


def _runnable(op: str, kernel: str) -> Callable[[Target], Optional[str]]:
    """Whether this machine can run ``kernel`` for ``op`` at all: a CUDA GPU whose cc one of its entry
    points is declared for (dtype and shape were checked for the plan's target at compile time)."""

    def runnable(target: Target) -> Optional[str]:
        reasons = [check_target(e, target) for e in TABLES[op][kernel].values()]
        if None not in reasons:
            return reasons[0]
        if not torch.cuda.is_available():
            return "FlashInfer's kernels need a CUDA GPU and torch.cuda.is_available() is False"
        return None

    return runnable


def _entry(op: str, kernel: str) -> Callable[[KernelSpec], str]:
    def entry(spec: KernelSpec) -> str:
        e = entry_point(op, kernel, spec.quant)
        if e is None:
            return ""
        adapter = adapters.adapter_for(op, kernel, spec.quant)
        return f"{e.describe()} via adapter {adapter.name}" if adapter else f"{e.describe()} (no adapter: plan only)"

    return entry


def _pdl(op: str, kernel: str) -> Callable[[KernelSpec], Optional[str]]:
    """FlashInfer's own declaration: the entry function takes ``enable_pdl`` (read from its signature)."""

    def pdl(spec: KernelSpec) -> Optional[str]:
        entry = entry_point(op, kernel, spec.quant)
        if entry is None:
            return f"no {kernel} entry point for this spec"
        missing = _missing(entry)
        if missing:
            return f"cannot read whether {entry.describe()} takes enable_pdl: {missing}"
        for name in entry.functions:
            params = inspect.signature(resolve(name)).parameters
            if "enable_pdl" not in params:
                return f"{name} takes no enable_pdl argument"
        return None

    return pdl


def _run(op: str, kernel: str) -> Callable[..., torch.Tensor]:
    def run(args, launch: Launch = Launch()) -> torch.Tensor:
        quant = adapters.quant_of(op, args)
        adapter = adapters.adapter_for(op, kernel, quant)
        if adapter is None:  # selection never binds such a call; an impl given by hand gets the reason
            raise adapters.AdapterCheckError(
                f"rubin.{op}[{kernel}]: no adapter for {QUANT_LABELS.get(quant, quant)} in this version"
            )
        return adapters.run(adapter, args, launch)

    return run


for _op, _table in TABLES.items():
    for _kernel in _table:
        CANONICAL_OPS[_op].add_kernel(
            Kernel(
                _op,
                _kernel,
                _supports(_op, _kernel),
                PRIORITIES[(_op, _kernel)],
                run=_run(_op, _kernel),
                runnable=_runnable(_op, _kernel),
                entry=_entry(_op, _kernel),
                pdl=_pdl(_op, _kernel),
                module=__name__,
                prepared_bytes=functools.partial(adapters.prepared_bytes_of, _op, _kernel),
            )
        )
