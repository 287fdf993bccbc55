#!/usr/bin/env bash
# Issue 16, fourth session, H200 step 3: the fused-projection GPU tests alone (the one that failed under -n 8 in
# step 2), then the host time of a compiled decode call without CUDA graphs (model.forward compiled, cProfile per
# backend): what rubin's ops cost on the host per call, which is also what a CUDA-graph recording runs.
#   bash benchmarks/h200/generate-15-host-forward.sh
. "$(dirname "$0")/common.sh"
timeout 120 python3 -m pytest tests/gpu/test_triton_gemm.py -q -p no:cacheprovider -k fused_projections -rfE \
    > "$OUT/pytest-fused.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|passed|failed|^E  " "$OUT/pytest-fused.log" | tail -8
timeout 300 python3 benchmarks/h200/generate_host_diagnose.py --context 4096 --setup forward --repeats 2 \
    --profile-out "$OUT" > "$OUT/host-forward.log" 2>&1
echo "host-forward exit $?"; grep "^|\|Error" "$OUT/host-forward.log" | tail -5
for b in inductor rubin; do echo "== $b"; sed -n 1,34p "$OUT/profile-forward-$b.txt" | cut -c1-170; done
