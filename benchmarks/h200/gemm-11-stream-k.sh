#!/usr/bin/env bash
# Issue 12 (third session), H200 step 1: the stream-K form's GPU tests, then the tuner with stream-K candidates
# for bf16 at the decode M buckets 1..16 on every shape but the 311 MB LM head (merged into the committed table;
# M = 32 / 64 and the LM head keep their entries; the table lands in $OUT/gemm_configs) and a
# summary against the committed table: per entry old / new time, % of copy bandwidth, whether stream-K won.
#   bash benchmarks/h200/gemm-11-stream-k.sh
. "$(dirname "$0")/common.sh"
timeout 120 python3 -m pytest tests/gpu/test_triton_gemm.py -q -p no:cacheprovider -k "stream_k or pdl_bitwise" \
    > "$OUT/pytest-stream-k.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|passed|failed|Error" "$OUT/pytest-stream-k.log" | tail -8
mkdir -p "$OUT/gemm_configs" && cp rubin_compile/kernels/triton/gemm_configs/NVIDIA_H200.json "$OUT/gemm_configs/"
SHAPES=$(python3 -c "from rubin_compile.kernels.triton.tune_gemm import SHAPES; print(','.join(s for s in SHAPES if s != 'qwen3-30b-a3b.lm_head'))")
timeout 330 python3 -m rubin_compile.kernels.triton.tune_gemm --formats bf16 --ms 1,2,4,8,16 --shapes "$SHAPES" \
    --merge --out "$OUT/gemm_configs" > "$OUT/tune-gemm-bf16.log" 2>&1
echo "tune bf16 exit $?"
grep -h -E "compiled|Error|error|wrong" "$OUT"/tune-gemm-*.log | head -10
python3 benchmarks/h200/gemm_table_diff.py "$OUT/gemm_configs/NVIDIA_H200.json" | tee "$OUT/table-diff.txt" | tail -60
