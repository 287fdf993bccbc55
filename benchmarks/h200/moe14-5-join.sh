#!/usr/bin/env bash
# Issue 14, FP8 prefill (one call, < 10 min): the ceiling cuBLAS reaches on the MoE's GEMMs done dense
# (benchmarks/moe_dense_ceiling.py), the persistent path's tests, then tune_moe --modes persistent on the three
# issue shapes at T = 1024, 4096, FP8 block and bf16: every persistent tile, among them the joined FC1 tiles
# (GemmConfig.join) and the W8A8 tiles that now fold one block scale per tile into their rows' scales. The table
# comes back as moe_configs/<GPU>.json (commit it before step 3), every candidate's time in tune-prefill-detail.log.
# carry [".whl", ".vllm-src"].   bash benchmarks/h200/moe14-5-join.sh
. "$(dirname "$0")/common.sh"
timeout 60 python3 benchmarks/moe_dense_ceiling.py --shapes qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b \
  --tokens 1024,4096 --json "$OUT/dense-ceiling-$SLUG.json" 2>&1 | tee "$OUT/dense-ceiling.log"
{ time timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_triton_moe.py -k persistent ; } \
  > "$OUT/pytest-prefill.log" 2>&1
echo "pytest persistent exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-prefill.log" | cut -c1-300 | tail -12
export SHAPES=${SHAPES:-qwen3-30b-a3b,deepseek-v3-tp8,mixtral-8x7b} TOKENS=${TOKENS:-1024,4096}
export FORMATS=${FORMATS:-fp8_block,bf16} TUNE_TIMEOUT=${TUNE_TIMEOUT:-$((570 - SECONDS))}
bash "$(dirname "$0")/moe14-2-tune.sh"
