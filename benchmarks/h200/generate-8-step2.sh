#!/usr/bin/env bash
# Issue 16, third session, H200 step 2: the decode attention kernel without the always-PDL combine (step 1 measured
# it slowing the uncaptured path), PDL variants (launch_dependents after the K / V loop or right after the wait;
# L2 prefetch); the decode step alone at 4k / 16k (rubin planned for a captured graph) with the per-kernel profile;
# generate() at 4k / 16k (batch 1, 64 new tokens, compile_config reduce-overhead: fused projections under cudagraph
# trees); the GPU tests of the attention kernel and generate().
#   bash benchmarks/h200/generate-8-step2.sh
. "$(dirname "$0")/common.sh"
timeout 100 python3 benchmarks/decode_attention.py --contexts 4096,16384,32768 --batches 1,8 --out "$OUT" \
    > /tmp/decode-attention.log 2>&1
echo "decode_attention exit $?"; grep "^|\|Error" /tmp/decode-attention.log | grep -v "ATen\|fp8" | tail -30
timeout 330 python3 benchmarks/generate.py --contexts 4096,16384 --batches 1 --variants inductor,rubin \
    --new-tokens 64 --repeats 2 --step-contexts 4096,16384 --step-variants rubin --out "$OUT" > "$OUT/generate.log" 2>&1
echo "generate exit $?"
grep -v '^{' "$OUT/generate.log" | grep -iv "warn" | grep "^|\|^kernel\|^Per-\|Error" | tail -30
{ time timeout 90 python3 -m pytest tests/gpu/test_decode_attention.py tests/gpu/test_generate.py \
    -q -n 8 -p no:cacheprovider -rfE ; } > "$OUT/pytest-step2.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-step2.log" | tail -15
grep -E "^E   " "$OUT/pytest-step2.log" | cut -c1-300 | head -12
