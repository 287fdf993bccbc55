"""rubin.stacked_weights: torch.cat once, reused while every part is the same unchanged tensor."""

from __future__ import annotations

import torch

from rubin_compile.ops import weights


def test_concatenates_and_reuses_while_the_parts_are_unchanged():
    weights.clear_cache()
    parts = [torch.randn(3, 4) for _ in range(3)]
    first = torch.ops.rubin.stacked_weights(parts)
    assert torch.equal(first, torch.cat(parts))
    again = torch.ops.rubin.stacked_weights(parts)
    assert again is first and weights.cache_info()["hits"] >= 1
    parts[1].add_(1.0)  # an in-place update (load_state_dict does the same) bumps the version: recomputed
    updated = torch.ops.rubin.stacked_weights(parts)
    assert updated is not first and torch.equal(updated, torch.cat(parts))


def test_parameters_cast_in_place_are_stacked_again():
    """``Module.to(dtype)`` swaps each parameter's data (same object, same version): the stacked copy is made again
    in the new dtype, not served from before the cast."""
    weights.clear_cache()
    module = torch.nn.Module()
    module.a, module.b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(2, 4))
    parts = [module.a, module.b]
    assert torch.ops.rubin.stacked_weights(parts).dtype == torch.float32
    module.to(torch.bfloat16)
    again = torch.ops.rubin.stacked_weights(parts)
    assert again.dtype == torch.bfloat16 and torch.equal(again, torch.cat([p.detach() for p in parts]))
    module.a.data = torch.randn(3, 4, dtype=torch.bfloat16)  # new data, same dtype and shape
    assert torch.equal(torch.ops.rubin.stacked_weights(parts), torch.cat([p.detach() for p in parts]))


def test_other_tensors_at_a_reused_address_are_not_served_from_the_cache():
    weights.clear_cache()
    parts = [torch.randn(2, 2), torch.randn(2, 2)]
    torch.ops.rubin.stacked_weights(parts)
    del parts
    fresh = [torch.ones(2, 2), torch.zeros(2, 2)]  # may reuse the ids and the memory of the freed ones
    assert torch.equal(torch.ops.rubin.stacked_weights(fresh), torch.cat(fresh))


def test_fake_impl_and_opcheck():
    parts = [torch.randn(2, 5), torch.randn(3, 5)]
    torch.library.opcheck(torch.ops.rubin.stacked_weights.default, (parts,))


def test_inference_tensors_are_kept_by_identity_with_a_warning():
    """Weights made under torch.inference_mode() have no version counter (before: "Inference tensors do not track
    version counter" at run time): the stacked copy is kept while they are the same tensors, and the user is told
    that an in-place update of them is not seen."""
    import pytest

    weights.clear_cache()
    with torch.inference_mode():
        parts = [torch.randn(3, 4) for _ in range(2)]
    with pytest.warns(UserWarning, match="inference tensors .* carry no version counter"):
        first = torch.ops.rubin.stacked_weights(parts)
    assert torch.equal(first, torch.cat(parts))
    assert torch.ops.rubin.stacked_weights(parts) is first


def test_a_model_built_under_inference_mode_runs_compiled(rubin_run):
    """The expert-loop MoE (stacked weights) built and run under inference_mode equals eager."""
    from tests.conftest import assert_close_to_eager
    from tests.cpu.passes.match_moe.test_expert_loop import LoopMoE

    with torch.inference_mode():
        model = LoopMoE().eval()
        x = torch.randn(5, 32)
        compiled = rubin_run.compile(model)
        for _ in range(2):
            assert_close_to_eager(compiled(x), model(x))
    assert len(rubin_run.rewrites()) == 1


def test_made_outside_cudagraph_pools_runs_in_another_thread_and_reraises():
    """The helper that keeps stacked / prepared weights out of cudagraph trees' pool: ``make`` runs in a thread of
    its own (cudagraph trees route the warm-up thread's allocations to their pool), its value comes back, and its
    error is raised in the caller."""
    import threading

    import pytest

    seen = []
    value = weights.made_outside_cudagraph_pools(lambda: seen.append(threading.current_thread().name) or 7)
    assert value == 7 and seen == ["rubin-weights"] and threading.current_thread().name != "rubin-weights"
    # grad mode is per thread: parameters stacked there must not drag an autograd graph along
    w = torch.nn.Parameter(torch.randn(3, 2))
    stacked = weights.made_outside_cudagraph_pools(lambda: torch.cat([w, w]))
    assert not stacked.requires_grad and stacked.grad_fn is None

    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        weights.made_outside_cudagraph_pools(fail)
