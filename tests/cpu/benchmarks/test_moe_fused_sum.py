"""benchmarks/moe_fused_sum.py on the CPU: how a run's measurements reach the tuned table (--apply); the timing itself
needs a GPU (tests/gpu/test_triton_moe.py tests the epilogue sum's values)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TABLE = ROOT / "rubin_compile" / "kernels" / "triton" / "moe_configs" / "NVIDIA_H200.json"
QWEN3 = "E=128,H=2048,I=768,k=8,w=bf16"


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("triton", reason="the benchmark imports the Triton MoE's tuner")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_fused_sum

        yield moe_fused_sum
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _row(T, unfused, fused, wins=True, equal=True, source=None, **extra):
    return dict(
        shape="qwen3-30b-a3b",
        format="bf16",
        T=T,
        source=source or f"table:{QWEN3}@T={T}",
        unfused_us=unfused,
        fused_us=fused,
        speedup=round(unfused / fused, 4),
        fused_wins_every_round=wins,
        bitwise_equal=equal,
        **extra,
    )


def test_apply_sets_the_epilogue_sum_only_where_it_measured_faster_on_the_tables_gpu(bench, tmp_path):
    table = tmp_path / "NVIDIA_H200.json"
    shutil.copy(TABLE, table)
    before = json.loads(table.read_text())["configs"]
    assert before[QWEN3]["4096"]["mode"] == "persistent" and "epilogue_sum" not in before[QWEN3]["4096"]["fc2"]
    rows = [
        _row(4096, 700.0, 650.0),  # 1.077x, every round: set
        _row(1024, 370.0, 366.0),  # 1.011x: below the margin
        _row(512, 340.0, 320.0, wins=False),  # lost a round
        _row(256, 300.0, 280.0, equal=False),  # values differ
        _row(2048, 500.0, 450.0, source=f"table:{QWEN3}@T=1024"),  # ran the T = 1024 entry: not this T's
        dict(shape="qwen3-30b-a3b", format="bf16", T=64, config="grouped", source="", skipped="mode 'grouped'"),
    ]
    said = bench.apply({"device": "NVIDIA H200", "rows": rows}, table, 1.02, "abc1234")
    after = json.loads(table.read_text())["configs"]
    assert after[QWEN3]["4096"]["fc2"]["epilogue_sum"] is True and after[QWEN3]["4096"]["us"] == 650.0
    assert "abc1234" in after[QWEN3]["4096"]["measured_by"] and "700.0 us" in after[QWEN3]["4096"]["measured_by"]
    for t in ("1024", "512", "256"):
        assert after[QWEN3][t] == before[QWEN3][t], t
    assert len(said) == len(rows) and said[0].endswith("epilogue_sum set (700.0 -> 650.0 us)")
    assert "median 1.011x" in said[1]
    assert "not faster in every round" in said[2]
    assert "outputs differ" in said[3] and "not the table's entry at T=2048" in said[4] and "not compared" in said[5]
    # the table's entry still builds, with the epilogue sum on
    from rubin_compile.kernels.triton import moe as tmoe

    assert tmoe.MoEConfig.from_json(after[QWEN3]["4096"]).fc2.epilogue_sum


def test_apply_refuses_another_gpus_run(bench, tmp_path):
    table = tmp_path / "NVIDIA_H200.json"
    shutil.copy(TABLE, table)
    said = bench.apply({"device": "NVIDIA H100 80GB HBM3", "rows": [_row(4096, 700.0, 600.0)]}, table, 1.02, "x")
    assert "measured on NVIDIA H100 80GB HBM3, the table is NVIDIA H200's" in said[0]
    assert json.loads(table.read_text()) == json.loads(TABLE.read_text())
