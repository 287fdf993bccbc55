"""runtime/locality.py without a GPU: domain plans per target, locality modes, split bounds, and the
weight-shard cache (copies with localised memory, views without). Placement strings: tests/cpu/ops/test_registry.py."""

from __future__ import annotations

import pytest
import torch

from rubin_compile.runtime import locality
from rubin_compile.runtime.locality import DomainPlan
from rubin_compile.target import locality_mode, resolve

HBM = "HBM locality domains (FlashInfer locality_domain, CUDA 13.4)"
GREEN = "green contexts (SM partitions)"


def test_plan_cpu_is_one_domain():
    for mode in ("default", "backfill", "strict"):
        p = locality.plan(resolve("cpu"), mode)
        assert p == DomainPlan(1, locality_mode(mode), (0,), 0, False, "CPU: one domain, the current stream")


def test_plan_sm90_green_contexts():
    sm90 = resolve("sm90")
    assert locality.plan(sm90, "default") == DomainPlan(2, "default", (64, 64), 4, False, GREEN)
    assert locality.plan(sm90, "backfill") == DomainPlan(2, "backfill", (64, 68), 0, False, GREEN)
    assert locality.plan(sm90, "strict") == locality.plan(sm90, "default")
    assert locality.plan(sm90, "default", 3) == DomainPlan(3, "default", (40, 40, 40), 12, False, GREEN)
    assert locality.plan(sm90, "backfill", 3) == DomainPlan(3, "backfill", (40, 40, 52), 0, False, GREEN)
    assert locality.plan(sm90, "default").describe() == (
        "2 domains x 64/64 SMs (default, 4 SMs idle; memory un-localised; green contexts (SM partitions))"
    )
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        locality.plan(sm90, "default", 0)
    with pytest.raises(ValueError, match="cannot split 132 SMs into 20 green-context domains of at least 8"):
        locality.plan(sm90, "default", 20)


def test_plan_sm107_hbm_domains():
    sm107 = resolve("sm107")
    strict = DomainPlan(2, "default", (100, 100), 12, True, HBM)
    backfill = DomainPlan(2, "backfill", (106, 106), 0, True, HBM)
    assert locality.plan(sm107, "strict") == strict == locality.plan(sm107, "default", 2)
    assert locality.plan(sm107, "backfill") == backfill == locality.plan(sm107, "backfill", 2)
    assert locality.plan(sm107) == backfill  # backfill is the default mode
    assert backfill.describe() == (
        "2 domains x 106/106 SMs (backfill; localised memory; HBM locality domains "
        "(FlashInfer locality_domain, CUDA 13.4))"
    )
    assert strict.describe() == (
        "2 domains x 100/100 SMs (default, 12 SMs idle; localised memory; HBM locality "
        "domains (FlashInfer locality_domain, CUDA 13.4))"
    )


def test_plan_sm107_with_other_domain_counts_uses_green_contexts():
    sm107 = resolve("sm107")
    # 212 // 4 = 53 SMs, rounded down to a multiple of 8: 48 each, 192 in all
    source = "green contexts (SM partitions) not matching the HBM domains"
    assert locality.plan(sm107, "default", 4) == DomainPlan(4, "default", (48, 48, 48, 48), 20, False, source)
    assert locality.plan(sm107, "backfill", 4) == DomainPlan(4, "backfill", (48, 48, 48, 68), 0, False, source)
    assert locality.plan(sm107, "default", 3) == DomainPlan(3, "default", (64, 64, 64), 20, False, source)


def test_green_context_split():
    assert locality.green_context_split(132, 2, "default") == (64, 64)
    assert locality.green_context_split(132, 2, "backfill") == (64, 68)
    assert locality.green_context_split(212, 2, "strict") == (104, 104)
    assert locality.green_context_split(212, 4, "default") == (48, 48, 48, 48)
    assert locality.green_context_split(16, 2, "default") == (8, 8)
    with pytest.raises(ValueError, match="cannot split 15 SMs into 2"):
        locality.green_context_split(15, 2, "default")


def test_locality_mode():
    assert locality_mode("strict") == "default"
    assert locality_mode(" Strict ") == "default"
    assert locality_mode("BACKFILL") == "backfill"
    assert locality_mode("default") == "default"
    for bad in ("auto", "off", "whole", ""):
        with pytest.raises(ValueError, match=rf"unknown locality mode {bad!r}; use one of \('default', 'backfill'\)"):
            locality_mode(bad)
    with pytest.raises(ValueError, match="unknown locality mode 'auto'"):
        locality.plan(resolve("sm90"), "auto")


def test_split_bounds():
    assert locality.split_bounds(768, 2) == [(0, 384), (384, 768)]
    assert locality.split_bounds(256, 2) == [(0, 128), (128, 256)]
    assert locality.split_bounds(640, 2) == [(0, 256), (256, 640)]  # shares of 128 rows; the last takes the rest
    assert locality.split_bounds(1536, 4) == [(0, 384), (384, 768), (768, 1152), (1152, 1536)]
    assert locality.split_bounds(192, 2) is None  # 96-row shares
    assert locality.split_bounds(128, 2) is None
    assert locality.split_bounds(320, 2) is None  # not a multiple of 128
    assert locality.split_bounds(96, 2, align=16) == [(0, 48), (48, 96)]


def test_split_n_unsupported():
    assert locality.split_n_unsupported(None, 256, 256, 2, None) is None
    assert locality.split_n_unsupported(None, 256, 256, 2, (128, 128)) is None
    assert (
        locality.split_n_unsupported(None, 192, 256, 2, None)
        == "I=192 does not split into 2 shares of a multiple of 128"
    )
    assert (
        locality.split_n_unsupported(None, 256, 320, 2, None)
        == "H=320 does not split into 2 shares of a multiple of 128"
    )
    assert locality.split_n_unsupported(None, 256, 256, 1, None) == "1 domain(s): nothing to split"
    assert locality.split_n_unsupported(None, 768, 768, 2, (96, 96)) == (
        "block scales of [96, 96] do not align with the 128-row shards"
    )


# ------------------------------------------------------------------------------------------------
# weight shards
# ------------------------------------------------------------------------------------------------


def test_sequential_domains():
    dom = locality.sequential(2, torch.device("cpu"), localized_memory=True)
    assert dom.count == 2 and dom.streams == (None, None) and dom.plan.localized_memory is True
    assert dom.plan == DomainPlan(2, "default", (0, 0), 0, True, "sequential (one stream)")
    t = dom.empty(1, (3, 4), torch.bfloat16)
    assert t.shape == (3, 4) and t.dtype == torch.bfloat16 and t.device.type == "cpu"


def test_localized_shards_are_cached_copies_with_gate_and_up_rows():
    E, I, H = 3, 256, 8
    w13 = torch.randn(E, 2 * I, H)
    dom = locality.sequential(2, torch.device("cpu"), localized_memory=True)
    bounds = locality.split_bounds(I, 2)
    assert bounds == [(0, 128), (128, 256)]
    before = dict(locality.SHARD_STATS)

    first = locality.shards(w13, dom, "w13", bounds, up=I)
    assert len(first) == 2
    for (lo, hi), shard in zip(bounds, first):
        want = torch.cat([w13[:, lo:hi], w13[:, I + lo : I + hi]], dim=1)
        assert shard.shape == (E, 2 * (hi - lo), H)
        assert torch.equal(shard, want)
        # a copy: its own storage, not a view of the weight
        assert shard.untyped_storage().data_ptr() != w13.untyped_storage().data_ptr()
    assert torch.equal(first[0][:, :128], w13[:, :128]) and torch.equal(first[0][:, 128:], w13[:, 256:384])
    assert torch.equal(first[1][:, :128], w13[:, 128:256]) and torch.equal(first[1][:, 128:], w13[:, 384:512])
    assert locality.SHARD_STATS["misses"] == before["misses"] + 1

    second = locality.shards(w13, dom, "w13", bounds, up=I)
    assert len(second) == 2 and all(a is b for a, b in zip(second, first))  # the same shard tensors
    assert locality.SHARD_STATS["hits"] == before["hits"] + 1
    assert locality.SHARD_STATS["misses"] == before["misses"] + 1

    # an in-place update bumps the weight's _version: new shards with the new values
    version = w13._version
    w13.add_(1)
    assert w13._version > version
    third = locality.shards(w13, dom, "w13", bounds, up=I)
    assert all(a is not b for a, b in zip(third, first))
    assert locality.SHARD_STATS["misses"] == before["misses"] + 2
    assert locality.SHARD_STATS["hits"] == before["hits"] + 1
    for (lo, hi), shard, old in zip(bounds, third, first):
        assert torch.equal(shard, torch.cat([w13[:, lo:hi], w13[:, I + lo : I + hi]], dim=1))
        assert torch.equal(shard, old + 1)
    assert all(a is b for a, b in zip(locality.shards(w13, dom, "w13", bounds, up=I), third))
    assert locality.SHARD_STATS["hits"] == before["hits"] + 2


def test_localized_fc2_shards_take_rows_only():
    E, H, I = 2, 256, 16
    w2 = torch.randn(E, H, I)
    dom = locality.sequential(2, torch.device("cpu"), localized_memory=True)
    bounds = locality.split_bounds(H, 2)
    out = locality.shards(w2, dom, "w2", bounds)
    assert [tuple(s.shape) for s in out] == [(E, 128, I), (E, 128, I)]
    assert torch.equal(out[0], w2[:, :128]) and torch.equal(out[1], w2[:, 128:])
    # another domain object or kind is another cache entry
    other = locality.sequential(2, torch.device("cpu"), localized_memory=True)
    assert locality.shards(w2, other, "w2", bounds)[0] is not out[0]
    assert locality.shards(w2, dom, "w2_bias", bounds)[0] is not out[0]
    assert locality.shards(w2, dom, "w2", bounds)[0] is out[0]


def test_uniform_memory_shards_are_views():
    E, I, H = 3, 256, 8
    w13 = torch.randn(E, 2 * I, H)
    dom = locality.sequential(2, torch.device("cpu"), localized_memory=False)
    bounds = locality.split_bounds(I, 2)
    before = dict(locality.SHARD_STATS)
    views = locality.shards(w13, dom, "w13", bounds, up=I)
    assert len(views) == 2
    elt = w13.element_size()
    for (lo, _), v in zip(bounds, views):
        assert v.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
        assert v.data_ptr() == w13.data_ptr() + lo * w13.stride(1) * elt
        assert v.stride() == w13.stride()
        assert v.shape == (E, 2 * I - lo, H)  # from the domain's first row on; the kernel bounds the count
        assert torch.equal(v, w13[:, lo:])
    w13[0, 200, 0] = 42.0  # a view sees writes to the weight
    assert views[1][0, 72, 0].item() == 42.0
    assert locality.SHARD_STATS == before  # views are not cached


def test_shards_of_nothing():
    dom = locality.sequential(2, torch.device("cpu"), localized_memory=True)
    assert locality.shards(None, dom, "w13_bias", [(0, 128), (128, 256)]) is None
    assert locality.shards(torch.ones(4), dom, "w2_scale", [(0, 128), (128, 256)]) is None
