#!/usr/bin/env bash
# Issue 16, batch-1 decode attention: the decode attention GPU tests, the Config sweep at batch 1 / 4k, 16k, 32k and
# batch 8 / 4k, 16k, then benchmarks/decode_attention.py. ~4 min. (Ran at 29661ca, where a dense span's mask tiles
# were predicated off and the benchmark had a "mask tiles always read" variant; both removed after it.)
# bash benchmarks/h200/attn16-b1-5-sweep.sh
. "$(dirname "$0")/common.sh"
{ time timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 tests/gpu/test_decode_attention.py ; } \
  > "$OUT/pytest-decode-attention.log" 2>&1
echo "pytest decode attention exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-decode-attention.log" | tail -8
for b in 1 8; do
  ctx=4096,16384,32768; [ $b = 8 ] && ctx=4096,16384
  timeout 200 python3 benchmarks/decode_attention.py --sweep --batches $b --contexts $ctx --out "$OUT" \
    2>&1 | grep -v Warning > "$OUT/sweep-b$b.log"
  echo "sweep b$b exit $?"; grep -E "^\|" "$OUT/sweep-b$b.log"
  mv "$OUT/decode-attention-sweep-$SLUG.json" "$OUT/sweep-b$b.json"; mv "$OUT/decode-attention-sweep-$SLUG.md" "$OUT/sweep-b$b.md"
done
timeout 150 python3 benchmarks/decode_attention.py --contexts 4096,16384,32768 --batches 1,8 --out "$OUT" \
  > "$OUT/decode-attention.log" 2>&1
echo "decode_attention exit $?"; grep -E "^\| [0-9]" "$OUT/decode-attention-$SLUG.md" | grep -E "\(bf16\) \||always read|ATen" | cut -c1-150
