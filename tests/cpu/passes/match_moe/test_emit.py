"""passes/match_moe/emit.py: ``reference_only_reason``, the rule that keeps a block as written on a CUDA target when
only the reference (a loop over the experts) would run its rubin.moe, for activations and for the optional
semantics a kernel must declare (``Kernel.features``: the router weight on the input)."""

from __future__ import annotations

import pytest

from rubin_compile.ops.moe import MOE, ROUTER_WEIGHT_ON_INPUT
from rubin_compile.ops.registry import KernelSpec
from rubin_compile.passes.match_moe.emit import reference_only_reason
from rubin_compile.target import resolve

SIZES = {"E": 16, "H": 512, "I": 256, "k": 1}
SM90, CPU = resolve("sm90"), resolve("cpu")


def chosen(activation: str, features: tuple = (), dtype: str = "bfloat16") -> str:
    spec = KernelSpec(
        op="moe",
        act_dtype=dtype,
        weight_dtype=dtype,
        shape=tuple(SIZES.items()),
        activation=activation,
        features=features,
    )
    return MOE.select(spec, SM90).chosen.name


def test_the_premise_a_gpu_kernel_takes_silu_but_not_the_router_weight_on_input():
    """What the tests below rest on, read off the registry: on sm90 in bf16 a GPU kernel takes a plain silu block,
    and every GPU kernel rejects the router weight on the input (none declares it), leaving the reference."""
    assert chosen("silu") != "reference"
    assert chosen("silu", (ROUTER_WEIGHT_ON_INPUT,)) == "reference"


def test_router_weight_on_input_alone_keeps_the_block_on_a_gpu_target():
    """Before: the rule looked at the activation only, so a silu block weighted on the input was rewritten for sm90
    and then ran the reference there."""
    assert reference_only_reason(SM90, "bfloat16", "bfloat16", SIZES, "silu") is None
    why = reference_only_reason(SM90, "bfloat16", "bfloat16", SIZES, "silu", (ROUTER_WEIGHT_ON_INPUT,))
    assert why is not None and f"only the reference implements {ROUTER_WEIGHT_ON_INPUT} (" in why
    assert f"triton does not implement {ROUTER_WEIGHT_ON_INPUT}" in why and "so the block stays" in why
    assert "activation silu" not in why  # the activation is not to blame


def test_the_reason_names_what_is_to_blame():
    both = reference_only_reason(SM90, "bfloat16", "bfloat16", SIZES, "swigluoai", (ROUTER_WEIGHT_ON_INPUT,))
    assert f"only the reference implements activation swigluoai and {ROUTER_WEIGHT_ON_INPUT}" in both
    activation = reference_only_reason(SM90, "bfloat16", "bfloat16", SIZES, "swigluoai")
    assert "only the reference implements activation swigluoai (" in activation


@pytest.mark.parametrize(
    "target, dtype", [(CPU, "bfloat16"), (SM90, "float32")], ids=["cpu-target", "sm90-fp32-reference-anyway"]
)
def test_no_reason_where_the_reference_runs_anyway(target, dtype):
    """On the CPU the reference is rubin.moe's kernel for these; in fp32 on sm90 the reference runs every block
    (no GPU kernel takes fp32), so the rewrite changes nothing there: both rewritten, as before."""
    assert reference_only_reason(target, dtype, dtype, SIZES, "silu", (ROUTER_WEIGHT_ON_INPUT,)) is None
