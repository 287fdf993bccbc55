#!/usr/bin/env bash
# Issue 16: time the decode attention's FP8 KV path on fp16 MMAs (0881ccd) against the commit before it, in one machine
# session: the decode attention GPU tests at this tree, then benchmarks/decode_attention.py at this tree and at 0881ccd^
# (a git worktree under /tmp), same shapes. ~2 min.   bash benchmarks/h200/attn16-fp8kv.sh
. "$(dirname "$0")/common.sh"
{ time timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 tests/gpu/test_decode_attention.py ; } \
  > "$OUT/pytest-decode-attention.log" 2>&1
echo "pytest decode attention exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|^real" "$OUT/pytest-decode-attention.log" | tail -8
rm -rf /tmp/before && git worktree add -f --detach /tmp/before 0881ccd^ > /dev/null 2>&1 || echo "worktree failed"
mkdir -p "$OUT/before" "$OUT/after"
for side in after before; do
  dir=$PWD; [ "$side" = before ] && dir=/tmp/before
  ( cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 150 python3 benchmarks/decode_attention.py --contexts 4096,16384,32768 \
      --batches 1,8 --out "$OUT/$side" ) > "$OUT/$side/decode-attention.log" 2>&1
  rc=$?; echo "decode_attention ($side, $(git -C "$dir" rev-parse --short HEAD)) exit $rc"
  grep -E "^\| [0-9]" "$OUT/$side/decode-attention-$SLUG.md" | grep -v "ATen form"
done
git worktree remove --force /tmp/before > /dev/null 2>&1
archive_out attn.tgz 'pytest-decode-attention.log before after'
