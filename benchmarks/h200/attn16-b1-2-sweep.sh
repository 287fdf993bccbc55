#!/usr/bin/env bash
# Issue 16, batch-1 decode attention: the Config sweep widened to 1- and 2-warp programs and 32-position tiles (the
# probe of attn16-b1-1 found the 4-warp split kernel issue-bound: 13 CTA barriers per K / V tile, one warp per
# scheduler), at batch 1 / 4k, 16k, 32k and batch 8 / 16k. ~4 min.   bash benchmarks/h200/attn16-b1-2-sweep.sh
. "$(dirname "$0")/common.sh"
timeout 480 python3 benchmarks/decode_attention.py --sweep --batches 1 --contexts 4096,16384,32768 --out "$OUT" \
  2>&1 | grep -v Warning > "$OUT/sweep-b1.log"
echo "sweep b1 exit $?"; grep -E "^\|" "$OUT/sweep-b1.log"
mv "$OUT/decode-attention-sweep-$SLUG.json" "$OUT/sweep-b1.json"; mv "$OUT/decode-attention-sweep-$SLUG.md" "$OUT/sweep-b1.md"
