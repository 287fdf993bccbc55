"""Tune the small-M Triton GEMM on the GPU and write its table (never run at import).

    PYTHONPATH=. python -m rubin_compile.kernels.triton.tune_gemm --formats bf16,fp8_block --merge

For every benchmark shape (``SHAPES``: the decode projections of Qwen3-30B-A3B, Llama-3.1-8B and DeepSeek-V3
TP8), weight format and M bucket (1, 2, ..., 64) it times candidate configs of our kernel and cuBLAS --
back-to-back calls in one CUDA graph over enough copies of the weights that L2 never holds the next call's
(a decode step's GEMMs read weights from HBM), median of the replays --, checks the fastest against the
op's reference, and writes ``gemm_configs/<GPU name>.json``: per (N, K, format) and M bucket the config, our
time with PDL on (how a CUDA-graph decode step launches it) and off, with the L2 prefetch flipped, cuBLAS's time,
the heuristic config's time, and the floor. ``--inductor-from`` merges Inductor max-autotune times that
benchmarks/gemm.py measured (Inductor's autotuning compiles for minutes per shape; it is measured once, there).

The harness (``make_weights``, ``time_op``, ``cublas_time``) is shared with benchmarks/gemm.py.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from dataclasses import replace
from typing import Callable, Optional

import torch

from rubin_compile.kernels.triton import gemm as G
from rubin_compile.kernels.triton.tune_moe import copy_bandwidth_gbs, time_graph, warm_compile
from rubin_compile.ops.gemm import GemmArgs, aten, reference

# name: (K, N). Qwen3-30B-A3B: q/k/v fused (32 + 4 + 4 heads of 128), k or v alone (unfused under CUDA graphs),
# o_proj, router (128 experts), LM head
# (vocabulary 151936, and the 4096 of benchmarks/decode_step.py); Llama-3.1-8B: fused qkv, o, fused gate-up,
# down; DeepSeek-V3 with tensor parallelism 8: MLA q_a / q_b / kv_a / kv_b / o and the dense layers' MLP.
SHAPES: dict[str, tuple[int, int]] = {
    "qwen3-30b-a3b.qkv": (2048, 5120),
    "qwen3-30b-a3b.kv": (2048, 512),
    "qwen3-30b-a3b.o": (4096, 2048),
    "qwen3-30b-a3b.router": (2048, 128),
    "qwen3-30b-a3b.lm_head": (2048, 151936),
    "qwen3-30b-a3b.lm_head_4k": (2048, 4096),
    "llama-3.1-8b.qkv": (4096, 6144),
    "llama-3.1-8b.o": (4096, 4096),
    "llama-3.1-8b.gate_up": (4096, 28672),
    "llama-3.1-8b.down": (14336, 4096),
    "deepseek-v3-tp8.q_a": (7168, 1536),
    "deepseek-v3-tp8.q_b": (1536, 3072),
    "deepseek-v3-tp8.kv_a": (7168, 576),
    "deepseek-v3-tp8.kv_b": (512, 4096),
    "deepseek-v3-tp8.o": (2048, 7168),
    "deepseek-v3-tp8.mlp_gate_up": (7168, 4608),
    "deepseek-v3-tp8.mlp_down": (2304, 7168),
}
FORMATS = ("bf16", "fp8_block")
ROTATE_BYTES = 240e6  # weights cycled through per graph replay: several times L2 (50 MB on H200)


# ------------------------------------------------------------------------------------------------
# inputs and timing (shared with benchmarks/gemm.py)
# ------------------------------------------------------------------------------------------------


def make_weights(N: int, K: int, wfmt: str, copies: int, seed: int = 0) -> list[dict]:
    """``copies`` random weights as ``rubin.gemm`` keyword arguments (``b`` = W.t() of an [N, K] weight;
    ``fp8_block``: e4m3 with 128 x 128 scales, given transposed like a checkpoint's ``weight_scale_inv``)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(copies):
        if wfmt == "bf16":
            w = (torch.randn((N, K), generator=g, device="cuda") / math.sqrt(K)).to(torch.bfloat16)
            out.append(dict(b=w.t()))
        elif wfmt == "fp8_block":
            w = (torch.randn((N, K), generator=g, device="cuda") * 64).clamp_(-448, 448).to(torch.float8_e4m3fn)
            s = torch.rand((-(-N // 128), -(-K // 128)), generator=g, device="cuda") / (64 * math.sqrt(K))
            out.append(dict(b=w.t(), b_scale=(s + 1e-4 / math.sqrt(K)).t()))
        else:
            raise ValueError(f"unknown weight format {wfmt!r} (bf16, fp8_block)")
    return out


def copies_for(N: int, K: int, wfmt: str) -> int:
    """Weight copies per graph: ROTATE_BYTES of them, at least 2, at most 128 (a router's 0.5 MB x 128 still
    exceeds L2)."""
    return min(128, max(2, int(ROTATE_BYTES // G.weight_bytes(N, K, wfmt)) + 1))


def time_op(calls: list[Callable[[], object]], reps: int) -> float:
    """Median us per call of ``calls`` replayed back to back in one CUDA graph."""
    return statistics.median(time_graph(calls, reps=reps, warmup=3))


def ours_time(x, weights, cfg: G.GemmConfig, pdl: bool, reps: int) -> float:
    return time_op([lambda w=w: G.launch(GemmArgs(x, **w), cfg, pdl=pdl) for w in weights], reps)


def cublas_time(x, weights, wfmt: str, reps: int) -> float:
    """cuBLAS for bf16 (``torch.mm``, what the lowered node runs); for FP8 weights the op's ATen form, which
    is what rubin lowers an FP8 weight-only GEMM to when our kernel does not run it."""
    if wfmt == "bf16":
        return time_op([lambda w=w: torch.mm(x, w["b"]) for w in weights], reps)
    return time_op([lambda w=w: aten(GemmArgs(x, **w)) for w in weights[:2]], reps)


def floor_us(M: int, N: int, K: int, wfmt: str, bw_gbs: float) -> float:
    return G.flops_and_bytes(M, N, K, wfmt)[1] / (bw_gbs * 1e3)


# ------------------------------------------------------------------------------------------------
# candidates
# ------------------------------------------------------------------------------------------------


def _smem_ok(M: int, cfg: G.GemmConfig, esize: int, limit: int = 200 << 10) -> bool:
    """Whether ``num_stages - 1`` weight and activation tiles in flight fit the shared memory (227 KB on sm_90,
    with room for Triton's layout conversions)."""
    block_m = G._block_m(M, cfg.mma)
    return cfg.num_stages * cfg.block_k * (cfg.block_n * esize + block_m * 2) <= limit


def candidates(M: int, N: int, K: int, wfmt: str, num_sms: int) -> list[G.GemmConfig]:
    """Tensor-core tiles whose programs cover the SMs between half and four times over, split-K where N alone
    cannot; each with 4 warps and 4 stages, 6 stages (more weight tiles in flight), and 8 warps for wide tiles;
    K tiles of 256 where no block scale forces 128; for up to four rows also the FMA form with long K tiles and
    its reduction (GEMV) form with narrow column tiles; the heuristic's config always. Without the early weight
    tile and the L2 prefetch (``tune`` tries those on the fastest)."""
    esize = 1 if wfmt.startswith("fp8") else 2
    out = {G.heuristic(M, N, K, wfmt, num_sms)}
    block_ks = (64, 128) if wfmt == "fp8_block" else (64, 128, 256)
    for bn in (16, 32, 64, 128):
        tiles = -(-N // bn)
        for bk in block_ks:
            k_tiles = -(-K // bk)
            for split in (1, 2, 4, 8, 16):
                programs = tiles * split
                if split > 1 and (k_tiles // split < 2 or programs > 4 * num_sms):
                    continue
                if programs < num_sms // 2 and split < 16 and k_tiles // (split * 2) >= 2:
                    continue  # a larger split fills the GPU better
                if programs > 8 * num_sms and bn < 128:
                    continue  # a wider tile does the same with fewer programs
                shapes = [(4, 4)] + ([(4, 6)] if bk == 128 else []) + ([(8, 4)] if bn >= 64 and bk <= 128 else [])
                for warps, stages in shapes:
                    cfg = G.GemmConfig(bn, bk, split, warps, stages, False)
                    if _smem_ok(M, cfg, esize):
                        out.add(cfg)
    if M <= G.FMA_MAX_M:
        for bn, bk in ((8, 512), (16, 512), (16, 256)):
            tiles = -(-N // bn)
            for split in (1, 2, 4, 8):
                if split > 1 and (tiles * split > 4 * num_sms or -(-K // bk) // split < 2):
                    continue
                out.add(G.GemmConfig(bn, bk, split, 4, 3, False, False))  # plain loads: no pipeline depth
        # the reduction (GEMV) form: narrow column tiles, many programs, at most 64 fp32 accumulators a thread
        block_m = G._block_m(M, mma=False)
        for bn, bk, warps in (
            (8, 128, 4),
            (8, 256, 4),
            (8, 512, 4),
            (16, 128, 4),
            (16, 256, 4),
            (16, 512, 8),
            (32, 128, 4),
            (32, 256, 8),
        ):
            if wfmt == "fp8_block" and bk > G.SCALE_BLOCK:
                continue
            if block_m * bk * bn > 64 * 32 * warps:
                continue
            if warps == 8 and block_m > 1:  # 8-warp tiles only at 1 row (at 2 rows the first, 3-D layout spilled 8
                continue  # bytes on Triton 3.9; the flat layout does not, 161-239 registers: kept out until tuned)
            tiles = -(-N // bn)
            for split in (1, 2, 4, 8):
                if split > 1 and (tiles * split > 8 * num_sms or -(-K // bk) // split < 2):
                    continue
                out.add(G.GemmConfig(bn, bk, split, warps, 1, False, False, gemv=True))
    return sorted(out, key=lambda c: (not c.mma, c.gemv, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages))


def flipped(cfg: G.GemmConfig, **flags: bool) -> G.GemmConfig:
    return replace(cfg, **{k: (not getattr(cfg, k)) if v else getattr(cfg, k) for k, v in flags.items()})


def check(x, w, cfg: G.GemmConfig) -> Optional[str]:
    """None when our result matches the reference (fp32 accumulation: 1e-2 relative to the output's scale)."""
    args = GemmArgs(x, **w)
    got, want = G.launch(args, cfg).float(), reference(args).float()
    err = (got - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    return None if err <= 1e-2 * scale + 1e-3 else f"max error {err:.3g} for output scale {scale:.3g}"


# ------------------------------------------------------------------------------------------------
# compiling ahead, in parallel
# ------------------------------------------------------------------------------------------------


def _compile_key(M: int, wfmt: str, cfg: G.GemmConfig, split: bool) -> tuple:
    # the kernel specialises on its tiles, the M tile, the format and whether K is split (not on M, N, K)
    return (G._block_m(M, cfg.mma or M > G.FMA_MAX_M), wfmt, json.dumps(cfg.to_json(), sort_keys=True), split)


def _warm_one(job) -> Optional[str]:
    """Worker: compile one variant by running it once, PDL on and off, on a small shape of the same kind."""
    block_m, wfmt, cfg_json, split = job
    cfg = G.GemmConfig.from_json(json.loads(cfg_json))
    torch.cuda.set_device(0)
    K = cfg.block_k * max(2, cfg.split_k) * 2
    w = make_weights(512, K, wfmt, 1, seed=1)[0]
    x = torch.randn((block_m, K), device="cuda", dtype=torch.bfloat16)
    try:
        for pdl in (True, False):
            G.launch(GemmArgs(x, **w), cfg, pdl=pdl)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # reported by the caller, which then drops the config
        return f"{type(exc).__name__}: {exc}"[:300]


# ------------------------------------------------------------------------------------------------
# tuning
# ------------------------------------------------------------------------------------------------


def tune(
    shapes: list[str],
    formats: list[str],
    ms: list[int],
    reps: int,
    log: Callable[[str], None],
    checkpoint: Optional[Callable[[dict], None]] = None,
) -> dict:
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    bw = copy_bandwidth_gbs()
    log(f"{props.name}: {sms} SMs, copy bandwidth {bw:.0f} GB/s")
    t0 = time.time()
    jobs = set()
    for name in shapes:
        K, N = SHAPES[name]
        for wfmt in formats:
            for M in ms:
                for cfg in candidates(M, N, K, wfmt, sms):  # the prefetch variants compile when first timed
                    for c in (cfg, flipped(cfg, early=True)):
                        jobs.add(_compile_key(M, wfmt, c, c.split_k > 1))
    failed = warm_compile(sorted(jobs), 16, _warm_one)
    log(f"compiled {len(jobs)} variants in {time.time() - t0:.0f} s; {len(failed)} failed")
    for job, err in list(failed.items())[:10]:
        log(f"  {job}: {err}")
    entries: dict[str, dict] = {}
    for name in shapes:
        K, N = SHAPES[name]
        for wfmt in formats:
            t0 = time.time()
            weights = make_weights(N, K, wfmt, copies_for(N, K, wfmt))
            key = G.table_key(N, K, wfmt)
            rows = entries.setdefault(key, {})
            for M in ms:
                x = torch.randn((M, K), device="cuda", dtype=torch.bfloat16)
                cands = [
                    c for c in candidates(M, N, K, wfmt, sms) if _compile_key(M, wfmt, c, c.split_k > 1) not in failed
                ]
                times = {}
                for cfg in cands:
                    try:
                        times[cfg] = ours_time(x, weights, cfg, True, reps)
                    except Exception as exc:  # a config that does not compile or launch: dropped, logged
                        log(f"  {name} {wfmt} M={M} {cfg.describe()}: {type(exc).__name__}: {exc}")
                # the early weight tile on the four fastest, then the L2 prefetch on the three fastest
                for flag, top in (("early", 4), ("prefetch", 3)):
                    for cfg in sorted(times, key=times.get)[:top]:
                        other = flipped(cfg, **{flag: True})
                        if other in times:
                            continue
                        try:
                            times[other] = ours_time(x, weights, other, True, reps)
                        except Exception as exc:
                            log(f"  {name} {wfmt} M={M} {other.describe()}: {type(exc).__name__}: {exc}")
                best = min(times, key=times.get)
                bad = check(x, weights[0], best)
                if bad:
                    raise RuntimeError(f"{name} {wfmt} M={M} {best.describe()} is wrong: {bad}")
                heur = G.heuristic(M, N, K, wfmt, sms)

                def flipped_time(flag: str, ws: list = weights) -> Optional[float]:
                    other = flipped(best, **{flag: True})
                    if other not in times:
                        try:
                            times[other] = ours_time(x, ws, other, True, reps)
                        except Exception:  # e.g. the early tile does not fit the shared memory: no time
                            return None
                    return round(times[other], 3)

                row = {
                    "config": best.to_json(),
                    "ours_us": round(times[best], 3),
                    "ours_nopdl_us": round(ours_time(x, weights, best, False, reps), 3),
                    "ours_other_prefetch_us": flipped_time("prefetch"),
                    "ours_other_early_us": flipped_time("early"),
                    "heuristic": heur.to_json(),
                    "heuristic_us": round(times.get(heur, float("nan")), 3),
                    "cublas_us": round(cublas_time(x, weights, wfmt, reps), 3),
                    "inductor_us": None,
                    "floor_us": round(floor_us(M, N, K, wfmt, bw), 3),
                    "candidates": len(times),
                }
                rows[str(M)] = row
                log(
                    f"{name:28s} {wfmt:9s} M={M:3d} best {best.describe():30s} {row['ours_us']:8.2f} us "
                    f"(no PDL {row['ours_nopdl_us']:.2f}, prefetch flipped {row['ours_other_prefetch_us']}, "
                    f"early flipped {row['ours_other_early_us']}, heuristic {row['heuristic_us']:.2f}) "
                    f"cuBLAS {row['cublas_us']:.2f} floor {row['floor_us']:.2f}"
                )
            del weights
            torch.cuda.empty_cache()
            log(f"  {name} {wfmt}: {time.time() - t0:.0f} s")
            if checkpoint is not None:  # a run cut short keeps what it measured
                checkpoint({"gpu": props.name, "sms": sms, "copy_GBps": round(bw), "entries": entries})
    return {"gpu": props.name, "sms": sms, "copy_GBps": round(bw), "entries": entries}


def merge(old: dict, new: dict, inductor_from: Optional[Path]) -> dict:
    """``old`` updated with ``new``'s entries (per M bucket) and the Inductor times of a benchmark JSON."""
    table = json.loads(json.dumps(old))
    table.update({k: v for k, v in new.items() if k != "entries"})
    entries = table.setdefault("entries", {})
    for key, rows in new.get("entries", {}).items():
        kept = entries.setdefault(key, {})
        for m, row in rows.items():
            if row.get("inductor_us") is None and (kept.get(m) or {}).get("inductor_us") is not None:
                row = {**row, "inductor_us": kept[m]["inductor_us"]}  # Inductor's time does not depend on ours
            kept[m] = row
    if inductor_from is not None:  # Inductor max-autotune times measured by benchmarks/gemm.py
        for r in json.loads(inductor_from.read_text())["rows"]:
            row = entries.get(G.table_key(r["N"], r["K"], r["format"]), {}).get(str(r["M"]))
            if row is not None and r.get("inductor_us") is not None:
                row["inductor_us"] = r["inductor_us"]
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--ms", default=",".join(map(str, G.M_BUCKETS)))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=str(G.CONFIG_DIR))
    ap.add_argument("--merge", action="store_true", help="update the existing table instead of replacing it")
    ap.add_argument("--inductor-from", default=None, help="benchmarks/gemm.py JSON whose Inductor times to merge")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_gemm needs a CUDA GPU")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / G.device_file_name(torch.cuda.get_device_properties(0).name)
    before = json.loads(path.read_text()) if path.is_file() else {}

    def write(new: dict) -> None:
        table = new
        if a.merge or a.inductor_from:
            table = merge(before, new, Path(a.inductor_from) if a.inductor_from else None)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")

    new = {}
    if a.shapes:
        ms = [int(m) for m in a.ms.split(",")]
        new = tune(a.shapes.split(","), a.formats.split(","), ms, a.reps, print, checkpoint=write)
    write(new)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
