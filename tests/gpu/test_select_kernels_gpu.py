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
    plans = rubin_run.plans()
    # When the loop is not rewritten, say why (the match_moe report), not only that the plans differ.
    # the MoE and the fused routing ahead of it (match_routing)
    assert [(pl["canonical_op"], pl["impl"]) for pl in plans] == [
        ("rubin.route", "triton@sm90"),
        ("rubin.moe", "triton@sm90"),
    ], f"rewrites {rubin_run.rewrites()}, left unchanged {rubin_run.unchanged()}; {_input_slices(rubin_run)}"


@pytest.mark.parametrize("padding", [False, True], ids=["rubin-default", "shape_padding-on"])
def test_inductor_shape_padding_is_off_and_would_hide_the_expert_loop(rubin_run, padding):
    """The intermittent failure above: Inductor's pad_mm pass (before our post-grad pass) rewrote the experts' mm of 5
    tokens into constant_pad_nd + mm + slice wherever its compile-time benchmark said padding was faster.
    ``force_shape_pad`` makes it pad every time: with rubin's default (shape_padding off) the loop is still matched;
    with the user's ``{"shape_padding": True}`` it is padded, and match_moe says where it stopped."""
    model = LoopMoE(hidden=256, inter=256, experts=8, k=2).to("cuda", torch.bfloat16).eval()
    with torch.no_grad(), torch._inductor.config.patch(force_shape_pad=True):
        for p in model.parameters():
            p.normal_(0, 0.05)
        x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
        options = {"inductor": {"shape_padding": True}} if padding else {}
        assert_close_to_eager(rubin_run.compile(model, **options)(x), model(x))
    if not padding:
        assert len(rubin_run.rewrites()) == 1, (rubin_run.unchanged(), _input_slices(rubin_run))
    else:
        assert rubin_run.rewrites() == [], "Inductor no longer pads this mm: the test shows nothing"
        (left,) = rubin_run.unchanged()
        inputs = "".join(p.read_text() for p in rubin_run.dump_dir.glob("*/00-input.py"))
        assert "aten.constant_pad_nd" in inputs and "slice" in left["reason"], left


def _input_slices(rubin_run) -> str:
    """For the failure the test above explains (match_moe stopped at ``slice_tensor_7``, a slice inserted by a
    pattern replacement): how many graphs were dumped, and the slices each one's input graph already held."""
    inputs = sorted(rubin_run.dump_dir.glob("*/00-input.py"))
    held = {
        p.parent.name: [line.strip()[:160] for line in p.read_text().splitlines() if "slice" in line][:4]
        for p in inputs
    }
    return f"{len(inputs)} graph(s) dumped; slices in their input graphs: {held}"


class _GptOssExperts(torch.nn.Module):
    """GPT-OSS's experts as the op match_moe writes for them: the clamped SwiGLU over interleaved gate / up rows,
    with biases."""

    def __init__(self, E: int, H: int, I: int):  # noqa: E741
        super().__init__()
        self.w13 = torch.nn.Parameter(torch.randn(E, 2 * I, H) * 0.05)
        self.b13 = torch.nn.Parameter(torch.randn(E, 2 * I) * 0.05)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, I) * 0.05)
        self.b2 = torch.nn.Parameter(torch.randn(E, H) * 0.05)

    def forward(self, x, topk_weights, topk_ids):
        return torch.ops.rubin.moe(x, self.w13, self.w2, topk_weights, topk_ids, "swigluoai", self.b13, self.b2)


@pytest.mark.skipif(
    torch.cuda.get_device_capability()[0] < 9 if torch.cuda.is_available() else True,
    reason="torch's grouped GEMM on a GPU: sm_90 and newer",
)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "cuda-graphs"])
def test_moe_no_kernel_takes_runs_grouped_gemms_over_the_routed_experts(rubin_run, mode):
    """A bf16 MoE no kernel of ours takes (GPT-OSS's clamped SwiGLU) is lowered into the ATen form, grouped GEMMs
    over the routed experts, with and without CUDA graphs (where the reference would run every expert on every
    token); results within bf16 tolerance of the op run eagerly (the reference), expert ids repeated across tokens."""
    import rubin_compile.ops  # noqa: F401

    torch.manual_seed(0)
    E, H, I, T, k = 8, 256, 128, 5, 2  # noqa: E741
    model = _GptOssExperts(E, H, I).to("cuda", torch.bfloat16).eval()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    ids[1] = ids[0]  # two tokens routed alike
    tw = torch.softmax(torch.randn(T, k, device="cuda"), dim=-1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rubin", mode=mode, options={"dump_dir": str(rubin_run.dump_dir)})
    with torch.no_grad():
        want = model(x, tw, ids)
        for _ in range(3):  # CUDA graphs: warm-up, record, replay
            got = compiled(x, tw, ids)
    assert_close_to_eager(got, want, torch.bfloat16)
    plans = rubin_run.plans()
    assert [(pl["kernel"], pl["lowered"]) for pl in plans] == [("reference", "aten")], plans
    assert "rubin.moe" not in rubin_run.final_code() and "_grouped_mm" in rubin_run.final_code()
