#!/usr/bin/env bash
# Issue 14, H200 step 1 (written 2026-12-05 in a session with no device time; not yet run): the persistent prefill
# path (kernels/triton/moe_prefill.py) and the per-call-size choice against what a graph runs without rubin
# (kernels/triton/moe_choice.py).
#   1. GPU tests: the persistent path (every tuner tile, routings, dtypes, epilogues, PDL / graph replay bitwise) and
#      the choice (ours, the ATen form and vLLM's fused_moe timed; the chosen kernel within 5% of the fastest);
#   2. the tuner with the persistent tiles against the committed table's entries at T = 256, 1024, 4096 (bf16 and FP8
#      block, the three shapes of issue 14), merged into a copy of the table ($OUT/moe_configs), which the next steps
#      then use;
#   3. benchmarks/moe.py with the vllm and grouped_mm baselines at T = 1 .. 4096 (bf16): the prefill table, and the
#      times merged into a copy of the selection table ($OUT/NVIDIA_H200.json); then FP8 block at T = 256, 1024, 4096.
# Commit both tables (and the results) after reading them.
# Before: bash benchmarks/h200/vllm-src.sh on the CPU machine; carry [".whl", ".vllm-src"].
#   bash benchmarks/h200/moe14-1-prefill.sh
. "$(dirname "$0")/common.sh"
export RUBIN_VLLM_SRC=$PWD/.vllm-src
cat .vllm-src/VERSION
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -n 4 tests/gpu/test_triton_moe.py -k persistent \
  > "$OUT/pytest-prefill.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|passed|failed|Error" "$OUT/pytest-prefill.log" | cut -c1-300 | tail -8
# timed tests: alone on the GPU (no -n)
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_moe_choice_gpu.py > "$OUT/pytest-choice.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|SKIPPED|passed|failed|Error" "$OUT/pytest-choice.log" | cut -c1-300 | tail -12
mkdir -p "$OUT/moe_configs" && cp rubin_compile/kernels/triton/moe_configs/NVIDIA_H200.json "$OUT/moe_configs/"
timeout 480 python3 -m rubin_compile.kernels.triton.tune_moe --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b \
  --formats bf16,fp8_block --tokens 256,1024,4096 --modes persistent --merge --reps 10 --out "$OUT/moe_configs" \
  --log "$OUT/tune-prefill-detail.log" > "$OUT/tune-prefill.log" 2>&1
echo "tune exit $?"; grep -v "compile failed" "$OUT/tune-prefill.log" | grep -E "T=|WRONG|Error|compiled" | cut -c1-220
cp "$OUT/moe_configs/NVIDIA_H200.json" rubin_compile/kernels/triton/moe_configs/NVIDIA_H200.json
cp rubin_compile/kernels/triton/moe_baselines/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
timeout 480 python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b --tokens 1,8,64,128,256,1024,4096 \
  --formats bf16 --baselines grouped_mm,vllm --reps 20 --vllm-src .vllm-src --out "$OUT" --tag -prefill \
  --write-baselines "$OUT/NVIDIA_H200.json" > "$OUT/moe-prefill.log" 2>&1
echo "benchmark exit $?"; grep -E "T=|merged|Error|Traceback" "$OUT/moe-prefill.log" | cut -c1-220
[ -f "$OUT/moe-prefill-h200-prefill.md" ] && cat "$OUT/moe-prefill-h200-prefill.md"
timeout 300 python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b --tokens 256,1024,4096 \
  --formats fp8_block --baselines none --reps 20 --out "$OUT" --tag -prefill-fp8 > "$OUT/moe-prefill-fp8.log" 2>&1
echo "benchmark fp8 exit $?"; grep -E "T=|Error|Traceback" "$OUT/moe-prefill-fp8.log" | cut -c1-220
python3 - "$OUT/NVIDIA_H200.json" <<'PY'
import json, pathlib, sys
from rubin_compile.kernels.triton import moe_choice
table = json.load(open(sys.argv[1]))
moe_choice.TABLE_DIR = pathlib.Path(sys.argv[1]).parent
for key in table["entries"]:
    E, H, I, k = (int(p.split("=")[1]) for p in key.split(",")[:4])
    for b in ("aten", "vllm"):
        print(f"{key} against {b}: {moe_choice.policy(E, H, I, k, 'bf16', table['device'], b)}")
PY
