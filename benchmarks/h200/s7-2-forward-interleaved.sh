#!/usr/bin/env bash
# Issue 16, seventh session, H200 step 2: step 1 measured rubin without CUDA graphs at 0.92x Inductor at 4k (1.83x at
# 512, 1.29x at 16k, where the first token differed) with Inductor's own per-token time varying 4.2-5.9 ms across
# contexts: the host's drift. Here both backends are timed in interleaved rounds, with host per call, kernels per call,
# and the prefill logits against eager (is the 16k first token a near-tie?).
#   bash benchmarks/h200/s7-2-forward-interleaved.sh
. "$(dirname "$0")/common.sh"
timeout 420 python3 benchmarks/h200/forward_interleaved.py --contexts 4096,16384 --rounds 7 --out "$OUT" \
    > "$OUT/forward-interleaved.log" 2>&1
echo "forward-interleaved exit $?"; grep -E '^\||Error' "$OUT/forward-interleaved.log" | tail -8
