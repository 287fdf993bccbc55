"""Decode routing on the GPU: rubin's fused routing (rubin_compile/kernels/triton/route.py: two kernels chained
with PDL) against the unfused ATen routing as the Hugging Face models write it (F.linear, softmax / sigmoid,
top-k, DeepSeek-V3's group mask, renormalisation, scale), run eagerly and compiled by Inductor; and against the
floor (the router weight's bytes / 4.2 TB/s).

    PYTHONPATH=. python benchmarks/route.py --out benchmarks/results

Routers: DeepSeek-V3 (E = 256, H = 7168, k = 8, sigmoid with e_score_correction_bias, 8 groups keep 4,
renormalised, scale 2.5; HF computes its logits in float32 from float32 copies of the bf16 inputs), Qwen3-30B-A3B
(E = 128, H = 2048, k = 8, softmax, renormalised) and Mixtral-8x7B (E = 8, H = 4096, k = 2, softmax,
renormalised; HF's logits are bf16, F.linear in the model's dtype), bf16 random inputs, T = 1, 4, 16, 32, 64.

Timing: 16 calls captured in one CUDA graph, each reading its own copy of the router weight (16 copies of
DeepSeek-V3's 3.7 MB exceed the 50 MB L2; the smaller routers fit whatever one does) and its own hidden
states, the graph replayed (CUDA events, median of 30 replays) and divided by 16: the device time of a call
between other kernels of one graph, the gaps between kernels included, the host's launch cost not. Inductor's
variant is ``torch.compile`` (default mode, static shapes) of the same function, compiled before the capture
and captured in the same way. Our kernel runs with PDL on (as rubin launches it under CUDA graphs on sm_90)
and off, with the arguments match_routing gives it for that code (Mixtral / Qwen3: the logits rounded to bf16 as
their bf16 nn.Linear writes them, bf16 weights). Ids are checked against the ATen routing's (as sets per token:
logits within one bf16 ulp may round the other way) and against route_reference. Writes route-<gpu>.{md,json} under ``--out`` (gpu_names.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from rubin_compile.kernels.triton import route as kernel
from rubin_compile.kernels.triton.tune_moe import time_graph

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: gpu_names
from gpu_names import write_results  # noqa: E402  (benchmarks/gpu_names.py)

CALLS = 16  # calls per captured graph
HBM_BPS = 4.2e12  # the floor's bandwidth (H200 HBM3e, as copies reach it)
TOKENS = (1, 4, 16, 32, 64)


# ------------------------------------------------------------------------------------------------
# the routing as the Hugging Face models write it
# ------------------------------------------------------------------------------------------------


def mixtral_qwen3_routing(hidden_states, weight, top_k: int, norm_topk_prob: bool):
    """MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: (routing_weights, selected_experts)."""
    router_logits = F.linear(hidden_states, weight)
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    if norm_topk_prob:
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(hidden_states.dtype)
    return routing_weights, selected_experts


def deepseek_v3_routing(hidden_states, weight, e_score_correction_bias, top_k=8, n_group=8, topk_group=4, scale=2.5):
    """DeepseekV3TopkRouter + DeepseekV3MoE.route_tokens_to_experts: (topk_weights, topk_indices)."""
    n_routed_experts = weight.shape[0]
    router_logits = F.linear(hidden_states.type(torch.float32), weight.type(torch.float32))
    router_logits = router_logits.sigmoid()
    router_logits_for_choice = router_logits + e_score_correction_bias
    group_scores = (
        router_logits_for_choice.view(-1, n_group, n_routed_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    )
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, n_routed_experts // n_group).reshape(-1, n_routed_experts)
    scores_for_choice = router_logits_for_choice.masked_fill(~score_mask.bool(), 0.0)
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = router_logits.gather(1, topk_indices)
    denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    topk_weights /= denominator
    topk_weights = topk_weights * scale
    return topk_weights, topk_indices


def _mixtral(x, w, b):
    return mixtral_qwen3_routing(x, w, 2, True)


def _qwen3(x, w, b):
    return mixtral_qwen3_routing(x, w, 8, True)


def _deepseek(x, w, b):
    return deepseek_v3_routing(x, w, b)


# ``kw``: what passes/match_routing.py passes rubin.route for the HF code (bf16 logits and weights for Mixtral / Qwen3,
# whose nn.Linear writes bf16 logits; DeepSeek-V3's group mask filling 0.0)
_BF16 = dict(logits_dtype=torch.bfloat16, weights_dtype=torch.bfloat16)
MODELS = {
    "DeepSeek-V3": dict(E=256, H=7168, k=8, aten=_deepseek, bias=True, kw=dict(
        scoring="sigmoid", renormalize=True, n_group=8, topk_group=4, routed_scaling_factor=2.5, group_fill="0")),
    "Qwen3-30B-A3B": dict(E=128, H=2048, k=8, aten=_qwen3, bias=False, kw=dict(renormalize=True, **_BF16)),
    "Mixtral-8x7B": dict(E=8, H=4096, k=2, aten=_mixtral, bias=False, kw=dict(renormalize=True, **_BF16)),
}  # fmt: skip


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


def graph_us(fns: list, iters: int = 30) -> float:
    """Device time per call of ``fns`` (each called once, in order, CALLS calls in all), captured in one graph
    (tune_moe.time_graph: warm-up on a side stream, capture, median of ``iters`` replays)."""
    return statistics.median(time_graph([fns[i % len(fns)] for i in range(CALLS)], reps=iters, warmup=3))


def _mismatches(ids_a: torch.Tensor, ids_b: torch.Tensor) -> int:
    """Tokens whose sets of experts differ."""
    a, b = ids_a.long().sort(-1).values, ids_b.long().sort(-1).values
    return int((a != b).any(-1).sum())


def inputs(model: str, T: int) -> tuple[list, list, Optional[torch.Tensor], dict]:
    """CALLS router weight copies and hidden states of a router at T tokens (random bf16, seeded by T), its
    correction bias (or None) and the keywords rubin.route takes for it."""
    m = MODELS[model]
    E, H = m["E"], m["H"]
    g = torch.Generator(device="cuda").manual_seed(T)
    w0 = (torch.randn((E, H), device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    ws = [w0.clone() for _ in range(CALLS)]  # a fresh copy per call
    xs = [torch.randn((T, H), device="cuda", generator=g).to(torch.bfloat16) for _ in range(CALLS)]
    bias = torch.randn((E,), device="cuda", generator=g) * 0.05 if m["bias"] else None  # fp32, as HF keeps it
    kw = dict(m["kw"], correction_bias=bias) if bias is not None else dict(m["kw"])
    return ws, xs, bias, kw


def case(model: str, T: int, compiled: dict, use_inductor: bool) -> dict:
    m = MODELS[model]
    E, H, k = m["E"], m["H"], m["k"]
    ws, xs, bias, kw = inputs(model, T)
    aten = m["aten"]
    row = {"model": model, "T": T, "E": E, "H": H, "k": k, "router_MB": E * H * 2 / 1e6}
    row["floor_us"] = E * H * 2 / HBM_BPS * 1e6

    def ours(x, w, pdl):
        return kernel.route(x, w, top_k=k, pdl=pdl, **kw)

    # correctness on the benchmark data
    mism_aten = mism_ref = 0
    for x, w in zip(xs, ws):
        got = ours(x, w, True)
        mism_aten += _mismatches(got[1], aten(x, w, bias)[1])
        mism_ref += _mismatches(got[1], kernel.route_reference(x, w, top_k=k, **kw)[1])
    row["tokens_checked"] = T * CALLS
    row["mismatch_vs_aten"] = mism_aten
    row["mismatch_vs_reference"] = mism_ref

    row["rubin_pdl_us"] = graph_us([lambda x=x, w=w: ours(x, w, True) for x, w in zip(xs, ws)])
    row["rubin_us"] = graph_us([lambda x=x, w=w: ours(x, w, False) for x, w in zip(xs, ws)])
    row["aten_us"] = graph_us([lambda x=x, w=w: aten(x, w, bias) for x, w in zip(xs, ws)])
    if use_inductor:
        if model not in compiled:
            compiled[model] = torch.compile(aten, dynamic=False)
        fn = compiled[model]
        t0 = time.perf_counter()
        fn(xs[0], ws[0], bias)  # compile outside the capture
        torch.cuda.synchronize()
        row["inductor_compile_s"] = time.perf_counter() - t0
        row["inductor_us"] = graph_us([lambda x=x, w=w: fn(x, w, bias) for x, w in zip(xs, ws)])
    best = min(row["rubin_pdl_us"], row["rubin_us"])
    row["speedup_vs_aten"] = row["aten_us"] / best
    if use_inductor:
        row["speedup_vs_inductor"] = row["inductor_us"] / best
    row["of_floor"] = row["floor_us"] / best
    del ws, xs
    torch.cuda.empty_cache()
    return row


def render(rows: list[dict], head: str) -> list[str]:
    lines = [
        f"Decode routing (router GEMM + scoring + top-k + renormalisation + scale), bf16; {head}",
        "",
        "us per call: 16 calls in one CUDA graph, a fresh router weight copy per call, median of 30 replays. "
        "Floor: router weight bytes / 4.2 TB/s. Speedups and % of floor use the faster of our two launches. "
        "Mismatches: tokens whose expert sets differ, of 16 x T checked.",
        "",
        "| router | T | rubin, PDL | rubin | ATen (HF code) | Inductor | vs ATen | vs Inductor | floor | % of floor "
        "| mismatches vs ATen | vs reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ind = f"{r['inductor_us']:.2f}" if "inductor_us" in r else "-"
        vs_ind = f"{r['speedup_vs_inductor']:.2f}x" if "speedup_vs_inductor" in r else "-"
        lines.append(
            f"| {r['model']} | {r['T']} | {r['rubin_pdl_us']:.2f} | {r['rubin_us']:.2f} | {r['aten_us']:.2f} | {ind} | "
            f"{r['speedup_vs_aten']:.2f}x | {vs_ind} | {r['floor_us']:.2f} | {100 * r['of_floor']:.0f}% | "
            f"{r['mismatch_vs_aten']} / {r['tokens_checked']} | {r['mismatch_vs_reference']} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="directory of the results")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    ap.add_argument("--no-inductor", action="store_true", help="skip the torch.compile variant (its compiles)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    for name in ("cache_size_limit", "recompile_limit"):  # one static compile per (router, T)
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    import triton

    props = torch.cuda.get_device_properties(0)
    head = f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}"
    print(head, flush=True)
    t0 = time.perf_counter()
    rows, compiled = [], {}
    for model in args.models:
        for T in args.tokens:
            rows.append(case(model, T, compiled, not args.no_inductor))
            print(json.dumps(rows[-1]), flush=True)
    text = "\n".join(render(rows, head))
    print(text)
    total = sum(r["mismatch_vs_aten"] for r in rows)
    print(f"id mismatches vs the ATen routing: {total} of {sum(r['tokens_checked'] for r in rows)} tokens; "
          f"vs route_reference: {sum(r['mismatch_vs_reference'] for r in rows)}; {time.perf_counter() - t0:.0f} s")  # fmt: skip
    write_results(args.out, "route", text, {"device": head, "rows": rows})


if __name__ == "__main__":
    main()
