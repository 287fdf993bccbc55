"""torch.compile(backend="rubin"): registration, options, pass-through of what we do not rewrite."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import assert_close_to_eager


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
    assert isinstance(patches["post_grad_custom_post_pass"], PassManager)
    # a user's own post-grad pass keeps running, before ours
    seen = []
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda g: seen.append(g)):
        torch._dynamo.reset()
        f = torch.compile(lambda x: x * 3, backend="rubin")
        f(torch.randn(4))
    assert len(seen) == 1
