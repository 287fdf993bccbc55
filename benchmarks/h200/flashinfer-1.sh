#!/usr/bin/env bash
# Issue 15, H200 step 1: FlashInfer 0.7.2.post1 from the carried bundle (../shared/tools/flashinfer-bundle .devcache)
# and the cuDNN frontend wheel beside it (.devcache/nvidia_cudnn_frontend-*.whl); the FlashInfer GPU tests, then
# benchmarks/flashinfer_kernels.py. FlashInfer's JIT output goes to .ficache (kept while the machine stays warm).
#   bash benchmarks/h200/flashinfer-1.sh            (run with carry [".devcache"])
. "$(dirname "$0")/flashinfer-common.sh"
python3 -c "
import torch, triton, flashinfer
print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)
try:
    import cudnn; print('cudnn frontend', cudnn.__version__, 'backend', cudnn.backend_version())
except Exception as e: print('cudnn frontend:', type(e).__name__, e)
"
TESTS="tests/gpu/test_flashinfer_gemm.py tests/gpu/test_flashinfer_attention.py tests/gpu/test_flashinfer_moe.py"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest $TESTS -q -p no:cacheprovider -n 4 -rfEs > "$OUT/flashinfer-h200.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|ERROR|passed|failed|crashed" "$OUT/flashinfer-h200.log" | tail -40
# a kernel that aborted its test worker (a crash, not a failure) is left out of the benchmark, which it would kill
SKIP=$(grep -o "crashed while running '[^']*flashinfer_[a-z0-9]*" "$OUT/flashinfer-h200.log" | grep -o "flashinfer_[a-z0-9]*$" | sort -u | paste -sd, -)
echo "benchmark skips: ${SKIP:-none}"
timeout ${BENCH_TIMEOUT:-250} python3 benchmarks/flashinfer_kernels.py --out "$OUT" --skip "$SKIP" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "benchmark exit $?"; tail -5 "$OUT/bench.log"; cat "$OUT/flashinfer-$SLUG.md" 2>/dev/null | head -150
