"""Hugging Face decoders on the CPU: eager vs ``backend="inductor"`` vs ``backend="rubin"``, whole forward.

    python benchmarks/hf_cpu_models.py --out benchmarks/results

What it answers: does compiling with rubin cost anything against Inductor alone on a machine where rubin has
no faster kernel to offer (the CPU)? Models (random weights, bf16, nothing downloaded): a 4-layer Phi-3
(dense: fused qkv / gate_up projections; rubin.gemm lowered back to ATen) and a 2-layer Qwen3-MoE (E=64,
k=8; rubin.moe on the reference kernel). Median of ``--reps`` wall-clock forward calls after two warm-up
calls, one token batch per T; each compiled variant is compiled and timed before the next.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def models():
    import transformers

    phi3 = transformers.Phi3Config(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=1, use_cache=False)
    qwen = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                                       num_key_value_heads=4, head_dim=64, intermediate_size=2048,
                                       moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8,
                                       norm_topk_prob=True, max_position_embeddings=512, use_cache=False)
    return {"phi3-4l-h1024": (transformers.Phi3ForCausalLM, phi3),
            "qwen3moe-2l-e64": (transformers.Qwen3MoeForCausalLM, qwen)}


def median_ms(fn, reps):
    fn()
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import rubin_compile  # noqa: F401  (registers the backend when run from a checkout)

    rows = []
    for name, (cls, cfg) in models().items():
        torch.manual_seed(0)
        model = cls(cfg).to(torch.bfloat16).eval()
        for T in [int(t) for t in args.tokens.split(",")]:
            ids = torch.randint(0, cfg.vocab_size, (1, T))
            row = {"model": name, "T": T}
            with torch.no_grad():
                row["eager"] = median_ms(lambda: model(ids).logits, args.reps)
                for backend in ("inductor", "rubin"):
                    torch._dynamo.reset()
                    compiled = torch.compile(model, backend=backend)
                    row[backend] = median_ms(lambda: compiled(ids).logits, args.reps)
            rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            print(f"{name:18s} T={T:4d}  eager {row['eager']:8.2f}  inductor {row['inductor']:8.2f}  "
                  f"rubin {row['rubin']:8.2f} ms", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "method": f"median of {args.reps} forward calls after 2 warm-up calls"}
        (out / "hf-cpu-models.json").write_text(json.dumps({"rows": rows, **meta}, indent=1) + "\n")
        lines = [f"# Hugging Face decoders on the CPU, bf16 ({meta['threads']} threads, torch {meta['torch']})", "",
                 "| model | T | eager ms | Inductor ms | rubin ms | rubin / Inductor |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['T']} | {r['eager']:.2f} | {r['inductor']:.2f} | {r['rubin']:.2f} | "
                  f"{r['rubin'] / r['inductor']:.2f} |" for r in rows]
        (out / "hf-cpu-models.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
