#!/usr/bin/env bash
# Issue 14, H200 step 1 (written 2026-12-05 in a session with no device time; not yet run): the per-call-size choice
# between our MoE kernels and what a graph runs without rubin (kernels/triton/moe_choice.py). First its GPU tests
# (ours, the ATen form and vLLM's fused_moe timed at prefill and decode sizes; the chosen one within 5% of the
# fastest; the adapter running the ATen form), then benchmarks/moe.py with the vllm and grouped_mm baselines at
# T = 1 .. 4096 on Qwen3-30B-A3B, DeepSeek-V3 TP8 and Mixtral-8x7B (bf16), writing the prefill table and merging the
# times into a copy of the committed selection table ($OUT/NVIDIA_H200.json: commit it as
# rubin_compile/kernels/triton/moe_baselines/NVIDIA_H200.json after reading it).
# Before: bash benchmarks/h200/vllm-src.sh (on the CPU machine); carry [".whl", ".vllm-src"].
#   bash benchmarks/h200/moe14-1-baselines.sh
. "$(dirname "$0")/common.sh"
export RUBIN_VLLM_SRC=$PWD/.vllm-src
cat .vllm-src/VERSION
timeout 240 python3 -m pytest tests/gpu/test_moe_choice_gpu.py -q -p no:cacheprovider -rs > "$OUT/pytest-moe-choice.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|SKIPPED|passed|failed|Error" "$OUT/pytest-moe-choice.log" | cut -c1-300 | tail -12
cp rubin_compile/kernels/triton/moe_baselines/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
timeout 420 python3 benchmarks/moe.py --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b --tokens 1,8,64,128,256,1024,4096 \
  --formats bf16 --baselines grouped_mm,vllm --reps 20 --vllm-src .vllm-src --out "$OUT" --tag -baselines \
  --write-baselines "$OUT/NVIDIA_H200.json" > "$OUT/moe-baselines.log" 2>&1
echo "benchmark exit $?"; grep -E "T=|merged|Error|Traceback" "$OUT/moe-baselines.log" | cut -c1-220
[ -f "$OUT/moe-prefill-h200-baselines.md" ] && cat "$OUT/moe-prefill-h200-baselines.md"
python3 - "$OUT/NVIDIA_H200.json" <<'PY'
import json, sys
from rubin_compile.kernels.triton import moe_choice
table = json.load(open(sys.argv[1]))
moe_choice.TABLE_DIR = __import__("pathlib").Path(sys.argv[1]).parent
for key in table["entries"]:
    E, H, I, k = (int(p.split("=")[1]) for p in key.split(",")[:4])
    for b in ("aten", "vllm"):
        print(f"{key} against {b}: {moe_choice.policy(E, H, I, k, 'bf16', table['device'], b)}")
PY
