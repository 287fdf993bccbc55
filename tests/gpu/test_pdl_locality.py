"""PDL and locality-domain placement on the GPU: results never change, domains stay on their SMs.

* PDL on vs off: bitwise identical over many random inputs, inside CUDA-graph replays (a race would show
  as a moving error), for our kernels alone and for a whole model compiled with backend="rubin".
* split-N vs whole: bitwise identical (each output element is computed by the same tiles in the same K
  order; only which stream and SMs run them changes), for bf16 and FP8 block weights.
* Each domain's kernels run only on its domain's SMs (a probe kernel reads ``%smid``), also when captured
  into a CUDA graph.
* 1000 CUDA-graph replays of the split-N MoE with fresh inputs: no mismatch against the whole form.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_moe_blocks_close, block_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QWEN = dict(E=128, H=2048, I=768, k=8)
DEEPSEEK_TP8 = dict(E=256, H=7168, I=256, k=8)


def _hopper_or_newer() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


needs_sm90 = pytest.mark.skipif(not _hopper_or_newer(), reason="PDL and the Triton MoE kernels need sm_90+")


@pytest.fixture(scope="module")
def tmoe():
    from rubin_compile.kernels.triton import moe

    return moe


def _weights(E, H, I, fp8=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn((E, 2 * I, H), device="cuda", generator=g) / H**0.5
    w2 = torch.randn((E, H, I), device="cuda", generator=g) / I**0.5
    if not fp8:
        return dict(w13=w13.bfloat16(), w2=w2.bfloat16())
    f8 = torch.float8_e4m3fn
    s13 = torch.rand((E, -(-2 * I // 128), -(-H // 128)), device="cuda", generator=g) / 32 + 1e-3
    s2 = torch.rand((E, -(-H // 128), -(-I // 128)), device="cuda", generator=g) / 32 + 1e-3
    return dict(w13=(w13 * 32).to(f8), w2=(w2 * 32).to(f8), w13_scale=s13, w2_scale=s2, block_shape=[128, 128])


def _route(T, E, k, g):
    logits = torch.randn((T, E), device="cuda", generator=g)
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


def _call(tmoe, x, wts, tw, ids, **kw):
    return tmoe.fused_moe(
        x,
        wts["w13"],
        wts["w2"],
        tw,
        ids,
        "silu",
        None,
        None,
        wts.get("w13_scale"),
        wts.get("w2_scale"),
        wts.get("block_shape"),
        **kw,
    )


class _Graphed:
    """A CUDA graph of: x = x_src * 1 (a kernel before ours, so PDL has a predecessor), then the MoE."""

    def __init__(self, tmoe, T, shape, wts, **kw):
        H = shape["H"]
        self.x_src = torch.zeros((T, H), device="cuda", dtype=torch.bfloat16)
        self.tw = torch.zeros((T, shape["k"]), device="cuda")
        self.ids = torch.zeros((T, shape["k"]), device="cuda", dtype=torch.int64)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # compile the kernels outside the capture
                _call(tmoe, self.x_src * 1, wts, self.tw, self.ids, **kw)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            x = self.x_src * 1
            self.out = _call(tmoe, x, wts, self.tw, self.ids, **kw)

    def __call__(self, x, tw, ids):
        self.x_src.copy_(x)
        self.tw.copy_(tw)
        self.ids.copy_(ids)
        self.graph.replay()
        return self.out


@needs_sm90
@pytest.mark.parametrize("T", [1, 8, 32])
def test_pdl_on_off_bitwise_identical_in_graph_replays(tmoe, T):
    wts = _weights(**{k: QWEN[k] for k in ("E", "H", "I")})
    on = _Graphed(tmoe, T, QWEN, wts, pdl=True)
    off = _Graphed(tmoe, T, QWEN, wts, pdl=False)
    g = torch.Generator(device="cuda").manual_seed(T)
    for i in range(200):
        x = torch.randn((T, QWEN["H"]), device="cuda", dtype=torch.bfloat16, generator=g)
        tw, ids = _route(T, QWEN["E"], QWEN["k"], g)
        a = on(x, tw, ids).clone()
        b = off(x, tw, ids).clone()
        assert torch.equal(a, b), f"replay {i}: PDL on and off differ by {(a.float() - b.float()).abs().max().item()}"
        assert torch.isfinite(a).all()


@needs_sm90
@pytest.mark.parametrize("mode", ["default", "backfill"])
@pytest.mark.parametrize(
    "shape,fp8,T",
    [(QWEN, False, 1), (QWEN, False, 4), (QWEN, False, 16), (DEEPSEEK_TP8, True, 1), (DEEPSEEK_TP8, True, 8)],
)
def test_split_n_equals_whole_bitwise(tmoe, shape, fp8, T, mode):
    wts = _weights(shape["E"], shape["H"], shape["I"], fp8=fp8)
    g = torch.Generator(device="cuda").manual_seed(T)
    for _ in range(5):
        x = torch.randn((T, shape["H"]), device="cuda", dtype=torch.bfloat16, generator=g)
        tw, ids = _route(T, shape["E"], shape["k"], g)
        whole = _call(tmoe, x, wts, tw, ids)
        split = _call(tmoe, x, wts, tw, ids, placement=f"split_n:{mode}:2:64")
        torch.cuda.synchronize()
        assert torch.equal(whole, split), f"max diff {(whole.float() - split.float()).abs().max().item()}"


@needs_sm90
def test_split_n_above_threshold_runs_whole(tmoe):
    from rubin_compile.runtime import locality

    wts = _weights(QWEN["E"], QWEN["H"], QWEN["I"])
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn((32, QWEN["H"]), device="cuda", dtype=torch.bfloat16, generator=g)
    tw, ids = _route(32, QWEN["E"], QWEN["k"], g)
    before = dict(locality.SHARD_STATS)
    assert torch.equal(_call(tmoe, x, wts, tw, ids), _call(tmoe, x, wts, tw, ids, placement="split_n:default:2:16"))
    assert locality.SHARD_STATS == before  # no shard was asked for: the call ran whole


def _smid_probe():
    import triton
    import triton.language as tl

    @triton.jit
    def probe(out_ptr, spin):
        pid = tl.program_id(0)
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        acc = pid.to(tl.float32)
        for i in range(spin):  # noqa: B007  (Triton loop) keep the program resident so the scheduler spreads programs over every SM
            acc = acc * 1.0000001 + 1.0
        tl.store(out_ptr + pid, smid + (acc < -1.0).to(tl.int32))

    return probe


@needs_sm90
@pytest.mark.parametrize("mode", ["default", "backfill"])
def test_each_domain_runs_only_on_its_sms(mode):
    from rubin_compile.runtime import locality

    dom = locality.get(torch.device("cuda"), mode, 2)
    probe = _smid_probe()
    n = 4096
    outs = [torch.full((n,), -1, dtype=torch.int32, device="cuda") for _ in dom.streams]

    def launch():
        for s, o in zip(dom.streams, outs):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                probe[(n,)](o, 2000)
            torch.cuda.current_stream().wait_stream(s)

    launch()
    torch.cuda.synchronize()
    eager = [set(o.tolist()) for o in outs]
    for o in outs:
        o.fill_(-1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    graph.replay()
    torch.cuda.synchronize()
    graphed = [set(o.tolist()) for o in outs]
    total = torch.cuda.get_device_properties(0).multi_processor_count
    for sms in (eager, graphed):
        assert -1 not in sms[0] | sms[1]
        assert not (sms[0] & sms[1]), "two domains shared an SM"
        for d, s in enumerate(sms):
            assert len(s) <= dom.plan.sm_counts[d], (d, len(s), dom.plan.sm_counts)
            assert len(s) >= dom.plan.sm_counts[d] - 2, f"domain {d} used only {len(s)} of {dom.plan.sm_counts[d]} SMs"
    assert sum(dom.plan.sm_counts) == (total if mode == "backfill" else total - total % 16)


@needs_sm90
@pytest.mark.parametrize("mode", ["default", "backfill"])
def test_thousand_graph_replays_split_n_no_mismatch(tmoe, mode):
    T = 4
    wts = _weights(QWEN["E"], QWEN["H"], QWEN["I"], seed=3)
    split = _Graphed(tmoe, T, QWEN, wts, pdl=True, placement=f"split_n:{mode}:2:16")
    whole = _Graphed(tmoe, T, QWEN, wts, pdl=False)
    g = torch.Generator(device="cuda").manual_seed(7)
    bad = 0
    for _ in range(1000):
        x = torch.randn((T, QWEN["H"]), device="cuda", dtype=torch.bfloat16, generator=g)
        tw, ids = _route(T, QWEN["E"], QWEN["k"], g)
        a = split(x, tw, ids).clone()
        b = whole(x, tw, ids)
        bad += int(not torch.equal(a, b))
    assert bad == 0, f"{bad} of 1000 replays differ"


def _qwen3(layers=2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        use_cache=False,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()


@needs_sm90
@pytest.mark.parametrize(
    "how", [{"mode": "reduce-overhead"}, {"options": {"cudagraphs": True, "locality": "backfill"}}]
)
def test_compiled_model_pdl_on_off_bitwise_under_cuda_graphs(how):
    """A whole model, compiled with backend="rubin" under CUDA graphs: PDL on (mode="reduce-overhead" turns
    it on with pdl="auto") and split-N give the same logits bit for bit as neither, over replays."""
    model = _qwen3()
    opts = dict(how.get("options", {}))
    torch._dynamo.reset()
    kw = {"mode": how["mode"]} if "mode" in how else {}
    if kw:  # torch.compile takes mode or options, not both
        on = torch.compile(model, backend="rubin", **kw)
    else:
        on = torch.compile(model, backend="rubin", options={**opts, "pdl": "on"})
    g = torch.Generator(device="cuda").manual_seed(0)
    toks = [torch.randint(0, 512, (1, 4), device="cuda", generator=g) for _ in range(20)]
    with torch.no_grad():
        got_on = [on(t).logits.clone() for t in toks + toks]
        torch._dynamo.reset()
        off = torch.compile(
            model, backend="rubin", options={**opts, "cudagraphs": True, "pdl": "off", "locality": "off"}
        )
        got_off = [off(t).logits.clone() for t in toks + toks]
    for i, (a, b) in enumerate(zip(got_on, got_off)):
        assert torch.equal(a, b), f"call {i}: PDL / placement changed the logits by {(a - b).abs().max().item()}"
    # and right: each MoE block, compiled with the same settings, against Inductor alone on the same input (every
    # token bounded; the same input gives both the same routing)
    blocks = [layer.mlp for layer in model.model.layers]
    settings = {"cudagraphs": True} if kw else {**opts, "pdl": "on"}
    assert_moe_blocks_close(blocks, block_inputs(model, blocks, toks[0]), torch.bfloat16, **settings)
