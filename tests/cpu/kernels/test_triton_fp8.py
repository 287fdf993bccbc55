"""kernels/triton/fp8.py compiled for sm_90 on the CPU: the activations' e4m3 kernel moves its rows in 16-byte
vectors (numerics: the interpreter cases of test_triton_moe_config.py, against the emulated e4m3 computation)."""

from __future__ import annotations

import re
import sys

import pytest

from tests.cpu.kernels.triton_aot import compile_like_a_launch


@pytest.fixture(scope="module")
def fp8():
    from tests.cpu.kernels.triton_aot import load_plain

    yield load_plain("fp8", "rubin_fp8_aot")
    del sys.modules["rubin_fp8_aot"]


@pytest.mark.parametrize("H", [2048, 7168])
def test_quant_rows_moves_rows_in_16_byte_vectors(fp8, H):
    """quant_rows_kernel at a hidden size that is a multiple of 16 (every model's): the bf16 rows are loaded and the e4m3
    rows stored 16 bytes per instruction. With ``H`` unspecialised (as it was) Triton cannot tell that a 16-element
    run shares its mask, and moved every element alone -- 16 two-byte loads and 16 one-byte stores a thread: on the
    H100 the kernel ran at 25-30% of the copy bandwidth (DeepSeek-V3 TP8 at T = 4096: 101 us against about 29;
    benchmarks/results/moe-h100-2026-12-05-s7/)."""
    ptx = compile_like_a_launch(
        fp8.quant_rows_kernel,
        dict(G=128, NG=16, GDC=True),
        dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", tick_ptr="*i32"),
        dict(n_tick=0, H=H, stride_xt=H, stride_xh=1, stride_qt=H, stride_st=H // 128),
    )
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "bf16 rows not loaded in 16-byte vectors"
    assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "e4m3 rows not stored in 16-byte vectors"
    assert not re.search(r"ld\.global(\.\w+)*\.b16\b", ptx), "a bf16 element loaded alone"
    assert not re.search(r"st\.global(\.\w+)*\.b8\b", ptx), "an e4m3 element stored alone"
