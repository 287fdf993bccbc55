"""The canonical ops, the kernels registered onto each, and how one kernel is chosen for a target.

A **canonical op** (``CanonicalOp``: ``rubin.moe``, ``rubin.gemm``, ``rubin.attention``) is defined in its own
module of ``ops/``: its torch.library schema, its argument dataclass, its reference semantics, the spec
builder that tells selection what a node of it is (``KernelSpec``) and, where there is one, its ATen form.
The op knows nothing of its implementations. A **kernel** registers onto the op, the torch.library way, from
its own module in ``kernels/`` (``OP.register_kernel(...)`` on its adapter): the capability check
``supports(target, spec) -> None | reason`` (answered from declarations, never by running anything, so a
plan for sm_107 can be made on a laptop), a priority per target, what it runs on this machine
(``runnable``), its PDL and split-N abilities, and the adapter ``run(args, launch)``. Kernels depend on ops,
never the reverse.

``CanonicalOp.select(spec, target)`` takes the supported kernel of highest priority and keeps the reason of
every one it rejected; select_kernels writes the choice into the node's ``impl`` argument, and the op finds
the kernel again by that name when the compiled graph runs (``CanonicalOp.run``).

``impl`` strings: ``"<kernel>"`` or ``"<kernel>@<target>"``, e.g. ``"flashinfer_trtllm@sm107"``. The target
is the one the plan was made for, so that a machine that cannot run the kernel says which target and which
kernel (``KernelUnavailableError``) instead of crashing inside a kernel. The reference kernel runs
everywhere; in a plan for the CPU it is written without a target, in a plan for a GPU with it (so the passes
after selection reason about the GPU the plan is for).

Launch settings (``Launch``: PDL on or off, a locality ``Placement``) say how a kernel is launched, never what
it computes; a kernel that declares neither runs without them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from rubin_compile import target as target_mod
from rubin_compile.errors import RubinError
from rubin_compile.ops.nodes import bound_arguments, device_type, schema_name
from rubin_compile.target import Target, locality_mode

# Quantisation schemes of a canonical op's weights (for attention: of the KV cache).
QUANTS: tuple[str, ...] = ("none", "fp8_tensor", "fp8_block", "nvfp4", "mxfp4")
QUANT_LABELS: dict[str, str] = {
    "none": "bf16",
    "fp8_tensor": "FP8 per-tensor",
    "fp8_block": "FP8 block 128x128",
    "fp8_rowwise": "FP8 per-row / per-column",  # rubin.gemm's per-token / per-channel scales
    "nvfp4": "NVFP4",
    "mxfp4": "MXFP4",
}
_EXAMPLE_WEIGHT_DTYPE = {
    "none": "bfloat16",
    "fp8_tensor": "float8_e4m3fn",
    "fp8_block": "float8_e4m3fn",
    "nvfp4": "float4_e2m1fn_x2",
    "mxfp4": "float4_e2m1fn_x2",
}


class KernelUnavailableError(RubinError, RuntimeError):
    """A compiled graph asks for a kernel this machine cannot run."""


class UnknownKernelError(RubinError, ValueError):
    """A kernel name (e.g. in ``options["kernels"]``) that no kernel of the op has, or an unknown op."""


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
        How the weights are stored (``rubin.moe``'s ``weight_layout``: ``"plain"``, ``"vllm_cpu:<isa>[:vnni]"``).
    features:
        Optional semantics the node uses that only kernels declaring them implement (``rubin.moe``:
        ``"router_weight_on_input"``, ``"runtime_activation_constants"``; ``Kernel.features``).
    static_input_scales:
        The node carries static activation scales (``rubin.moe``'s ``a13_scale`` / ``a2_scale``, ``rubin.gemm``'s
        ``a_scale`` with FP4 weights): what W8A8 / W4A4 kernels that quantise activations statically need.
    has_bias:
        The node adds biases (``rubin.moe``'s ``w13_bias`` / ``w2_bias``), which some kernels do not take.
    baseline:
        What computes the node where rubin's kernel does not, for a kernel that chooses per call size between itself
        and it (``rubin.moe``: ``"aten"``, its ATen form; vLLM's MoE layer op: ``"vllm"``, vLLM's own fused MoE;
        kernels/triton/moe_choice.py). ``""``: none.
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
    features: tuple[str, ...] = ()
    static_input_scales: bool = False
    has_bias: bool = False
    baseline: str = ""

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


# ------------------------------------------------------------------------------------------------
# launch settings
# ------------------------------------------------------------------------------------------------

PLACEMENT_KIND = "split_n"


@dataclass(frozen=True)
class Placement:
    """A locality placement (the op's ``placement`` argument, set by passes/place_locality.py): the call runs
    split-N over ``domains`` locality domains in ``mode`` ("default" / "backfill") when it has at most
    ``max_tokens`` tokens, whole otherwise. The op schema keeps the string form, ``encode()``."""

    mode: str
    domains: int
    max_tokens: int
    kind: str = PLACEMENT_KIND

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", locality_mode(self.mode))

    def encode(self) -> str:
        return f"{self.kind}:{self.mode}:{self.domains}:{self.max_tokens}"

    @staticmethod
    def decode(text: str) -> Optional["Placement"]:
        """``"split_n:<mode>:<domains>:<max_tokens>"`` -> a ``Placement``; ``""`` -> ``None``."""
        if not text:
            return None
        parts = text.split(":")
        if len(parts) != 4 or parts[0] != PLACEMENT_KIND or not parts[2].isdigit() or not parts[3].isdigit():
            raise ValueError(
                f"rubin.moe: placement {text!r} is not '' or "
                f"'{PLACEMENT_KIND}:<default|backfill>:<domains>:<max_tokens>'"
            )
        return Placement(parts[1], int(parts[2]), int(parts[3]))

    def applies(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` tokens runs split (decode-sized) or whole."""
        return tokens <= self.max_tokens


@dataclass(frozen=True)
class Launch:
    """How a kernel is launched: Programmatic Dependent Launch, and a locality placement (or none)."""

    pdl: bool = False
    placement: Optional[Placement] = None

    @staticmethod
    def decode(pdl: bool, placement: str) -> "Launch":
        return Launch(bool(pdl), Placement.decode(placement))


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    """One kernel that can run canonical op ``op``.

    ``priority`` maps ``"<target>:<quant>"``, ``"<target>"``, ``"*:<quant>"`` or ``"*"`` (looked up in that
    order) to a number; the supported kernel with the highest wins. ``runnable(target)`` says whether this
    machine (``target.detect()``) can run it at all. ``entry(spec)`` names what runs. ``layouts``: the weight
    layouts it reads (their family, the part before ":"; ``"*"``: any). ``pdl(spec)``: ``None`` when the
    kernel may be launched with Programmatic Dependent Launch for ``spec`` (it waits, ``griddepcontrol.wait``,
    before touching anything its predecessor writes or reads, and its adapter honours ``Launch.pdl``), else
    why not; a kernel without ``pdl`` is never launched with it. ``placements``: the locality placements its
    adapter runs (``"split_n"``). ``run(args, launch)``: the adapter from the op's argument dataclass; ``None``
    for a kernel declared for plans only (no adapter yet). ``module``: where it is registered. ``graphs_only(spec)``:
    why ``spec`` should run on this kernel only when the graph is replayed from CUDA graphs (its host cost per call
    exceeds what it saves on the GPU otherwise), or ``None``; a kernel without it runs either way. ``features``:
    the op's optional semantics it implements (``KernelSpec.features``; ``"*"``: all); a node that uses one it
    lacks is rejected with that reason. ``in_graph``: the adapter only allocates with torch and launches Triton
    kernels through ``kernels/triton/launch.launcher``, with a launch configuration that depends on static sizes
    alone, so passes/inline_kernels.py may trace its launches into the graph (Inductor then launches them).
    """

    op: str
    name: str
    supports: Callable[[Target, KernelSpec], Optional[str]]
    priority: Mapping[str, int]
    run: Optional[Callable[..., torch.Tensor]] = None
    runnable: Optional[Callable[[Target], Optional[str]]] = None
    entry: Callable[[KernelSpec], str] = lambda spec: ""
    layouts: tuple[str, ...] = ("plain",)
    pdl: Optional[Callable[[KernelSpec], Optional[str]]] = None
    placements: tuple[str, ...] = ()
    module: str = ""
    graphs_only: Optional[Callable[[KernelSpec], Optional[str]]] = None
    features: tuple[str, ...] = ()
    in_graph: bool = False
    # bytes the kernel keeps for a node's weights in its own layout (prepared once, like rubin.stacked_weights), for
    # the plan; None: none, or unknown
    prepared_bytes: Optional[Callable[[torch.fx.Node], Optional[int]]] = None

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
        missing = self.missing_features(spec.features)
        if missing:
            return f"{self.name} does not implement {', '.join(missing)}"
        try:
            return self.supports(target, spec)
        except Exception as exc:  # a provider's declaration could not be read: reject, say why
            return f"could not check support: {type(exc).__name__}: {exc}"

    def missing_features(self, features: tuple[str, ...]) -> list[str]:
        """The ones of ``features`` this kernel does not implement."""
        return [] if "*" in self.features else [f for f in features if f not in self.features]

    def pdl_unsupported(self, spec: KernelSpec) -> Optional[str]:
        """Why ``spec`` on this kernel cannot be launched with PDL; ``None`` when it can."""
        if self.pdl is None:
            return f"{self.name} takes no PDL launch (its kernels do not wait on griddepcontrol)"
        try:
            return self.pdl(spec)
        except Exception as exc:  # a provider's declaration could not be read: no PDL, say why
            return f"could not check PDL support: {type(exc).__name__}: {exc}"

    def launch_for(self, launch: Launch) -> Launch:
        """``launch`` without what this kernel does not take: it runs without them (the op's contract)."""
        pdl = launch.pdl and self.pdl is not None
        placement = launch.placement if launch.placement and launch.placement.kind in self.placements else None
        return launch if (pdl, placement) == (launch.pdl, launch.placement) else Launch(pdl, placement)

    def unavailable_here(self, here: Target) -> Optional[str]:
        """Why this machine (``here``) cannot run the kernel; ``None`` when it can."""
        if self.runnable is not None:
            reason = self.runnable(here)
            if reason is not None:
                return reason
        if self.run is None:
            return (
                f"this version of rubin_compile has no adapter from rubin.{self.op} to {self.name} yet "
                f"({self.module} declares it for plans only)"
            )
        return None


@dataclass
class Selection:
    """The decision for one node: the chosen kernel and why each other one lost."""

    spec: KernelSpec
    target: Target
    chosen: Kernel
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (kernel, reason), highest priority first
    outranked: list[str] = field(default_factory=list)  # supported, but of lower priority
    forced: Optional[str] = None
    forced_reason: Optional[str] = None  # why the forced kernel was not used

    @property
    def impl(self) -> str:
        return format_impl(self.chosen.name, self.target)


def format_impl(kernel: str, target: Target) -> str:
    """The ``impl`` argument for ``kernel`` chosen for ``target`` (see the module docstring)."""
    return kernel if kernel == "reference" and not target.is_cuda else f"{kernel}@{target.name}"


def parse_impl(impl: str) -> tuple[str, Optional[str]]:
    kernel, _, planned = impl.partition("@")
    return kernel, planned or None


# ------------------------------------------------------------------------------------------------
# canonical ops
# ------------------------------------------------------------------------------------------------

SpecBuilder = Callable[[torch.fx.Node], KernelSpec]

# Every canonical op by name, in definition order (moe, gemm, attention): the ops a kernel can register onto.
CANONICAL_OPS: dict[str, "CanonicalOp"] = {}


class CanonicalOp:
    """A canonical op as selection and the runtime see it.

    Parameters
    ----------
    name:
        ``"moe"``: the op is ``torch.ops.rubin.<name>``.
    spec:
        Builds the ``KernelSpec`` of a node of the op from its arguments and fake values.
    reference:
        The op's semantics, ``reference(args, launch) -> Tensor`` on its argument dataclass: the ``reference``
        kernel (kernels/reference.py registers it onto every op).
    aten_form:
        The op as ATen ops, ``fn(**arguments) -> Tensor`` (``None`` when it has none); select_kernels lowers a
        node bound to ``torch`` / ``reference`` into it, so Inductor fuses and tunes it as without rubin.
    aten_declines:
        ``fn(target, **arguments) -> Optional[str]``: why the ATen form cannot express a call on ``target``
        (``None`` when it can; no callable: it expresses every call). A node it declines stays an op call, with
        the reason in the report.
    aten_label:
        What the ATen form is, for reports ("mm / addmm / _scaled_mm + epilogue").
    example_shape:
        Representative, well-aligned named sizes: the rows of the selection table (docs/kernels/selection.md).
    """

    def __init__(
        self,
        name: str,
        spec: SpecBuilder,
        reference: Callable[..., torch.Tensor],
        *,
        aten_form: Optional[Callable[..., torch.Tensor]] = None,
        aten_declines: Optional[Callable[..., Optional[str]]] = None,
        aten_label: str = "ATen",
        example_shape: tuple[tuple[str, int], ...] = (),
        example_activation: Optional[str] = None,
    ) -> None:
        if name in CANONICAL_OPS:
            raise ValueError(f"canonical op {name!r} is defined twice")
        self.name = name
        self.reference = reference
        self.aten_form = aten_form
        self.aten_declines = aten_declines
        self.aten_label = aten_label
        self.example_shape = example_shape
        self.example_activation = example_activation
        # schema name -> spec builder: the op itself, and ops that run its kernels without being it (the vLLM
        # MoE layer ops, integrations/vllm/layer_ops.py, run rubin.moe's kernels on the weights of a vLLM layer).
        self.forms: dict[str, SpecBuilder] = {f"rubin::{name}": spec}
        self._kernels: dict[str, Kernel] = {}
        CANONICAL_OPS[name] = self

    def __repr__(self) -> str:
        return f"CanonicalOp(rubin.{self.name}, kernels={list(self._kernels)})"

    # registration ------------------------------------------------------------------------------

    def register_kernel(
        self,
        name: str,
        *,
        supports: Callable[[Target, KernelSpec], Optional[str]],
        priority: Mapping[str, int],
        runnable: Optional[Callable[[Target], Optional[str]]] = None,
        entry: Callable[[KernelSpec], str] = lambda spec: "",
        layouts: tuple[str, ...] = ("plain",),
        pdl: Optional[Callable[[KernelSpec], Optional[str]]] = None,
        placements: tuple[str, ...] = (),
        module: Optional[str] = None,
        graphs_only: Optional[Callable[[KernelSpec], Optional[str]]] = None,
        features: tuple[str, ...] = (),
        in_graph: bool = False,
    ) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
        """Decorator: register the decorated adapter ``run(args, launch)`` as kernel ``name`` of this op
        (``module``: the registering module, for messages; the adapter's own by default)."""

        def register(run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            self.add_kernel(
                Kernel(
                    self.name,
                    name,
                    supports,
                    priority,
                    run,
                    runnable,
                    entry,
                    layouts,
                    pdl,
                    placements,
                    module or run.__module__,
                    graphs_only,
                    features,
                    in_graph,
                )
            )
            return run

        return register

    def add_kernel(self, kernel: Kernel) -> None:
        """Register ``kernel`` (one declared for plans only has ``run=None``). A module imported again (a reload)
        replaces its own registration; two modules registering one name is an error."""
        if kernel.op != self.name:
            raise ValueError(f"kernel {kernel.name!r} is for rubin.{kernel.op}, not rubin.{self.name}")
        if kernel.name in self._kernels and self._kernels[kernel.name].module != kernel.module:
            raise ValueError(
                f"rubin.{self.name}: kernel {kernel.name!r} is registered twice "
                f"({self._kernels[kernel.name].module}, {kernel.module})"
            )
        self._kernels[kernel.name] = kernel

    def add_form(self, schema: str, spec: SpecBuilder) -> None:
        """Declare that op ``schema`` ("namespace::name") runs this op's kernels, selected by its ``impl``
        argument, with ``spec`` building its ``KernelSpec``."""
        self.forms[schema] = spec

    # lookup ------------------------------------------------------------------------------------

    def kernels(self) -> list[Kernel]:
        """Every kernel of the op, in registration order."""
        return list(self._kernels.values())

    def kernel(self, name: str) -> Kernel:
        try:
            return self._kernels[name]
        except KeyError:
            raise UnknownKernelError(
                f"unknown kernel {name!r} for rubin.{self.name}; its kernels are {list(self._kernels)}"
            ) from None

    def example_spec(self, quant: str) -> KernelSpec:
        """A representative spec of the op in ``quant`` (bf16 activations; NVFP4 with a checkpoint's static activation
        scales): a row of the selection table."""
        block = (128, 128) if quant == "fp8_block" else None
        return KernelSpec(
            self.name,
            quant,
            "bfloat16",
            _EXAMPLE_WEIGHT_DTYPE[quant],
            block,
            self.example_shape,
            self.example_activation,
            # NVFP4 checkpoints (ModelOpt) carry static activation scales, which W4A4 kernels need
            static_input_scales=quant == "nvfp4" and self.name != "attention",
        )

    # selection ---------------------------------------------------------------------------------

    def select(
        self,
        spec: KernelSpec,
        target: Target,
        forced: Optional[str] = None,
        runs_here: bool = False,
        cudagraphs: Optional[bool] = None,
    ) -> Selection:
        """Choose the kernel for ``spec`` on ``target``: ``forced`` if it supports them, else the supported
        kernel of highest priority. Every kernel is asked, so the plan lists why each one lost.

        ``runs_here``: the graph will run on this machine (the target is the detected one), so a kernel this
        machine cannot run (no adapter yet, its package or GPU missing) is rejected with that reason instead
        of being chosen and failing at run time. Plans for other targets follow the declarations alone,
        which is what docs/kernels/selection.md documents.

        ``cudagraphs``: whether the graph is replayed from CUDA graphs (``False`` rejects a kernel's
        ``graphs_only`` specs with its reason; ``None``, unknown: declarations alone)."""
        ordered = sorted(self._kernels.values(), key=lambda k: -k.rank(target, spec))  # stable: ties keep order
        reasons = {k.name: k.check(target, spec) for k in ordered}
        if cudagraphs is False:
            for k in ordered:
                if reasons[k.name] is None and k.graphs_only is not None:
                    why = k.graphs_only(spec)
                    if why is not None:
                        reasons[k.name] = f"the graph does not run under CUDA graphs: {why}"
        if runs_here:
            here = target_mod.detect()
            for k in ordered:
                if reasons[k.name] is None:
                    reasons[k.name] = k.unavailable_here(here)
        forced_reason = None
        chosen: Optional[Kernel] = None
        if forced is not None:
            forced_kernel = self.kernel(forced)
            forced_reason = reasons[forced_kernel.name]
            if forced_reason is None:
                chosen = forced_kernel
        if chosen is None:
            chosen = next((k for k in ordered if reasons[k.name] is None), None)
        if chosen is None:  # the reference supports everything; reaching this is a bug in a declaration
            raise RuntimeError(f"rubin.{self.name}: no kernel supports {spec.describe()} on {target.name}: {reasons}")
        rejected = [(k.name, reasons[k.name]) for k in ordered if reasons[k.name] is not None]
        outranked = [k.name for k in ordered if reasons[k.name] is None and k is not chosen]
        return Selection(spec, target, chosen, rejected, outranked, forced, forced_reason)

    # run time ----------------------------------------------------------------------------------

    def run(self, impl: str, args: Any, launch: Launch = Launch()) -> torch.Tensor:
        """Run kernel ``impl`` (``"<kernel>[@<target>]"``) on ``args`` (the op's argument dataclass).

        Raises ``KernelUnavailableError`` -- naming the kernel and the target the plan was made for -- when
        this machine cannot run it: a plan for sm107 executed on a CPU, a missing package, a kernel whose
        adapter this version does not have.
        """
        kernel_name, planned = parse_impl(impl)
        try:
            kernel = self.kernel(kernel_name)
        except UnknownKernelError as exc:
            raise KernelUnavailableError(f"rubin.{self.name}: {exc}") from exc
        here = target_mod.detect()
        reason = kernel.unavailable_here(here)
        if reason is not None:
            plan = f"compiled for target {planned}" if planned else "compiled"
            raise KernelUnavailableError(
                f"rubin.{self.name}: this graph was {plan} with kernel {kernel_name!r}, which cannot run on this "
                f"machine (target {here.name}): {reason}. Compile for this machine (leave options['target'] / "
                f"RUBIN_TARGET unset), force another kernel with options={{'kernels': {{'{self.name}': ...}}}}, "
                f"or run it on {'a ' + planned + ' GPU' if planned else 'a machine that has the kernel'}."
            )
        missing = kernel.missing_features(tuple(getattr(args, "features", ())))
        if missing:  # impl given by hand (selection never binds such a kernel): refuse rather than compute another op
            raise KernelUnavailableError(
                f"rubin.{self.name}: kernel {kernel_name!r} does not implement {', '.join(missing)}, which this call "
                "uses; use impl='reference' or a kernel that declares it"
            )
        return kernel.run(args, kernel.launch_for(launch))


def op_of(name: str) -> CanonicalOp:
    """The canonical op called ``name`` (``"moe"``); ``UnknownKernelError`` listing the ops otherwise."""
    try:
        return CANONICAL_OPS[name]
    except KeyError:
        raise UnknownKernelError(f"unknown canonical op {name!r}; the ops are {list(CANONICAL_OPS)}") from None


def canonical_form(node: torch.fx.Node) -> Optional[tuple[CanonicalOp, SpecBuilder]]:
    """For a node that runs a canonical op's kernels (the op itself, or a form added with ``add_form``): the op
    and the spec builder of the node's form; ``None`` for any other node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    name = schema_name(node.target)
    for op in CANONICAL_OPS.values():
        if name in op.forms:
            return op, op.forms[name]
    return None


@dataclass(frozen=True)
class BoundKernel:
    """A canonical node after select_kernels: its op, the kernel it is bound to, the target the plan was
    made for, and the node's spec."""

    op: CanonicalOp
    kernel: Kernel
    target: Target
    spec: KernelSpec


def bound_kernel(node: torch.fx.Node, default_target: Optional[Target]) -> Optional[BoundKernel]:
    """The kernel a canonical node is bound to, read back from its ``impl`` argument (so later passes work on
    graphs that went through selection in another process too); ``None`` for any other node.

    ``default_target``: the target of a node whose ``impl`` names none (the reference kernel planned for the CPU,
    or a node selection has not seen) when its tensors live on a GPU; a node on the CPU is planned for the CPU."""
    form = canonical_form(node)
    if form is None:
        return None
    op, spec = form
    kernel_name, planned = parse_impl(bound_arguments(node).get("impl") or "reference")
    try:
        kernel = op.kernel(kernel_name)
    except UnknownKernelError:
        return None
    if planned is not None:
        target = target_mod.resolve(planned)
        here = target_mod.detect()
        if here.name == target.name:
            target = here  # this machine's own SM count and name
    elif default_target is None or device_type(node) in (None, "cpu"):
        target = target_mod.resolve("cpu")
    else:  # an impl without a target: the CPU's reference, or a node selection has not bound
        target = default_target
    return BoundKernel(op, kernel, target, spec(node))


def bound_nodes(graph: torch.fx.Graph, default_target: Optional[Target]) -> Iterator[tuple[torch.fx.Node, BoundKernel]]:
    """Each canonical node of ``graph`` with its bound kernel (``bound_kernel``), over a snapshot of the nodes: the
    passes after selection walk them this way, and may replace the node they are given."""
    for node in list(graph.nodes):
        bound = bound_kernel(node, default_target)
        if bound is not None:
            yield node, bound
