"""match_attention: SDPA in every ATen form becomes rubin.attention, GQA kept as GQA, near misses left with a
reason. vLLM's attention (kept, recorded) is tested on a real engine in tests/vllm/test_vllm_attention_gemm.py.

Numerics: compiled against eager on fresh random inputs (fp32 1e-4 and bf16 2e-2 of the output's scale; the
reference runs the same CPU flash kernel eager does). The CUDA forms are built as graphs with fake tensors
(no GPU needed to trace them), rewritten, and the rewritten graph is run on the CPU against SDPA.
"""

from __future__ import annotations

import functools
import importlib.util
import re

import pytest
import torch
import torch.nn.functional as F

from rubin_compile.options import RubinOptions
from rubin_compile.passes import match_attention
from rubin_compile.integrations.vllm.engine import BACKEND_KERNELS, VllmEngine
from rubin_compile.passes.base import PassContext
from tests.conftest import assert_close_to_eager, count_ops
from tests.cpu.passes import hf_models

aten = torch.ops.aten
CPU_SDPA = "aten._scaled_dot_product_flash_attention_for_cpu"
FP32, BF16 = pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")


def attention_rewrites(rubin_run) -> list[dict]:
    return rubin_run.rewrites("match_attention")


# --- a Hugging Face model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_hf_model_attention_rewritten_and_logits_match(dtype):
    pytest.importorskip("transformers")
    run = hf_models.run("qwen3_moe", dtype)
    for got, want in run.outputs:
        hf_models.assert_close_to_eager(got, want, dtype)
    result = run.result("match_attention")
    assert result["unchanged"] == [] and len(result["rewrites"]) == hf_models.LAYERS
    for r in result["rewrites"]:
        d = r["details"]
        assert r["canonical_op"] == "rubin.attention" and d["form"] == CPU_SDPA
        assert (d["Hq"], d["Hkv"], d["D"], d["S"], d["Skv"]) == (4, 2, 16, 8, 8)
        # Under torch.compile transformers always builds a mask, and with a mask it repeats the KV heads
        # (repeat_kv): the rewrite folds the repeat back into GQA.
        assert d["masking"] == "mask" and d["gqa"].startswith("repeat_kv folded")
        assert d["scale"] == 0.25  # transformers passes head_dim ** -0.5
    before, after = run.stage_code("match_moe"), run.stage_code("match_attention")
    assert count_ops(before, CPU_SDPA) == hf_models.LAYERS and count_ops(after, CPU_SDPA) == 0
    assert count_ops(after, "rubin.attention") == hf_models.LAYERS
    # the repeated key / value copies (expand + clone + reshape, twice per layer) are gone
    assert count_ops(before, "aten.clone") - count_ops(after, "aten.clone") == 2 * hf_models.LAYERS


# --- plain PyTorch: every CPU form in one graph ----------------------------------------------------------------


def sdpa_forms(q, k, v, m):
    outs = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),  # native GQA
        F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True),
        F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=m, scale=0.3
        ),  # float mask, non-default scale
        F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), attn_mask=m > 0),  # tiled heads
        F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat(1, 2, 1, 1)),  # not alike: no fold
    ]
    # (A value head dim other than the query's, as MLA has, is not SDPA on the CPU: Inductor decomposes it.)
    return torch.cat([o.flatten() for o in outs])


EXPECTED_FORMS = [  # (gqa, masking, scale, Hkv, Dv) per SDPA call above, in graph order
    ("native (enable_gqa)", "causal", "1/sqrt(D)", 2, 16),
    ("repeat_kv folded", "causal", "1/sqrt(D)", 2, 16),
    ("repeat_kv folded", "mask", 0.3, 2, 16),
    ("none (Hq == Hkv)", "mask", "1/sqrt(D)", 4, 16),
    ("repeated in the graph, not folded", "none", "1/sqrt(D)", 4, 16),
]


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_plain_sdpa_forms(rubin_run, dtype):
    compiled = rubin_run.compile(sdpa_forms)
    for _ in range(2):
        args = (torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 1, 8, 8))
        args = tuple(a.to(dtype) for a in args)
        assert_close_to_eager(compiled(*args), sdpa_forms(*args), dtype)
    rewrites = attention_rewrites(rubin_run)
    assert rubin_run.unchanged("match_attention") == []
    assert len(rewrites) == len(EXPECTED_FORMS)
    for r, (gqa, masking, scale, hkv, dv) in zip(rewrites, EXPECTED_FORMS):
        d = r["details"]
        assert d["gqa"].startswith(gqa) and d["masking"] == masking and d["scale"] == scale, d
        assert (d["Hkv"], d["Dv"], d["dtype"]) == (hkv, dv, str(dtype).replace("torch.", "")), d
    matched = rubin_run.stage_code("match_gemm")
    assert count_ops(matched, "rubin.attention") == len(EXPECTED_FORMS) and count_ops(matched, CPU_SDPA) == 0
    # On the CPU every rubin.attention is bound to the reference kernel, i.e. plain SDPA: select_kernels lowers
    # it back to ATen (repeat_kv + SDPA) so Inductor lowers the attention itself
    code = rubin_run.final_code()
    assert count_ops(code, "rubin.attention") == 0 and count_ops(code, CPU_SDPA) == len(EXPECTED_FORMS)
    plans = rubin_run.plans("rubin.attention")
    assert [(pl["kernel"], pl["lowered"]) for pl in plans] == [("reference", "aten")] * len(EXPECTED_FORMS)


def test_dynamic_sequence_length(rubin_run):
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="rubin", dynamic=True, options={"dump_dir": str(rubin_run.dump_dir)})
    for s in (6, 11):
        q, k, v = torch.randn(1, 4, s, 16), torch.randn(1, 2, s, 16), torch.randn(1, 2, s, 16)
        assert_close_to_eager(compiled(q, k, v), fn(q, k, v))
    (r,) = attention_rewrites(rubin_run)
    assert isinstance(r["details"]["S"], str) and r["details"]["gqa"] == "native (enable_gqa)"  # symbolic S


# --- near misses through torch.compile -------------------------------------------------------------------------


def test_training_graph_keeps_sdpa_for_its_logsumexp(rubin_run):
    """With requires_grad the forward graph saves SDPA's logsumexp for the backward pass: left unchanged, and
    forward and backward still compute what eager does."""
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(-1)  # noqa: E731
    compiled = rubin_run.compile(fn)
    leaves = [torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3)]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    got, want = compiled(*leaves), fn(*twins)
    assert_close_to_eager(got, want)
    got.sum().backward()
    want.sum().backward()
    for a, b in zip(leaves, twins):
        assert_close_to_eager(a.grad, b.grad)
    assert attention_rewrites(rubin_run) == []
    (left,) = rubin_run.unchanged("match_attention")
    assert "logsumexp output is used" in left["reason"] and "backward" in left["reason"]
    assert count_ops(rubin_run.final_code(), "rubin.attention") == 0


def test_strict_mode_raises_on_a_near_miss(rubin_run):
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v).sum()  # noqa: E731
    compiled = rubin_run.compile(fn, strict=True)
    with pytest.raises(Exception, match=r"(?s)rubin \(strict\).*logsumexp"):
        compiled(*(torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3)))


# --- attention written out as ops (a model's eager attention) ---------------------------------------------------


def _scores(q, k):
    return q @ k.transpose(-1, -2) * 0.25


def eager_plain(q, k, v):
    return torch.softmax(_scores(q, k), -1) @ v


def eager_softcap(q, k, v):  # Gemma 2's eager attention: the scores softcapped by tanh
    return torch.softmax(torch.tanh(_scores(q, k) / 50.0) * 50.0, -1) @ v


SINKS = torch.randn(4, generator=torch.Generator().manual_seed(3))


def eager_sinks(q, k, v, sinks=SINKS):  # GPT-OSS's eager attention: a logit per head joins the softmax, its column
    w = _scores(q, k)  # dropped
    c = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], -1)], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    return torch.softmax(c, dim=-1)[..., :-1] @ v


def test_eager_attention_with_softcapping_left_unchanged_says_why(rubin_run):
    """A softmax between two matmuls that rubin.attention does not express (tanh-softcapped scores) stays as it is,
    and the report says so: the two products, what the softmax holds besides the scaled scores, and why."""
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    assert_close_to_eager(rubin_run.compile(eager_softcap)(q, k, v), eager_softcap(q, k, v))
    assert attention_rewrites(rubin_run) == []
    (left,) = rubin_run.unchanged("match_attention")
    assert left["idiom"] == "eager attention" and left["node"].startswith("bmm")
    assert re.search(r"matmul -> softmax -> matmul \(bmm\w* -> softmax -> bmm\w*\), with tanh", left["reason"])
    assert "has no softcapping" in left["reason"] and "stays as Inductor compiles it" in left["reason"]
    assert count_ops(rubin_run.final_code(), "aten.bmm") == 2


def test_eager_attention_inductor_turns_into_sdpa_is_rewritten(rubin_run):
    """The plain form reaches rubin as SDPA (Inductor's fuse_attention pass): rewritten, nothing left unchanged."""
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    assert_close_to_eager(rubin_run.compile(eager_plain)(q, k, v), eager_plain(q, k, v))
    assert len(attention_rewrites(rubin_run)) == 1 and rubin_run.unchanged("match_attention") == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eager_attention_with_sinks_rewritten(rubin_run, dtype):
    """GPT-OSS's eager attention (a sink logit per head concatenated to the scores, the softmax, the sink's column
    dropped) becomes one rubin.attention with ``sinks``: the same values as eager within the dtype's tolerance."""
    q, k, v = (torch.randn(2, 4, 8, 16).to(dtype) for _ in range(3))
    fn = functools.partial(eager_sinks, sinks=SINKS.to(dtype))
    assert_close_to_eager(rubin_run.compile(fn)(q, k, v), fn(q, k, v), dtype)
    (rw,) = attention_rewrites(rubin_run)
    assert rw["source_idiom"] == "eager attention (matmul -> softmax -> matmul with attention sinks)"
    d = rw["details"]
    assert (d["Hq"], d["Hkv"], d["S"], d["Skv"], d["D"], d["scale"]) == (4, 4, 8, 8, 16, 0.25)
    assert d["sinks"].endswith("[4]") and d["masking"] == "none"
    assert rubin_run.unchanged("match_attention") == []
    assert "bmm" in " ".join(rw["replaced"]) and "cat" in " ".join(rw["replaced"])


def repeat_kv(x, n=2):  # transformers' repeat_kv (n_rep a number of the module)
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, n, S, D).reshape(B, H * n, S, D)


def eager_sinks_gqa_mask(q, k, v, mask):  # GPT-OSS with repeat_kv and the additive mask of a static cache
    k, v = repeat_kv(k), repeat_kv(v)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
    c = torch.cat([w, SINKS.reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], -1)], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    return torch.matmul(torch.softmax(c, dim=-1, dtype=c.dtype)[..., :-1].to(v.dtype), v)


def test_eager_attention_with_sinks_gqa_and_mask_rewritten(rubin_run):
    """With repeat_kv (folded: the op takes the 2 KV heads) and a finite additive mask (eager attention's
    ``finfo.min``) whose last rows attend to nothing: each such row gives zeros, as eager's softmax does when
    its sink takes all the weight."""
    q = torch.randn(2, 4, 3, 16)
    k, v = torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    mask = torch.zeros(2, 1, 3, 10)
    mask[:, :, :, 7:] = torch.finfo(torch.float32).min
    mask[1, :, 2, :] = torch.finfo(torch.float32).min
    want = eager_sinks_gqa_mask(q, k, v, mask)
    got = rubin_run.compile(eager_sinks_gqa_mask)(q, k, v, mask)
    assert_close_to_eager(got, want)
    assert got[1, :, 2].abs().max() == 0 and want[1, :, 2].abs().max() == 0
    (rw,) = attention_rewrites(rubin_run)
    d = rw["details"]
    assert (d["Hq"], d["Hkv"], d["masking"]) == (4, 2, "mask") and d["gqa"].startswith("repeat_kv folded")


def test_eager_attention_whose_weights_are_returned_left_unchanged_says_why(rubin_run):
    """The probabilities also returned (``output_attentions``): the op would not save their computation, so the
    attention stays as it is, and the report names the node read outside it."""

    def fn(q, k, v):
        w = _scores(q, k)
        c = torch.cat([w, SINKS.reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], -1)], dim=-1)
        p = torch.softmax(c, dim=-1)[..., :-1]
        return p @ v, p.sum()

    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    got, want = rubin_run.compile(fn)(q, k, v), fn(q, k, v)
    assert_close_to_eager(got[0], want[0])
    assert attention_rewrites(rubin_run) == []
    (left,) = rubin_run.unchanged("match_attention")
    assert "is also read by" in left["reason"] and "returns only the attention output" in left["reason"]


def _sinks_tail(w, v):
    c = torch.cat([w, SINKS.reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], -1)], dim=-1)
    return torch.softmax(c - c.max(dim=-1, keepdim=True).values, -1)[..., :-1] @ v


@pytest.mark.parametrize(
    "fn, reason",
    [
        pytest.param(
            lambda q, k, v, m: _sinks_tail(torch.add(_scores(q, k), m, alpha=3.0), v), "alpha=3.0", id="mask-alpha"
        ),
        pytest.param(
            lambda q, k, v, m: torch.softmax(_scores(q, k) + (m > 0), -1) @ v, "not floating-point", id="bool-added"
        ),
        pytest.param(
            lambda q, k, v, m: torch.softmax(_scores(q, k).to(torch.int32).float() + m, -1) @ v,
            "neither side is q @ k^T",
            id="int-cast-scores",
        ),
        pytest.param(
            lambda q, k, v, m: torch.softmax(_scores(q, k) + m, -1).to(torch.int32).float() @ v,
            "not a plain softmax",
            id="int-cast-probs",
        ),
        pytest.param(
            lambda q, k, v, m: torch.bmm(
                torch.softmax(_scores(q, k) + m, -1).reshape(8, 5, 7), v.reshape(8, 7, 16)
            ).reshape(4, 2, 5, 16),
            "not back to [B, H, S, Dv]",
            id="output-reshaped-otherwise",
        ),
    ],
)
def test_eager_attention_near_misses_left_unchanged(rubin_run, fn, reason):
    """Forms that look like attention but compute something else stay as they are, with the reason: a mask added
    times alpha, a bool added (0 / 1, not a mask), a cast to an integer between the products, the product reshaped
    to another shape."""
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 4, 7, 16), torch.randn(2, 4, 7, 16)
    m = torch.randn(2, 1, 5, 7)
    assert_close_to_eager(rubin_run.compile(fn)(q, k, v, m), fn(q, k, v, m))
    assert attention_rewrites(rubin_run) == []
    (left,) = rubin_run.unchanged("match_attention")
    assert reason in left["reason"], left["reason"]


def test_eager_attention_with_sinks_dynamic_shapes_rewritten(rubin_run):
    """Compiled with dynamic shapes, the graph reads sizes off the steps between the products (``sym_size``): those
    read no values, so the attention is still rewritten, and exact at every shape."""
    compiled = rubin_run.compile(eager_sinks_gqa_mask, dynamic=True)
    for s, skv in ((3, 9), (1, 17), (5, 5)):
        q, k, v = torch.randn(2, 4, s, 16), torch.randn(2, 2, skv, 16), torch.randn(2, 2, skv, 16)
        m = torch.randn(2, 1, s, skv)
        assert_close_to_eager(compiled(q, k, v, m), eager_sinks_gqa_mask(q, k, v, m))
    assert attention_rewrites(rubin_run) and rubin_run.unchanged("match_attention") == []


def test_gpt_oss_attention_sinks_rewritten(rubin_run):
    """GPT-OSS (transformers: no SDPA path, attention sinks in its eager attention): every layer's attention
    becomes rubin.attention with sinks, and the logits are eager's."""
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from rubin_compile.debug import moe_families

    config = moe_families.tiny_config(CONFIG_MAPPING["gpt_oss"]())
    torch.manual_seed(0)
    model = moe_families.model_class(config)(config).float().eval()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        got = rubin_run.compile(model)(ids).logits
    assert_close_to_eager(got, want)
    rewrites = attention_rewrites(rubin_run)
    assert len(rewrites) == config.num_hidden_layers and rubin_run.unchanged("match_attention") == []
    assert all(r["details"]["sinks"] is not None and r["details"]["masking"] == "mask" for r in rewrites)


def test_eager_attention_strict_mode_raises():
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    torch._dynamo.reset()
    compiled = torch.compile(eager_softcap, backend="rubin", options={"strict": True})
    with pytest.raises(Exception, match=r"(?s)rubin \(strict\).*eager attention.*softcapping"):
        compiled(q, k, v)


def test_other_softmax_between_products_is_not_called_attention():
    """A softmax whose input comes from no matmul (a router's, say) feeding a bmm is not reported as attention."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    e = g.call_function(aten.exp.default, (x,))
    s = g.call_function(aten.sum.dim_IntList, (e, [-1], True))
    p = g.call_function(aten.div.Tensor, (e, s))
    out = g.call_function(aten.bmm.default, (p, w))
    g.output(out)
    assert match_attention.read_eager_attention(out) is None


# --- the CUDA (and other device) forms, as graphs --------------------------------------------------------------


def _run_pass(gm: torch.fx.GraphModule):
    ctx = PassContext(options=RubinOptions.resolve({}), target=RubinOptions.resolve({}).resolved_target())
    result = match_attention.run(gm.graph, ctx)
    gm.recompile()
    return result


def _trace(fn, *args) -> torch.fx.GraphModule:
    """``fn``'s ops as one graph, each node with the fake value Inductor would have recorded (CUDA-only SDPA ops
    propagate through their meta functions, so no GPU is needed; the composite op is kept, not decomposed)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = torch.fx.symbolic_trace(fn)
    with torch._subclasses.FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(a) for a in args))
    return gm


Q, KV = (2, 4, 8, 16), (2, 2, 8, 16)  # GQA shapes; MHA forms read key / value with 4 heads


def _both(result):
    return result[0], result[1]


CUDA_FORMS = {  # name -> (ATen form in the report, graph, SDPA semantics it must keep, key/value shape)
    "flash": (
        "aten._scaled_dot_product_flash_attention",
        lambda q, k, v, b: aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, True, scale=0.2)[0],
        lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2),
        Q,
    ),
    "efficient": (
        "aten._scaled_dot_product_efficient_attention",
        lambda q, k, v, b: aten._scaled_dot_product_efficient_attention.default(q, k, v, b, True)[0],
        lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b),
        Q,
    ),
    "cudnn": (
        "aten._scaled_dot_product_cudnn_attention",
        lambda q, k, v, b: aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, False, 0.0, True)[0],
        lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        Q,
    ),
    "overrideable": (
        "aten._scaled_dot_product_fused_attention_overrideable",
        lambda q, k, v, b: aten._scaled_dot_product_fused_attention_overrideable.default(q, k, v, b)[0],
        lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b),
        Q,
    ),
    "composite_gqa": (
        "aten.scaled_dot_product_attention",
        lambda q, k, v, b: aten.scaled_dot_product_attention.default(q, k, v, b, enable_gqa=True),
        lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b, enable_gqa=True),
        KV,
    ),
}


@pytest.mark.parametrize("form", list(CUDA_FORMS))
def test_device_forms_rewritten(form):
    op, build, semantics, kv = CUDA_FORMS[form]
    args = (torch.randn(Q), torch.randn(kv), torch.randn(kv), torch.randn(2, 4, 8, 8))
    gm = _trace(build, *args)
    result = _run_pass(gm)
    assert result.unchanged == [] and len(result.rewrites) == 1
    assert result.rewrites[0].details["form"] == op
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.rubin.attention.default]  # the op and its getitems are gone
    fresh = tuple(torch.randn_like(a) for a in args)
    assert_close_to_eager(gm(*fresh), semantics(*fresh))


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda q, k, v: aten._scaled_dot_product_flash_attention.default(q, k, v, 0.1, True)[0], "dropout_p=0.1"),
        (
            lambda q, k, v: aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, False, True)[0],
            "return_debug_mask",
        ),
        (
            lambda q, k, v: _both(aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True)),
            "log_sumexp output is used",
        ),
        (lambda q, k, v: aten.scaled_dot_product_attention.default(q[0], k[0], v[0]), "query is 3-D"),
    ],
    ids=["dropout", "debug_mask", "logsumexp_used", "three_d"],
)
def test_device_form_near_misses(build, reason):
    """Dropout, a debug mask, a used logsumexp, a 3-D batch: left as they are, each with its reason."""
    gm = _trace(build, *(torch.randn(2, 4, 8, 16) for _ in range(3)))
    result = _run_pass(gm)
    assert result.rewrites == [] and not result.changed
    (left,) = result.unchanged
    assert reason in left.reason, left.reason


# --- what the report says of vLLM's attention, per target (the engine test sees one target) ------------------------


@pytest.mark.parametrize(
    "target, query, kv_cache, expect",
    [
        (
            "sm107",
            "bfloat16",
            "auto",
            [
                "would prefer flashinfer_trtllm",
                "trtllm-gen",
                "(vLLM runs FLASH_ATTN now)",
                "with an FP8 KV cache it would run flashinfer_trtllm FP8 attention: "
                "--kv-cache-dtype fp8 --attention-backend FLASHINFER",
            ],
        ),
        ("sm107", "bfloat16", "fp8", ["would prefer flashinfer_trtllm"]),
        (
            "sm107",
            "float32",
            "auto",
            [
                "no attention kernel for this layer's float32",
                "activations in float32",
                "a bfloat16 model would run flashinfer_trtllm",
            ],
        ),
        (
            "sm90",
            "bfloat16",
            "auto",
            ["would prefer flashinfer_fa3", "with an FP8 KV cache it would run flashinfer_fa2 FP8 attention"],
        ),
        ("cpu", "bfloat16", "auto", ["target cpu has no GPU attention kernel; vLLM's CPU backend is the one to run"]),
    ],
)
@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="the expected preferences come from FlashInfer's declarations (tests/run.sh installs it)",
)
def test_kept_vllm_attention_note_per_target(target, query, kv_cache, expect):
    """A recorded vLLM attention layer (as read_vllm_attention builds it from the layer object, through the
    vLLM engine adapter) and what the kernel registry says the target would run: on Blackwell / Rubin trtllm-gen, whose FP8 attention needs an
    FP8 KV cache and the FlashInfer backend; FA3 on Hopper (FP8 KV on FA2: FA3 wants an FP8 query)."""
    record = {
        "node": "auto_functionalized_1",
        "op": "vllm::unified_attention_with_output",
        "layer": "model.layers.0.self_attn.attn",
        "backend": "FLASH_ATTN",
        "kernel": BACKEND_KERNELS["FLASH_ATTN"],
        "query_dtype": query,
        "kv_cache_dtype": kv_cache,
        "kv_cache_torch_dtype": "float8_e4m3fn" if kv_cache == "fp8" else query,
        "num_heads": 32,
        "num_kv_heads": 8,
        "head_size": 128,
    }
    options = RubinOptions.resolve({"target": target})
    record["target_preference"] = match_attention._target_preference(
        record, PassContext(options=options, target=options.resolved_target(), engine=VllmEngine())
    )
    note = match_attention.describe_kept(record)
    assert note.startswith("kept vLLM's attention at auto_functionalized_1") and "stay vLLM's" in note
    for text in expect:
        assert text in note, note
    if kv_cache == "fp8":
        assert "with an FP8 KV cache" not in note  # it has one
