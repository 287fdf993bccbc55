"""Issue 13 (routing <= 3 us): the top-k kernel of kernels/triton/route.py is most of the routing's time
(benchmarks/route_profile.py on the H100, 2026-12-06: DeepSeek-V3 T = 1, 5.9 us of 9.1; Qwen3 2.5 of 3.4). Its PTX
(Triton 3.6, one warp) is a chain of k argmax rounds over int64 (value, id) keys: 2018 instructions for
DeepSeek-V3. This probe times ways of choosing the k largest of E float32 values (ties to the lower id) in one
program, alone in a kernel, against a one-store kernel (the launch floor):

- ``rounds64``: k rounds of one int64 max over [8, E / 8] keys (route.py's way until this probe);
- ``rounds32``: k rounds of an int32 max of the order-preserving bits, then an int32 min of the ids holding it;
- ``pair64``: k / 2 rounds of one reduction that keeps the two largest keys;
- ``bitonic64``: ``tl.topk`` (Triton's bitonic top-k) of the int64 keys;

each with 1 and 4 warps, E = 256 (DeepSeek-V3) and 128 (Qwen3-30B-A3B), k = 8. us per launch: 16 launches in one
CUDA graph, median of 30 replays; every variant's ids are checked against torch.topk's on tie-free data.

    PYTHONPATH=. python benchmarks/h200/route_topk_probe.py
"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from route import CALLS, graph_us  # noqa: E402

DEAD64 = -(2**63)
DEAD32 = -(2**31)


@triton.jit
def _key64(v, ids, BIG: tl.constexpr):
    bits = tl.where(v == 0.0, 0, v.to(tl.int32, bitcast=True))
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered.to(tl.int64) * 4294967296 + (BIG - ids).to(tl.int64)


@triton.jit
def _ordered32(v):
    bits = tl.where(v == 0.0, 0, v.to(tl.int32, bitcast=True))
    return tl.maximum(tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), -(2**31) + 1)  # DEAD32 stays unique


@triton.jit
def _top2(a1, a2, b1, b2):
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))


@triton.jit
def _store(o_ptr, kk, ids, K: tl.constexpr):
    tl.store(o_ptr + kk, ids, mask=kk < K)


@triton.jit
def rounds64(v_ptr, o_ptr, E: tl.constexpr, K: tl.constexpr):
    GS: tl.constexpr = E // 8
    BIG: tl.constexpr = 2 * E
    flat = tl.arange(0, 8)[:, None] * GS + tl.arange(0, GS)[None, :]
    key = _key64(tl.load(v_ptr + flat), flat, BIG)
    kk = tl.arange(0, K)
    ids = tl.zeros((K,), tl.int32)
    for i in tl.static_range(K):
        m = tl.max(tl.max(key, axis=1), axis=0)
        idx = (BIG - (m & 4294967295)).to(tl.int32)
        ids = tl.where(kk == i, idx, ids)
        key = tl.where(flat == idx, -(2**63), key)
    _store(o_ptr, kk, ids, K)


@triton.jit
def rounds32(v_ptr, o_ptr, E: tl.constexpr, K: tl.constexpr):
    GS: tl.constexpr = E // 8
    flat = tl.arange(0, 8)[:, None] * GS + tl.arange(0, GS)[None, :]
    key = _ordered32(tl.load(v_ptr + flat))
    kk = tl.arange(0, K)
    ids = tl.zeros((K,), tl.int32)
    for i in tl.static_range(K):
        m = tl.max(tl.max(key, axis=1), axis=0)
        idx = tl.min(tl.min(tl.where(key == m, flat, E), axis=1), axis=0)
        ids = tl.where(kk == i, idx, ids)
        key = tl.where(flat == idx, -(2**31), key)
    _store(o_ptr, kk, ids, K)


@triton.jit
def pair64(v_ptr, o_ptr, E: tl.constexpr, K: tl.constexpr):
    GS: tl.constexpr = E // 8
    BIG: tl.constexpr = 2 * E
    flat = tl.arange(0, 8)[:, None] * GS + tl.arange(0, GS)[None, :]
    key = _key64(tl.load(v_ptr + flat), flat, BIG)
    kk = tl.arange(0, K)
    ids = tl.zeros((K,), tl.int32)
    for i in tl.static_range(K // 2):
        dead = tl.full(key.shape, -(2**63), tl.int64)
        r1, r2 = tl.reduce((key, dead), 1, _top2)
        m1, m2 = tl.reduce((r1, r2), 0, _top2)
        i1 = (BIG - (m1 & 4294967295)).to(tl.int32)
        i2 = (BIG - (m2 & 4294967295)).to(tl.int32)
        ids = tl.where(kk == 2 * i, i1, tl.where(kk == 2 * i + 1, i2, ids))
        key = tl.where((flat == i1) | (flat == i2), -(2**63), key)
    _store(o_ptr, kk, ids, K)


@triton.jit
def bitonic64(v_ptr, o_ptr, E: tl.constexpr, K: tl.constexpr):
    BIG: tl.constexpr = 2 * E
    offs = tl.arange(0, E)
    key = _key64(tl.load(v_ptr + offs), offs, BIG)
    top = tl.topk(key, K)
    _store(o_ptr, tl.arange(0, K), (BIG - (top & 4294967295)).to(tl.int32), K)


@triton.jit
def one_store(v_ptr, o_ptr, E: tl.constexpr, K: tl.constexpr):
    tl.store(o_ptr, tl.load(v_ptr).to(tl.int32))


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}")
    K = 8
    print("| variant | warps | E | us per launch | minus the one-store kernel | ids equal torch.topk's |")
    print("|---|---|---|---|---|---|")
    for E in (256, 128):
        vals = [torch.rand(E, device="cuda") for _ in range(CALLS)]  # distinct with probability ~1
        outs = [torch.empty(K, device="cuda", dtype=torch.int32) for _ in range(CALLS)]
        floor = graph_us([lambda v=v, o=o: one_store[(1,)](v, o, E=E, K=K, num_warps=1) for v, o in zip(vals, outs)])
        print(f"| one_store | 1 | {E} | {floor:.2f} | - | - |", flush=True)
        for fn in (rounds64, rounds32, pair64, bitonic64):
            for nw in (1, 4):
                try:
                    us = graph_us([lambda v=v, o=o: fn[(1,)](v, o, E=E, K=K, num_warps=nw) for v, o in zip(vals, outs)])
                    torch.cuda.synchronize()
                    ok = all(torch.equal(o.long(), torch.topk(v, K).indices) for v, o in zip(vals, outs))
                    print(f"| {fn.fn.__name__} | {nw} | {E} | {us:.2f} | {us - floor:.2f} | {ok} |", flush=True)
                except Exception as exc:  # a variant that does not compile: reported, the others go on
                    print(f"| {fn.fn.__name__} | {nw} | {E} | {type(exc).__name__}: {str(exc)[:80]} | - | - |")


if __name__ == "__main__":
    main()
