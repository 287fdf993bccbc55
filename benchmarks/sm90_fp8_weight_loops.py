"""How many instructions a K loop spends per FP8 weight element on sm_90, read from ahead-of-time compiles (no GPU).

Weight-only FP8 at decode sizes (M <= 16) streams e4m3 weights and is, by its bytes, twice as fast as bf16; the
H200 measured our FP8 block GEMMs at 1.25x our bf16 at M = 1 (docs/kernels/gemm.md), with the GEMV form winning
every shape. This counts, per weight element, the PTX instructions of one K step (a thread's loop body x the
threads, over the tile's weight elements) for:

* gemm.py's GEMV form (the tuned FP8 winner at M = 1): each e4m3 pair to fp16 (``cvt.rn.f16x2.e4m3x2``), each
  element to fp32, a fp32 multiply-add per element per row;
* a plain MMA probe, activations [16, K] x weights^T, the weights converted to bf16 -- on sm_90 e4m3 reaches bf16
  through fp16, a ``cvt.bf16.f16`` per element after the pair conversion --, or to fp16 (exact, the pair
  conversion only; the activations then go to fp16, exact only inside fp16's range);
* a swapped MMA probe, weights [BN, K] as the register operand of wgmma (``m64n16k16``) against the activations'
  transpose, fp16.

    PYTHONPATH=. python benchmarks/sm90_fp8_weight_loops.py        # with the Triton to read (3.6 for the H200)

What it printed on 2026-12-05 (Triton 3.6; 3.9 alike but the swapped form, 3.3 / 2.7), instructions per weight
element: gemm.py's GEMV form 6.3 (n16 k512) / 8.2 (n16 k128, block scales); gemm.py's MMA form (BLOCK_M 16)
4.5 / 4.0 at n64 / n128 k128, 5.0 with block scales; plain bf16 probe 4.4 / 3.9 (64 / 128 x 128);
plain fp16 3.9 / 2.7; swapped fp16 2.9 / 2.2. The count alone does not pick the winner: gemm.py's MMA form counts
fewer instructions than its GEMV form, and the GEMV form won every FP8 shape at M = 1 on the H200 (the MMA form's
loop also holds shared-memory round trips, barriers and a 16-row MMA for one row). So the swapped fp16 form is a
lead, not a prediction. Tried in gemm.py's kernel the same day, with the activations' fp16 guard (a power of two
per row and K tile, exact): 5-26% fewer instructions than its MMA form (docs/kernels/gemm.md), not landed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def probe(w_ptr, x_ptr, o_ptr, N, K, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, FORM: tl.constexpr):
    """out = x [BM, K] . w^T, w [N, K] e4m3. FORM 0: plain, bf16; 1: plain, fp16; 2: swapped, fp16."""
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    if FORM == 2:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=4):
        w = tl.load(w_ptr + rn[:, None] * K + k0 + rk[None, :])
        x = tl.load(x_ptr + rm[:, None] * K + k0 + rk[None, :])
        if FORM == 0:
            acc = tl.dot(x, w.to(tl.bfloat16).T, acc)
        elif FORM == 1:
            acc = tl.dot(x.to(tl.float16), w.to(tl.float16).T, acc)
        else:
            acc = tl.dot(w.to(tl.float16), x.to(tl.float16).T, acc)
    if FORM == 2:
        tl.store(o_ptr + rm[None, :] * N + rn[:, None], acc.to(tl.bfloat16))
    else:
        tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def per_element(loop: list[str], threads: int, elements: int) -> float:
    """Instructions of a loop body (labels, directives and comments aside) per weight element of its tile."""
    return sum(1 for line in loop if re.match(r"\s*(@%p\d+\s+)?[a-z]", line)) * threads / elements


def main() -> None:
    from tests.cpu.kernels import test_triton_gemm as tg
    from tests.cpu.kernels import triton_aot as aot

    print(f"Triton {triton.__version__}, sm_90, instructions per weight element of one K step")
    gemv, mma = dict(MMA=False, GEMV=True, BLOCK_M=1), dict(MMA=True, GEMV=False, BLOCK_M=16)
    for name, form in (
        ("GEMV", dict(gemv, BLOCK_N=16, BLOCK_K=512)),
        ("GEMV", dict(gemv, BLOCK_N=16, BLOCK_K=128, B_SCALE=3)),  # 128 x 128 block scales
        ("MMA", dict(mma, BLOCK_N=64, BLOCK_K=128)),
        ("MMA", dict(mma, BLOCK_N=128, BLOCK_K=128)),
        ("MMA", dict(mma, BLOCK_N=64, BLOCK_K=128, B_SCALE=3)),
    ):
        ptx = tg._ptx(aot, ESIZE=1, **form)
        loop = max((b for b in aot.loop_bodies(ptx) if name == "GEMV" or any("mma" in ln for ln in b)), key=len)
        scales = ", block scales" if form.get("B_SCALE") else ""
        print(f"gemm.py {name} form, n{form['BLOCK_N']} k{form['BLOCK_K']}{scales}: "
              f"{per_element(loop, 128, form['BLOCK_N'] * form['BLOCK_K']):.2f}")  # fmt: skip
    sig = dict(w_ptr="*fp8e4nv", x_ptr="*bf16", o_ptr="*bf16", N="i32", K="i32")
    sig.update(BN="constexpr", BM="constexpr", BK="constexpr", FORM="constexpr")
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}  # pointers 16-byte aligned, N and K multiples of 16
    for form, name in ((0, "plain MMA, bf16"), (1, "plain MMA, fp16"), (2, "swapped MMA, fp16")):
        for bn in (64, 128):
            src = ASTSource(probe, sig, constexprs=dict(BN=bn, BM=16, BK=128, FORM=form), attrs=aligned)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
            loops = [b for b in aot.loop_bodies(ptx.asm["ptx"]) if any("mma" in line for line in b)]
            print(f"{name}, {bn} x 128: {per_element(max(loops, key=len), 128, bn * 128):.2f}")


if __name__ == "__main__":
    main()
