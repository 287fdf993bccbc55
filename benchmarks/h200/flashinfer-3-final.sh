#!/usr/bin/env bash
# Issue 15, H200 step 3 (at the commit submitted): FlashInfer carried as in step 1; the FlashInfer GPU tests, the
# end-to-end test (a model compiled with rubin runs FA3 and DeepGEMM where its plan chose them) and the GPU tests of
# the compiled-model paths those choices touch.
#   bash benchmarks/h200/flashinfer-3-final.sh      (run with carry [".devcache"])
. "$(dirname "$0")/flashinfer-common.sh"
TESTS="tests/gpu/test_flashinfer_end_to_end.py tests/gpu/test_flashinfer_attention.py tests/gpu/test_flashinfer_gemm.py
 tests/gpu/test_flashinfer_moe.py tests/gpu/test_end_to_end_gpu.py tests/gpu/test_select_kernels_gpu.py"
timeout ${TEST_TIMEOUT:-330} python3 -m pytest $TESTS -q -p no:cacheprovider -n 6 -rfE > "$OUT/flashinfer-h200-final.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|ERROR|passed|failed|crashed" "$OUT/flashinfer-h200-final.log" | tail -30
