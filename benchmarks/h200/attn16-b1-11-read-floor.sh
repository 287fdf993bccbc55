#!/usr/bin/env bash
# Issue 16, batch-1 decode attention: the floor of the goal. Step 10 found the streaming kernel of the split kernel's
# structure at 79% of copy bandwidth at batch 1 / 16k on an H100, with pointer or TMA loads. How fast can any one
# kernel read those bytes (the filled K and V in the cache) -- `read only` rows of
# benchmarks/decode_attention_probe.py --stream-only, 1-8 programs per SM -- on this GPU? On the H200 too: the goal
# is the H200's. ~2 min.   bash benchmarks/h200/attn16-b1-11-read-floor.sh
. "$(dirname "$0")/common.sh"
timeout 300 python3 benchmarks/decode_attention_probe.py --stream-only --shapes 1x4096,1x16384,1x32768 \
    --out "$OUT" 2>&1 | grep -v Warning > "$OUT/probe-read-floor.log"
echo "probe exit $?"; grep -E "^\| 1 .*(call|split only|read only|stream \(no softmax)" "$OUT/probe-read-floor.log" | cut -c1-200
