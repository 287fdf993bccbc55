# Step 9a: the whole GPU suite at this commit (the routing now matched on CUDA graphs too: the online-softmax form),
# full output kept under $OUT (the tail printed).
source benchmarks/h200/moe13-common.sh
{ time timeout 480 python3 -m pytest tests/gpu -q -n 8 -p no:cacheprovider -rfE ; } > "$OUT/pytest-step9-full.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-step9-full.log" | tail -30
grep -E "^E   " "$OUT/pytest-step9-full.log" | cut -c1-300 | head -40
