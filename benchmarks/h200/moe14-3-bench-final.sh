#!/usr/bin/env bash
# Issue 14, GPU step 3 of 3: with step 2's tuned table
# committed, benchmarks/moe.py (bf16; ours, vLLM's fused_moe, the ATen form) writes the prefill table and merges its
# times into this GPU's selection table, which is then put in the tree (the commit after this run holds it as
# measured), and the choice's timed test and the whole GPU suite run on it.
# carry [".whl", ".vllm-src"].   [SUITE=0] bash benchmarks/h200/moe14-3-bench-final.sh
. "$(dirname "$0")/common.sh"
export RUBIN_VLLM_SRC=$PWD/.vllm-src
cat .vllm-src/VERSION
TABLE=$(moe_table_file)
[ -f "rubin_compile/kernels/triton/moe_baselines/$TABLE" ] && cp "rubin_compile/kernels/triton/moe_baselines/$TABLE" "$OUT/"
{ time timeout 180 python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b \
  --tokens 1,64,256,1024,4096 --formats bf16 --baselines grouped_mm,vllm --reps 10 --vllm-src .vllm-src \
  --out "$OUT" --tag=-prefill --write-baselines "$OUT/$TABLE" ; } > "$OUT/moe-prefill.log" 2>&1
echo "benchmark exit $?"; grep -E "T=|merged|Error|Traceback|^real" "$OUT/moe-prefill.log" | cut -c1-220
[ -f "$OUT/moe-prefill-$SLUG-prefill.md" ] && cat "$OUT/moe-prefill-$SLUG-prefill.md"
cp "$OUT/$TABLE" rubin_compile/kernels/triton/moe_baselines/
# the benchmark's outputs archived now, so that a call cut short still returns them
archive_out bench.tgz 'moe-*'
{ time timeout 90 python3 -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_moe_choice_gpu.py ; } > "$OUT/pytest-choice.log" 2>&1
echo "pytest choice exit $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^real" "$OUT/pytest-choice.log" | cut -c1-300 | tail -12
[ "${SUITE:-1}" = 0 ] && { archive_out results.tgz; exit 0; }  # SUITE=0: the suite runs in a call of its own
{ time timeout 260 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu --ignore tests/gpu/test_moe_choice_gpu.py ; } \
  > "$OUT/pytest-gpu.log" 2>&1
echo "pytest gpu exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-gpu.log" | cut -c1-300 | tail -30
archive_out results.tgz
