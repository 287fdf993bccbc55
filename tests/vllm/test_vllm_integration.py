"""rubin_compile.vllm_pass as vLLM sees it: resolved by name, kept as vLLM's own InductorPass (so its uuid,
not a wrapper's, keys vLLM's and Inductor's caches), and a uuid that moves with code and options."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import rubin_compile
from rubin_compile.integrations.vllm import VllmPass, backend_route_cache_key, vllm_pass

ROOT = Path(__file__).resolve().parents[2]


def test_exported_at_package_top():
    assert getattr(rubin_compile, "vllm_pass", None) is vllm_pass, (
        "rubin_compile/__init__.py must re-export the pass: `from rubin_compile.integrations.vllm import vllm_pass`"
    )


def test_vllm_resolves_the_name_and_keeps_our_uuid():
    from vllm.compilation.passes.inductor_pass import InductorPass
    from vllm.config import CompilationConfig

    cc = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "rubin_compile.vllm_pass"})
    resolved = cc.inductor_compile_config["post_grad_custom_post_pass"]
    assert resolved is vllm_pass  # not wrapped in CallableInductorPass (whose uuid hashes its own source)
    assert isinstance(resolved, InductorPass)
    assert resolved.is_applicable_for_range(None)


def test_vllm_config_hash_follows_rubin_options(monkeypatch):
    """vLLM's compile caches (its AOT artifacts among them) are keyed on the config hash, which reads our
    uuid(): a change of RUBIN_* settings must give a new hash."""
    from vllm.config import CompilationConfig

    def config_hash() -> str:
        return CompilationConfig(
            inductor_passes={"post_grad_custom_post_pass": "rubin_compile.vllm_pass"}
        ).compute_hash()

    monkeypatch.delenv("RUBIN_PASSES", raising=False)
    default = config_hash()
    monkeypatch.setenv("RUBIN_PASSES", "match_moe")
    assert config_hash() != default
    monkeypatch.delenv("RUBIN_PASSES")
    assert config_hash() == default


def test_uuid_moves_with_options_and_code(monkeypatch):
    from rubin_compile.passes import manager

    base = VllmPass().uuid()
    assert VllmPass({"strict": True}).uuid() != base
    assert VllmPass({"passes": ["match_moe"]}).uuid() != base
    assert VllmPass({"target": "sm107"}).uuid() != base
    monkeypatch.setattr(manager, "_source_hash", lambda: "edited")
    assert VllmPass().uuid() != base


def test_backend_route_cache_key_moves_with_options(monkeypatch):
    monkeypatch.delenv("RUBIN_STRICT", raising=False)
    key = backend_route_cache_key()["additional_config"]["rubin_uuid"]
    assert backend_route_cache_key({"strict": True})["additional_config"]["rubin_uuid"] != key
    monkeypatch.setenv("RUBIN_STRICT", "1")
    assert backend_route_cache_key()["additional_config"]["rubin_uuid"] != key


def test_pickles_for_vllm_workers():
    p = VllmPass({"strict": True})
    p.last_report = {"big": "report"}
    q = pickle.loads(pickle.dumps(p))
    assert q.uuid() == p.uuid() and q.last_report is None


@pytest.mark.parametrize("first", ["rubin", "vllm"])
def test_import_order_does_not_matter(first):
    """The handshake (InductorPass registration, the vLLM layer ops' schema) happens whichever package a
    process imports first."""
    imports = {
        "rubin": "import rubin_compile.integrations.vllm as rv",
        "vllm": "import vllm.config",
    }
    second = "vllm" if first == "rubin" else "rubin"
    code = textwrap.dedent(f"""
        {imports[first]}
        {imports[second]}
        import torch, rubin_compile.integrations.vllm as rv
        from vllm.compilation.passes.inductor_pass import InductorPass
        assert isinstance(rv.vllm_pass, InductorPass)
        assert hasattr(torch.ops.rubin, "vllm_moe_layer") and hasattr(torch.ops.rubin, "vllm_moe_layer_shared")
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_rubin_import_does_not_import_vllm():
    code = "import sys, rubin_compile; assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules); print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_layer_op_schema_matches_vllm_op():
    """rubin.vllm_moe_layer takes vllm.moe_forward's arguments (minus hidden_dim_unpadded), layer_name with
    the same (hoisted opaque) type, so a rewrite passes the very graph input on."""
    import vllm.model_executor.layers.fused_moe.runner.moe_runner  # noqa: F401  (registers vllm.moe_forward)

    ours = {a.name: str(a.type) for a in torch.ops.rubin.vllm_moe_layer.default._schema.arguments}
    theirs = {a.name: str(a.type) for a in torch.ops.vllm.moe_forward.default._schema.arguments}
    for name in ("hidden_states", "router_logits", "shared_experts_input", "input_ids", "layer_name"):
        assert ours[name] == theirs[name]
