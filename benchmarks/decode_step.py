"""One decode step of 8 Qwen3-30B-A3B MoE decoder layers: eager, Inductor, Inductor + CUDA graphs, and rubin
with and without PDL and locality domains, against the weight-read floor.

    PYTHONPATH=. python benchmarks/decode_step.py --out benchmarks/results            # T = 1, 8, 32
    PYTHONPATH=. python benchmarks/decode_step.py --tokens 1 --variants inductor-cg,rubin-pdl --profile

The model: transformers' ``Qwen3MoeForCausalLM`` with Qwen3-30B-A3B's dimensions (hidden 2048, 32 query /
4 KV heads of 128, 128 experts, top 8, expert intermediate 768), 8 layers, vocabulary 4096, random bf16
weights; a forward of T new tokens (batch 1, no KV cache). Every variant compiles once with dynamic shapes
(as vLLM does) and runs every T.

Timing: per call, CUDA events around the call (host launch cost included: it is part of a step), after
warm-up; median of ``--iters`` calls; the variants take turns in each round so drift hits all of them.

Floor: the bytes of weights the step must read (attention, norms, router, the distinct experts the T
tokens are routed to in each layer -- counted by hooks on the routers in an eager run of the same input --
and the LM head) divided by the device-to-device copy bandwidth measured at the start of the run
((read + write) / time).

``--profile``: a per-kernel breakdown of the rubin step at each T (torch.profiler; the kernels of a CUDA
graph replay, grouped by what they are), written to the JSON and the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: rubin_compile beside benchmarks/
from rubin_compile.passes import PASS_NAMES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: gpu_names
from gpu_names import write_results  # noqa: E402  (benchmarks/gpu_names.py)

VARIANTS = {
    # name: (backend, torch.compile kwargs) -- None backend: eager
    "eager": (None, {}),
    "inductor": ("inductor", {}),
    "inductor-cg": ("inductor", {"mode": "reduce-overhead"}),
    "rubin-nopdl": ("rubin", {"options": {"cudagraphs": True, "pdl": "off"}}),
    "rubin-pdl": ("rubin", {"options": {"cudagraphs": True, "pdl": "on"}}),
    # rubin before issue 12: dense GEMMs on cuBLAS, q / k / v separate
    "rubin-pdl-gemm-cublas": (
        "rubin",
        {"options": {"cudagraphs": True, "pdl": "on", "kernels": {"gemm": "torch"}, "fuse_projections": "off"}},
    ),
    # rubin before the routing was fused (issue 13): the router GEMM, softmax / top-k and renormalisation as Inductor
    # compiles them from the source graph
    "rubin-pdl-route-aten": (
        "rubin",
        {"options": {"cudagraphs": True, "pdl": "on", "passes": [p for p in PASS_NAMES if p != "match_routing"]}},
    ),
    "rubin-pdl-inductor-pdl": (
        "rubin",
        {"options": {"cudagraphs": True, "pdl": "on", "inductor": {"triton.enable_pdl": True}}},
    ),
    "rubin-pdl-loc-default": (
        "rubin",
        {"options": {"cudagraphs": True, "pdl": "on", "locality": "default", "locality_max_tokens": 16}},
    ),
    "rubin-pdl-loc-backfill": (
        "rubin",
        {"options": {"cudagraphs": True, "pdl": "on", "locality": "backfill", "locality_max_tokens": 16}},
    ),
}


def build_model(layers: int, vocab: int):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=4096,
        use_cache=False,
        initializer_range=0.02,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    return model, cfg


def routed_experts(model, x) -> list[int]:
    """Distinct experts each layer's router sends the tokens of ``x`` to (an eager forward with hooks on
    the routers; transformers' Qwen3-MoE router returns (logits, scores, indices))."""
    seen: list[int] = []

    def hook(mod, inp, out):
        ids = out[2] if isinstance(out, tuple) else out.topk(model.config.num_experts_per_tok, dim=-1).indices
        seen.append(int(torch.unique(ids).numel()))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def weight_bytes(cfg, T: int, routed: list[int] | None = None) -> dict:
    """Bytes of weights one forward of T tokens must read: the experts actually routed to (``routed``, per
    layer), else the expected count under uniform routing. Qwen3-MoE's configuration, or GPT-OSS's (its experts
    ``num_local_experts`` of ``intermediate_size``; its biases, a few KB a layer, are not counted)."""
    H, k = cfg.hidden_size, cfg.num_experts_per_tok
    E = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    I = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    attn = (H * q + 2 * H * kv + q * H + 2 * cfg.head_dim + 2 * H) * 2  # projections, q/k norms, 2 RMSNorms
    router = H * E * 2
    L = cfg.num_hidden_layers
    distinct = (sum(routed) / len(routed)) if routed else E * (1 - (1 - k / E) ** T)
    experts = distinct * 3 * H * I * 2
    per_layer = attn + router + experts
    head = cfg.vocab_size * H * 2 + H * 2 + T * H * 2  # LM head, final norm, embedding rows
    return {
        "per_layer": per_layer,
        "experts_per_layer": experts,
        "distinct_experts": distinct,
        "routing": "as routed" if routed else "uniform expectation",
        "total": L * per_layer + head,
    }


def time_call(fn: Callable, x) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn(x)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3  # us


def categorize(name: str) -> str:
    n = name.lower()
    if "_moe_fc1" in n:
        return "MoE FC1 (rubin)"
    if "_moe_fc2" in n:
        return "MoE FC2 + top-k sum (rubin)"
    if "_moe_route" in n or "_moe_sum" in n or "_router_logits" in n or "_route_topk" in n:
        return "MoE routing (rubin)"
    if "_gemm_kernel" in n or "_splitk_reduce" in n:
        return "dense GEMM (rubin Triton)"
    if "_split_kv" in n or "_combine" in n:
        return "attention (rubin split-KV decode)"
    if "gemm" in n or "gemv" in n or "cublas" in n or "sm90_xmma" in n or "cutlass" in n or "nvjet" in n:
        return "dense GEMM (cuBLAS)"
    if "flash" in n or "attention" in n or "fmha" in n or "sdpa" in n:
        return "attention"
    if "topk" in n or "sort" in n or "softmax" in n:
        return "router top-k / softmax"
    if n.startswith("triton_"):
        return "Inductor Triton (norms, RoPE, pointwise, reductions)"
    return "other: " + name[:60]


def profile_step(fn: Callable, x, reps: int = 10) -> dict:
    """Per category: device us and kernels per step; and the boundaries between consecutive kernels: how
    many overlapped (the next one started before the previous ended: PDL) and the median gap."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn(x)
            torch.cuda.synchronize()
    per: dict[str, dict] = {}
    spans = []
    for ev in prof.events():
        if (
            ev.device_type != torch.autograd.DeviceType.CUDA
            or "memcpy" in ev.name.lower()
            or "memset" in ev.name.lower()
        ):
            continue
        cat = categorize(ev.name)
        d = per.setdefault(cat, {"us": 0.0, "kernels": 0})
        d["us"] += (ev.device_time if hasattr(ev, "device_time") else ev.cuda_time) / reps
        d["kernels"] += 1 / reps
        spans.append((ev.time_range.start, ev.time_range.end, cat))
    spans.sort()
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if b[0] - a[1] < 1000]  # within one step
    moe_gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if "MoE" in b[2] and b[0] - a[1] < 1000]
    return {
        "categories": dict(sorted(per.items(), key=lambda kv: -kv[1]["us"])),
        "boundaries": len(gaps),
        "overlapped": sum(g < 0 for g in gaps),
        "median_gap_us": statistics.median(gaps) if gaps else None,
        "moe_boundaries": len(moe_gaps),
        "moe_overlapped": sum(g < 0 for g in moe_gaps),
        "moe_median_gap_us": statistics.median(moe_gaps) if moe_gaps else None,
    }


def plan_summary(dump: str) -> str:
    """What the rubin pipeline decided for the MoE nodes, from the reports in ``dump``."""
    kernels, pdl, placed = [], 0, []
    for rep in Path(dump).glob("*/report.json"):
        for p in json.loads(rep.read_text())["passes"]:
            if p["name"] == "select_kernels":
                kernels += [pl["kernel"] for pl in p["plans"] if pl["canonical_op"] == "rubin.moe"]
            if p["name"] == "chain_pdl":
                pdl += sum(d["decision"] == "pdl on" for d in p["decisions"] if d["canonical_op"] == "rubin.moe")
            if p["name"] == "place_locality":
                placed += [d["decision"] for d in p["decisions"] if d["decision"].startswith("split_n")]
    return (
        f"rubin.moe nodes: {len(kernels)} ({', '.join(sorted(set(kernels)))}), {pdl} with PDL, "
        f"{len(placed)} split-N {sorted(set(placed))}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    Ts = [int(t) for t in args.tokens.split(",")]
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        sys.exit(f"unknown variant(s) {bad}; known: {list(VARIANTS)}")
    import rubin_compile  # noqa: F401  (registers backend="rubin" when run from a checkout)

    torch._dynamo.config.cache_size_limit = 64
    model, cfg = build_model(args.layers, args.vocab)
    from rubin_compile.kernels.triton.tune_moe import copy_bandwidth_gbs

    bw = copy_bandwidth_gbs()
    print(
        f"device: {torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s; torch {torch.__version__}", flush=True
    )
    inputs = {T: torch.randint(0, cfg.vocab_size, (1, T), device="cuda") for T in Ts}
    routed = {T: routed_experts(model, inputs[T]) for T in Ts}
    print("distinct experts routed per layer: " + "; ".join(f"T={T}: {r}" for T, r in routed.items()), flush=True)
    fns: dict[str, Callable] = {}
    compile_s: dict[str, float] = {}
    ref = {}
    with torch.no_grad():
        for T in Ts:
            ref[T] = model(inputs[T]).logits.float()
        for name in names:
            backend, kw = VARIANTS[name]
            torch._dynamo.reset()
            dump = None
            if backend is None:
                fn = model
            else:
                if backend == "rubin":  # dump the plan, to show what ran (and that the MoE was rewritten)
                    import tempfile

                    dump = tempfile.mkdtemp(prefix=f"rubin-{name}-")
                    kw = {**kw, "options": {**kw.get("options", {}), "dump_dir": dump}}
                fn = torch.compile(model, backend=backend, dynamic=True, **kw)
            t0 = time.perf_counter()
            errs = []
            for T in Ts:
                for _ in range(3):  # compile / record the graph for this T
                    got = fn(inputs[T]).logits.float()
                scale = ref[T].abs().max().item()
                errs.append((got - ref[T]).abs().max().item() / scale)
            torch.cuda.synchronize()
            compile_s[name] = time.perf_counter() - t0
            fns[name] = lambda x, fn=fn: fn(x)
            print(
                f"  {name}: ready in {compile_s[name]:.0f} s; max |logits - eager| / scale per T: "
                + ", ".join(f"{e:.1e}" for e in errs)
                + (f"; {plan_summary(dump)}" if dump else ""),
                flush=True,
            )
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for T in Ts:
                for name in names:
                    fn = fns[name]
                    for _ in range(3):
                        fn(inputs[T])
                    ts = [time_call(fn, inputs[T]) for _ in range(args.iters)]
                    times.setdefault((name, T), []).extend(ts)
        profiles = {}
        if args.profile:
            prof_name = next((n for n in ("rubin-pdl", "rubin-nopdl") if n in fns), None)
            for T in Ts if prof_name else []:
                profiles[T] = {"variant": prof_name, **profile_step(fns[prof_name], inputs[T])}
            for other in ("rubin-nopdl", "inductor-cg", "rubin-pdl-gemm-cublas", "rubin-pdl-route-aten"):
                if other in fns and other != prof_name:
                    # rubin before issues 12 / 13 (dense GEMMs on cuBLAS; routing as Inductor compiles it) at every
                    # T, the others at the first
                    for T in Ts if other in ("rubin-pdl-gemm-cublas", "rubin-pdl-route-aten") else Ts[:1]:
                        profiles[f"{other}:T={T}"] = {"variant": other, **profile_step(fns[other], inputs[T])}
    rows = []
    for T in Ts:
        wb = weight_bytes(cfg, T, routed[T])
        floor = wb["total"] / (bw * 1e9) * 1e6
        base = statistics.median(times[("inductor-cg", T)]) if ("inductor-cg", T) in times else None
        for name in names:
            med = statistics.median(times[(name, T)])
            rows.append(
                {
                    "T": T,
                    "variant": name,
                    "us": med,
                    "floor_us": floor,
                    "x_floor": med / floor,
                    "speedup_vs_inductor_cg": (base / med) if base else None,
                    "distinct_experts_per_layer": wb["distinct_experts"],
                    "weight_MB": wb["total"] / 1e6,
                }
            )
    lines = [
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s; "
        f"{args.layers} Qwen3-30B-A3B MoE layers, vocab {args.vocab}, bf16, forward of T tokens, no KV cache; "
        f"median of {args.rounds} x {args.iters} calls",
        "",
        "| T | variant | us / step | x floor | speed-up vs inductor + CUDA graphs | floor us (weights MB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = f"{r['speedup_vs_inductor_cg']:.2f}x" if r["speedup_vs_inductor_cg"] else "-"
        lines.append(
            f"| {r['T']} | {r['variant']} | {r['us']:.0f} | {r['x_floor']:.2f} | {sp} | "
            f"{r['floor_us']:.0f} ({r['weight_MB']:.0f}) |"
        )
    pdl_rows = []
    for T in Ts:
        if ("rubin-pdl", T) in times and ("rubin-nopdl", T) in times:
            saved = statistics.median(times[("rubin-nopdl", T)]) - statistics.median(times[("rubin-pdl", T)])
            pdl_rows.append(f"| {T} | {saved:.1f} |")
    if pdl_rows:
        lines += [
            "",
            "PDL: us saved per step (rubin without PDL - rubin with PDL)",
            "",
            "| T | us saved |",
            "|---|---|",
            *pdl_rows,
        ]
    for key, prof in profiles.items():
        lines += [
            "",
            f"Per-kernel breakdown, {prof['variant']}, {key if isinstance(key, str) else f'T={key}'} "
            "(torch.profiler, device time per step):",
            "",
            "| kernels of | us | kernels |",
            "|---|---|---|",
        ]
        for cat, d in prof["categories"].items():
            lines.append(f"| {cat} | {d['us']:.1f} | {d['kernels']:.0f} |")
        moe_us = sum(d["us"] for cat, d in prof["categories"].items() if cat.startswith("MoE"))
        routed_here = "MoE routing (rubin)" in prof["categories"]
        T_prof = int(str(key).rsplit("=", 1)[-1]) if isinstance(key, str) else key
        wb = weight_bytes(cfg, T_prof, routed[T_prof])
        block_floor = (wb["experts_per_layer"] + cfg.hidden_size * cfg.num_experts * 2) / (bw * 1e9) * 1e6
        if routed_here:  # the whole block is rubin's kernels: routing + FC1 + FC2
            per_layer = moe_us / args.layers
            prof["moe_block_us_per_layer"], prof["moe_block_floor_us"] = per_layer, block_floor
            lines.append(
                f"\nMoE block (routing + experts) per layer: {per_layer:.1f} us = {per_layer / block_floor:.2f}x its "
                f"weight-read floor ({block_floor:.1f} us: router + {wb['distinct_experts']:.0f} experts)"
            )
        gap = prof["median_gap_us"]
        mgap = prof["moe_median_gap_us"]
        lines.append(
            f"\nkernel boundaries: {prof['boundaries'] // 10} per step, {prof['overlapped'] / 10:.0f} overlapped "
            f"(next kernel started before the previous ended), median gap "
            f"{gap if gap is None else round(gap, 2)} us; into MoE kernels: {prof['moe_overlapped'] / 10:.0f} of "
            f"{prof['moe_boundaries'] / 10:.0f} overlapped, median gap {mgap if mgap is None else round(mgap, 2)} us"
        )
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        write_results(
            Path(args.out),
            "decode-step",
            text,
            {
                "bandwidth_GBps": bw,
                "rows": rows,
                "compile_s": compile_s,
                "profiles": {str(k): v for k, v in profiles.items()},
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(),
                "env": {k: v for k, v in os.environ.items() if k.startswith(("RUBIN_", "TORCHINDUCTOR_"))},
            },
        )


if __name__ == "__main__":
    main()
