#!/usr/bin/env bash
# Issue 16, third session, H200 step 5: where generate()'s host time per decode call goes, rubin against Inductor
# (cudagraph skips and their reasons; host time of one compiled call).
#   bash benchmarks/h200/generate-11-host.sh
. "$(dirname "$0")/common.sh"
timeout 150 python3 benchmarks/h200/generate_host_diagnose.py > "$OUT/host.log" 2>&1
echo "exit $?"; grep -i "skipping cudagraph\|compiled decode calls\|Error" "$OUT/host.log" | cut -c1-400 | head -20
