"""The canonical rubin.moe op: semantics, dtypes, FP8 dequantisation, errors, fake impl."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rubin_compile.ops.moe import MoEArgumentError, moe_reference


def _act64(act: str, h: torch.Tensor) -> torch.Tensor:
    """The activation of one gate-up row ``h`` (float64), restated from the op's docstring."""
    kind, *consts = act.split(":")
    consts = [float(c) for c in consts]
    if kind.endswith("_no_mul"):
        return {
            "silu_no_mul": F.silu,
            "gelu_no_mul": F.gelu,
            "gelu_tanh_no_mul": lambda v: F.gelu(v, approximate="tanh"),
            "relu2_no_mul": lambda v: F.relu(v) ** 2,
            "relu_no_mul": F.relu,
        }[kind](h)
    inter = h.shape[0] // 2
    if kind == "swigluoai":  # GPT-OSS: interleaved rows, clamped, up + 1
        alpha, limit = consts or (1.702, 7.0)
        gate, up = h[0::2].clamp(max=limit), h[1::2].clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    gate, up = h[:inter], h[inter:]
    if kind == "swigluoai_uninterleave":  # MiniMax-M3: the same over halves
        alpha, limit = consts or (1.702, 7.0)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    if kind == "silu_clamp":  # DeepSeek-V4: clamp, then SiLU
        (limit,) = consts
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    if kind == "swiglustep":  # Step-3.5: SiLU, then clamp
        (limit,) = consts or (7.0,)
        return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
    fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[kind]
    return fn(gate) * up


def dense_moe(x, w13, w2, topk_w, topk_ids, act="silu", b13=None, b2=None, on_input=False):
    """Token-by-token float64 restatement of the documented semantics (independent of the op's code)."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            xt = x[t] * float(topk_w[t, j]) if on_input else x[t]
            h = w13[e] @ xt + (0 if b13 is None else b13[e].double())
            y = w2[e] @ _act64(act, h) + (0 if b2 is None else b2[e].double())
            out[t] += y if on_input else float(topk_w[t, j]) * y
    return out


def make(T=6, H=24, E=5, I=12, k=2, dtype=torch.float32, bias=False, gated=True):
    x = torch.randn(T, H, dtype=dtype)
    w13 = torch.randn(E, 2 * I if gated else I, H, dtype=dtype) * 0.3
    w2 = torch.randn(E, H, I, dtype=dtype) * 0.3
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.empty(0, k, dtype=torch.long)
    w = torch.rand(T, k)
    b13 = torch.randn(E, 2 * I if gated else I, dtype=dtype) if bias else None
    b2 = torch.randn(E, H, dtype=dtype) if bias else None
    return x, w13, w2, w, ids, b13, b2


CLAMPED = ("swigluoai", "swigluoai:1.25:2.5", "swigluoai_uninterleave", "swigluoai_uninterleave:1.0:3.5",
           "silu_clamp:2.5", "swiglustep", "swiglustep:1.5")  # fmt: skip
NO_MUL = ("silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul", "relu2_no_mul", "relu_no_mul")


@pytest.mark.parametrize("act", ("silu", "gelu_tanh", "gelu") + CLAMPED + NO_MUL)
@pytest.mark.parametrize("bias", [False, True])
def test_reference_matches_documented_semantics(act, bias):
    x, w13, w2, w, ids, b13, b2 = make(bias=bias, gated=not act.endswith("_no_mul"))
    if act in CLAMPED:  # pre-activations of std ~4: the clamps (1.5 .. 7) bite
        w13 = w13 * 7
        assert (torch.einsum("eih,th->tei", w13, x).abs() > 7).any()
    got = torch.ops.rubin.moe(x, w13, w2, w, ids, act, b13, b2)
    want = dense_moe(x, w13, w2, w, ids, act, b13, b2)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ["silu", "relu2_no_mul"])
def test_router_weight_on_input(act, bias):
    """apply_router_weight_on_input: each expert runs on its routed weight times the token (Llama 4, vLLM's flag):
    not the same as weighting the output (the FFN is not linear), and equal to the restatement."""
    x, w13, w2, w, ids, b13, b2 = make(bias=bias, gated=act == "silu")
    ids[1, 1] = ids[1, 0]  # a duplicate expert in a row: each slot runs on its own scaled input
    got = torch.ops.rubin.moe(x, w13, w2, w, ids, act, b13, b2, apply_router_weight_on_input=True)
    torch.testing.assert_close(got.double(), dense_moe(x, w13, w2, w, ids, act, b13, b2, on_input=True),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert not torch.allclose(got, torch.ops.rubin.moe(x, w13, w2, w, ids, act, b13, b2), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("act, constants", [("swigluoai", [1.25, 2.5]), ("silu_clamp:7.0", [2.0]),
                                            ("silu_clamp", [2.0]),  # the kind alone: its limit comes at run time
                                            ("swigluoai_uninterleave", [0.5, 1.5])])  # fmt: skip
def test_activation_constants_at_run_time(act, constants):
    """activation_constants (a tensor the graph computes or receives) replaces the string's constants."""
    x, w13, w2, w, ids, b13, b2 = make(bias=True)
    w13 = w13 * 7
    kind = act.split(":")[0]
    written = ":".join([kind] + [repr(float(c)) for c in constants])
    got = torch.ops.rubin.moe(x, w13, w2, w, ids, act, b13, b2, activation_constants=torch.tensor(constants))
    assert torch.equal(got, torch.ops.rubin.moe(x, w13, w2, w, ids, written, b13, b2))
    torch.testing.assert_close(got.double(), dense_moe(x, w13, w2, w, ids, written, b13, b2), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(
        torch.ops.rubin.moe.default, (x, w13, w2, w, ids, act), {"activation_constants": torch.tensor(constants)}
    )
    with pytest.raises(MoEArgumentError, match="1-D float tensor of"):
        torch.ops.rubin.moe(x, w13, w2, w, ids, act, activation_constants=torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(MoEArgumentError, match="has no constants"):
        torch.ops.rubin.moe(x, w13, w2, w, ids, "silu", activation_constants=torch.tensor([1.0]))


def test_features_only_on_kernels_that_declare_them():
    """A kernel that does not declare apply_router_weight_on_input / run-time constants is rejected by selection
    with that reason, and refuses such a call given by hand (it would compute another op)."""
    from rubin_compile.ops.moe import MOE
    from rubin_compile.ops.registry import KernelSpec, KernelUnavailableError
    from rubin_compile.target import resolve

    spec = KernelSpec("moe", act_dtype="bfloat16", shape=(("E", 8), ("H", 256), ("I", 128), ("k", 1)),
                      activation="silu", features=("router_weight_on_input",))  # fmt: skip
    sel = MOE.select(spec, resolve("sm90"))
    assert sel.chosen.name == "reference"
    assert dict(sel.rejected)["triton"] == "triton does not implement router_weight_on_input"
    # by hand: vllm_cpu, the one kernel besides the reference that runs on this machine, declares the router weight
    # on the input (top-1, as vLLM runs it) but not run-time activation constants
    pytest.importorskip("vllm", reason="the vllm_cpu kernel runs only with vLLM's CPU build")
    x, w13, w2, w, ids, _, _ = make(k=1)
    constants = torch.tensor([1.702, 7.0])
    with pytest.raises(KernelUnavailableError, match="'vllm_cpu' does not implement runtime_activation_constants"):
        torch.ops.rubin.moe(x, w13, w2, w, ids, "swigluoai", impl="vllm_cpu", activation_constants=constants)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision_close_to_float64(dtype, tol):
    x, w13, w2, w, ids, _, _ = make(dtype=dtype)
    got = torch.ops.rubin.moe(x, w13, w2, w, ids)
    want = dense_moe(x, w13, w2, w, ids)
    assert got.dtype == dtype
    assert (got.double() - want).norm() / want.norm() < tol


def test_edge_cases_duplicate_ids_empty_batch_int32_ids():
    x, w13, w2, w, ids, _, _ = make(T=3, k=2)
    ids[:, 1] = ids[:, 0]  # the same expert twice in a row: both slots count
    torch.testing.assert_close(
        torch.ops.rubin.moe(x, w13, w2, w, ids.int()).double(), dense_moe(x, w13, w2, w, ids), rtol=1e-5, atol=1e-5
    )
    x0, w130, w20, w0, ids0, _, _ = make(T=0)
    assert torch.ops.rubin.moe(x0, w130, w20, w0, ids0).shape == (0, 24)


def test_fp8_block_and_per_tensor_dequantisation():
    x, w13, w2, w, ids, _, _ = make(H=40, I=20)  # not multiples of the block size
    E = w13.shape[0]
    q13, q2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 1, 1) + 0.5
    s2 = torch.rand(E) + 0.5
    got = torch.ops.rubin.moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    want = dense_moe(x, q13.float() * s13, q2.float() * s2.view(E, 1, 1), w, ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    bs = [16, 16]
    b13 = torch.rand(E, 3, 3) + 0.5  # ceil(40/16) x ceil(40/16)
    b2 = torch.rand(E, 3, 2) + 0.5  # ceil(40/16) x ceil(20/16)
    got = torch.ops.rubin.moe(x, q13, q2, w, ids, w13_scale=b13, w2_scale=b2, block_shape=bs)
    full13 = b13.repeat_interleave(16, 1)[:, :40].repeat_interleave(16, 2)[:, :, :40]
    full2 = b2.repeat_interleave(16, 1)[:, :40].repeat_interleave(16, 2)[:, :, :20]
    want = dense_moe(x, q13.float() * full13, q2.float() * full2, w, ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(activation="relu"), "activation='relu' is not supported"),
        (lambda a: a.update(activation="swigluoai:1.7"), "activation='swigluoai:1.7' is not supported"),
        (lambda a: a.update(activation="swigluoai:1.7:-1"), "limit > 0"),
        (lambda a: a.update(activation="silu_clamp"), "'silu_clamp:<limit>'"),  # its limit has no default
        (lambda a: a.update(activation="silu:1.0"), "is not supported"),
        (lambda a: a.update(activation="relu2_no_mul"), r"w2 has I=12, so w13 must be \[E=5, I=12, H=24\]"),
        (lambda a: a.update(w2=a["w2"][:, :, :-1]), r"disagree on I: w2 has I=11, so w13 must be \[E=5, 2I=22"),
        # a w13 with two rows too many names w13 (before: "w2 shape ... does not match")
        (
            lambda a: a.update(w13=torch.cat([a["w13"], a["w13"][:, :2]], 1)),
            r"w13 \(5, 26, 24\) and w2 \(5, 24, 12\) disagree on I: .* w13 must be \[E=5, 2I=24, H=24\]",
        ),
        (lambda a: a.update(w2=a["w2"][:, :-1]), r"w2 shape \(5, 23, 12\) does not match \[E=5, H=24, I\]"),
        (lambda a: a.update(w13=a["w13"].double()), "must have hidden_states' dtype"),
        (lambda a: a.update(topk_ids=a["topk_ids"].float()), "topk_ids must be int32 or int64"),
        (lambda a: a.update(topk_ids=a["topk_ids"][:-1], topk_weights=a["topk_weights"][:-1]), "rows"),
    ],
)
def test_bad_arguments_are_clear_errors(mutate, message):
    x, w13, w2, w, ids, _, _ = make()
    args = dict(hidden_states=x, w13=w13, w2=w2, topk_weights=w, topk_ids=ids)
    mutate(args)
    with pytest.raises(MoEArgumentError, match=message):
        torch.ops.rubin.moe(**args)


def test_vllm_cpu_packed_layout_means_the_same_weights():
    """weight_layout="vllm_cpu:<isa>": the same op on the weights vLLM's CPU build prepacked (16-row
    blocks interleaved along K); the reference unpacks them, so the result is the plain one exactly."""
    from rubin_compile.ops.moe import pack_cpu_weight, unpack_cpu_weight

    x, w13, w2, w, ids, b13, b2 = make(E=5, H=48, I=32, bias=True)
    p13, p2 = pack_cpu_weight(w13), pack_cpu_weight(w2)
    assert not torch.equal(p13, w13) and torch.equal(unpack_cpu_weight(p13), w13)
    got = torch.ops.rubin.moe(x, p13, p2, w, ids, "silu", b13, b2, weight_layout="vllm_cpu:vec")
    assert torch.equal(got, torch.ops.rubin.moe(x, w13, w2, w, ids, "silu", b13, b2))
    torch.library.opcheck(torch.ops.rubin.moe.default, (x, p13, p2, w, ids), {"weight_layout": "vllm_cpu:vec"})
    with pytest.raises(MoEArgumentError, match="weight_layout='blocked' is not 'plain', 'vllm_cpu:<isa>' or "):
        torch.ops.rubin.moe(x, w13, w2, w, ids, weight_layout="blocked")
    for bad in ("vllm_cpu", "vllm_cpu:", "vllm_cpu:amx:pairs", "vllm_cpu:amx:vnni:1"):
        with pytest.raises(MoEArgumentError, match="is not 'plain'"):
            torch.ops.rubin.moe(x, w13, w2, w, ids, weight_layout=bad)
    x, w13, w2, w, ids, _, _ = make(E=5, H=48, I=20)  # 2I = 40 rows: not whole 16-row blocks
    with pytest.raises(MoEArgumentError, match="N divisible by 16"):
        torch.ops.rubin.moe(x, w13, w2, w, ids, weight_layout="vllm_cpu:vec")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_vllm_cpu_vnni_layout_means_the_same_weights(dtype):
    """weight_layout="vllm_cpu:amx:vnni" (K in pairs, as vLLM packs 16-bit weights for AMX): the reference unpacks
    it, so the result is the plain one exactly."""
    from rubin_compile.ops.moe import WeightLayout, pack_cpu_weight, unpack_cpu_weight

    x, w13, w2, w, ids, b13, b2 = make(E=4, H=64, I=32, bias=True, dtype=dtype)
    p13, p2 = pack_cpu_weight(w13, vnni=True), pack_cpu_weight(w2, vnni=True)
    assert not torch.equal(p13, pack_cpu_weight(w13)) and torch.equal(unpack_cpu_weight(p13, vnni=True), w13)
    # K in pairs inside each 16-row block: element (n, k) sits at [n // 16, k // 2, n % 16, k % 2]
    assert p13[1].reshape(4, 32, 16, 2)[1, 3, 5, 1] == w13[1, 16 + 5, 2 * 3 + 1]
    got = torch.ops.rubin.moe(x, p13, p2, w, ids, "silu", b13, b2, weight_layout="vllm_cpu:amx:vnni")
    assert torch.equal(got, torch.ops.rubin.moe(x, w13, w2, w, ids, "silu", b13, b2))
    assert WeightLayout.decode("vllm_cpu:amx:vnni") == WeightLayout("vllm_cpu", "amx", vnni=True)
    assert WeightLayout("vllm_cpu", "amx", vnni=True).encode() == "vllm_cpu:amx:vnni"


def test_out_of_range_expert_id():
    x, w13, w2, w, ids, _, _ = make()
    ids[0, 0] = 99
    with pytest.raises(MoEArgumentError, match="outside"):
        moe_reference(x, w13, w2, w, ids)


def test_fake_impl_and_opcheck():
    x, w13, w2, w, ids, _, _ = make()
    torch.library.opcheck(torch.ops.rubin.moe.default, (x, w13, w2, w, ids))
    with torch._subclasses.FakeTensorMode() as mode:
        out = torch.ops.rubin.moe(*(mode.from_tensor(t) for t in (x, w13, w2, w, ids)))
    assert out.shape == x.shape and out.dtype == x.dtype


def test_launch_settings_a_kernel_does_not_take_change_nothing():
    """pdl=True and a placement on the reference kernel, which takes neither: it runs without them, as the op's
    docstring says (before: TypeError from the kernel)."""
    x, w13, w2, w, ids, b13, b2 = make(H=256, I=128, bias=True)
    want = torch.ops.rubin.moe(x, w13, w2, w, ids, "silu", b13, b2)
    got = torch.ops.rubin.moe(x, w13, w2, w, ids, "silu", b13, b2, pdl=True, placement="split_n:backfill:2:16")
    assert torch.equal(got, want)


@pytest.mark.parametrize("bias", [False, True])
def test_reference_without_synchronisation_equals_the_reference(bias):
    """While a CUDA graph is captured the reference runs every expert on every token, weighted by the routing
    (no unique / nonzero over the routing, which would synchronise): the same sum."""
    from rubin_compile.ops.moe import MoEArgs, _reference_in_capture

    T, H, E, I, k = 7, 16, 6, 8, 2
    x, w13, w2 = torch.randn(T, H), torch.randn(E, 2 * I, H) / 4, torch.randn(E, H, I) / 3
    ids = torch.rand(T, E).topk(k).indices
    ids[0] = torch.tensor([3, 3])  # a duplicate expert in one row
    b13, b2 = (torch.randn(E, 2 * I), torch.randn(E, H)) if bias else (None, None)
    args = MoEArgs(x, w13, w2, torch.rand(T, k), ids, "silu", b13, b2)
    want = moe_reference(x.double(), w13.double(), w2.double(), args.topk_weights, ids, "silu",
                         *(t.double() if t is not None else None for t in (b13, b2)))  # fmt: skip
    got = _reference_in_capture(args, w13, w2, torch.zeros(T, H))
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ("silu", "gelu_tanh", "swigluoai", "silu_clamp:2.5", "relu2_no_mul"))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("on_input", [False, True])
def test_aten_form_equals_the_reference(act, bias, on_input):
    """The ATen form select_kernels lowers a CPU bf16 node into (grouped GEMMs over the slots sorted by expert):
    bitwise the reference run eagerly (it sums the slots in the reference's order), duplicate ids and experts no
    token routes to included; and both within bf16 tolerance of the float64 restatement."""
    from rubin_compile.ops.moe import MoEArgs, aten, aten_declines, reference

    x, w13, w2, w, ids, b13, b2 = make(T=9, H=32, E=6, I=16, k=3, dtype=torch.bfloat16, bias=bias,
                                       gated=not act.endswith("_no_mul"))  # fmt: skip
    ids[0, 1] = ids[0, 0]  # a duplicate expert in one row
    ids[ids == 5] = 4  # expert 5 gets no token
    args = MoEArgs(x, w13, w2, w, ids, act, b13, b2, apply_router_weight_on_input=on_input)
    assert aten_declines(args) is None
    got = aten(args)
    assert got.dtype == x.dtype and torch.equal(got, reference(args))
    want = dense_moe(x, w13, w2, w, ids, act, b13, b2, on_input)
    assert torch.allclose(got.double(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_aten_form_of_an_empty_batch_and_runtime_constants():
    from rubin_compile.ops.moe import MoEArgs, aten, reference

    x, w13, w2, w, ids, _, _ = make(T=0, H=32, I=16, dtype=torch.bfloat16)
    assert aten(MoEArgs(x, w13, w2, w, ids)).shape == (0, x.shape[1])
    x, w13, w2, w, ids, _, _ = make(H=32, I=16, dtype=torch.bfloat16)
    args = MoEArgs(x, w13, w2, w, ids, "swigluoai", activation_constants=torch.tensor([1.25, 2.5]))
    assert torch.equal(aten(args), reference(args))


def test_aten_form_declines_what_it_cannot_express_with_the_reason():
    """fp16 (Inductor compiles torch's grouped GEMM for bf16 only; fp32 takes grouped_mm_rows), FP8 weights, vLLM's
    packed layout, a GPU target below sm_90 or not in bf16: each a reason; the node then stays an op call
    (tests/cpu/passes/test_select_kernels.py)."""
    from rubin_compile.ops.moe import MoEArgs, aten_declines, pack_cpu_weight

    x, w13, w2, w, ids, _, _ = make(E=4, H=64, I=32)
    assert aten_declines(MoEArgs(x, w13, w2, w, ids)) is None  # float32: grouped_mm_rows
    assert "bfloat16 only" in aten_declines(MoEArgs(x.half(), w13.half(), w2.half(), w, ids))
    f8 = torch.float8_e4m3fn
    fp8 = MoEArgs(x.bfloat16(), w13.to(f8), w2.to(f8), w, ids, w13_scale=torch.ones(4), w2_scale=torch.ones(4))
    assert "float8_e4m3fn weights" in aten_declines(fp8)
    b13, b2 = w13.bfloat16(), w2.bfloat16()
    packed = MoEArgs(x.bfloat16(), pack_cpu_weight(b13), pack_cpu_weight(b2), w, ids, weight_layout="vllm_cpu:vec")
    assert "16-row blocks layout" in aten_declines(packed)
    plain = MoEArgs(x.bfloat16(), b13, b2, w, ids)
    assert aten_declines(plain) is None
    x, w13, w2, w, ids, _, _ = make(E=4, H=24, I=12, dtype=torch.bfloat16)  # 12 bf16 values: 24 bytes a row
    assert "rows of whole 16 bytes" in aten_declines(MoEArgs(x, w13, w2, w, ids)) and "'I': 12" in aten_declines(
        MoEArgs(x, w13, w2, w, ids)
    )
    # a GPU target: bf16 of plain layout from sm_90 (the grouped GEMM reads only the routed experts; the reference
    # in a CUDA graph runs them all); float32 tensors of a plan made on this CPU do not count as the CPU's
    assert aten_declines(plain, target_cc=90) is None and aten_declines(plain, target_cc=107) is None
    assert "sm_90 or newer (the target is cc 80)" in aten_declines(plain, target_cc=80)
    assert "on a GPU takes bfloat16" in aten_declines(MoEArgs(x.float(), w13.float(), w2.float(), w, ids), target_cc=90)
    assert "float8_e4m3fn weights" in aten_declines(fp8, target_cc=90)


@pytest.mark.parametrize("on_input", [False, True], ids=["weights-after", "weights-on-input"])
def test_float32_aten_form_equals_the_reference(on_input):
    """float32 on the CPU: the two grouped GEMMs are grouped_mm_rows calls (a GEMM per expert's run of rows), which
    compute each expert's rows as the reference does, and the slots are summed in the reference's order: equal to
    it, bias and rows that are not whole 16 bytes included; an expert id outside [0, E) drops its
    slot, as in bf16 (the routing weight applied after the experts)."""
    from rubin_compile.ops.moe import MoEArgs, aten, grouped_mm_rows, reference

    x, w13, w2, w, ids, b13, b2 = make(T=9, H=24, E=6, I=12, k=2, bias=True)
    args = MoEArgs(x, w13, w2, w, ids, "silu", b13, b2, apply_router_weight_on_input=False)
    if on_input:
        ids, w = ids[:, :1].contiguous(), torch.ones(9, 1)
        args = MoEArgs(x, w13, w2, w, ids, "silu", b13, b2, apply_router_weight_on_input=True)
    torch.testing.assert_close(aten(args), reference(args), rtol=1e-6, atol=1e-6)
    if on_input:  # a zero weight on the input still adds the expert's biases: no twin call to compare with
        return
    bad = ids.clone()
    bad[2, 0] = 99
    dropped = w.clone()
    dropped[2, 0] = 0.0
    kept = MoEArgs(x, w13, w2, dropped, ids, "silu", b13, b2)
    got = aten(MoEArgs(x, w13, w2, w, bad, "silu", b13, b2))
    torch.testing.assert_close(got, reference(kept), rtol=1e-6, atol=1e-6)
    # the op alone: a run per expert, empty runs skipped, rows past the last run zero
    rows, wt = torch.randn(7, 5), torch.randn(3, 5, 4)
    out = grouped_mm_rows(rows, wt, torch.tensor([2, 2, 5], dtype=torch.int32))
    want = torch.cat([rows[:2] @ wt[0], rows[2:5] @ wt[2], torch.zeros(2, 4)])
    torch.testing.assert_close(out, want)


def test_aten_form_drops_an_expert_id_outside_the_range():
    """Without a host synchronisation the ATen form cannot raise on an expert id outside [0, E) as the reference
    does; such a slot contributes nothing, as if its routing weight were zero (before: an id >= E added the rows the
    grouped GEMM leaves unwritten, NaN on this CPU, and a negative one was computed as expert 0)."""
    from rubin_compile.ops.moe import MoEArgs, aten, reference

    x, w13, w2, w, ids, b13, b2 = make(T=6, H=32, E=5, I=16, k=2, dtype=torch.bfloat16, bias=True)
    bad = ids.clone()
    bad[1, 0], bad[3, 1] = 99, -1
    dropped = w.clone()
    dropped[1, 0] = dropped[3, 1] = 0.0
    got = aten(MoEArgs(x, w13, w2, w, bad, "silu", b13, b2))
    assert torch.isfinite(got).all()
    assert torch.equal(got, reference(MoEArgs(x, w13, w2, dropped, ids, "silu", b13, b2)))
