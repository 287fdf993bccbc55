# Sourced by the FlashInfer H200 step scripts: FlashInfer 0.7.2.post1 from the carried bundle
# (../shared/tools/flashinfer-bundle .devcache) and the cuDNN frontend wheel beside it, this checkout on the path,
# FlashInfer's JIT output in .ficache (kept while the machine stays warm). Run the steps with carry [".devcache"].
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
[ -d /tmp/site/flashinfer ] || xz -dc .devcache/flashinfer.tar.xz | tar xf - -C /tmp/site
[ -d /tmp/site/cudnn ] || python3 -m zipfile -e .devcache/nvidia_cudnn_frontend-*.whl /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=$PWD/.ficache
echo "tree of commit ${RUBIN_COMMIT:-?} (the device copy's own git HEAD can be stale)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# The GPU's word in the benchmarks' output file names (benchmarks/gpu_names.py): h200 on the H200
SLUG=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from gpu_names import gpu_slug; print(gpu_slug())")
