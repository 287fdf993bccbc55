"""Models on the CPU: eager vs ``backend="inductor"`` vs ``backend="rubin"``, whole forward.

    python benchmarks/cpu_models.py --out benchmarks/results

What it answers: does compiling with rubin cost anything against Inductor alone on a machine where rubin has
no faster kernel to offer (the CPU)? Models (random weights, bf16, nothing downloaded): a 4-layer Phi-3
(dense: fused qkv / gate_up projections; rubin.gemm lowered back to ATen), a 2-layer Qwen3-MoE (E=64,
k=8; rubin.moe on the reference kernel), and a MoE written as a loop over expert modules (E=32, k=4, H=1024,
I=512; every expert weighted over all tokens, as plain PyTorch code does; rubin.moe computes only the
routed ones, on weights stacked once by rubin.stacked_weights). The three variants are timed in
interleaved rounds (``--rounds`` x ``--reps`` wall-clock forward calls each, after warm-up), so drift of a
shared machine hits all three alike; the median of all calls is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from cpu_timing import median_ms  # noqa: E402  (benchmarks/ is the script's folder)


class LoopMoE(torch.nn.Module):
    """Router, top-k, softmax; then every expert on every token, weighted by its (often zero) top-k weight."""

    def __init__(self, hidden=1024, inter=512, experts=32, k=4):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                dict(
                    gate=torch.nn.Linear(hidden, inter, bias=False),
                    up=torch.nn.Linear(hidden, inter, bias=False),
                    down=torch.nn.Linear(inter, hidden, bias=False),
                )
            )
            for _ in range(experts)
        )
        self.k = k

    def forward(self, x):
        w, ids = torch.topk(self.router(x).softmax(-1, dtype=torch.float32), self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            out = out + (w * (ids == e)).sum(-1, keepdim=True) * ex["down"](
                torch.nn.functional.silu(ex["gate"](x)) * ex["up"](x)
            )
        return out


def models():
    import transformers

    phi3 = transformers.Phi3Config(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        use_cache=False,
    )
    qwen = transformers.Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=1024,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=512,
        use_cache=False,
    )
    return {
        "phi3-4l-h1024": (transformers.Phi3ForCausalLM, phi3),
        "qwen3moe-2l-e64": (transformers.Qwen3MoeForCausalLM, qwen),
        "loop-moe-e32": (lambda cfg: LoopMoE(), None),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", default=None, help="comma-separated subset of the model names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import rubin_compile  # noqa: F401  (registers the backend when run from a checkout)

    rows = []
    for name, (cls, cfg) in models().items():
        if args.models and name not in args.models.split(","):
            continue
        torch.manual_seed(0)
        model = cls(cfg).to(torch.bfloat16).eval()
        for T in [int(t) for t in args.tokens.split(",")]:
            if cfg is None:  # the loop MoE takes hidden states and returns them
                inp = torch.randn(T, 1024, dtype=torch.bfloat16)
                out = lambda y: y  # noqa: E731
            else:
                inp = torch.randint(0, cfg.vocab_size, (1, T))
                out = lambda y: y.logits  # noqa: E731
            row = {"model": name, "T": T}
            with torch.no_grad():
                torch._dynamo.reset()  # Dynamo keeps one cache entry per backend: both stay compiled
                fns = {
                    "eager": model,
                    "inductor": torch.compile(model, backend="inductor"),
                    "rubin": torch.compile(model, backend="rubin"),
                }
                samples = {k: [] for k in fns}
                for _ in range(args.rounds):
                    for k, fn in fns.items():
                        samples[k].append(median_ms(lambda: out(fn(inp)), args.reps))
                row.update({k: statistics.median(v) for k, v in samples.items()})
            rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            print(
                f"{name:18s} T={T:4d}  eager {row['eager']:8.2f}  inductor {row['inductor']:8.2f}  "
                f"rubin {row['rubin']:8.2f} ms",
                flush=True,
            )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "method": f"{args.rounds} interleaved rounds of {args.reps} forward calls per variant, "
            "median of the round medians",
        }
        (out / "cpu-models.json").write_text(json.dumps({"rows": rows, **meta}, indent=1) + "\n")
        lines = [
            f"# Models on the CPU, bf16 ({meta['threads']} threads, torch {meta['torch']})",
            "",
            "| model | T | eager ms | Inductor ms | rubin ms | rubin / Inductor |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['model']} | {r['T']} | {r['eager']:.2f} | {r['inductor']:.2f} | {r['rubin']:.2f} | "
            f"{r['rubin'] / r['inductor']:.2f} |"
            for r in rows
        ]
        (out / "cpu-models.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
