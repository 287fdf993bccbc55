#!/usr/bin/env bash
# Issue 16, fifth session, H200 step 1: the host cost of rubin's decode ops outside CUDA graphs, where it goes
# (dispatch, registry, adapter, Triton's launcher), against Inductor's code for the same computation.
#   bash benchmarks/h200/host-1-probe.sh
. "$(dirname "$0")/common.sh"
timeout 400 python3 benchmarks/host_cost.py --out "$OUT" --label "${LABEL:-probe}" > "$OUT/host-cost.log" 2>&1
echo "host_cost exit $?"; grep -v '^{' "$OUT/host-cost.log" | tail -30
