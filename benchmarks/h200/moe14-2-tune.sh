#!/usr/bin/env bash
# Issue 14, GPU step 2 of 3 (one call, < 10 min): tune_moe --modes persistent (every persistent tile against the
# heuristic and the committed table's entry) at TOKENS (default 1024,4096; later calls with TOKENS=128,256,512,2048,
# 8192 cover the other prefill sizes), FORMATS (default bf16,fp8_block; if one call cannot hold both, one each) and
# SHAPES (default the four benchmark shapes: issue 14's three and MiniMax-M2-like, whose prefill entries predate the
# persistent path), merged into a copy of this GPU's table under $OUT/moe_configs. Commit it over
# rubin_compile/kernels/triton/moe_configs/ before the next call and step 3.
# TUNE_TIMEOUT (default 560 s) bounds the tuner when this runs after step 1 in the same call; the table is written
# after every shape, so a cut-short run keeps the shapes it finished.
# carry [".whl", ".vllm-src"].   [TOKENS=...] [FORMATS=...] [SHAPES=...] [TUNE_TIMEOUT=...] bash benchmarks/h200/moe14-2-tune.sh
. "$(dirname "$0")/common.sh"
TABLE=$(moe_table_file)
echo "this GPU's tables: $TABLE; T = ${TOKENS:=1024,4096}; formats ${FORMATS:=bf16,fp8_block}"
echo "shapes ${SHAPES:=qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b,minimax-m2}"
mkdir -p "$OUT/moe_configs"
[ -f "rubin_compile/kernels/triton/moe_configs/$TABLE" ] && cp "rubin_compile/kernels/triton/moe_configs/$TABLE" "$OUT/moe_configs/"
{ time timeout "${TUNE_TIMEOUT:-560}" python3 -m rubin_compile.kernels.triton.tune_moe --shapes "$SHAPES" \
  --formats "$FORMATS" --tokens "$TOKENS" --modes persistent --merge --reps 10 --out "$OUT/moe_configs" \
  --log "$OUT/tune-prefill-detail.log" ; } > "$OUT/tune-prefill.log" 2>&1
echo "tune exit $?"; grep -v "compile failed" "$OUT/tune-prefill.log" | grep -E "T=|WRONG|Error|compiled|^real" | cut -c1-220
# a copy the next call on the same warm machine can put in its tree (cp /tmp/rubin-tuned/*.json rubin_compile/kernels/
# triton/moe_configs/) before the same table is committed here
mkdir -p /tmp/rubin-tuned && cp "$OUT/moe_configs/$TABLE" /tmp/rubin-tuned/
archive_out results.tgz
