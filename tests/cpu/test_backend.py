"""torch.compile(backend="rubin"): registration, options, pass-through of what we do not rewrite."""

import os
import subprocess
import sys
import textwrap

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_close_to_eager

ROOT = Path(__file__).resolve().parents[2]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unmatched_model_equals_inductor(rubin_run, dtype):
    model = Block().to(dtype).eval()
    x = torch.randn(3, 5, 32, dtype=dtype)
    with torch.no_grad():
        got = rubin_run.compile(model)(x)
        torch._dynamo.reset()
        want = torch.compile(model, backend="inductor")(x)
    assert_close_to_eager(got, want)
    assert rubin_run.rewrites() == []
    assert len(rubin_run.reports()) == 1


def test_backend_found_without_importing_the_package(tmp_path):
    """The entry point makes backend="rubin" work in a process that never imports rubin_compile."""
    script = textwrap.dedent("""
        import sys, torch
        f = torch.compile(lambda x: torch.sin(x) * 2, backend="rubin")
        x = torch.randn(8)
        assert torch.allclose(f(x), torch.sin(x) * 2)
        print("rubin_compile imported by the entry point:", "rubin_compile" in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUBIN_")}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "imported by the entry point: True" in out.stdout


def test_unknown_option_is_a_clear_error():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="rubin", options={"dump": "/tmp/x"})
    with pytest.raises(Exception, match=r"unknown rubin option 'dump'; valid options are \['dump_dir'"):
        f(torch.randn(3))


def test_inductor_settings_and_mode_pass_through():
    from rubin_compile.backend import inductor_config_patches
    from rubin_compile.options import RubinOptions
    from rubin_compile.passes.manager import PassManager

    patches = inductor_config_patches(
        RubinOptions.resolve({"inductor": {"max_autotune": True}}, environ={}), "reduce-overhead"
    )
    assert patches["max_autotune"] is True and patches["triton.cudagraphs"] is True
    # Inductor's benchmark-driven GEMM padding is off (the graph our passes see must not depend on timing), unless
    # the user turns it back on
    assert patches["shape_padding"] is False
    theirs = RubinOptions.resolve({"inductor": {"shape_padding": True}}, environ={})
    assert inductor_config_patches(theirs, None)["shape_padding"] is True
    assert isinstance(patches["post_grad_custom_post_pass"], PassManager)
    # a user's own post-grad pass keeps running, before ours
    seen = []
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda g: seen.append(g)):
        torch._dynamo.reset()
        f = torch.compile(lambda x: x * 3, backend="rubin")
        f(torch.randn(4))
    assert len(seen) == 1


def test_readme_model_at_two_sequence_lengths_and_dynamic(tmp_path):
    """The README's example model called at sequence 16, then 24 (a recompile with a symbolic T), and compiled with
    dynamic=True: before, the second shape failed with "Cannot access data pointer of Tensor (FakeTensor)"."""
    from tests.conftest import check_two_shapes_and_dynamic

    sys.path.insert(0, str(ROOT / "examples"))
    from standalone_moe import TinyMoEModel

    model = TinyMoEModel().eval()
    check_two_shapes_and_dynamic(
        tmp_path, model, lambda s: (torch.randint(0, 512, (2, s)),), (16, 24), "match_moe", "rubin.moe"
    )


def test_a_report_that_cannot_be_written_never_fails_the_compile(rubin_run, monkeypatch):
    """Dumping and reporting are best effort: the error is logged and recorded, the compile goes on."""
    from rubin_compile.debug.dump import GraphDump
    from rubin_compile.passes.base import Rewrite, jsonable

    def broken(self, report):
        raise OSError("disk full")

    monkeypatch.setattr(GraphDump, "write_report", broken)
    model = Block().eval()
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        assert_close_to_eager(rubin_run.compile(model)(x), model(x))
    assert list(rubin_run.dump_dir.glob("*/report.json")) == []
    # report values are made JSON-able field by field: symbolic sizes become their text
    shape_env = torch.fx.experimental.symbolic_shapes.ShapeEnv()
    s = shape_env.create_unbacked_symint()
    assert jsonable(Rewrite("n", "rubin.moe", "loop", ["a"], {"T": s, "shape": (s, 4), "dtype": torch.bfloat16})) == {
        "node": "n",
        "canonical_op": "rubin.moe",
        "source_idiom": "loop",
        "replaced": ["a"],
        "details": {"T": str(s), "shape": [str(s), 4], "dtype": "bfloat16"},
    }


def test_rubin_errors_reach_the_user_as_themselves():
    """A rubin error raised while compiling (strict mode, a bad option) used to arrive as Dynamo's
    BackendCompilerFailed / Inductor's InductorError, whose first line was theirs. Now the message starts with
    rubin's error, and it is caught as that error, as RubinError and as BackendCompilerFailed."""
    from torch._dynamo.exc import BackendCompilerFailed

    from rubin_compile import RubinError, RubinOptionsError, RubinStrictError
    from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE

    model = LoopMoE(act="relu").eval()  # ReLU: recognised, left unchanged with the reason
    torch._dynamo.reset()
    with pytest.raises(RubinStrictError) as err, torch.no_grad():
        torch.compile(model, backend="rubin", options={"strict": True})(torch.randn(5, 32))
    first = str(err.value).splitlines()[0]
    assert first.startswith("RubinStrictError: rubin (strict): 1 recognised idiom(s)"), first
    assert isinstance(err.value, RubinError) and isinstance(err.value, BackendCompilerFailed)
    assert isinstance(err.value.inner_exception, RubinStrictError)
    torch._dynamo.reset()
    with pytest.raises(RubinOptionsError) as err:
        torch.compile(model, backend="rubin", options={"stict": True})(torch.randn(5, 32))
    assert str(err.value).startswith("RubinOptionsError: unknown rubin option 'stict'")
    torch._dynamo.reset()
