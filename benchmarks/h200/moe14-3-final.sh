#!/usr/bin/env bash
# Issue 14, GPU step 3 of 3: the whole GPU suite at the commit submitted (the tables of steps 1 and 2 committed), the
# choice's timed test alone on the GPU first (it times kernels; -n would share the GPU).
# carry [".whl", ".vllm-src"].   bash benchmarks/h200/moe14-3-final.sh
. "$(dirname "$0")/common.sh"
export RUBIN_VLLM_SRC=$PWD/.vllm-src
{ time timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_moe_choice_gpu.py ; } > "$OUT/pytest-choice.log" 2>&1
echo "pytest choice exit $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^real" "$OUT/pytest-choice.log" | cut -c1-300 | tail -12
{ time timeout 380 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu --ignore tests/gpu/test_moe_choice_gpu.py ; } \
  > "$OUT/pytest-gpu.log" 2>&1
echo "pytest gpu exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-gpu.log" | cut -c1-300 | tail -30
# at most 8 files come back from $OUT: everything in one archive
(cd "$OUT" && tar czf /tmp/results.tgz . && find . -mindepth 1 -delete && mv /tmp/results.tgz .)
