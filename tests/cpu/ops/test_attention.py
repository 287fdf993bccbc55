"""The canonical rubin.attention op: semantics against float64 softmax attention, layout, errors, fake impl."""

from __future__ import annotations

import math

import pytest
import torch

from rubin_compile.ops.attention import AttentionArgumentError, attention_reference


def dense_attention(q, k, v, mask=None, is_causal=False, scale=None):
    """Float64 restatement of the documented semantics, head by head (independent of SDPA)."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    n = Hq // Hkv
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, Hq, S, v.shape[-1], dtype=torch.float64)
    for h in range(Hq):
        s = q[:, h] @ k[:, h // n].transpose(-2, -1) * scale  # query head h reads kv head h // n
        if is_causal:
            s = s.masked_fill(~torch.ones(S, Skv, dtype=torch.bool).tril(), float("-inf"))  # upper-left
        if mask is not None:
            m = mask.expand(B, Hq, S, Skv)[:, h]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
        out[:, h] = torch.softmax(s, -1) @ v[:, h // n]
    return out


def make(B=2, Hq=4, Hkv=2, S=5, Skv=7, D=8, Dv=8, dtype=torch.float32):
    return (
        torch.randn(B, Hq, S, D, dtype=dtype),
        torch.randn(B, Hkv, Skv, D, dtype=dtype),
        torch.randn(B, Hkv, Skv, Dv, dtype=dtype),
    )


@pytest.mark.parametrize(
    "case", ["plain", "causal", "causal_S_lt_Skv", "bool_mask", "float_mask", "scale", "mha", "mqa", "dv_differs"]
)
def test_reference_matches_documented_semantics(case):
    kw = {
        "Hkv": {"mha": 4, "mqa": 1}.get(case, 2),
        "Dv": 6 if case == "dv_differs" else 8,
        "Skv": 5 if case == "causal" else 7,
    }
    q, k, v = make(**kw)
    mask, is_causal, scale = None, case.startswith("causal"), 0.37 if case == "scale" else None
    if case == "bool_mask":
        mask = torch.rand(2, 1, 5, 7) > 0.3
        mask[..., 0] = True  # no fully masked row
    elif case == "float_mask":
        mask = torch.randn(1, 4, 5, 7)
    got = torch.ops.rubin.attention(q, k, v, mask, is_causal, scale)
    assert got.shape == (2, 4, 5, kw["Dv"]) and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), dense_attention(q, k, v, mask, is_causal, scale), rtol=1e-5, atol=1e-5)


def gpt_oss_eager(q, k, v, sinks, mask=None, scale=None):
    """GPT-OSS's eager attention (transformers' modeling_gpt_oss.eager_attention_forward), float64, head by head."""
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, dim=1).double(), v.repeat_interleave(n, dim=1).double()
    w = q.double() @ k.transpose(2, 3) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else w + mask.double()
    c = torch.cat([w, sinks.double().reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], -1)], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    return torch.softmax(c, dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("case", ["plain", "bool_mask", "float_mask", "causal", "scale", "fully_masked_row"])
def test_sinks_are_gpt_oss_eager_attention(case):
    """With ``sinks`` the op is the model's own eager attention: one more logit per head in the softmax, its column
    dropped. A row that attends to nothing gives zeros (the sink takes all the weight), not NaN."""
    q, k, v = make()
    sinks = torch.randn(4) * 2
    mask, is_causal, scale = None, case == "causal", 0.37 if case == "scale" else None
    if case in ("bool_mask", "fully_masked_row"):
        mask = torch.rand(2, 1, 5, 7) > 0.3
        mask[..., 0] = True
        if case == "fully_masked_row":
            mask[1, 0, 2] = False
    elif case == "float_mask":
        mask = torch.randn(1, 4, 5, 7)
    got = torch.ops.rubin.attention(q, k, v, mask, is_causal, scale, sinks=sinks)
    want_mask = torch.ones(5, 7, dtype=torch.bool).tril() if is_causal else mask
    want = gpt_oss_eager(q, k, v, sinks, want_mask, scale)
    assert torch.isfinite(want).all()  # eager attention with a sink has no NaN rows
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    if case == "fully_masked_row":
        assert got[1, :, 2].abs().max() == 0
    # without sinks: SDPA's semantics (the sink logit at -inf is no sink)
    if case != "fully_masked_row":
        no_sink = torch.ops.rubin.attention(q, k, v, mask, is_causal, scale, sinks=torch.full((4,), float("-inf")))
        torch.testing.assert_close(no_sink, torch.ops.rubin.attention(q, k, v, mask, is_causal, scale))


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_half_precision_close_to_float64(dtype, tol):
    q, k, v = make(dtype=dtype)
    got = torch.ops.rubin.attention(q, k, v, is_causal=True)
    want = dense_attention(q, k, v, is_causal=True)
    assert got.dtype == dtype
    assert (got.double() - want).norm() / want.norm() < tol


def test_same_as_sdpa_with_enable_gqa():
    """The grouping is SDPA's enable_gqa (and HF repeat_kv's): query head h reads kv head h // (Hq / Hkv)."""
    q, k, v = make(Hq=6, Hkv=2, S=7)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(torch.ops.rubin.attention(q, k, v, is_causal=True), want)


def test_output_layout_is_bshd():
    """[B, Hq, S, Dv] laid out as [B, S, Hq, Dv]: out.transpose(1, 2) is contiguous (the fused kernels' layout)."""
    q, k, v = make(Dv=6)
    out = torch.ops.rubin.attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.rubin.attention(*(mode.from_tensor(t) for t in (q, k, v)))
    assert fake.shape == out.shape and fake.stride() == out.stride()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(query=a["query"][0]), "query must be 4-D"),
        (lambda a: a.update(key=a["key"].double()), "share one dtype"),
        (
            lambda a: a.update(
                key=a["key"][:, :1].expand(-1, 3, -1, -1), value=a["value"][:, :1].expand(-1, 3, -1, -1)
            ),
            "must be a multiple of key/value heads",
        ),
        (lambda a: a.update(value=a["value"][:, :, :-1]), "positions but value has"),
        (lambda a: a.update(attn_mask=torch.zeros(2, 4, 5, 7), is_causal=True), "exclusive"),
        (lambda a: a.update(attn_mask=torch.zeros(2, 4, 5, 7, dtype=torch.float64)), "attn_mask must be bool"),
        (lambda a: a.update(attn_mask=torch.zeros(2, 4, 3, 7)), "does not broadcast"),
        (lambda a: a.update(query=a["query"].int(), key=a["key"].int(), value=a["value"].int()), "dtype"),
        (lambda a: a.update(sinks=torch.zeros(2)), r"sinks must be 1-D with a logit per query head \(\[Hq\] = \[4\]\)"),
        (lambda a: a.update(sinks=torch.zeros(1, 4)), "sinks must be 1-D"),
        (lambda a: a.update(sinks=torch.zeros(4, dtype=torch.int32)), "sinks must be a float tensor"),
    ],
)
def test_bad_arguments_are_clear_errors(mutate, message):
    q, k, v = make()
    args = dict(query=q, key=k, value=v)
    mutate(args)
    with pytest.raises(AttentionArgumentError, match=message):
        torch.ops.rubin.attention(**args)
    with pytest.raises(AttentionArgumentError, match=message):
        attention_reference(**args)


def test_fake_impl_and_opcheck():
    q, k, v = make()
    torch.library.opcheck(torch.ops.rubin.attention.default, (q, k, v), {"is_causal": True})
    torch.library.opcheck(torch.ops.rubin.attention.default, (q, k, v), {"attn_mask": torch.randn(2, 1, 5, 7)})
    torch.library.opcheck(torch.ops.rubin.attention.default, (q, k, v), {"sinks": torch.randn(4)})


def test_kernel_spec_for_selection():
    """What select_kernels reads from a rubin.attention node; the registry accepts it for every target."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from rubin_compile.ops.attention import ATTENTION, attention_spec
    from rubin_compile.target import resolve

    q, k, v = make(dtype=torch.bfloat16)
    gm = make_fx(lambda q, k, v: torch.ops.rubin.attention(q, k, v, is_causal=True), tracing_mode="fake")(q, k, v)
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.rubin.attention.default]
    spec = attention_spec(node)
    assert (spec.op, spec.quant, spec.act_dtype, spec.weight_dtype, spec.activation) == (
        "attention",
        "none",
        "bfloat16",
        "bfloat16",
        "causal",
    )
    assert spec.dim("D") == 8 and spec.dim("Hq") == 4 and spec.dim("Hkv") == 2
    for name in ("cpu", "sm90", "sm107"):
        assert ATTENTION.select(spec, resolve(name)).chosen.name  # a kernel, never an exception
    assert ATTENTION.select(spec, resolve("cpu")).chosen.name == "reference"
