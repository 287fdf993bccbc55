#!/usr/bin/env bash
# Issue 16, sixth session, H200 step 1: passes/inline_kernels.py (our Triton launches traced into the graph, launched
# by Inductor) -- its GPU tests, then generate() with model.forward compiled (no CUDA graphs) at 4k for Inductor, rubin
# with every kernel node an op call (inline_kernels='off', the path before) and rubin as it is now.
#   bash benchmarks/h200/inline-1.sh
. "$(dirname "$0")/common.sh"
( time timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_inline_kernels.py ) > "$OUT/pytest-inline.log" 2>&1
echo "pytest exit $?"; grep -E "^FAILED|^ERROR|passed|failed|host us per call|Error" "$OUT/pytest-inline.log" | tail -12
timeout 330 python3 benchmarks/h200/generate_host_diagnose.py --context 4096 --setup forward --repeats 2 \
    --backends inductor,rubin-call,rubin --profile-out "$OUT" > "$OUT/host-forward.log" 2>&1
echo "host-forward exit $?"; grep "^|\|Error" "$OUT/host-forward.log" | tail -8
sed -n 1,16p "$OUT/profile-forward-rubin.txt" | cut -c1-160
