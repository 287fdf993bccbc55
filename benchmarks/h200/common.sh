# Sourced by the H200 step scripts: transformers 5.19 from the carried wheel (.whl), this checkout on the path.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo '+uncommitted')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# The GPU's word in the benchmarks' output file names (benchmarks/gpu_names.py): h200 on the H200
SLUG=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from gpu_names import gpu_slug; print(gpu_slug())")
# The file name of this GPU's MoE tables (moe_configs/, moe_baselines/), e.g. NVIDIA_H200.json
moe_table_file() {
  python3 -c "import torch; from rubin_compile.kernels.triton import moe_choice; print(moe_choice.table_file(torch.cuda.get_device_name()))"
}
# At most 8 files come back from $OUT: the files matching the patterns after the name (quoted: they are expanded in
# $OUT; none: all of $OUT) moved into one archive, $OUT/<name>
archive_out() {
  local name=$1; shift
  (
    cd "$OUT" || exit 1
    if [ $# -eq 0 ]; then
      tar czf "/tmp/$name" . && find . -mindepth 1 -delete
    else
      # shellcheck disable=SC2206
      local files=($@)
      tar czf "/tmp/$name" "${files[@]}" && rm -rf "${files[@]}"
    fi && mv "/tmp/$name" .
  )
}
