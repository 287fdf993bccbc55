"""FP4 weights in the canonical ops (ops/fp4.py), ``rubin.dequantize`` (ops/quantized.py), and the matchers folding it
into ``rubin.moe`` / ``rubin.gemm`` with the weights as stored."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rubin_compile.ops import fp4
from rubin_compile.ops.gemm import GemmArgs, GemmArgumentError
from rubin_compile.ops.gemm import reference as gemm_reference
from rubin_compile.ops.moe import MoEArgs, MoEArgumentError
from rubin_compile.ops.moe import reference as moe_reference
from rubin_compile.ops.quantized import DequantizeArgumentError, quantize_weight, shared_global_scale

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "standalone_moe.py"


def test_e2m1_codes_decode_to_their_values_and_pack_low_nibble_first():
    codes = torch.arange(16, dtype=torch.uint8)
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert fp4.decode(codes).tolist() == want
    packed = torch.tensor([[0x2F]], dtype=torch.uint8)  # low nibble 0xF (-6.0) is element 0, high 0x2 (1.0) element 1
    assert fp4.unpack(packed).tolist() == [[-6.0, 1.0]]
    assert fp4.pack(torch.tensor([[15, 2]], dtype=torch.uint8)).tolist() == [[0x2F]]


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_quantize_then_dequantize(kind):
    torch.manual_seed(0)
    w = torch.randn(4, 48, 64)
    packed, scale, scale_2 = fp4.quantize(w, kind, per_leading_dim=True)
    block = fp4.block_size(kind)
    assert packed.shape == (4, 48, 32) and scale.shape == (4, 48, 64 // block) and scale.dtype == fp4.scale_dtype(kind)
    assert (scale_2 is None) == (kind == "mxfp4")
    d = fp4.dequantize(packed, scale, scale_2, torch.float32)
    rel = ((d - w).norm() / w.norm()).item()
    assert rel < 0.15, rel  # 4-bit values: about 10% relative error on Gaussian weights
    # the dequantised values are exactly code * block scale * global scale
    s = fp4.block_scales(scale, kind).repeat_interleave(block, -1)
    g = scale_2.reshape(4, 1, 1) if scale_2 is not None else 1.0
    torch.testing.assert_close(d, fp4.unpack(packed) * s * g, rtol=0, atol=0)


def _fp4_moe_args(kind, T=5, E=4, H=64, inter=32, k=2):
    torch.manual_seed(1)
    x = torch.randn(T, H)
    w13 = torch.randn(E, 2 * inter, H) * 0.1
    w2 = torch.randn(E, H, inter) * 0.1
    q13, s13, g13 = fp4.quantize(w13, kind, per_leading_dim=True)
    q2, s2, g2 = fp4.quantize(w2, kind, per_leading_dim=True)
    ids = torch.randint(0, E, (T, k))
    tw = torch.rand(T, k)
    args = MoEArgs(x, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2, w13_scale_2=g13, w2_scale_2=g2)
    plain = MoEArgs(x, fp4.dequantize(q13, s13, g13, torch.float32), fp4.dequantize(q2, s2, g2, torch.float32), tw, ids)
    return args, plain


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_moe_reference_on_fp4_weights_is_the_dequantised_moe(kind):
    args, plain = _fp4_moe_args(kind)
    assert args.fp4 == kind and (args.H, args.I) == (64, 32)
    torch.testing.assert_close(moe_reference(args), moe_reference(plain), rtol=0, atol=0)


def test_moe_fp4_argument_errors_name_the_fix():
    args, _ = _fp4_moe_args("nvfp4")
    with pytest.raises(MoEArgumentError, match="w13_scale_2"):
        MoEArgs(args.hidden_states, args.w13, args.w2, args.topk_weights, args.topk_ids, w13_scale=args.w13_scale,
                w2_scale=args.w2_scale, w2_scale_2=args.w2_scale_2)  # fmt: skip
    with pytest.raises(MoEArgumentError, match="float8_e4m3fn per 16"):
        MoEArgs(args.hidden_states, args.w13, args.w2, args.topk_weights, args.topk_ids,
                w13_scale=args.w13_scale.float(), w2_scale=args.w2_scale)  # fmt: skip
    with pytest.raises(MoEArgumentError, match="w13_scale must be"):
        MoEArgs(args.hidden_states, args.w13, args.w2, args.topk_weights, args.topk_ids,
                w13_scale=args.w13_scale[:, :, :2], w2_scale=args.w2_scale, w13_scale_2=args.w13_scale_2,
                w2_scale_2=args.w2_scale_2)  # fmt: skip
    _, plain = _fp4_moe_args("nvfp4")
    with pytest.raises(MoEArgumentError, match="a13_scale .* is for FP8 per-tensor and FP4 weights"):
        MoEArgs(plain.hidden_states, plain.w13, plain.w2, plain.topk_weights, plain.topk_ids, a13_scale=torch.ones(()))


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_gemm_reference_on_fp4_weights(kind):
    torch.manual_seed(2)
    a = torch.randn(3, 64, dtype=torch.bfloat16)
    W = torch.randn(40, 64)
    q, s, g = fp4.quantize(W, kind)
    args = GemmArgs(a, q.t(), b_scale=s.t(), b_scale_2=g)
    assert args.fp4 == kind and (args.M, args.N, args.K) == (3, 40, 64)
    want = (a.float() @ fp4.dequantize(q, s, g, torch.float32).t()).to(torch.bfloat16)
    torch.testing.assert_close(gemm_reference(args), want, rtol=0, atol=0)
    with pytest.raises(GemmArgumentError, match="K/2"):
        GemmArgs(a[:, :32], q.t(), b_scale=s.t(), b_scale_2=g)


def test_dequantize_op_matches_its_formats_and_rejects_bad_scales():
    torch.manual_seed(3)
    W = torch.randn(256, 256)
    for fmt, tol in (("fp8_tensor", 0.07), ("fp8_block", 0.07), ("nvfp4", 0.15), ("mxfp4", 0.15)):
        parts = quantize_weight(W, fmt)
        d = torch.ops.rubin.dequantize(
            parts["weight"], parts["scale"], parts.get("scale_2"), format=fmt, dtype=torch.float32
        )
        assert d.shape == W.shape and ((d - W).norm() / W.norm()).item() < tol, fmt
    parts = quantize_weight(W, "fp8_block")
    with pytest.raises(DequantizeArgumentError, match=r"\[ceil\(N/128\), ceil\(K/128\)\]"):
        torch.ops.rubin.dequantize(parts["weight"], parts["scale"][:1], format="fp8_block")
    nv = quantize_weight(W, "nvfp4")
    with pytest.raises(DequantizeArgumentError, match="NVFP4 needs scale_2"):
        torch.ops.rubin.dequantize(nv["weight"], nv["scale"], format="nvfp4")
    shared = shared_global_scale(W, 2 * W)
    assert quantize_weight(W, "nvfp4", shared)["scale_2"] is shared


def _example():
    spec = importlib.util.spec_from_file_location("standalone_moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block"])
def test_quantised_example_is_folded_and_exact(fmt, rubin_run):
    """The example's quantised model (fp32 dequantisation) compiled with rubin: every expert loop and projection is
    rewritten with the quantised weights as stored, and the logits equal eager's (fp32)."""
    ex = _example()
    torch.manual_seed(0)
    model = ex.TinyMoEModel(inter=128).eval()
    tokens = torch.randint(0, 512, (2, 16))
    model = ex.quantize_model(model, fmt, tokens)
    with torch.no_grad():
        want = model(tokens)
        got = rubin_run.compile(model)(tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    moes = rubin_run.rewrites("match_moe")
    assert len(moes) == 2 and all(f"{fmt} weights read as stored" in r["details"]["weights"] for r in moes)
    gemms = [r for r in rubin_run.rewrites("match_gemm") if "rubin.dequantize" in r["details"]["b_layout"]]
    if fmt == "nvfp4":  # q/k/v and o of both layers (the LM head is not quantised), folded as stored
        assert len(gemms) == 4
        assert "torch.ops.rubin.dequantize" not in rubin_run.final_code()
    else:  # rubin.gemm's weight-only FP8 takes bf16 / fp16 activations: fp32 projections stay, with the reason
        assert not gemms
        reasons = [u["reason"] for u in rubin_run.unchanged("match_gemm")]
        assert sum("a dequantised fp8_block weight times torch.float32" in r for r in reasons) == 4, reasons


class _TwoScaleExpertModel(nn.Module):
    """An expert loop whose gate and up projections carry their own NVFP4 global scales: rubin.moe has one per expert
    for w13, so the loop stays as written, with that reason."""

    def __init__(self, E=4, H=64, inter=32, k=2):
        super().__init__()
        torch.manual_seed(4)
        self.router = nn.Linear(H, E, bias=False)
        self.k = k
        for e in range(E):
            for name, shape in (("g", (inter, H)), ("u", (inter, H)), ("d", (H, inter))):
                parts = quantize_weight(torch.randn(shape) * 0.1, "nvfp4")
                for key, t in parts.items():
                    self.register_buffer(f"{name}{e}_{key}", t)
        self.E = E

    def _w(self, name, e):
        return torch.ops.rubin.dequantize(
            getattr(self, f"{name}{e}_weight"), getattr(self, f"{name}{e}_scale"), getattr(self, f"{name}{e}_scale_2"),
            format="nvfp4", dtype=torch.float32,
        )  # fmt: skip

    def forward(self, x):
        w, ids = torch.topk(self.router(x).softmax(-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.E):
            h = F.silu(F.linear(x, self._w("g", e))) * F.linear(x, self._w("u", e))
            out = out + (w * (ids == e)).sum(-1, keepdim=True) * F.linear(h, self._w("d", e))
        return out


def test_gate_and_up_with_different_global_scales_stay_with_the_reason(rubin_run):
    model = _TwoScaleExpertModel().eval()
    x = torch.randn(6, 64)
    with torch.no_grad():
        torch.testing.assert_close(rubin_run.compile(model)(x), model(x), rtol=1e-5, atol=1e-5)
    reasons = " ".join(u["reason"] for u in rubin_run.unchanged("match_moe"))
    assert "different nvfp4 scale_2s" in reasons, reasons
