"""FP4 weights as the canonical ops take them: NVFP4 and MXFP4, packed two e2m1 values per byte.

Both formats store each weight as an e2m1 value (sign, 2 exponent bits, 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3,
4, 6}) times a scale per block of consecutive elements along the reduction dimension:

* **NVFP4** (ModelOpt's ``nvfp4``, NVIDIA's Blackwell / Rubin format): blocks of 16, the block scale in
  ``float8_e4m3fn``, and one float32 global scale per tensor (per expert for MoE weights; ModelOpt's
  ``weight_scale_2``): ``w = e2m1 * float(block_scale) * scale_2``.
* **MXFP4** (OCP microscaling, GPT-OSS checkpoints): blocks of 32, the block scale an E8M0 exponent in a
  ``uint8`` byte ``s`` (``2 ** (s - 127)``); no global scale.

Packing: ``torch.uint8``, element ``2j`` in the low nibble and ``2j + 1`` in the high nibble of byte ``j`` (the
ModelOpt / FlashInfer ``fp4_quantize`` convention), packed along the reduction dimension, the block scales
row-major and linear (one row of scales per weight row; no swizzle: a kernel that wants its scale factors
swizzled or its weights shuffled prepares them once, kernels/flashinfer/). ``torch.float4_e2m1fn_x2`` is not
used: torch implements almost no op on it, and the checkpoints and FlashInfer both hand FP4 around as uint8.

The quantisers below serve the examples and the tests (they make FP4 weights out of bf16 ones as ModelOpt
does: global scale from the tensor's absolute maximum, block scales rounded to their format, values rounded
to the nearest e2m1); the semantics is ``dequantize``.
"""

from __future__ import annotations

from typing import Optional

import torch

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; code | 8 is the negative value


def block_size(kind: str) -> int:
    return NVFP4_BLOCK if kind == "nvfp4" else MXFP4_BLOCK


def scale_dtype(kind: str) -> torch.dtype:
    return torch.float8_e4m3fn if kind == "nvfp4" else torch.uint8


def kind_of(scale: Optional[torch.Tensor]) -> Optional[str]:
    """``"nvfp4"`` for e4m3 block scales, ``"mxfp4"`` for uint8 (E8M0) ones, ``None`` for anything else."""
    if scale is None:
        return None
    return {torch.float8_e4m3fn: "nvfp4", torch.uint8: "mxfp4"}.get(scale.dtype)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (integers 0-15) -> their float32 values: sign bit 3, exponent bits 2-1, mantissa bit 0; exponent 0
    is subnormal (0 or 0.5). Arithmetic rather than a table lookup, so that a graph tracing it holds no tensor
    constant (select_kernels traces the ops' ATen forms into the graph)."""
    c = codes.to(torch.int32)
    exponent = ((c >> 1) & 3).to(torch.float32)
    mantissa = (c & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent - 1) * (1 + 0.5 * mantissa))
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K / 2]`` -> float32 ``[..., K]``: the e2m1 values, unscaled."""
    low, high = decode(packed & 0x0F), decode(packed >> 4)
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def block_scales(scale: torch.Tensor, kind: str) -> torch.Tensor:
    """The block scales as float32 values (E8M0 bytes decoded)."""
    if kind == "mxfp4":
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    scale_2: Optional[torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Packed FP4 ``[..., K / 2]`` with block scales ``[..., K / block]`` (and, NVFP4, a global ``scale_2``
    broadcasting over the leading dims: ``[]`` or ``[E]`` for ``[E, N, K / 2]`` weights) -> ``[..., K]`` in
    ``dtype``; computed in float32, rounded once."""
    kind = kind_of(scale)
    if kind is None:
        raise ValueError(f"FP4 block scales must be float8_e4m3fn (NVFP4) or uint8 (MXFP4), got {scale.dtype}")
    values = unpack(packed)
    s = block_scales(scale, kind).repeat_interleave(block_size(kind), dim=-1)[..., : values.shape[-1]]
    w = values * s
    if scale_2 is not None:
        g = scale_2.to(torch.float32)
        w = w * g.reshape(g.shape + (1,) * (w.dim() - g.dim()))
    return w.to(dtype)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 values already scaled into [-6, 6] -> their nearest e2m1 codes (uint8, 0-15), ties to the
    even code (the one with a zero mantissa bit), as round-to-nearest-even conversion hardware does."""
    mag = x.abs().clamp(max=E2M1_MAX)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    dist = (mag.unsqueeze(-1) - values).abs()
    # ties: prefer the even code; a tiny bias on odd codes breaks them that way
    dist = dist + torch.tensor([0.0, 1e-7] * 4, device=x.device)
    code = dist.argmin(dim=-1).to(torch.uint8)
    return code | ((x < 0) & (code != 0)).to(torch.uint8) << 3


def pack(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes ``[..., K]`` (uint8, K even) -> packed ``[..., K / 2]``."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def quantize(
    w: torch.Tensor, kind: str, per_leading_dim: bool = False, scale_2: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``w`` ``[..., K]`` (K a multiple of the block) -> ``(packed, block_scales, scale_2)`` in ``kind``.

    NVFP4: ``scale_2 = amax / (448 * 6)`` over the tensor (over each ``w[e]`` with ``per_leading_dim``: the
    per-expert global scales of a MoE), block scales ``block_amax / 6 / scale_2`` rounded to e4m3. MXFP4:
    ``scale_2`` is ``None``, block scales the power of two ``2 ** ceil(log2(block_amax / 6))`` as E8M0. A given NVFP4
    ``scale_2`` is used as the global scale (and returned) instead of the tensor's own: one global scale shared by
    weights that are stacked together, such as an expert's gate and up projections."""
    if kind not in ("nvfp4", "mxfp4"):
        raise ValueError(f"kind must be 'nvfp4' or 'mxfp4', got {kind!r}")
    block = block_size(kind)
    K = w.shape[-1]
    if K % block:
        raise ValueError(f"{kind}: the reduction dim ({K}) must be a multiple of {block}")
    wf = w.to(torch.float32)
    blocks = wf.reshape(*w.shape[:-1], K // block, block)
    amax = blocks.abs().amax(dim=-1)  # [..., K / block]
    if kind == "nvfp4" and scale_2 is None:
        if per_leading_dim:
            g = wf.abs().reshape(w.shape[0], -1).amax(dim=1) / (E4M3_MAX * E2M1_MAX)
        else:
            g = wf.abs().amax() / (E4M3_MAX * E2M1_MAX)
        scale_2 = torch.where(g > 0, g, torch.ones_like(g)).to(torch.float32)
    if kind == "nvfp4":
        g_b = scale_2.to(torch.float32).reshape(scale_2.shape + (1,) * (amax.dim() - scale_2.dim()))
        scale = (amax / E2M1_MAX / g_b).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        s = scale.to(torch.float32) * g_b
    else:
        scale_2 = None
        exponent = torch.ceil(torch.log2((amax / E2M1_MAX).clamp(min=2.0**-127))).clamp(-127, 127)
        scale = (exponent + 127).to(torch.uint8)
        s = torch.exp2(exponent)
    scaled = blocks / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    codes = _round_e2m1(scaled).reshape(w.shape)
    return pack(codes), scale, scale_2
