"""Compile a real vLLM MoE layer with Inductor + rubin's vLLM pass, and look at what the pass saw and did."""

from __future__ import annotations

import collections
import operator
from typing import Any, Callable, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from rubin_compile.integrations.vllm import VllmPass

AF = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)

# Tolerance of compiled-with-rubin against eager vLLM, relative to the largest reference magnitude. Both
# sides run the same math in the same dtype; they differ in summation order (vLLM's CPU grouped GEMM
# vs rubin.moe's reference, one expert at a time) and, for bf16, in where results are rounded to bf16.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def op_name(node: torch.fx.Node) -> Optional[str]:
    """``ns::name`` of the op a call node runs (looking inside auto_functionalized)."""
    if node.op != "call_function":
        return None
    target = node.args[0] if node.target in AF else node.target
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else None


def op_counts(graph: torch.fx.Graph) -> collections.Counter:
    return collections.Counter(n for n in map(op_name, graph.nodes) if n)


class Stop(Exception):
    """Raised by ``RecordingPass(stop=True)`` to end a compile once the pass has been inspected."""


class RecordingPass(CustomGraphPass):
    """rubin's vLLM pass, recording op counts before and after, with an optional graph edit first."""

    def __init__(
        self,
        options: Optional[dict] = None,
        edit: Optional[Callable[[torch.fx.Graph], None]] = None,
        stop: bool = False,
    ) -> None:
        self.inner = VllmPass({"passes": ["match_moe"], **(options or {})})
        self.edit, self.stop = edit, stop
        self.before: collections.Counter = collections.Counter()
        self.after: collections.Counter = collections.Counter()
        self.report: Optional[dict] = None
        self.graphs = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1
        if self.edit is not None:
            self.edit(graph)
        self.before = op_counts(graph)
        self.inner(graph)
        self.after = op_counts(graph)
        self.report = self.inner.last_report
        if self.stop:
            raise Stop

    def uuid(self) -> None:
        return None  # never served from a cache: every test compiles

    def match_moe(self) -> dict[str, Any]:
        assert self.report is not None, "the pass did not run"
        return next(p for p in self.report["passes"] if p["name"] == "match_moe")


class Block(torch.nn.Module):
    """A decoder layer's MoE half as vLLM models write it: RMSNorm, then the MoE layer on the normed
    hidden states (an intermediate of the graph, as in a real model). ``norm=False`` hands the layer a
    graph input instead."""

    def __init__(self, layer: torch.nn.Module, norm: bool = True) -> None:
        super().__init__()
        self.layer, self.norm = layer, norm

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.norm:
            x = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6)
        return self.layer(x, router_logits)


def run_eager(layer, vllm_config, x, logits, norm: bool = True) -> torch.Tensor:
    from vllm.forward_context import set_forward_context

    with torch.no_grad(), set_forward_context(None, vllm_config):
        return Block(layer, norm)(x.clone(), logits)


def compile_layer(
    layer,
    vllm_config,
    x,
    logits,
    *,
    af_v2: bool = False,
    options: Optional[dict] = None,
    edit=None,
    stop: bool = False,
    norm: bool = True,
    forward_context: bool = True,
) -> tuple[Callable, RecordingPass]:
    """Compile ``Block(layer)`` for (x, logits) with Inductor running ``RecordingPass``; return a function
    that runs the compiled block (in vLLM's forward context) and the pass. ``forward_context=False``
    compiles outside vLLM's forward context (use with ``stop=True``: the layer cannot run there)."""
    import contextlib

    from vllm.forward_context import set_forward_context

    torch._dynamo.reset()
    recorder = RecordingPass(options, edit, stop)
    compiled = torch.compile(Block(layer, norm), backend="inductor", fullgraph=True, dynamic=False)
    patches = {"post_grad_custom_post_pass": recorder, "enable_auto_functionalized_v2": af_v2, "fx_graph_cache": False}

    def run(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        fc = set_forward_context(None, vllm_config) if forward_context else contextlib.nullcontext()
        with torch.no_grad(), fc, torch._inductor.config.patch(patches):
            return compiled(x.clone(), logits)

    try:
        run(x, logits)
    except Exception as exc:  # Inductor wraps what a pass raises
        if not (stop and _caused_by(exc, Stop)):
            raise
    return run, recorder


def assert_close_to_reference(
    layer, vllm_config, run: Callable, dtype: torch.dtype, fresh: Callable, checks: int = 2
) -> None:
    """``run`` (the block compiled with rubin's pass) on ``checks`` fresh inputs from ``fresh()``, against:

    * fp32: the layer run eagerly by vLLM;
    * bf16: the same block compiled by Inductor with no rubin pass. The code around the MoE (RMSNorm,
      routing) is then the same code; against eager, Inductor's own bf16 roundings move outputs by up to
      2.3% of their scale (seen on this layer; rubin vs Inductor alone was bitwise equal on the CPU).
    """
    inputs = [fresh() for _ in range(checks)]
    got = [run(x, logits) for x, logits in inputs]
    if dtype == torch.float32:
        want = [run_eager(layer, vllm_config, x, logits) for x, logits in inputs]
    else:
        plain, _ = compile_layer(layer, vllm_config, *inputs[0], options={"passes": []})
        want = [plain(x, logits) for x, logits in inputs]
    for g, w in zip(got, want):
        assert_close(g, w)


def _caused_by(exc: BaseException, kind: type) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within ``TOLERANCE[dtype]`` of the largest |expected|, and not trivially zero."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.float().abs().max().item()
    assert scale > 0, "reference output is all zeros: the check would prove nothing"
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= TOLERANCE[expected.dtype] * scale, f"max error {err:.3g} vs scale {scale:.3g} ({expected.dtype})"


def add_reader_of_result(index: int, op: str) -> Callable[[torch.fx.Graph], None]:
    """A graph edit: something reads result ``index`` of the (auto-functionalized) ``op`` call, e.g. the
    mutated ``hidden_states`` of ``vllm.moe_forward`` (a near-miss: an extra user of an intermediate)."""

    def edit(graph: torch.fx.Graph) -> None:
        call = next(n for n in graph.nodes if op_name(n) == op)
        out = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(out):
            item = graph.call_function(operator.getitem, (call, index))
            item.meta["val"] = call.meta["val"][index] if "val" in call.meta else None
            extra = graph.call_function(torch.ops.aten.sum.default, (item,))
        out.args = ((*out.args[0], extra),) if isinstance(out.args[0], (tuple, list)) else ((out.args[0], extra),)

    return edit


def set_call_kwarg(op: str, **kwargs: Any) -> Callable[[torch.fx.Graph], None]:
    """A graph edit: change keyword arguments of every ``op`` call (e.g. ``act="gelu"``)."""

    def edit(graph: torch.fx.Graph) -> None:
        for n in graph.nodes:
            if op_name(n) == op:
                n.kwargs = {**n.kwargs, **kwargs}

    return edit
