"""Targets as data: the named GPUs, their SM layouts and features, resolve() and detect()."""

import pytest
import torch

from rubin_compile import target as T


def test_rubin_has_two_locality_domains_in_both_modes():
    rubin = T.resolve("sm107")
    assert rubin.compute_capability == (10, 7) and rubin.cc == 107 and rubin.sm_count == 212
    domains = rubin.locality_domains
    assert domains.count == 2
    assert domains.strict == (100, 100) and sum(domains.strict) == 200  # odd SMs left out
    assert domains.backfill == (106, 106) and sum(domains.backfill) == rubin.sm_count
    assert rubin.tcgen05 and rubin.two_cta_clusters and rubin.nvfp4 and rubin.mxfp4 and rubin.pdl


def test_named_targets_and_their_features():
    h200, b200, b300, cpu = (T.resolve(n) for n in ("sm90", "sm100", "sm103", "cpu"))
    assert (h200.cc, h200.sm_count) == (90, 132)
    assert h200.fp8 and h200.pdl and h200.green_contexts
    assert not (h200.nvfp4 or h200.mxfp4 or h200.tcgen05 or h200.two_cta_clusters)
    assert h200.locality_domains is None
    for blackwell in (b200, b300):
        assert blackwell.tcgen05 and blackwell.nvfp4 and blackwell.locality_domains is None
    assert (b200.cc, b300.cc) == (100, 103)
    assert not cpu.is_cuda and cpu.cc is None and cpu.sm_count == 0 and not cpu.pdl
    assert T.resolve("sm107").features()["locality_domains"] == {"strict": (100, 100), "backfill": (106, 106)}


@pytest.mark.parametrize(
    "alias, name",
    [
        ("sm_107", "sm107"),
        ("SM107", "sm107"),
        ("rubin", "sm107"),
        ("h200", "sm90"),
        ("sm_90", "sm90"),
        ("b300", "sm103"),
        ("sm100", "sm100"),
        ("cpu", "cpu"),
    ],
)
def test_aliases(alias, name):
    assert T.resolve(alias).name == name


def test_unknown_target_lists_the_valid_ones():
    with pytest.raises(
        T.UnknownTargetError, match=r"unknown rubin target 'sm999'.*auto.*cpu.*sm90.*sm100.*sm103.*sm107"
    ):
        T.resolve("sm999")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks detection on a machine without CUDA")
def test_auto_is_the_cpu_without_a_gpu():
    assert T.detect().name == "cpu"
    assert T.resolve("auto") is T.detect() and T.resolve(None) is T.detect()
