# Step 9b: the decode step with and without the fused routing, profiled (routing kernels per step, the MoE block
# per layer), and the routing benchmark at the arguments match_routing passes.
source benchmarks/h200/moe13-common.sh
timeout 300 python3 benchmarks/decode_step.py --tokens 1,8 --variants rubin-pdl,rubin-pdl-route-aten --iters 20 --rounds 3 \
  --profile --out "$OUT" > "$OUT/decode-step.log" 2>&1
grep -E "ready in|^\| (1|8) \||MoE block|MoE routing|router top-k|Per-kernel" "$OUT/decode-step.log" | cut -c1-400
