# Step 4: Nsight Compute on one decode call per case (T = 1): per-kernel time, DRAM bytes and throughput, and why
# warps stall (the average stalled warps per issued instruction, by reason).
source benchmarks/h200/moe13-common.sh
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active
for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle no_instruction; do
  M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
done
CASES=qwen3-30b-a3b:bf16:1,qwen3-30b-a3b:fp8_block:1,qwen3-30b-a3b:fp8_tensor:1,deepseek-v3-tp8:bf16:1,deepseek-v3-tp8:fp8_block:1,deepseek-v3-tp8:fp8_tensor:1
ncu --clock-control none --profile-from-start off --csv --metrics $M python3 benchmarks/moe_profile.py --cases $CASES \
  > "$OUT/ncu-t1.csv" 2> "$OUT/ncu-t1.err"
tail -3 "$OUT/ncu-t1.err"
grep "^# case" "$OUT/ncu-t1.err"
python3 benchmarks/moe_profile.py --summarise "$OUT/ncu-t1.csv" | tee "$OUT/ncu-t1.txt"
