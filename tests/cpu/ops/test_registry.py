"""The canonical ops' kernel registry (ops/registry.py) with every kernel registered (kernels/): the selection
table of docs/kernels/selection.md, FlashInfer's declarations, rejection reasons, forced kernels, and the clear
error when a plan's kernel cannot run here."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

from rubin_compile import target as T
from rubin_compile.kernels import flashinfer as fi
from rubin_compile.ops import moe as moe_op
from rubin_compile.ops import registry as R

DOC = Path(__file__).resolve().parents[3] / "docs" / "kernels" / "selection.md"
TARGETS = {"sm_90": "sm90", "sm_100": "sm100", "sm_103": "sm103", "sm_107": "sm107", "cpu": "cpu"}
DTYPES = {"bf16": "none", "FP8 per-tensor": "fp8_tensor", "FP8 block": "fp8_block", "NVFP4": "nvfp4", "MXFP4": "mxfp4"}
PACKAGES = {
    "flashinfer": "flashinfer-python",
    "cutlass": "nvidia-cutlass-dsl",
    "cudnn": "nvidia-cudnn-frontend",
    "triton": "triton",
}
missing = [pip for module, pip in PACKAGES.items() if importlib.util.find_spec(module) is None]
needs_packages = pytest.mark.skipif(
    bool(missing), reason=f"the selection table assumes {missing} installed (tests/run.sh)"
)


def example_spec(op: str, quant: str) -> R.KernelSpec:
    return R.op_of(op).example_spec(quant)


def select(spec: R.KernelSpec, target: T.Target, **kwargs) -> R.Selection:
    return R.op_of(spec.op).select(spec, target, **kwargs)


MARK = re.compile(r"^(\S+)(?: \((.+)\))?$")  # "<kernel>" or "<kernel> (<status>)"


def kernel_name(cell: str) -> str:
    return MARK.match(cell).group(1)


def documented_table() -> dict[tuple[str, str, str], tuple[str, str]]:
    """(op, target, quant) -> (kernel, runs), parsed from the tables of docs/kernels/selection.md (a FlashInfer
    kernel is written "<kernel> (<status>)": fi.status)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 6 or cells[0] not in R.CANONICAL_OPS:
            continue
        op, target, dtype, kernel, runs, _why = cells
        key = (op, TARGETS[target], DTYPES[dtype])
        assert key not in rows, f"{key} appears twice in {DOC.name}"
        rows[key] = (kernel, runs.strip("`"))
    return rows


def documented_summary() -> dict[tuple[str, str, str], str]:
    """(op, target, quant) -> kernel, from the "<op>: summary" matrices of the same document."""
    out, op, columns = {}, None, None
    for line in DOC.read_text().splitlines():
        heading = re.fullmatch(r"### (\w+): summary", line.strip())
        if heading or line.startswith("#"):
            op = heading.group(1) if heading else None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if op is None or len(cells) != 6:
            continue
        if cells[0] == "target":
            columns = [DTYPES[c] for c in cells[1:]]
        elif cells[0] in TARGETS:
            out.update({(op, TARGETS[cells[0]], q): k for q, k in zip(columns, cells[1:])})
    return out


def test_the_document_says_how_far_each_flashinfer_kernel_is_verified():
    """Every FlashInfer cell carries its status -- "runs, tested on H200", "call checked, needs sm_100+ hardware",
    "call checked, not yet run on a GPU" or "plan only" (no adapter) -- as fi.status computes it from the adapters;
    other kernels carry none (they run, and their GPU tests ran on the H200)."""
    cells = list(documented_table().items()) + [(k, (v, None)) for k, v in documented_summary().items()]
    assert cells
    statuses = {fi.TESTED_ON_H200, fi.CALL_CHECKED_SM100, fi.CALL_CHECKED, fi.PLAN_ONLY}
    for (op, _, quant), (cell, _) in cells:
        name, mark = MARK.match(cell).groups()
        if name.startswith("flashinfer_"):
            assert mark in statuses and mark == fi.status(op, name, quant), (op, quant, cell)
        else:
            assert mark is None, (op, quant, cell)


def test_the_document_covers_every_op_target_and_dtype():
    rows = documented_table()
    want = {(op, t, q) for op in R.CANONICAL_OPS for t in TARGETS.values() for q in R.QUANTS}
    assert set(rows) == want
    assert documented_summary() == {key: kernel for key, (kernel, _) in rows.items()}
    assert set(documented_summary()) == want


@needs_packages
@pytest.mark.parametrize("op", list(R.CANONICAL_OPS))
def test_selection_matches_the_documented_table(op):
    for (doc_op, target, quant), (kernel, runs) in documented_table().items():
        if doc_op != op:
            continue
        spec = example_spec(op, quant)
        chosen = select(spec, T.resolve(target)).chosen
        assert (chosen.name, chosen.entry(spec)) == (kernel_name(kernel), runs), (op, target, quant)


@needs_packages
def test_flashinfer_entry_points_resolve_to_real_callables():
    for op, table in fi.TABLES.items():
        for kernel, entries in table.items():
            for quant, entry in entries.items():
                for path in entry.functions:
                    assert callable(fi.resolve(path)), (op, kernel, quant, path)


@needs_packages
def test_declarations_read_from_flashinfer():
    # @supported_compute_capability on the CuTe-DSL MoE entry points
    assert fi.declared_ccs(fi.MOE["flashinfer_cutedsl"]["nvfp4"]) == {100, 103, 107}
    assert fi.declared_ccs(fi.MOE["flashinfer_cutedsl"]["mxfp4"]) == {100, 103}
    assert fi.declared_ccs(fi.MOE["flashinfer_cutedsl"]["none"]) == {90}
    # @backend_requirement tables of the GEMMs
    assert fi.declared_ccs(fi.GEMM["flashinfer_cutedsl"]["fp8_tensor"]) == {107}
    assert 90 not in fi.declared_ccs(fi.GEMM["flashinfer_cutlass"]["fp8_tensor"])
    assert {90, 100, 107} <= fi.declared_ccs(fi.GEMM["flashinfer_cudnn"]["fp8_tensor"])


@needs_packages
def test_rules_copied_from_flashinfer_code_still_match_its_source():
    """Where FlashInfer decides in code, flashinfer.py copies the rule; fail when FlashInfer changes it."""
    from flashinfer.fused_moe import core

    dispatch = inspect.getsource(core.get_cutlass_fused_moe_module)
    for cc in fi.CUTLASS_MOE_CCS:
        assert f'"{cc}"' in dispatch, cc
    assert "arch[0] < 10" in inspect.getsource(core.is_trtllm_moe_supported.__wrapped__)
    assert "FP8 block scaling not yet implemented for Blackwell" in inspect.getsource(core.cutlass_fused_moe)
    utils = importlib.import_module("flashinfer.utils")
    assert "major == 9" in inspect.getsource(utils.is_sm90a_supported)
    decode = importlib.import_module("flashinfer.decode")
    assert '"trtllm-gen" if get_compute_capability(query.device)[0] == 10 else "xqa"' in inspect.getsource(
        decode.trtllm_batch_decode_with_kv_cache
    )


def test_cpu_chooses_the_reference_and_says_why_for_the_others():
    sel = select(example_spec("moe", "none"), T.resolve("cpu"))
    assert sel.chosen.name == "reference" and sel.impl == "reference"
    assert {k for k, _ in sel.rejected} == {k.name for k in moe_op.MOE.kernels()} - {"reference"}
    reasons = dict(sel.rejected)
    assert "layout 'plain'; vllm_cpu reads only 'vllm_cpu:<isa>'" in reasons.pop("vllm_cpu")
    assert all("no CUDA GPU" in reason for reason in reasons.values())


def test_weight_layout_gates_the_candidates():
    """vLLM's CPU-prepacked weights: only the kernels that read that layout (vLLM's own CPU kernel, and the
    reference, which unpacks a copy) are candidates; on a GPU target the plan says why the others lost."""
    packed = dataclasses.replace(example_spec("moe", "none"), weight_layout="vllm_cpu:vec")
    cpu = select(packed, T.resolve("cpu"))
    if importlib.util.find_spec("vllm"):
        assert cpu.impl == "vllm_cpu@cpu" and "reference" in cpu.outranked
    else:
        assert cpu.impl == "reference" and "package vllm is not installed" in dict(cpu.rejected)["vllm_cpu"]
    gpu = select(packed, T.resolve("sm90"))
    assert gpu.impl == "reference@sm90"
    reasons = dict(gpu.rejected)
    assert "weights stored in layout 'vllm_cpu:vec'; triton reads only 'plain'" in reasons["triton"]
    assert "runs on the CPU, not on sm90" in reasons["vllm_cpu"]
    misaligned = dataclasses.replace(packed, shape=(("E", 8), ("H", 64), ("I", 40), ("k", 2)))
    assert "multiples of 32; got I=40" in dict(select(misaligned, T.resolve("cpu")).rejected)["vllm_cpu"]
    assert "weights vllm_cpu:vec" in packed.describe()


def test_shape_dtype_and_cc_reasons():
    spec = R.KernelSpec("moe", "none", "bfloat16", "bfloat16", None, (("E", 6), ("H", 32), ("I", 24), ("k", 2)), "silu")
    sel = select(spec, T.resolve("sm107"))
    reasons = dict(sel.rejected)
    if importlib.util.find_spec("flashinfer"):
        assert "shape limit: I=24 must be a multiple of 128" in reasons["flashinfer_trtllm"]
        assert "cc [90] only, not on sm107" in reasons["flashinfer_cutedsl"]
    fp32 = select(
        dataclasses.replace(example_spec("moe", "none"), act_dtype="float32", weight_dtype="float32"), T.resolve("sm90")
    )
    assert "activations in float32 are not supported" in dict(fp32.rejected)["triton"]


def test_missing_packages_reject_their_candidates(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("flashinfer", "triton") else real(name, *a)
    )
    sel = select(example_spec("moe", "fp8_tensor"), T.resolve("sm100"))
    reasons = dict(sel.rejected)
    assert reasons["flashinfer_trtllm"] == "package flashinfer-python is not installed"
    assert reasons["triton"] == "package triton is not installed"
    assert sel.chosen.name == "reference"


@needs_packages
def test_forced_kernel_that_cannot_run_is_rejected_with_its_reason():
    sel = select(example_spec("moe", "none"), T.resolve("sm107"), forced="flashinfer_cutedsl")
    assert sel.forced == "flashinfer_cutedsl" and "cc [90] only" in sel.forced_reason
    assert sel.chosen.name == "flashinfer_trtllm"
    ok = select(example_spec("moe", "none"), T.resolve("sm107"), forced="triton")
    assert ok.chosen.name == "triton" and ok.forced_reason is None and ok.impl == "triton@sm107"


def test_unknown_kernel_names_list_the_valid_ones():
    with pytest.raises(R.UnknownKernelError, match=r"unknown kernel 'cutlass' for rubin.moe.*flashinfer_cutlass"):
        moe_op.MOE.kernel("cutlass")


def test_a_declaration_that_fails_becomes_a_reason():
    def broken(target, spec):
        raise ImportError("no such module")

    kernel = R.Kernel("moe", "reference", broken, {"*": 0})
    assert (
        kernel.check(T.resolve("sm90"), example_spec("moe", "none"))
        == "could not check support: ImportError: no such module"
    )


def test_impl_strings():
    assert R.format_impl("reference", T.resolve("cpu")) == "reference"
    assert R.format_impl("reference", T.resolve("sm107")) == "reference@sm107"
    assert R.format_impl("flashinfer_trtllm", T.resolve("sm107")) == "flashinfer_trtllm@sm107"
    assert R.parse_impl("flashinfer_trtllm@sm107") == ("flashinfer_trtllm", "sm107")
    assert R.parse_impl("triton") == ("triton", None)


def test_reference_runs_everywhere():
    kernel = moe_op.MOE.kernel("reference")
    assert kernel.run is moe_op.reference and kernel.unavailable_here(T.detect()) is None
    assert kernel.module == "rubin_compile.kernels.reference"


def test_kernels_register_onto_their_op_once():
    with pytest.raises(ValueError, match="kernel 'reference' is registered twice"):
        moe_op.MOE.add_kernel(R.Kernel("moe", "reference", lambda t, s: None, {"*": 0}, module="elsewhere"))
    with pytest.raises(ValueError, match="is for rubin.gemm, not rubin.moe"):
        moe_op.MOE.add_kernel(R.Kernel("gemm", "another", lambda t, s: None, {"*": 0}))


def test_every_canonical_form_takes_pdl():
    """chain_pdl sets ``pdl`` on every node bound to a kernel: each op (and each form added to one: vLLM's layer ops,
    defined once vLLM is imported) must have the argument, defaulting to False."""
    import rubin_compile.integrations.vllm.layer_ops  # noqa: F401  (adds vLLM's layer forms to rubin.moe)

    if importlib.util.find_spec("vllm") is not None:
        importlib.import_module("vllm.utils.torch_utils")  # defines the layer ops

    forms = [name.split("::") for op in R.CANONICAL_OPS.values() for name in op.forms]
    schemas = {
        f"{ns}::{n}": getattr(getattr(torch.ops, ns), n).default._schema
        for ns, n in forms
        if hasattr(getattr(torch.ops, ns), n)
    }
    want = {"rubin::moe", "rubin::gemm", "rubin::attention", "rubin::route"}
    if importlib.util.find_spec("vllm") is not None:
        want |= {"rubin::vllm_moe_layer", "rubin::vllm_moe_layer_shared"}
    assert want <= set(schemas), sorted(schemas)
    for name, schema in schemas.items():
        args = {a.name: a for a in schema.arguments}
        assert "pdl" in args and args["pdl"].default_value is False, name


def test_launch_settings_a_kernel_does_not_take_are_dropped():
    """The op's contract: a kernel without PDL or placements runs without them (not a TypeError)."""
    launch = R.Launch(True, R.Placement("backfill", 2, 16))
    assert moe_op.MOE.kernel("reference").launch_for(launch) == R.Launch()
    assert moe_op.MOE.kernel("triton").launch_for(launch) == launch


def test_placement_strings():
    assert R.Placement.decode("") is None
    assert R.Placement.decode("split_n:backfill:2:16") == R.Placement("backfill", 2, 16)
    assert R.Placement.decode("split_n:strict:4:128") == R.Placement("default", 4, 128)
    assert R.Placement("backfill", 2, 16).encode() == "split_n:backfill:2:16"
    for bad in ("split_n", "split_k:default:2:16", "split_n:default:two:16", "split_n:default:2"):
        with pytest.raises(ValueError, match=r"is not '' or 'split_n:<default\|backfill>:<domains>:<max_tokens>'"):
            R.Placement.decode(bad)
    with pytest.raises(ValueError, match="unknown locality mode 'sideways'"):
        R.Placement.decode("split_n:sideways:2:16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("impl", ["flashinfer_trtllm@sm107", "flashinfer_cutedsl@sm107", "triton@sm90"])
def test_a_plan_for_a_gpu_raises_a_clear_error_here(impl, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel, planned = R.parse_impl(impl)
    with pytest.raises(R.KernelUnavailableError) as err:
        moe_op.MOE.run(impl, None)
    message = str(err.value)
    assert f"compiled for target {planned} with kernel {kernel!r}" in message
    assert "cannot run on this machine (target cpu)" in message


def test_unknown_kernel_at_run_time_is_a_clear_error():
    with pytest.raises(R.KernelUnavailableError, match=r"rubin.moe: unknown kernel 'nope'"):
        moe_op.MOE.run("nope@sm90", None)


def test_priorities_are_per_target_and_format():
    cutedsl = moe_op.MOE.kernel("flashinfer_cutedsl")
    assert cutedsl.rank(T.resolve("sm107"), example_spec("moe", "nvfp4")) == 50
    assert cutedsl.rank(T.resolve("sm100"), example_spec("moe", "nvfp4")) == 30
    assert cutedsl.rank(T.resolve("sm90"), example_spec("moe", "none")) == 5


@needs_packages
def test_a_plan_for_another_gpu_names_why_this_gpu_cannot_run_it(monkeypatch):
    """An sm_100 plan executed on an H200: the trtllm-gen MoE is not declared for cc 90."""
    monkeypatch.setattr(T, "detect", lambda device_index=0: T.resolve("sm90"))
    with pytest.raises(R.KernelUnavailableError) as err:
        moe_op.MOE.run("flashinfer_trtllm@sm100", None)
    assert "compiled for target sm100 with kernel 'flashinfer_trtllm'" in str(err.value)
    assert "(target sm90)" in str(err.value) and "not on sm90 (cc 90)" in str(err.value)
    # declared for this GPU, but the machine has no CUDA (this test fakes the H200): still a clear error
    if not torch.cuda.is_available():
        with pytest.raises(R.KernelUnavailableError, match=r"FlashInfer's kernels need a CUDA GPU"):
            moe_op.MOE.run("flashinfer_cutlass@sm90", None)


def test_compiling_for_this_machine_never_chooses_a_kernel_it_cannot_run(monkeypatch):
    """On the machine itself (target "auto" on an H200), a kernel without an adapter in this version, or whose
    package / GPU is missing here, is rejected with that reason; plans for other targets are not filtered (they
    follow the declarations, as docs/kernels/selection.md documents)."""
    sm90 = T.resolve("sm90")
    monkeypatch.setattr(T, "detect", lambda device_index=0: sm90)
    attention = example_spec("attention", "none")
    here = select(attention, sm90, runs_here=True)
    plan = select(attention, sm90)
    assert here.chosen.name == "torch"
    if importlib.util.find_spec("flashinfer") and not torch.cuda.is_available():  # else: missing package first
        assert dict(here.rejected)["flashinfer_fa3"].startswith("FlashInfer's kernels need a CUDA GPU")
        assert plan.chosen.name == "flashinfer_fa3"
    moe = example_spec("moe", "none")
    moe_here = select(moe, sm90, runs_here=True)
    if not torch.cuda.is_available():  # the Triton kernels cannot run without a GPU
        assert moe_here.chosen.name == "reference" and "triton" in dict(moe_here.rejected)
