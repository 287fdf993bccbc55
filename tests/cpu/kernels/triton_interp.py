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


def run_file(path, timeout: int = 900):
    """The JSON a kernel test file prints on its last line when run as a script under the interpreter: Triton must
    see TRITON_INTERPRET=1 before it is first imported, so the kernels run in a subprocess of their own (with this
    checkout on its path); its output tails are in the failure message when it exits non-zero."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, cwd=root, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def triton_version() -> tuple[int, ...]:
    """(major, minor) of the installed Triton; (0,) without one."""
    import importlib.util
    from importlib.metadata import version

    if importlib.util.find_spec("triton") is None:
        return (0,)
    return tuple(int(p) for p in version("triton").split(".")[:2])
