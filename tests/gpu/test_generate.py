"""generate() with a static cache on the GPU, compiled with backend="rubin" both ways (examples/generate.py: generate's
compile_config with mode="reduce-overhead", and model.forward without CUDA graphs): the generated ids equal eager's
in fp32; the decode step's attention runs the Triton decode kernel (GPT-OSS's with its attention sinks) and its
experts are one rubin.moe each (transformers switches them to batched_mm for decode on a GPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("generate_example", ROOT / "examples" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["tiny", "gpt-oss-tiny"])  # Qwen3-MoE (SDPA); GPT-OSS (eager attention, sinks)
@pytest.mark.parametrize("how", ["compile_config", "model.forward"])
def test_generate_fp32_ids_equal_eager(tmp_path, monkeypatch, how, name):
    ex = _example()
    monkeypatch.setenv("RUBIN_DUMP_DIR", str(tmp_path))
    model = ex.build_model(name, torch.float32, "cuda", 128)
    prompt = torch.randint(1, 128, (2, 37), generator=torch.Generator().manual_seed(0)).cuda()
    torch._dynamo.reset()
    want = ex.generate_once(model, prompt, 20)
    setup = ex.compile_config_setup("rubin", "cuda") if how == "compile_config" else ex.forward_setup("rubin", "cuda")
    config = setup(model)
    got = ex.generate_once(model, prompt, 20, config)
    model.__dict__.pop("forward", None)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    plans = [
        p
        for report in tmp_path.glob("*/report.json")
        for pass_ in json.loads(report.read_text())["passes"]
        for p in pass_.get("plans", [])
    ]
    decode = [p for p in plans if p["canonical_op"] == "rubin.attention" and p["spec"]["shape"].get("S") == 1]
    assert decode and all(p["kernel"] == "triton" for p in decode), [(p["kernel"], p["spec"]) for p in plans]
    # the experts (batched_mm for decode on a GPU) are rewritten; in fp32 they run the reference (the Triton MoE is
    # bf16 / fp16), which must be capturable in the CUDA graphs of mode="reduce-overhead"
    moe = [p for p in plans if p["canonical_op"] == "rubin.moe"]
    assert moe and all(p["kernel"] == "reference" for p in moe)
