#!/usr/bin/env bash
# Issue 16, fourth session, H200 step 1: generate()'s host time per decode call, rubin against Inductor, without the
# cudagraph debug log (step 5 of the third session had it on, which inflated rubin's calls), with a cProfile of
# one warm generate() per backend, and the fixed per-generate() cost (the CUDA graph recorded again for each new
# static cache) apart from the per-token cost.
#   bash benchmarks/h200/generate-12-host-profile.sh
. "$(dirname "$0")/common.sh"
timeout 400 python3 benchmarks/h200/generate_host_diagnose.py --context 4096 --profile-out "$OUT" 2>&1 | tee "$OUT/host.log" | grep -v Warning | tail -8
for b in inductor rubin; do echo "== $b"; head -60 "$OUT/profile-$b.txt" | cut -c1-200; done
