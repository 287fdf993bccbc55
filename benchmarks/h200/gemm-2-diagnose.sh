#!/usr/bin/env bash
# Issue 12, H200 step 2: the GPU tests again (fixed test), then benchmarks/h200/gemm_diagnose.py.
. "$(dirname "$0")/common.sh"
timeout 150 python3 -m pytest tests/gpu/test_triton_gemm.py -q -x -p no:cacheprovider -k "not fused and not compiled" 2>&1 | tail -4
timeout 400 python3 benchmarks/h200/gemm_diagnose.py 2>&1 | grep -v -i warn
