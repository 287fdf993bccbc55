#!/usr/bin/env bash
# Issue 16, third session, H200 step 3: the decode attention kernel with PDL letting the next kernel launch right
# after its wait (the default chosen from steps 1 / 2), against the late trigger and the L2 prefetch: alone
# (16k / 32k, batch 1 / 8) and in the decode step at 4k / 16k (rubin planned for a captured graph, profiled at
# 4k); generate() at 4k / 16k / 32k (batch 1, 128 new tokens) against Inductor.
# (variant names as renamed after the run: selection now declines the attention's PDL, so the PDL ablations
# force it; the run itself used rubin, rubin-attn-late-trigger, rubin-attn-l2-prefetch, the attention PDL-launched in all)
#   bash benchmarks/h200/generate-9-step3.sh
. "$(dirname "$0")/common.sh"
timeout 70 python3 benchmarks/decode_attention.py --contexts 16384,32768 --batches 1,8 --out "$OUT" \
    > /tmp/decode-attention.log 2>&1
echo "decode_attention exit $?"; grep "^|\|Error" /tmp/decode-attention.log | grep -v "ATen\|fp8" | tail -20
timeout 220 python3 benchmarks/generate.py --contexts "" --step-contexts 4096,16384 --new-tokens 128 \
    --step-variants rubin-attn-pdl,rubin-attn-pdl-late-trigger,rubin-attn-pdl-l2-prefetch --profile-variants rubin \
    --out "$OUT/step" > "$OUT/step.log" 2>&1
echo "step exit $?"
grep -v '^{' "$OUT/step.log" | grep -iv "warn" | grep "^|\|^kernel\|^Per-\|Error" | tail -24
timeout 260 python3 benchmarks/generate.py --contexts 4096,16384,32768 --batches 1 --variants inductor,rubin \
    --new-tokens 128 --repeats 2 --step-contexts "" --out "$OUT/gen" > /tmp/generate.log 2>&1
echo "generate exit $?"
grep -v "^{" /tmp/generate.log | grep -iv "warn" | grep "^|\|Error" | tail -12
