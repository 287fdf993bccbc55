"""Triton's interpreter made to round as the GPU does, for the kernel tests that run kernels on the CPU
(``TRITON_INTERPRET=1``, in a subprocess of their own)."""

from __future__ import annotations

import torch


def gpu_rounding() -> None:
    """float32 -> e4m3 and -> bf16 in the interpreter as the GPU does it (round to nearest even, as torch does).

    Triton 3.9's interpreter (``interpreter._convert_float``) rounds half up and drops the carry when a
    mantissa rounds up into the next binade (-31.98 becomes -16, not -32): up to 2x off on a few activations. The
    same happens to float32 -> bf16 (a bf16 case of the GEMV form was 1e-2 off the emulated roundings before this,
    0 after). The kernel tests check FP8 activation paths and bf16 roundings, so the cast the GPU's
    cvt.rn(.satfinite) does is what the interpreter must do too. Other conversions are left to Triton."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    ours = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.uint16)}

    def convert_rne(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype in ours and input_dtype == tl.float32:
            to, bits = ours[output_dtype]
            src = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return src.to(to).view(bits).numpy().reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_rne
