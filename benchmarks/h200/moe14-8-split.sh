#!/usr/bin/env bash
# Issue 14, FP8 prefill: where the W8A8 GEMMs' time goes (one call, < 8 min). The Gluon GPU tests (SKIP_TESTS=1: none);
# then the per-kernel split (moe_profile --torch-profiler, PDL off) at T = 4096 of the profile inputs in the H100
# results folder (CONFIGS, default "c d": c both GEMMs warp-specialized, d the best Triton W8A8 tile of the H100
# tuning; a: both 8-warp Gluon GEMMs; b: the Triton FC1 and the 8-warp Gluon FC2); then Nsight Compute's
# SpeedOfLight / WarpStateStats / ComputeWorkload / MemoryWorkload / Occupancy sections and stall reasons of their FC1
# and FC2 kernels on Qwen3-30B-A3B (ncu's CSV in $OUT; a failing ncu is reported and the rest still runs).
# carry [".whl", ".vllm-src"].   [SKIP_TESTS=1] [CONFIGS="a b c d"] [NCU=0] bash benchmarks/h200/moe14-8-split.sh
. "$(dirname "$0")/common.sh"
export RUBIN_VLLM_SRC=$PWD/.vllm-src
R=benchmarks/results/moe-h100-2026-12-05-s9
[ "${SKIP_TESTS:-0}" = 1 ] || { time timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 6 tests/gpu/test_triton_moe.py -k gluon ; } \
  > "$OUT/pytest-gluon.log" 2>&1
rc=$?; [ -f "$OUT/pytest-gluon.log" ] && grep -E "passed|failed|FAILED|ERROR|^real" "$OUT/pytest-gluon.log" | cut -c1-300 | tail -12
[ "$rc" -eq 0 ] || { echo "tests failed: nothing timed"; archive_out results.tgz; exit 1; }
for t in ${CONFIGS:-c d}; do
  { time timeout 90 python3 benchmarks/moe_profile.py --torch-profiler --configs "$R/profile-configs-$t.json" \
    --cases qwen3-30b-a3b:fp8_block:4096,deepseek-v3-tp8:fp8_block:4096 ; } > "$OUT/split-$t.log" 2>&1
  echo "split $t exit $?"; grep -vE "^\s*$|Warning|warn" "$OUT/split-$t.log" | tail -24 | cut -c1-200
done
[ "${NCU:-1}" = 0 ] && { archive_out results.tgz; exit 0; }  # NCU=0: the splits only
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# the stall reasons (per issued instruction) and the tensor pipes' busy share, by regex: a name this ncu lacks would
# fail the run, so on a failure it runs again with the sections only
STALLS='regex:^(smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active)$'
ncu_run() {
  timeout 120 "$NCU" --clock-control none --profile-from-start off --csv --page details \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats -k "regex:_fc[12]_" "$@" \
    python3 benchmarks/moe_profile.py --configs "$R/profile-configs-$t.json" --cases qwen3-30b-a3b:fp8_block:4096
}
for t in ${CONFIGS:-c d}; do
  { time ncu_run --metrics "$STALLS" ; } > "$OUT/ncu-$t.csv" 2> "$OUT/ncu-$t.err"
  rc=$?; echo "ncu $t exit $rc"; tail -3 "$OUT/ncu-$t.err" | cut -c1-200
  if [ "$rc" -ne 0 ]; then
    { time ncu_run ; } > "$OUT/ncu-$t.csv" 2> "$OUT/ncu-$t.err"; echo "ncu $t (sections only) exit $?"
  fi
  python3 - "$OUT/ncu-$t.csv" <<'PY'
import csv, io, sys
text = open(sys.argv[1]).read(); start = text.find('"ID"')
keep = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "Registers Per Thread",
        "Achieved Occupancy", "Executed Ipc Active", "Issue Slots Busy", "Warp Cycles Per Issued Instruction",
        "Avg. Active Threads Per Warp", "L1/TEX Hit Rate", "L2 Hit Rate", "Dynamic Shared Memory Per Block",
        "Block Limit Registers", "Block Limit Shared Mem", "Theoretical Occupancy", "Waves Per SM")
for r in csv.DictReader(io.StringIO(text[start:])) if start >= 0 else []:
    name = r["Metric Name"]
    if name in keep or "Throughput" in name or "stall" in name.lower() or name.startswith("sm__pipe_tensor"):
        name = name.replace("smsp__average_warps_issue_stalled_", "stall ").replace("_per_issue_active.ratio", "")
        print(r["Kernel Name"].split("(")[0][:24], "|", name, "|", r["Metric Value"], r["Metric Unit"])
PY
done
archive_out results.tgz
