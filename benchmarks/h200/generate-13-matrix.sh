#!/usr/bin/env bash
# Issue 16, fourth session, H200 step 2: the host time of rubin's ops without CUDA graphs (model.forward compiled,
# cProfile per backend), then generate() at 512 / 4k, batch 1 / 8, 128 new tokens, Inductor against rubin.
#   bash benchmarks/h200/generate-13-matrix.sh
. "$(dirname "$0")/common.sh"
timeout 200 python3 benchmarks/h200/generate_host_diagnose.py --context 4096 --setup forward --repeats 2 \
    --profile-out "$OUT" > "$OUT/host-forward.log" 2>&1
echo "host-forward exit $?"; grep "^|\|Error" "$OUT/host-forward.log" | tail -5
for b in inductor rubin; do echo "== $b"; sed -n 1,40p "$OUT/profile-forward-$b.txt" | cut -c1-180; done
timeout 330 python3 benchmarks/generate.py --contexts 512,4096 --batches 1,8 --variants inductor,rubin \
    --new-tokens 128 --repeats 3 --step-contexts "" --out "$OUT/gen" > "$OUT/generate.log" 2>&1
echo "generate exit $?"
grep -v "^{" "$OUT/generate.log" | grep -iv "warn" | grep "^|\|Error" | tail -12
