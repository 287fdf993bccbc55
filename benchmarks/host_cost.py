"""Host cost of rubin's decode ops outside CUDA graphs, where it goes, and what Inductor's code for the same
computation costs (run on the GPU).

    PYTHONPATH=. python benchmarks/host_cost.py [--out DIR] [--label NAME]

Why: without CUDA graphs a decode step is host-bound, so an op that saves GPU time but costs more host time to
launch makes the step slower (issue 16: generate() with ``model.forward`` compiled ran 2.2x slower under rubin than
under Inductor at 4k). For each of rubin's decode ops at Qwen3-30B-A3B's sizes (MoE T = 1 bf16, the routing T = 1,
the decode attention over a static cache of 4096 + 136 positions with transformers' bool mask) it measures:

* ``host us``: wall time of one call started on an idle GPU (synchronised before, outside the timed region),
  median of ``--reps``: what the CPU pays per call;
* ``stream us``: ``--reps`` calls back to back without synchronising, divided by their number: the time per
  call of an uncaptured loop of them (whichever of host and GPU is slower sets it);
* ``device us``: 16 calls captured in one CUDA graph, replayed (median), per call: the GPU time alone;
* for rubin's ops, where the host time goes (nested wall-clock timers, summed per call): the op's dispatch
  (``torch.ops.rubin.X`` to ``CanonicalOp.run``), the registry (``CanonicalOp.run`` to the adapter), the adapter's
  own Python, and the kernel launches (``kernels/triton/launch.py``'s ``Launcher.launch``: the bound binary, or Triton's
  own path for a key's first launch; with their count), then those launches replayed alone.

The rival ("inductor") is the same computation written as the source model writes it (transformers' batched-mm
experts, its routing, repeat_kv + SDPA with the mask), compiled with ``backend="inductor"``: what a step without
rubin runs. Prints a table and writes host-cost-<label>.{md,json}.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rubin_compile.kernels.triton.tune_moe import make_routing, make_weights, time_graph
from rubin_compile.ops import registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_host_overhead import host_us  # noqa: E402  (one call on an idle GPU, median; the same measure as there)

H, E, I, K = 2048, 128, 768, 8  # Qwen3-30B-A3B
HQ, HKV, D = 32, 4, 128
CALLS = 16  # per captured graph


# ------------------------------------------------------------------------------------------------
# nested timers
# ------------------------------------------------------------------------------------------------


class Timers:
    """Wall-clock seconds spent inside patched functions, summed over calls, and call counts."""

    def __init__(self) -> None:
        self.total: collections.Counter = collections.Counter()
        self.count: collections.Counter = collections.Counter()
        self.enabled = False

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            if not self.enabled:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total[name] += time.perf_counter() - t0
                self.count[name] += 1

        return timed

    def reset(self) -> None:
        self.total.clear()
        self.count.clear()


TIMERS = Timers()


RECORDED: list = []  # (Launcher, grid, args, kwargs) of the launches of one call, while RECORD[0]
RECORD = [False]


def install_timers() -> None:
    from rubin_compile.kernels.triton.launch import Launcher

    timed_launch = TIMERS.wrap("launch", Launcher.launch)

    def launch(self, grid, args, kwargs):
        if RECORD[0]:
            RECORDED.append((self, grid, args, dict(kwargs)))
        return timed_launch(self, grid, args, kwargs)

    Launcher.launch = launch  # every launch of our kernels: the bound binary or Triton's own path
    for op in registry.CANONICAL_OPS.values():
        op.run = TIMERS.wrap(f"registry.{op.name}", op.run)
        for k in op.kernels():
            if k.run is not None:
                object.__setattr__(k, "run", TIMERS.wrap(f"adapter.{op.name}", k.run))


# ------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------


def stream_us(fn, reps: int) -> float:
    rounds = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) * 1e6 / reps)
    return statistics.median(rounds)


def device_us(fn) -> float:
    return statistics.median(time_graph([fn] * CALLS, reps=30, warmup=3))


def breakdown(fn, op: str, reps: int) -> dict:
    """Per call: total, the op's dispatch, the registry, the adapter's own Python, the kernel launches."""
    TIMERS.reset()
    TIMERS.enabled = True
    t = []
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    finally:
        TIMERS.enabled = False
    torch.cuda.synchronize()
    per = {name: TIMERS.total[name] / reps * 1e6 for name in TIMERS.total}
    # the same launches again, alone: their cost without rubin's Python around them
    RECORDED.clear()
    RECORD[0] = True
    try:
        fn()
    finally:
        RECORD[0] = False
    launches = list(RECORDED)

    def replay():
        for lau, grid, a, k in launches:
            lau.launch(grid, a, k)

    replay_us = host_us(replay, reps)
    total = sum(t) / reps * 1e6
    reg, ada, lau = per.get(f"registry.{op}", 0.0), per.get(f"adapter.{op}", 0.0), per.get("launch", 0.0)
    return {
        "total": total,
        "dispatch": total - reg,
        "registry": reg - ada,
        "adapter": ada - lau,
        "launch": lau,
        "launch_count": TIMERS.count["launch"] / reps,
        "launch_alone": replay_us,
    }


# ------------------------------------------------------------------------------------------------
# the ops and their rivals
# ------------------------------------------------------------------------------------------------


def batched_mm_experts(x, w13, w2, tw, ids):
    """transformers 5.x's batched-mm experts (what generate() switches a GPU model's experts to for decode)."""
    T = x.shape[0]
    flat = ids.reshape(-1)
    h = x.repeat_interleave(ids.shape[1], dim=0)
    gate_up = torch.bmm(w13[flat], h.unsqueeze(-1)).squeeze(-1)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    out = torch.bmm(w2[flat], act.unsqueeze(-1)).squeeze(-1)
    out = out * tw.reshape(-1, 1).to(out.dtype)
    return out.view(T, ids.shape[1], -1).sum(1)


def qwen3_routing(x, w):
    logits = F.linear(x, w)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, K, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), ids


def repeat_kv_sdpa(q, k, v, mask):
    n = q.shape[1] // k.shape[1]
    B, Hkv, S, Dh = k.shape
    k = k[:, :, None].expand(B, Hkv, n, S, Dh).reshape(B, Hkv * n, S, Dh)
    v = v[:, :, None].expand(B, Hkv, n, S, Dh).reshape(B, Hkv * n, S, Dh)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def cases(context: int) -> list[tuple[str, str, object, object]]:
    """(name, op, rubin call, rival call)."""
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    w = make_weights(E, H, I, "bf16")
    x = torch.randn((1, H), device="cuda", dtype=dt)
    tw, ids = make_routing(1, E, K, generator=g)
    tw = tw.to(dt)
    moe_rival = torch.compile(batched_mm_experts, backend="inductor", dynamic=False)
    rw = (torch.randn((E, H), device="cuda") / H**0.5).to(dt)
    route_rival = torch.compile(qwen3_routing, backend="inductor", dynamic=False)
    skv = context + 136
    q = torch.randn(1, 1, HQ, D, device="cuda", dtype=dt).transpose(1, 2)
    kc = torch.randn(1, HKV, skv, D, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    mask = (torch.arange(skv, device="cuda") < context)[None, None, None, :]
    attn_rival = torch.compile(repeat_kv_sdpa, backend="inductor", dynamic=False)
    rubin = torch.ops.rubin
    return [
        (
            "moe (Qwen3-30B-A3B, T=1, bf16)",
            "moe",
            lambda: rubin.moe.default(x, w["w13"], w["w2"], tw, ids, impl="triton@sm90"),
            lambda: moe_rival(x, w["w13"], w["w2"], tw, ids),
        ),
        (
            "route (E=128, k=8, T=1)",
            "route",
            lambda: rubin.route.default(
                x, rw, K, renormalize=True, logits_dtype=dt, weights_dtype=dt, impl="triton@sm90"
            ),
            lambda: route_rival(x, rw),
        ),
        (
            f"attention (32/4 heads, cache {skv}, filled {context})",
            "attention",
            lambda: rubin.attention.default(q, kc, vc, mask, impl="triton@sm90"),
            lambda: attn_rival(q, kc, vc, mask),
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--label", default="run")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    install_timers()
    rows = []
    for name, op, ours, rival in cases(args.context):
        row = {"case": name, "op": op}
        for who, fn in (("rubin", ours), ("inductor", rival)):
            row[f"{who}_host_us"] = host_us(fn, args.reps)
            row[f"{who}_stream_us"] = stream_us(fn, args.reps)
            row[f"{who}_device_us"] = device_us(fn)
        row["rubin_breakdown"] = breakdown(ours, op, args.reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = [
        f"Host cost per call outside CUDA graphs ({args.label}; torch {torch.__version__}, "
        f"{torch.cuda.get_device_name()})",
        "",
        "| op | rubin host | rubin stream | rubin device | inductor host | inductor stream | inductor device |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['rubin_host_us']:.1f} | {r['rubin_stream_us']:.1f} | {r['rubin_device_us']:.1f} | "
            f"{r['inductor_host_us']:.1f} | {r['inductor_stream_us']:.1f} | {r['inductor_device_us']:.1f} |"
        )
    lines += [
        "",
        "Where rubin's host time goes (us per call, nested timers; their own cost included):",
        "",
        "| op | total | dispatch (torch.ops to the registry) | registry | adapter's Python | launches (count) | the same launches alone |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["rubin_breakdown"]
        lines.append(
            f"| {r['op']} | {b['total']:.1f} | {b['dispatch']:.1f} | {b['registry']:.1f} | {b['adapter']:.1f} | "
            f"{b['launch']:.1f} ({b['launch_count']:.0f}) | {b['launch_alone']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"host-cost-{args.label}.md").write_text(text)
    (out / f"host-cost-{args.label}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
