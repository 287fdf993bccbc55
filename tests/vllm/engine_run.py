"""Run one vLLM (CPU) engine on a model folder and write greedy tokens and top logprobs as JSON.

    python -m tests.vllm.engine_run --model DIR --route none|pass|backend --prompts P.json --out OUT.json
        [--dtype float32] [--max-tokens 8] [--moe-op]

``--route pass`` adds rubin's post-grad pass by name, ``--route backend`` compiles with
``backend="rubin"`` (with the cache key of ``backend_route_cache_key()``); ``--moe-op`` makes vLLM's MoE
layers call the opaque ``vllm.moe_forward`` op, as they do on GPUs, instead of tracing into the CPU
experts. ``RUBIN_*`` variables configure rubin as usual. One engine per process: vLLM leaves
process-wide state (distributed groups, compile caches) behind.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def compilation_kwargs(route: str) -> dict:
    if route == "none":
        return {}
    if route == "pass":
        return {"compilation_config": {"inductor_passes": {"post_grad_custom_post_pass": "rubin_compile.vllm_pass"}}}
    if route == "backend":
        from rubin_compile.integrations.vllm import backend_route_cache_key

        return {"compilation_config": {"mode": 2, "backend": "rubin"}, **backend_route_cache_key()}
    raise ValueError(f"unknown route {route!r}")


def use_moe_op() -> None:
    """Make MoERunner call torch.ops.vllm.moe_forward[_shared] on the CPU too (vLLM's choice on CUDA)."""
    import torch
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    def select(self):
        return torch.ops.vllm.moe_forward if self._shared_experts is None else torch.ops.vllm.moe_forward_shared

    moe_runner.MoERunner._select_forward = select


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--route", choices=["none", "pass", "backend"], required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--moe-op", action="store_true")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    start = time.perf_counter()
    from vllm import LLM, SamplingParams

    if args.moe_op:
        use_moe_op()
    with open(args.prompts) as f:
        prompts = json.load(f)
    kwargs = compilation_kwargs(args.route)
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        **kwargs,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=args.logprobs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    from vllm.compilation.counter import compilation_counter

    result = {
        "route": args.route,
        "moe_op": args.moe_op,
        "seconds": time.perf_counter() - start,
        "aot_compiles": compilation_counter.num_aot_compiles,
        "aot_artifacts_saved": compilation_counter.num_aot_artifacts_saved,
        "aot_artifacts_loaded": compilation_counter.num_aot_artifacts_loaded,
        "rubin_uuid": kwargs.get("additional_config", {}).get("rubin_uuid"),
        "outputs": [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
            }
            for o in outputs
        ],
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
