#!/usr/bin/env bash
# Issue 12 (third session), H200 step 2, with the stream-K retune committed: benchmarks/gemm.py over every shape,
# bf16, M = 1..16 (Inductor's max-autotune not re-timed: its times stay in the table from earlier runs), then the
# decode step of 8 Qwen3-30B-A3B layers at 4k (one CUDA graph) with the table before the retune and after, Inductor
# beside them, profiled.
#   bash benchmarks/h200/gemm-12-benchmark-step.sh
. "$(dirname "$0")/common.sh"
R=benchmarks/results/gemm-h200-2026-12-02
timeout 200 python3 benchmarks/gemm.py --formats bf16 --ms 1,2,4,8,16 --inductor-ms "" --commit "${COMMIT:-?}" --out "$OUT/gemm" \
    > "$OUT/gemm.log" 2>&1
echo "benchmark exit $?"
grep -v -i warn "$OUT/gemm.log" | sed -n '/## Goals/,/## All rows/p' | head -30
export RUBIN_GEMM_TABLE_BEFORE=$R/table-before.json
timeout 300 python3 benchmarks/generate.py --contexts "" --step-contexts 4096 --new-tokens 128 \
    --step-variants inductor,rubin-gemm-table-before,rubin --profile-variants rubin-gemm-table-before,rubin \
    --out "$OUT/step" > "$OUT/step.log" 2>&1
echo "step exit $?"
grep -v '^{' "$OUT/step.log" | grep -iv "warn" | grep "^|\|^kernel\|^Per-\|Error" | tail -40
