#!/usr/bin/env bash
# Issue 16, batch-1 decode attention: the decode attention GPU tests, then the Config sweep at batch 1 / 4k, 16k, 32k
# and batch 8 / 4k, 16k. ~5 min.   bash benchmarks/h200/attn16-b1-4-sweep.sh
# (Ran at 25f639a, with a second K / V loop for dense spans that was removed after it: see
# benchmarks/results/decode-attention-b1-h100-2026-12-06/README.md.)
. "$(dirname "$0")/common.sh"
{ time timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 tests/gpu/test_decode_attention.py ; } \
  > "$OUT/pytest-decode-attention.log" 2>&1
echo "pytest decode attention exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-decode-attention.log" | tail -8
for b in 1 8; do
  ctx=4096,16384,32768; [ $b = 8 ] && ctx=4096,16384
  timeout 300 python3 benchmarks/decode_attention.py --sweep --batches $b --contexts $ctx --out "$OUT" \
    2>&1 | grep -v Warning > "$OUT/sweep-b$b.log"
  echo "sweep b$b exit $?"; grep -E "^\|" "$OUT/sweep-b$b.log"
  mv "$OUT/decode-attention-sweep-$SLUG.json" "$OUT/sweep-b$b.json"; mv "$OUT/decode-attention-sweep-$SLUG.md" "$OUT/sweep-b$b.md"
done
