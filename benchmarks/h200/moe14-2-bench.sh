#!/usr/bin/env bash
# Issue 14, GPU step 2 of 3 (one call, < 10 min), with step 1's tuned table committed in the tree:
#   1. benchmarks/moe.py, bf16, ours against vLLM's fused_moe (from .vllm-src) and the ATen form (grouped_mm) at
#      T = 1 .. 4096 on the three shapes: the prefill table, and the times merged into a copy of this GPU's selection
#      table ($OUT/<gpu>.json: copy it over kernels/triton/moe_baselines/);
#   2. FP8 block at T = 1024, 4096 (ours only; the bf16 run above is the reference);
#   3. the policies the new selection table gives, per shape.
# carry [".whl", ".vllm-src"].   bash benchmarks/h200/moe14-2-bench.sh
. "$(dirname "$0")/common.sh"
export RUBIN_VLLM_SRC=$PWD/.vllm-src
cat .vllm-src/VERSION
TABLE=$(python3 -c "import torch; from rubin_compile.kernels.triton import moe_choice; print(moe_choice.table_file(torch.cuda.get_device_name()))")
[ -f "rubin_compile/kernels/triton/moe_baselines/$TABLE" ] && cp "rubin_compile/kernels/triton/moe_baselines/$TABLE" "$OUT/"
{ time timeout 330 python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b \
  --tokens 1,8,64,128,256,1024,4096 --formats bf16 --baselines grouped_mm,vllm --reps 20 --vllm-src .vllm-src \
  --out "$OUT" --tag -prefill --write-baselines "$OUT/$TABLE" ; } > "$OUT/moe-prefill.log" 2>&1
echo "benchmark exit $?"; grep -E "T=|merged|Error|Traceback|^real" "$OUT/moe-prefill.log" | cut -c1-220
[ -f "$OUT/moe-prefill-h200-prefill.md" ] && cat "$OUT/moe-prefill-h200-prefill.md"
{ time timeout 150 python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b --tokens 1024,4096 \
  --formats fp8_block --baselines none --reps 20 --out "$OUT" --tag -prefill-fp8 ; } > "$OUT/moe-prefill-fp8.log" 2>&1
echo "benchmark fp8 exit $?"; grep -E "T=|Error|Traceback|^real" "$OUT/moe-prefill-fp8.log" | cut -c1-220
python3 - "$OUT/$TABLE" <<'PY'
import json, pathlib, sys
from rubin_compile.kernels.triton import moe_choice
table = json.load(open(sys.argv[1]))
moe_choice.TABLE_DIR = pathlib.Path(sys.argv[1]).parent
for key in table["entries"]:
    E, H, I, k = (int(p.split("=")[1]) for p in key.split(",")[:4])
    for b in ("aten", "vllm"):
        print(f"{key} against {b}: {moe_choice.policy(E, H, I, k, 'bf16', table['device'], b)}")
PY
# at most 8 files come back from $OUT: everything in one archive
(cd "$OUT" && tar czf /tmp/results.tgz . && find . -mindepth 1 -delete && mv /tmp/results.tgz .)
