"""The fused routing in compiled models on the GPU (passes/match_routing.py -> rubin.route -> kernels/triton/route.py):

- at the Qwen3-30B-A3B router (E = 128, H = 2048, k = 8, bf16 nn.Linear, softmax in float32, renormalised, weights
  cast to bf16), 4096 random tokens: the ids equal the source routing's (eager transformers code) on every token
  whose k-th and (k+1)-th bf16 logits are more than two bf16 ulps apart (each may round one ulp the other way: the
  logits are summed in another order than cuBLAS sums them), the weights within one bf16 ulp;
- Hugging Face MoE blocks (Qwen3-MoE, Mixtral, DeepSeek-V3 grouped, GLM-4-MoE, GPT-OSS), compiled for this GPU: the
  routing is one rubin.route on the triton kernel, fp32 outputs equal eager (1e-4 of the scale), bf16 outputs equal
  the same pipeline without match_routing (bf16 tolerance), at a static T and a dynamic one (T = 100 > 64 runs the
  op's reference inside the adapter).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rubin_compile.passes import PASS_NAMES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PASSES_WITHOUT = [p for p in PASS_NAMES if p != "match_routing"]  # the pipeline without the fused routing


def test_qwen3_router_ids_equal_the_source_routing_except_two_ulp_ties():
    import rubin_compile.ops  # noqa: F401

    E, H, k, T = 128, 2048, 8, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((T, H), device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn((E, H), device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    logits = F.linear(x, w)  # the source: Qwen3MoeTopKRouter
    probs = F.softmax(logits, dim=1, dtype=torch.float)
    top, ids = torch.topk(probs, k, dim=-1)
    top = (top / top.sum(dim=-1, keepdim=True)).to(torch.bfloat16)
    got_w, got_ids = [], []
    for t0 in range(0, T, 64):  # decode-sized calls, as the kernel is selected for
        a, b = torch.ops.rubin.route(
            x[t0 : t0 + 64], w, k, renormalize=True, logits_dtype=torch.bfloat16, weights_dtype=torch.bfloat16,
            impl="triton",
        )  # fmt: skip
        got_w.append(a), got_ids.append(b)
    got_w, got_ids = torch.cat(got_w), torch.cat(got_ids).long()
    same = (got_ids.sort(-1).values == ids.sort(-1).values).all(-1)
    sorted_logits = logits.float().sort(-1, descending=True).values
    gap = sorted_logits[:, k - 1] - sorted_logits[:, k]
    ulp = sorted_logits[:, k - 1].abs() * 2.0**-7  # one bf16 ulp (8 bits of mantissa) at that magnitude, or more
    differ = ~same  # each of the two logits may round one ulp the other way: a gap of up to 2 ulps may swap them
    assert (gap[differ] <= 2 * ulp[differ]).all(), f"{int(differ.sum())} tokens differ, some with a gap above 2 ulps"
    assert differ.float().mean() < 0.01  # before the logits were rounded as the source's: 46 of 4080 differed
    order_got, order_src = got_ids[same].argsort(-1), ids[same].argsort(-1)
    a, b = got_w[same].gather(1, order_got).float(), top[same].gather(1, order_src).float()
    rel = (a - b).abs() / b.abs().clamp_min(1e-6)
    # one bf16 ulp of rounding the weight, plus what one ulp of a logit moves it (a logit of 4 rounded one ulp the
    # other way moves its exp by 3%): rare, so nearly every weight is within the one ulp
    assert (rel > 2**-7).float().mean() < 1e-3, f"{int((rel > 2**-7).sum())} of {rel.numel()} weights beyond one ulp"
    assert rel.max() < 0.05, rel.max()


def test_a_cpu_scale_tensor_is_read_on_the_host():
    """Under dynamic=True Dynamo passes DeepSeek-V3's routed_scaling_factor as a 0-d CPU tensor."""
    import rubin_compile.ops  # noqa: F401

    x = torch.randn(3, 256, device="cuda")
    w = torch.randn(32, 256, device="cuda") / 16
    kw = dict(scoring="sigmoid", renormalize=True, n_group=4, topk_group=2, impl="triton")
    a = torch.ops.rubin.route(x, w, 4, scale_tensor=torch.tensor(2.5), **kw)
    b = torch.ops.rubin.route(x, w, 4, scale=2.5, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _blocks():
    from tests.cpu.passes.test_match_routing import FAMILIES, _block

    return FAMILIES, _block


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_blocks_run_the_fused_routing(tmp_path, model_type, dtype):
    from tests.conftest import RubinRun, count_ops

    _, _block = _blocks()
    torch.manual_seed(0)
    block, H = _block(model_type)
    block = block.to("cuda", dtype)
    run = RubinRun(tmp_path / "dumps")
    # inline_kernels off: this test counts the rubin.route / rubin.moe nodes of the final graph, which the pass
    # would replace by their traced launches where sizes are static (tests/gpu/test_inline_kernels.py checks that)
    fused = run.compile(block, dynamic=None, inline_kernels="off")
    unfused = RubinRun(tmp_path / "dumps-unfused").compile(block, passes=PASSES_WITHOUT)
    with torch.no_grad():
        for T in (1, 5):
            x = torch.randn(1, T, H, device="cuda", dtype=dtype)
            got, want = fused(x), (block(x) if dtype == torch.float32 else unfused(x))
            scale = want.abs().max().item()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            assert (got.float() - want.float()).abs().max().item() <= tol * scale, (model_type, T)
    code = run.final_code()
    moes = count_ops(code, "rubin.moe")
    assert count_ops(code, "rubin.route") == moes  # one fused routing ahead of every rubin.moe
    # a block with no rubin.moe is one match_moe left as written, with its reason (GPT-OSS in bf16: its clamped
    # SwiGLU has no GPU kernel, and the reference would be slower than the block as written)
    assert moes >= 1 or run.unchanged("match_moe"), model_type
    assert all(rw["details"]["kernel"] == "triton" for rw in run.rewrites("match_routing"))


def test_dynamic_t_past_the_kernel_limit_runs_the_reference(tmp_path):
    from tests.conftest import RubinRun

    _, _block = _blocks()
    torch.manual_seed(0)
    block, H = _block("deepseek_v3")
    block = block.to("cuda")
    compiled = RubinRun(tmp_path / "dumps").compile(block, dynamic=True)
    with torch.no_grad():
        for T in (3, 100):
            x = torch.randn(1, T, H, device="cuda")
            want = block(x)
            assert (compiled(x) - want).abs().max().item() <= 1e-4 * want.abs().max().item()
