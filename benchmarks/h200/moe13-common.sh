# Sourced by the issue-13 H200 step scripts (MoE decode): this checkout on the path, results under $OUT.
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
echo "tree of commit ${RUBIN_COMMIT:-?} (the device copy's own git HEAD can be stale)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
