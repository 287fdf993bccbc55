#!/usr/bin/env bash
# Issue 15, H200 step 2 (at the commit submitted): FlashInfer carried as in step 1, then the FlashInfer GPU tests and
# the whole GPU suite (with FlashInfer present, so the plans may choose its kernels).
#   bash benchmarks/h200/flashinfer-2-suite.sh      (run with carry [".devcache"])
. "$(dirname "$0")/flashinfer-common.sh"
timeout 420 python3 -m pytest tests/gpu -q -p no:cacheprovider -n 8 -rfE > "$OUT/flashinfer-h200.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|ERROR|passed|failed|crashed" "$OUT/flashinfer-h200.log" | tail -40
