"""End to end on vLLM's CPU build: a 2-layer Qwen3-MoE with random non-trivial weights (a safetensors
checkpoint, ``initializer_range=0.1``), served through each rubin route, against the same engine without
rubin.

Checked: every MoE node of the served graph is rewritten (from rubin's report, or from the code Inductor
generated); greedy tokens are identical; top-5 logprobs agree within ``LOGPROB_ATOL`` (fp32: both sides run
the same math, in a different summation order; observed differences are around 5e-6).

Each engine runs in its own process (tests/vllm/engine_run.py): a vLLM engine leaves process-wide state
behind. About a minute per engine on two cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import seeded_random
from tests.vllm.checkpoint import QWEN3_MOE, save_qwen3_moe

LOGPROB_ATOL = 1e-4
NUM_MOE_LAYERS = QWEN3_MOE["num_hidden_layers"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def model(workdir, request) -> Path:
    return save_qwen3_moe(workdir / "qwen3-moe", seed=seeded_random(request).randrange(2**31))


@pytest.fixture(scope="module")
def prompts(workdir, request) -> Path:
    rng = seeded_random(request)
    path = workdir / "prompts.json"
    path.write_text(json.dumps([[rng.randrange(QWEN3_MOE["vocab_size"]) for _ in range(n)] for n in (5, 11, 3)]))
    return path


class Engines:
    """Runs (once per module) and caches engine results by name."""

    def __init__(self, workdir: Path, model: Path, prompts: Path) -> None:
        self.workdir, self.model, self.prompts = workdir, model, prompts
        self.cache: dict[str, dict] = {}
        # One vLLM cache root for the module: the backend route's second start must find the first's artifact.
        self.vllm_cache = workdir / "vllm-cache"

    def run(self, name: str, route: str, *, moe_op: bool = False, dump: bool = False, env: dict | None = None) -> dict:
        if name in self.cache:
            return self.cache[name]
        out = self.workdir / f"{name}.json"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("RUBIN_")}
        environ.update(
            VLLM_CACHE_ROOT=str(self.vllm_cache),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            TORCHINDUCTOR_CACHE_DIR=str(self.workdir / "inductor-cache"),
            **(env or {}),
        )
        dump_dir = self.workdir / f"dump-{name}"
        if dump:
            environ["RUBIN_DUMP_DIR"] = str(dump_dir)
        cmd = [
            sys.executable,
            "-m",
            "tests.vllm.engine_run",
            "--model",
            str(self.model),
            "--route",
            route,
            "--prompts",
            str(self.prompts),
            "--out",
            str(out),
        ] + (["--moe-op"] if moe_op else [])
        proc = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{name} engine failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        result = json.loads(out.read_text())
        result["log"] = proc.stdout + proc.stderr
        result["reports"] = [json.loads(p.read_text()) for p in sorted(dump_dir.glob("*/report.json"))]
        self.cache[name] = result
        return result


@pytest.fixture(scope="module")
def engines(workdir, model, prompts) -> Engines:
    return Engines(workdir, model, prompts)


def assert_same_generation(actual: dict, expected: dict) -> None:
    for a, e in zip(actual["outputs"], expected["outputs"], strict=True):
        assert a["token_ids"] == e["token_ids"]
        for step_a, step_e in zip(a["logprobs"], e["logprobs"], strict=True):
            for token, lp in step_e.items():
                if token in step_a:
                    assert abs(step_a[token] - lp) <= LOGPROB_ATOL, (token, step_a[token], lp)
            # The top-5 sets agree too, except for a swap at the boundary within tolerance.
            top_e = sorted(step_e.items(), key=lambda kv: -kv[1])
            assert max(step_e, key=step_e.get) == max(step_a, key=step_a.get)
            for token, lp in top_e[:-1]:
                assert token in step_a or abs(lp - top_e[-1][1]) <= LOGPROB_ATOL


def match_moe(report: dict) -> dict:
    return next(p for p in report["passes"] if p["name"] == "match_moe")


def assert_every_moe_rewritten(result: dict, idiom: str, canonical: str) -> None:
    (report,) = result["reports"]  # vLLM on CPU compiles the whole model as one graph
    mm = match_moe(report)
    assert mm["unchanged"] == []
    rewrites = [r for r in mm["rewrites"] if r["source_idiom"] == idiom]
    assert len(rewrites) == len(mm["rewrites"]) == NUM_MOE_LAYERS
    assert {r["canonical_op"] for r in rewrites} == {canonical}


def test_baseline_is_not_trivial(engines):
    """The checkpoint's logits are far from uniform: a rewrite that broke a layer would show."""
    base = engines.run("none", "none")
    for out in base["outputs"]:
        for step in out["logprobs"]:
            values = sorted(step.values(), reverse=True)
            assert values[0] - values[-1] > 0.05


def test_pass_route(engines):
    base = engines.run("none", "none")
    ours = engines.run("pass", "pass", dump=True)
    (report,) = ours["reports"]
    assert report["source"] == "vllm"
    assert_every_moe_rewritten(ours, "vllm _C.cpu_fused_moe", "rubin.moe")
    for r in match_moe(report)["rewrites"]:
        d = r["details"]
        assert (d["E"], d["H"], d["I"], d["k"]) == (
            QWEN3_MOE["num_experts"],
            QWEN3_MOE["hidden_size"],
            QWEN3_MOE["moe_intermediate_size"],
            QWEN3_MOE["num_experts_per_tok"],
        )
        assert d["routing"]["order"] == "topk_then_softmax" and d["routing"]["router"].startswith("linear")
    # chain_pdl takes the execution mode from vLLM (its config, or its default when the config is not in
    # scope, as in vLLM 0.32), never from the backend option, and decides per MoE node (the CPU: no PDL)
    pdl = next(p for p in report["passes"] if p["name"] == "chain_pdl")
    assert any("vLLM cudagraph_mode=" in n or "assuming vLLM's default CUDA graphs" in n for n in pdl["notes"]), pdl[
        "notes"
    ]
    assert [d["decision"] for d in pdl["decisions"]] == ["pdl off"] * NUM_MOE_LAYERS
    assert all("has no PDL" in d["reason"] for d in pdl["decisions"])
    assert_same_generation(ours, base)


def test_pass_route_gpu_form(engines):
    """The same model with its MoE layers calling ``vllm.moe_forward`` (vLLM's GPU form, run on the CPU)."""
    base = engines.run("none", "none")
    ours = engines.run("pass-moe-op", "pass", moe_op=True, dump=True)
    rewrites = match_moe(ours["reports"][0])["rewrites"]
    assert_every_moe_rewritten(ours, "vllm.moe_forward (layer op)", "rubin.vllm_moe_layer")
    assert {r["details"]["layer"] for r in rewrites} == {f"model.layers.{i}.mlp.experts" for i in range(NUM_MOE_LAYERS)}
    assert all(r["details"]["gate_in_layer"] for r in rewrites)  # Qwen3-MoE's router runs inside the layer
    assert_same_generation(ours, base)


def generated_code(result: dict) -> str:
    """The Python code Inductor generated for an AOT-compiled engine (vLLM points Inductor's cache at
    ``<VLLM_CACHE_ROOT>/torch_compile_cache/torch_aot_compile/<hash>/inductor_cache``)."""
    saved = re.search(r"saved AOT compiled function to (\S+)", result["log"])
    assert saved, "no AOT artifact was saved"
    inductor_cache = Path(saved.group(1)).parents[1] / "inductor_cache"
    return "\n".join(f.read_text(errors="replace") for f in sorted(inductor_cache.rglob("*.py")))


def test_backend_route_with_aot_compile(engines):
    """``mode=2, backend="rubin"`` under vLLM's default AOT compile (``VLLM_USE_AOT_COMPILE`` is on with
    torch >= 2.10): the backend's compiled artifact must be serialisable, or the engine fails to start.
    With RUBIN_DUMP_DIR set too: dumping must not cost the artifact its serialisability."""
    base = engines.run("none", "none")
    ours = engines.run("backend", "backend", dump=True)
    assert ours["aot_compiles"] == 1 and ours["aot_artifacts_saved"] == 1
    assert_every_moe_rewritten(ours, "vllm _C.cpu_fused_moe", "rubin.moe")
    code = generated_code(ours)
    assert code.count("torch.ops.rubin.moe.default(") == NUM_MOE_LAYERS
    assert "cpu_fused_moe" not in code
    assert_same_generation(ours, base)
