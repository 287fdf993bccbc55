#!/usr/bin/env bash
# Issue 14, FP8 prefill, the Gluon W8A8 GEMMs (one call, < 10 min): their GPU tests (values against the reference and
# the Triton kernels, PDL, graphs) with the persistent variants; then tune_moe --modes persistent for FP8 block at TOKENS (default
# 4096) on SHAPES (default Qwen3-30B-A3B, DeepSeek-V3 TP8): every W8A8 tile with and without the Gluon kernels, each
# candidate's time in tune-detail.log; then moe_profile's per-kernel split (FC1 / FC2 / sum / e4m3 quantisation) of
# that table's FP8 winners at T = 4096 (PDL off).
# carry [".whl", ".vllm-src"].   [SHAPES=...] [TOKENS=...] [TUNE_TIMEOUT=...] [TESTS="gluon or variants or joined"]
#   [PROFILE=0: no per-kernel split] bash benchmarks/h200/moe14-7-gluon.sh
. "$(dirname "$0")/common.sh"
export RUBIN_VLLM_SRC=$PWD/.vllm-src
SHAPES=${SHAPES:-qwen3-30b-a3b,deepseek-v3-tp8} TOKENS=${TOKENS:-4096}
{ time timeout 250 python3 -m pytest -q -p no:cacheprovider -rfE -n 6 tests/gpu/test_triton_moe.py \
  -k "${TESTS:-gluon or variants or joined}" ; } > "$OUT/pytest-gluon.log" 2>&1
rc=$?; echo "pytest exit $rc"; grep -E "passed|failed|FAILED|ERROR|^real" "$OUT/pytest-gluon.log" | cut -c1-300 | tail -25
# a Gluon kernel that fails (or hangs) its tests is not timed: the tuner would spend the call on it. Budget: tests
# 250 s, tuner 210 s, profile 100 s, under the call's 600 s
[ "$rc" -eq 0 ] || { echo "tests failed: no tuning"; archive_out results.tgz; exit 1; }
TABLE=$(moe_table_file)
mkdir -p "$OUT/moe_configs"
[ -f "rubin_compile/kernels/triton/moe_configs/$TABLE" ] && cp "rubin_compile/kernels/triton/moe_configs/$TABLE" "$OUT/moe_configs/"
{ time timeout "${TUNE_TIMEOUT:-210}" python3 -m rubin_compile.kernels.triton.tune_moe --shapes "$SHAPES" \
  --formats fp8_block --tokens "$TOKENS" --modes persistent --merge --reps 10 --out "$OUT/moe_configs" \
  --log "$OUT/tune-detail.log" ; } > "$OUT/tune.log" 2>&1
echo "tune exit $?"; grep -E "T=|WRONG|Error|^real" "$OUT/tune.log" | cut -c1-260
grep -E "^ +[0-9.]+ us .*persistent.*a_fp8" "$OUT/tune-detail.log" | sort -n | head -12 | cut -c1-200
echo "gluon candidates:"; grep -E "gluon|/ws" "$OUT/tune-detail.log" | cut -c1-200
mkdir -p /tmp/rubin-tuned && cp "$OUT/moe_configs/$TABLE" /tmp/rubin-tuned/
[ "${PROFILE:-1}" = 0 ] && { archive_out results.tgz; exit 0; }
CASES=$(echo "$SHAPES" | tr ',' '\n' | sed 's/$/:fp8_block:4096/' | paste -sd,)
{ time timeout 100 python3 benchmarks/moe_profile.py --torch-profiler --configs "$OUT/moe_configs/$TABLE" \
  --cases "$CASES" ; } > "$OUT/profile.log" 2>&1
echo "profile exit $?"; grep -vE "^\s*$" "$OUT/profile.log" | tail -40 | cut -c1-220
archive_out results.tgz
