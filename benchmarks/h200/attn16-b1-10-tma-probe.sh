#!/usr/bin/env bash
# Issue 16, batch-1 decode attention: the warp split measured slower at every batch-1 shape (step 9), and the
# streaming kernel of the split kernel's structure (pointer loads) is at 78% of copy bandwidth at batch 1 / 16k by
# itself (step 1). Whether TMA loads (host descriptors) stream the cache faster: benchmarks/decode_attention_probe.py
# --stream-only (the call, its split kernel alone, the stream with pointer and TMA loads over five tile / warp / stage /
# split choices), then the decode attention GPU tests. ~4 min.   bash benchmarks/h200/attn16-b1-10-tma-probe.sh
. "$(dirname "$0")/common.sh"
timeout 300 python3 benchmarks/decode_attention_probe.py --stream-only --shapes 1x4096,1x16384,1x32768,8x16384 \
    --out "$OUT" 2>&1 | grep -v Warning > "$OUT/probe-tma.log"
echo "probe exit $?"; grep -E "^\|" "$OUT/probe-tma.log" | cut -c1-200
# then the GPU tests that run the decode attention, at this tree (the warp split removed)
{ time timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_decode_attention.py \
    tests/gpu/test_inline_kernels.py ; } > "$OUT/pytest-decode-attention.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-decode-attention.log" | tail -12
