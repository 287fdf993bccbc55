"""The small-M Triton GEMM (rubin_compile/kernels/triton/gemm.py) on the GPU: every weight format and epilogue
against the float32 reference, split-K and not, with the first weight tile loaded before the wait and without;
PDL on and off (and the early tile) bitwise equal under CUDA-graph replay with fresh inputs; split-K
deterministic; the cuBLAS fallback's epilogues; and, compiled with rubin, selection binding it and fused
q / k / v projections equal to the separate ones."""

from __future__ import annotations

import math

import pytest
import torch

from rubin_compile.ops.gemm import GemmArgs, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="built for sm_90+"
)


def _args(M, N, K, wfmt, epilogue="none", bias=False, act=torch.bfloat16, seed=0) -> GemmArgs:
    """Random call: ``wfmt`` bf16 / fp16 / fp8_tensor / fp8_column / fp8_block (weight-only FP8) or
    ``a8_tensor`` / ``a8_row`` / ``a8_group`` (W8A8, block-scaled weights with the group scales)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((M, K), generator=g, device="cuda").to(act)
    W = torch.randn((N, K), generator=g, device="cuda") / math.sqrt(K)
    kw = {}
    if wfmt in ("bf16", "fp16"):
        b = W.to(act).t()
    else:
        b = (W * 64).clamp(-448, 448).to(torch.float8_e4m3fn).t()
        kind = wfmt.split("_")[1]
        if wfmt.startswith("a8"):
            x = (x.float() * 16).to(torch.float8_e4m3fn)
            kw["out_dtype"] = act
            kw["a_scale"] = {
                "tensor": torch.full((), 1 / 16, device="cuda"),
                "row": torch.rand((M, 1), generator=g, device="cuda") / 16 + 0.01,
                "group": torch.rand((M, -(-K // 128)), generator=g, device="cuda") / 16 + 0.01,
            }[kind]
            kind = {"tensor": "tensor", "row": "column", "group": "block"}[kind]
        kw["b_scale"] = {
            "tensor": torch.full((), 1 / 64, device="cuda"),
            "column": torch.rand((1, N), generator=g, device="cuda") / 64 + 1e-3,
            "block": (torch.rand((-(-N // 128), -(-K // 128)), generator=g, device="cuda") / 64 + 1e-3).t(),
        }[kind]
    if bias:
        kw["bias"] = torch.randn((N,), generator=g, device="cuda").to(act)
    if epilogue == "residual_add":
        kw["residual"] = torch.randn((M, N), generator=g, device="cuda").to(act)
    return GemmArgs(x, b, epilogue=epilogue, **kw)


def _check(got: torch.Tensor, args: GemmArgs) -> None:
    want = reference(args).float()
    assert got.shape == want.shape and got.dtype == args.result_dtype
    err = (got.float() - want).abs().max().item()
    scale = want.abs().max().item()
    # fp32 accumulation in a different order, then the same roundings: a few units in the last place of bf16
    assert err <= 2e-2 * scale + 1e-2, f"max error {err} at output scale {scale}"


FORMATS = ["bf16", "fp16", "fp8_tensor", "fp8_column", "fp8_block", "a8_tensor", "a8_row", "a8_group"]
EPILOGUES = ["none", "silu_and_mul", "gelu_tanh_and_mul", "residual_add"]


@needs_sm90
@pytest.mark.parametrize("wfmt", FORMATS)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("split", [1, 4])
def test_formats_and_epilogues(wfmt, epilogue, split):
    from rubin_compile.kernels.triton import gemm as G

    act = torch.float16 if wfmt == "fp16" else torch.bfloat16
    args = _args(5, 384, 1000, wfmt, epilogue, bias=epilogue != "residual_add", act=act)
    cfg = G.GemmConfig(block_n=32, block_k=128, split_k=split, num_warps=4, num_stages=3)
    _check(G.launch(args, cfg, pdl=True), args)


@needs_sm90
@pytest.mark.parametrize("wfmt", FORMATS)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("split,early", [(1, False), (4, False), (3, True)])
def test_gemv_form(wfmt, epilogue, split, early):
    """The reduction (GEMV) form (M <= 4): right for every format and epilogue, split and not, with the early
    tile; M = 3 pads to 4 rows. A 64-column tile with block scales and 96 gated columns straddles a scale block
    and runs the FMA form instead (launch's rule); the result is the same either way."""
    from rubin_compile.kernels.triton import gemm as G

    act = torch.float16 if wfmt == "fp16" else torch.bfloat16
    for M, block_n, N in ((1, 16, 384), (3, 32, 384), (2, 64, 192)):
        args = _args(M, N, 1000, wfmt, epilogue, bias=epilogue != "residual_add", act=act)
        cfg = G.GemmConfig(block_n=block_n, block_k=128, split_k=split, num_warps=4, num_stages=1, mma=False,
                           gemv=True, early=early)  # fmt: skip
        _check(G.launch(args, cfg, pdl=True), args)


@needs_sm90
@pytest.mark.parametrize("wfmt", FORMATS)
@pytest.mark.parametrize("split", [1, 3])
def test_early_weight_tile(wfmt, split):
    """The first weight tile loaded before the wait: right for every format, gated and residual epilogues."""
    from rubin_compile.kernels.triton import gemm as G

    act = torch.float16 if wfmt == "fp16" else torch.bfloat16
    for epilogue in ("silu_and_mul", "residual_add"):
        args = _args(3, 384, 1000, wfmt, epilogue, bias=epilogue != "residual_add", act=act)
        cfg = G.GemmConfig(block_n=32, block_k=128, split_k=split, num_warps=4, num_stages=3, early=True)
        _check(G.launch(args, cfg, pdl=True), args)


@needs_sm90
@pytest.mark.parametrize("M", [1, 3, 16, 33, 64, 100])
@pytest.mark.parametrize("wfmt", ["bf16", "fp8_block"])
def test_row_counts_and_heuristic(M, wfmt):
    """Every M the kernel takes (one M tile up to 64; several above) with the heuristic's config, N and K
    not multiples of the tiles."""
    from rubin_compile.kernels.triton import gemm as G

    N, K = 1000, 2100
    args = _args(M, N, K, wfmt, bias=True)
    _check(G.launch(args, G.heuristic(M, N, K, wfmt)), args)


def _graph_outputs(args_of, cfg, pdl: bool, rounds: int = 3):
    """Capture three back-to-back calls in a CUDA graph, replay with fresh inputs, return every output."""
    from rubin_compile.kernels.triton import gemm as G

    static = [args_of(0) for _ in range(3)]
    outs = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for a in static:
            G.launch(a, cfg, pdl=pdl)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [G.launch(a, cfg, pdl=pdl) for a in static]
    for r in range(rounds):
        for i, a in enumerate(static):
            fresh = args_of(100 * r + i + 1)
            a.a.copy_(fresh.a)
            if a.residual is not None:
                a.residual.copy_(fresh.residual)
        graph.replay()
        torch.cuda.synchronize()
        outs.append([y.clone() for y in ys])
    _check(outs[-1][-1], static[-1])  # the last replay computed the fresh inputs (static holds them now)
    return outs


@needs_sm90
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("wfmt,epilogue", [("bf16", "residual_add"), ("fp8_block", "silu_and_mul")])
def test_pdl_bitwise_under_graph_replay(split, wfmt, epilogue):
    from rubin_compile.kernels.triton import gemm as G

    def args_of(seed):
        return _args(4, 512, 1536, wfmt, epilogue, seed=seed)

    cfg = G.GemmConfig(block_n=32, block_k=128, split_k=split, num_warps=4, num_stages=4, prefetch=True)
    on = _graph_outputs(args_of, cfg, True)
    off = _graph_outputs(args_of, cfg, False)
    # the first weight tile loaded before the wait: the same sums in the same order, so bitwise the same
    early = _graph_outputs(args_of, G.GemmConfig(**{**cfg.to_json(), "early": True}), True)
    for r_on, r_off, r_early in zip(on, off, early):
        for y_on, y_off, y_early in zip(r_on, r_off, r_early):
            assert torch.equal(y_on, y_off) and torch.equal(y_on, y_early)
    # the reduction (GEMV) form, PDL on and off
    gemv = G.GemmConfig(block_n=16, block_k=128, split_k=split, num_warps=4, num_stages=1, mma=False, gemv=True)
    for r_on, r_off in zip(_graph_outputs(args_of, gemv, True), _graph_outputs(args_of, gemv, False)):
        for y_on, y_off in zip(r_on, r_off):
            assert torch.equal(y_on, y_off)


@needs_sm90
def test_split_k_deterministic():
    from rubin_compile.kernels.triton import gemm as G

    args = _args(8, 256, 8192, "bf16", bias=True)
    cfg = G.GemmConfig(block_n=32, block_k=128, split_k=16)
    first = G.launch(args, cfg)
    for _ in range(5):
        assert torch.equal(G.launch(args, cfg), first)


@needs_sm90
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_fallback_epilogues(epilogue):
    """M > 64 (and the table's cuBLAS entries) run cuBLAS with the epilogue in one more pass."""
    from rubin_compile.kernels.triton import gemm as G

    for bias in (False, True):
        args = _args(200, 512, 768, "bf16", epilogue, bias=bias)
        choice = G.choose(200, 512, 768, "bf16")
        assert choice.kernel == "cublas"
        _check(G.run(args, choice=choice), args)


@needs_sm90
def test_compiled_linear_binds_triton_and_matches(rubin_run):
    """A decode-sized linear compiled for this GPU under CUDA graphs is bound to the kernel this GPU's GEMM table
    picks (the H200's: ours, which wins at M = 1 for this shape; a GPU without a table: cuBLAS, by the rule) and
    gives the eager result; without CUDA graphs cuBLAS runs it (our adapter's host cost would outweigh the GPU time
    it saves)."""
    from rubin_compile.kernels.triton import gemm as G

    name = torch.cuda.get_device_name()
    want_kernel = {"triton": "triton", "cublas": "torch"}[G.choose(1, 5120, 2048, "bf16", name).kernel]
    if name == "NVIDIA H200":  # the measured table is committed: the pick is ours
        assert want_kernel == "triton", G.choose(1, 5120, 2048, "bf16", name).describe()
    lin = torch.nn.Linear(2048, 5120, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)

    def kernels() -> list[str]:
        return [
            p["kernel"]
            for rep in rubin_run.reports()
            for ps in rep["passes"]
            if ps["name"] == "select_kernels"
            for p in ps["plans"]
        ]

    with torch.no_grad():
        want = lin(x)
        got = rubin_run.compile(lin, cudagraphs=True)(x).clone()
    assert kernels() == [want_kernel], name
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        rubin_run.compile(lin)(x)
    assert kernels()[-1] == "torch"


class QKV(torch.nn.Module):
    """Qwen3-30B-A3B's q / k / v projections, reading one input."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(2048, 4096, bias=False)
        self.k = torch.nn.Linear(2048, 512, bias=False)
        self.v = torch.nn.Linear(2048, 512, bias=False)

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


@needs_sm90
def test_fused_projections_match_separate(rubin_run):
    """q / k / v linears sharing an input: fused into one rubin.gemm, the outputs equal the separate ones."""

    m = QKV().to("cuda", torch.bfloat16)
    x = torch.randn(2, 1, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fused = rubin_run.compile(m, fuse_projections="on")(x)
        joined = rubin_run.rewrites("fuse_projections")
        # what the passes said. The intermittent failure under pytest -n 8 (2 of 3 joined) had the cause of
        # test_select_kernels_gpu.py's: Inductor's pad_mm padding some of the M = 2 mm's by a benchmark (now off)
        said = {p: rubin_run.notes(p) for p in ("match_gemm", "fuse_projections")}
        said["graphs"] = [r["graph_id"] for r in rubin_run.reports()]
        separate = rubin_run.compile(m, fuse_projections="off")(x)
    assert len(joined) == 1 and len(joined[0]["replaced"]) == 3, (joined, said)
    for f, s in zip(fused, separate):
        torch.testing.assert_close(f, s, rtol=2e-2, atol=2e-2)


@needs_sm90
@pytest.mark.parametrize("graphs", ["trees", "external"])
def test_fused_projections_under_cuda_graphs(rubin_run, graphs):
    """q / k / v fused under CUDA graphs: cudagraph trees (mode="reduce-overhead") record with the stacked copy
    alive (it is made outside their pool: before, recording failed with "tensors in the cudagraph pool not
    tracked as outputs"), and a graph the caller captures itself (cudagraphs="external") replays it; each replay
    on fresh inputs equals the eager model."""
    from rubin_compile.ops import weights

    weights.clear_cache()
    m = QKV().to("cuda", torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        if graphs == "trees":
            compiled = rubin_run.compile(m, cudagraphs=True)
            for _ in range(3):  # warm-up, record, replay
                x.copy_(torch.randn_like(x))
                got = [t.clone() for t in compiled(x)]
                for g, w in zip(got, m(x)):
                    torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
        else:
            compiled = rubin_run.compile(m, cudagraphs="external")
            compiled(x)  # the first call prepares the stacked copy and compiles the kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = compiled(x)
            for _ in range(2):
                x.copy_(torch.randn_like(x))
                graph.replay()
                for g, w in zip(outs, m(x)):
                    torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    joined = rubin_run.rewrites("fuse_projections")
    assert len(joined) == 1 and len(joined[0]["replaced"]) == 3, joined
    assert weights.cache_info()["entries"] == 1
