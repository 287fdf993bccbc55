"""Kernel registry: the candidates for each canonical op, how one is chosen for a target, and how the
chosen kernel is found again when the compiled graph runs.

A **candidate** is one kernel that can run a canonical op (``rubin.moe``, later ``rubin.gemm`` and
``rubin.attention``): its name (the vLLM ``--moe-backend`` / ``--linear-backend`` spelling where there
is one), the provider module that implements it, ``supports(target, spec) -> None | reason`` (answered
from declarations, never by running anything, so a plan for sm_107 can be made on a laptop) and a
priority per target. ``select(spec, target)`` takes the supported candidate of highest priority and keeps
the reason of every one it rejected; ``select_kernels`` writes the choice into the node's ``impl`` argument.

``impl`` strings: ``"<kernel>"`` or ``"<kernel>@<target>"``, e.g. ``"flashinfer_trtllm@sm107"``. The
target is the one the plan was made for, so that ``implementation(op, impl)`` -- called by the op when it
runs -- can say which target and which kernel a machine cannot run (``KernelUnavailableError``) instead
of crashing inside a kernel. The reference kernel runs everywhere and is written without a target.

Providers (each imported only when one of its kernels is asked for, so Triton, FlashInfer, CuTe-DSL and
cuDNN are never imported at package import time)::

    reference   plain PyTorch, every op, every device; lowest priority on GPUs, the choice on the CPU
    torch       cuBLAS (torch.mm, torch._scaled_mm) and SDPA where they are the best available (torch_provider.py)
    triton      our fused Triton MoE kernels (rubin_compile.kernels.triton)
    vllm_cpu    vLLM's own CPU MoE kernel (``_C.cpu_fused_moe``) on the weights vLLM prepacked for it
                (vllm_cpu.py): the choice for vLLM's CPU MoE layers on a CPU
    flashinfer  FlashInfer 0.7.2 MoE / GEMM / attention entry points, gated by FlashInfer's own
                capability declarations (flashinfer.py)

The selection table that results is written out, with the source of every entry, in
docs/kernels/selection.md; tests/cpu/kernels/test_registry.py checks the registry against it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from rubin_compile import target as target_mod
from rubin_compile.options import CANONICAL_OPS
from rubin_compile.target import Target

# Quantisation schemes of a canonical op's weights (for attention: of the KV cache).
QUANTS: tuple[str, ...] = ("none", "fp8_tensor", "fp8_block", "nvfp4", "mxfp4")
QUANT_LABELS: dict[str, str] = {
    "none": "bf16", "fp8_tensor": "FP8 per-tensor", "fp8_block": "FP8 block 128x128",
    "nvfp4": "NVFP4", "mxfp4": "MXFP4",
}

# kernel name -> module that provides it. A provider module declares ``IMPLEMENTATIONS``: ``{op: fn}``
# when it has one kernel per op, or ``{(op, kernel): fn}`` when it has several.
PROVIDERS: dict[str, str] = {
    "reference": "rubin_compile.kernels.reference",
    "torch": "rubin_compile.kernels.torch_provider",
    "triton": "rubin_compile.kernels.triton",
    "vllm_cpu": "rubin_compile.kernels.vllm_cpu",
    "flashinfer_cutlass": "rubin_compile.kernels.flashinfer",
    "flashinfer_trtllm": "rubin_compile.kernels.flashinfer",
    "flashinfer_cutedsl": "rubin_compile.kernels.flashinfer",
    "flashinfer_cudnn": "rubin_compile.kernels.flashinfer",
    "flashinfer_fa2": "rubin_compile.kernels.flashinfer",
    "flashinfer_fa3": "rubin_compile.kernels.flashinfer",
}


class KernelUnavailableError(RuntimeError):
    """A compiled graph asks for a kernel this machine cannot run."""


class UnknownKernelError(ValueError):
    """A kernel name (e.g. in ``options["kernels"]``) that no candidate of the op has."""


@dataclass(frozen=True)
class KernelSpec:
    """What kernel selection knows of one canonical node.

    Parameters
    ----------
    op:
        ``"moe"``, ``"gemm"`` or ``"attention"``.
    quant:
        Weights' (attention: KV cache's) quantisation: ``"none"``, ``"fp8_tensor"`` (one scale per tensor
        or per expert), ``"fp8_block"`` (``block_shape`` scales, 128x128 in checkpoints), ``"nvfp4"``,
        ``"mxfp4"``.
    act_dtype, weight_dtype:
        ``torch`` dtype names (``"bfloat16"``, ``"float8_e4m3fn"``, ...) of the activations (hidden states,
        A, the query) and of the weights (B, the KV cache) as stored.
    shape:
        Named sizes: MoE ``E, H, I, k`` (``T`` when static); GEMM ``M, N, K``; attention ``D`` (head dim).
    weight_layout:
        How the weights are stored (``rubin.moe``'s ``weight_layout``: ``"plain"``, ``"vllm_cpu:<isa>"``).
    """

    op: str
    quant: str = "none"
    act_dtype: str = "bfloat16"
    weight_dtype: str = "bfloat16"
    block_shape: Optional[tuple[int, ...]] = None
    shape: tuple[tuple[str, int], ...] = ()
    activation: Optional[str] = None
    node: str = ""
    weight_layout: str = "plain"

    def dim(self, name: str) -> Optional[int]:
        return dict(self.shape).get(name)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shape"] = dict(self.shape)
        out["block_shape"] = list(self.block_shape) if self.block_shape else None
        return out

    def describe(self) -> str:
        parts = [QUANT_LABELS.get(self.quant, self.quant) if self.quant != "none" else self.act_dtype]
        if self.quant != "none":
            parts.append(f"act {self.act_dtype}")
        if self.block_shape:
            parts.append("block " + "x".join(map(str, self.block_shape)))
        parts += [f"{k}={v}" for k, v in self.shape]
        if self.activation:
            parts.append(self.activation)
        if self.weight_layout != "plain":
            parts.append(f"weights {self.weight_layout}")
        return " ".join(parts)


def example_spec(op: str, quant: str) -> KernelSpec:
    """A representative, well-aligned spec of ``op`` in ``quant`` (BF16 activations): the row of the
    selection table in docs/kernels/selection.md."""
    weight = {"none": "bfloat16", "fp8_tensor": "float8_e4m3fn", "fp8_block": "float8_e4m3fn",
              "nvfp4": "float4_e2m1fn_x2", "mxfp4": "float4_e2m1fn_x2"}[quant]
    block = (128, 128) if quant == "fp8_block" else None
    shape = {"moe": (("E", 128), ("H", 4096), ("I", 1536), ("k", 8)),
             "gemm": (("M", 128), ("N", 4096), ("K", 4096)),
             "attention": (("D", 128),)}[op]
    return KernelSpec(op, quant, "bfloat16", weight, block, shape, "silu" if op == "moe" else None)


@dataclass(frozen=True)
class Candidate:
    """One kernel that can run canonical op ``op``.

    ``priority`` maps ``"<target>:<quant>"``, ``"<target>"``, ``"*:<quant>"`` or ``"*"`` (looked up in
    that order) to a number; the supported candidate with the highest wins. ``runnable(target)`` says
    whether this machine (``target.detect()``) can run it at all, for providers whose module imports
    without a GPU; ``None`` leaves that to the provider module's import. ``entry(spec)`` names what runs.
    ``layouts``: the weight layouts it reads (their part before ":"; ``"*"``: any).
    ``pdl(spec)``: ``None`` when the kernel may be launched with Programmatic Dependent Launch for ``spec``
    (it waits, ``griddepcontrol.wait``, before touching anything its predecessor writes or reads, and its
    adapter takes ``pdl=``), else why not; a candidate without ``pdl`` is never launched with it.
    ``placements``: the locality placements its adapter runs (``"split_n"``; passes/place_locality.py).
    """

    op: str
    name: str
    supports: Callable[[Target, KernelSpec], Optional[str]]
    priority: Mapping[str, int]
    runnable: Optional[Callable[[Target], Optional[str]]] = None
    entry: Callable[[KernelSpec], str] = lambda spec: ""
    provider: str = ""
    layouts: tuple[str, ...] = ("plain",)
    pdl: Optional[Callable[[KernelSpec], Optional[str]]] = None
    placements: tuple[str, ...] = ()

    def pdl_unsupported(self, spec: KernelSpec) -> Optional[str]:
        """Why ``spec`` on this kernel cannot be launched with PDL; ``None`` when it can."""
        if self.pdl is None:
            return f"{self.name} takes no PDL launch (its kernels do not wait on griddepcontrol)"
        try:
            return self.pdl(spec)
        except Exception as exc:  # a provider's declaration could not be read: no PDL, say why
            return f"could not check PDL support: {type(exc).__name__}: {exc}"

    def __post_init__(self) -> None:
        if not self.provider:
            object.__setattr__(self, "provider", PROVIDERS[self.name])

    def rank(self, target: Target, spec: KernelSpec) -> int:
        for key in (f"{target.name}:{spec.quant}", target.name, f"*:{spec.quant}", "*"):
            if key in self.priority:
                return self.priority[key]
        return 0

    def check(self, target: Target, spec: KernelSpec) -> Optional[str]:
        """``supports``, with a declaration that fails turned into a reason (selection never crashes)."""
        family = spec.weight_layout.split(":", 1)[0]
        if "*" not in self.layouts and family not in self.layouts:
            readable = " / ".join(repr(x if x == "plain" else f"{x}:<isa>") for x in self.layouts)
            return f"weights stored in layout {spec.weight_layout!r}; {self.name} reads only {readable}"
        try:
            return self.supports(target, spec)
        except Exception as exc:  # a provider's declaration could not be read: reject, say why
            return f"could not check support: {type(exc).__name__}: {exc}"


@dataclass
class Selection:
    """The decision for one node: the chosen candidate and why each other one lost."""

    spec: KernelSpec
    target: Target
    chosen: Candidate
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (kernel, reason), highest priority first
    outranked: list[str] = field(default_factory=list)  # supported, but of lower priority
    forced: Optional[str] = None
    forced_reason: Optional[str] = None  # why the forced kernel was not used

    @property
    def impl(self) -> str:
        return format_impl(self.chosen.name, self.target)


def format_impl(kernel: str, target: Target) -> str:
    """The ``impl`` argument for ``kernel`` chosen for ``target`` (see the module docstring)."""
    return kernel if kernel == "reference" else f"{kernel}@{target.name}"


def parse_impl(impl: str) -> tuple[str, Optional[str]]:
    kernel, _, planned = impl.partition("@")
    return kernel, planned or None


# ------------------------------------------------------------------------------------------------
# the candidates
# ------------------------------------------------------------------------------------------------


def _package_missing(module: str, pip_name: str) -> Optional[str]:
    if importlib.util.find_spec(module) is None:
        return f"package {pip_name} is not installed"
    return None


def _reference_supports(target: Target, spec: KernelSpec) -> Optional[str]:
    return None


_TRITON_MOE_ACTS = ("bfloat16", "float16")


def _triton_moe_supports(target: Target, spec: KernelSpec) -> Optional[str]:
    """Our fused Triton MoE (kernels/triton/moe.py): BF16 / FP16 activations; unquantised, FP8 per-tensor
    (or per-expert) and FP8 block-scaled weights; sm_90 and newer (PDL, TMA-era tensor cores)."""
    if not target.is_cuda:
        return f"target {target.name} has no CUDA GPU"
    if target.cc < 90:
        return f"the Triton MoE kernels are built for sm_90 and newer; {target.name} is cc {target.cc}"
    if spec.quant not in ("none", "fp8_tensor", "fp8_block"):
        return f"{QUANT_LABELS[spec.quant]} weights are not supported (bf16 / fp16, FP8 per-tensor or block)"
    if spec.act_dtype not in _TRITON_MOE_ACTS:
        return f"activations in {spec.act_dtype} are not supported (bf16 / fp16)"
    return _package_missing("triton", "triton")


@functools.lru_cache(maxsize=1)
def _all_candidates() -> tuple[Candidate, ...]:
    from rubin_compile.kernels import flashinfer, torch_provider, vllm_cpu

    out: list[Candidate] = [
        Candidate(op, "reference", _reference_supports, {"*": 0},
                  entry=lambda spec, op=op: f"rubin_compile.kernels.reference ({op})", layouts=("*",))
        for op in CANONICAL_OPS
    ]
    # Priorities mirror vLLM's MoE backend order (vllm/model_executor/layers/fused_moe/oracle/): on
    # Blackwell FlashInfer first and Triton after it; on Hopper Triton first (see docs/kernels/selection.md).
    out.append(Candidate("moe", "triton", _triton_moe_supports, {"*": 10, "sm90": 30},
                         entry=lambda spec: "rubin_compile.kernels.triton.moe.fused_moe",
                         pdl=lambda spec: None, placements=("split_n",)))
    out += torch_provider.candidates()
    out += vllm_cpu.candidates()
    out += flashinfer.candidates()
    return tuple(out)


def candidates(op: str) -> list[Candidate]:
    """Every candidate of canonical op ``op``, in declaration order."""
    if op not in CANONICAL_OPS:
        raise UnknownKernelError(f"unknown canonical op {op!r}; the ops are {list(CANONICAL_OPS)}")
    return [c for c in _all_candidates() if c.op == op]


def candidate(op: str, name: str) -> Candidate:
    for c in candidates(op):
        if c.name == name:
            return c
    raise UnknownKernelError(
        f"unknown kernel {name!r} for rubin.{op}; its kernels are {[c.name for c in candidates(op)]}"
    )


def select(spec: KernelSpec, target: Target, forced: Optional[str] = None, runs_here: bool = False) -> Selection:
    """Choose the kernel for ``spec`` on ``target``: ``forced`` if it supports them, else the supported
    candidate of highest priority. Every candidate is asked, so the plan lists why each one lost.

    ``runs_here``: the graph will run on this machine (the target is the detected one), so a candidate
    this version cannot run here (no adapter from the canonical op yet, its package or GPU missing) is
    rejected with that reason instead of being chosen and failing at run time. Plans for other targets
    keep following the declarations alone, which is what docs/kernels/selection.md documents."""
    ordered = sorted(candidates(spec.op), key=lambda c: -c.rank(target, spec))  # stable: ties keep order
    reasons = {c.name: c.check(target, spec) for c in ordered}
    if runs_here:
        for c in ordered:
            if reasons[c.name] is None:
                reasons[c.name] = _cannot_run_here(c, spec.op)
    forced_reason = None
    chosen: Optional[Candidate] = None
    if forced is not None:
        forced_c = candidate(spec.op, forced)
        forced_reason = reasons[forced_c.name]
        if forced_reason is None:
            chosen = forced_c
    if chosen is None:
        chosen = next((c for c in ordered if reasons[c.name] is None), None)
    if chosen is None:  # the reference supports everything; reaching this is a bug in a declaration
        raise RuntimeError(f"rubin.{spec.op}: no kernel supports {spec.describe()} on {target.name}: {reasons}")
    rejected = [(c.name, reasons[c.name]) for c in ordered if reasons[c.name] is not None]
    outranked = [c.name for c in ordered if reasons[c.name] is None and c is not chosen]
    return Selection(spec, target, chosen, rejected, outranked, forced, forced_reason)


def _cannot_run_here(cand: Candidate, op: str) -> Optional[str]:
    """Why this machine cannot run ``cand`` for ``op`` (None when it can): the run-time lookup of
    ``implementation``, asked ahead of time."""
    return _lookup(op, cand, target_mod.detect())[1]


# ------------------------------------------------------------------------------------------------
# run time
# ------------------------------------------------------------------------------------------------


def implementation(op: str, impl: str) -> Callable:
    """Return the callable that runs canonical op ``op`` with ``impl`` (``"<kernel>[@<target>]"``).

    Raises ``KernelUnavailableError`` -- naming the kernel and the target the plan was made for -- when
    this machine cannot run it: a plan for sm107 executed on a CPU, a missing package, a kernel whose
    adapter this version does not have.
    """
    kernel, planned = parse_impl(impl)
    try:
        cand = candidate(op, kernel)
    except UnknownKernelError as exc:
        raise KernelUnavailableError(f"rubin.{op}: {exc}") from exc
    here = target_mod.detect()
    fn, reason = _lookup(op, cand, here)
    if fn is None:
        raise KernelUnavailableError(_cannot_run(op, kernel, planned, here, reason))
    return fn


def _lookup(op: str, cand: Candidate, here: Target) -> tuple[Optional[Callable], Optional[str]]:
    """(the callable running ``op`` with ``cand`` on this machine, None) or (None, why it cannot run)."""
    if cand.runnable is not None:
        reason = cand.runnable(here)
        if reason is not None:
            return None, reason
    try:
        module = importlib.import_module(cand.provider)
    except ImportError as exc:  # an optional package of that provider is missing, or no GPU here
        return None, str(exc)
    impls = getattr(module, "IMPLEMENTATIONS", {})
    fn = impls.get((op, cand.name)) or impls.get(op)
    if fn is None:
        return None, (f"this version of rubin_compile has no adapter from rubin.{op} to {cand.name} yet "
                      f"({cand.provider} declares it for plans only)")
    return fn, None


def _cannot_run(op: str, kernel: str, planned: Optional[str], here: Target, reason: str) -> str:
    plan = f"compiled for target {planned}" if planned else "compiled"
    return (
        f"rubin.{op}: this graph was {plan} with kernel {kernel!r}, which cannot run on this machine "
        f"(target {here.name}): {reason}. Compile for this machine (leave options['target'] / RUBIN_TARGET "
        f"unset), force another kernel with options={{'kernels': {{'{op}': ...}}}}, or run it on "
        f"{'a ' + planned + ' GPU' if planned else 'a machine that has the kernel'}."
    )
