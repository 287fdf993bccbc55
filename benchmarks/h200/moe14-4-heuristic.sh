#!/usr/bin/env bash
# Issue 14: the heuristic's persistent tiles (shapes without tuned configs) timed against its decode-style tiles, the
# tuned table and the ATen form on the four benchmark shapes and five held-out ones (benchmarks/moe_heuristic.py),
# then the GPU tests of the MoE kernel and of the choice. carry [".whl", ".vllm-src"].
#   RUBIN_COMMIT=<the tree's commit> bash benchmarks/h200/moe14-4-heuristic.sh
. "$(dirname "$0")/common.sh"
{ time timeout 300 python3 benchmarks/moe_heuristic.py --tokens 256,512,1024,4096 --reps 10 --out "$OUT" \
    --fp8-shapes qwen3-30b-a3b,deepseek-v3-tp8,qwen3-235b-a22b,llama-4-scout ; } > "$OUT/moe-heuristic.log" 2>&1
echo "benchmark exit $?"; grep -E "T=|Error|Traceback|^real" "$OUT/moe-heuristic.log" | cut -c1-200
{ time timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs -n 4 tests/gpu/test_moe_choice_gpu.py \
    tests/gpu/test_triton_moe.py ; } > "$OUT/pytest-moe.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^real" "$OUT/pytest-moe.log" | cut -c1-300 | tail -12
