"""The activation between the two projections of a Hugging Face experts block, and how its gate and up parts lie
in the first projection's output: what hf_grouped_mm.py and hf_batched_mm.py read between their gate_up and down
projections (through hf_experts.py).

The forms transformers 5.x writes (``_apply_gate`` of an experts class decorated with
``@use_experts_implementation``; ``act_fn`` on the whole product when ``has_gate=False``), and rubin.moe's
activation for each::

    act_fn(gate) * up, gate, up = h.chunk(2, -1)           silu / gelu_tanh / gelu       (_default_apply_gate)
    GPT-OSS's clamped SwiGLU over h[..., ::2], h[..., 1::2]  swigluoai[:alpha:limit]      (GptOssExperts)
    the same over h.chunk(2, -1)                           swigluoai_uninterleave[...]   (MiniMaxM3VLExperts)
    silu(gate.clamp(max=L)) * up.clamp(-L, L), halves      silu_clamp:<L>                (DeepseekV4Experts,
                                                                                          Glm5NextTextExperts,
                                                                                          HYV4Experts)
    silu(gate).clamp(max=L) * up.clamp(-L, L), halves      swiglustep[:L]                (Step3p7Experts' gate: that
                                                                                          class is undecorated in
                                                                                          5.19-5.24, an eager loop;
                                                                                          decorated from 5.25)
    act_fn(h), has_gate=False (an up_proj, no split)       <act>_no_mul: silu / gelu /   (NemotronHExperts: relu2)
                                                           gelu_tanh / relu2 / relu

where GPT-OSS's clamped SwiGLU is ``gate = gate.clamp(max=L); up = up.clamp(-L, L); (up + 1) * (gate *
sigmoid(gate * alpha))``. Each form is traced into a pattern with Inductor's own decompositions (``fwd_only``),
so it matches whatever form they give it in each dtype, and matched at the down projection's input.

Generated patterns ignore scalar arguments, so every match is checked against the numbers read off the matched
nodes: an activation's fixed numbers (GELU's, SiLU's ``+ 1``) must be the traced ones, and the constants of a
clamped form are read by their role -- the gate's ``clamp_max``, the up's ``clamp_min`` / ``clamp_max``, the
``gate * alpha`` and the ``up + 1`` -- and must describe one of rubin.moe's activations: one limit L > 0 for the
gate (max L) and the up (min -L, max L), an offset of exactly 1, no alpha on ``silu_clamp``. Anything else is a
near miss, left unchanged with the numbers in the reason.

A constant may also be a run-time value. Under ``dynamic=True`` Dynamo does not specialise a module's float
attribute (GPT-OSS's ``alpha`` / ``limit``, DeepSeek-V4's ``limit``): it becomes a 0-d float64 graph input, which
the graph converts to float32 before each use (``-limit`` as ``convert(mul(full([], -1), limit))``); torch 2.15
passes both alpha and limit so, torch 2.13 the alpha alone (it specialises the clamps' limit). The clamps then
take the ``.Tensor`` overloads (a second trace of each clamped form, with 0-d tensor limits), and a constant that
is a node must be, up to dtype conversions and a negation, a graph input; the clamps of one limit must read the
same input (the up's minimum its negation). The rewrite then passes them as ``activation_constants``, a 1-D
float32 tensor built in the graph (the values the activation read, a number as ``aten.full``, concatenated),
with the activation string the kind alone.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from rubin_compile.ops.moe import ACTIVATION_KINDS, ACTIVATIONS, activation_string
from rubin_compile.passes.fx import is_call, tensor_val

aten = torch.ops.aten
prims = torch.ops.prims

_CLAMP_MIN = (aten.clamp_min.default, aten.clamp_min.Tensor)
_CLAMP_MAX = (aten.clamp_max.default, aten.clamp_max.Tensor)
_CONVERT = prims.convert_element_type.default
# the layouts of the gate and up parts, as the report names them (``details["gate_up"]``)
HALVES = "halves (gate, up = gate_up.chunk(2, dim=-1): gate rows, then up rows), read as stored"
INTERLEAVED = "interleaved (gate_up[..., ::2], gate_up[..., 1::2]), read as stored"
NOT_GATED = "not gated (has_gate=False: one up_proj, the activation applied to its whole output)"


class NoMatch(Exception):
    """The block deviates from the idiom; the message is the reason recorded in the report."""


def _same(a: Any, b: Any) -> bool:
    return bool(statically_known_true(a == b))


# ------------------------------------------------------------------------------------------------
# the forms, as functions to trace
# ------------------------------------------------------------------------------------------------


def _silu_mul(gate, up):
    return F.silu(gate) * up


def _gelu_tanh_mul(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def _gelu_mul(gate, up):  # exact GELU
    return F.gelu(gate) * up


def _relu_mul(gate, up):  # recognised so that the report can name it; rubin.moe has no gated ReLU
    return F.relu(gate) * up


def _sigmoid_mul(gate, up):
    return torch.sigmoid(gate) * up


# Clamped forms: ``limit`` / ``neg_limit`` / ``up_limit`` are traced as numbers (patterns ignore them) and as 0-d
# tensors (the clamps' .Tensor overloads); ``_read`` then reads them off the matched clamps by role.
def _clamped_swiglu(gate, up, limit=7.0, neg_limit=-7.0, up_limit=7.0):
    """GPT-OSS's ``_apply_gate`` after its split (MiniMax-M3's over halves): any constants."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=neg_limit, max=up_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


def _clamped_swiglu_no_offset(gate, up, limit=7.0, neg_limit=-7.0, up_limit=7.0):
    """The same without the ``+ 1`` on up: silu_clamp with an alpha, a near miss to name."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=neg_limit, max=up_limit)
    return (gate * torch.sigmoid(gate * 1.702)) * up


def _silu_clamp(gate, up, limit=7.0, neg_limit=-7.0, up_limit=7.0):
    """DeepSeek-V4's / GLM-5-Next's / Hunyuan-V4's ``_apply_gate`` after ``chunk(2)``."""
    return F.silu(gate.clamp(min=None, max=limit)) * up.clamp(min=neg_limit, max=up_limit)


def _swiglustep(gate, up, limit=7.0, neg_limit=-7.0, up_limit=7.0):
    """Step-3.7's ``_apply_gate`` after ``chunk(2)``: SiLU first, then the clamp."""
    return F.silu(gate).clamp(max=limit) * up.clamp(min=neg_limit, max=up_limit)


# Not gated (``has_gate=False``): the activation of the whole product ``h``.
def _silu(h):
    return F.silu(h)


def _gelu_tanh(h):
    return F.gelu(h, approximate="tanh")


def _gelu(h):
    return F.gelu(h)


def _relu2(h):  # transformers' ReLUSquaredActivation (Nemotron-H's relu2)
    return torch.square(F.relu(h))


def _relu(h):
    return F.relu(h)


@dataclass(frozen=True)
class _Form:
    """One traced form: ``name`` (rubin.moe's kind, or the activation's name for the plain gated and non-gated
    ones), whether it is gated (reads a gate and an up part), clamped (limits), with a ``gate * alpha`` and with
    an ``up + offset``."""

    name: str
    fn: Callable
    gated: bool = True
    clamped: bool = False
    alpha: bool = False
    offset: bool = False

    def label(self) -> str:
        return {
            "clamped_swiglu": "a clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate))",
            "clamped_swiglu_no_offset": "a clamped SwiGLU without the + 1 on up (gate * sigmoid(alpha * gate) * up)",
            "silu_clamp": "a clamped SiLU (silu(gate.clamp(max=L)) * up.clamp(-L, L))",
            "swiglustep": "a SwiGLU-step (silu(gate).clamp(max=L) * up.clamp(-L, L))",
        }.get(self.name, f"{self.name}(gate) * up" if self.gated else f"{self.name}(h), not gated")


GATED_FORMS = (
    _Form("silu", _silu_mul),
    _Form("gelu_tanh", _gelu_tanh_mul),
    _Form("gelu", _gelu_mul),
    _Form("relu", _relu_mul),
    _Form("sigmoid", _sigmoid_mul),
    _Form("clamped_swiglu", _clamped_swiglu, clamped=True, alpha=True, offset=True),
    _Form("clamped_swiglu_no_offset", _clamped_swiglu_no_offset, clamped=True, alpha=True),
    _Form("silu_clamp", _silu_clamp, clamped=True),
    _Form("swiglustep", _swiglustep, clamped=True),
)
UNGATED_FORMS = (
    _Form("silu", _silu, gated=False),
    _Form("gelu_tanh", _gelu_tanh, gated=False),
    _Form("gelu", _gelu, gated=False),
    _Form("relu2", _relu2, gated=False),
    _Form("relu", _relu, gated=False),
)
_FORMS = {(f.name, f.gated): f for f in GATED_FORMS + UNGATED_FORMS}


@functools.lru_cache(maxsize=None)
def _pattern(name: str, gated: bool, low_precision: bool, tensor_limits: bool):
    """The form as Inductor decomposes it (bf16 / fp16 add upcasts around parts of it), and its fixed numbers
    (those of nodes that hold no constant of the activation's own): generated patterns ignore scalar arguments,
    so a match is checked against these."""
    from torch._inductor.pattern_matcher import fwd_only, gen_pattern_and_search_gm

    form = _FORMS[(name, gated)]
    dtype = torch.bfloat16 if low_precision else torch.float32
    inputs = [torch.empty(4, 8, dtype=dtype) for _ in range(2 if gated else 1)]
    if tensor_limits:
        inputs += [torch.empty((), dtype=torch.float32) for _ in range(3)]
    fn = form.fn
    if form.clamped and not tensor_limits:  # the traced signature is the inputs'; the limits keep their defaults

        def fn(gate, up):
            return form.fn(gate, up)

    pattern, search_gm = gen_pattern_and_search_gm(fn, inputs, fwd_only)
    placeholders = [n for n in search_gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in search_gm.graph.nodes if n.op == "call_function"]
    roles = _roles(form, nodes, placeholders[: len(inputs) - (3 if tensor_limits else 0)])
    assert roles is not None, f"the traced {name} has not the roles its form says"
    return pattern, _constants(n for n in nodes if n not in roles.values())


def _constants(nodes) -> list[float]:
    """The Python numbers among the arguments of ``nodes``, sorted."""
    out = []
    for n in nodes:
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                out.append(float(a))
    return sorted(out)


def _outside(n: torch.fx.Node, inside: set, inputs: list) -> list[Any]:
    """The operands of a binary ``n`` that come from neither the matched nodes nor the form's inputs: numbers, or
    nodes computed before the activation (its run-time constants)."""
    return [a for a in n.args[:2] if not (isinstance(a, torch.fx.Node) and (a in inside or a in inputs))]


def _under_converts(node: Any, inside: set) -> Any:
    while is_call(node, _CONVERT) and node in inside:
        node = node.args[0]
    return node


def _roles(form: _Form, nodes: list, inputs: list) -> Optional[dict[str, torch.fx.Node]]:
    """The nodes of a clamped form that hold its constants: ``gate_max`` (``gate.clamp(max=L)``), ``up_min`` and
    ``up_max`` (``up.clamp(-L, L)``), ``alpha`` (``gate * alpha``), ``offset`` (``up + 1``); None when the nodes
    do not have them (the form's structure says they do)."""
    inside = set(nodes)
    roles: dict[str, torch.fx.Node] = {}
    if form.clamped:
        mins = [n for n in nodes if is_call(n, *_CLAMP_MIN)]
        maxs = [n for n in nodes if is_call(n, *_CLAMP_MAX)]
        if len(mins) != 1 or len(maxs) != 2:
            return None
        up_max = [n for n in maxs if _under_converts(n.args[0], inside) is mins[0]]
        if len(up_max) != 1:
            return None
        roles.update(gate_max=next(n for n in maxs if n is not up_max[0]), up_min=mins[0], up_max=up_max[0])
    for role, wanted, target in (("alpha", form.alpha, aten.mul.Tensor), ("offset", form.offset, aten.add.Tensor)):
        if wanted:
            found = [n for n in nodes if is_call(n, target) and len(_outside(n, inside, inputs)) == 1]
            if len(found) != 1:
                return None
            roles[role] = found[0]
    return roles


# ------------------------------------------------------------------------------------------------
# constants: numbers or run-time values
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scalar:
    """One constant of the activation as a matched node reads it: a ``value`` (a Python number), or ``operand``,
    the 0-d node the activation reads, whose value is ``source`` (a graph input), negated or not."""

    value: Optional[float] = None
    operand: Optional[torch.fx.Node] = None
    source: Optional[torch.fx.Node] = None
    negated: bool = False
    chain: tuple = ()  # the nodes from operand to source (conversions, the negation): erased once unused

    @property
    def runtime(self) -> bool:
        return self.value is None

    def describe(self) -> str:
        if not self.runtime:
            return repr(self.value)
        return f"{'-' if self.negated else ''}{self.source.name} (a graph input)"

    def equals(self, other: "Scalar", negated: bool = False) -> bool:
        """Whether this is ``other`` (``negated``: its negation), shown without knowing run-time values."""
        if self.runtime != other.runtime:
            return False
        if not self.runtime:
            return self.value == (-other.value if negated else other.value)
        return self.source is other.source and self.negated == (other.negated ^ negated)


def _is_minus_one(x: Any) -> bool:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x == -1
    if is_call(x, aten.full.default):
        return list(x.args[0]) == [] and x.args[1] == -1
    return is_call(x, aten.scalar_tensor.default) and x.args[0] == -1


def read_scalar(x: Any, what: str) -> Scalar:
    """The constant ``x`` (an operand of the activation): a number, or a 0-d value that is a graph input up to dtype
    conversions and negations (``neg``, ``mul`` by -1); ``NoMatch`` naming ``what`` otherwise."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return Scalar(value=float(x))
    if not isinstance(x, torch.fx.Node):
        raise NoMatch(f"the {what} of the activation is {x!r}, not a number or a graph input")
    node, negated, chain = x, False, []
    while True:
        chain.append(node)
        if is_call(node, _CONVERT):
            node = node.args[0]
        elif is_call(node, aten.neg.default):
            node, negated = node.args[0], not negated
        elif is_call(node, aten.mul.Tensor) and any(_is_minus_one(a) for a in node.args[:2]):
            minus, other = (node.args[0], node.args[1]) if _is_minus_one(node.args[0]) else node.args[1::-1]
            if isinstance(minus, torch.fx.Node):
                chain.append(minus)
            node, negated = other, not negated
        else:
            break
    val = tensor_val(node)
    if not (
        isinstance(node, torch.fx.Node)
        and node.op == "placeholder"
        and val is not None
        and val.dim() == 0
        and val.dtype.is_floating_point
    ):
        raise NoMatch(
            f"the {what} of the activation ({x.name}) is computed in the graph ({getattr(node, 'name', node)}), "
            "not a number or a graph input (a float attribute Dynamo did not specialise)"
        )
    return Scalar(operand=x, source=node, negated=negated, chain=tuple(chain[:-1]))


# ------------------------------------------------------------------------------------------------
# the split
# ------------------------------------------------------------------------------------------------


def _split_gate_up(sources: list[torch.fx.Node], flow: list) -> tuple[torch.fx.Node, torch.fx.Node, bool]:
    """``gate, up = h.chunk(2, dim=-1)`` (an aten.split into two halves, or two slices) or GPT-OSS's
    ``h[..., ::2], h[..., 1::2]``: (gate, up, interleaved). ``sources``: the nodes of one value ``h``
    (functionalization regenerates a view after an in-place bias add once per use)."""
    val = tensor_val(sources[0])
    two_i = val.shape[-1]
    users = [u for src in sources for u in src.users]
    others = [u for u in users if not is_call(u, aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor)]
    if others:
        raise NoMatch(
            f"the gate_up output ({sources[0].name}) has users besides its split into gate and up "
            f"({', '.join(u.name for u in others)}): a user outside the experts block, or not this idiom"
        )
    # One split, or (seen with biased experts, where Inductor does not merge them) one split per half.
    if users and all(is_call(u, aten.split.Tensor, aten.split_with_sizes.default) for u in users):
        parts: dict[int, list[torch.fx.Node]] = {}
        for split in users:
            size, dim = split.args[1], split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
            halves = size == [two_i // 2] * 2 if isinstance(size, (list, tuple)) else _same(size * 2, two_i)
            if dim % val.dim() != val.dim() - 1 or not halves:
                raise NoMatch(
                    f"the gate_up output is split by {size} along dim {dim}, not into two halves of the last dim"
                )
            for g in split.users:
                if not is_call(g, operator.getitem):
                    raise NoMatch(f"the gate_up split has a user {g.name} that is not gate or up")
                parts.setdefault(g.args[1], []).append(g)
        if sorted(parts) != [0, 1] or any(len(v) != 1 for v in parts.values()):
            raise NoMatch("the gate_up split is not used as exactly (gate, up)")
        flow += users + [parts[0][0], parts[1][0]]
        return parts[0][0], parts[1][0], False
    slices = [u for u in users if is_call(u, aten.slice.Tensor)]
    if len(slices) == 2 and len(users) == 2:

        def bounds(s):
            a = list(s.args) + [0, None, None, 1][len(s.args) - 1 :]
            return a[1] % val.dim(), a[2], a[3], a[4]

        steps = {bounds(s)[3] for s in slices}
        g, u = sorted(slices, key=lambda s: 0 if bounds(s)[1] in (0, None) else 1)
        (g_dim, g_start, g_end, _), (u_dim, u_start, u_end, _) = bounds(g), bounds(u)
        if steps == {2}:
            # gate_up[..., ::2], gate_up[..., 1::2]: GPT-OSS's interleaved rows, which rubin.moe's swigluoai reads
            # as stored (the activation must then be that one)
            ends = all(e is None or (isinstance(e, int) and e >= two_i) or _same(e, two_i) for e in (g_end, u_end))
            if g_dim == u_dim == val.dim() - 1 and g_start in (0, None) and u_start == 1 and ends:
                flow += [g, u]
                return g, u, True
            raise NoMatch(
                f"gate and up are strided slices of gate_up that are not its even and odd columns "
                f"(starts {g_start}, {u_start})"
            )
        if steps != {1}:
            raise NoMatch(f"gate and up are slices of gate_up with steps {sorted(steps)}, not halves or interleaved")
        if (
            g_dim == u_dim == val.dim() - 1
            and g_start in (0, None)
            and _same(g_end, two_i // 2)
            and _same(u_start, two_i // 2)
        ):
            flow += [g, u]
            return g, u, False
    raise NoMatch(
        "the gate_up output is not split into gate and up halves (chunk(2, dim=-1)) or GPT-OSS's interleaved "
        "columns; a custom _apply_gate?"
    )


def split_gate_up(h: Union[torch.fx.Node, list[torch.fx.Node]]) -> tuple[torch.fx.Node, torch.fx.Node, bool, list]:
    """The gate / up split of a gated projection's output ``h``: (gate, up, interleaved, the split's nodes), for a
    matcher that reads the activation itself (hf_llama4.py: ``up * act(gate)``); ``NoMatch`` otherwise."""
    flow: list[torch.fx.Node] = []
    gate, up, interleaved = _split_gate_up(h if isinstance(h, list) else [h], flow)
    return gate, up, interleaved, flow


def _splits(sources: list[torch.fx.Node]) -> bool:
    users = [u for src in sources for u in src.users]
    return any(is_call(u, aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor) for u in users)


# ------------------------------------------------------------------------------------------------
# the activation
# ------------------------------------------------------------------------------------------------


@dataclass
class GateUp:
    """What ``match`` found between the projections: rubin.moe's ``activation``, whether it is gated and how gate
    and up lie (``layout``: HALVES / INTERLEAVED / NOT_GATED), the constants to pass at run time (``constants``:
    numbers or 0-d nodes, in the order of the kind's constants; None when the string holds them), how the
    report names them, and the nodes of the block (``flow``: replaced; ``aux``: erased once unused)."""

    activation: str
    gated: bool
    layout: str
    constants: Optional[list[Union[float, torch.fx.Node]]] = None
    constants_report: Optional[dict[str, str]] = None
    flow: list[torch.fx.Node] = field(default_factory=list)
    aux: list[torch.fx.Node] = field(default_factory=list)

    @property
    def interleaved(self) -> bool:
        return self.layout == INTERLEAVED


def match(h: Union[torch.fx.Node, list[torch.fx.Node]], act_out: Any, down: str) -> GateUp:
    """The activation that turns the first projection's output ``h`` (several nodes of one value, or one) into
    ``act_out``, the input of the down projection (``down`` names it, for reasons); ``NoMatch`` otherwise."""
    sources = h if isinstance(h, list) else [h]
    flow: list[torch.fx.Node] = []
    if _splits(sources):
        gate, up, interleaved = _split_gate_up(sources, flow)
        found = _match_gated(gate, up, interleaved, act_out, down)
    else:
        found = _match_ungated(sources, act_out, down)
    found.flow = flow + found.flow
    return found


def _low_precision(node: torch.fx.Node) -> bool:
    val = tensor_val(node)
    return val is not None and val.dtype in (torch.bfloat16, torch.float16)


def _hits(forms, inputs: dict[str, torch.fx.Node], act_out: Any, low: bool, seen: dict):
    """Each traced form (a clamped one twice: number and tensor limits), lazily, that matches at ``act_out`` with
    ``inputs`` as its inputs and the fixed numbers it was traced with (GELU's differ from GELU-tanh's): (form,
    matched nodes, roles). ``seen["extra_user"]``: a pattern failed only on an intermediate with a user outside it."""
    from torch._inductor.pattern_matcher import Match

    for form in forms:
        for tensor_limits in (False, True) if form.clamped else (False,):
            pattern, fixed = _pattern(form.name, form.gated, low, tensor_limits)
            m = pattern.match(act_out)
            if not isinstance(m, Match):
                # The pattern matcher refuses a pattern node with a user outside the pattern; say so.
                seen["extra_user"] = seen.get("extra_user", False) or str(m).startswith("multiple_users")
                continue
            if any(m.kwargs.get(k) is not v for k, v in inputs.items()):
                continue
            nodes = [n for n in m.nodes if n not in inputs.values()]
            roles = _roles(form, nodes, list(inputs.values()))
            if roles is None or _constants(n for n in nodes if n not in roles.values()) != fixed:
                continue
            yield form, nodes, roles


def _match_gated(gate: torch.fx.Node, up: torch.fx.Node, interleaved: bool, act_out: Any, down: str) -> GateUp:
    name_of = getattr(act_out, "name", act_out)
    layout = INTERLEAVED if interleaved else HALVES
    seen: dict = {}
    for form, nodes, roles in _hits(GATED_FORMS, {"gate": gate, "up": up}, act_out, _low_precision(gate), seen):
        if not form.clamped:
            if form.name not in ACTIVATIONS:
                raise NoMatch(
                    f"the experts' activation is {form.name}(gate) * up; rubin.moe implements {list(ACTIVATIONS)}"
                )
            if interleaved:
                raise NoMatch(_interleaved_reason(form.name))
            return GateUp(form.name, True, layout, flow=list(nodes))
        kind, named, aux = _clamped(form, nodes, roles, interleaved)
        if ACTIVATION_KINDS[kind].interleaved != interleaved:  # the swigluoai kinds follow the columns
            raise NoMatch(_interleaved_reason(kind))
        return _with_constants(kind, named, layout, nodes, aux)
    if seen.get("extra_user"):
        raise NoMatch(f"an intermediate of the gate/up activation ({name_of}) has a user outside the experts block")
    raise NoMatch(
        f"the input of the {down} ({name_of}) is not act(gate) * up with a recognised activation (rubin.moe "
        f"implements {list(ACTIVATIONS)}); a custom _apply_gate?"
    )


def _interleaved_reason(kind: str) -> str:
    return (
        f"the experts' activation is {kind} over interleaved gate / up columns; rubin.moe reads interleaved ones "
        "only for swigluoai (GPT-OSS's clamped SwiGLU, vLLM's swigluoai), its other activations gate rows then up "
        "rows"
    )


def _clamped(form: _Form, nodes: list, roles: dict, interleaved: bool) -> tuple[str, dict[str, Scalar], list]:
    """rubin.moe's kind for a matched clamped form and its constants by name; ``NoMatch`` with the numbers when
    they are not one of rubin.moe's activations."""
    inside = set(nodes)

    def operand(role: str, what: str) -> Scalar:
        n = roles[role]
        if role in ("gate_max", "up_min", "up_max"):
            return read_scalar(n.args[1], what)
        (x,) = [a for a in n.args[:2] if not (isinstance(a, torch.fx.Node) and a in inside)]
        return read_scalar(x, what)

    label = form.label()
    gate_max = operand("gate_max", "limit of the gate's clamp")
    up_min = operand("up_min", "lower limit of the up's clamp")
    up_max = operand("up_max", "upper limit of the up's clamp")
    limits = f"gate clamp_max {gate_max.describe()}, up clamp_min {up_min.describe()}, clamp_max {up_max.describe()}"
    if not (up_max.equals(gate_max) and up_min.equals(gate_max, negated=True) and not gate_max.negated):
        raise NoMatch(f"{label} with different limits for gate and up ({limits}); rubin.moe takes one limit L")
    if not gate_max.runtime and not gate_max.value > 0:
        raise NoMatch(f"{label} with limit {gate_max.value}; rubin.moe takes a limit > 0")
    named = {"limit": gate_max}
    aux = [n for s in (gate_max, up_min, up_max) for n in s.chain]
    if form.offset:
        offset = operand("offset", "offset on up")
        if offset.runtime or offset.value != 1.0:
            raise NoMatch(
                f"{label} whose offset on up is {offset.describe()}, not 1; rubin.moe's swigluoai kinds compute "
                "(up + 1) * ..."
            )
    if form.alpha:
        alpha = operand("alpha", "alpha (gate * alpha)")
        aux += list(alpha.chain)
        if not form.offset:  # (an alpha of 1 is no mul in the graph: Inductor drops it, and the form is another)
            raise NoMatch(
                f"{label} with alpha {alpha.describe()} ({limits}): rubin.moe's silu_clamp has no alpha, and its "
                "swigluoai kinds add 1 to up"
            )
        named = {"alpha": alpha, "limit": gate_max}
        return ("swigluoai" if interleaved else "swigluoai_uninterleave"), named, aux
    return form.name, named, aux


def _with_constants(kind: str, named: dict[str, Scalar], layout: str, nodes: list, aux: list) -> GateUp:
    """The GateUp of ``kind`` with its constants: in the string when all are numbers, else the kind alone and the
    constants (numbers and run-time values) to pass as ``activation_constants``."""
    order = ACTIVATION_KINDS[kind].constants
    scalars = [named[c] for c in order]
    gated = ACTIVATION_KINDS[kind].gated
    if not any(s.runtime for s in scalars):
        return GateUp(activation_string(kind, [s.value for s in scalars]), gated, layout, flow=list(nodes), aux=aux)
    return GateUp(
        kind,
        gated,
        layout,
        constants=[s.operand if s.runtime else s.value for s in scalars],
        constants_report={c: s.describe() for c, s in zip(order, scalars)},
        flow=list(nodes),
        aux=aux,
    )


def _match_ungated(sources: list[torch.fx.Node], act_out: Any, down: str) -> GateUp:
    name_of = getattr(act_out, "name", act_out)
    seen: dict = {}
    for h in sources:
        for form, nodes, _ in _hits(UNGATED_FORMS, {"h": h}, act_out, _low_precision(h), seen):
            kind = f"{form.name}_no_mul"
            if kind not in ACTIVATIONS:
                raise NoMatch(
                    f"the experts' activation is {form.name}(h), not gated; rubin.moe implements {ACTIVATIONS}"
                )
            return GateUp(kind, False, NOT_GATED, flow=list(nodes))
    if seen.get("extra_user"):
        raise NoMatch(f"an intermediate of the activation ({name_of}) has a user outside the experts block")
    raise NoMatch(
        f"the gate_up output is not split into gate and up (chunk(2, dim=-1), or GPT-OSS's interleaved columns), "
        f"and the input of the {down} ({name_of}) is not a recognised activation of the whole product either "
        f"(has_gate=False experts: silu / gelu / gelu_tanh / relu2 / relu); a custom _apply_gate?"
    )
