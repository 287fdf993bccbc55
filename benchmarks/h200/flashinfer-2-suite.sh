#!/usr/bin/env bash
# Issue 15, H200 step 2 (at the commit submitted): FlashInfer carried as in step 1, then the FlashInfer GPU tests and
# the whole GPU suite (with FlashInfer present, so the plans may choose its kernels).
#   bash benchmarks/h200/flashinfer-2-suite.sh      (run with carry [".devcache"])
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
[ -d /tmp/site/flashinfer ] || xz -dc .devcache/flashinfer.tar.xz | tar xf - -C /tmp/site
[ -d /tmp/site/cudnn ] || python3 -m zipfile -e .devcache/nvidia_cudnn_frontend-*.whl /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=$PWD/.ficache
echo "tree of commit ${RUBIN_COMMIT:-?}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 420 python3 -m pytest tests/gpu -q -p no:cacheprovider -n 8 -rfE > "$OUT/flashinfer-h200.log" 2>&1
echo "pytest exit $?"; grep -E "FAILED|ERROR|passed|failed|crashed" "$OUT/flashinfer-h200.log" | tail -40
