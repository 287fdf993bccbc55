"""``torch.ops.rubin.dequantize``: a quantised weight as a model written in plain PyTorch holds it.

A checkpoint quantised to FP8 or FP4 keeps each weight as its quantised values and their scales (ModelOpt's
``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale``; DeepSeek's ``weight_scale_inv``). A model that
runs on any device dequantises it in its forward and multiplies in bf16; that is what this op computes. Written
so, the graph says what the weight is: match_gemm and match_moe (the expert loop) fold a ``rubin.dequantize``
that feeds a linear layer into ``rubin.gemm`` / ``rubin.moe`` with the quantised weight and its scales, and the
kernel chosen for the target then reads the quantised weight (FlashInfer's FP8 / NVFP4 / MXFP4 kernels, our
FP8 Triton kernels) instead of a dequantised copy. Unmatched, it runs as written (the dequantise, then the
product), so the result is the same either way up to the kernel's stated tolerance.

Schema::

    rubin::dequantize(Tensor weight,            # [N, K] FP8 e4m3, or uint8 [N, K / 2] FP4 (ops/fp4.py)
                      Tensor scale,             # fp8_tensor: []; fp8_block: [ceil(N/128), ceil(K/128)];
                                                # nvfp4: e4m3 [N, K / 16]; mxfp4: uint8 E8M0 [N, K / 32]
                      Tensor? scale_2=None,     # nvfp4 only: the float32 global scale []
                      Tensor? input_scale=None, # optional: the static scale of this layer's input, float32 []
                      str format="nvfp4",       # "fp8_tensor" | "fp8_block" | "nvfp4" | "mxfp4"
                      ScalarType dtype=bfloat16)
      -> Tensor                                 # [N, K] in dtype

``input_scale`` changes nothing here (the product runs in ``dtype``); it is carried so that a kernel that
quantises activations with static scales (W8A8 / W4A4) gets the checkpoint's.
"""

from __future__ import annotations

from typing import Optional

import torch

from rubin_compile.errors import RubinError
from rubin_compile.ops import fp4
from rubin_compile.ops.library import op

FORMATS = ("fp8_tensor", "fp8_block", "nvfp4", "mxfp4")
FP8_BLOCK = 128


class DequantizeArgumentError(RubinError, ValueError):
    """Raised when the arguments of ``rubin.dequantize`` do not describe a quantised weight."""


def _fail(msg: str) -> None:
    raise DequantizeArgumentError(f"rubin.dequantize: {msg}")


def validate(
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_2: Optional[torch.Tensor],
    input_scale: Optional[torch.Tensor],
    format: str,
) -> tuple[int, int]:
    """(N, K) of a valid quantised weight; ``DequantizeArgumentError`` naming the problem otherwise."""
    if format not in FORMATS:
        _fail(f"format={format!r} is not one of {FORMATS}")
    if weight.dim() != 2:
        _fail(f"weight must be 2-D [N, K] (one linear layer's), got {tuple(weight.shape)}")
    N, K = weight.shape
    if format.startswith("fp8"):
        if weight.dtype != torch.float8_e4m3fn:
            _fail(f"format {format} takes a float8_e4m3fn weight, got {weight.dtype}")
        if scale.dtype != torch.float32:
            _fail(f"FP8 scales are float32, got {scale.dtype}")
        if format == "fp8_tensor" and scale.numel() != 1:
            _fail(f"fp8_tensor takes one scale, got shape {tuple(scale.shape)}")
        want = (-(-N // FP8_BLOCK), -(-K // FP8_BLOCK))
        if format == "fp8_block" and tuple(scale.shape) != want:
            _fail(f"fp8_block scales must be [ceil(N/128), ceil(K/128)] = {want}, got {tuple(scale.shape)}")
        if scale_2 is not None:
            _fail("scale_2 is NVFP4's global scale; FP8 weights have none")
    else:
        if weight.dtype != torch.uint8:
            _fail(f"format {format} takes a uint8 weight (two e2m1 values per byte), got {weight.dtype}")
        K = 2 * K
        if fp4.kind_of(scale) != format:
            want_dtype = fp4.scale_dtype(format)
            _fail(f"{format} block scales are {want_dtype}, got {scale.dtype}")
        block = fp4.block_size(format)
        if K % block or tuple(scale.shape) != (N, K // block):
            _fail(f"{format} scales must be [N, K/{block}] = {(N, K // block)} for K={K}, got {tuple(scale.shape)}")
        if (format == "nvfp4") != (scale_2 is not None):
            _fail("NVFP4 needs scale_2 (its global scale); MXFP4 takes none")
        if scale_2 is not None and (scale_2.dtype != torch.float32 or scale_2.numel() != 1):
            _fail(f"scale_2 must be one float32 element, got {scale_2.dtype} {tuple(scale_2.shape)}")
    if input_scale is not None and (input_scale.dtype != torch.float32 or input_scale.numel() != 1):
        _fail(f"input_scale must be one float32 element, got {input_scale.dtype} {tuple(input_scale.shape)}")
    return N, K


def dequantize_weight(
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_2: Optional[torch.Tensor] = None,
    format: str = "nvfp4",
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype`` (float32 arithmetic, one rounding)."""
    if format in ("nvfp4", "mxfp4"):
        return fp4.dequantize(weight, scale, scale_2, dtype)
    w = weight.to(torch.float32)
    if format == "fp8_tensor":
        return (w * scale.reshape(())).to(dtype)
    N, K = w.shape
    s = scale.repeat_interleave(FP8_BLOCK, 0)[:N].repeat_interleave(FP8_BLOCK, 1)[:, :K]
    return (w * s).to(dtype)


@op("dequantize")
def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_2: Optional[torch.Tensor] = None,
    input_scale: Optional[torch.Tensor] = None,
    format: str = "nvfp4",
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """See the module docstring."""
    validate(weight, scale, scale_2, input_scale, format)
    return dequantize_weight(weight, scale, scale_2, format, dtype)


@dequantize.register_fake
def _dequantize_fake(weight, scale, scale_2=None, input_scale=None, format="nvfp4", dtype=torch.bfloat16):
    N, K = validate(weight, scale, scale_2, input_scale, format)
    return weight.new_empty((N, K), dtype=dtype)


def quantize_weight(w: torch.Tensor, format: str, scale_2: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """A bf16 / fp32 weight ``[N, K]`` quantised to ``format`` as a checkpoint stores it: ``{"weight", "scale",
    "scale_2"?}`` (the examples and tests use it; ``scale_2`` may be given, to share one NVFP4 global scale
    between layers that ``rubin.moe`` stacks, such as an expert's gate and up projections)."""
    if format in ("nvfp4", "mxfp4"):
        packed, scale, g = fp4.quantize(w, format, scale_2=scale_2 if format == "nvfp4" else None)
        out = {"weight": packed, "scale": scale}
        if g is not None:
            out["scale_2"] = g
        return out
    wf = w.to(torch.float32)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    if format == "fp8_tensor":
        s = (wf.abs().amax() / fmax).clamp(min=1e-12)
        return {"weight": (wf / s).clamp(-fmax, fmax).to(torch.float8_e4m3fn), "scale": s.reshape(())}
    N, K = wf.shape
    pn, pk = -(-N // FP8_BLOCK) * FP8_BLOCK, -(-K // FP8_BLOCK) * FP8_BLOCK
    padded = torch.zeros(pn, pk, dtype=torch.float32, device=w.device)
    padded[:N, :K] = wf
    blocks = padded.reshape(pn // FP8_BLOCK, FP8_BLOCK, pk // FP8_BLOCK, FP8_BLOCK)
    s = (blocks.abs().amax(dim=(1, 3)) / fmax).clamp(min=1e-12)
    q = (blocks / s[:, None, :, None]).clamp(-fmax, fmax).reshape(pn, pk)[:N, :K]
    return {"weight": q.to(torch.float8_e4m3fn), "scale": s}


def shared_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """One NVFP4 global scale covering every weight given (amax / (448 * 6))."""
    amax = torch.stack([w.to(torch.float32).abs().amax() for w in weights]).amax()
    g = amax / (fp4.E4M3_MAX * fp4.E2M1_MAX)
    return torch.where(g > 0, g, torch.ones_like(g)).to(torch.float32)
