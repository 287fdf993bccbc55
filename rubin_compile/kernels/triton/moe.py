"""Fused mixture-of-experts Triton kernels for ``rubin.moe`` (decode at the HBM roofline, and prefill).

Contract: ``run(args, launch)`` computes ``rubin.moe`` (ops/moe.py) for bf16 / fp16 / fp32 activations with
unquantised, FP8 per-tensor / per-expert or FP8 128x128 block-scaled weights, with no host synchronisation
(capturable in a CUDA graph); ``launch.pdl`` launches every kernel with Programmatic Dependent Launch, bitwise
identical to without; ``launch.placement`` runs decode-sized calls split-N over locality domains, also bitwise
identical. FP8 weights with FP8 activations (``a_fp8``, the default for FP8: quantised once per call, see
``MoEPlan.quantise`` and ``q_inter``) are within 6e-2 of the float64 reference, everything else within the
tolerances of tests/gpu/test_triton_moe.py.

Why this shape: decode is bound by reading the routed experts' weights, so the floor is (bytes of the distinct
experts routed) / (HBM bandwidth), and every launch, pass over memory or host decision costs a fraction of it.
So FC1 applies the activation in its epilogue, FC2 applies the routed weights and sums the top-k rows of each
token in slot order in its epilogue (deterministic, no float atomics), decode needs no routing launch at all
(slot mode: program ``s`` serves slot ``s``'s expert unless an earlier slot has it), and each expert's weights
are read once however many tokens chose it. A call's launch plan (``MoEPlan``) is built once per call shape.
The design, the byte counts, the options at the FC1 -> FC2 boundary and the measurements are in
docs/kernels/triton_moe.md; configurations are data (``moe_configs/<GPU name>.json``, written by tune_moe.py on
the GPU, a heuristic for shapes it does not cover; nothing is tuned at import).
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from rubin_compile.kernels.triton import moe_decode, moe_prefill
from rubin_compile.kernels.triton.activations import CODES as _ACT_CODES

# Imported under their own names: Inductor rebuilds a traced kernel's source from the helpers' definitions
# (tests/cpu/passes/test_inline_kernels.py: test_inductor_rebuilds_every_kernel_source_with_its_helpers).
from rubin_compile.kernels.triton.activations import gelu_tanh, silu
from rubin_compile.kernels.triton.fp8 import quantise_rows, scale_args
from rubin_compile.kernels.triton.launch import aligned16, cdiv, launcher, next_power_of_2
from rubin_compile.kernels.triton.pdl import l2_prefetch_range

# The tuned table (moe_configs/<GPU>.json) is read by moe_choice, which weighs our times against baselines without
# importing Triton; load_config_table: {} where a GPU has none, read once per process, never tunes.
from rubin_compile.kernels.triton.moe_choice import CONFIG_DIR  # noqa: F401 (moe.CONFIG_DIR: the tables' folder)
from rubin_compile.kernels.triton.moe_choice import load_configs as load_config_table
from rubin_compile.kernels.triton.moe_choice import nearest_tuned_T, table_file, table_key, weight_format
from rubin_compile.kernels.triton.moe_choice import expected_distinct_experts, expected_rows, heuristic_runs_persistent
from rubin_compile.ops.moe import WEIGHT_FP8_DTYPES as FP8_DTYPES
from rubin_compile.ops.moe import MoEArgs, MoEArgumentError
from rubin_compile.ops.registry import Launch, Placement
from rubin_compile.runtime import locality

try:  # Triton >= 3.4 ships the PDL intrinsics; older versions run without PDL.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_wait = gdc_launch_dependents = None

SLOT_MAX = 64  # decode "slot" mode handles up to this many (token, expert) slots with no routing launch
ROUTE_KERNEL_MAX = 4096  # the single-program routing kernel sorts up to this many slots in registers
GEMV_MAX_BM = 4  # rows per chunk the reduction (GEMV) form takes (GemmConfig.gemv); more run on the tensor cores
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# ------------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipelining of one of the two GEMM kernels."""

    BM: int = 16  # token rows per dot (padded); a group with more rows loops over chunks of BM
    BN: int = 64  # output columns per program
    BK: int = 128  # K step
    num_warps: int = 4
    num_stages: int = 4
    prefetch: int = 0  # bytes of this program's weight slice to pull into L2 up front (0 = off)
    swap: bool = False  # weight tile as the MMA's M side (acc [BN, BM]): wgmma / FP8 wgmma for few tokens
    split_k: int = 1  # FC1 only: split K = H over this many programs (when I / BN alone cannot fill the SMs)
    # the reduction (GEMV) form: no tensor cores; products summed per element over K, reduced once after the K
    # loop (see _gemv_step); BM <= GEMV_MAX_BM rows per chunk, plain (not swapped) tiles, bf16 / fp16 / fp32
    # activations (FP8 weights are converted in registers: not with a_fp8)
    gemv: bool = False
    # the persistent path only: programs per SM in the grid. 2 lets a second program's MMAs run while one waits in
    # its epilogue, its pipeline's first loads, or (FP8 W8A8) the scaling of each K step's products; it pays only
    # where two fit on an SM (registers, shared memory: the tuner's PERSISTENT_VARIANTS are checked to)
    occupancy: int = 1
    # the persistent path only: one software-pipelined loop over all of a program's (work item, K step) pairs
    # (Triton's tl.range(flatten=True)), so the next item's first tiles load during this item's last K steps and
    # epilogue; for short K loops (FC2 of fine-grained experts: I = 256 is 4 steps of 64)
    flatten: bool = False
    # the persistent path's FC1 only: a gate tile and its up tile loaded as one TMA box (w13 seen as [E * 2, I, H]) and
    # multiplied in one MMA of 2 BN columns: the gathered rows read once per K step from shared memory, and in FP8
    # (W8A8) one wait for the products per K step instead of two
    join: bool = False
    # the persistent path, W8A8 (a_fp8): this GEMM by its Gluon kernel (moe_prefill_gluon.py), whose K loop issues the
    # next step's MMA before it scales this one's product (Triton's own K loop waits for every FP8 product); BM = 16 x
    # num_warps; FC2: BN <= 128; FC1: joined (join=True: its one MMA covers the gate and up tiles), BN <= 64. Where
    # it cannot run (a Triton without Gluon, block scales not holding whole tiles, the interpreter) the Triton kernel
    # runs the same tiles
    gluon: bool = False
    # the Gluon kernel's K steps per loop iteration, unrolled (moe_prefill_gluon.py): all but the last are scaled while
    # the next step's MMA runs, the last is waited for alone (no MMA in flight across the loop's back-edge), so 4
    # leaves a quarter of the steps' scaling exposed where 2 leaves half, for a larger loop body
    unroll: int = 2
    # the persistent path, W8A8, with gluon=True: the Gluon kernel's warp-specialized form (moe_prefill_ws.py): 128-row
    # tiles whose two 64-row halves are two consumer warpgroups on the same weight tiles, and a producer warp issuing
    # the TMA loads (FC1's rows quantised in tile order first, so they load by TMA too); BM = 128 at num_warps = 4
    # (one consumer warpgroup: the kernel runs 9 warps), one program per SM
    ws: bool = False

    def problem(self) -> Optional[str]:
        """Why this tile cannot run (None: it can)."""
        if self.occupancy not in (1, 2, 3, 4):
            return f"occupancy={self.occupancy}: programs per SM of a persistent grid, 1 to 4"
        if self.gemv and self.swap:
            return "gemv=True and swap=True exclude each other (the GEMV form has no MMA to swap); set one"
        if self.gemv and self.BM > GEMV_MAX_BM:
            return f"gemv=True takes BM <= {GEMV_MAX_BM} rows per chunk, not {self.BM}; use BM in (1, 2, 4)"
        if self.unroll not in (2, 4):
            return f"unroll={self.unroll}: the Gluon kernels run 2 or 4 K steps per loop iteration"
        if self.unroll != 2 and not self.gluon:
            return f"unroll={self.unroll} sets the Gluon kernel's loop (gluon=True); without it keep unroll=2"
        if self.ws and not self.gluon:
            return "ws=True is the warp-specialized form of the Gluon kernel: set gluon=True with it"
        if self.ws and self.occupancy != 1:
            return (
                f"ws=True runs one program per SM (its 9 warps take the SM's registers), not occupancy={self.occupancy}"
            )
        return None


@dataclass(frozen=True)
class MoEConfig:
    """How one MoE call is run: routing mode, the two GEMMs' tiles, and the top-k reduction."""

    # "slot" (T*k <= SLOT_MAX), "grouped" (one group per expert), "prefill" (BM-row blocks of sorted slots),
    # "persistent" (moe_prefill.py: slots aligned on the GPU, persistent TMA + wgmma grouped GEMMs; fc1.BM rows), or
    # "fused" (moe_decode.py, decode: FC1, FC2 and the top-k sum in one persistent launch; BM = 16, one row real;
    # fc1.BN / BK / num_stages / split_k its FC1 items, fc2.BN / BK / num_stages its FC2 items and fc2.split_k their
    # slot groups, fc1.num_warps / occupancy the grid's, fc2.prefetch the FC2 items' L2 requests)
    mode: str = "slot"
    fc1: GemmConfig = field(default_factory=GemmConfig)
    fc2: GemmConfig = field(default_factory=GemmConfig)
    cap: int = 0  # rows per group in "prefill" mode (0 = one group per expert)
    fused_sum: bool = True  # last-arriving FC2 program sums the k slots (else a separate sum kernel)
    # FP8 weights only: quantise activations in-kernel and use FP8 tensor cores (in the persistent mode a_fp8=False
    # runs W8A16: the weights dequantised in registers, the activations' tensor cores)
    a_fp8: bool = False
    chain: bool = False  # PDL between our own kernels even when the call has pdl=False (sm_90+; always safe)
    early_launch: bool = False  # FC1 lets FC2's programs start right after its gdc_wait (FC2 then prefetches)
    w2_l2: bool = False  # FC1's programs pull their expert's w2 into L2 while they stream w13 (decode)

    def __post_init__(self) -> None:
        why = self.problem()
        if why is not None:
            raise ValueError(f"MoEConfig: {why}")

    def problem(self) -> Optional[str]:
        """Why this configuration cannot run (None: it can): a GEMM tile's own problem, or a GEMV GEMM with FP8
        activations (they need the tensor cores) or an FC2 GEMV after a K-split FC1 (its A tiles would be sums of
        float32 partials, activated per tile: the MMA forms do that)."""
        for name, g in (("fc1", self.fc1), ("fc2", self.fc2)):
            why = g.problem()
            if why is not None:
                return f"{name}: {why}"
        if self.a_fp8 and (self.fc1.gemv or self.fc2.gemv):
            return "a_fp8=True needs the tensor cores, gemv=True does not use them; set a_fp8=False for a GEMV GEMM"
        if self.fc2.gemv and self.fc1.split_k > 1:
            return "fc2.gemv=True after a K-split FC1 (fc1.split_k > 1) is not implemented; set fc1.split_k=1"
        if self.mode == "persistent":
            return self._persistent_problem()
        if self.mode == "fused":
            return moe_decode.config_problem(self)
        if self.fc1.occupancy != 1 or self.fc2.occupancy != 1:
            return f"occupancy sizes the persistent path's grids; mode={self.mode!r} takes occupancy=1"
        if self.fc1.flatten or self.fc2.flatten:
            return f"flatten is the persistent path's loop over work items; mode={self.mode!r} takes flatten=False"
        if self.fc1.join or self.fc2.join:
            return f"join is the persistent path's FC1 tile; mode={self.mode!r} takes join=False"
        if self.fc1.gluon or self.fc2.gluon:
            return f"gluon picks the persistent path's Gluon kernels; mode={self.mode!r} takes gluon=False"
        return None

    def _persistent_problem(self) -> Optional[str]:
        """What the persistent path (moe_prefill.py) does not take: its two GEMMs share the sorted rows' tile."""
        if self.fc1.BM != self.fc2.BM:
            return f"mode='persistent': fc1.BM ({self.fc1.BM}) and fc2.BM ({self.fc2.BM}) must be equal (one row tile)"
        for name, g in (("fc1", self.fc1), ("fc2", self.fc2)):
            if g.swap or g.gemv or g.split_k > 1 or g.prefetch:
                return f"mode='persistent': {name} takes plain tiles (no swap, gemv, split_k or prefetch)"
            if g.BM not in (16, 32, 64, 128) or g.BN > 256 or g.BK > 256:
                return f"mode='persistent': {name} tile {g.BM}x{g.BN}x{g.BK}: BM in 16..128, BN and BK <= 256"
        if self.w2_l2 or self.early_launch or not self.fused_sum:
            return "mode='persistent': w2_l2, early_launch and fused_sum=False are decode-path options"
        if self.fc2.join:
            return "mode='persistent': join joins FC1's gate and up tiles; FC2 has none (set fc2.join=False)"
        ws_bm, ws_warps = moe_prefill.ws_k.WS_BM, moe_prefill.ws_k.WS_WARPS
        for name, g, widest in (("fc1", self.fc1, 64), ("fc2", self.fc2, 128)):
            if g.ws and not (g.BM == ws_bm and g.num_warps == ws_warps):
                return (
                    f"mode='persistent': {name}.ws takes BM = {ws_bm} at num_warps = {ws_warps} (two consumer "
                    f"warpgroups of 64 rows), not {g.BM} rows at {g.num_warps} warps"
                )
            rows_ok = g.ws or (g.num_warps in (4, 8) and g.BM == 16 * g.num_warps)
            if g.gluon and not (self.a_fp8 and rows_ok and g.BN <= widest):
                rows = f"BM = {ws_bm} at {ws_warps} warps (ws)" if g.ws else "BM = 16 x num_warps"
                return (
                    f"mode='persistent': {name}.gluon takes a_fp8=True (the W8A8 kernels), {rows} and "
                    f"BN <= {widest}, not a_fp8={self.a_fp8} with {g.BM}x{g.BN} at {g.num_warps} warps"
                )
        if self.fc1.gluon and not self.fc1.join:
            return "mode='persistent': fc1.gluon multiplies the gate and up tiles in one MMA: set fc1.join=True"
        return None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "MoEConfig":
        """Build from a table entry; keys that are not config fields (timings, errors) are ignored."""
        fields = MoEConfig.__dataclass_fields__
        rest = {n: v for n, v in d.items() if n in fields and n not in ("fc1", "fc2")}
        return MoEConfig(fc1=GemmConfig(**d.get("fc1", {})), fc2=GemmConfig(**d.get("fc2", {})), **rest)


def shape_key(E: int, H: int, I: int, k: int, weight_dtype: torch.dtype, block_shape=None) -> str:
    """Key of a shape bucket in the tuned-config JSON."""
    return table_key(E, H, I, k, weight_format(weight_dtype, block_shape is not None))


def device_file_name(device_name: str) -> str:
    """File name of a GPU's tuned-config table, e.g. 'NVIDIA H200' -> 'NVIDIA_H200.json'."""
    return table_file(device_name)


def _pow2_at_least(x: float, lo: int, hi: int) -> int:
    v = lo
    while v < x and v < hi:
        v *= 2
    return v


def heuristic_config(
    T: int,
    E: int,
    H: int,
    I: int,
    k: int,
    weight_dtype: torch.dtype,
    block_shape=None,
    num_sms: int = 132,
    sm90: bool = False,
) -> MoEConfig:
    """A sane configuration for shapes the tuned table does not cover.

    Decode: fill the SMs about twice over with (group, N tile) programs, each streaming a weight slice
    across the whole K in ``BK`` steps, 4-stage pipelined. Prefill on sm_90 (``sm90``): the persistent TMA +
    wgmma path with the tiles that won the H200's tuning at prefill sizes (``persistent_heuristic``). Prefill
    elsewhere: 128-row blocks, wgmma tiles (FC1 128 x 64 x 64 gate and up, FC2 128 x 128 x 64), 8 warps, 3
    stages.
    """
    S = T * k
    fp8 = weight_dtype in FP8_DTYPES
    bk = 128
    if fp8 and block_shape is not None:
        bk = _largest_pow2_divisor(int(block_shape[1]), 128)
    groups = max(1.0, expected_distinct_experts(T, E, k))
    rows = S / groups
    w_elt = 1 if fp8 else 2
    if sm90:
        cfg = persistent_heuristic(T, E, k, H, I, weight_dtype, block_shape)
        if cfg is not None:
            return cfg
    if rows > 64 and T >= 512:
        mode = "prefill"
        fc1 = GemmConfig(BM=128, BN=64, BK=min(64, bk), num_warps=8, num_stages=3)
        fc2 = GemmConfig(BM=128, BN=128, BK=min(64, bk), num_warps=8, num_stages=3)
        return MoEConfig(
            mode=mode,
            fc1=fit_smem(fc1, "fc1", 2, w_elt),
            fc2=fit_smem(fc2, "fc2", 2, w_elt),
            cap=128,
            fused_sum=True,
            a_fp8=False,
        )
    mode = "slot" if S <= SLOT_MAX else "grouped"
    bm = _pow2_at_least(rows, 16, 64)

    def pick_bn(n: int, widest: int) -> int:
        for bn in (128, 64, 32):
            if bn > widest:
                continue
            if groups * cdiv(n, bn) >= 2 * num_sms:
                return bn
        return 16

    if fp8:
        # FP8 weights: swapped tiles (weights on the wgmma's M side) with FP8 activations quantised in-kernel,
        # so the weights go to the FP8 tensor cores unconverted (converting them in registers is the
        # bottleneck of the W8A16 path on this design)
        fc1 = GemmConfig(BM=bm, BN=min(64, max(32, pick_bn(I, 128))), BK=bk, num_warps=4, num_stages=4, swap=True)
        fc2 = GemmConfig(BM=bm, BN=min(64, max(32, pick_bn(H, 128))), BK=bk, num_warps=4, num_stages=4, swap=True)
        return MoEConfig(
            mode=mode, fc1=fit_smem(fc1, "fc1", 2, 1), fc2=fit_smem(fc2, "fc2", 2, 1), cap=0, fused_sum=True, a_fp8=True
        )
    # (FC2's fused-sum epilogue spills at BN=128 with 4 warps, hence its narrower widest tile)
    fc1 = GemmConfig(BM=bm, BN=pick_bn(I, 128), BK=bk, num_warps=4, num_stages=4)
    fc2 = GemmConfig(BM=bm, BN=pick_bn(H, 64), BK=bk, num_warps=4, num_stages=4)
    return MoEConfig(
        mode=mode,
        fc1=fit_smem(fc1, "fc1", 2, w_elt),
        fc2=fit_smem(fc2, "fc2", 2, w_elt),
        cap=0,
        fused_sum=True,
        a_fp8=False,
    )


def persistent_heuristic(
    T: int, E: int, k: int, H: int, I: int, weight_dtype: torch.dtype, block_shape=None
) -> Optional[MoEConfig]:
    """The persistent path's config for a prefill-sized call of a shape without tuned configs (None: the call is
    below the sizes where it is used, or a format it was not tuned in).

    The tiles are the ones that won the H200's tuning at T = 1024 and 4096 on the four benchmark shapes
    (moe_configs/NVIDIA_H200.json, 1cd6c14), by expected rows per routed expert:

    * bf16 / fp16: 64-row tiles under 64 rows (DeepSeek-V3 TP8 and MiniMax-M2 at T = 1024), 128 from 64 on;
      FC1 BM x 128 x 64 (gate and up), 8 warps, 4 stages; FC2 BM x 256 x 64, 8 warps, 3 stages, one flattened
      loop over the program's work items: 6 of the 8 entries exactly (MiniMax-M2 at T = 4096: these tiles without
      the flattened loop; Mixtral at T = 1024: FC1 128 x 128 x 64 with 3 stages, FC2 128 x 128 x 64);
    * FP8 weights with 128-wide block scales: under 128 rows e4m3 activations (W8A8) on 64-row tiles, two
      programs per SM (3 of 3 entries); from 128 rows the weights dequantised in registers (W8A16) on 128-row
      tiles (2 of 5: Qwen3 and DeepSeek-V3 at T = 4096; Mixtral took FC2 128 x 256 x 64, MiniMax-M2 at T = 4096
      the W8A8 tiles).

    Where these tiles are used is measured, not assumed: benchmarks/moe_heuristic.py times them against the
    heuristic's other tiles and the ATen form on the benchmark shapes and on shapes never tuned.
    """
    fp8 = weight_dtype in FP8_DTYPES
    if not heuristic_runs_persistent(T, E, k, fp8):  # moe_choice's rule reads the same switch
        return None
    rows = expected_rows(T, E, k)
    if fp8:
        if block_shape is None or int(block_shape[1]) % 128:
            return None  # per-tensor and other block widths: never tuned on this path
        if rows < 128:
            fc1 = GemmConfig(BM=64, BN=64, BK=128, num_warps=4, num_stages=4, occupancy=2)
            fc2 = GemmConfig(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, occupancy=2)
            return MoEConfig(mode="persistent", fc1=fc1, fc2=fc2, a_fp8=True)
        fc1 = GemmConfig(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)
        fc2 = GemmConfig(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, occupancy=2)
        return MoEConfig(mode="persistent", fc1=fc1, fc2=fc2, a_fp8=False)
    bm = 64 if rows < 64 else 128
    fc1 = GemmConfig(BM=bm, BN=128, BK=64, num_warps=8, num_stages=4)
    fc2 = GemmConfig(BM=bm, BN=256, BK=64, num_warps=8, num_stages=3, flatten=True)
    return MoEConfig(mode="persistent", fc1=fc1, fc2=fc2)


SMEM_LIMIT = 225 * 1024  # of the H100 / H200's 227 KB per block, with room for Triton's scratch


def smem_estimate(g: GemmConfig, which: str, x_elt: int, w_elt: int, split1: int = 1) -> int:
    """Shared memory of one GEMM config: an (x tile + weight tile(s)) per pipeline buffer.

    Triton keeps num_stages buffers on the wgmma path (BM >= 64 or swapped), num_stages - 1 on mma.sync
    (checked against the compiled kernels' reports). FC2 after a K-split FC1 (``split1`` > 1) pipelines the
    float32 partial gate / up tiles instead: (num_stages - 1) x 2 x split1 x BM x BK x 4 bytes plus one
    weight tile (fitted to the sizes ptxas reported for sm_90 AOT compiles with Triton 3.9: exact for
    swapped tiles, up to 4 KB over for mma.sync ones).
    """
    if g.gemv:  # no tile in shared memory in the K loop; the one reduction over K after it: at most a float32
        # [BM, BN] per warp and accumulator (FC1 has two)
        return (2 if which == "fc1" else 1) * g.BM * g.BN * 4 * g.num_warps
    if which == "fc2" and split1 > 1:
        return (g.num_stages - 1) * 2 * split1 * g.BM * g.BK * 4 + g.BN * g.BK * w_elt + 4096
    stage = g.BM * g.BK * x_elt + (2 if which == "fc1" else 1) * g.BN * g.BK * w_elt
    # the Gluon FC1 (moe_prefill_gluon.py) splits its [BM, 2 BN] float32 sums into gate and up through shared memory
    scratch = g.BM * 2 * g.BN * 4 if (g.gluon and which == "fc1") else 0
    return stage * (g.num_stages if (g.swap or g.BM >= 64) else g.num_stages - 1) + scratch


def fit_smem(g: GemmConfig, which: str, x_elt: int = 2, w_elt: int = 2, split1: int = 1) -> GemmConfig:
    """Shrink a config until it fits shared memory: fewer stages (down to 2), then a narrower BN."""
    while smem_estimate(g, which, x_elt, w_elt, split1) > SMEM_LIMIT:
        if g.num_stages > 2:
            g = replace(g, num_stages=g.num_stages - 1)
        elif g.BN > 16:
            g = replace(g, BN=g.BN // 2)
        else:
            g = replace(g, BK=max(16, g.BK // 2))
    return g


def _largest_pow2_divisor(n: int, cap: int) -> int:
    v = 1
    while v * 2 <= cap and n % (v * 2) == 0:
        v *= 2
    return v


def lookup_config(
    T: int,
    E: int,
    H: int,
    I: int,
    k: int,
    weight_dtype: torch.dtype,
    block_shape=None,
    device_name: str = "",
    num_sms: int = 132,
    table: Optional[dict[str, Any]] = None,
    sm90: bool = False,
) -> tuple[MoEConfig, str]:
    """Choose a config: the tuned entry for this GPU (or its stand-in: moe_choice.CONFIG_STAND_INS) and shape at the
    nearest tuned T, else the heuristic (``sm90``: the GPU runs the persistent path, see ``heuristic_config``).

    Returns (config, source) where source says where it came from ("table:<key>@T=<t>" or "heuristic").
    A table entry whose mode cannot serve this T (slot mode needs T*k <= SLOT_MAX) is adjusted to the
    nearest mode that can, keeping its tiles.
    """
    if table is None:
        table = load_config_table(device_name) if device_name else {}
    entry = table.get("configs", {}).get(shape_key(E, H, I, k, weight_dtype, block_shape))
    if entry:
        best = nearest_tuned_T(T, sorted(int(t) for t in entry))  # one rule with moe_choice.current_config
        cfg = MoEConfig.from_json(entry[str(best)])
        source = f"table:{shape_key(E, H, I, k, weight_dtype, block_shape)}@T={best}"
        if device_name and table.get("device", device_name) != device_name:  # a stand-in's (CONFIG_STAND_INS)
            source += f" of {table['device']}"
        return _fit_mode(cfg, T, k), source
    return heuristic_config(T, E, H, I, k, weight_dtype, block_shape, num_sms, sm90), "heuristic"


@functools.lru_cache(maxsize=4096)
def _tuned_config(
    T: int, E: int, H: int, I: int, k: int, weight_dtype, block_shape, device_name: str, num_sms: int, sm90: bool
):
    """``lookup_config``'s config for this GPU's table, found once per call signature (``run`` asks on every call;
    the table itself is read once per process)."""
    return lookup_config(T, E, H, I, k, weight_dtype, block_shape, device_name, num_sms, sm90=sm90)[0]


def _fit_mode(cfg: MoEConfig, T: int, k: int) -> MoEConfig:
    if cfg.mode == "slot" and T * k > SLOT_MAX:
        return replace(cfg, mode="grouped")
    return cfg


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _and_lt(mask, a, b):
    """mask & (a < b) for scalars a, b (as a tensor op: the interpreter cannot mask with a Python bool)."""
    return mask & ((tl.zeros_like(mask.to(tl.int32)) + a) < b)


@triton.jit
def _block_scales(s_base, rows, k, stride_sn, stride_sk, SCALE_BN, SCALE_BK, mask):
    """The 128x128-style block scales of weight rows ``rows`` at K offset ``k`` (0 where ``mask`` is off)."""
    return tl.load(s_base + (rows // SCALE_BN) * stride_sn + (k // SCALE_BK) * stride_sk, mask=mask, other=0.0)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _slot_group(ids_ptr, S, pid, SLOT_P2: tl.constexpr):
    """Slot mode: slot ``pid``'s expert, whether an earlier slot already leads that expert, its row count."""
    offs = tl.arange(0, SLOT_P2)
    ids = tl.load(ids_ptr + offs, mask=offs < S, other=-1)
    e = tl.load(ids_ptr + pid)
    match = ids == e
    dup = tl.sum((match & (offs < pid)).to(tl.int32), axis=0) > 0
    count = tl.sum(match.to(tl.int32), axis=0)
    rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
    return e, dup, count, match, rank


@triton.jit
def _program_group(ids_ptr, gexp_ptr, gstart_ptr, gcount_ptr, S, pid_g, ROUTE: tl.constexpr, SLOT_P2: tl.constexpr):
    """The group of slots that program ``pid_g`` of axis 0 serves: (expert, skip, start, row count, match,
    rank). Slot mode (``ROUTE`` 0): slot ``pid_g`` leads its expert's group unless an earlier slot routes to
    the same expert (then skip). Route tables (``ROUTE`` 1): group ``pid_g`` of the table; skip when empty."""
    if ROUTE == 0:
        e, skip, count, match, rank = _slot_group(ids_ptr, S, pid_g, SLOT_P2)
        start = 0
    else:
        count = tl.load(gcount_ptr + pid_g)
        skip = count == 0
        e = tl.load(gexp_ptr + pid_g)
        start = tl.load(gstart_ptr + pid_g)
        match = tl.zeros([SLOT_P2], tl.int1)
        rank = tl.zeros([SLOT_P2], tl.int32)
    return e, skip, start, count, match, rank


@triton.jit
def _group_rows(
    match, rank, sorted_ptr, start, count, m0, ROUTE: tl.constexpr, BM: tl.constexpr, SLOT_P2: tl.constexpr
):
    """Slot indices (and validity) of rows [m0, m0 + BM) of the current group."""
    want = m0 + tl.arange(0, BM)
    if ROUTE == 0:
        sel = match[None, :] & (rank[None, :] == want[:, None])
        slot = tl.sum(tl.where(sel, tl.arange(0, SLOT_P2)[None, :], 0), axis=1)
        valid = want < count
    else:
        valid = want < count
        slot = tl.load(sorted_ptr + start + want, mask=valid, other=0)
    return slot.to(tl.int64), valid


@triton.jit
def _mma_step(
    x,
    w,
    acc,
    sw,
    xs,
    W_SCALE: tl.constexpr,
    A_FP8: tl.constexpr,
    A_PRE: tl.constexpr,
    SWAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """acc + x . w over one K tile.

    Plain: x [BM, BK], w [BK, BN], acc [BM, BN]. Swapped (``SWAP``): w [BN, BK], x [BK, BM], acc [BN, BM],
    so the weight tile is the MMA's M side (wgmma from BN = 64, FP8 wgmma with ``A_FP8``) and a few
    tokens are its N side. ``sw`` [BN]: the weight rows' block scales for this K tile (W_SCALE == 2).
    With ``A_FP8`` each token's K tile is e4m3 with its own scale: ``A_PRE``: ``x`` is already e4m3 and ``xs``
    [BM] its scales (quantised once, before the kernel, or by FC1's epilogue); else this step quantises the
    tile (amax / 448), a reduction and a shared-memory store per K step (only FC2 without ``q_inter``: an FC1
    tile wider than the weights' scale block).
    """
    if A_FP8:
        if A_PRE:
            xq = x
            xsc = xs
        else:
            xf = x.to(tl.float32)
            if SWAP:
                xsc = tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-12) / 448.0
                xq = (xf / xsc[None, :]).to(tl.float8e4nv)
            else:
                xsc = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-12) / 448.0
                xq = (xf / xsc[:, None]).to(tl.float8e4nv)
        if SWAP:
            d = tl.dot(w, xq)
            scale = xsc[None, :]
            if W_SCALE == 2:
                scale = scale * sw[:, None]
        else:
            d = tl.dot(xq, w)
            scale = xsc[:, None]
            if W_SCALE == 2:
                scale = scale * sw[None, :]
        out = acc + d * scale
    elif W_SCALE == 2:
        if SWAP:
            out = acc + tl.dot(w.to(x.dtype), x, input_precision=DOT_PREC) * sw[:, None]
        else:
            out = acc + tl.dot(x, w.to(x.dtype), input_precision=DOT_PREC) * sw[None, :]
    else:
        if SWAP:
            out = tl.dot(w.to(x.dtype), x, acc, input_precision=DOT_PREC)
        else:
            out = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PREC)
    return out


@triton.jit
def _gemv_step(acc, x, w, sw, W_SCALE: tl.constexpr):
    """The reduction (GEMV) form's K tile: ``acc[k, j] += x[k, j] * w[k, j]`` in float32, element by element (times
    ``sw``, the tile's block scale, with ``W_SCALE`` 2); the sum over K is taken once, after the K loop. The
    tile's columns are flat (column, row of the chunk) pairs, ``j = n * BM + m`` (``_gemv_columns``): the weight
    tile repeats each weight column for the BM rows (the repeats are the same addresses in one warp's load: one
    memory transaction), and ``x`` holds row m's activations in column j. Both loads are then 2-D tiles with K
    contiguous, which Triton gives one thread layout whatever its version, so the loop needs no layout conversion,
    no shared memory and no barrier: vector loads and FMAs (tests/cpu/kernels/test_triton_moe_sm90_compile.py
    reads the PTX). (With a 3-D [rows, K, N] product Triton 3.6 and 3.9 break the tie between the two
    non-contiguous axes differently, and one of them converted every weight tile through shared memory.) The MMA
    forms pad a group's 1-4 rows to 16 and pass every K tile through shared memory (the dense GEMM's GEMV form:
    gemm.py)."""
    wf = w.to(tl.float32)
    if W_SCALE == 2:
        wf = wf * sw
    return acc + x * wf


@triton.jit
def _gemv_columns(slot, valid, n0, BN: tl.constexpr, BM: tl.constexpr):
    """The GEMV tile's flat columns ``j = n * BM + m`` for the chunk's rows (``slot``, ``valid`` [BM], from
    ``_group_rows``) and the BN weight columns from ``n0``: (weight column, slot of row m, whether row m exists)."""
    jj = tl.arange(0, BN * BM)
    pick = (jj % BM)[:, None] == tl.arange(0, BM)[None, :]
    slot_j = tl.sum(tl.where(pick, slot[None, :], 0), axis=1)
    valid_j = tl.sum(tl.where(pick, valid[None, :].to(tl.int32), 0), axis=1) > 0
    return n0 + jj // BM, slot_j, valid_j


@triton.jit
def _gemv_rows(acc, BN: tl.constexpr, BM: tl.constexpr):
    """The sum over K of a GEMV accumulator [BK, BN * BM], as the [BM, BN] tile the epilogues take."""
    return tl.trans(tl.reshape(tl.sum(acc, axis=0), [BN, BM]))


@triton.jit
def _gemv_offs_k(BK: tl.constexpr, W_BITS: tl.constexpr):
    """The K offsets of a GEMV weight tile. For 1-byte (FP8) weights, the same offsets written so that Triton's
    analysis sees runs of 8: its loads then take 8 elements per thread (8-byte loads), the layout of the 16-bit
    activations' 16-byte loads, and the products need no layout conversion (with the plain offsets each thread
    loads 16 FP8 weights, and every K tile goes through shared memory behind 2-8 barriers; sm_90 PTX, Triton 3.9)."""
    offs = tl.arange(0, BK)
    if W_BITS == 8:
        offs = (offs // 8) * 8 + offs % 8
    return offs


@triton.jit
def _tile_scale(s_base, n0, k, k_last, stride_sn, stride_sk, SCALE_BN, SCALE_BK):
    """The one block scale of the weight tile at rows [n0, n0 + BN), K offset ``k`` (clamped to ``k_last``, so the
    look-ahead past the last tile stays in bounds): a GEMV tile lies in one scale block (``plan_call`` checks)."""
    return tl.load(s_base + (n0 // SCALE_BN) * stride_sn + (tl.minimum(k, k_last) // SCALE_BK) * stride_sk)


@triton.jit(
    do_not_specialize=[
        "S",
        "K_TOP",
        "cnt_numel",
        "stride_be",
        "stride_bn",
        "stride_se",
        "stride_sn",
        "stride_sk",
        "KCH",
        "stride_is",
        "stride_w2e",
        "stride_xst",
        "stride_ist",
    ]
)
def _moe_fc1_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    b_ptr,
    ws_ptr,
    ids_ptr,
    sorted_ptr,
    gexp_ptr,
    gstart_ptr,
    gcount_ptr,
    inter_ptr,
    isc_ptr,
    qi_ptr,
    tick_ptr,
    cnt_ptr,
    w2_ptr,
    S,
    K_TOP,
    H,
    I,
    N_UP,
    P_UP,
    cnt_numel,
    KCH,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_it,
    stride_is,
    stride_w2e,
    stride_xst,
    stride_ist,
    stride_qit,
    SCALE_BN,
    SCALE_BK,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,
    A_FP8: tl.constexpr,
    A_PRE: tl.constexpr,
    Q_OUT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ROUTE: tl.constexpr,
    SLOT_P2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    GDC: tl.constexpr,
    PREFETCH: tl.constexpr,
    PF_CHUNK: tl.constexpr,
    SWAP: tl.constexpr,
    SPLIT: tl.constexpr,
    SPLIT_SUM: tl.constexpr,
    EARLY: tl.constexpr,
    W2_L2: tl.constexpr,
    W2_CHUNK: tl.constexpr,
    GEMV: tl.constexpr,
):
    """FC1 + activation: inter[slot, n] = act(x[tok] . w13[e, n]) * (x[tok] . w13[e, N_UP + n]), n < I.

    ``I`` is the number of output columns (gate rows) this launch covers and ``N_UP`` the distance from a
    gate row to its up row: both the full intermediate size for a whole call; for one locality domain's
    shard (split-N) ``w_ptr`` / ``inter_ptr`` start at the shard's first row and ``I`` is its width. ``P_UP``:
    the distance from a gate partial to its up partial in a row of ``inter`` when split over K (N_UP for a
    whole call; the shard's width over domains, each domain's partials in a block of its own).

    With ``SPLIT`` > 1, program (g, n, s) covers K range [s * KCH, (s + 1) * KCH) and writes its float32
    partial gate and up products to inter[s, slot, n] and inter[s, slot, P_UP + n]; FC2 sums the SPLIT
    partials in order and applies the activation as it loads them (deterministic, no atomics), unless
    ``SPLIT_SUM`` (below).
    ``W2_L2`` > 0: each program also asks L2 for its share (W2_L2 bytes) of its expert's w2, so FC2
    finds its weights in L2 instead of waiting on HBM after the kernel boundary.

    FP8 activations (``A_FP8``): ``x`` is e4m3 with scales ``xs`` [T, H / BK] (``A_PRE``, see fp8.quantise_rows);
    ``Q_OUT``: the epilogue writes the intermediate as e4m3 with one scale per (slot, BN columns) into
    ``isc`` [S, I / BN], which FC2 reads with its K tile equal to our BN. The scales of the next K step are
    loaded one step ahead, so their latency hides behind this step's copies and MMAs.

    ``SPLIT_SUM`` (K split with ``Q_OUT``): the SPLIT programs of a (group, N tile) each store their float32
    partials, then take an arrival ticket (``tick``, zeroed by the quantisation kernel); the last to arrive sums
    the partials in split order (deterministic), activates, and writes the e4m3 intermediate ``qi`` and its
    scales, so FC2 reads one e4m3 tile per K step as after an unsplit FC1.

    ``GEMV``: the reduction form (``_gemv_step``): chunks of BM <= 4 rows, no MMA, the sum over K after the loop;
    16-bit activations, FP8 weights converted in registers, one block scale per tile (MoEConfig.problem, plan_call).
    """
    pid_g = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BK)
    if GDC:
        gdc_wait()  # hidden states, ids and route tables are written by earlier kernels
        if EARLY:
            # Let FC2's programs take free SM slots now: before their own gdc_wait they only read routing
            # data (complete: we are past our wait) and prefetch their weights into L2.
            gdc_launch_dependents()
    # Zero FC2's arrival counters (FC2 touches them only after its own gdc_wait, i.e. after this grid).
    if (pid_g == 0) & (pid_k == 0):
        per = tl.cdiv(cnt_numel, tl.num_programs(1))
        for c0 in range(0, per, 1024):
            zo = c0 + tl.arange(0, 1024)
            tl.store(
                cnt_ptr + pid_n * per + zo, tl.zeros([1024], tl.int32), mask=(zo < per) & (pid_n * per + zo < cnt_numel)
            )
    e, skip, start, count, match, rank = _program_group(
        ids_ptr, gexp_ptr, gstart_ptr, gcount_ptr, S, pid_g, ROUTE, SLOT_P2
    )
    if skip:
        return
    e64 = e.to(tl.int64)
    w_base = w_ptr + e64 * stride_we
    if W2_L2 > 0:  # w2[e] is one contiguous block; program (n, s) of the group takes share n * SPLIT + s
        w2_bytes = H * N_UP * w2_ptr.dtype.element_ty.primitive_bitwidth // 8
        share = (pid_n * SPLIT + pid_k) * W2_L2
        w2_base = (w2_ptr + e64 * stride_w2e).to(tl.pointer_type(tl.int8))
        l2_prefetch_range(
            w2_base + share, tl.minimum(tl.maximum(w2_bytes - share, 0), W2_L2), W2_CHUNK, W2_L2 // W2_CHUNK
        )
    if PREFETCH > 0:
        nbytes = tl.minimum(I - pid_n * BN, BN) * H * w_ptr.dtype.element_ty.primitive_bitwidth // 8
        nbytes = tl.minimum(nbytes, PREFETCH)
        l2_prefetch_range(w_base + pid_n * BN * stride_wn, nbytes, PF_CHUNK, PREFETCH // PF_CHUNK)
        l2_prefetch_range(w_base + (N_UP + pid_n * BN) * stride_wn, nbytes, PF_CHUNK, PREFETCH // PF_CHUNK)
    s_base = ws_ptr + e64 * stride_se
    if SPLIT == 1:
        # Compile-time 0 and the (specialised) H: the weight / activation pointers then keep the 16-byte
        # alignment Triton knows of their bases, and the K loop its vectorised cp.async pipeline. (A runtime
        # k_lo = pid_k * KCH here cost both -- 2-byte loads, no pipeline, 2.3x slower at T = 1 on the H200:
        # benchmarks/results/moe-regression-bisect-h200.log; tests/cpu/kernels/test_triton_moe_sm90_compile.py
        # guards it.)
        k_lo = 0
        k_hi = H
    else:
        k_lo = tl.multiple_of(pid_k * KCH, BK)  # KCH: a multiple of BK, so no K tile straddles two ranges
        k_hi = tl.minimum(H, k_lo + KCH)
    for m0 in range(0, count, BM):
        slot, valid = _group_rows(match, rank, sorted_ptr, start, count, m0, ROUTE, BM, SLOT_P2)
        tok = slot // K_TOP
        if SWAP:
            x_ptrs = x_ptr + tok[None, :] * stride_xt + (k_lo + offs_k[:, None]) * stride_xh
            wg_ptrs = w_base + offs_n[:, None] * stride_wn + (k_lo + offs_k[None, :]) * stride_wk
            acc_g = tl.zeros([BN, BM], tl.float32)
            acc_u = tl.zeros([BN, BM], tl.float32)
        elif GEMV:
            col_j, slot_j, valid_j = _gemv_columns(slot, valid, pid_n * BN, BN, BM)
            ncol_ok = col_j < I
            offs_kw = _gemv_offs_k(BK, w_ptr.dtype.element_ty.primitive_bitwidth)
            x_ptrs = x_ptr + (slot_j // K_TOP)[None, :] * stride_xt + (k_lo + offs_k[:, None]) * stride_xh
            wg_ptrs = w_base + col_j[None, :] * stride_wn + (k_lo + offs_kw[:, None]) * stride_wk
            acc2_g = tl.zeros([BK, BN * BM], tl.float32)
            acc2_u = tl.zeros([BK, BN * BM], tl.float32)
        else:
            x_ptrs = x_ptr + tok[:, None] * stride_xt + (k_lo + offs_k[None, :]) * stride_xh
            wg_ptrs = w_base + offs_n[None, :] * stride_wn + (k_lo + offs_k[:, None]) * stride_wk
            acc_g = tl.zeros([BM, BN], tl.float32)
            acc_u = tl.zeros([BM, BN], tl.float32)
        wu_ptrs = wg_ptrs + N_UP * stride_wn
        # the scales of the first K step; each step then loads the next step's (one step ahead)
        sg_nxt = 1.0
        su_nxt = 1.0
        xs_nxt = 1.0
        if W_SCALE == 2 and GEMV:
            sg_nxt = _tile_scale(s_base, pid_n * BN, k_lo, k_hi - 1, stride_sn, stride_sk, SCALE_BN, SCALE_BK)
            su_nxt = _tile_scale(s_base, N_UP + pid_n * BN, k_lo, k_hi - 1, stride_sn, stride_sk, SCALE_BN, SCALE_BK)
        elif W_SCALE == 2:
            sg_nxt = _block_scales(s_base, offs_n, k_lo, stride_sn, stride_sk, SCALE_BN, SCALE_BK, n_mask)
            su_nxt = _block_scales(s_base, offs_n + N_UP, k_lo, stride_sn, stride_sk, SCALE_BN, SCALE_BK, n_mask)
        if A_PRE:
            xs_nxt = tl.load(xs_ptr + tok * stride_xst + k_lo // BK, mask=valid, other=1.0)
        for k0 in range(k_lo, k_hi, BK):
            sg = sg_nxt
            su = su_nxt
            xs = xs_nxt
            k1 = k0 + BK
            if W_SCALE == 2 and GEMV:
                sg_nxt = _tile_scale(s_base, pid_n * BN, k1, k_hi - 1, stride_sn, stride_sk, SCALE_BN, SCALE_BK)
                su_nxt = _tile_scale(s_base, N_UP + pid_n * BN, k1, k_hi - 1, stride_sn, stride_sk, SCALE_BN, SCALE_BK)
            elif W_SCALE == 2:
                more = _and_lt(n_mask, k1, k_hi)
                sg_nxt = _block_scales(s_base, offs_n, k1, stride_sn, stride_sk, SCALE_BN, SCALE_BK, more)
                su_nxt = _block_scales(s_base, offs_n + N_UP, k1, stride_sn, stride_sk, SCALE_BN, SCALE_BK, more)
            if A_PRE:
                xs_nxt = tl.load(xs_ptr + tok * stride_xst + k1 // BK, mask=_and_lt(valid, k1, k_hi), other=1.0)
            k_mask = (offs_k < H - k0) | EVEN_K
            if GEMV:
                x2 = tl.load(x_ptrs, mask=valid_j[None, :] & k_mask[:, None], other=0.0).to(tl.float32)
                wg = tl.load(wg_ptrs, mask=ncol_ok[None, :] & k_mask[:, None], other=0.0)
                wu = tl.load(wu_ptrs, mask=ncol_ok[None, :] & k_mask[:, None], other=0.0)
                acc2_g = _gemv_step(acc2_g, x2, wg, sg, W_SCALE)
                acc2_u = _gemv_step(acc2_u, x2, wu, su, W_SCALE)
            else:
                if SWAP:
                    x = tl.load(x_ptrs, mask=valid[None, :] & k_mask[:, None], other=0.0)
                    wg = tl.load(wg_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                    wu = tl.load(wu_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                else:
                    x = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
                    wg = tl.load(wg_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
                    wu = tl.load(wu_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
                acc_g = _mma_step(x, wg, acc_g, sg, xs, W_SCALE, A_FP8, A_PRE, SWAP, DOT_PREC)
                acc_u = _mma_step(x, wu, acc_u, su, xs, W_SCALE, A_FP8, A_PRE, SWAP, DOT_PREC)
            x_ptrs += BK * stride_xh
            wg_ptrs += BK * stride_wk
            wu_ptrs += BK * stride_wk
        if GEMV:  # the reduction over K, once per chunk of rows
            acc_g = _gemv_rows(acc2_g, BN, BM)
            acc_u = _gemv_rows(acc2_u, BN, BM)
        if SWAP:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        if GDC:
            gdc_launch_dependents()  # last read of inputs done (later chunks re-read only L2-hot weights)
        if W_SCALE == 1:
            s = tl.load(s_base).to(tl.float32)
            acc_g = acc_g * s
            acc_u = acc_u * s
        if HAS_BIAS:  # added once: by the first K range when split
            b_mask = n_mask & ((tl.zeros([BN], tl.int32) + pid_k) == 0)
            bg = tl.load(b_ptr + e64 * stride_be + offs_n * stride_bn, mask=b_mask, other=0.0).to(tl.float32)
            bu = tl.load(b_ptr + e64 * stride_be + (offs_n + N_UP) * stride_bn, mask=b_mask, other=0.0).to(tl.float32)
            acc_g += bg[None, :]
            acc_u += bu[None, :]
        i_ptrs = inter_ptr + pid_k * stride_is + slot[:, None] * stride_it + offs_n[None, :]
        i_mask = valid[:, None] & n_mask[None, :]
        if SPLIT == 1:
            _act_store(acc_g, acc_u, i_ptrs, i_mask, isc_ptr + slot * stride_ist + pid_n, valid, ACT, Q_OUT)
        else:
            tl.store(i_ptrs, acc_g, mask=i_mask)
            tl.store(i_ptrs + P_UP, acc_u, mask=i_mask)
    if SPLIT_SUM:
        # Publish this program's partials, then count arrivals per (group, N tile): the last of the SPLIT
        # programs sums them in split order (deterministic, no float atomics) -- as FC2's fused top-k sum does.
        tl.debug_barrier()
        old = tl.atomic_add(tick_ptr + pid_g * tl.num_programs(1) + pid_n, 1, sem="acq_rel", scope="gpu")
        if old == SPLIT - 1:
            for m0 in range(0, count, BM):
                slot, valid = _group_rows(match, rank, sorted_ptr, start, count, m0, ROUTE, BM, SLOT_P2)
                p_ptrs = inter_ptr + slot[:, None] * stride_it + offs_n[None, :]
                p_mask = valid[:, None] & n_mask[None, :]
                g = tl.zeros([BM, BN], tl.float32)
                u = tl.zeros([BM, BN], tl.float32)
                for sp in tl.static_range(0, SPLIT):
                    g += tl.load(p_ptrs + sp * stride_is, mask=p_mask, other=0.0, cache_modifier=".cg")
                    u += tl.load(p_ptrs + sp * stride_is + P_UP, mask=p_mask, other=0.0, cache_modifier=".cg")
                q_ptrs = qi_ptr + slot[:, None] * stride_qit + offs_n[None, :]
                _act_store(g, u, q_ptrs, p_mask, isc_ptr + slot * stride_ist + pid_n, valid, ACT, True)


@triton.jit
def _act_store(acc_g, acc_u, ptrs, mask, sc_ptrs, valid, ACT: tl.constexpr, Q_OUT: tl.constexpr):
    """act(gate) * up into the intermediate at ``ptrs``; with ``Q_OUT`` in e4m3, one scale per row (amax / 448
    over the tile's columns) stored at ``sc_ptrs`` -- FC2's FP8 A tile, quantised once."""
    if ACT == 0:
        h = silu(acc_g) * acc_u
    else:
        h = gelu_tanh(acc_g) * acc_u
    if Q_OUT:
        hs = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-12) / 448.0
        h = h / hs[:, None]
        tl.store(sc_ptrs, hs, mask=valid)
    tl.store(ptrs, h.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit(
    do_not_specialize=[
        "S",
        "K_TOP",
        "stride_be",
        "stride_bn",
        "stride_se",
        "stride_sn",
        "stride_sk",
        "stride_as",
        "stride_ast",
    ]
)
def _moe_fc2_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    b_ptr,
    ws_ptr,
    ids_ptr,
    tw_ptr,
    sorted_ptr,
    gexp_ptr,
    gstart_ptr,
    gcount_ptr,
    part_ptr,
    out_ptr,
    cnt_ptr,
    S,
    K_TOP,
    H,
    I,
    stride_at,
    stride_as,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_pt,
    stride_ot,
    stride_ast,
    SCALE_BN,
    SCALE_BK,
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,
    A_FP8: tl.constexpr,
    A_PRE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ROUTE: tl.constexpr,
    SLOT_P2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    GDC: tl.constexpr,
    PREFETCH: tl.constexpr,
    PF_CHUNK: tl.constexpr,
    FUSED_SUM: tl.constexpr,
    SWAP: tl.constexpr,
    SPLIT1: tl.constexpr,
    ACT: tl.constexpr,
    GEMV: tl.constexpr,
):
    """FC2 + top-k weighted sum: out[t, n] = sum_j w[t, j] * (inter[t*k + j] . w2[e_j, n]).

    ``SPLIT1`` > 1: FC1 split its K range and left float32 partial gate / up products (see FC1); each A
    tile is then sum_s gate_s, sum_s up_s (in s order), activated and rounded to the activations' dtype,
    the same rounding the unsplit FC1 applies before it stores the intermediate.
    ``A_PRE``: the intermediate is e4m3 with a scale per (slot, BK columns) in ``as_ptr`` (FC1's ``Q_OUT``).
    ``GEMV``: the reduction form (``_gemv_step``; unsplit FC1, no e4m3 intermediate: MoEConfig.problem).
    """
    pid_g = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BK)
    # Routing data (ids, route tables) was complete before FC1 passed its gdc_wait, and FC1 lets this grid
    # start only after that, so reading it here, before our own wait, is safe.
    e, skip, start, count, match, rank = _program_group(
        ids_ptr, gexp_ptr, gstart_ptr, gcount_ptr, S, pid_g, ROUTE, SLOT_P2
    )
    if skip:
        return
    e64 = e.to(tl.int64)
    w_base = w_ptr + e64 * stride_we
    if PREFETCH > 0:  # weights: nothing before us writes them
        nbytes = tl.minimum(H - pid_n * BN, BN) * I * w_ptr.dtype.element_ty.primitive_bitwidth // 8
        l2_prefetch_range(w_base + pid_n * BN * stride_wn, tl.minimum(nbytes, PREFETCH), PF_CHUNK, PREFETCH // PF_CHUNK)
    if GDC:
        gdc_wait()  # the intermediate is FC1's output
    s_base = ws_ptr + e64 * stride_se
    n_tiles = tl.num_programs(1)
    for m0 in range(0, count, BM):
        slot, valid = _group_rows(match, rank, sorted_ptr, start, count, m0, ROUTE, BM, SLOT_P2)
        if SWAP:
            a_ptrs = a_ptr + slot[None, :] * stride_at + offs_k[:, None]
            w_ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
            acc = tl.zeros([BN, BM], tl.float32)
        elif GEMV:
            col_j, slot_j, valid_j = _gemv_columns(slot, valid, pid_n * BN, BN, BM)
            ncol_ok = col_j < H
            offs_kw = _gemv_offs_k(BK, w_ptr.dtype.element_ty.primitive_bitwidth)
            a_ptrs = a_ptr + slot_j[None, :] * stride_at + offs_k[:, None]
            w_ptrs = w_base + col_j[None, :] * stride_wn + offs_kw[:, None] * stride_wk
            acc2 = tl.zeros([BK, BN * BM], tl.float32)
        else:
            a_ptrs = a_ptr + slot[:, None] * stride_at + offs_k[None, :]
            w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
            acc = tl.zeros([BM, BN], tl.float32)
        sw_nxt = 1.0
        as_nxt = 1.0
        if W_SCALE == 2 and GEMV:  # scales one K step ahead (see FC1)
            sw_nxt = _tile_scale(s_base, pid_n * BN, 0, I - 1, stride_sn, stride_sk, SCALE_BN, SCALE_BK)
        elif W_SCALE == 2:
            sw_nxt = _block_scales(s_base, offs_n, 0, stride_sn, stride_sk, SCALE_BN, SCALE_BK, n_mask)
        if A_PRE:
            as_nxt = tl.load(as_ptr + slot * stride_ast, mask=valid, other=1.0)
        for k0 in range(0, I, BK):
            sw = sw_nxt
            a_s = as_nxt
            k1 = k0 + BK
            if W_SCALE == 2 and GEMV:
                sw_nxt = _tile_scale(s_base, pid_n * BN, k1, I - 1, stride_sn, stride_sk, SCALE_BN, SCALE_BK)
            elif W_SCALE == 2:
                more = _and_lt(n_mask, k1, I)
                sw_nxt = _block_scales(s_base, offs_n, k1, stride_sn, stride_sk, SCALE_BN, SCALE_BK, more)
            if A_PRE:
                as_nxt = tl.load(as_ptr + slot * stride_ast + k1 // BK, mask=_and_lt(valid, k1, I), other=1.0)
            k_mask = (offs_k < I - k0) | EVEN_K
            if GEMV:
                a2 = tl.load(a_ptrs, mask=valid_j[None, :] & k_mask[:, None], other=0.0).to(tl.float32)
                w = tl.load(w_ptrs, mask=ncol_ok[None, :] & k_mask[:, None], other=0.0)
                acc2 = _gemv_step(acc2, a2, w, sw, W_SCALE)
            else:
                if SWAP:
                    a_mask = valid[None, :] & k_mask[:, None]
                    w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                else:
                    a_mask = valid[:, None] & k_mask[None, :]
                    w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
                if SPLIT1 == 1:
                    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
                else:
                    ag = tl.load(a_ptrs, mask=a_mask, other=0.0)
                    au = tl.load(a_ptrs + I, mask=a_mask, other=0.0)
                    for sp in tl.static_range(1, SPLIT1):
                        ag += tl.load(a_ptrs + sp * stride_as, mask=a_mask, other=0.0)
                        au += tl.load(a_ptrs + sp * stride_as + I, mask=a_mask, other=0.0)
                    if ACT == 0:
                        a = (silu(ag) * au).to(out_ptr.dtype.element_ty)
                    else:
                        a = (gelu_tanh(ag) * au).to(out_ptr.dtype.element_ty)
                acc = _mma_step(a, w, acc, sw, a_s, W_SCALE, A_FP8, A_PRE, SWAP, DOT_PREC)
            a_ptrs += BK
            w_ptrs += BK * stride_wk
        if GEMV:  # the reduction over K, once per chunk of rows
            acc = _gemv_rows(acc2, BN, BM)
        if SWAP:
            acc = tl.trans(acc)
        if GDC:
            gdc_launch_dependents()
        if W_SCALE == 1:
            acc = acc * tl.load(s_base).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e64 * stride_be + offs_n * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tw = tl.load(tw_ptr + slot, mask=valid, other=0.0).to(tl.float32)
        acc = acc * tw[:, None]
        p_ptrs = part_ptr + slot[:, None] * stride_pt + offs_n[None, :]
        tl.store(p_ptrs, acc.to(part_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])
        if FUSED_SUM:
            # Publish this program's rows, then count arrivals per (token, N tile). The program that
            # completes a token sums its k rows in slot order: deterministic, no float atomics.
            tl.debug_barrier()
            tok = slot // K_TOP
            old = tl.atomic_add(cnt_ptr + tok * n_tiles + pid_n, 1, mask=valid, sem="acq_rel", scope="gpu")
            last = valid & (old == K_TOP - 1)
            if tl.sum(last.to(tl.int32), axis=0) > 0:
                tot = tl.zeros([BM, BN], tl.float32)
                q_ptrs = part_ptr + (tok * K_TOP)[:, None] * stride_pt + offs_n[None, :]
                for j in range(0, K_TOP):
                    p = tl.load(
                        q_ptrs + j * stride_pt, mask=last[:, None] & n_mask[None, :], other=0.0, cache_modifier=".cg"
                    )
                    tot += p.to(tl.float32)
                o_ptrs = out_ptr + tok[:, None] * stride_ot + offs_n[None, :]
                tl.store(o_ptrs, tot.to(out_ptr.dtype.element_ty), mask=last[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["K_TOP"])
def _moe_sum_kernel(part_ptr, out_ptr, H, K_TOP, stride_pt, stride_ot, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """out[t] = sum_j part[t*k + j] in slot order (used when the config does not fuse the sum into FC2)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    if GDC:
        gdc_wait()
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(0, K_TOP):
        acc += tl.load(part_ptr + (t * K_TOP + j) * stride_pt + offs, mask=mask, other=0.0).to(tl.float32)
    if GDC:
        gdc_launch_dependents()
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["S", "G", "CAP"])
def _moe_route_kernel(
    ids_ptr,
    S,
    G,
    CAP,
    sorted_ptr,
    gexp_ptr,
    gstart_ptr,
    gcount_ptr,
    scratch_ptr,
    S_P2: tl.constexpr,
    G_P2: tl.constexpr,
    GDC: tl.constexpr,
):
    """One program: sort slots by expert (stable), cut them into groups of <= CAP rows per expert.

    Writes sorted_slots[S], and for g < G: group expert, start and row count (0 past the last group).
    """
    offs = tl.arange(0, S_P2)
    valid = offs < S
    if GDC:
        gdc_wait()
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    if GDC:
        gdc_launch_dependents()
    key = tl.where(valid, ids * S_P2 + offs, 0x7FFFFFFF)
    skey = tl.sort(key)
    sid = skey // S_P2
    tl.store(sorted_ptr + offs, skey % S_P2, mask=valid)
    tl.store(scratch_ptr + offs, sid, mask=valid)
    tl.debug_barrier()
    prev = tl.load(scratch_ptr + offs - 1, mask=valid & (offs > 0), other=-1, cache_modifier=".cg")
    run_first = valid & (sid != prev)
    run_start = tl.associative_scan(tl.where(run_first, offs, 0), 0, _max_combine)
    first = run_first | (valid & ((offs - run_start) % CAP == 0))
    gidx = tl.cumsum(first.to(tl.int32), axis=0) - 1
    n_groups = tl.sum(first.to(tl.int32), axis=0)
    tl.store(gexp_ptr + gidx, sid, mask=first)
    tl.store(gstart_ptr + gidx, offs, mask=first)
    tl.debug_barrier()
    go = tl.arange(0, G_P2)
    st = tl.load(gstart_ptr + go, mask=go < n_groups, other=0, cache_modifier=".cg")
    nxt = tl.load(gstart_ptr + go + 1, mask=go + 1 < n_groups, other=S, cache_modifier=".cg")
    tl.store(gcount_ptr + go, tl.where(go < n_groups, nxt - st, 0), mask=go < G)


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[str, int, int]:
    """(name, SM count, compute capability major) of a CUDA device."""
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count, props.major


def _device_facts(device: torch.device) -> tuple[str, int, int]:
    if device.type == "cuda":
        return _device_info(device.index if device.index is not None else torch.cuda.current_device())
    return "cpu", 132, 0  # the interpreter: no PDL instructions, heuristic tiles


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU (H100 / H200 / GH200): where the heuristic may pick the persistent path,
    tested only there (its TMA descriptors and wgmma tiles; an interpreted run on the CPU takes the other tiles)."""
    return not _INTERPRET and _device_facts(device)[2] == 9


def route_groups_torch(flat_ids: torch.Tensor, E: int, cap: int):
    """Prefill routing with capturable torch ops: slots sorted by expert, cut into groups of <= cap rows.

    Returns (sorted_slots int32 [S], group_expert, group_start, group_count: int32 [G]) with
    G = S // cap + min(E, S); groups past the last have count 0.
    """
    S = flat_ids.numel()
    dev = flat_ids.device
    sorted_ids, order = torch.sort(flat_ids.to(torch.int32), stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=dev, dtype=torch.int32))
    counts = bounds[1:] - bounds[:-1]
    nblk = (counts + cap - 1) // cap
    cum = torch.cumsum(nblk, 0)
    G = S // cap + min(E, S)
    b = torch.arange(G, device=dev, dtype=cum.dtype)
    e = torch.searchsorted(cum, b, right=True).clamp_(max=E - 1)
    gstart = bounds[e] + (b - (cum[e] - nblk[e])) * cap
    gcount = torch.clamp(bounds[e + 1] - gstart, 0, cap)
    gcount = torch.where(b < cum[-1], gcount, torch.zeros_like(gcount))
    i32 = torch.int32
    return order.to(i32), e.to(i32), gstart.to(i32), gcount.to(i32)


def _pf_chunk(prefetch: int, cfg: GemmConfig) -> int:
    """Bytes per prefetch instruction: one instruction per thread, so no thread repeats another's."""
    if prefetch <= 0:
        return 16
    return max(16, prefetch // (32 * cfg.num_warps))


def _clamp_bk(cfg: GemmConfig, block_shape, k_extent: int) -> GemmConfig:
    bk = cfg.BK
    if block_shape is not None:
        bk = min(bk, _largest_pow2_divisor(int(block_shape[1]), bk))
    bk = max(16, min(bk, next_power_of_2(max(k_extent, 16))))
    return cfg if bk == cfg.BK else replace(cfg, BK=bk)


# ------------------------------------------------------------------------------------------------
# the launch plan: what one call shape runs, built once
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEPlan:
    """How every call of one shape runs: routing mode, grids, the two GEMMs' tiles, buffer shapes and the
    kernels' compile-time arguments. Built once per (shape, dtypes, config, device, launch) by ``plan_call``
    and cached; a call then allocates its buffers and launches (``run_whole``, or ``run_split_n`` -- the same
    plan over locality domains, each domain running FC1 / FC2 on its share of the output columns)."""

    T: int
    H: int
    E: int
    I: int  # noqa: E741
    k: int
    config: MoEConfig  # after _fit_mode
    fc1: GemmConfig  # BK clamped to K and the scale block; no L2 prefetch in the interpreter
    fc2: GemmConfig  # also fitted to shared memory after a K-split FC1
    route: int  # 0: slot mode (no routing launch); 1: route tables (group expert / start / count)
    groups: int  # G: programs on axis 0 of FC1 and FC2
    cap: int  # rows per group (route tables)
    route_kernel: bool  # route tables by the single-program kernel (else capturable torch ops)
    split: int  # FC1 programs along K (1: unsplit)
    kch: int  # K range per FC1 program, a multiple of fc1.BK
    act: int  # 0 silu, 1 gelu_tanh
    w_scale: int  # 0 none, 1 per tensor / per expert, 2 block scales
    block: tuple[int, int]  # the scale block (1, 1 when not block-scaled)
    gdc: bool  # the kernels contain the PDL instructions (sm_90+, Triton >= 3.4, not the interpreter)
    first_pdl: bool  # the call's first kernel is launched with PDL (Launch.pdl)
    chain_pdl: bool  # our later kernels are launched with PDL (Launch.pdl or config.chain)
    a_fp8: bool  # FP8 activations: the hidden states quantised once per call (quantise()) for FC1
    q_inter: bool  # ... and FC1 writes FC2's intermediate in e4m3 (fc2.BK == fc1.BN), whole and over domains;
    # not when an FC1 tile is wider than the scale block (FC2 then quantises its A tiles itself)
    split_sum: bool  # K-split FC1 with q_inter: FC1's last-arriving program sums the partials (else FC2 does)
    dot_prec: str
    x_dtype: torch.dtype

    @property
    def S(self) -> int:
        return self.T * self.k

    @property
    def common(self) -> dict[str, Any]:
        """Compile-time arguments both GEMM kernels take."""
        return dict(
            W_SCALE=self.w_scale,
            A_FP8=self.a_fp8,
            DOT_PREC=self.dot_prec,
            ROUTE=self.route,
            SLOT_P2=SLOT_MAX,
            GDC=self.gdc,
        )

    def _pdl(self, on: bool) -> dict[str, Any]:
        return {"launch_pdl": True} if on else {}

    # buffers and routing -------------------------------------------------------------------------

    def routing(self, ids: torch.Tensor) -> tuple:
        """(sorted_slots, group_expert, group_start, group_count) for this call, launching the routing kernel
        (or torch ops) where the plan has route tables; slot mode needs none (``ids`` stand in, unread)."""
        if self.route == 0:
            return ids, ids, ids, ids
        dev, i32, S, G = ids.device, torch.int32, self.S, self.groups
        if not self.route_kernel:
            return route_groups_torch(ids, self.E, self.cap)
        sorted_slots = torch.empty(S, dtype=i32, device=dev)
        gexp, gcount = torch.empty(G, dtype=i32, device=dev), torch.empty(G, dtype=i32, device=dev)
        gstart = torch.empty(G + 1, dtype=i32, device=dev)
        s_p2 = next_power_of_2(S)
        scratch = torch.empty(s_p2, dtype=i32, device=dev)
        launcher(_moe_route_kernel)[(1,)](
            ids,
            S,
            G,
            self.cap,
            sorted_slots,
            gexp,
            gstart,
            gcount,
            scratch,
            S_P2=s_p2,
            G_P2=next_power_of_2(G),
            GDC=self.gdc,
            num_warps=4 if s_p2 <= 1024 else 8,
            **self._pdl(self.first_pdl),
        )
        return sorted_slots, gexp, gstart, gcount

    def intermediate(self, dev: torch.device) -> torch.Tensor:
        """FC1's output: [1, S, I] in the activations' dtype (e4m3 with ``q_inter``); float32 partial (gate, up)
        products [split, S, 2I] when FC1 is split over K."""
        if self.split > 1:
            return torch.empty((self.split, self.S, 2 * self.I), dtype=torch.float32, device=dev)
        if self.q_inter:
            return torch.empty((1, self.S, self.I), dtype=torch.float8_e4m3fn, device=dev)
        return torch.empty((1, self.S, self.I), dtype=self.x_dtype, device=dev)

    def summed_intermediate(self, dev: torch.device) -> Optional[torch.Tensor]:
        """With ``split_sum``: the e4m3 intermediate [1, S, I] FC1's last programs write from the partials."""
        if not self.split_sum:
            return None
        return torch.empty((1, self.S, self.I), dtype=torch.float8_e4m3fn, device=dev)

    def tickets(self, dev: torch.device) -> Optional[torch.Tensor]:
        """With ``split_sum``: one arrival ticket per (group, FC1 N tile), zeroed by ``quantise``'s kernel."""
        if not self.split_sum:
            return None
        return torch.empty(self.groups * cdiv(self.I, self.fc1.BN), dtype=torch.int32, device=dev)

    def inter_scales(self, dev: torch.device) -> Optional[torch.Tensor]:
        """The e4m3 intermediate's scales [S, I / fc1.BN] (``q_inter``), else None."""
        if not self.q_inter:
            return None
        return torch.empty((self.S, cdiv(self.I, self.fc1.BN)), dtype=torch.float32, device=dev)

    def quantise(
        self, x: torch.Tensor, pdl: bool, tick: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(activations for FC1, their scales): with ``a_fp8`` the hidden states in e4m3 with one scale per
        (token, FC1 K tile), made by one small kernel (which also zeroes ``tick``); else ``x`` itself and None."""
        if not self.a_fp8:
            return x, None
        return quantise_rows(x, self.fc1.BK, self.gdc, self._pdl(pdl), tick)

    # the two GEMMs -------------------------------------------------------------------------------

    def launch_fc1(
        self,
        c: "_Call",
        w: torch.Tensor,
        n_up: int,
        i_len: int,
        b: Optional[torch.Tensor],
        sc: tuple,
        inter_v: torch.Tensor,
        cnt: torch.Tensor,
        cnt_numel: int,
        w2_l2: bool,
        pdl: bool,
        q_out: bool = False,
        col0: int = 0,
    ) -> None:
        """FC1 over ``i_len`` gate rows of ``w`` (up rows ``n_up`` further), into ``inter_v`` (in e4m3, scales
        into ``c.isc``, with ``q_out``). ``col0``: the first intermediate column this launch covers (a locality
        domain's shard, a multiple of fc1.BN): where its e4m3 output, scales, tickets and partials start."""
        fc1, H, elt = self.fc1, self.H, w.element_size()
        pf1 = fc1.prefetch if (w.stride(2) == 1 and w.stride(1) == H and (H * elt) % 16 == 0) else 0
        if self.split > 1:
            pf1 = 0  # a program's K range of a weight row is not one contiguous run
        # FC1 pulls w2 into L2 in equal shares, one instruction per thread (w2[e] must be one aligned block)
        nt1 = cdiv(i_len, fc1.BN)
        w2_l2_bytes = w2_chunk = 0
        if w2_l2:
            threads = 32 * fc1.num_warps
            w2_chunk = cdiv(cdiv(H * self.I * elt, nt1 * self.split * threads), 16) * 16
            w2_l2_bytes = w2_chunk * threads
        x, out = c.x, c.out
        bb = b if b is not None else out
        scale, s_e, s_n, s_k = sc
        xs = c.xs if c.xs is not None else out
        isc = c.isc[:, col0 // fc1.BN :] if (c.isc is not None and q_out) else out
        split_sum = self.split_sum and q_out
        qi = c.qinter[:, :, col0:] if split_sum else out
        tick = c.tick[self.groups * (col0 // fc1.BN) :] if split_sum else out
        p_up = n_up
        if self.split > 1 and i_len < self.I:
            # a domain's float32 partials: [gate | up] of its own width, at 2 * col0 (never another domain's)
            inter_v, p_up = c.inter[:, :, 2 * col0 :], i_len
        launcher(_moe_fc1_kernel)[(self.groups, nt1, self.split)](
            x,
            xs,
            w,
            bb,
            scale if scale is not None else out,
            c.ids,
            *c.routes,
            inter_v,
            isc,
            qi,
            tick,
            cnt,
            c.args.w2,
            self.S,
            self.k,
            H,
            i_len,
            n_up,
            p_up,
            cnt_numel,
            self.kch,
            x.stride(0),
            x.stride(1),
            w.stride(0),
            w.stride(1),
            w.stride(2),
            bb.stride(0) if b is not None else 0,
            bb.stride(1) if b is not None else 0,
            s_e,
            s_n,
            s_k,
            inter_v.stride(1),
            inter_v.stride(0),
            c.args.w2.stride(0),
            xs.stride(0) if c.xs is not None else 0,
            isc.stride(0) if isc is not out else 0,
            qi.stride(1) if split_sum else 0,
            *self.block,
            ACT=self.act,
            HAS_BIAS=b is not None,
            A_PRE=c.xs is not None,
            Q_OUT=isc is not out and self.split == 1,
            BM=fc1.BM,
            BN=fc1.BN,
            BK=fc1.BK,
            EVEN_K=H % fc1.BK == 0,
            PREFETCH=pf1,
            PF_CHUNK=_pf_chunk(pf1, fc1),
            SWAP=fc1.swap,
            SPLIT=self.split,
            SPLIT_SUM=split_sum,
            EARLY=bool(self.config.early_launch and pdl),
            W2_L2=w2_l2_bytes,
            W2_CHUNK=max(16, w2_chunk),
            GEMV=fc1.gemv,
            num_warps=fc1.num_warps,
            num_stages=fc1.num_stages,
            **self.common,
            **self._pdl(pdl),
        )

    def launch_fc2(
        self,
        c: "_Call",
        w: torch.Tensor,
        h_len: int,
        b: Optional[torch.Tensor],
        sc: tuple,
        part_v: torch.Tensor,
        out_v: torch.Tensor,
        cnt: torch.Tensor,
        pdl: bool,
        q_in: bool = False,
    ) -> None:
        """FC2 for ``h_len`` output columns: rows of ``w`` / ``part_v`` / ``out_v`` from their first (reading
        FC1's e4m3 intermediate and its scales, with ``q_in``)."""
        fc2, I, elt = self.fc2, self.I, w.element_size()
        inter = c.qinter if (q_in and c.qinter is not None) else c.inter
        split1 = 1 if (q_in and self.split_sum) else self.split
        pf2 = fc2.prefetch if (w.stride(2) == 1 and w.stride(1) == I and (I * elt) % 16 == 0) else 0
        bb = b if b is not None else c.out
        scale, s_e, s_n, s_k = sc
        a_pre = c.isc is not None and q_in
        isc = c.isc if a_pre else c.out
        launcher(_moe_fc2_kernel)[(self.groups, cdiv(h_len, fc2.BN))](
            inter,
            isc,
            w,
            bb,
            scale if scale is not None else c.out,
            c.ids,
            c.tw,
            *c.routes,
            part_v,
            out_v,
            cnt,
            self.S,
            self.k,
            h_len,
            I,
            inter.stride(1),
            inter.stride(0),
            w.stride(0),
            w.stride(1),
            w.stride(2),
            bb.stride(0) if b is not None else 0,
            bb.stride(1) if b is not None else 0,
            s_e,
            s_n,
            s_k,
            part_v.stride(0),
            out_v.stride(0),
            isc.stride(0) if a_pre else 0,
            *self.block,
            HAS_BIAS=b is not None,
            A_PRE=a_pre,
            BM=fc2.BM,
            BN=fc2.BN,
            BK=fc2.BK,
            EVEN_K=I % fc2.BK == 0,
            PREFETCH=pf2,
            PF_CHUNK=_pf_chunk(pf2, fc2),
            FUSED_SUM=self.config.fused_sum,
            SWAP=fc2.swap,
            SPLIT1=split1,
            ACT=self.act,
            GEMV=fc2.gemv,
            num_warps=fc2.num_warps,
            num_stages=fc2.num_stages,
            **self.common,
            **self._pdl(pdl),
        )

    # the two ways to run it ----------------------------------------------------------------------

    def run_whole(self, c: "_Call") -> None:
        """FC1 then FC2 (and the top-k sum, unless FC2 fuses it) on the current stream."""
        args, dev = c.args, c.out.device
        nt2 = cdiv(self.H, self.fc2.BN)
        cnt = torch.empty((self.T, nt2), dtype=torch.int32, device=dev) if self.config.fused_sum else c.out
        w2, elt = args.w2, args.w2.element_size()
        w2_l2 = bool(
            self.config.w2_l2
            and self.config.mode != "prefill"
            and not _INTERPRET
            and (w2.stride(2) == 1 and w2.stride(1) == self.I and (self.H * self.I * elt) % 16 == 0 and aligned16(w2))
        )
        self.launch_fc1(
            c,
            args.w13,
            self.I,
            self.I,
            args.w13_bias,
            c.s13,
            c.inter,
            cnt,
            self.T * nt2 if self.config.fused_sum else 0,
            w2_l2,
            c.fc1_pdl,
            q_out=self.q_inter,
        )
        self.launch_fc2(c, w2, self.H, args.w2_bias, c.s2, c.part, c.out, cnt, self.chain_pdl, q_in=self.q_inter)
        if not self.config.fused_sum:
            block = min(1024, next_power_of_2(self.H))
            launcher(_moe_sum_kernel)[(self.T, cdiv(self.H, block))](
                c.part,
                c.out,
                self.H,
                self.k,
                c.part.stride(0),
                c.out.stride(0),
                BLOCK=block,
                GDC=self.gdc,
                num_warps=4,
                **self._pdl(self.chain_pdl),
            )

    def run_split_n(self, c: "_Call", dom: locality.Domains) -> None:
        """The split-N form: domain d runs FC1 on its share of I (gate rows with their up rows) and FC2 on its
        share of H, each on its own stream over its own weight shard; a cross-domain join sits between them,
        since each FC2 reads every domain's part of the intermediate.

        Streams: fork from the current stream, FC1_d on stream d, every stream waits for every FC1, FC2_d on
        stream d, the current stream waits for every FC2. All of it is stream-ordered (events), so a CUDA graph
        captures it as a fork / join. Every buffer is allocated before the fork on the current stream and used
        only before the join, so the caching allocator never hands it out while a domain stream still reads it.
        """
        args, dev, n, I, H = c.args, c.out.device, dom.count, self.I, self.H
        ib, hb = locality.split_bounds(I, n), locality.split_bounds(H, n)
        local = dom.plan.localized_memory
        w13s = locality.shards(args.w13, dom, "w13", ib, up=I)
        w2s = locality.shards(args.w2, dom, "w2", hb)
        b13s = locality.shards(args.w13_bias, dom, "b13", ib, up=I) if args.w13_bias is not None else None
        b2s = locality.shards(args.w2_bias, dom, "b2", hb) if args.w2_bias is not None else None
        if self.w_scale == 2:  # block scales: rows in units of the scale block
            sbn = self.block[0]
            blk = lambda bounds: [(lo // sbn, -(-hi // sbn)) for lo, hi in bounds]  # noqa: E731
            sc13 = [scale_args(s, True) for s in locality.shards(c.s13[0], dom, "s13", blk(ib), up=I // sbn)]
            sc2 = [scale_args(s, True) for s in locality.shards(c.s2[0], dom, "s2", blk(hb))]
        else:  # per-tensor / per-expert scales (or none) are shared
            sc13, sc2 = [c.s13] * n, [c.s2] * n
        cnts = [torch.empty((self.T, cdiv(hi - lo, self.fc2.BN)), dtype=torch.int32, device=dev) for lo, hi in hb]

        def fc1(d: int) -> None:
            lo, hi = ib[d]
            self.launch_fc1(
                c,
                w13s[d],
                (hi - lo) if local else I,
                hi - lo,
                b13s[d] if b13s else None,
                sc13[d],
                c.inter[:, :, lo:],
                cnts[d],
                cnts[d].numel(),
                False,
                False,
                q_out=self.q_inter,
                col0=lo,
            )

        def fc2(d: int) -> None:
            lo, hi = hb[d]
            self.launch_fc2(
                c,
                w2s[d],
                hi - lo,
                b2s[d] if b2s else None,
                sc2[d],
                c.part[:, lo:],
                c.out[:, lo:],
                cnts[d],
                False,
                q_in=self.q_inter,
            )

        if any(st is None for st in dom.streams):  # sequential domains (interpreter, tests): same order, one stream
            for d in range(n):
                fc1(d)
            for d in range(n):
                fc2(d)
            return
        cur = torch.cuda.current_stream(dev)
        ev = dom.events(1 + 2 * n)
        fork, done1, done2 = ev[0], ev[1 : 1 + n], ev[1 + n :]
        fork.record(cur)
        for d, s in enumerate(dom.streams):
            s.wait_event(fork)
            with torch.cuda.stream(s):
                fc1(d)
            done1[d].record(s)
        for d, s in enumerate(dom.streams):
            for o in range(n):
                if o != d:
                    s.wait_event(done1[o])
            with torch.cuda.stream(s):
                fc2(d)
            done2[d].record(s)
        for d in range(n):
            cur.wait_event(done2[d])


@dataclass
class _Call:
    """One call's tensors: its arguments, flattened routing, routing tables, buffers and kernel-ready scales."""

    args: MoEArgs
    out: torch.Tensor
    ids: torch.Tensor
    tw: torch.Tensor
    routes: tuple  # sorted_slots, group_expert, group_start, group_count
    inter: torch.Tensor
    part: torch.Tensor
    s13: tuple
    s2: tuple
    fc1_pdl: bool  # FC1's launch: the first kernel of the call unless routing or quantisation ran before it
    x: torch.Tensor  # FC1's activations: the hidden states, or their e4m3 copy (plan.a_fp8)
    xs: Optional[torch.Tensor]  # ... and its scales [T, H / fc1.BK]
    isc: Optional[torch.Tensor]  # the e4m3 intermediate's scales (plan.q_inter)
    qinter: Optional[torch.Tensor] = None  # the e4m3 intermediate summed by a K-split FC1 (plan.split_sum)
    tick: Optional[torch.Tensor] = None  # ... and its arrival tickets


def _act_code(activation: str) -> int:
    if activation not in _ACT_CODES:
        raise MoEArgumentError(
            f"rubin.moe: the Triton MoE implements activations {sorted(_ACT_CODES)}, not {activation!r}; "
            "kernel selection gives such a call to another kernel (the reference)"
        )
    return _ACT_CODES[activation]


@functools.lru_cache(maxsize=1024)
def plan_call(
    T: int,
    H: int,
    E: int,
    I: int,
    k: int,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,  # noqa: E741
    block_shape: Optional[tuple[int, int]],
    activation: str,
    config: MoEConfig,
    has_pdl: bool,
    pdl: bool,
    split_n: bool,
    interpret: bool,
) -> MoEPlan:
    """The launch plan of one call shape (see ``MoEPlan``); ``config`` is the chosen one (table or heuristic),
    ``split_n`` whether the call runs over locality domains (FC1 then runs unsplit over K unless it writes the
    e4m3 intermediate, ``q_inter``: FC2's sum of float32 partials is per whole call)."""
    config = _fit_mode(config, T, k)
    if block_shape is not None and int(block_shape[1]) % 16:
        # a K tile must lie in one scale block and is at least 16 wide (the MMA's K): refuse, do not mis-scale
        raise MoEArgumentError(
            f"rubin.moe[triton]: FP8 scale blocks of {block_shape[1]} along K are not supported (a multiple of 16 is; "
            "checkpoints use 128); kernel selection gives such a call to another kernel"
        )
    gdc = has_pdl and not interpret and gdc_wait is not None
    S = T * k
    fp8 = w_dtype in FP8_DTYPES
    fc1 = _clamp_bk(config.fc1, block_shape, H)
    fc2 = _clamp_bk(config.fc2, block_shape, I)
    if fp8 and block_shape is not None:
        # a GEMV tile takes one block scale per K step: its rows must lie in one scale block (FC1's up rows too)
        for name, g, up in (("fc1", fc1, I), ("fc2", fc2, 0)):
            if g.gemv and (int(block_shape[0]) % g.BN or up % g.BN):
                raise MoEArgumentError(
                    f"rubin.moe[triton]: config {name}: a GEMV tile of BN={g.BN} rows straddles the weights' "
                    f"{block_shape[0]}-row scale blocks (I = {I}); use a BN that divides {block_shape[0]} and I"
                )
    if interpret:
        fc1, fc2 = replace(fc1, prefetch=0), replace(fc2, prefetch=0)
    a_fp8 = bool(config.a_fp8 and fp8)
    # FP8 activations: FC1 writes the e4m3 intermediate FC2 reads (one scale per FC1 N tile; FC2's K tile is that
    # tile), whole or over locality domains (their shards are 128-column aligned, so the tiles are the same)
    q_inter = a_fp8 and (block_shape is None or int(block_shape[1]) % fc1.BN == 0)
    if q_inter:  # FC2's K tile is FC1's N tile: one scale of the e4m3 intermediate per A tile row
        fc2q = fit_smem(replace(fc2, BK=fc1.BN), "fc2", x_dtype.itemsize, w_dtype.itemsize)
        q_inter = fc2q.BK == fc1.BN
        fc2 = fc2q if q_inter else fc2
    if split_n and not q_inter:
        fc1 = replace(fc1, split_k=1)  # FC2's sum of float32 partials reads them per whole call
    # routing
    cap = config.cap if (config.mode == "prefill" and config.cap > 0) else (1 << 30)
    route_kernel = False
    if config.mode == "slot" and S <= SLOT_MAX:
        route, groups = 0, S
    elif S <= ROUTE_KERNEL_MAX:
        route, route_kernel = 1, True
        groups = min(E, S) if cap >= S else S // cap + min(E, S)
    else:
        route, cap = 1, min(cap, S)
        groups = S // cap + min(E, S)
    # split K: chunks of whole BK tiles; no empty chunk
    kch = cdiv(cdiv(H, max(1, fc1.split_k)), fc1.BK) * fc1.BK
    split = cdiv(H, kch)
    w_scale = (2 if block_shape is not None else 1) if fp8 else 0
    split_sum = q_inter and split > 1
    if split > 1 and not split_sum:  # FC2 pipelines 2 x split float32 tiles per K step: fewer stages may fit
        fc2 = fit_smem(fc2, "fc2", x_dtype.itemsize, w_dtype.itemsize, split1=split)
    return MoEPlan(
        T=T,
        H=H,
        E=E,
        I=I,
        k=k,
        config=config,
        fc1=fc1,
        fc2=fc2,
        route=route,
        groups=groups,
        cap=cap,
        route_kernel=route_kernel,
        split=split,
        kch=kch,
        act=_act_code(activation),
        w_scale=w_scale,
        block=(int(block_shape[0]), int(block_shape[1])) if block_shape is not None else (1, 1),
        gdc=gdc,
        first_pdl=pdl and gdc,
        chain_pdl=(pdl or config.chain) and gdc,
        a_fp8=a_fp8,
        q_inter=q_inter,
        split_sum=split_sum,
        dot_prec="ieee" if x_dtype == torch.float32 else "tf32",
        x_dtype=x_dtype,
    )


def _domains_for(placement: Placement, args: MoEArgs, dev: torch.device, domains: Optional[locality.Domains]):
    """The domains a decode-sized call with ``placement`` runs over. ``domains`` (tests): use these."""
    why = locality.split_n_unsupported(args.T, args.I, args.H, placement.domains, args.block_shape)
    if why is not None:  # place_locality checks this at compile time; a hand-written placement lands here
        raise ValueError(f"rubin.moe: placement {placement.encode()!r}: {why}")
    if domains is not None:
        return domains
    if _INTERPRET or dev.type != "cuda":  # no streams to split over: the same kernels, one after another
        return locality.sequential(placement.domains, dev)
    return locality.get(dev, placement.mode, placement.domains)


def run(
    args: MoEArgs,
    launch: Launch = Launch(),
    *,
    config: Optional[MoEConfig] = None,
    out: Optional[torch.Tensor] = None,
    domains: Optional[locality.Domains] = None,
) -> torch.Tensor:
    """``rubin.moe`` on the GPU with the fused Triton kernels (the registered adapter; same result as the
    reference).

    ``launch.pdl`` launches every kernel with programmatic dependent launch (sm_90+; results are bitwise
    identical either way); ``launch.placement`` (written by passes/place_locality.py) runs calls of at most its
    ``max_tokens`` tokens split over locality domains (``MoEPlan.run_split_n``; ``domains`` overrides the live
    ones, for tests); ``config`` overrides the tuned / heuristic choice; ``out`` ([T, H], hidden_states'
    dtype, contiguous rows) receives the result (the tests poison it). No host synchronisation: safe to
    capture in a CUDA graph. ``topk_ids`` outside [0, E) are not checked on the device (that would need a
    sync); the reference op reports them.
    """
    x = args.hidden_states
    T, H, E, I, k = args.T, args.H, args.E, args.I, args.k
    dtype = x.dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NotImplementedError(f"rubin.moe[triton]: hidden_states dtype {dtype} is not supported (bf16, fp16, fp32)")
    dev = x.device
    if out is None:
        out = torch.empty((T, H), dtype=dtype, device=dev)
    elif out.shape != (T, H) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"rubin.moe[triton]: out must be [{T}, {H}] {dtype} with contiguous rows")
    if T == 0 or k == 0:
        return out.zero_()
    name, num_sms, major = _device_facts(dev)
    has_pdl = major >= 9
    if config is None:
        block = tuple(args.block_shape) if args.block_shape is not None else None
        config = _tuned_config(T, E, H, I, k, args.w13.dtype, block, name, num_sms, is_sm90(dev))
    placed = launch.placement is not None and launch.placement.applies(T)
    if config.mode == "fused":
        why = moe_decode.problem(args, placed)
        if why is None:
            return moe_decode.run(args, launch, moe_decode.Tiles.of(config), num_sms, out)
        # a call the fused decode kernel does not take (FP8, biases, T > 64, split-N): the slot-mode kernels
        config = heuristic_config(T, E, H, I, k, args.w13.dtype, args.block_shape, num_sms)
    if config.mode == "persistent":
        tiles = moe_prefill.Tiles.of(config)
        why = moe_prefill.problem(args, tiles) or ("a split-N placement (decode sizes)" if placed else None)
        if why is None:
            return moe_prefill.run(args, launch, tiles, num_sms, out)
        # a call the persistent path does not take (rows off 16 bytes, another weight format, split-N): another mode
        config = heuristic_config(T, E, H, I, k, args.w13.dtype, args.block_shape, num_sms)
    dom = _domains_for(launch.placement, args, dev, domains) if placed else None
    plan = plan_call(
        T,
        H,
        E,
        I,
        k,
        dtype,
        args.w13.dtype,
        args.block_shape,
        args.activation,
        config,
        has_pdl,
        launch.pdl,
        placed,
        _INTERPRET,
    )
    ids, tw = args.flat_routing()
    routes = plan.routing(ids)
    tick = plan.tickets(dev)
    xq, xs = plan.quantise(x, plan.chain_pdl if plan.route_kernel else plan.first_pdl, tick)
    block_scaled = plan.w_scale == 2
    call = _Call(
        args,
        out,
        ids,
        tw,
        routes,
        plan.intermediate(dev),
        torch.empty((plan.S, H), dtype=dtype, device=dev),
        scale_args(args.w13_scale, block_scaled),
        scale_args(args.w2_scale, block_scaled),
        fc1_pdl=plan.chain_pdl if (plan.route_kernel or plan.a_fp8) else plan.first_pdl,
        x=xq,
        xs=xs,
        isc=plan.inter_scales(dev),
        qinter=plan.summed_intermediate(dev),
        tick=tick,
    )
    if dom is not None:
        if not plan.config.fused_sum:
            raise ValueError("rubin.moe[triton]: split-N needs the fused top-k sum (config.fused_sum)")
        plan.run_split_n(call, dom)
    else:
        plan.run_whole(call)
    return out


def fused_moe(
    *op_args,
    pdl: bool = False,
    placement: str = "",
    config: Optional[MoEConfig] = None,
    out: Optional[torch.Tensor] = None,
    domains: Optional[locality.Domains] = None,
    **op_kwargs,
) -> torch.Tensor:
    """``run`` called like the op: its data arguments (positionally or by name, as ``MoEArgs`` takes them),
    ``pdl`` and ``placement`` as the op's strings; ``config`` / ``out`` / ``domains`` as in ``run``. The
    benchmarks, the tuner and the GPU tests call the kernels this way."""
    return run(MoEArgs(*op_args, **op_kwargs), Launch.decode(pdl, placement), config=config, out=out, domains=domains)
