#!/usr/bin/env bash
# Issue 16, first GPU run of the attention-sinks work (26919fd..03eaa3e, built on the CPU): the whole GPU suite (the
# sinks tests and gpt-oss-tiny's generate() among them), then benchmarks/decode_attention.py at this tree, then the
# read-floor probe at batch 1 (how fast any one kernel reads the filled K and V: the call, the split kernel alone,
# a kernel that only streams the bytes). ~8 min.   bash benchmarks/h200/generate-17-suite-attn.sh   (carry .whl)
. "$(dirname "$0")/common.sh"
{ time timeout 200 python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider -rfE ; } > "$OUT/pytest-suite.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-suite.log" | tail -12
timeout 130 python3 benchmarks/decode_attention.py --contexts 512,4096,16384,32768 --batches 1,8 --out "$OUT" \
    > "$OUT/decode-attention.log" 2>&1
echo "decode_attention exit $?"; grep -E "^\| [0-9]" "$OUT/decode-attention-$SLUG.md" | cut -c1-140
timeout 190 python3 benchmarks/decode_attention_probe.py --stream-only --shapes 1x4096,1x16384,1x32768 \
    --out "$OUT" 2>&1 | grep -v Warning > "$OUT/probe-read-floor.log"
echo "probe exit $?"; grep -E "^\| 1 .*(call|split only|read only|stream \(no softmax)" "$OUT/probe-read-floor.log" | cut -c1-170
