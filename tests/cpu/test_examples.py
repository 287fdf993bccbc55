"""The README's example runs as documented: numerics on the CPU, and a Rubin plan made on the CPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RUBIN_")}
    out = subprocess.run(
        [sys.executable, "examples/standalone_moe.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**environ, **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_standalone_example_prints_the_rewrite_table(tmp_path):
    text = _run("--dump-dir", str(tmp_path))
    diff = float(text.split("max |diff| = ")[1].split()[0])
    assert diff < 1e-4
    assert text.count("| rubin.moe | expert loop |") == 2


def test_standalone_example_plans_for_rubin_on_a_cpu(tmp_path):
    text = _run("--dump-dir", str(tmp_path), "--dtype", "bfloat16", RUBIN_TARGET="sm107")
    assert "the plan cannot run on this machine" in text and "compiled for target sm107" in text
    assert "target: sm107 (Rubin)" in text


def readme_block(heading: str) -> list[str]:
    """The commands of the first ```bash block under ``heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    block = section[section.index("```bash") + len("```bash") : section.index("```", section.index("```bash") + 7)]
    return [line.split("#")[0].strip() for line in block.strip().splitlines() if line.split("#")[0].strip()]


def test_the_readme_dump_workflow_works_as_written(tmp_path):
    """`RUBIN_DUMP_DIR=dumps python examples/standalone_moe.py`, then `python -m rubin_compile explain dumps`, run
    as the README writes them (here: in a copy of examples/ under a fresh folder). Before, the example ignored
    RUBIN_DUMP_DIR and the second command failed with "no such folder"."""
    import shutil

    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RUBIN_")}
    environ["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
    commands = readme_block("## Debugging with dumps")
    assert commands == [
        "RUBIN_DUMP_DIR=dumps python examples/standalone_moe.py",
        "python -m rubin_compile explain dumps",
    ]
    outputs = []
    for command in commands:
        out = subprocess.run(
            command.replace("python ", f"{sys.executable} ", 1),
            shell=True,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env=environ,
        )
        assert out.returncode == 0, command + "\n" + out.stderr[-3000:]
        outputs.append(out.stdout)
    assert (tmp_path / "dumps").is_dir() and list((tmp_path / "dumps").glob("*/report.md"))
    assert "| rubin.moe | expert loop |" in outputs[1]


def test_bfloat16_example_line_uses_the_tests_tolerance(tmp_path):
    """In bf16 the example compares with Inductor alone (before: with bf16 eager, 4.7% of the scale, which reads as
    a failure next to the README's 2e-2), and reports the difference relative to the logits' scale."""
    text = _run("--dump-dir", str(tmp_path), "--dtype", "bfloat16")
    assert "compiled with rubin vs Inductor alone (bfloat16)" in text
    relative = float(text.split(" of the logits' scale")[0].split(" = ")[-1])
    assert relative <= 2e-2


def test_the_environment_and_dump_folders_are_ignored_by_git():
    """The README's commands create .venv/ and dumps/ in the checkout: git must not offer to commit them."""
    import shutil

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        raise AssertionError("this test needs the git checkout the README's commands run in")
    out = subprocess.run(
        ["git", "check-ignore", ".venv/pyvenv.cfg", "dumps/g000-0_0/report.json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == [".venv/pyvenv.cfg", "dumps/g000-0_0/report.json"], out.stdout + out.stderr


def _generate_example_reports(tmp_path, *args) -> list[str]:
    """Run examples/generate.py (8 new tokens, one repeat, ``args``) with its dumps under ``tmp_path``: it must exit
    0 with both rubin variants' ids equal to eager's; the dumps' reports."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RUBIN_")}
    out = subprocess.run(
        [sys.executable, "examples/generate.py", *args, "--new-tokens", "8", "--repeats", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**environ, "RUBIN_DUMP_DIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("| equal to eager |") == 2, out.stdout
    return [p.read_text() for p in tmp_path.glob("*/report.md")]


def test_generate_example_on_the_cpu(tmp_path):
    """examples/generate.py as the README runs it on a CPU: generate() with a static cache compiled both ways
    (generate's compile_config, forced onto the CPU with transformers' own switch, and model.forward), the ids
    equal eager's, and the dumps show the decode step's experts and attention rewritten."""
    reports = _generate_example_reports(tmp_path)
    decode = [r for r in reports if "S=1" in r and "static cache" in r]  # a decode step over the static cache
    assert decode, "no decode graph over the static cache was compiled"
    for report in decode:
        assert "| rubin.moe | hf grouped_mm" in report and "| rubin.attention | sdpa" in report


def test_generate_example_gpt_oss_on_the_cpu(tmp_path):
    """examples/generate.py --model gpt-oss-tiny: GPT-OSS's eager attention with sinks (no SDPA path in its
    transformers code) becomes rubin.attention with sinks in every decode graph, the experts rubin.moe (clamped
    SwiGLU with biases), and the ids are eager's both ways."""
    decode = [r for r in _generate_example_reports(tmp_path, "--model", "gpt-oss-tiny") if "S=1" in r]
    assert decode, "no decode graph was compiled"
    sinks = "| rubin.attention | eager attention (matmul -> softmax -> matmul with attention sinks) |"
    for report in decode:
        assert report.count(sinks) == 2 and "activation=swigluoai" in report, report


def test_generate_without_a_compile_config_turns_transformers_own_compile_off():
    """Without a compile_config, transformers compiles the forward itself on a GPU with a static cache (Inductor,
    reduce-overhead), around whatever model.forward is: the example's eager variant would not be eager, and a
    model.forward compiled with rubin would run inside a second compile (on the H200 that compile traced a per-call
    timer and recompiled on every call). Every generate() the example makes without one passes disable_compile."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("generate_example_t", Path("examples/generate.py"))
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    seen = []

    class Model:
        def generate(self, prompt, **kwargs):
            seen.append(kwargs)
            return prompt

    prompt = torch.ones(1, 4, dtype=torch.long)
    example.generate_once(Model(), prompt, 3)
    example.generate_once(Model(), prompt, 3, compile_config="a config")
    assert seen[0]["disable_compile"] is True and "compile_config" not in seen[0]
    assert seen[1]["compile_config"] == "a config" and "disable_compile" not in seen[1]


def _generate_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_example_d", ROOT / "examples" / "generate.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    return example


def test_divergence_finds_the_earliest_differing_token_and_its_gap_in_dtype_steps():
    """divergence() names the first new token where two generations differ (the earliest column over every row),
    and measures the two tokens' eager logits there in steps of the logits' dtype: bf16 logits 4.0 and 4 - 1/32
    are one step apart (bf16 spacing between 4 and 8 is 1/32); 4.0 and 3.5 are 16."""
    import torch

    example = _generate_example()
    calls = []

    class Out:
        def __init__(self, logits):
            self.logits = logits

    class Model:
        device = torch.device("cpu")

        def forward(self, input_ids, use_cache, logits_to_keep):
            calls.append((input_ids.clone(), use_cache, logits_to_keep))
            logits = torch.zeros(1, input_ids.shape[1], 10, dtype=torch.bfloat16)
            logits[0, -1, 5], logits[0, -1, 7], logits[0, -1, 2] = 4.0, 4.0 - 1 / 32, 3.5
            return Out(logits)

        def __call__(self, **kwargs):  # divergence must use the class's forward, not a compiled instance attribute
            raise AssertionError("called the instance")

    context = 3
    a = torch.tensor([[1, 2, 3, 5, 5, 5, 5], [1, 2, 4, 5, 5, 5, 5]])
    assert example.divergence(Model(), a, a.clone(), context) is None
    b = a.clone()
    b[0, 5] = 7  # row 0 differs at new token 2 ...
    b[1, 4] = 7  # ... row 1 earlier, at new token 1: that one is reported
    d = example.divergence(Model(), a, b, context)
    assert (d["new_token"], d["row"], d["tokens"]) == (1, 1, (5, 7))
    assert torch.equal(calls[-1][0], a[1:2, :4]) and calls[-1][1] is False  # the shared prefix, teacher-forced
    assert calls[-1][2] == 1  # only the last position's logits are computed
    assert d["eager_logit_gap"] == 1 / 32 and d["gap_in_steps"] == 1.0
    assert d["eager_top2_margin"] == 1 / 32
    b[1, 4] = 2
    d = example.divergence(Model(), a, b, context)
    assert d["tokens"] == (5, 2) and d["gap_in_steps"] == 16.0
    assert "from new token 1 (row 1: tokens 5 / 2" in example.describe(d) and "16 step(s)" in example.describe(d)


def test_divergence_on_a_real_model_gives_eager_logits_of_the_shared_prefix():
    """On the tiny random Qwen3-MoE: generation a is eager's greedy output, b replaces one new token by eager's
    runner-up there; divergence reports that token, a gap equal to eager's top-2 margin at that position (a is the
    argmax), and does not depend on a compiled model.forward set on the instance."""
    import torch

    example = _generate_example()
    model = example.build_model("tiny", torch.float32, "cpu", 64)
    prompt = torch.randint(1, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    a = example.generate_once(model, prompt, 6).cpu()
    with torch.inference_mode():
        logits = model(input_ids=a[:, :15]).logits[0, -1]
    top2 = logits.topk(2)
    assert int(top2.indices[0]) == int(a[0, 15])  # the static-cache generate agrees with a no-cache forward here
    b = a.clone()
    b[0, 15] = int(top2.indices[1])
    model.forward = lambda *args, **kwargs: (_ for _ in ()).throw(AssertionError("the instance's forward"))
    d = example.divergence(model, a, b, 12)
    assert d["new_token"] == 3 and d["tokens"] == (int(a[0, 15]), int(top2.indices[1]))
    margin = float(top2.values[0] - top2.values[1])
    assert abs(d["eager_logit_gap"] - margin) <= 1e-5 * max(1.0, abs(margin))
    assert d["gap_in_steps"] > 0


def test_only_a_bf16_divergence_at_a_near_tie_is_accepted():
    """The example's exit code: a bf16 generation that first differs where eager's logits of the two tokens are at
    most NEAR_TIE_STEPS bf16 steps apart is accepted; 3 steps apart, or any difference in fp32, is a failure."""
    import torch

    example = _generate_example()

    def result(steps):
        r = example.Result("rubin", torch.zeros(1, 4), 1.0, 1.0, 1.0, 1.0, "inductor", False)
        r.divergence = {"gap_in_steps": steps}
        return r

    assert example.NEAR_TIE_STEPS == 2
    assert example.near_tie(result(0.0), torch.bfloat16) and example.near_tie(result(2.0), torch.bfloat16)
    assert not example.near_tie(result(3.0), torch.bfloat16)
    assert not example.near_tie(result(0.0), torch.float32)


@pytest.mark.parametrize("dynamic", ["example's", False], ids=["example", "dynamic-false"])
def test_gpt_oss_model_forward_compiles_once_for_the_decode_steps(dynamic):
    """The model.forward way for GPT-OSS: transformers' sliding-window cache layer keeps its length as a Python int,
    which a static compile guards on, so with ``dynamic=False`` each of the 7 decode steps of 8 new tokens compiles
    again (any backend: here Dynamo's eager backend), 8 graphs with the prefill's; with the example's
    ``forward_dynamic`` (None for a model with sliding layers) the decode step's graph has the length symbolic (it
    changed from the prefill's 0): 2 graphs. A model without sliding layers keeps ``dynamic=False``."""
    import torch

    example = _generate_example()
    model = example.build_model("gpt-oss-tiny", torch.float32, "cpu", 64)
    assert example.forward_dynamic(model) is None
    assert example.forward_dynamic(example.build_model("tiny", torch.float32, "cpu", 64)) is False
    prompt = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    want = example.generate_once(model, prompt, 8)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    flag = example.forward_dynamic(model) if dynamic == "example's" else dynamic
    model.forward = torch.compile(model.forward, backend="eager", dynamic=flag)
    try:
        got = example.generate_once(model, prompt, 8)
    finally:
        model.__dict__.pop("forward", None)
        torch._dynamo.reset()
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == (2 if dynamic == "example's" else 8), dict(counters["stats"])
