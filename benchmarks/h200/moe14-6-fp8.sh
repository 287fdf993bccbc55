#!/usr/bin/env bash
# Issue 14, FP8 prefill (one call, < 10 min): tune_moe --modes persistent for FP8 block weights on the three issue
# shapes at T = 1024, 4096 (the joined FC1 tiles and the one-scale-per-tile W8A8 steps among the candidates), the
# table put in this tree, then benchmarks/moe.py times ours in bf16 and FP8 block in one run (the issue's goal: FP8
# block >= 1.5x faster than our bf16 at T = 4096). The table comes back as moe_configs/<GPU>.json.
# carry [".whl", ".vllm-src"].   [SHAPES=...] [TOKENS=...] [TUNE_TIMEOUT=...] bash benchmarks/h200/moe14-6-fp8.sh
# (an H100's table comes back under its own name: do not commit it to moe_configs/, where it would replace the H200's
# table the H100 runs as its stand-in at every size; benchmarks/results/moe-h100-2026-12-05-s7/README.md)
. "$(dirname "$0")/common.sh"
export SHAPES=${SHAPES:-qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b} TOKENS=${TOKENS:-1024,4096} FORMATS=fp8_block
export TUNE_TIMEOUT=${TUNE_TIMEOUT:-330}
bash "$(dirname "$0")/moe14-2-tune.sh"
TABLE=$(moe_table_file)
cp /tmp/rubin-tuned/"$TABLE" rubin_compile/kernels/triton/moe_configs/
{ time timeout 150 python3 benchmarks/moe.py --shapes "$SHAPES" --tokens "$TOKENS" --formats bf16,fp8_block \
  --baselines none --reps 10 --out "$OUT" --tag=-fp8 ; } > "$OUT/moe-fp8.log" 2>&1
echo "benchmark exit $?"; grep -E "T=|Error|Traceback|^real|TFLOP" "$OUT/moe-fp8.log" | cut -c1-220
[ -f "$OUT/moe-prefill-$SLUG-fp8.md" ] && cat "$OUT/moe-prefill-$SLUG-fp8.md"
archive_out bench.tgz 'moe-*'
