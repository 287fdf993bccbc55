"""benchmarks/moe_heuristic.py on the CPU: its file names and its table (the timing itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_heuristic

        yield moe_heuristic
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_files_are_named_after_the_gpu_that_ran(bench):
    import gpu_names

    assert gpu_names.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert gpu_names.gpu_slug("NVIDIA H200") == "h200"  # the names of every earlier H200 result
    assert gpu_names.gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert gpu_names.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    assert gpu_names.gpu_slug() == "cpu"  # no GPU visible (the CPU tests)
    # no benchmark writes a name with the H200 in it on other GPUs
    for path in (ROOT / "benchmarks").glob("*.py"):
        for line in path.read_text().splitlines():
            if "write_text" in line or "savefig" in line or "stem = " in line:
                assert "h200" not in line, (path.name, line)


def test_held_out_shapes_are_not_tuned(bench):
    from rubin_compile.kernels.triton import moe as tmoe
    from rubin_compile.kernels.triton.moe_choice import table_key

    configs = tmoe.load_config_table("NVIDIA H200")["configs"]
    for sh in bench.HELD_OUT.values():
        for w in ("bf16", "fp8_block"):
            assert table_key(sh["E"], sh["H"], sh["I"], sh["k"], w) not in configs


def test_markdown_gives_every_row_its_ratios_and_errors(bench):
    row = dict(shape="qwen3-235b-a22b", wfmt="bf16", T=1024, rubin_runs="heuristic", persistent_rel_err=2.5e-3)
    row["us"] = {"decode_tiles": 900.0, "persistent": 450.0, "aten": 600.0}
    row["errors"] = {}
    bad = dict(row, T=4096, us={"decode_tiles": 1800.0}, errors={"persistent": "RuntimeError: boom"})
    bad.pop("persistent_rel_err")
    result = dict(device="NVIDIA H100 80GB HBM3", date="2026-12-05", torch="2.11", triton="3.6", commit="abc")
    result.update(method="m", probe_t=512, rows=[row, bad])
    md = bench.markdown(result)
    assert (
        "| qwen3-235b-a22b | bf16 | 1024 | 900.0 | 450.0 | - | 600.0 | 2.00x | 1.33x | - | 2.5e-03 | heuristic |" in md
    )
    assert "| qwen3-235b-a22b | bf16 | 4096 | 1800.0 | - | - | - | - | - | - | - | heuristic |" in md
    assert "- qwen3-235b-a22b bf16 T=4096: {'persistent': 'RuntimeError: boom'}" in md


def test_no_benchmark_shadows_a_dependency():
    """A script run from benchmarks/ has that folder first on sys.path (and the benchmarks that import their
    neighbours put it there): a file named like a dependency's package would be imported in its place (until 2026-12-05
    the FlashInfer benchmark, now flashinfer_kernels, was named flashinfer, and was, for every benchmark that reached
    rubin's FlashInfer provider)."""
    dependencies = {"torch", "triton", "flashinfer", "cutlass", "cuda", "vllm", "transformers", "pytest", "numpy"}
    names = {p.stem for p in (ROOT / "benchmarks").rglob("*.py")} | {p.name for p in (ROOT / "benchmarks").iterdir()}
    assert not names & dependencies, names & dependencies
