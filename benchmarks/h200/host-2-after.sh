#!/usr/bin/env bash
# Issue 16, fifth session, H200 step 2: with the bound-binary launcher (kernels/triton/launch.py): the GPU suite, the
# host cost of the decode ops again, and generate() with model.forward compiled (no CUDA graphs) per backend.
#   bash benchmarks/h200/host-2-after.sh
. "$(dirname "$0")/common.sh"
( time timeout 420 python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider -rfE ) > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pytest-gpu.log" | tail -12
timeout 300 python3 benchmarks/host_cost.py --out "$OUT" --label after > "$OUT/host-cost.log" 2>&1
echo "host_cost exit $?"; grep -v '^{' "$OUT/host-cost.log" | tail -16
timeout 420 python3 benchmarks/h200/generate_host_diagnose.py --context 4096 --setup forward --repeats 2 \
    --profile-out "$OUT" > "$OUT/host-forward.log" 2>&1
echo "host-forward exit $?"; grep "^|\|Error" "$OUT/host-forward.log" | tail -5
for b in inductor rubin; do echo "== $b"; sed -n 1,22p "$OUT/profile-forward-$b.txt" | cut -c1-150; done
