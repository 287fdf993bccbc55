#!/usr/bin/env bash
# Issue 16, batch-1 decode attention (>= 80% of copy bandwidth at >= 16k): where the time goes.
# benchmarks/decode_attention_probe.py (call with each mask kind and none, each kernel alone, split counts, a
# streaming kernel of the same grid, copy_ of the same bytes, the profiled per-kernel times), then ncu on one split
# kernel and one combine of batch 1 / 16k (uncaptured). ~3 min.   bash benchmarks/h200/attn16-b1-1-probe.sh
. "$(dirname "$0")/common.sh"
timeout 300 python3 benchmarks/decode_attention_probe.py --out "$OUT" 2>&1 | grep -v Warning > "$OUT/probe.log"
echo "probe exit $?"; grep -E "^\|" "$OUT/probe.log" | cut -c1-400
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for k in _split_kv _combine; do
  timeout 120 "$NCU" --clock-control none -k "regex:$k" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    python3 benchmarks/decode_attention_probe.py --ncu 1x16384 > "$OUT/ncu-$k.log" 2>&1
  echo "ncu $k exit $?"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Stall|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Shared Memory Config|Block Limit|Grid Size|Eligible|Issued Warp|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|SM Busy|One or More" "$OUT/ncu-$k.log" | head -40
done
