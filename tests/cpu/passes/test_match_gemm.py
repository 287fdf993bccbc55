"""match_gemm: linear layers (mm / addmm / FP8 _scaled_mm) with their epilogues become rubin.gemm; routers,
products of activations and in-graph weights are left to Inductor with a note; near misses keep the product
rewritten and the epilogue in ATen, with the reason.

Numerics: compiled against eager on fresh random inputs (fp32 1e-4, bf16 2e-2 of the output's scale; bf16
whole models against Inductor alone, see tests/cpu/passes/hf_models.py). On the CPU rubin.gemm runs torch.mm /
addmm, as the source graph did.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conftest import ROWWISE_SKIP, assert_close_to_eager, count_ops
from tests.cpu.passes import hf_models

FP32, BF16 = pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")
E4M3 = torch.float8_e4m3fn


def epilogues(rewrites: list[dict]) -> list[str]:
    return [r["details"]["epilogue"] for r in rewrites]


# --- Hugging Face models ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_qwen3_moe_linear_layers(dtype):
    """Layer 0 MoE (router left to Inductor, experts already rubin.moe), layer 1 dense (separate gate / up /
    down projections); q / k / v / o and lm_head projections; the residual adds fold into o_proj / down_proj."""
    pytest.importorskip("transformers")
    run = hf_models.run("qwen3_moe", dtype)
    for got, want in run.outputs:
        hf_models.assert_close_to_eager(got, want, dtype)
    result = run.result("match_gemm")
    assert result["unchanged"] == []
    # per layer q, k, v, o (+ residual); layer 1 gate, up, down (+ residual); lm_head
    assert sorted(epilogues(result["rewrites"])) == sorted(
        ["none"] * 3 * 2 + ["residual_add"] * 2 + ["none", "none", "residual_add"] + ["none"]
    )
    for r in result["rewrites"]:
        assert r["details"]["b_layout"].startswith("weight.t()") and r["details"]["bias"] is False
    (router_note,) = [n for n in result["notes"] if "router" in n]
    assert "1 MoE router product" in router_note and "top-k" in router_note
    before, after = run.stage_code("match_attention"), run.stage_code("match_gemm")
    assert count_ops(before, "aten.mm") == 13 and count_ops(before, "rubin.gemm") == 0
    assert count_ops(after, "aten.mm") == 1  # the router
    assert count_ops(after, "rubin.gemm") == 12 and count_ops(after, "rubin.moe") == 1  # experts counted once


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_phi3_fused_gate_up_silu_and_mul(dtype):
    """Phi-3's gate_up_proj split by chunk(2) and written ``up * silu(gate)``; its fused qkv_proj (sliced in
    three, not an epilogue) is a plain product."""
    pytest.importorskip("transformers")
    run = hf_models.run("phi3", dtype)
    for got, want in run.outputs:
        hf_models.assert_close_to_eager(got, want, dtype)
    result = run.result("match_gemm")
    assert result["unchanged"] == [] and result["notes"] == []
    layer = ["none", "residual_add", "silu_and_mul", "residual_add"]  # qkv, o, gate_up, down
    assert epilogues(result["rewrites"]) == layer * hf_models.LAYERS + ["none"]  # + lm_head
    before, after = run.stage_code("match_attention"), run.stage_code("match_gemm")
    assert count_ops(before, "aten.mm") == 4 * hf_models.LAYERS + 1 and count_ops(after, "aten.mm") == 0
    assert count_ops(after, "rubin.gemm") == 4 * hf_models.LAYERS + 1
    assert count_ops(before, "aten.split") == hf_models.LAYERS and count_ops(after, "aten.split") == 0  # chunk(2)


# --- plain PyTorch: vLLM-style MLPs, and what is left to Inductor -------------------------------------------------


class Block(nn.Module):
    """One graph with every linear idiom: vLLM's gate_up + SiluAndMul (slices), a GELU-tanh gated MLP with
    biases, residual adds; a router, a product of two activations and an in-graph dequantised weight."""

    def __init__(self, hidden=32, inter=48, experts=8):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=True)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.gate_up2 = nn.Linear(hidden, 2 * inter, bias=True)
        self.down2 = nn.Linear(inter, hidden, bias=True)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.register_buffer("w_int8", torch.randint(-8, 8, (hidden, hidden), dtype=torch.int8))
        self.register_buffer("w_scale", torch.rand(hidden, 1) * 0.05)
        self.inter = inter

    def forward(self, x):
        d = self.inter
        h = self.gate_up(x)
        x = x + self.down(F.silu(h[..., :d]) * h[..., d:])  # vLLM SiluAndMul.forward_native
        g, u = self.gate_up2(x).chunk(2, dim=-1)
        x = self.down2(F.gelu(g, approximate="tanh") * u) + x  # residual on the right
        weights, ids = torch.topk(torch.softmax(self.router(x), -1), 2)  # a router: left to Inductor
        attn = torch.softmax(x @ x.transpose(-2, -1), -1) @ x  # activations x activations (3-D: bmm)
        deq = x @ (self.w_int8.to(x.dtype) * self.w_scale.to(x.dtype)).t()  # weight dequantised in the graph
        return x + attn + deq, weights, ids


def run_block(rubin_run, dtype, block=None, tokens=(5,), dynamic=None, cast=True, **options):
    block = block or Block()
    block = (block.to(dtype) if cast else block).eval()
    torch._dynamo.reset()
    compiled = torch.compile(
        block, backend="rubin", dynamic=dynamic, options={"dump_dir": str(rubin_run.dump_dir), **options}
    )
    with torch.no_grad():
        for t in tokens:
            x = torch.randn(2, t, 32, dtype=dtype)
            got, want = compiled(x), block(x)
            got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
            assert_close_to_eager(got, want, dtype)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_block_epilogues_and_policy(rubin_run, dtype):
    run_block(rubin_run, dtype)
    rewrites = rubin_run.rewrites("match_gemm")
    assert rubin_run.unchanged("match_gemm") == []
    assert epilogues(rewrites) == ["silu_and_mul", "residual_add", "gelu_tanh_and_mul", "residual_add"]
    assert [r["details"]["bias"] for r in rewrites] == [True, False, True, True]
    (report,) = rubin_run.reports()
    notes = next(p for p in report["passes"] if p["name"] == "match_gemm")["notes"]
    assert any("1 MoE router product" in n for n in notes), notes
    assert any("1 product(s) whose b is not a weight" in n for n in notes), notes  # the dequantised weight
    code = rubin_run.stage_code("match_gemm")
    assert count_ops(code, "rubin.gemm") == 4 and count_ops(code, "aten.bmm") == 2  # bmm is never touched
    assert count_ops(code, "aten.addmm") == 0 and count_ops(code, "aten.tanh") == 0 and count_ops(code, "aten.neg") == 0
    # bound to the reference on the CPU: lowered back to ATen for Inductor (three products with a bias)
    final = rubin_run.final_code()
    assert count_ops(final, "rubin.gemm") == 0 and count_ops(final, "aten.addmm") == 3
    assert count_ops(final, "aten.mm") == count_ops(code, "aten.mm") + 1  # router and the dequantised product stay
    plans = [
        pl
        for pl in next(p for p in report["passes"] if p["name"] == "select_kernels")["plans"]
        if pl["canonical_op"] == "rubin.gemm"
    ]
    assert len(plans) == 4 and all(pl["lowered"] == "aten" for pl in plans)


def test_dynamic_token_count(rubin_run):
    run_block(rubin_run, torch.float32, tokens=(5, 9), dynamic=True)
    rewrites = rubin_run.rewrites("match_gemm")
    assert len(rewrites) == 4 and all(isinstance(r["details"]["M"], str) for r in rewrites)  # symbolic M
    assert rubin_run.unchanged("match_gemm") == []


# --- FP8 ----------------------------------------------------------------------------------------------------------


class Fp8Linear(nn.Module):
    """A static FP8 W8A8 linear as vLLM's Fp8LinearMethod runs it through torch._scaled_mm: the activation
    quantised in the graph, the weight stored FP8 [N, K] and passed transposed."""

    def __init__(self, k=32, n=48, rowwise=False, out_dtype=torch.bfloat16, bias=True):
        super().__init__()
        self.register_buffer("w", (torch.randn(n, k) * 0.5).to(E4M3))
        self.register_buffer("w_scale", torch.rand(1, n) + 0.5 if rowwise else torch.tensor(0.8))
        self.register_buffer("bias", torch.randn(n, dtype=torch.bfloat16) if bias else None)
        self.rowwise, self.out_dtype = rowwise, out_dtype

    def forward(self, x):
        x = x.reshape(-1, x.shape[-1])
        scale = (x.abs().amax(-1, keepdim=True) if self.rowwise else x.abs().amax()).float() / 448.0
        xq = (x / scale).clamp(-448, 448).to(E4M3)
        return torch._scaled_mm(
            xq, self.w.t(), scale_a=scale, scale_b=self.w_scale, bias=self.bias, out_dtype=self.out_dtype
        )


@pytest.mark.parametrize("rowwise", [False, pytest.param(True, marks=ROWWISE_SKIP)], ids=["per_tensor", "rowwise"])
def test_fp8_scaled_mm(rubin_run, rowwise):
    block = Fp8Linear(rowwise=rowwise)
    compiled = rubin_run.compile(block)
    for _ in range(2):
        x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
        assert_close_to_eager(compiled(x), block(x), torch.bfloat16)
    (r,) = rubin_run.rewrites("match_gemm")
    d = r["details"]
    assert r["source_idiom"] == "fp8 linear (aten._scaled_mm)"
    assert (d["dtype"], d["out_dtype"], d["bias"]) == ("float8_e4m3fn", "bfloat16", True)
    assert d["scales"] == ("a row, b column" if rowwise else "a tensor, b tensor")
    code = rubin_run.stage_code("match_gemm")
    assert count_ops(code, "rubin.gemm") == 1 and count_ops(code, "aten._scaled_mm") == 0
    final = rubin_run.final_code()  # lowered back: the same _scaled_mm the source called
    assert count_ops(final, "rubin.gemm") == 0 and count_ops(final, "aten._scaled_mm") == 1


# --- near misses ----------------------------------------------------------------------------------------------------


class NearMisses(nn.Module):
    """Four linears whose epilogue cannot fold: the gate_up product is also returned; the SiLU output is also
    returned; the residual is fp32 while the product is bf16 (the add promotes); addmm with beta."""

    def __init__(self, hidden=32, inter=16):
        super().__init__()
        self.a = nn.Linear(hidden, 2 * inter, bias=False)
        self.b = nn.Linear(hidden, 2 * inter, bias=False)
        self.c = nn.Linear(hidden, hidden, bias=False).to(torch.bfloat16)
        self.d = nn.Linear(hidden, hidden, bias=True)
        self.inter = inter

    def forward(self, x):
        d = self.inter
        ha = self.a(x)
        ya = F.silu(ha[..., :d]) * ha[..., d:]
        hb = self.b(x)
        sb = F.silu(hb[..., :d])
        yb = sb * hb[..., d:]
        yc = x + self.c(x.to(torch.bfloat16))  # fp32 residual + bf16 product
        yd = torch.addmm(self.d.bias, x.reshape(-1, x.shape[-1]), self.d.weight.t(), beta=0.5)
        return ya, ha, yb, sb, yc, yd


def test_near_misses_keep_the_product_and_say_why(rubin_run):
    run_block(rubin_run, torch.float32, block=NearMisses(), cast=False)
    reasons = sorted(u["reason"] for u in rubin_run.unchanged("match_gemm"))
    assert len(reasons) == 4, reasons
    assert "addmm with beta=0.5" in reasons[0]
    assert "gated epilogue" in reasons[1] and "intermediate of act(gate) * up has a user outside it" in reasons[1]
    assert "residual add" in reasons[2] and "promotes" in reasons[2]
    assert "silu_and_mul epilogue" in reasons[3] and "also read by" in reasons[3]
    # a, b, c are still rubin.gemm (without their epilogue); the addmm with beta stays ATen
    assert epilogues(rubin_run.rewrites("match_gemm")) == ["none", "none", "none"]
    code = rubin_run.stage_code("match_gemm")
    assert count_ops(code, "rubin.gemm") == 3 and count_ops(code, "aten.addmm") == 1


def test_fp8_output_left_unchanged(rubin_run):
    block = Fp8Linear(out_dtype=E4M3, bias=False)
    compiled = rubin_run.compile(block)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    assert torch.equal(compiled(x).float(), block(x).float())
    (left,) = rubin_run.unchanged("match_gemm")
    assert "float8_e4m3fn" in left["reason"] and "bf16 / fp16 / fp32" in left["reason"]
    assert count_ops(rubin_run.final_code(), "aten._scaled_mm") == 1


def test_strict_mode_raises_on_an_epilogue_near_miss(rubin_run):
    lin = nn.Linear(16, 32, bias=False)

    def fn(x):
        h = lin(x)
        return F.silu(h[:, :16]) * h[:, 16:], h

    compiled = rubin_run.compile(fn, strict=True)
    with pytest.raises(Exception, match=r"(?s)rubin \(strict\).*silu_and_mul epilogue"), torch.no_grad():
        compiled(torch.randn(4, 16))


def test_unfused_bias_add_gpu_form():
    """On CUDA Inductor unfuses ``addmm`` whose output feeds pointwise ops into ``mm`` + ``add(bias)``
    (post_grad.py: unfuse_bias_add_to_pointwise); that graph, with SiLU as Inductor decomposes it, folds whole."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from rubin_compile.options import RubinOptions
    from rubin_compile.passes import match_gemm
    from rubin_compile.passes.base import PassContext

    aten = torch.ops.aten

    def graph(x, w, b):
        y = aten.add.Tensor(aten.mm.default(x, aten.permute.default(w, [1, 0])), b)
        gate, up = aten.slice.Tensor(y, 1, 0, 16), aten.slice.Tensor(y, 1, 16, 9223372036854775807)
        return aten.mul.Tensor(aten.div.Tensor(gate, aten.add.Tensor(aten.exp.default(aten.neg.default(gate)), 1)), up)

    args = (torch.randn(6, 24), torch.randn(32, 24), torch.randn(32))
    gm = torch.fx.symbolic_trace(graph)
    with torch._subclasses.FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(a) for a in args))
    options = RubinOptions.resolve({})
    result = match_gemm.run(gm.graph, PassContext(options=options, target=options.resolved_target()))
    gm.recompile()
    (r,) = result.rewrites
    assert r.details["epilogue"] == "silu_and_mul" and r.details["bias"] and r.details["bias_add"]  # add folded
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        aten.permute.default,
        torch.ops.rubin.gemm.default,
    ]
    x, w, b = (torch.randn_like(a) for a in args)
    y = x @ w.t() + b
    assert_close_to_eager(gm(x, w, b), F.silu(y[:, :16]) * y[:, 16:])


class _BiasAfterView(nn.Module):
    """A bias-free linear on [B, S, H] input, then a separate bias add (Qwen3.5-MoE's ``in_proj_a(x) + dt_bias``):
    Inductor leaves mm -> view -> add, and the add is folded into rubin.gemm's bias."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 4, bias=False)
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.lin(x) + self.b


@pytest.mark.parametrize("shape", [(2, 8, 64), (8, 64)], ids=["3d", "2d"])
def test_bias_add_folded_once(rubin_run, shape):
    """Regression (found by the families survey, 2026-12-01): with a 3-D input the folded bias add stayed in the
    graph and read the new node, adding the bias twice (5.5% of the output's scale off on Qwen3.5-MoE)."""
    model = _BiasAfterView().eval()
    x = torch.randn(*shape)
    with torch.no_grad():
        assert_close_to_eager(rubin_run.compile(model)(x), model(x))
    code = rubin_run.final_code()
    assert count_ops(code, "rubin.gemm") == 1 or count_ops(code, "aten.mm") + count_ops(code, "aten.addmm") == 1
