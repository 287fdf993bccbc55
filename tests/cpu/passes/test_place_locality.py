"""place_locality: split-N placements per target and mode, the token threshold (static and dynamic T),
shapes that do not split, and the decision details in the report."""

from __future__ import annotations

import pytest
import torch

from rubin_compile.ops.moe import MOE
from rubin_compile.options import RubinOptions
from rubin_compile.passes import place_locality
from rubin_compile.passes.manager import PassManager
from rubin_compile.runtime import locality
from rubin_compile.target import Target, resolve
from tests.conftest import stage_file
from tests.cpu.passes.test_chain_pdl import DirectMoE, compile_for_gpu_target, moe_lines, pass_decisions, pass_notes

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour on a machine without CUDA")

SM107_TRITON = dict(target="sm107", kernels={"moe": "triton"})
SM107_BACKFILL = (
    "2 domains x 106/106 SMs (backfill; localised memory; HBM locality domains (FlashInfer locality_domain, CUDA 13.4))"
)
SM107_STRICT = (
    "2 domains x 100/100 SMs (default, 12 SMs idle; localised memory; HBM locality domains "
    "(FlashInfer locality_domain, CUDA 13.4))"
)
UNIFORM = (
    "locality='auto': sm90 has uniform memory (no HBM locality domains), where a split only adds a fork "
    "and a join; force it with locality='default' or 'backfill'"
)


def _placement(rubin_run):
    """The placement keyword of the one rubin.moe call after place_locality ('' when it has none)."""
    (line,) = moe_lines(rubin_run.stage_code("place_locality"))
    if "placement = '" not in line:
        return ""
    return line.split("placement = '", 1)[1].split("'", 1)[0]


def _decision(rubin_run):
    (d,) = pass_decisions(rubin_run, "place_locality")
    assert d["node"] == "moe" and d["canonical_op"] == "rubin.moe"
    return d


@cpu_only
@pytest.mark.parametrize("locality_opt", ["auto", "backfill"])
def test_sm107_backfill(rubin_run, locality_opt):
    compile_for_gpu_target(rubin_run, DirectMoE(), locality=locality_opt, **SM107_TRITON)
    assert _placement(rubin_run) == "split_n:backfill:2:16"
    (line,) = moe_lines(rubin_run.stage_code("place_locality"))
    assert "impl = 'triton@sm107'" in line and "placement = 'split_n:backfill:2:16'" in line
    d = _decision(rubin_run)
    assert d["decision"] == "split_n:backfill:2:16"
    assert d["reason"] == "decode-sized MoE (T in [4, 4]) on sm107"
    assert d["details"] == {
        "domains": SM107_BACKFILL,
        "FC1 I shares": [128, 128],
        "FC2 H shares": [128, 128],
        "tokens": "always",
        # E * 3 * H * I * 2 bytes = 4 * 3 * 256 * 256 * 2 = 1.5 MiB, printed as "2"
        "shard copies": "2 MiB once per layer (the experts in domain memory)",
    }
    assert "106/106 SMs" in d["details"]["domains"]
    notes = pass_notes(rubin_run, "place_locality")
    assert notes == [
        f"sm107 domains (backfill): {SM107_BACKFILL}",
        f"1 of 1 MoE node(s) split over locality domains (locality={locality_opt!r})",
    ]


@cpu_only
def test_sm107_strict_is_default_mode(rubin_run):
    compile_for_gpu_target(rubin_run, DirectMoE(), locality="strict", **SM107_TRITON)
    assert _placement(rubin_run) == "split_n:default:2:16"
    d = _decision(rubin_run)
    assert d["decision"] == "split_n:default:2:16"
    assert d["details"]["domains"] == SM107_STRICT
    assert "100/100 SMs" in d["details"]["domains"] and "12 SMs idle" in d["details"]["domains"]
    (report,) = rubin_run.reports()
    assert report["options"]["locality"] == "default"


@cpu_only
def test_sm107_off_and_flashinfer_kernel_have_no_placement(rubin_run):
    compile_for_gpu_target(rubin_run, DirectMoE(), locality="off", **SM107_TRITON)
    assert _placement(rubin_run) == ""
    d = _decision(rubin_run)
    assert (d["decision"], d["reason"], d["details"]) == ("whole (current stream)", "options locality='off'", {})
    assert pass_notes(rubin_run, "place_locality") == [
        "0 of 1 MoE node(s) split over locality domains (locality='off')"
    ]


def test_kernel_without_split_n_form_runs_whole():
    """sm107's default MoE kernel is a FlashInfer one, which has no split-N form (no placements)."""
    spec = MOE.example_spec("none")
    for name in ("flashinfer_trtllm", "flashinfer_cutlass", "reference"):
        kernel = MOE.kernel(name)
        assert "split_n" not in kernel.placements
        assert place_locality.decide("backfill", resolve("sm107"), kernel, spec, None, 16, (4, 4)) == (
            None,
            f"kernel {name} has no split-N form",
            {},
        )
    assert MOE.kernel("triton").placements == ("split_n",)


@cpu_only
def test_sm90_auto_has_no_placement_uniform_memory(rubin_run):
    compile_for_gpu_target(rubin_run, DirectMoE(), target="sm90")
    assert _placement(rubin_run) == ""
    (graph_dir,) = rubin_run.dump_dir.iterdir()
    assert not stage_file(graph_dir, "place_locality").exists()
    d = _decision(rubin_run)
    assert d["decision"] == "whole (current stream)" and d["reason"] == UNIFORM and d["details"] == {}
    assert "uniform memory" in d["reason"]


@cpu_only
@pytest.mark.parametrize(
    "mode, counts", [("default", "64/64 SMs (default, 4 SMs idle"), ("backfill", "64/68 SMs (backfill")]
)
def test_sm90_forced_green_context_domains(rubin_run, mode, counts):
    assert locality.green_context_split(132, 2, "default") == (64, 64)
    assert locality.green_context_split(132, 2, "backfill") == (64, 68)
    compile_for_gpu_target(rubin_run, DirectMoE(), target="sm90", locality=mode)
    assert _placement(rubin_run) == f"split_n:{mode}:2:16"
    d = _decision(rubin_run)
    assert d["reason"] == "decode-sized MoE (T in [4, 4]) on sm90"
    assert d["details"] == {
        "domains": f"2 domains x {counts}; memory un-localised; green contexts (SM partitions))",
        "FC1 I shares": [128, 128],
        "FC2 H shares": [128, 128],
        "tokens": "always",
        "shards": "views of the weights (uniform memory: no copy)",
    }


@cpu_only
def test_static_prefill_runs_whole(rubin_run):
    compile_for_gpu_target(rubin_run, DirectMoE(), tokens=32, **SM107_TRITON)
    assert _placement(rubin_run) == ""
    d = _decision(rubin_run)
    assert d["decision"] == "whole (current stream)"
    assert d["reason"] == "T >= 32 > locality_max_tokens=16: not decode-sized"


@cpu_only
def test_static_tokens_at_a_raised_threshold_are_placed(rubin_run):
    compile_for_gpu_target(rubin_run, DirectMoE(), tokens=32, locality_max_tokens=32, **SM107_TRITON)
    assert _placement(rubin_run) == "split_n:backfill:2:32"
    assert _decision(rubin_run)["reason"] == "decode-sized MoE (T in [32, 32]) on sm107"


@cpu_only
def test_dynamic_tokens_are_decided_per_call(rubin_run):
    compile_for_gpu_target(rubin_run, DirectMoE(), tokens=32, dynamic=True, **SM107_TRITON)
    assert _placement(rubin_run) == "split_n:backfill:2:16"
    (line,) = moe_lines(rubin_run.stage_code("place_locality"))
    assert "bf16[s" in line  # the token count is symbolic in the graph
    d = _decision(rubin_run)
    assert d["reason"] == "decode-sized MoE (T <= 16) on sm107"
    assert d["details"]["tokens"] == "per call"


@cpu_only
@pytest.mark.parametrize("I, H, dim, n", [(192, 256, "I", 192), (256, 320, "H", 320)])
def test_dims_that_do_not_split_run_whole(rubin_run, I, H, dim, n):
    compile_for_gpu_target(rubin_run, DirectMoE(H=H, I=I), **SM107_TRITON)
    assert _placement(rubin_run) == ""
    d = _decision(rubin_run)
    assert d["decision"] == "whole (current stream)"
    assert d["reason"] == f"{dim}={n} does not split into 2 shares of a multiple of 128"


@cpu_only
def test_domains_option_overrides_the_count(rubin_run):
    compile_for_gpu_target(rubin_run, DirectMoE(H=512, I=512), domains=4, locality="default", **SM107_TRITON)
    assert _placement(rubin_run) == "split_n:default:4:16"
    d = _decision(rubin_run)
    assert d["details"]["domains"] == (
        "4 domains x 48/48/48/48 SMs (default, 20 SMs idle; memory un-localised; "
        "green contexts (SM partitions) not matching the HBM domains)"
    )
    assert d["details"]["FC1 I shares"] == [128, 128, 128, 128]
    assert d["details"]["shards"] == "views of the weights (uniform memory: no copy)"


class _Spec:
    """A stand-in spec for decide(): named dims and a weight dtype."""

    def __init__(self, **dims):
        self.dims, self.block_shape, self.weight_dtype = dims, None, "bfloat16"

    def dim(self, name):
        return self.dims.get(name)


def test_decide_edge_cases():
    triton = MOE.kernel("triton")
    spec = _Spec(E=8, H=256, I=256)
    sm107, sm90 = resolve("sm107"), resolve("sm90")
    assert place_locality.decide("backfill", resolve("cpu"), triton, spec, None, 16, (4, 4)) == (
        None,
        "target cpu has no GPU: one domain",
        {},
    )
    no_gc = Target("sm80", "Ampere (A100)", (8, 0), 108)
    assert place_locality.decide("default", no_gc, triton, spec, None, 16, (4, 4)) == (
        None,
        "target sm80 has no green contexts",
        {},
    )
    assert place_locality.decide("backfill", sm107, triton, _Spec(E=8, H=256), None, 16, (4, 4)) == (
        None,
        "the node's I and H are not known statically",
        {},
    )
    # a range with a lower bound above the threshold is prefill; an upper bound at it is always decode
    assert place_locality.decide("auto", sm107, triton, spec, None, 16, (17, None))[0] is None
    placement, why, details = place_locality.decide("auto", sm107, triton, spec, None, 16, (1, 16))
    assert placement == "split_n:backfill:2:16" and why == "decode-sized MoE (T in [1, 16]) on sm107"
    assert details["tokens"] == "always"
    placement, why, details = place_locality.decide("auto", sm107, triton, spec, None, 16, (2, 64))
    assert why == "decode-sized MoE (T <= 16) on sm107" and details["tokens"] == "per call"
    # sm90 "default" with too many domains for its SMs: the plan's error is the reason
    placement, why, _ = place_locality.decide("default", sm90, triton, _Spec(E=8, H=4096, I=4096), 20, 16, (4, 4))
    assert placement is None and why == "cannot split 132 SMs into 20 green-context domains of at least 8"


def test_locality_options_change_the_pass_uuid():
    def uuid(**o):
        return PassManager(RubinOptions.resolve({"target": "sm107", **o}, environ={})).uuid()

    keys = {
        uuid(),
        uuid(locality="off"),
        uuid(locality="default"),
        uuid(locality="backfill"),
        uuid(domains=4),
        uuid(locality_max_tokens=32),
    }
    assert len(keys) == 6
    assert uuid(locality="strict") == uuid(locality="default")
