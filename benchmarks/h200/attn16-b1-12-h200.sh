#!/usr/bin/env bash
# Issue 16, batch-1 decode attention on the goal's GPU (the H200; steps 1-11 ran on H100s): the read floor (step 11's
# probe: how fast any one kernel reads the filled K and V, beside the call, the split kernel alone and the streaming
# kernel), benchmarks/decode_attention.py at this tree (the H200 table was the earlier kernel's), and the GPU tests
# that run the decode attention (review commits 649da2c / eae3763 / 8b693f2 were not run on a GPU). ~6 min.
#   bash benchmarks/h200/attn16-b1-12-h200.sh   (carry .whl)
. "$(dirname "$0")/common.sh"
timeout 240 python3 benchmarks/decode_attention_probe.py --stream-only --shapes 1x4096,1x16384,1x32768 \
    --out "$OUT" 2>&1 | grep -v Warning > "$OUT/probe-read-floor.log"
echo "probe exit $?"; grep -E "^\| 1 .*(call|split only|read only|stream \(no softmax)" "$OUT/probe-read-floor.log" | cut -c1-170
timeout 150 python3 benchmarks/decode_attention.py --contexts 512,4096,16384,32768 --batches 1,8 --out "$OUT" \
    > "$OUT/decode-attention.log" 2>&1
echo "decode_attention exit $?"; grep -E "^\| [0-9]" "$OUT/decode-attention-$SLUG.md" | cut -c1-140
{ time timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_decode_attention.py \
    tests/gpu/test_inline_kernels.py tests/gpu/test_generate.py tests/gpu/test_end_to_end_gpu.py \
    tests/gpu/test_pdl_locality.py tests/gpu/test_triton_launch.py ; } > "$OUT/pytest-gpu-attention.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-gpu-attention.log" | tail -8
