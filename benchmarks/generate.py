"""Hugging Face generate() with a static cache: eager, Inductor and rubin, tokens per second and per-token
latency, the decode forward alone as one CUDA graph against its floor, and a per-kernel breakdown of one step.

    PYTHONPATH=. python benchmarks/generate.py --out benchmarks/results            # the full matrix (H200)
    PYTHONPATH=. python benchmarks/generate.py --contexts 4096 --batches 1 --new-tokens 32

Model: examples/generate.py's ``qwen3-30b-a3b-8l`` (8 layers of Qwen3-30B-A3B's dimensions, random bf16
weights, vocabulary 4096). Prompt of ``context`` random tokens, ``--new-tokens`` greedy tokens,
``cache_implementation="static"`` (max_cache_len = context + new tokens).

* generate: each variant's ``generate()`` -- eager (``disable_compile=True``: without it transformers compiles the
  forward itself on a GPU with a static cache, so the eager rows of the runs before 2026-12-03 were most likely
  that compile); ``compile_config=CompileConfig(backend=..., mode=
  "reduce-overhead")`` for Inductor and rubin (generate compiles its decode step; prefill stays eager). Per-token
  latency = (t(N) - t(1)) / (N - 1) (prefill and first token taken out), median of ``--repeats``; tokens/s =
  batch / per-token latency; compile time = the first call less a warm one; the generated ids against Inductor's.
* step: the decode forward alone (``model.forward`` compiled with ``dynamic=False`` and no CUDA graphs of its own,
  one step captured in one ``torch.cuda.CUDAGraph``, replayed: CUDA events, median) at the ``--step-contexts``
  with batch 1, against the floor per step; the compiles of ``--step-variants`` (``STEP_VARIANTS``: rubin with
  ``cudagraphs="external"``, as a serving runner that captures the step would compile it; ablations).
* floor per step: (bytes of the weights one step reads -- attention, norms, router, the distinct experts the
  batch is routed to under uniform routing, LM head -- plus the K and V bytes of the filled cache at the middle of
  the generation) / device-to-device copy bandwidth measured at the start.
* breakdown: torch.profiler over replays of the rubin step graph (and Inductor's), device time per kernel group.

Writes ``generate-<gpu>.{md,json,png}`` under ``--out`` (gpu_names.py; ``generate-<gpu>-<model>`` for a ``--model``
other than qwen3-30b-a3b-8l, e.g. gpt-oss-20b-8l). ``--setup forward`` times generate() with ``model.forward``
compiled instead (examples/generate.py's second way: no CUDA graphs, so the host cost of every op is paid per step)
and writes ``generate-forward-<gpu>.*``; pass ``--step-contexts ""`` to skip the one-graph step there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from decode_step import profile_step, weight_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: gpu_names
from gpu_names import gpu_slug  # noqa: E402  (benchmarks/gpu_names.py)

# examples/generate.py: the model and the generate variants (loaded by path: this module has the same name)
_spec = importlib.util.spec_from_file_location("generate_example", HERE.parent / "examples" / "generate.py")
example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = example  # its dataclasses look their module up
_spec.loader.exec_module(example)

BACKENDS = {"eager": None, "inductor": "inductor", "rubin": "rubin"}

# The decode forward alone, captured by this script in one CUDA graph (what a serving runner does): name ->
# (backend, torch.compile options). rubin is told the graph is captured by its caller (cudagraphs="external"), so
# it plans for graph replay (PDL, the kernels that pay only there) as it does under mode="reduce-overhead".
STEP_VARIANTS = {
    "inductor": ("inductor", None),
    "rubin": ("rubin", {"cudagraphs": "external"}),
    # rubin not told about the capture (plans as for an uncaptured graph: no PDL, cuBLAS GEMMs)
    "rubin-uncaptured-plan": ("rubin", {}),
    "rubin-nofuse": ("rubin", {"cudagraphs": "external", "fuse_projections": "off"}),
    # Inductor's own Triton kernels PDL-launched too (torch._inductor.config.triton.enable_pdl)
    "rubin-inductor-pdl": ("rubin", {"cudagraphs": "external", "inductor": {"triton.enable_pdl": True}}),
    "inductor-pdl": ("inductor", {"triton.enable_pdl": True}),
    # the decode attention kernel PDL-launched, which selection declines (kernels/triton/__init__.py
    # ATTENTION_PDL_DECLINED), and its Config options for a PDL launch; rubin as above otherwise
    "rubin-attn-pdl": ("rubin", {"cudagraphs": "external"}),
    "rubin-attn-pdl-late-trigger": ("rubin", {"cudagraphs": "external"}),
    "rubin-attn-pdl-l2-prefetch": ("rubin", {"cudagraphs": "external"}),
}
# what an attention ablation changes, for every call while the step is warmed up and captured: the launch it is
# given (Launch(pdl=True) whatever the plan says) and the kernel Config fields
ATTENTION_ABLATIONS = {
    "rubin-attn-pdl": {},
    "rubin-attn-pdl-late-trigger": {"early_trigger": False},
    "rubin-attn-pdl-l2-prefetch": {"prefetch_tiles": 2},
}


@contextlib.contextmanager
def attention_config(variant: str):
    """For an ``ATTENTION_ABLATIONS`` variant: ``kernels/triton/attention.run`` launched with PDL and ``config_for``
    with the variant's Config fields (nothing else changes); other variants run as planned."""
    from rubin_compile.kernels.triton import attention
    from rubin_compile.ops.registry import Launch

    if variant not in ATTENTION_ABLATIONS:
        yield
        return
    change = ATTENTION_ABLATIONS[variant]
    original_config, original_run = attention.config_for, attention.run
    attention.run = lambda args, launch=Launch(), **kw: original_run(args, Launch(True, launch.placement), **kw)
    attention.config_for = lambda *a: dataclasses.replace(original_config(*a), **change)
    try:
        yield
    finally:
        attention.config_for, attention.run = original_config, original_run


def floor_us(cfg, batch: int, context: int, new: int, dtype_bytes: int, bw_gbps: float) -> dict:
    """The floor of one decode step at the middle of the generation (module docstring)."""
    weights = weight_bytes(cfg, batch)["total"]
    filled = context + new // 2
    # a sliding-window layer (GPT-OSS's every other one) reads at most its window
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or filled
    positions = sum(min(window, filled) if t == "sliding_attention" else filled for t in types)
    kv = 2 * batch * cfg.num_key_value_heads * cfg.head_dim * positions * dtype_bytes
    return {"weights_MB": weights / 1e6, "kv_MB": kv / 1e6, "us": (weights + kv) / (bw_gbps * 1e9) * 1e6}


def rewinder(cache, context: int):
    """A function that sets a static cache prefilled with ``context`` tokens back to that length, so the next step
    writes the same position and the compiled step's guards hold. It rewinds the full layers' counters (tensors); a
    sliding-window layer (GPT-OSS) is full after a prefill longer than its window and rolls its window on every step
    whatever its counter says, but its Python-int copy of the counter (``cumulative_length_int``, what
    get_seq_length returns) is a guard of the compiled step: rewound too, or each step would recompile, the last of
    them during the CUDA-graph capture (tests/cpu/benchmarks/test_generate_step.py)."""
    lengths = [layer.cumulative_length for layer in cache.layers if not getattr(layer, "is_sliding", False)]
    sliding = [layer for layer in cache.layers if hasattr(layer, "cumulative_length_int")]

    def rewind():
        with torch.inference_mode():  # the cache's counters are inference tensors (the prefill ran in it)
            for n in lengths:
                n.fill_(context)
            for layer in sliding:
                layer.cumulative_length_int = context

    return rewind


def step_graph(model, variant: str, batch: int, context: int, new: int):
    """(replay, compile seconds): one decode step of ``model.forward`` compiled as ``STEP_VARIANTS[variant]`` says
    (no CUDA graphs of its own), captured in one CUDA graph over a static cache prefilled with ``context`` tokens.
    Each replay writes the next cache position; the position is reset before the cache would fill."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=context + new)
    prompt = torch.randint(1, model.config.vocab_size, (batch, context), device="cuda")
    step_ids = torch.randint(1, model.config.vocab_size, (batch, 1), device="cuda")
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)  # eager prefill
    rewind = rewinder(cache, context)
    backend, options = STEP_VARIANTS[variant]
    fwd = torch.compile(model.forward, backend=backend, dynamic=False, options=options)

    def step():
        return fwd(input_ids=step_ids, past_key_values=cache, use_cache=True).logits

    t0 = time.perf_counter()
    with torch.inference_mode(), attention_config(variant):
        for _ in range(3):
            rewind()
            step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        rewind()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    rewind()
    state = {"used": 0}

    def replay(_=None):
        if state["used"] >= new - 1:
            rewind()
            state["used"] = 0
        graph.replay()
        state["used"] += 1

    return replay, compile_s


def time_replays(replay, iters: int = 50) -> float:
    """Median us of one replay (CUDA events around each)."""
    for _ in range(5):
        replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096,16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--variants", default="eager,inductor,rubin")
    ap.add_argument("--eager-batches", default="1", help="batches at which eager is timed (it is ~10 ms a token)")
    ap.add_argument("--step-contexts", default="4096,16384", help="contexts of the one-CUDA-graph step (batch 1)")
    ap.add_argument(
        "--step-variants",
        default="inductor,rubin",
        help=f"compiles of the one-CUDA-graph step, from {list(STEP_VARIANTS)}",
    )
    ap.add_argument(
        "--profile-variants", default=None, help="step variants profiled at the first step context (default: all)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="qwen3-30b-a3b-8l")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--setup",
        choices=["compile_config", "forward"],
        default="compile_config",
        help="how generate() is compiled: its compile_config (CUDA graphs) or model.forward (no CUDA graphs)",
    )
    args = ap.parse_args()
    import rubin_compile  # noqa: F401  (backend="rubin" from a checkout)
    from rubin_compile.kernels.triton.tune_moe import copy_bandwidth_gbs

    torch._dynamo.config.cache_size_limit = 64
    contexts = [int(c) for c in args.contexts.split(",") if c]
    batches = [int(b) for b in args.batches.split(",") if b]
    names = args.variants.split(",")
    eager_batches = {int(b) for b in args.eager_batches.split(",") if b}
    step_contexts = [int(c) for c in args.step_contexts.split(",") if c]
    step_variants = [v for v in args.step_variants.split(",") if v]
    unknown = [v for v in step_variants if v not in STEP_VARIANTS]
    if unknown:
        ap.error(f"unknown --step-variants {unknown}; known: {list(STEP_VARIANTS)}")
    profiled = step_variants if args.profile_variants is None else args.profile_variants.split(",")
    new = args.new_tokens
    model = example.build_model(args.model, torch.bfloat16, "cuda", max(contexts + step_contexts) + new + 8)
    cfg = model.config
    bw = copy_bandwidth_gbs()
    head = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s"
    print(head, flush=True)
    rows, steps, profiles, skipped = [], [], {}, []
    for batch in batches:
        for context in contexts:
            g = torch.Generator().manual_seed(context + batch)
            prompt = torch.randint(1, cfg.vocab_size, (batch, context), generator=g).cuda()
            fl = floor_us(cfg, batch, context, new, 2, bw)
            results, oom = {}, None
            for i, name in enumerate(names):
                if name == "eager" and batch not in eager_batches:
                    continue
                torch._dynamo.reset()
                compiled = example.forward_setup if args.setup == "forward" else example.compile_config_setup
                setup = example.eager_setup if name == "eager" else compiled(BACKENDS[name], "cuda")
                try:
                    results[name] = example.run_variant(name, model, prompt, new, "cuda", args.repeats, setup)
                except torch.OutOfMemoryError as exc:
                    # GPT-OSS's eager attention materialises [B, Hq, S, S] scores in the (uncompiled) prefill: 32 GiB
                    # of fp32 softmax at 4k, batch 8. The variants after this one share that prefill: none is run.
                    oom = {"batch": batch, "context": context, "variants": names[i:], "reason": str(exc).split(".")[0]}
                    break
            if oom is not None:
                skipped.append(oom)
                print(json.dumps({"skipped": oom}), flush=True)
                torch.cuda.empty_cache()
            ref = results.get("inductor")
            for name, r in results.items():
                row = {
                    "batch": batch,
                    "context": context,
                    "variant": name,
                    "per_token_us": r.per_token_us,
                    "tokens_per_s": r.tokens_per_s,
                    "x_floor": r.per_token_us / fl["us"],
                    "floor_us": fl["us"],
                    "compile_s": r.first_call_s - r.warm_call_s if name != "eager" else None,
                    "first_call_s": r.first_call_s,
                    "ids_equal_inductor": bool(torch.equal(r.ids, ref.ids)) if ref is not None else None,
                }
                if ref is not None and not row["ids_equal_inductor"]:
                    # where, and whether a near-tie: eager's logits of the two tokens there, in steps of bf16
                    row["divergence"] = example.divergence(model, r.ids, ref.ids, context)
                if ref is not None and name == "rubin":
                    row["speedup_vs_inductor"] = ref.per_token_us / r.per_token_us
                rows.append(row)
                print(json.dumps(row), flush=True)
    model.__dict__.pop("forward", None)
    for context in step_contexts:
        fl = floor_us(cfg, 1, context, new, 2, bw)
        for name in step_variants:
            torch._dynamo.reset()
            replay, compile_s = step_graph(model, name, 1, context, new)
            us = time_replays(replay)
            steps.append(
                {
                    "context": context,
                    "variant": name,
                    "options": STEP_VARIANTS[name][1],
                    "us": us,
                    "floor_us": fl["us"],
                    "x_floor": us / fl["us"],
                    "compile_s": compile_s,
                }
            )
            print(json.dumps(steps[-1]), flush=True)
            if context == step_contexts[0] and name in profiled:
                profiles[f"{name}, context {context}"] = profile_step(replay, None)
            del replay
            torch.cuda.empty_cache()
    lines = [
        f"generate() with a static cache, {args.model} (random bf16 weights), greedy, prompt + {new} new tokens; "
        + (
            "compiled by generate's compile_config (mode='reduce-overhead', CUDA graphs); "
            if args.setup == "compile_config"
            else "model.forward compiled (torch.compile(model.forward, dynamic=False), no CUDA graphs); "
        )
        + head,
        "",
        "| batch | context | variant | tokens/s | per-token us | x floor | rubin vs Inductor | compile s | ids = Inductor's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = f"{r['speedup_vs_inductor']:.2f}x" if "speedup_vs_inductor" in r else "-"
        cs = f"{r['compile_s']:.0f}" if r["compile_s"] is not None else "-"
        eq = {None: "-", True: "yes", False: "no " + (example.describe(r["divergence"]) if "divergence" in r else "")}[
            r["ids_equal_inductor"]
        ]
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['variant']} | {r['tokens_per_s']:.1f} | {r['per_token_us']:.0f} | "
            f"{r['x_floor']:.2f} | {sp} | {cs} | {eq} |"
        )
    lines += [
        f"| {k['batch']} | {k['context']} | {', '.join(k['variants'])} | not measured: {k['reason']} | | | | | |"
        for k in skipped
    ]
    lines += [
        "",
        "Decode forward alone, one CUDA graph (batch 1; variants: benchmarks/generate.py STEP_VARIANTS):",
        "",
        "| context | variant | us / step | floor us | x floor |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {s['context']} | {s['variant']} | {s['us']:.0f} | {s['floor_us']:.0f} | {s['x_floor']:.2f} |" for s in steps
    ]
    for key, prof in profiles.items():
        lines += [
            "",
            f"Per-kernel breakdown of one decode step, {key} (torch.profiler):",
            "",
            "| kernels of | us | kernels |",
        ]
        lines += ["|---|---|---|"]
        lines += [f"| {c} | {d['us']:.1f} | {d['kernels']:.0f} |" for c, d in prof["categories"].items()]
        lines += [
            "",
            f"kernel boundaries: {prof['boundaries']} per step, {prof['overlapped']} overlapped (the next kernel "
            f"started before the previous ended), median gap {prof['median_gap_us'] or 0:.2f} us",
        ]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"generate-{gpu_slug()}" if args.setup == "compile_config" else f"generate-forward-{gpu_slug()}"
        if args.model != ap.get_default("model"):  # another model's table beside the default's: generate-<gpu>-<model>
            stem += f"-{args.model}"
        (out / f"{stem}.md").write_text(text + "\n")
        (out / f"{stem}.json").write_text(
            json.dumps(
                {"device": head, "rows": rows, "skipped": skipped, "steps": steps, "profiles": profiles}, indent=1
            )
        )
        plot(rows, out / f"{stem}.png")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    batches = sorted({r["batch"] for r in rows})
    if not batches:  # only the step was measured
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for variant in ("eager", "inductor", "rubin"):
            pts = sorted(
                (r["context"], r["per_token_us"]) for r in rows if r["batch"] == batch and r["variant"] == variant
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=variant)
        pts = sorted({(r["context"], r["floor_us"]) for r in rows if r["batch"] == batch})
        ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], linestyle="--", label="floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("per-token latency (ms)")
        ax.set_title(f"generate(), batch {batch}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
