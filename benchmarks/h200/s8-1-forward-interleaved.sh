#!/usr/bin/env bash
# Issue 16, the next H200 step (written in the eighth session, which had 68 s of device time and made no run):
# step 4 of the seventh session ran out of time after Inductor's row. The same interleaved rounds at 4k under a limit
# that holds both compiles (about 45 s each) and the rounds, then the GPU suite (16k: a later step).
#   bash benchmarks/h200/s8-1-forward-interleaved.sh
. "$(dirname "$0")/common.sh"
timeout 300 python3 benchmarks/h200/forward_interleaved.py --contexts 4096 --rounds 5 --out "$OUT" \
    > "$OUT/forward-interleaved-4k.log" 2>&1
echo "forward-interleaved 4k exit $?"; grep -E '^\||Error' "$OUT/forward-interleaved-4k.log" | tail -8
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/gpu > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pytest-gpu.log" | tail -8
