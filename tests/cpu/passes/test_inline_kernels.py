"""inline_kernels: which nodes are traced into the graph and why not, and what tracing an adapter records.

The CPU machine has no GPU, so the adapters are traced here with fake CUDA tensors and the GPU's facts patched in
(what ``torch.cuda.get_device_properties`` would say on an H200); that Inductor compiles and launches the traced
kernels, with results equal to the op call's, is checked on the GPU (tests/gpu/test_inline_kernels.py).
"""

from __future__ import annotations

import operator
from contextlib import ExitStack
from unittest import mock

import pytest
import torch
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode

from rubin_compile import target as target_mod
from rubin_compile.kernels.triton import attention as triton_attention
from rubin_compile.kernels.triton import moe as triton_moe
from rubin_compile.kernels.triton import route as triton_route
from rubin_compile.kernels.triton.launch import cdiv
from rubin_compile.ops import registry
from rubin_compile.ops.registry import bound_kernel
from rubin_compile.options import RubinOptions
from rubin_compile.passes import inline_kernels

SM90 = target_mod.resolve("sm90")
HOP = torch.ops.higher_order.triton_kernel_wrapper_mutation


@pytest.fixture
def on_h200():
    """This process taken for an H200 with its kernels runnable, for tracing only (nothing launches)."""
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(target_mod, "detect", lambda: SM90))
        stack.enter_context(mock.patch.object(registry.Kernel, "unavailable_here", lambda self, here: None))
        stack.enter_context(mock.patch.object(triton_attention, "_sm_count", lambda index: 132))
        stack.enter_context(mock.patch.object(triton_route, "_device_facts", lambda index: (132, True)))
        stack.enter_context(mock.patch.object(triton_moe, "_device_info", lambda index: ("NVIDIA H200", 132, 9)))
        yield


class Graph:
    """An FX graph of placeholders with fake CUDA values, and rubin op calls on them."""

    def __init__(self):
        self.mode = FakeTensorMode()
        self.graph = torch.fx.Graph()
        self.nodes: dict[str, torch.fx.Node] = {}

    def input(self, name, *shape, dtype=torch.bfloat16):
        with self.mode:
            val = torch.empty(*shape, dtype=dtype, device="cuda")
        node = self.nodes[name] = self.graph.placeholder(name)
        node.meta["val"] = val
        return node

    def call(self, op, *args, **kwargs):
        node = self.graph.call_function(op, args, kwargs)
        val = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a  # noqa: E731
        with self.mode:
            node.meta["val"] = op(*map(val, args), **{**{k: val(a) for k, a in kwargs.items()}, "impl": "reference"})
        return node

    def finish(self, *outs):
        flat = []
        for o in outs:
            if isinstance(o.meta["val"], tuple):
                for i, v in enumerate(o.meta["val"]):
                    item = self.graph.call_function(operator.getitem, (o, i))
                    item.meta["val"] = v
                    flat.append(item)
            else:
                flat.append(o)
        self.graph.output(tuple(flat))
        return self

    def inline(self, node):
        with self.mode, V.set_fake_mode(self.mode):
            return inline_kernels.inline(self.graph, node)

    def targets(self):
        return [n.target for n in self.graph.nodes if n.op == "call_function"]


def attention_graph(context=4232, filled=True, impl="triton@sm90"):
    g = Graph()
    q = g.input("q", 1, 32, 1, 128)
    k = g.input("k", 1, 4, context, 128)
    v = g.input("v", 1, 4, context, 128)
    m = g.input("m", 1, 1, 1, context, dtype=torch.bool)
    node = g.call(torch.ops.rubin.attention.default, q, k, v, m, impl=impl)
    return g.finish(node), node


def test_attention_is_traced_into_its_two_launches(on_h200):
    g, node = attention_graph()
    assert g.inline(node) == ["_split_kv", "_combine"]
    targets = g.targets()
    assert torch.ops.rubin.attention.default not in targets
    assert targets.count(HOP) == 2
    # the split kernel's grid and constants are those the op call would launch with
    launch = next(n for n in g.graph.nodes if n.target is HOP)
    (grid,) = launch.kwargs["grid"]
    B, Hkv, ctx = 1, 4, 4232
    cfg = triton_attention.config_for(B, Hkv, ctx)
    split_len = triton_attention.split_positions(B, Hkv, ctx, 132, cfg)
    assert grid == (cdiv(ctx, split_len), B * Hkv, 1)
    assert launch.kwargs["kwargs"]["Q"] is g.nodes["q"] and launch.kwargs["kwargs"]["Skv"] == ctx
    # the graph's output is the buffer the kernels write, in the op's layout ([B, S, Hq, Dv] seen as [B, Hq, S, Dv])
    out = next(n for n in g.graph.nodes if n.op == "output").args[0][0]
    assert tuple(out.meta["val"].shape) == (1, 32, 1, 128) and out.meta["val"].stride() == (4096, 128, 4096, 1)
    g.graph.lint()


def test_attention_with_sinks_passes_them_to_both_launches(on_h200):
    """GPT-OSS's sinks (a graph input of one logit per query head) reach the split kernel and the combine."""
    g = Graph()
    q = g.input("q", 1, 64, 1, 64)
    k = g.input("k", 1, 8, 4232, 64)
    v = g.input("v", 1, 8, 4232, 64)
    m = g.input("m", 1, 1, 1, 4232, dtype=torch.bool)
    s = g.input("s", 64)
    node = g.call(torch.ops.rubin.attention.default, q, k, v, m, sinks=s, impl="triton@sm90")
    g.finish(node)
    assert g.inline(node) == ["_split_kv", "_combine"]
    launches = [n for n in g.graph.nodes if n.target is HOP]
    assert [n.kwargs["kwargs"]["Sinks"] is g.nodes["s"] for n in launches] == [True, True]
    g.graph.lint()


def test_route_is_traced_and_its_two_outputs_rewired(on_h200):
    g = Graph()
    x, w = g.input("x", 1, 2048), g.input("w", 128, 2048)
    node = g.call(torch.ops.rubin.route.default, x, w, 8, renormalize=True, impl="triton@sm90")
    g.finish(node)
    assert g.inline(node) == ["_router_logits_kernel", "_route_topk_kernel"]
    outs = next(n for n in g.graph.nodes if n.op == "output").args[0]
    assert [(o.meta["val"].dtype, tuple(o.meta["val"].shape)) for o in outs] == [
        (torch.float32, (1, 8)),
        (torch.int32, (1, 8)),
    ]
    assert operator.getitem not in g.targets() and torch.ops.rubin.route.default not in g.targets()
    g.graph.lint()


def moe_graph(T=1, E=128, H=2048, I=768, k=8):  # noqa: E741
    """A graph of one rubin.moe call bound to our Triton kernels (Qwen3-30B-A3B's MoE by default)."""
    g = Graph()
    x = g.input("x", T, H)
    w13, w2 = g.input("w13", E, 2 * I, H), g.input("w2", E, H, I)
    tw, ids = g.input("tw", T, k, dtype=torch.float32), g.input("ids", T, k, dtype=torch.int32)
    node = g.call(torch.ops.rubin.moe.default, x, w13, w2, tw, ids, "silu", impl="triton@sm90")
    return g.finish(node), node


def test_moe_at_decode_is_traced(on_h200):
    g, node = moe_graph()
    kernels = g.inline(node)
    assert "_moe_fc1_kernel" in kernels and "_moe_fc2_kernel" in kernels
    assert g.targets().count(HOP) == len(kernels) and torch.ops.rubin.moe.default not in g.targets()
    g.graph.lint()


def test_moe_fused_decode_is_traced_with_a_workspace_of_its_own(on_h200):
    """A call the tuned table runs on the fused decode kernel (moe_decode.py): one launch, after a zeroed workspace
    the graph makes for each call (the op call's per-device workspace is process state a graph cannot own)."""
    g, node = moe_graph()
    G = triton_moe.GemmConfig
    fused = triton_moe.MoEConfig(
        mode="fused",
        fc1=G(BM=16, BN=32, BK=128, num_stages=4, occupancy=2, split_k=2),
        fc2=G(BM=16, BN=32, BK=128, num_stages=4, occupancy=2, split_k=4),
    )
    with mock.patch.object(triton_moe, "_tuned_config", lambda *a, **kw: fused):
        kernels = g.inline(node)
    assert kernels == ["_moe_decode_kernel"]
    # torch.zeros, as the trace decomposes it: aten.full(size, 0) of int32
    zeros = [n for n in g.graph.nodes if n.target is torch.ops.aten.full.default and n.args[1] == 0]
    assert len(zeros) == 1 and zeros[0].meta["val"].dtype == torch.int32
    assert torch.ops.rubin.moe.default not in g.targets()
    g.graph.lint()


def test_a_failing_trace_leaves_the_graph_unchanged(on_h200):
    g, node = attention_graph()
    before = [n.format_node() for n in g.graph.nodes]
    with mock.patch.object(triton_attention, "run", side_effect=NotImplementedError("no such layout")):
        with pytest.raises(NotImplementedError):
            g.inline(node)
    assert [n.format_node() for n in g.graph.nodes] == before


class _Engine:
    def __init__(self, graphs: bool):
        self.graphs = graphs

    def runs_under_cudagraphs(self, options):
        return self.graphs, f"test cudagraphs={self.graphs}"


def _reason(node, mode="auto", graphs=False, runs_here=True):
    bound = bound_kernel(node, SM90)
    return inline_kernels.why_not(node, bound, mode, graphs, f"cudagraphs={graphs}", runs_here)


def test_why_not_names_each_condition():
    g, node = attention_graph()
    assert _reason(node) is None
    assert _reason(node, mode="off") == "options inline_kernels='off'"
    assert "CUDA graphs" in _reason(node, graphs=True) and "inline_kernels='on'" in _reason(node, graphs=True)
    assert _reason(node, mode="on", graphs=True) is None
    assert "planned for sm90 on another machine" in _reason(node, runs_here=False)
    node.kwargs = {**node.kwargs, "pdl": True}
    assert "PDL" in _reason(node)
    g2, ref = attention_graph(impl="reference")
    assert "'reference' runs through its adapter" in _reason(ref)


def test_symbolic_sizes_stay_op_calls():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    g, node = attention_graph()
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        length = mode.shape_env.create_unbacked_symint()
        g.nodes["k"].meta["val"] = torch.empty(1, 4, length, 128, dtype=torch.bfloat16, device="cuda")
    assert "symbolic" in _reason(node)


def test_option_reads_and_rejects():
    assert RubinOptions.resolve({}).inline_kernels == "auto"
    assert RubinOptions.resolve({"inline_kernels": "OFF"}).inline_kernels == "off"
    assert RubinOptions.resolve({}, environ={"RUBIN_INLINE_KERNELS": "on"}).inline_kernels == "on"
    with pytest.raises(ValueError, match="inline_kernels must be one of"):
        RubinOptions.resolve({"inline_kernels": "sometimes"})


def test_only_the_inline_asm_analysis_warning_is_filtered():
    import logging

    keep = inline_kernels._InlineAsmAnalysisFilter()

    def record(message, exc):
        try:
            raise exc
        except RuntimeError:
            import sys

            return logging.LogRecord("torch._dynamo", logging.WARNING, __file__, 1, message, (), sys.exc_info())

    asm = RuntimeError("ttir analysis hit an op we do not know how to analyze: tt.elementwise_inline_asm")
    other = RuntimeError("ttir analysis hit an op we do not know how to analyze: tt.something_else")
    message = "Encountered an exception in identify_mutated_tensors, assuming every input is mutated"
    assert not keep.filter(record(message, asm))
    assert keep.filter(record(message, other))
    assert keep.filter(record("another warning", asm))


def _jit_functions():
    """Every @triton.jit function defined in a module of rubin_compile/kernels/triton."""
    import importlib
    import pkgutil

    import triton

    from rubin_compile.kernels import triton as kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, obj in vars(module).items():
            # (not the Gluon ones: launch.Launcher.record refuses them, so none is traced into a graph)
            if (
                isinstance(obj, triton.runtime.jit.JITFunction)
                and obj.fn.__module__ == module.__name__
                and not obj.is_gluon()
            ):
                yield f"{info.name}.{name}", obj


def test_inductor_rebuilds_every_kernel_source_with_its_helpers():
    """A traced launch is compiled by Inductor from source it rebuilds (codegen/wrapper.py:
    user_defined_triton_kernel_transitive_closure_source_code: the kernel and every @triton.jit function it calls,
    spliced under the names they were defined with). A helper imported under another name (``from activations import
    silu as _silu``) is spliced as ``silu`` and then called as ``_silu``: the H200 run at 9f3f9c9 failed to compile
    _moe_fc1_kernel with "NameError: _silu is not defined". Every global each rebuilt function loads must be defined
    in the rebuilt module (torch's own generated header gives it triton and tl)."""
    import builtins
    import dis
    import types

    import triton.language as tl
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    def keep(fn=None, **_):  # triton.jit needs the source file; the rebuilt functions stay plain functions here
        return fn if fn is not None else keep

    kernels = dict(_jit_functions())
    assert {"moe._moe_fc1_kernel", "moe_prefill._fc1_kernel", "attention._split_kv"} <= set(kernels)
    missing = {}
    for name, kernel in kernels.items():
        source = "@triton.jit\n" + user_defined_triton_kernel_transitive_closure_source_code(kernel)
        namespace = {"triton": types.SimpleNamespace(jit=keep, constexpr_function=keep), "tl": tl}
        exec(compile(source, f"<rebuilt {name}>", "exec"), namespace)
        for fn in [v for v in namespace.values() if isinstance(v, types.FunctionType) and v is not keep]:
            loads = {i.argval for i in dis.Bytecode(fn) if i.opname == "LOAD_GLOBAL"}
            undefined = sorted(n for n in loads if n not in namespace and not hasattr(builtins, n))
            if undefined:
                missing[f"{name} -> {fn.__name__}"] = undefined
    assert not missing, f"names a rebuilt kernel loads but its rebuilt source does not define: {missing}"
