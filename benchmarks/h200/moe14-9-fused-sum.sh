#!/usr/bin/env bash
# Issue 14: the persistent path's top-k sum in FC2's epilogue (GemmConfig.epilogue_sum). One call, < 8 min: the GPU tests of
# the fused sum (bitwise the sum kernel's output, PDL, CUDA-graph replays) and of the persistent path's determinism,
# then benchmarks/moe_fused_sum.py: both forms of the config this GPU runs (its table, or the heuristic) on the three
# prefill shapes, bf16 and FP8 block, at TOKENS (default 256,1024,4096), timed in alternating rounds.
# carry [".whl"].   [SKIP_TESTS=1] [TOKENS=...] [SHAPES=...] bash benchmarks/h200/moe14-9-fused-sum.sh
. "$(dirname "$0")/common.sh"
[ "${SKIP_TESTS:-0}" = 1 ] || { time timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 6 tests/gpu/test_triton_moe.py \
  -k "epilogue_sum or persistent_path_deterministic or persistent_path_back_to_back" ; } > "$OUT/pytest-fused-sum.log" 2>&1
rc=$?; [ -f "$OUT/pytest-fused-sum.log" ] && grep -E "passed|failed|FAILED|ERROR|^real" "$OUT/pytest-fused-sum.log" | cut -c1-300 | tail -12
[ "$rc" -eq 0 ] || { echo "tests failed: nothing timed"; exit 1; }
{ time timeout 330 python3 benchmarks/moe_fused_sum.py --shapes "${SHAPES:-qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b}" \
  --tokens "${TOKENS:-256,1024,4096}" --formats bf16,fp8_block --rounds 5 --reps 20 --out "$OUT" ; } > "$OUT/fused-sum.log" 2>&1
echo "benchmark exit $?"; grep -vE "^\{|Warning|warn" "$OUT/fused-sum.log" | tail -30 | cut -c1-260
