#!/usr/bin/env bash
# Issue 16, batch-1 decode attention: Config.warp_split (each warp the softmax of its own positions of a tile, merged
# after the K / V loop: 2 CTA barriers per tile on sm_90 against 11). Built and checked on the CPU only (Triton's
# interpreter, the sm_90 PTX); this is its first GPU run. Carry .whl.
#   PHASE=test  (~4 min): the decode attention GPU tests (the warp split's among them), then
#               benchmarks/decode_attention.py at batch 1 / 8 x 4k, 16k, 32k (the "warp split" rows beside the default)
#   PHASE=sweep (~6 min): the Config sweep with and without the warp split (and on 8 warps) at batch 1 / 4k, 16k, 32k
#               and batch 8 / 4k, 16k: what would make warp_split part of DEFAULT / LONG
# PHASE=test bash benchmarks/h200/attn16-b1-9-warp-split.sh
. "$(dirname "$0")/common.sh"
if [ "${PHASE:-test}" = test ]; then
  { time timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu/test_decode_attention.py \
      tests/gpu/test_inline_kernels.py ; } > "$OUT/pytest-decode-attention.log" 2>&1
  echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-decode-attention.log" | tail -12
  timeout 200 python3 benchmarks/decode_attention.py --contexts 4096,16384,32768 --batches 1,8 --out "$OUT" \
    > "$OUT/decode-attention.log" 2>&1
  echo "decode_attention exit $?"
  grep -E "^\| [0-9]" "$OUT/decode-attention-$SLUG.md" | grep -E "\((bf16|fp8 KV)\)( \||, warp split)" | cut -c1-130
else
  for b in 1 8; do
    ctx=4096,16384,32768; [ $b = 8 ] && ctx=4096,16384
    timeout 280 python3 benchmarks/decode_attention.py --sweep --warp-split --batches $b --contexts $ctx --out "$OUT" \
      2>&1 | grep -v Warning > "$OUT/sweep-ws-b$b.log"
    echo "sweep b$b exit $?"; grep -E "^\|" "$OUT/sweep-ws-b$b.log"
    mv "$OUT/decode-attention-sweep-$SLUG.json" "$OUT/sweep-ws-b$b.json"
    mv "$OUT/decode-attention-sweep-$SLUG.md" "$OUT/sweep-ws-b$b.md"
  done
fi
