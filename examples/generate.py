"""Hugging Face ``generate()`` with a static KV cache, compiled with ``backend="rubin"`` both ways people do it.

    python examples/generate.py                                   # CPU: a tiny random Qwen3-MoE, float32
    python examples/generate.py --model qwen3-30b-a3b-8l --dtype bfloat16 --context 4096   # a GPU (H200)

The model has random weights (nothing is downloaded): ``tiny`` (a Qwen3-MoE of 2 layers, hidden 64, 8 experts),
``qwen3-30b-a3b-8l`` (8 layers of Qwen3-30B-A3B's dimensions: hidden 2048, 32 query / 4 KV heads of 128,
128 experts of 768, top 8), ``gpt-oss-tiny`` (a GPT-OSS of 2 layers, one sliding-window, one full: eager attention
with sinks, which rubin rewrites into ``rubin.attention`` with ``sinks``) or ``gpt-oss-20b-8l`` (8 layers of
GPT-OSS-20B's dimensions: hidden 2880, 64 query / 8 KV heads of 64, every other layer a 128-position sliding
window, 32 experts of 2880, top 4, clamped SwiGLU with biases; bf16 weights, not the checkpoint's MXFP4). Greedy decoding of ``--new-tokens`` tokens after a random prompt of
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
  whole loop with it, timed in interleaved rounds against Inductor on an H100 (2026-12-06), took 3153 against 4030
  us a token at 4k and 4867 against 5800 at 16k (benchmarks/results/forward-interleaved-h100-2026-12-06/). Prefer
  the ``compile_config`` way for speed.
* ``--inductor``: Inductor compiled both ways too, timed beside rubin (in fp32 checked against eager).
* with ``--dtype bfloat16``, ``inductor (compile_config)`` always: rubin's ids are checked against Inductor's
  (Inductor's own bf16 roundings already make eager's ids differ after a near-tie), and timed beside it.

Printed: tokens per second, per-token decode latency ((t(N) - t(1)) / (N - 1): the prefill and first token
taken out), whether the ids equal the reference -- where they differ, the first new token that does and how far
apart eager's logits of the two tokens are there (``divergence``: one or two steps of the dtype is a near-tie) --,
and the compile time (the first generate call less a warm one).
Exits 1 if a checked variant's ids differ, except, in bf16, where they first differ at a near-tie (eager's logits of
the two tokens at most ``NEAR_TIE_STEPS`` steps of bf16 apart; the table says so). ``RUBIN_DUMP_DIR=dumps`` writes
the compiled graphs' dumps (``python -m rubin_compile explain dumps``).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MODELS = {
    # name: Qwen3MoeConfig keyword arguments (GPT-OSS's: GPT_OSS below)
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


# GptOssConfig keyword arguments
GPT_OSS = {
    "gpt-oss-tiny": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gpt-oss-20b-8l": dict(
        vocab_size=4096,
        hidden_size=2880,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=8,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 4,
    ),
}
MODELS.update(GPT_OSS)


def build_model(name: str, dtype: torch.dtype, device: str, max_positions: int):
    """A random-weight Qwen3-MoE or GPT-OSS causal LM (seeded: the same weights on every run)."""
    import transformers

    if name in GPT_OSS:
        config_cls, model_cls = transformers.GptOssConfig, transformers.GptOssForCausalLM
    else:
        config_cls, model_cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    cfg = config_cls(**MODELS[name], max_position_embeddings=max_positions, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(cfg).to(dtype).eval()
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
    divergence: Optional[dict] = None  # where the ids first differ from checked_against's (``divergence``)


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


# A bf16 generation may differ from its reference at a near-tie and be right: the two tokens' eager logits at most
# this many steps of bf16 apart (the rounding of any kernel may order them either way), and after it the two
# sequences no longer share a prefix, so nothing after it can be compared. vLLM's tests accept a divergence the same
# way (check_logprobs_close: each token among the other's top log-probabilities), here with a tighter bound. fp32
# generations must equal their reference exactly.
NEAR_TIE_STEPS = 2


def divergence(model, a: torch.Tensor, b: torch.Tensor, context: int) -> Optional[dict]:
    """Where two greedy generations ``a`` and ``b`` ([batch, context + new] ids, same prompt) first differ, and
    whether that is a near-tie: the two tokens' logits there under eager (the class's own forward, teacher-forced on
    the prefix both share, no cache), their gap, and the gap in steps of the logits dtype's spacing at that size (a
    bf16 logit near 4 is a multiple of 1/32: a gap of one or two steps is a tie that any rounding may flip). ``None``
    when they are equal."""
    diff = (a != b).nonzero()
    if not len(diff):
        return None
    col = int(diff[:, 1].min())
    row = int(diff[diff[:, 1] == col][0, 0])
    prefix = a[row : row + 1, :col].to(model.device)
    with torch.inference_mode():
        # logits_to_keep=1: the last position's only (all of a 32k prefix would be 32k x vocab of them)
        logits = type(model).forward(model, input_ids=prefix, use_cache=False, logits_to_keep=1).logits[0, -1]
    ta, tb = int(a[row, col]), int(b[row, col])
    la, lb = float(logits[ta]), float(logits[tb])
    size = max(abs(la), abs(lb), torch.finfo(logits.dtype).tiny)
    step = torch.finfo(logits.dtype).eps * 2.0 ** math.floor(math.log2(size))  # the dtype's spacing at that size
    top2 = logits.float().topk(2).values
    return {
        "new_token": col - context,
        "row": row,
        "tokens": (ta, tb),
        "eager_logit_gap": la - lb,
        "gap_in_steps": abs(la - lb) / step,
        "eager_top2_margin": float(top2[0] - top2[1]),
    }


def near_tie(r: Result, dtype: torch.dtype) -> bool:
    """``r``'s ids differ from its reference's first at a near-tie (``NEAR_TIE_STEPS``), in a dtype below fp32."""
    return dtype != torch.float32 and r.divergence is not None and r.divergence["gap_in_steps"] <= NEAR_TIE_STEPS


def describe(d: dict) -> str:
    """One line of ``divergence``'s finding."""
    return (
        f"from new token {d['new_token']} (row {d['row']}: tokens {d['tokens'][0]} / {d['tokens'][1]}, "
        f"their eager logits {abs(d['eager_logit_gap']):.4g} apart = {d['gap_in_steps']:.0f} step(s) of the dtype)"
    )


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


def forward_dynamic(model) -> Optional[bool]:
    """``dynamic`` for ``torch.compile(model.forward)``: False (static shapes: one graph for the prefill, one for the
    decode step), except for a model with sliding-window layers (GPT-OSS). transformers' static cache keeps such a
    layer's length as a Python int (``StaticSlidingWindowLayer.cumulative_length_int``), which a static compile
    guards on: with ``dynamic=False`` every decode step compiles again, under any backend, until Dynamo's recompile
    limit, after which the step runs eagerly. ``None`` (Dynamo's default) makes that int symbolic where it changed
    from the prefill's: the decode step compiles once (tests/cpu/test_examples.py: 2 graphs for 8 new tokens, 8
    with ``dynamic=False``)."""
    types = getattr(model.config, "layer_types", None) or ()
    return None if "sliding_attention" in types else False


def forward_setup(backend: str, device: str):
    def setup(model):
        model.__dict__.pop("forward", None)
        # no CUDA graphs: see above
        model.forward = torch.compile(model.forward, backend=backend, dynamic=forward_dynamic(model))
        return None

    return setup


def variants(dtype: torch.dtype, device: str, inductor: bool = False) -> list[tuple[str, Callable, Optional[str]]]:
    """(name, setup, the variant whose ids it must equal); ``inductor``: Inductor compiled both ways too, timed
    beside rubin (in bf16 its ``compile_config`` way is always there, as the ids' reference)."""
    out = [("eager", eager_setup, None)]
    if dtype == torch.float32:
        ref = "eager"
        if inductor:
            out.append(("inductor (compile_config)", compile_config_setup("inductor", device), ref))
    else:
        out.append(("inductor (compile_config)", compile_config_setup("inductor", device), None))
        ref = "inductor (compile_config)"
    out += [
        ("rubin (compile_config)", compile_config_setup("rubin", device), ref),
        ("rubin (model.forward)", forward_setup("rubin", device), ref),
    ]
    if inductor:
        out.append(("inductor (model.forward)", forward_setup("inductor", device), ref))
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
    p.add_argument("--inductor", action="store_true", help="time Inductor both ways too (fp32: checked against eager)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, dtype, args.device, args.context + args.new_tokens + 8)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, model.config.vocab_size, (args.batch, args.context), generator=g).to(args.device)

    results: dict[str, Result] = {}
    for name, setup, ref in variants(dtype, args.device, args.inductor):
        torch._dynamo.reset()
        gc.collect()
        r = run_variant(name, model, prompt, args.new_tokens, args.device, args.repeats, setup)
        if ref is not None:
            r.checked_against, r.equal = ref, torch.equal(r.ids, results[ref].ids)
            if not r.equal:
                r.divergence = divergence(model, r.ids, results[ref].ids, args.context)
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
            ids += " " + describe(r.divergence) + (": a near-tie, accepted" if near_tie(r, dtype) else "")
        compile_s = "-" if r.variant == "eager" else f"{r.first_call_s - r.warm_call_s:.1f} s"
        print(f"| {r.variant} | {r.tokens_per_s:.1f} | {r.per_token_us:.0f} us | {compile_s} | {ids} |")
    failed = [r.variant for r in results.values() if r.equal is False and not near_tie(r, dtype)]
    if failed:
        print(f"\ngenerated ids differ (not at a near-tie) for: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
