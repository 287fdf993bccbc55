#!/usr/bin/env bash
# Issue 16, third session, H200 step 4 (at the commit submitted): the decode step with the attention launched with
# and without PDL (everything else as planned for a captured graph), at 4k / 16k; then the whole GPU test suite.
# (variant names as renamed after the run: selection now declines the attention's PDL, so the PDL ablations
# force it; the run itself used rubin = attention PDL-launched, rubin-attn-nopdl = without)
#   bash benchmarks/h200/generate-10-final.sh
. "$(dirname "$0")/common.sh"
timeout 170 python3 benchmarks/generate.py --contexts "" --step-contexts 4096,16384 --new-tokens 128 \
    --step-variants rubin-attn-pdl,rubin,rubin-attn-pdl --profile-variants "" --out "$OUT/step" > /tmp/step.log 2>&1
echo "step exit $?"; grep "^| [0-9]\|Error" /tmp/step.log | tail -8
{ time timeout 320 python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider -rfE ; } > "$OUT/pytest-final.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-final.log" | tail -15
grep -E "^E   " "$OUT/pytest-final.log" | cut -c1-300 | head -12
