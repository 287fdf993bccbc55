"""Kernel selection on a real GPU: the detected target, and a compiled MoE that runs the chosen kernel."""

from __future__ import annotations

import pytest
import torch

from rubin_compile import target as T
from tests.conftest import assert_close_to_eager
from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_detect_reads_the_device():
    props = torch.cuda.get_device_properties(0)
    here = T.detect()
    assert here.compute_capability == (props.major, props.minor)
    assert here.sm_count == props.multi_processor_count and here.is_cuda
    if (props.major, props.minor) == (9, 0):
        assert here.name == "sm90" and here.pdl and here.fp8 and not here.tcgen05


@pytest.mark.skipif(
    torch.cuda.get_device_capability() != (9, 0) if torch.cuda.is_available() else True,
    reason="the sm_90 row of docs/kernels/selection.md",
)
def test_auto_target_binds_triton_on_sm90_and_matches_eager(rubin_run):
    model = LoopMoE(hidden=256, inter=256, experts=8, k=2).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
        x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
        out = rubin_run.compile(model)(x)
        assert_close_to_eager(out, model(x))
    plans = [
        pl for rep in rubin_run.reports() for p in rep["passes"] if p["name"] == "select_kernels" for pl in p["plans"]
    ]
    # When the loop is not rewritten, say why (the match_moe report), not only that the plans differ.
    # the MoE and the fused routing ahead of it (match_routing)
    assert [(pl["canonical_op"], pl["impl"]) for pl in plans] == [
        ("rubin.route", "triton@sm90"),
        ("rubin.moe", "triton@sm90"),
    ], f"rewrites {rubin_run.rewrites()}, left unchanged {rubin_run.unchanged()}; {_input_slices(rubin_run)}"


def _input_slices(rubin_run) -> str:
    """For the intermittent failure under -n 8 (match_moe stopped at ``slice_tensor_7``, a name our
    fuse_projections gives): how many graphs were dumped, and the slices each one's input graph already held."""
    inputs = sorted(rubin_run.dump_dir.glob("*/00-input.py"))
    held = {
        p.parent.name: [line.strip()[:160] for line in p.read_text().splitlines() if "slice" in line][:4]
        for p in inputs
    }
    return f"{len(inputs)} graph(s) dumped; slices in their input graphs: {held}"
