"""benchmarks/generate.py's one-CUDA-graph decode step, the part that runs without a GPU: rewinding the static cache
between steps keeps the compiled step's guards true, so it compiles once (on the GPU, a recompile during the
capture fails: GPT-OSS's step did, 2026-12-07, benchmarks/results/issue16-gpt-oss-h100-2026-12-07/)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():
    """benchmarks/generate.py, loaded by path under a name of its own (examples/generate.py is "generate" too)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("benchmarks_generate", ROOT / "benchmarks" / "generate.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _frames_compiled(bench, rewind, context: int) -> int:
    """Frames Dynamo compiled over four rewound decode steps of gpt-oss-tiny (sliding and full layers) after a
    prefill of ``context`` tokens, ``rewind`` called before each."""
    torch.manual_seed(0)
    model = bench.example.build_model("gpt-oss-tiny", torch.float32, "cpu", context + 8)
    cache = StaticCache(config=model.config, max_cache_len=context + 8)
    prompt = torch.randint(1, model.config.vocab_size, (1, context))
    step_ids = torch.randint(1, model.config.vocab_size, (1, 1))
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    assert any(hasattr(layer, "cumulative_length_int") for layer in cache.layers), "no sliding layer: nothing shown"
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    fwd = torch.compile(model.forward, backend="eager", dynamic=False)
    with torch.inference_mode():
        for _ in range(4):
            rewind(cache)
            fwd(input_ids=step_ids, past_key_values=cache, use_cache=True)
    return counters["stats"]["unique_graphs"]


def test_rewound_steps_compile_once(bench):
    context = 20  # longer than gpt-oss-tiny's sliding window: its sliding layers are full, as at 4k on the GPU
    assert _frames_compiled(bench, lambda cache: bench.rewinder(cache, context)(), context) == 1


def test_rewinding_only_the_counter_tensors_recompiles_every_step(bench):
    """What the step did before: the sliding layers' int counter moved on, and each step compiled again."""
    context = 20

    def tensors_only(cache):
        with torch.inference_mode():
            for layer in cache.layers:
                if not getattr(layer, "is_sliding", False):
                    layer.cumulative_length.fill_(context)

    assert _frames_compiled(bench, tensors_only, context) == 4
