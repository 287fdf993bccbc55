#!/usr/bin/env bash
# Issue 12, H200 step 1: the GEMM's GPU tests, a probe of the benchmark (3 shapes, M = 1 / 16, Inductor at M = 1
# to see what its max-autotune compile costs) and of the tuner on one shape.
#   bash benchmarks/h200/gemm-1-tests-and-probe.sh
. "$(dirname "$0")/common.sh"
timeout 240 python3 -m pytest tests/gpu/test_triton_gemm.py -q -x -p no:cacheprovider -k "not fused" 2>&1 | tail -25
timeout 200 python3 benchmarks/gemm.py --shapes qwen3-30b-a3b.qkv,llama-3.1-8b.o,qwen3-30b-a3b.router \
    --ms 1,16 --formats bf16,fp8_block --inductor-ms 1 --out "$OUT/probe" 2>&1 | grep -v -i warn | tail -30
timeout 150 python3 -m rubin_compile.kernels.triton.tune_gemm --shapes qwen3-30b-a3b.qkv --ms 1,16 --formats bf16 \
    --out "$OUT/tbl" 2>&1 | grep -v -i warn | tail -12
