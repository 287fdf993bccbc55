#!/usr/bin/env bash
# Issue 14: the persistent path's top-k sum in FC2's epilogue (GemmConfig.epilogue_sum). One call, < 9 min:
# 1. the GPU tests of the epilogue sum (bitwise the sum kernel's output, PDL, CUDA-graph replays) and of the persistent
#    path's determinism;
# 2. benchmarks/moe_fused_sum.py: both forms of the config this GPU runs (its table, or the heuristic) on the three
#    prefill shapes, bf16 and FP8 block, at TOKENS (default 256,1024,4096), in alternating rounds;
# 3. (APPLY=1, the default, on a GPU with its own tuned table) --apply sets epilogue_sum in that table where it won;
#    if it set any, benchmarks/moe.py re-times ours against vLLM's fused_moe and the ATen form (bf16) into the
#    selection table (its rows of changed configs would otherwise no longer count), and the choice's timed test runs.
#    Both tables come back in $OUT; the commit after this run holds them as measured.
# carry [".whl", ".vllm-src"].   RUBIN_COMMIT=<hash> [SKIP_TESTS=1] [APPLY=0] [TOKENS=...] [SHAPES=...] bash ...
. "$(dirname "$0")/common.sh"
export RUBIN_VLLM_SRC=$PWD/.vllm-src
[ "${SKIP_TESTS:-0}" = 1 ] || { time timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 6 tests/gpu/test_triton_moe.py \
  -k "epilogue_sum or persistent_path_deterministic or persistent_path_back_to_back" ; } > "$OUT/pytest-fused-sum.log" 2>&1
rc=$?; [ -f "$OUT/pytest-fused-sum.log" ] && grep -E "passed|failed|FAILED|ERROR|^real" "$OUT/pytest-fused-sum.log" | cut -c1-300 | tail -12
[ "$rc" -eq 0 ] || { echo "tests failed: nothing timed"; exit 1; }
{ time timeout 300 python3 benchmarks/moe_fused_sum.py --shapes "${SHAPES:-qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b}" \
  --tokens "${TOKENS:-256,1024,4096}" --formats bf16,fp8_block --rounds 5 --reps 20 --out "$OUT" ; } > "$OUT/fused-sum.log" 2>&1
echo "benchmark exit $?"; grep -vE "^\{|Warning|warn" "$OUT/fused-sum.log" | tail -30 | cut -c1-260
cp "$OUT/moe-fused-sum-$SLUG.json" /tmp/fused-sum.json 2>/dev/null
# at most 8 files come back: this step's now, so that a call cut short still returns them
archive_out fused-sum.tgz 'moe-fused-sum-*' fused-sum.log pytest-fused-sum.log
[ "${APPLY:-1}" = 1 ] || exit 0
TABLE=$(moe_table_file)
CONF=rubin_compile/kernels/triton/moe_configs/$TABLE
[ -f "$CONF" ] || { echo "no tuned table of this GPU ($TABLE): nothing applied"; archive_out results.tgz; exit 0; }
cp "$CONF" "$OUT/before-$TABLE"
python3 benchmarks/moe_fused_sum.py --apply /tmp/fused-sum.json --write-configs "$CONF" \
  --commit "${RUBIN_COMMIT:-unknown}" | tee "$OUT/apply.log"
# where the call's time goes, per kernel (torch.profiler, PDL off), with the table as it now is
{ time timeout 90 python3 benchmarks/moe_profile.py --torch-profiler --cases \
  qwen3-30b-a3b:bf16:1024,qwen3-30b-a3b:bf16:4096,deepseek-v3-tp8:bf16:1024,deepseek-v3-tp8:bf16:4096 ; } > "$OUT/split.log" 2>&1
echo "split exit $?"; grep -vE "^\s*$|Warning|warn" "$OUT/split.log" | tail -40 | cut -c1-200
cmp -s "$CONF" "$OUT/before-$TABLE" && { echo "no entry changed"; archive_out results.tgz; exit 0; }
cp "$CONF" "$OUT/configs-$TABLE"
BASE=rubin_compile/kernels/triton/moe_baselines/$TABLE
{ time timeout 150 python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b \
  --tokens 1,64,256,1024,4096 --formats bf16 --baselines grouped_mm,vllm --reps 10 --vllm-src .vllm-src \
  --out "$OUT" --tag=-prefill --write-baselines "$BASE" ; } > "$OUT/moe-prefill.log" 2>&1
echo "selection benchmark exit $?"; grep -E "merged|Error|Traceback|^real" "$OUT/moe-prefill.log" | cut -c1-220
[ -f "$OUT/moe-prefill-$SLUG-prefill.md" ] && cat "$OUT/moe-prefill-$SLUG-prefill.md"
cp "$BASE" "$OUT/baselines-$TABLE"
{ time timeout 90 python3 -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_moe_choice_gpu.py ; } > "$OUT/pytest-choice.log" 2>&1
echo "pytest choice exit $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^real" "$OUT/pytest-choice.log" | cut -c1-300 | tail -12
archive_out results.tgz
