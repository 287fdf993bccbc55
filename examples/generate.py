"""Hugging Face ``generate()`` with a static KV cache, compiled with ``backend="rubin"`` both ways people do it.

    python examples/generate.py                                   # CPU: a tiny random Qwen3-MoE, float32
    python examples/generate.py --model qwen3-30b-a3b-8l --dtype bfloat16 --context 4096   # a GPU (H200)

The model has random weights (nothing is downloaded): ``tiny`` (2 layers, hidden 64, 8 experts) or
``qwen3-30b-a3b-8l`` (8 layers of Qwen3-30B-A3B's dimensions: hidden 2048, 32 query / 4 KV heads of 128,
128 experts of 768, top 8). Greedy decoding of ``--new-tokens`` tokens after a random prompt of
``--context`` tokens, with ``cache_implementation="static"`` (what generate compiles), in these variants:

* ``eager``: no compile; its generated ids are the reference.
* ``rubin (compile_config)``: generate compiles its own decode step,
  ``compile_config=CompileConfig(backend="rubin", mode="reduce-overhead")`` (prefill stays eager). transformers
  does this only on a GPU; on the CPU the example sets ``CompileConfig._compile_all_devices`` (transformers' own
  switch for testing) and ``mode="default"`` (no CUDA graphs), so the same path runs.
* ``rubin (model.forward)``: ``model.forward = torch.compile(model.forward, backend="rubin", dynamic=False)``:
  prefill and decode each compile once, as static graphs, without CUDA graphs: transformers 5.x creates the
  static cache inside the first (prefill) call, so under ``mode="reduce-overhead"`` the cache would be made
  inside a CUDA-graph capture; on the H200 that crashed with Inductor alone too
  (benchmarks/h200/generate-3-diagnose.sh). For CUDA graphs use the ``compile_config`` way, which compiles the
  decode step only. generate() is then called with ``disable_compile=True``: without a ``compile_config``,
  transformers compiles the forward itself on a GPU with a static cache (Inductor, ``mode="reduce-overhead"``,
  around whatever ``model.forward`` is), which every generate() here without one turns off (``generate_once``; for
  ``eager`` too, which is otherwise not eager on a GPU). Without CUDA graphs the decode step is host-bound (about
  5-6 ms a token at 4k on the H200's host for Inductor, 2026-12-03): rubin traces its Triton launches into such
  graphs (passes/inline_kernels.py: 0.58x the op calls' host time for one layer's attention, routing and MoE); the
  whole loop with it, timed in interleaved rounds against Inductor, is not measured yet
  (benchmarks/results/issue16-s7-h200-2026-12-03/README.md). Prefer the ``compile_config`` way for speed.
* with ``--dtype bfloat16``, ``inductor (compile_config)`` too: rubin's ids are checked against Inductor's
  (Inductor's own bf16 roundings already make eager's ids differ after a near-tie), and timed beside it.

Printed: tokens per second, per-token decode latency ((t(N) - t(1)) / (N - 1): the prefill and first token
taken out), whether the ids equal the reference, and the compile time (the first generate call less a warm one).
Exits 1 if a checked variant's ids differ. ``RUBIN_DUMP_DIR=dumps`` writes the compiled graphs' dumps
(``python -m rubin_compile explain dumps``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MODELS = {
    # name: Qwen3MoeConfig keyword arguments
    "tiny": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen3-30b-a3b-8l": dict(
        vocab_size=4096,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
    ),
}


def build_model(name: str, dtype: torch.dtype, device: str, max_positions: int):
    """A random-weight Qwen3-MoE causal LM (seeded: the same weights on every run)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(**MODELS[name], max_position_embeddings=max_positions, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


@dataclass
class Result:
    variant: str
    ids: torch.Tensor
    per_token_us: float
    tokens_per_s: float
    first_call_s: float
    warm_call_s: float  # the same call warm (compile time ~ first_call_s - warm_call_s)
    checked_against: Optional[str] = None
    equal: Optional[bool] = None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate_once(model, prompt: torch.Tensor, new_tokens: int, compile_config=None) -> torch.Tensor:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    if compile_config is not None:
        kwargs["compile_config"] = compile_config
    else:
        # Without a compile_config, transformers compiles the forward itself (Inductor, mode="reduce-overhead") on a
        # GPU with a static cache, around whatever model.forward is: eager would not be eager, and a model.forward
        # compiled with rubin would be called from inside a second compile. disable_compile turns that off.
        kwargs["disable_compile"] = True
    with torch.inference_mode():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)


def timed(fn: Callable[[], torch.Tensor], device: str, repeats: int) -> tuple[torch.Tensor, float]:
    """(output, median wall seconds of ``repeats`` calls)."""
    times, out = [], None
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return out, times[len(times) // 2]


def run_variant(
    variant: str, model, prompt: torch.Tensor, new_tokens: int, device: str, repeats: int, setup: Callable
) -> Result:
    """Set the variant up (``setup(model) -> compile_config or None``), call generate once (compiles), then time
    generate of ``new_tokens`` and of 1 token, ``repeats`` times each."""
    config = setup(model)
    t0 = time.perf_counter()
    generate_once(model, prompt, new_tokens, config)
    _sync(device)
    first = time.perf_counter() - t0
    generate_once(model, prompt, 1, config)  # warm the one-token path too
    ids, t_n = timed(lambda: generate_once(model, prompt, new_tokens, config), device, repeats)
    _, t_1 = timed(lambda: generate_once(model, prompt, 1, config), device, repeats)
    per_token = (t_n - t_1) / (new_tokens - 1)
    batch = prompt.shape[0]
    return Result(variant, ids.cpu(), per_token * 1e6, batch / per_token, first, t_n)


def eager_setup(model):
    return None


def compile_config_setup(backend: str, device: str):
    def setup(model):
        from transformers import CompileConfig

        model.__dict__.pop("forward", None)  # the class's forward, not a compiled one from another variant
        config = CompileConfig(backend=backend, mode="reduce-overhead" if device == "cuda" else "default")
        if device != "cuda":
            config._compile_all_devices = True  # transformers' switch to compile on the CPU (for testing)
        return config

    return setup


def forward_setup(backend: str, device: str):
    def setup(model):
        model.__dict__.pop("forward", None)
        model.forward = torch.compile(model.forward, backend=backend, dynamic=False)  # no CUDA graphs: see above
        return None

    return setup


def variants(dtype: torch.dtype, device: str) -> list[tuple[str, Callable, Optional[str]]]:
    """(name, setup, the variant whose ids it must equal)."""
    out = [("eager", eager_setup, None)]
    if dtype == torch.float32:
        ref = "eager"
    else:
        out.append(("inductor (compile_config)", compile_config_setup("inductor", device), None))
        ref = "inductor (compile_config)"
    out += [
        ("rubin (compile_config)", compile_config_setup("rubin", device), ref),
        ("rubin (model.forward)", forward_setup("rubin", device), ref),
    ]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--context", type=int, default=24, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, dtype, args.device, args.context + args.new_tokens + 8)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, model.config.vocab_size, (args.batch, args.context), generator=g).to(args.device)

    results: dict[str, Result] = {}
    for name, setup, ref in variants(dtype, args.device):
        torch._dynamo.reset()
        gc.collect()
        r = run_variant(name, model, prompt, args.new_tokens, args.device, args.repeats, setup)
        if ref is not None:
            r.checked_against, r.equal = ref, torch.equal(r.ids, results[ref].ids)
        results[name] = r
    model.__dict__.pop("forward", None)

    print(
        f"\n{args.model}, {args.dtype}, {args.device}, batch {args.batch}, prompt {args.context} + "
        f"{args.new_tokens} new tokens, static cache, greedy (median of {args.repeats})\n"
    )
    print("| variant | tokens/s | per-token latency | compile (first call - warm call) | ids |")
    print("|---|---|---|---|---|")
    for r in results.values():
        ids = "reference" if r.checked_against is None else f"{'equal' if r.equal else 'DIFFER'} to {r.checked_against}"
        if r.equal is False:
            first = int((r.ids != results[r.checked_against].ids).nonzero()[0, 1]) - args.context
            ids += f" from new token {first}"
        compile_s = "-" if r.variant == "eager" else f"{r.first_call_s - r.warm_call_s:.1f} s"
        print(f"| {r.variant} | {r.tokens_per_s:.1f} | {r.per_token_us:.0f} us | {compile_s} | {ids} |")
    failed = [r.variant for r in results.values() if r.equal is False]
    if failed:
        print(f"\ngenerated ids differ for: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
