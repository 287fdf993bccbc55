"""Ours or the baseline for one ``rubin.moe`` call of ``T`` tokens: the kernel selection runs per call size.

The Triton MoE kernels (moe.py) are built for decode: from T = 16 to 128 they read each routed expert's weights at
92-107% of the copy bandwidth on the four benchmark shapes, and below that they run forms made for one token. At
prefill sizes the same kernels can be slower than what the source graph would have run -- vLLM's own fused MoE
(its Triton ``fused_moe_kernel`` with vLLM's tuned configs: 1.9-2.0x faster at T = 1024 on Qwen3-30B-A3B and
DeepSeek-V3 TP8, issue 14), or, for a graph built from transformers' experts, rubin.moe's ATen form (sort +
``torch._grouped_mm``: 1.1x faster on Mixtral-8x7B at T = 4096, benchmarks/results/moe-h200.md). A graph compiled
with a symbolic T (vLLM, ``dynamic=True``) meets every size, so the choice is made per call, from the call's T
alone (a size, never data: no host synchronisation, and each CUDA graph a serving runner captures holds one
choice).

``choose`` decides, with the first of:

1. **The measured table** of this GPU (``moe_baselines/<GPU name>.json``, written by ``benchmarks/moe.py
   --baselines ... --write-baselines``): per shape (E, H, I, k, weight format) and measured T, our time, the
   tuned config ours ran with (``config``) and each baseline's time; the entry of the measured T nearest the
   call's in log2 (ties to the smaller) decides, up to the largest measured T, ours where it measured faster. An
   entry counts only while ours would still run the config it was timed with (``current_config``: the tuned table of moe_configs/ may have been re-tuned since, and
   then our time there is not ours any more). The plan and ``Choice.describe`` carry the times.
2. **Off the table** (no current entry at or above the call's T), **the rule**: against the ATen form, ours at
   every T where ours runs a tuned config for the shape (it measured faster at every benchmark shape and T but
   Mixtral's 256, which the tables hold), and up to ``UNTUNED_RULE_MAX_T`` tokens where it runs the heuristic's (the
   ATen form above); against vLLM's fused MoE, ours up to ``VLLM_RULE_MAX_T`` tokens and vLLM's own above (ours
   measured slower or tied at every prefill size measured before the persistent path).

The baseline a node has is what its graph runs without rubin (``KernelSpec.baseline``): ``"aten"`` for rubin.moe
(matched from graph code: transformers' experts, expert loops), ``"vllm"`` for vLLM's MoE layer op. This module
imports neither Triton nor vLLM: selection reads it when it plans for a GPU this machine lacks.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

TABLE_DIR = Path(__file__).with_name("moe_baselines")
CONFIG_DIR = Path(__file__).with_name("moe_configs")  # the tuned configs (moe.py reads them through lookup_config)
# Fields of a tuned-config entry that are its measurement, not the config
MEASUREMENT_FIELDS = frozenset({"us", "rel_err", "heuristic_us", "measured_by"})
# GemmConfig fields added after rows were first recorded, at their defaults: an fc1 / fc2 without them is the same
# tile (the tables hold configs as JSON, read here without Triton; a CPU test checks these against GemmConfig)
LATER_GEMM_DEFAULTS = {"occupancy": 1, "flatten": False, "join": False}

# What each baseline is, for plans and messages.
BASELINES: dict[str, str] = {
    "aten": "rubin.moe's ATen form (the slots sorted by expert, two torch._grouped_mm)",
    "vllm": "vLLM's own fused MoE (the layer's quant method: vLLM's Triton fused_moe and its tuned configs)",
}
# Off the table, ours runs a call against vLLM's fused MoE up to this many tokens. At 16 <= T <= 128 ours reads
# the routed experts at 92-107% of the copy bandwidth (bf16, the four benchmark shapes, benchmarks/results/moe-h200.md),
# so no kernel reading the same weights is much faster; below 16 the rule keeps ours, whose decode forms (no routing
# launch, split K, the fused top-k sum) vLLM's kernel lacks, though the two have not been timed against each other
# there; at T = 256 ours was 1.01x / 1.45x slower than vLLM's on Qwen3-30B-A3B / Mixtral-8x7B, at T = 1024 1.1-2.0x
# (issue 14, H200, 2026-11-30). The persistent prefill path (moe_prefill.py, tuned at T = 1024 and 4096 on 2026-12-05)
# timed 1.03-1.18x faster than those vLLM times, but in another run: the rule stays until one run times both.
VLLM_RULE_MAX_T = 128
# Off the table, against the ATen form, where ours has no tuned config for the shape (a GPU without a table or a
# stand-in's, a shape the tuner never saw): ours up to this many tokens, the ATen form above. On the H100 with the
# heuristic's configs (benchmarks/results/moe-h100-2026-12-05/call1-*), ours was 1.09-2.96x faster than the ATen form
# at T = 1 and 64 on Qwen3-30B-A3B, DeepSeek-V3 TP8 and Mixtral-8x7B, but the ATen form was faster at T = 256, 1024
# and 4096 on Mixtral (0.72-0.90x) and at 1024 on Qwen3 (0.92x).
UNTUNED_RULE_MAX_T = 128
# ... except, for bf16 weights on the GPUs that run these tables' configs (the H200, and by CONFIG_STAND_INS the H100):
# there ours also runs above it wherever the heuristic's config measured faster than the ATen form (``untuned_ours``):
# where it runs the persistent path (``heuristic_runs_persistent``), and where it runs its decode-style tiles on at
# most DECODE_TILES_MAX_ROWS expected rows per routed expert. On the H200 (one run, four tuned shapes and five never
# tuned: Qwen3-235B-A22B, GLM-4.5-Air, Llama-4-Scout, Qwen1.5-MoE-A2.7B, gpt-oss-120b;
# benchmarks/results/moe-h200-2026-12-05-s6/moe-heuristic-h200.md) the persistent tiles were 1.05-4.44x faster than
# the ATen form at every T and shape where they ran (T = 256 to 4096), and the decode-style tiles 1.27-1.60x at 8-17
# rows (T = 256, 512), but anywhere from 0.78x to 2.13x at 32 and more (Mixtral at T = 256, 64 rows: 1331 against
# 1083 us): the ATen form runs the calls where the decode-style tiles would get more rows. The H100 runs the same
# tiles (its stand-in configs), 1.19-3.49x faster than the ATen form at T = 1024 and 4096 on the tuned shapes
# (benchmarks/results/moe-h100-2026-12-05, call 5), and its decode-style tiles at T = 256 1.27x / 1.37x faster on
# Qwen3-30B-A3B / DeepSeek-V3 TP8 (16 / 8 rows) but 0.72x on Mixtral (64 rows) (call 1); the persistent tiles below
# T = 1024 were not timed on the H100.
PERSISTENT_RULE_CONFIGS = frozenset({"NVIDIA H200"})
PERSISTENT_RULE_FORMATS = frozenset({"bf16"})
# measured up to 17.1 rows (expected rows are fractional: DeepSeek-V3's 16 at T = 512 computes as 16.000001)
DECODE_TILES_MAX_ROWS = 17
# Where the MoE kernel's heuristic runs the persistent path on sm_90 (kernels/triton/moe.py ``persistent_heuristic``):
# (from T, at least this many expected rows per routed expert), the last pair whose T the call reaches. On the H200
# (moe-heuristic-h200.md) the persistent tiles were faster than the decode-style ones at T = 512 at 32+ rows on all
# nine (shape, format) pairs where they ran (1.12-1.87x; bf16 and FP8 block), and at T = 256 at 16-64 rows in bf16
# (1.04-1.79x, six shapes) but not with FP8 weights (0.85-0.89x, three shapes).
PERSISTENT_SWITCH = {"bf16": ((256, 16), (512, 32)), "fp8": ((512, 32),)}


def expected_distinct_experts(T: int, E: int, k: int) -> float:
    """Expected number of distinct experts hit by T tokens routed uniformly to k distinct experts each."""
    if T <= 0 or k <= 0:
        return 0.0
    return min(float(E), E * (1.0 - (1.0 - min(k, E) / E) ** T))


def expected_rows(T: int, E: int, k: int) -> float:
    """Expected slots per routed expert of a call of T tokens (routing uniform over E experts, k each)."""
    return T * k / max(1.0, expected_distinct_experts(T, E, k))


def heuristic_runs_persistent(T: int, E: int, k: int, fp8: bool = False) -> bool:
    """Whether the heuristic takes a call of ``T`` tokens to the persistent path (on sm_90): ``PERSISTENT_SWITCH``."""
    switch = [rows for t, rows in PERSISTENT_SWITCH["fp8" if fp8 else "bf16"] if T >= t]
    return bool(switch) and expected_rows(T, E, k) >= switch[-1]


def untuned_ours(T: int, E: int, k: int) -> bool:
    """Off the table, bf16, a shape without tuned configs, on a GPU of ``PERSISTENT_RULE_CONFIGS``: whether ours (the
    heuristic's config) runs the call rather than the ATen form."""
    return (
        T <= UNTUNED_RULE_MAX_T or heuristic_runs_persistent(T, E, k) or expected_rows(T, E, k) <= DECODE_TILES_MAX_ROWS
    )


def _untuned_ranges(E: int, k: int, lo: int, baseline: str) -> str:
    """``untuned_ours`` of one shape above ``lo`` tokens as ranges of T ("ours T <= 384; aten 384 < T <= 511; ours
    T > 511"), up to the T from which the persistent path runs at every size (rows grow with T)."""
    end = PERSISTENT_SWITCH["bf16"][-1][0]  # the switch untuned_ours reads
    while not heuristic_runs_persistent(end, E, k):
        end *= 2
    parts, start = [], lo
    who = untuned_ours(lo + 1, E, k)
    for T in range(lo + 2, end + 1):
        now = untuned_ours(T, E, k)
        if now != who:
            name = "ours" if who else baseline
            parts.append(f"{name} T <= {T - 1}" if start == 0 else f"{name} {start} < T <= {T - 1}")
            start, who = T - 1, now
    parts.append(f"{'ours' if who else baseline} T > {start}" if start else f"{'ours' if who else baseline} every T")
    return "; ".join(parts)


_WFMT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def weight_format(weight_dtype: torch.dtype, block_scaled: bool) -> str:
    """The tables' word for a weight format: bf16 / fp16 / fp32, fp8 (per-tensor or per-expert scales) or
    fp8_block."""
    if weight_dtype.is_floating_point and weight_dtype.itemsize == 1:
        return "fp8_block" if block_scaled else "fp8"
    return _WFMT.get(weight_dtype, str(weight_dtype).replace("torch.", ""))


def table_key(E: int, H: int, I: int, k: int, wfmt: str) -> str:
    """Key of a shape in the MoE tables (this one and moe_configs/, the tuned configs)."""
    return f"E={E},H={H},I={I},k={k},w={wfmt}"


def table_file(device_name: str) -> str:
    """File name of a GPU's tables, e.g. 'NVIDIA H200' -> 'NVIDIA_H200.json'."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in device_name.strip()) + ".json"


def device_name(device: torch.device) -> str:
    """The name the tables of ``device`` are filed under ("NVIDIA H200"); "" off a GPU, and for the fake CUDA tensors
    of a trace made without one (the rules apply)."""
    return _cuda_name(device.index or 0) if device.type == "cuda" and torch.cuda.is_available() else ""


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_properties(index).name


@functools.lru_cache(maxsize=None)
def load_table(device_name: str, directory: Optional[str] = None) -> dict[str, Any]:
    """The measured table of a GPU ({} when there is none). Read once per process."""
    path = (Path(directory) if directory else TABLE_DIR) / table_file(device_name)
    if not device_name or not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def nearest_tuned_T(T: int, tuned: list[int]) -> int:
    """The tuned size whose entry serves a call of ``T`` tokens: the nearest in log2, ties towards the smaller."""
    return min(tuned, key=lambda t: (abs(math.log2(max(T, 1)) - math.log2(t)), t))


def current_config(T: int, key: str, configs: dict[str, Any]) -> Any:
    """What ours runs at ``T`` for shape ``key`` by the tuned-config table ``configs`` (a moe_configs JSON): the
    entry (its config fields only), or "heuristic" where the table has none for the shape. Recorded beside our
    time in the measured table, and compared with it when the table is read."""
    entry = configs.get("configs", {}).get(key)
    if not entry:
        return "heuristic"
    row = entry[str(nearest_tuned_T(T, sorted(int(t) for t in entry)))]
    return {f: v for f, v in row.items() if f not in MEASUREMENT_FIELDS}


def same_config(a: Any, b: Any) -> bool:
    """Whether two recorded configs (``current_config`` values) are the same, GEMM fields added since one was
    recorded taken at their defaults."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return a == b

    def filled(c: dict) -> dict:
        return {**c, **{g: {**LATER_GEMM_DEFAULTS, **c[g]} for g in ("fc1", "fc2") if isinstance(c.get(g), dict)}}

    return filled(a) == filled(b)


# GPUs without a tuned-config table of their own that run another GPU's: the same chip (GH100: sm_90, 132 SMs, 50 MB
# of L2), which differ in their memory only, so the tiles tuned on one fit the other. On the H100 SXM the H200's table
# ran every bf16 benchmark size 1.03-2.0x faster than the heuristic (T = 1 to 4096; 2.0x at T = 1024 on Qwen3-30B-A3B;
# benchmarks/results/moe-h100-2026-12-05/). Which kernel wins a call is still measured on the GPU itself
# (moe_baselines/), never taken from the other.
CONFIG_STAND_INS: dict[str, str] = {"NVIDIA H100 80GB HBM3": "NVIDIA H200"}


def configs_device(device_name: str, directory: Optional[str] = None) -> str:
    """The GPU whose tuned-config table ``device_name`` runs: its own where it has one, else its stand-in's
    (``CONFIG_STAND_INS``) where that has one, else itself (no table: the heuristic)."""
    folder = Path(directory) if directory else CONFIG_DIR
    other = CONFIG_STAND_INS.get(device_name)
    if device_name and not (folder / table_file(device_name)).is_file() and other:
        if (folder / table_file(other)).is_file():
            return other
    return device_name


@functools.lru_cache(maxsize=None)
def load_configs(device_name: str, directory: Optional[str] = None) -> dict[str, Any]:
    """The tuned-config table ``device_name`` runs (its own, or its stand-in's: ``configs_device``) as JSON ({} when
    there is none), read without Triton."""
    path = (Path(directory) if directory else CONFIG_DIR) / table_file(configs_device(device_name, directory))
    return json.loads(path.read_text()) if device_name and path.is_file() else {}


@dataclass(frozen=True)
class Choice:
    """What runs one call: ``kernel`` ("triton" or the baseline's name), the ``baseline`` it was weighed against,
    where the decision came from (``source``: ``table:<key>@T=<measured T>``, or the rule's ``RULES`` text) and, from
    the table, the two times (us)."""

    kernel: str
    baseline: str
    source: str
    ours_us: Optional[float] = None
    baseline_us: Optional[float] = None

    @property
    def margin(self) -> Optional[float]:
        """The baseline's time / ours (> 1: ours is faster), from the table."""
        if self.ours_us and self.baseline_us:
            return self.baseline_us / self.ours_us
        return None

    def describe(self) -> str:
        who = "ours" if self.kernel == "triton" else self.baseline
        text = f"{who} ({self.source}"
        if self.margin is not None:
            text += f": ours {self.ours_us:.1f} us, {self.baseline} {self.baseline_us:.1f} us"
        return text + ")"


RULE_TEXT = {
    "aten": "ours at every T (ours runs a tuned config)",
    "aten_untuned": f"ours up to T = {UNTUNED_RULE_MAX_T}, aten above (ours runs the heuristic's config)",
    "aten_persistent": f"ours up to T = {UNTUNED_RULE_MAX_T}, and above where the heuristic runs the persistent path "
    f"or its decode tiles on <= {DECODE_TILES_MAX_ROWS} rows per routed expert, aten elsewhere (ours runs the "
    "heuristic's config)",
    "vllm": f"ours up to T = {VLLM_RULE_MAX_T}, vllm above",
}
# a Choice's source off the table (no row of this GPU's table, timed with today's config, at or above the call's T),
# by baseline ("aten_untuned": the ATen form where ours has no tuned config for the shape)
RULES = {b: f"no measured entry at or above this T; rule: {text}" for b, text in RULE_TEXT.items()}


def _configs_dir(directory: Optional[str]) -> Optional[str]:
    """The tuned configs' folder beside a measured table's ``directory`` (None: moe_configs/)."""
    return directory and str(Path(directory) / "configs")


def _configs(device_name: str, directory: Optional[str]) -> dict[str, Any]:
    """The tuned configs ``choose`` reads: moe_configs/'s, or the ``configs`` subfolder of its ``directory``."""
    return load_configs(device_name, _configs_dir(directory))


def _rule(E, H, I, k, wfmt, device_name, baseline, directory=None) -> tuple[str, Optional[int]]:
    """The rule off the table for one shape: its ``RULES`` key, and the T up to which ours runs (None: every T; for
    "aten_persistent", ``untuned_ours`` says). Against the ATen form it depends on whether ours runs a tuned config
    for the shape (this GPU's or a stand-in's), and else on whether the heuristic's configs were measured on this
    GPU (``PERSISTENT_RULE_CONFIGS``)."""
    if baseline == "vllm":
        return "vllm", VLLM_RULE_MAX_T
    if _configs(device_name, directory).get("configs", {}).get(table_key(E, H, I, k, wfmt)):
        return "aten", None
    if (
        wfmt in PERSISTENT_RULE_FORMATS
        and k > 0
        and configs_device(device_name, _configs_dir(directory)) in PERSISTENT_RULE_CONFIGS
    ):
        return "aten_persistent", UNTUNED_RULE_MAX_T
    return "aten_untuned", UNTUNED_RULE_MAX_T


@functools.lru_cache(maxsize=4096)
def choose(
    T: int, E: int, H: int, I: int, k: int, wfmt: str, device_name: str, baseline: str, directory: Optional[str] = None
) -> Choice:
    """Ours or ``baseline`` for a call of ``T`` tokens on the GPU called ``device_name`` ("" for none: the rule).
    ``baseline`` "" (none known) always gives ours. ``directory``: a folder holding the measured table in place of
    moe_baselines/ (its ``configs`` subfolder then stands for moe_configs/). Cached: a serving step asks once per
    layer and call."""
    if baseline not in BASELINES:
        return Choice("triton", baseline, "no baseline")
    key, rows, measured = _measured(E, H, I, k, wfmt, device_name, baseline, directory)
    # the measured size nearest T in log2 (ties to the smaller: the rule lookup_config finds configs by); beyond the
    # largest, the rule. (It was the smallest measured T at least T: on the H100, DeepSeek-V3 at T = 8 then went by
    # the T = 64 row, where vLLM's kernel won by 1.5%, though ours is 1.13x faster at T = 8 and won the T = 1 row.)
    at = nearest_tuned_T(T, measured) if measured and T <= measured[-1] else None
    if at is not None:
        row = rows[str(at)]
        ours, other = float(row["triton"]), float(row[baseline])
        return Choice("triton" if ours <= other else baseline, baseline, f"table:{key}@T={at}", ours, other)
    rule, limit = _rule(E, H, I, k, wfmt, device_name, baseline, directory)
    ours = untuned_ours(T, E, k) if rule == "aten_persistent" else limit is None or T <= limit
    return Choice("triton" if ours else baseline, baseline, RULES[rule])


def _rows(E, H, I, k, wfmt, device_name, directory=None) -> tuple[str, dict, set[str]]:
    """(the shape's key, its rows in the GPU's table, the sizes (keys) of the rows timed with the config ours runs
    today)."""
    key = table_key(E, H, I, k, wfmt)
    rows = load_table(device_name, directory).get("entries", {}).get(key, {})
    configs = _configs(device_name, directory)
    current = {t for t, r in rows.items() if same_config(r.get("config"), current_config(int(t), key, configs))}
    return key, rows, current


def _measured(E, H, I, k, wfmt, device_name, baseline, directory=None) -> tuple[str, dict, list[int]]:
    """(the shape's key, its rows in the GPU's table, the sorted T at which ours and ``baseline`` were both timed,
    ours with the config it runs today)."""
    key, rows, current = _rows(E, H, I, k, wfmt, device_name, directory)
    both = (t for t in current if rows[t].get("triton") is not None and rows[t].get(baseline) is not None)
    return key, rows, sorted(int(t) for t in both)


def stale(E: int, H: int, I: int, k: int, wfmt: str, device_name: str, directory: Optional[str] = None) -> list[int]:
    """The sizes of a shape's measured rows whose config is not what ours runs today (left out of the choice)."""
    _, rows, current = _rows(E, H, I, k, wfmt, device_name, directory)
    return sorted(int(t) for t in rows if t not in current)


def policy(E: int, H: int, I: int, k: int, wfmt: str, device_name: str, baseline: str) -> str:
    """Which kernel runs which T for one shape, in words, for the plan of a node with a symbolic T."""
    if baseline not in BASELINES:
        return "ours at every T"
    key, _, measured = _measured(E, H, I, k, wfmt, device_name, baseline)
    rule, limit = _rule(E, H, I, k, wfmt, device_name, baseline)  # ours up to limit, the baseline above
    if not measured:
        why = f"no measured entry for {key} on {device_name}" if device_name else "planned without the GPU's table"
        if rule == "aten_persistent":
            why += f"; for this shape: {_untuned_ranges(E, k, 0, baseline)}"
        return f"{RULE_TEXT[rule]} (rule: {why})"
    # Runs of consecutive measured sizes with one winner: "ours T <= 128; aten 128 < T <= 512; ...", then the rule. A
    # measured size serves the calls nearest it in log2: up to isqrt(t * next) (ties to the smaller), the last up to t.
    winners = [choose(t, E, H, I, k, wfmt, device_name, baseline).kernel for t in measured]
    ends = [math.isqrt(t * u) for t, u in zip(measured, measured[1:])] + [measured[-1]]
    parts: list[str] = []
    lo = 0
    for i, (end, who) in enumerate(zip(ends, winners)):
        if i == len(measured) - 1 or winners[i + 1] != who:
            parts.append(
                f"{'ours' if who == 'triton' else baseline} " + (f"T <= {end}" if lo == 0 else f"{lo} < T <= {end}")
            )
            lo = end
    if rule == "aten_persistent":
        parts.append(_untuned_ranges(E, k, lo, baseline) + " (rule)")
    elif limit is not None and lo < limit:
        parts.append(f"ours {lo} < T <= {limit}, {baseline} above (rule)")
    else:
        parts.append(f"{'ours' if limit is None else baseline} T > {lo} (rule)")
    old = stale(E, H, I, k, wfmt, device_name)
    note = f"; not counted, timed with another config than today's: {', '.join(map(str, old))}" if old else ""
    return "; ".join(parts) + f" (measured on {device_name}: {', '.join(map(str, measured))} tokens{note})"
