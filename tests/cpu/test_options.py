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
