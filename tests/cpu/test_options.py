"""RubinOptions: defaults, RUBIN_* variables, options={...}, and clear errors."""

import pytest

from rubin_compile.options import PIPELINE, RubinOptions, RubinOptionsError


def test_defaults_run_the_whole_pipeline():
    opts = RubinOptions.resolve({}, environ={})
    assert opts.dump_dir is None and opts.strict is False
    assert opts.enabled_passes() == PIPELINE


def test_env_maps_onto_options_and_explicit_options_win():
    env = {"RUBIN_DUMP_DIR": "/tmp/x", "RUBIN_STRICT": "1", "RUBIN_PASSES": "match_moe, canonicalize"}
    opts = RubinOptions.resolve({}, environ=env)
    assert opts.dump_dir == "/tmp/x" and opts.strict is True
    assert opts.enabled_passes() == ("canonicalize", "match_moe")  # pipeline order, whatever the input order
    assert RubinOptions.resolve({"strict": False}, environ=env).strict is False


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(RubinOptionsError, match=r"unknown rubin option 'dumpdir'.*dump_dir.*strict.*passes"):
        RubinOptions.resolve({"dumpdir": "/tmp"}, environ={})


def test_unknown_env_variable_and_bad_values():
    with pytest.raises(RubinOptionsError, match="RUBIN_DUMPDIR"):
        RubinOptions.resolve({}, environ={"RUBIN_DUMPDIR": "x"})
    with pytest.raises(RubinOptionsError, match="unknown pass"):
        RubinOptions.resolve({"passes": ["match_everything"]}, environ={})
    with pytest.raises(RubinOptionsError, match="strict must be a bool"):
        RubinOptions.resolve({"strict": "maybe"}, environ={})


def test_behaviour_key_tracks_behaviour_changing_options():
    a = RubinOptions.resolve({}, environ={}).behaviour_key()
    b = RubinOptions.resolve({"strict": True}, environ={}).behaviour_key()
    c = RubinOptions.resolve({"passes": "canonicalize"}, environ={}).behaviour_key()
    assert a != b and a != c


def test_target_option_and_env():
    assert RubinOptions.resolve({}, environ={}).target == "auto"
    assert RubinOptions.resolve({}, environ={"RUBIN_TARGET": "sm_107"}).target == "sm107"
    opts = RubinOptions.resolve({"target": "Rubin"}, environ={"RUBIN_TARGET": "sm90"})
    assert opts.target == "sm107" and opts.resolved_target().sm_count == 212  # options win over env
    with pytest.raises(RubinOptionsError, match=r"unknown rubin target 'sm99'.*valid targets are.*sm107"):
        RubinOptions.resolve({"target": "sm99"}, environ={})


def test_kernels_option_and_env():
    env = {"RUBIN_KERNELS": "moe=triton, gemm=torch"}
    assert RubinOptions.resolve({}, environ=env).kernels == {"moe": "triton", "gemm": "torch"}
    assert RubinOptions.resolve({"kernels": {"moe": "flashinfer_cutedsl"}}, environ=env).kernels == {"moe": "flashinfer_cutedsl"}
    assert RubinOptions.resolve({}, environ={}).kernels == {}
    with pytest.raises(RubinOptionsError, match=r"unknown canonical op\(s\) \['mlp'\].*moe.*gemm.*attention"):
        RubinOptions.resolve({"kernels": {"mlp": "triton"}}, environ={})
    with pytest.raises(RubinOptionsError, match="write op=kernel pairs"):
        RubinOptions.resolve({}, environ={"RUBIN_KERNELS": "triton"})


def test_behaviour_key_tracks_target_and_kernels():
    base = RubinOptions.resolve({"target": "sm90"}, environ={}).behaviour_key()
    assert base["target"] == "sm90"
    assert base != RubinOptions.resolve({"target": "sm107"}, environ={}).behaviour_key()
    assert base != RubinOptions.resolve({"target": "sm90", "kernels": {"moe": "triton"}}, environ={}).behaviour_key()
    # "auto" enters the key as the target it resolves to on this machine
    from rubin_compile.target import detect

    assert RubinOptions.resolve({}, environ={}).behaviour_key()["target"] == detect().name
