"""How rubin's ops are defined (rubin_compile/ops/library.py): through torch.library.Library with the schema inferred
from the function, a fake implementation, callable through the op object; without an autograd formula, so a call on
inputs that require grad returns outputs whose backward raises a clear error (as custom_op's did), and a call under
no_grad returns plain tensors."""

from __future__ import annotations

import pytest
import torch

import rubin_compile  # noqa: F401  (defines the ops)
from rubin_compile import RubinError
from rubin_compile.ops import attention, weights
from rubin_compile.ops.library import RubinGradError


def test_schema_is_inferred_from_the_function():
    schema = str(torch.ops.rubin.attention.default._schema)
    assert schema.startswith("rubin::attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None")
    assert schema.endswith('str impl="reference", bool pdl=False) -> Tensor')
    assert not any(a.alias_info for a in torch.ops.rubin.attention.default._schema.arguments)  # functional


def test_the_op_object_calls_the_op_and_its_fake_runs_on_meta():
    q = torch.randn(1, 4, 1, 8)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert torch.equal(attention.attention(q, k, v), torch.ops.rubin.attention.default(q, k, v))
    out = torch.ops.rubin.attention.default(q.to("meta"), k.to("meta"), v.to("meta"))
    assert out.device.type == "meta" and out.shape == (1, 4, 1, 8)


def test_inputs_that_require_grad_give_outputs_whose_backward_raises():
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(2, 4))
    weights.clear_cache()
    out = torch.ops.rubin.stacked_weights([a, b])
    assert out.requires_grad and torch.equal(out.detach(), torch.cat([a.detach(), b.detach()]))
    with pytest.raises(RubinGradError, match=r"rubin.stacked_weights has no backward.*torch.no_grad\(\)") as err:
        out.sum().backward()
    assert isinstance(err.value, RubinError) and isinstance(err.value, RuntimeError)
    with torch.no_grad():
        assert not torch.ops.rubin.stacked_weights([a, b]).requires_grad


def test_a_tuple_result_is_wrapped_per_tensor():
    x = torch.randn(2, 16, requires_grad=True)
    w = torch.randn(4, 16)
    topk_weights, topk_ids = torch.ops.rubin.route.default(x, w, 2)
    assert topk_weights.requires_grad and topk_ids.dtype == torch.int32
    with pytest.raises(RubinGradError, match="rubin.route has no backward"):
        topk_weights.sum().backward()
