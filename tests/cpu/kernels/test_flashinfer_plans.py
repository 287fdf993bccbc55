"""The sm_107 and sm_100 plans of the example model (examples/standalone_moe.py: bf16, and its FP8 / NVFP4 / MXFP4
variants) call FlashInfer as FlashInfer is written: every node the plan binds to a FlashInfer kernel names its
adapter, and the call that adapter makes for that very node -- its arguments built on meta tensors shaped and
strided as the graph's, weights prepared -- binds to the installed function's signature and passes the adapter's
checks of what the function requires (kernels/flashinfer/adapter.py). A parameter FlashInfer renames, a dtype or a
layout it stops taking, fails here, on a machine without the GPU the kernel needs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("flashinfer")

from rubin_compile.kernels.flashinfer import adapter as A  # noqa: E402
from rubin_compile.ops.attention import AttentionArgs  # noqa: E402
from rubin_compile.ops.gemm import GemmArgs  # noqa: E402
from rubin_compile.ops.moe import MoEArgs  # noqa: E402
from rubin_compile.ops.nodes import bound_arguments, schema_name  # noqa: E402
from rubin_compile.ops.registry import KernelUnavailableError, Launch, parse_impl  # noqa: E402
from rubin_compile.passes import manager  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "standalone_moe.py"
ARGS = {
    "rubin::moe": ("moe", MoEArgs),
    "rubin::gemm": ("gemm", GemmArgs),
    "rubin::attention": ("attention", AttentionArgs),
}


def _example():
    spec = importlib.util.spec_from_file_location("standalone_moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(weights: str, target: str, tmp_path: Path, monkeypatch) -> tuple[list[torch.fx.Node], dict]:
    """Compile the example for ``target`` (on this CPU: the plan is made, running it raises), keeping the graph the
    pipeline ends with; return its FlashInfer-bound canonical nodes and the report."""
    graphs: list[torch.fx.Graph] = []
    last = manager.PIPELINE[-1]

    def keep(graph, ctx):
        result = last.run(graph, ctx)
        graphs.append(graph)
        return result

    monkeypatch.setattr(manager, "PIPELINE", manager.PIPELINE[:-1] + (dataclasses.replace(last, run=keep),))
    ex = _example()
    torch.manual_seed(0)
    model = ex.TinyMoEModel(inter=96 if weights == "unquantized" else 128).to(torch.bfloat16).eval()
    tokens = torch.randint(0, 512, (2, 16))
    if weights != "unquantized":
        model = ex.quantize_model(model, weights, tokens)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rubin", options={"target": target, "dump_dir": str(tmp_path)})
    with torch.no_grad(), pytest.raises(KernelUnavailableError):
        compiled(tokens)
    assert graphs, "the pipeline did not run"
    nodes = [
        n
        for g in graphs
        for n in g.nodes
        if n.op == "call_function"
        and schema_name(n.target) in ARGS
        and parse_impl(bound_arguments(n).get("impl") or "reference")[0].startswith("flashinfer_")
    ]
    report = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/report.json"))]
    return nodes, report


CASES = [
    ("unquantized", "sm107"),
    ("fp8_block", "sm107"),
    ("nvfp4", "sm107"),
    ("mxfp4", "sm107"),
    ("nvfp4", "sm100"),
    ("fp8_tensor", "sm100"),
]


@pytest.mark.parametrize("weights,target", CASES)
def test_every_flashinfer_node_of_the_plan_binds(weights, target, tmp_path, monkeypatch):
    nodes, report = _plan(weights, target, tmp_path, monkeypatch)
    assert nodes, f"the {target} plan of the {weights} example binds no FlashInfer kernel"
    entries = json.dumps(report)
    seen = set()
    for node in nodes:
        op, _ = ARGS[schema_name(node.target)]
        bound = bound_arguments(node)
        kernel, _ = parse_impl(bound["impl"])
        args = A.meta_args(op, node)
        quant = A.quant_of(op, args)
        adapter = A.adapter_for(op, kernel, quant)
        assert adapter is not None, (node.name, kernel, quant)
        assert f"via adapter {adapter.name}" in entries, f"the plan does not name {adapter.name} for {node.name}"
        call = A.build(adapter, args, Launch(pdl=bool(bound.get("pdl", False))))
        call.bound()  # TypeError if FlashInfer's signature no longer takes these arguments
        seen.add((op, kernel, quant))
    # what each variant is for: the quantised experts and projections reach their FlashInfer kernels
    ops = {op for op, _, _ in seen}
    assert "moe" in ops, seen
    if weights in ("nvfp4", "fp8_block") and target == "sm107":
        assert "gemm" in ops, seen
