#!/usr/bin/env bash
# Issue 16, batch-1 decode attention: the combine PDL-chained to the split kernel (Config.pdl_combine, the split
# kernel triggering after its K / V loop) in calls launched without PDL. The GPU tests that run the decode attention,
# then benchmarks/decode_attention.py with the unchained variant. ~3 min.   bash benchmarks/h200/attn16-b1-8-chain.sh
. "$(dirname "$0")/common.sh"
{ time timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_decode_attention.py \
    tests/gpu/test_inline_kernels.py tests/gpu/test_generate.py tests/gpu/test_end_to_end_gpu.py \
    tests/gpu/test_pdl_locality.py tests/gpu/test_triton_launch.py ; } > "$OUT/pytest-gpu-attention.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-gpu-attention.log" | tail -8
timeout 150 python3 benchmarks/decode_attention.py --contexts 4096,16384,32768 --batches 1,8 --out "$OUT" \
  > "$OUT/decode-attention.log" 2>&1
echo "decode_attention exit $?"; grep -E "^\| [0-9]" "$OUT/decode-attention-$SLUG.md" | grep -E "\(bf16\)( |, combine)" | cut -c1-120
