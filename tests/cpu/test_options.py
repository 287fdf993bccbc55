"""RubinOptions: defaults, RUBIN_* variables, options={...}, and clear errors."""

import pytest

from rubin_compile.options import RubinOptions, RubinOptionsError
from rubin_compile.passes import PASS_NAMES


def test_defaults_run_the_whole_pipeline():
    opts = RubinOptions.resolve({}, environ={})
    assert opts.dump_dir is None and opts.strict is False
    assert opts.enabled_passes() == PASS_NAMES


def test_env_maps_onto_options_and_explicit_options_win():
    env = {"RUBIN_DUMP_DIR": "/tmp/x", "RUBIN_STRICT": "1", "RUBIN_PASSES": "match_moe, canonicalize"}
    opts = RubinOptions.resolve({}, environ=env)
    assert opts.dump_dir == "/tmp/x" and opts.strict is True
    assert opts.enabled_passes() == ("canonicalize", "match_moe")  # pipeline order, whatever the input order
    assert RubinOptions.resolve({"strict": False}, environ=env).strict is False


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(RubinOptionsError, match=r"unknown rubin option 'dumpdir'.*dump_dir.*strict.*passes"):
        RubinOptions.resolve({"dumpdir": "/tmp"}, environ={})


def test_unknown_env_variable_is_ignored_with_a_warning():
    """A shared environment may hold RUBIN_* variables that are not ours (RUBIN_HOME) or a typo: a warning, not an
    error that would stop every compile (and vLLM's uuid()); options={...} stays strict."""
    with pytest.warns(UserWarning, match=r"ignoring the environment variable RUBIN_DUMPDIR.*RUBIN_DUMP_DIR"):
        opts = RubinOptions.resolve({}, environ={"RUBIN_DUMPDIR": "x", "RUBIN_STRICT": "1"})
    assert opts.dump_dir is None and opts.strict is True
    with pytest.raises(RubinOptionsError, match="unknown rubin option 'dumpdir'"):
        RubinOptions.resolve({"dumpdir": "x"}, environ={})


def test_bad_values():
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
    assert RubinOptions.resolve({"kernels": {"moe": "flashinfer_cutedsl"}}, environ=env).kernels == {
        "moe": "flashinfer_cutedsl"
    }
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


# ------------------------------------------------------------------------------------------------
# pdl, cudagraphs, locality, domains, locality_max_tokens
# ------------------------------------------------------------------------------------------------


def test_pdl_locality_defaults():
    opts = RubinOptions.resolve({}, environ={})
    assert (opts.pdl, opts.cudagraphs, opts.locality, opts.domains, opts.locality_max_tokens) == (
        "auto",
        False,
        "auto",
        None,
        16,
    )
    key = opts.behaviour_key()
    assert {k: key[k] for k in ("pdl", "cudagraphs", "locality", "domains", "locality_max_tokens")} == {
        "pdl": "auto",
        "cudagraphs": False,
        "locality": "auto",
        "domains": None,
        "locality_max_tokens": 16,
    }


def test_pdl_locality_env_and_options_win():
    env = {
        "RUBIN_PDL": "On",
        "RUBIN_CUDAGRAPHS": "1",
        "RUBIN_LOCALITY": "strict",
        "RUBIN_DOMAINS": "4",
        "RUBIN_LOCALITY_MAX_TOKENS": "32",
    }
    opts = RubinOptions.resolve({}, environ=env)
    assert (opts.pdl, opts.cudagraphs, opts.locality, opts.domains, opts.locality_max_tokens) == (
        "on",
        True,
        "default",
        4,
        32,
    )
    opts = RubinOptions.resolve(
        {"pdl": "off", "cudagraphs": False, "locality": "backfill", "domains": None, "locality_max_tokens": 8},
        environ=env,
    )
    assert (opts.pdl, opts.cudagraphs, opts.locality, opts.domains, opts.locality_max_tokens) == (
        "off",
        False,
        "backfill",
        None,
        8,
    )
    assert RubinOptions.resolve({}, environ={"RUBIN_CUDAGRAPHS": "0", "RUBIN_DOMAINS": ""}).cudagraphs is False
    assert RubinOptions.resolve({}, environ={"RUBIN_DOMAINS": ""}).domains is None
    assert RubinOptions.resolve({}, environ={"RUBIN_LOCALITY": "OFF"}).locality == "off"


def test_strict_locality_reads_as_default_and_bool_pdl():
    assert RubinOptions.resolve({"locality": "strict"}, environ={}).locality == "default"
    assert RubinOptions.resolve({"locality": " Strict "}, environ={}).locality == "default"
    assert RubinOptions.resolve({"pdl": True}, environ={}).pdl == "on"
    assert RubinOptions.resolve({"pdl": False}, environ={}).pdl == "off"
    assert RubinOptions.resolve({"pdl": "AUTO"}, environ={}).pdl == "auto"
    assert RubinOptions.resolve({"domains": 2}, environ={}).domains == 2
    assert RubinOptions.resolve({"domains": 3.0}, environ={}).domains == 3
    assert RubinOptions.resolve({"locality_max_tokens": "1"}, environ={}).locality_max_tokens == 1
    assert RubinOptions.resolve({"cudagraphs": "yes"}, environ={}).cudagraphs is True


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pdl": "maybe"}, "option pdl must be one of ['auto', 'on', 'off'], got 'maybe'"),
        ({"pdl": None}, "option pdl must be one of ['auto', 'on', 'off'], got None"),
        ({"locality": "whole"}, "option locality must be one of ['auto', 'off', 'default', 'backfill'], got 'whole'"),
        ({"locality": True}, "option locality must be one of ['auto', 'off', 'default', 'backfill'], got True"),
        ({"domains": 1}, "option domains must be an integer >= 2, got 1"),
        ({"domains": "two"}, "option domains must be an integer >= 2, got 'two'"),
        ({"domains": True}, "option domains must be an integer >= 2, got True"),
        ({"domains": 2.5}, "option domains must be an integer >= 2, got 2.5"),
        ({"locality_max_tokens": 0}, "option locality_max_tokens must be an integer >= 1, got 0"),
        ({"locality_max_tokens": "-4"}, "option locality_max_tokens must be an integer >= 1, got '-4'"),
        ({"locality_max_tokens": None}, "option locality_max_tokens must be a positive integer, got nothing"),
        (
            {"cudagraphs": "maybe"},
            "option cudagraphs must be a bool (or 0/1 in RUBIN_CUDAGRAPHS), or 'external' when you capture the "
            "compiled function in a CUDA graph yourself; got 'maybe'",
        ),
    ],
)
def test_pdl_locality_bad_values(options, message):
    with pytest.raises(RubinOptionsError) as err:
        RubinOptions.resolve(options, environ={})
    assert str(err.value) == message


def test_pdl_locality_bad_env_values():
    with pytest.raises(RubinOptionsError, match=r"option pdl must be one of \['auto', 'on', 'off'\], got 'sometimes'"):
        RubinOptions.resolve({}, environ={"RUBIN_PDL": "sometimes"})
    with pytest.raises(RubinOptionsError, match="option domains must be an integer >= 2, got '1'"):
        RubinOptions.resolve({}, environ={"RUBIN_DOMAINS": "1"})
    with pytest.raises(RubinOptionsError, match="option locality_max_tokens must be a positive integer, got nothing"):
        RubinOptions.resolve({}, environ={"RUBIN_LOCALITY_MAX_TOKENS": ""})


def test_behaviour_key_tracks_pdl_and_locality_options():
    base = RubinOptions.resolve({}, environ={}).behaviour_key()
    for change in (
        {"pdl": "on"},
        {"pdl": "off"},
        {"cudagraphs": True},
        {"locality": "off"},
        {"locality": "backfill"},
        {"domains": 4},
        {"locality_max_tokens": 32},
    ):
        assert RubinOptions.resolve(change, environ={}).behaviour_key() != base, change
    assert (
        RubinOptions.resolve({"locality": "strict"}, environ={}).behaviour_key()
        == RubinOptions.resolve({"locality": "default"}, environ={}).behaviour_key()
    )


def test_mode_implies_cudagraphs_and_inductor_cudagraphs_patch():
    from rubin_compile.backend import inductor_config_patches, with_mode

    opts = RubinOptions.resolve({}, environ={})
    assert with_mode(opts, "reduce-overhead").cudagraphs is True
    assert with_mode(opts, "max-autotune").cudagraphs is True
    assert with_mode(opts, "max-autotune-no-cudagraphs").cudagraphs is False
    assert with_mode(opts, None) is opts and with_mode(opts, "default") is opts
    assert with_mode(opts, "reduce-overhead").pdl == "auto"  # nothing else changes
    graphs = RubinOptions.resolve({"cudagraphs": True}, environ={})
    assert with_mode(graphs, "reduce-overhead") is graphs
    assert inductor_config_patches(graphs, None)["triton.cudagraphs"] is True
    assert "triton.cudagraphs" not in inductor_config_patches(opts, None)
    assert inductor_config_patches(opts, "reduce-overhead")["triton.cudagraphs"] is True
    # the user's own Inductor setting still wins
    user = RubinOptions.resolve({"cudagraphs": True, "inductor": {"triton.cudagraphs": False}}, environ={})
    assert inductor_config_patches(user, None)["triton.cudagraphs"] is False


def test_a_dump_dir_that_is_a_file_is_a_clear_error(tmp_path):
    """Before: a raw FileExistsError from the first compile, naming neither the option nor the fix."""
    file = tmp_path / "dumps"
    file.write_text("not a folder")
    with pytest.raises(RubinOptionsError, match=r"option dump_dir \(RUBIN_DUMP_DIR\) is .*dumps', which is a file"):
        RubinOptions.resolve({"dump_dir": str(file)}, environ={})
    with pytest.raises(RubinOptionsError, match="which is a file"):
        RubinOptions.resolve({}, environ={"RUBIN_DUMP_DIR": str(file)})
    assert RubinOptions.resolve({"dump_dir": str(tmp_path / "new")}, environ={}).dump_dir == str(tmp_path / "new")


def test_cudagraphs_external_plans_for_graphs_without_cudagraph_trees():
    """``cudagraphs="external"``: the caller captures the compiled function in a CUDA graph of its own (a serving
    runner's whole-step capture). Passes plan as under CUDA graphs (PDL, graph-only kernels), but Inductor's
    cudagraph trees stay off (they would capture inside the caller's capture)."""
    from rubin_compile.backend import inductor_config_patches
    from rubin_compile.passes.base import Engine

    for given in ("external", " External ", "EXTERNAL"):
        assert RubinOptions.resolve({"cudagraphs": given}, environ={}).cudagraphs == "external"
    opts = RubinOptions.resolve({}, environ={"RUBIN_CUDAGRAPHS": "external"})
    assert opts.cudagraphs == "external"
    assert Engine().runs_under_cudagraphs(opts) == (True, "options cudagraphs='external'")
    assert "triton.cudagraphs" not in inductor_config_patches(opts, None)
    assert opts.behaviour_key()["cudagraphs"] == "external"
