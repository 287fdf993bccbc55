#!/usr/bin/env bash
# Issue 16, batch-1 decode attention: the in-place merge (the last split of each (batch, KV head) merges all of them,
# loading every partial at once) against the second kernel, in benchmarks/decode_attention_probe.py. ~2 min.
# bash benchmarks/h200/attn16-b1-3-merge.sh
. "$(dirname "$0")/common.sh"
timeout 300 python3 benchmarks/decode_attention_probe.py --shapes "${SHAPES:-1x4096,1x16384,1x32768,8x4096,8x16384}" \
  --out "$OUT" 2>&1 | grep -v Warning > "$OUT/probe.log"
echo "probe exit $?"; grep -E "^\|" "$OUT/probe.log" | grep -v "profile" | cut -c1-200
grep -o '"err_vs_combine": [0-9.e-]*' "$OUT/probe.log"
