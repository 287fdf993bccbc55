"""match_attention: rewrite scaled-dot-product attention into ``rubin.attention``; record vLLM's attention.

Idioms rewritten, as post-grad ATen gives them (torch 2.13). Source: ``F.scaled_dot_product_attention`` in
plain PyTorch and in Hugging Face transformers 5.x (``transformers/integrations/sdpa_attention.py``,
``sdpa_attention_forward``: every ``attn_implementation="sdpa"`` model -- Llama, Qwen2/3(-MoE), Mixtral...),
and hand-written ``softmax(q @ k.T) @ v`` that Inductor's own ``fuse_attention`` pass turned into SDPA::

    # CPU (torch 2.13: the CPU flash kernel, whatever the mask; fp32 / bf16 / fp16)
    o = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]            # is_causal
    o = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=m, scale=0.25)[0]
    # CUDA (the backend SDPA picked at trace time)
    o = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=s)[0]            # no mask
    o = aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, 0.0, False)[0]  # mask as bias
    o = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, 0.0, True)[0]
    o = aten._scaled_dot_product_fused_attention_overrideable(q, k, v, bias, ...)[0]      # XPU, PrivateUse1
    o = aten.scaled_dot_product_attention(q, k, v, m, 0.0, False, enable_gqa=True)         # not decomposed

A bool ``attn_mask`` reaches the op already converted by SDPA (``where(mask, 0.0, -inf)``); it is passed on as
it is. GQA comes two ways, both kept as GQA: natively (``enable_gqa=True``: the op takes ``k``/``v`` with
``Hkv < Hq`` heads; transformers does this when there is no mask) or with the key/value heads repeated in the
graph (transformers' ``repeat_kv`` when there is a mask, or ``k.repeat_interleave(n, dim=1)``)::

    k_rep = aten.reshape(aten.clone(aten.expand(aten.unsqueeze(k, 2), [B, Hkv, n, S, D])), [B, Hkv * n, S, D])

which the rewrite folds away (``rubin.attention`` takes ``k`` itself, and the copy of every KV head ``n`` times
disappears when nothing else reads it).

A Hugging Face **static cache** (``cache_implementation="static"``, what ``generate()`` compiles) writes the new
keys / values into preallocated ``[B, Hkv, max_cache_len, D]`` buffers and attends over the whole buffer, the
positions not yet written masked out by the bool mask generate passes in::

    k_all = aten.index_put(k_cache, [None, None, cache_position], k_new)     # keys.index_copy_(2, pos, k)
    o = sdpa(q, repeat_kv(k_all), repeat_kv(v_all), where(mask, 0.0, -inf))  # over max_cache_len

It is rewritten like any SDPA; the report says which graph input is the cache and how many positions the
graph writes, and a decode kernel reads only the positions the mask lets some query see (kernels/triton/
attention.py). An **FP8 KV cache** dequantised in the graph before attention -- ``k.to(q.dtype) * s``,
``k.to(q.dtype)``, or ``(k.float() * s).to(q.dtype)``, ``k`` in ``float8_e4m3fn`` / ``float8_e5m2``, ``s`` a
number or a one-element float tensor -- is folded into the op (``key`` in FP8, ``k_scale``), so a kernel reads
one byte per element instead of the dequantised copy; where the graph multiplied in the query's dtype the
scale is rounded to it first, so the result is the graph's. A ``repeat`` that tiles heads (``h % Hkv``) is not GQA's grouping and
stays as it is (the op then sees ``Hq == Hkv``).

Left unchanged, with the reason: an output besides the attention output is used (the logsumexp a training
graph saves for the backward pass), dropout, ``return_debug_mask``, inputs that are not 4-D ``[B, H, S, D]``,
mixed dtypes, a mask ``rubin.attention`` does not take. SDPA with dropout in a graph compiled for inference
does not reach post-grad as SDPA at all (Inductor decomposes it to ``bmm`` / ``softmax``): nothing to see.
An attention written out as ops, ``softmax(q @ k^T ...) @ v``, that Inductor's ``fuse_attention`` did not turn
into SDPA (a model's eager attention: GPT-OSS and other families with attention sinks, whose transformers code
has no SDPA path; eager attention with a mask) is read back to the same operands and rewritten (``_read_eager``)::

    w = reshape(bmm(reshape(q), reshape(permute(repeat_kv(k), [0, 1, 3, 2]))), [B, Hq, S, Skv]) * scale [+ mask]
    c = cat([w, expand(reshape(sinks, [1, Hq, 1, 1]), [B, Hq, S, 1])], -1)     # attention sinks (optional)
    p = exp(c - amax(c)) / sum(...)      (row-maximum subtractions before it; the softmax whole, or upcast)
    o = reshape(bmm(reshape(p[..., :-1]), reshape(repeat_kv(v))), [B, Hq, S, Dv])

into ``rubin.attention(q, k, v, mask, scale=scale, sinks=sinks)``. Only casts between floating dtypes are read
through; the mask must be a float tensor added as it is (no ``alpha``), the result reshaped back to
``[B, Hq, S, Dv]``. One difference is stated: a row whose every position is masked with ``-inf`` and no sink gives
NaN in the source and zeros in ``rubin.attention`` (SDPA's semantics); Hugging Face's eager masks use
``finfo.min``, with which the source gives no NaN either. Left unchanged with the reason (the report names its two
products and what its softmax holds besides the scaled scores, ``read_eager_attention``; strict mode fails on
it): tanh-softcapped scores (Gemma 2), any other step between the products, and steps whose values are read
elsewhere (returned attention weights, a backward pass).

Recorded, not rewritten: vLLM's attention::

    dep = vllm.unified_kv_cache_update(k, v, layer_name)                 # writes vLLM's paged KV cache
    out = auto_functionalized(vllm.unified_attention_with_output, query=q, key=k, value=v, output=o,
                              layer_name=L, output_scale=None, kv_cache_dummy_dep=dep)[1]
    (also ``auto_functionalized_v2(..., _output_base_index=0, _all_bases=[o])``, and MLA's
     ``vllm.unified_mla_attention_with_output(q, kv_c_normed, k_pe, output, layer_name, ...)``)

The KV cache, its paging and the attention backend are vLLM's (chosen by ``--attention-backend`` and
``--kv-cache-dtype`` when the engine starts, before any graph exists): rubin keeps the call and says so in
the report ("kept vLLM's attention"), with the layer, vLLM's backend and the kernel it runs (read from the
layer object in vLLM's forward context at compile time), and what the compile target would prefer,
answered by the kernel registry (e.g. on sm_100 / sm_107 trtllm-gen through FlashInfer, whose FP8
attention needs ``--kv-cache-dtype fp8 --attention-backend FLASHINFER``). Those records are notes, not
rewrites and not "left unchanged" (strict mode does not fail on them): keeping vLLM's attention is the design.

Why a hand walk around one node and not ``register_replacement``: the SDPA ops are single nodes whose
arguments need checking (dropout, used logsumexp, mask dtype) with a reason for each refusal, and the GQA
fold is an optional prefix on two of the inputs; a traced pattern per form x mask x fold would be dozens of
patterns that fail without saying why. vLLM's op is mutating, behind ``auto_functionalized``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

import rubin_compile.kernels  # noqa: F401  (registers every kernel onto its op: the target's preference below)
from rubin_compile.ops.attention import ATTENTION, KV_FP8_DTYPES, AttentionArgs, AttentionArgumentError
from rubin_compile.ops.registry import KernelSpec
from rubin_compile.passes.base import Pass, PassContext, PassResult, Rewrite, Unchanged
from rubin_compile.passes.fx import (
    CONVERTS,
    RESHAPES,
    bound_arguments,
    call,
    decode_mutating_call,
    dtype_name,
    inherit_source,
    is_call,
    report_value,
    same_shape,
    scalar,
    schema_name,
    tensor_val,
)

NAME = "match_attention"
IDIOM = "sdpa"

aten = torch.ops.aten
prims = torch.ops.prims

# The ATen SDPA ops and the name the report gives each form.
SDPA_FORMS: dict[Any, str] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "aten._scaled_dot_product_flash_attention_for_cpu",
    aten._scaled_dot_product_flash_attention.default: "aten._scaled_dot_product_flash_attention",
    aten._scaled_dot_product_efficient_attention.default: "aten._scaled_dot_product_efficient_attention",
    aten._scaled_dot_product_cudnn_attention.default: "aten._scaled_dot_product_cudnn_attention",
    aten._scaled_dot_product_fused_attention_overrideable.default: "aten._scaled_dot_product_fused_attention_overrideable",
    aten.scaled_dot_product_attention.default: "aten.scaled_dot_product_attention",
}

# vLLM's attention ops (vllm/model_executor/layers/attention/attention.py, mla_attention.py; vLLM 0.32 and 0.33
# register these two; the older `vllm::unified_attention` is gone from both).
VLLM_ATTENTION_OPS = (
    "vllm::unified_attention_with_output",
    "vllm::unified_mla_attention_with_output",
)


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    for node in list(graph.nodes):
        if node.op != "call_function" or node._erased:  # erased: part of an attention rewritten before it
            continue
        if node.target in SDPA_FORMS:
            outcome = _rewrite_sdpa(graph, node)
            if isinstance(outcome, Rewrite):
                result.rewrites.append(outcome)
            else:
                result.unchanged.append(Unchanged(node.name, IDIOM, outcome))
            continue
        record = read_vllm_attention(node, ctx)
        if record is not None:
            node.meta["rubin_kept"] = record
            result.notes.append(describe_kept(record))
            continue
        seen = _eager_seen(node)
        if seen is not None:
            what = seen.describe(node)
            outcome = _rewrite_eager(graph, node, seen)
            if isinstance(outcome, Rewrite):
                result.rewrites.append(outcome)
            else:
                result.unchanged.append(
                    Unchanged(node.name, EAGER_IDIOM, f"{what}: {outcome}; it stays as Inductor compiles it")
                )
    result.changed = bool(result.rewrites)
    if result.changed:
        graph.lint()
    return result


# --------------------------------------------------------------------------------------------------
# attention written out (matmul -> softmax -> matmul): rewritten where rubin.attention expresses it, else left
# unchanged with the reason
# --------------------------------------------------------------------------------------------------

EAGER_IDIOM = "eager attention"

# Ops that only move, view or convert values between the softmax and the products around it.
_PASS_THROUGH = (
    *RESHAPES,
    aten.expand.default,
    aten.clone.default,
    aten.slice.Tensor,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    *CONVERTS,
)
# The softmax as the graph holds it: decomposed (``exp(x - amax) / sum``; Inductor decomposes ``softmax`` before
# post-grad passes run) or whole.
_SOFTMAX = (aten._softmax.default, aten._safe_softmax.default)
_SCORES_DEPTH = 24  # nodes walked back from the softmax's exp to find the scores' matmul


def _through(node: Any) -> Any:
    while is_call(node, *_PASS_THROUGH):
        node = node.args[0]
    return node


def _softmax_input(node: Any) -> Optional[torch.fx.Node]:
    """The input of the softmax that produced ``node`` (``exp(x) / sum(exp(x))`` or ``_softmax(x)``), else None."""
    node = _through(node)
    if is_call(node, *_SOFTMAX):
        return node.args[0]
    if is_call(node, aten.div.Tensor):
        num = node.args[0]
        if is_call(num, aten.where.self):  # _safe_softmax: where(all masked, 0, exp / sum)
            num = num.args[2]
        if is_call(num, aten.exp.default):
            return num.args[0]
    if is_call(node, aten.where.self):
        return _softmax_input(node.args[2])
    return None


@dataclass
class _EagerSeen:
    """A ``probs @ v`` product whose probabilities are a softmax of scores from another bmm: what its softmax holds
    besides the scaled scores."""

    scores: torch.fx.Node  # the q @ k^T bmm
    sinks: bool  # a column concatenated on the last dim before the softmax
    softcap: bool  # a tanh between the scores and the softmax

    def describe(self, node: torch.fx.Node) -> str:
        extra = []
        if self.sinks:
            extra.append("attention sinks (a logit per head concatenated to the scores before the softmax)")
        if self.softcap:
            extra.append("tanh softcapping of the scores")
        what = f", with {' and '.join(extra)}" if extra else ""
        return f"attention written as matmul -> softmax -> matmul ({self.scores.name} -> softmax -> {node.name}){what}"


def _eager_seen(node: torch.fx.Node) -> Optional[_EagerSeen]:
    """What ``node`` completes, when it is the ``probs @ v`` product of an attention written out as ops; else None."""
    if not is_call(node, aten.bmm.default):
        return None
    start = _softmax_input(node.args[0])
    if start is None:
        return None
    seen, frontier, found = set(), [start], None
    sinks = softcap = False
    for _ in range(_SCORES_DEPTH):
        if not frontier or found is not None:
            break
        nxt = []
        for n in frontier:
            if not isinstance(n, torch.fx.Node) or n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if is_call(n, aten.bmm.default):
                found = n
                break
            if is_call(n, aten.cat.default):
                val = tensor_val(n)
                sinks = sinks or (val is not None and bound_arguments(n)["dim"] in (-1, val.dim() - 1))
            softcap = softcap or is_call(n, aten.tanh.default)
            nxt.extend(a for a in n.all_input_nodes)
        frontier = nxt
    return None if found is None else _EagerSeen(found, sinks, softcap)


def read_eager_attention(node: torch.fx.Node) -> Optional[str]:
    """What attention ``node`` completes, when ``node`` is the ``probs @ v`` product of an attention written out as
    ops (``softmax(q @ k^T ...) @ v``: a model's eager attention, which neither SDPA nor Inductor's
    ``fuse_attention`` pass turned into an SDPA call): its two products and what the softmax holds besides the
    scores (attention sinks, softcapping); None for any other node. ``_rewrite_eager`` then rewrites it or says
    why not."""
    seen = _eager_seen(node)
    return None if seen is None else seen.describe(node)


@dataclass
class _EagerAttention:
    """An attention written out as ops, read back to ``rubin.attention``'s operands."""

    query: torch.fx.Node  # [B, Hq, S, D] (key / value may still be repeated: _new_attention folds that)
    key: torch.fx.Node
    value: torch.fx.Node
    mask: Optional[torch.fx.Node]  # added to the scaled scores
    scale: float
    sinks: Optional[torch.fx.Node]  # the logit per head concatenated to the scores (as the graph holds it)
    out: torch.fx.Node  # the [B, Hq, S, Dv] result, which the rewrite replaces
    walked: list[torch.fx.Node]  # the nodes between the operands and ``out``


def _unbatch(node: Any, walked: list) -> Optional[torch.fx.Node]:
    """``x`` for ``reshape([expand](x, [B, H, M, N]), [B * H, M, N])`` -- how a 4-D ``matmul`` reaches ``bmm`` -- with
    ``x`` 4-D and the expand not broadcasting (the reshape and expand added to ``walked``); else None."""
    if not is_call(node, *RESHAPES):
        return None
    chain = [node]
    inner = node.args[0]
    if is_call(inner, aten.expand.default):
        chain.append(inner)
        inner = inner.args[0]
    val, out = tensor_val(inner), tensor_val(node)
    if val is None or out is None or val.dim() != 4 or out.dim() != 3:
        return None
    B, H, M, N = val.shape
    if not all(statically_known_true(a == b) for a, b in zip(out.shape, (B * H, M, N))):
        return None
    walked += chain
    return inner


def _strip(node: Any, walked: list, *targets: Any) -> Any:
    """``node`` with calls of ``targets`` (their first argument) peeled off -- a conversion only between floating
    dtypes (one to an integer changes the values) --; a non-broadcasting ``expand`` too."""
    while True:
        if is_call(node, *targets) and (not is_call(node, *CONVERTS) or _float_to_float(node)):
            walked.append(node)
            node = node.args[0]
        elif is_call(node, aten.expand.default) and _same_shape_nodes(node, node.args[0]):
            walked.append(node)
            node = node.args[0]
        else:
            return node


def _float_to_float(node: torch.fx.Node) -> bool:
    src, dst = tensor_val(node.args[0]), tensor_val(node)
    return src is not None and dst is not None and src.dtype.is_floating_point and dst.dtype.is_floating_point


def _same_shape_nodes(a: Any, b: Any) -> bool:
    va, vb = tensor_val(a), tensor_val(b)
    return va is not None and vb is not None and same_shape(va, vb)


def _last_dim(dim: Any, node: Any) -> bool:
    val = tensor_val(node)
    return val is not None and isinstance(dim, int) and dim in (-1, val.dim() - 1)


def _row_max_of(m: Any, x: Any) -> Optional[list[torch.fx.Node]]:
    """The nodes of ``m`` when it is the maximum of ``x`` over the last dim, kept (``amax(x, [-1], True)`` or
    ``max(x, -1, True)[0]``); else None."""
    if is_call(m, aten.amax.default):
        a = bound_arguments(m)
        if a["self"] is x and a["keepdim"] and len(a["dim"]) == 1 and _last_dim(a["dim"][0], x):
            return [m]
    if is_call(m, operator.getitem) and m.args[1] == 0 and is_call(m.args[0], aten.max.dim):
        mx = m.args[0]
        a = bound_arguments(mx)
        if a["self"] is x and a["keepdim"] and _last_dim(a["dim"], x):
            return [m, mx]
    return None


def _softmax_of(p: Any, walked: list) -> Optional[torch.fx.Node]:
    """``x`` for ``p = softmax(x, dim=-1)`` (whole, or as Inductor decomposes it: ``exp(y - amax(y)) / sum``),
    before the subtractions of its row maximum (a softmax does not change by them) and the upcasts around it."""
    p = _strip(p, walked, *CONVERTS)
    if is_call(p, *_SOFTMAX):
        if not _last_dim(p.args[1], p.args[0]):
            return None
        walked.append(p)
        x = p.args[0]
    elif is_call(p, aten.div.Tensor) and is_call(p.args[0], aten.exp.default):
        e, total = p.args[0], p.args[1]
        if not is_call(total, aten.sum.dim_IntList):
            return None
        a = bound_arguments(total)
        if not (a["self"] is e and a["dim"] and len(a["dim"]) == 1 and a["keepdim"] and _last_dim(a["dim"][0], e)):
            return None
        walked += [p, e, total]
        x = e.args[0]
    else:
        return None
    while True:
        x = _strip(x, walked, *CONVERTS)
        if is_call(x, aten.sub.Tensor):
            base = _strip(x.args[0], [], *CONVERTS)
            m = _row_max_of(x.args[1], x.args[0]) or _row_max_of(x.args[1], base)
            if m is not None:
                walked += [x, *m]
                x = x.args[0]
                continue
        return x


def _scaled_scores(x: Any, walked: list) -> Optional[tuple[torch.fx.Node, float]]:
    """(the ``q @ k^T`` bmm, the number it is multiplied by) for ``x = reshape(bmm) * c`` (also ``/ c``, several
    times or none); else None."""
    scale = 1.0
    while True:
        x = _strip(x, walked, *CONVERTS)
        if is_call(x, aten.mul.Tensor) and scalar(x.args[1]) is not None:
            scale *= scalar(x.args[1])
        elif is_call(x, aten.mul.Tensor) and scalar(x.args[0]) is not None:
            walked.append(x)
            scale *= scalar(x.args[0])
            x = x.args[1]
            continue
        elif is_call(x, aten.div.Tensor) and scalar(x.args[1]) not in (None, 0.0):
            scale /= scalar(x.args[1])
        elif is_call(x, *RESHAPES) and is_call(x.args[0], aten.bmm.default):
            walked += [x, x.args[0]]
            return x.args[0], scale
        else:
            return None
        walked.append(x)
        x = x.args[0]


def _head_logits(col: Any, hq: Any, walked: list) -> Optional[torch.fx.Node]:
    """The sinks' source for the column ``col`` [B, Hq, S, 1] concatenated to the scores: a tensor of ``Hq`` values
    broadcast over batch and positions (``sinks.reshape(1, -1, 1, 1).expand(B, -1, S, -1)``), as a 1-D node when
    the graph has one; else None."""
    n = col
    while is_call(n, aten.expand.default):
        walked.append(n)
        n = n.args[0]
    val = tensor_val(n)
    if val is None or val.dim() != 4 or not statically_known_true(val.shape[1] == hq):
        return None
    if not all(statically_known_true(val.shape[i] == 1) for i in (0, 2, 3)):
        return None
    while is_call(n, *RESHAPES):
        inner = tensor_val(n.args[0])
        if inner is None or inner.numel() != val.numel():
            break
        walked.append(n)
        n = n.args[0]
    return n


def _read_eager(node: torch.fx.Node, seen: _EagerSeen):
    """``node`` (the ``probs @ v`` bmm of an attention written out as ops, ``seen``) read back to the operands of
    ``rubin.attention`` (an ``_EagerAttention``), or why it cannot be."""
    if seen.softcap:
        return "rubin.attention (SDPA's semantics, plus attention sinks) has no softcapping"
    walked: list[torch.fx.Node] = [node]
    users = list(node.users)
    out = users[0] if len(users) == 1 else None
    if not (is_call(out, *RESHAPES) and tensor_val(out) is not None and tensor_val(out).dim() == 4):
        return "its product is not reshaped back to [B, H, S, Dv] (a 4-D matmul)"
    walked.append(out)
    p, v = _unbatch(node.args[0], walked), _unbatch(node.args[1], walked)
    if p is None or v is None:
        return "its operands are not 4-D [B, H, S, ...] tensors batched for bmm"
    pv, vv = tensor_val(p), tensor_val(v)
    want = (pv.shape[0], pv.shape[1], pv.shape[2], vv.shape[3])
    if not all(statically_known_true(a == b) for a, b in zip(tensor_val(out).shape, want)):
        return f"its product is reshaped to {tuple(tensor_val(out).shape)}, not back to [B, H, S, Dv] = {want}"
    p = _strip(p, walked, aten.clone.default, *CONVERTS)
    sliced = is_call(p, aten.slice.Tensor)
    if sliced:
        a = bound_arguments(p)
        width = tensor_val(p.args[0]).shape[-1] if tensor_val(p.args[0]) is not None else None
        end = a["end"]
        if not (
            _last_dim(a["dim"], p) and a["start"] in (0, None) and a["step"] == 1 and (end == -1 or end == width - 1)
        ):
            return "the probabilities are a slice of the softmax other than all but its last column"
        walked.append(p)
        p = p.args[0]
    x = _softmax_of(p, walked)
    if x is None:
        return "its softmax is not over the last dim of the scores (or not a plain softmax)"
    sinks = None
    if is_call(x, aten.cat.default):
        a = bound_arguments(x)
        parts = a["tensors"]
        if not sliced or len(parts) != 2 or not _last_dim(a["dim"], x):
            return "the softmax is over scores concatenated with something other than one column it then drops"
        walked.append(x)
        x, col = parts
        sinks = _head_logits(col, tensor_val(out).shape[1], walked)
        if sinks is None:
            return "the column concatenated to the scores is not one logit per head (a sink) broadcast over rows"
    elif sliced:
        return "the probabilities drop the softmax's last column, which is not a concatenated sink column"
    x = _strip(x, walked, *CONVERTS)
    mask = None
    if is_call(x, aten.add.Tensor):
        alpha = bound_arguments(x)["alpha"]
        if alpha != 1:
            return f"the mask is added times alpha={alpha}"
        for a, b in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
            trial: list[torch.fx.Node] = []
            if isinstance(b, torch.fx.Node) and _scaled_scores(a, trial) is not None:
                if tensor_val(b) is None or not tensor_val(b).dtype.is_floating_point:
                    return f"the scores are added to {b.name}, a tensor that is not floating-point (a bool adds 0 / 1)"
                walked.append(x)
                x, mask = a, b
                break
        else:
            return "the scores are added to something that is not a mask: neither side is q @ k^T times a number"
    scores = _scaled_scores(x, walked)
    if scores is None:
        return "the scores are not q @ k^T multiplied by a number (and then a mask added)"
    qk, scale = scores
    q, kt = _unbatch(qk.args[0], walked), _unbatch(qk.args[1], walked)
    if q is None or kt is None:
        return "q @ k^T does not multiply 4-D [B, H, S, D] tensors"
    k = _untransposed(kt)
    if k is None:
        return "the keys are not transposed over their last two dims for q @ k^T"
    walked.append(kt)
    inside = set(walked)
    for n in walked:
        outside = [u.name for u in n.users if u not in inside and not _reads_shape_only(u)] if n is not out else []
        if outside:
            return (
                f"its {n.name} is also read by {', '.join(outside)} (attention weights returned, or saved for a "
                "backward pass); rubin.attention returns only the attention output"
            )
    return _EagerAttention(q, k, v, mask, scale, sinks, out, walked)


def _reads_shape_only(node: torch.fx.Node) -> bool:
    """A node that reads only its input's sizes / strides (``sym_size`` under dynamic shapes), not its values."""
    return is_call(
        node, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default
    )


def _untransposed(kt: torch.fx.Node) -> Optional[torch.fx.Node]:
    """``k`` for ``kt = k.transpose(-2, -1)`` (``permute(k, [0, 1, 3, 2])`` or ``transpose(k, 2, 3)``)."""
    if is_call(kt, aten.permute.default) and list(kt.args[1]) in ([0, 1, 3, 2], [0, 1, -1, -2]):
        return kt.args[0]
    if is_call(kt, aten.transpose.int) and {kt.args[1] % 4, kt.args[2] % 4} == {2, 3}:
        return kt.args[0]
    return None


def _rewrite_eager(graph: torch.fx.Graph, node: torch.fx.Node, seen: _EagerSeen):
    """Rewrite the attention written out as ops that ``node`` (its ``probs @ v``) completes into ``rubin.attention``
    (with ``sinks`` where its softmax has a sink column); the Rewrite, or why it was left alone."""
    read = _read_eager(node, seen)
    if isinstance(read, str):
        return read
    sinks = read.sinks
    with graph.inserting_before(node):
        sval = tensor_val(sinks)
        if sinks is not None and sval is not None and sval.dim() != 1:
            sinks = call(graph, aten.reshape.default, (sinks, [sval.numel()]))
    built = _new_attention(graph, node, read.query, read.key, read.value, read.mask, False, read.scale, sinks)
    if isinstance(built, str):
        if sinks is not read.sinks:
            graph.erase_node(sinks)
        return built
    new, folded_chains, details = built
    inherit_source([new], read.out)
    read.out.replace_all_uses_with(new)
    shape_reads = [u for n in read.walked for u in n.users if _reads_shape_only(u)]  # dead once unused
    replaced = _erase_unused(graph, read.walked + folded_chains + shape_reads)
    details["sinks"] = None if sinks is None else f"{read.sinks.name} [{report_value(details['Hq'])}]"
    form = "matmul -> softmax -> matmul" + (" with attention sinks" if sinks is not None else "")
    return _attention_rewrite(new, EAGER_IDIOM, form, replaced, details)


# --------------------------------------------------------------------------------------------------
# SDPA -> rubin.attention
# --------------------------------------------------------------------------------------------------


def _output_users(node: torch.fx.Node) -> tuple[Optional[list[torch.fx.Node]], str]:
    """The getitem(0) nodes of a tuple-returning SDPA op, or (None, why another output is needed)."""
    returns = node.target._schema.returns
    if len(returns) == 1:
        return [node], ""
    outs = []
    for user in node.users:
        if not is_call(user, operator.getitem) or not isinstance(user.args[1], int):
            return None, f"its result tuple is read whole by {user.name}"
        if user.args[1] == 0:
            outs.append(user)
        elif user.users:
            what = returns[user.args[1]].name
            hint = " (saved for the backward pass of a training graph)" if "sumexp" in what else ""
            return None, (
                f"its {what} output is used by {', '.join(u.name for u in user.users)}{hint}; "
                "rubin.attention returns only the attention output"
            )
    return outs, ""


def _unrepeat(node: Any) -> Optional[tuple[torch.fx.Node, int, list[torch.fx.Node]]]:
    """For ``reshape([clone](expand(unsqueeze(x, 2), [B, H, n, S, D])), [B, H * n, S, D])`` (GQA's
    ``repeat_kv`` / ``repeat_interleave(n, dim=1)``): (x, n, the chain's nodes); else None."""
    if not is_call(node, *RESHAPES):
        return None
    chain = [node]
    inner = node.args[0]
    if is_call(inner, aten.clone.default):
        chain.append(inner)
        inner = inner.args[0]
    if not is_call(inner, aten.expand.default):
        return None
    chain.append(inner)
    unsq = inner.args[0]
    if not is_call(unsq, aten.unsqueeze.default) or unsq.args[1] not in (2, -3):
        return None
    chain.append(unsq)
    base = unsq.args[0]
    bv, ev, ov = tensor_val(base), tensor_val(inner), tensor_val(node)
    if bv is None or ev is None or ov is None or bv.dim() != 4 or ev.dim() != 5 or ov.dim() != 4:
        return None
    B, H, S, D = bv.shape
    n = ev.shape[2]
    if not isinstance(n, int) or n < 1:
        return None
    want = ((ev, (B, H, n, S, D)), (ov, (B, H * n, S, D)))
    if not all(statically_known_true(x == y) for val, shape in want for x, y in zip(val.shape, shape)):
        return None
    return base, n, chain


def _rewrite_sdpa(graph: torch.fx.Graph, node: torch.fx.Node):
    """Rewrite one SDPA node into ``rubin.attention``; return the Rewrite, or the reason it was left alone."""
    form = SDPA_FORMS[node.target]
    args = bound_arguments(node)
    outs, why = _output_users(node)
    if outs is None:
        return why
    if args.get("dropout_p", 0.0) not in (0, 0.0):
        return f"dropout_p={args['dropout_p']}: rubin.attention is inference attention, without dropout"
    if args.get("return_debug_mask"):
        return "return_debug_mask=True (a debugging output rubin.attention does not produce)"
    q, k, v = args["query"], args["key"], args["value"]
    mask = args.get("attn_mask", args.get("attn_bias"))
    built = _new_attention(graph, node, q, k, v, mask, bool(args.get("is_causal", False)), args.get("scale"))
    if isinstance(built, str):
        return built
    new, folded_chains, details = built
    inherit_source([new], node)
    replaced = [node.name]
    for out in outs:
        if out is not node:
            out.replace_all_uses_with(new)
            replaced.append(out.name)
    if node.target is aten.scaled_dot_product_attention.default:
        node.replace_all_uses_with(new)
    for user in list(node.users):  # unused getitems (logsumexp, ...)
        replaced.append(user.name)
        graph.erase_node(user)
    for out in outs:
        if out is not node and not out._erased:
            graph.erase_node(out)
    graph.erase_node(node)
    replaced += _erase_unused(graph, folded_chains)  # the repeat copies, where nothing else reads them
    return _attention_rewrite(new, IDIOM, form, replaced, details)


def _attention_rewrite(new: torch.fx.Node, idiom: str, form: str, replaced: list[str], details: dict) -> Rewrite:
    return Rewrite(
        node=new.name,
        canonical_op="rubin.attention",
        source_idiom=f"{idiom} ({form})",
        replaced=sorted(set(replaced)),
        details={"form": form, **details},
    )


def _erase_unused(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Erase those of ``nodes`` nothing reads any more (users first, until none is left); their names."""
    erased, left = [], [n for n in nodes if isinstance(n, torch.fx.Node)]
    while True:
        dead = [n for n in left if not n._erased and not n.users]
        if not dead:
            return erased
        for n in dead:
            erased.append(n.name)
            graph.erase_node(n)
        left = [n for n in left if not n._erased]


def _new_attention(
    graph: torch.fx.Graph,
    anchor: torch.fx.Node,
    q: torch.fx.Node,
    k: torch.fx.Node,
    v: torch.fx.Node,
    mask: Optional[torch.fx.Node],
    is_causal: bool,
    scale: Optional[float],
    sinks: Optional[torch.fx.Node] = None,
):
    """A ``rubin.attention`` node before ``anchor`` for an attention of these operands (repeated key / value heads
    folded back into GQA, an FP8 cache's dequantisation folded into the op): (the node, the nodes of the folded
    chains, the report's details), or the reason it cannot be built."""
    vals = {n: tensor_val(x) for n, x in (("query", q), ("key", k), ("value", v))}
    if any(val is None for val in vals.values()) or (mask is not None and tensor_val(mask) is None):
        return "no fake tensor recorded on its inputs"
    for name, val in vals.items():
        if val.dim() != 4:
            return (
                f"{name} is {val.dim()}-D {tuple(val.shape)}; rubin.attention takes [B, H, S, D] "
                "(SDPA's other batch ranks are not rewritten)"
            )

    # Fold repeated KV heads back into GQA: both or neither (key and value must keep one head count).
    gqa = "native (enable_gqa)" if vals["query"].shape[1] != vals["key"].shape[1] else "none (Hq == Hkv)"
    folded_chains: list[torch.fx.Node] = []
    rk, rv = _unrepeat(k), _unrepeat(v)
    if rk is not None and rv is not None and rk[1] == rv[1] and rk[1] > 1:
        k, v = rk[0], rv[0]
        folded_chains = rk[2] + rv[2]
        gqa = f"repeat_kv folded (key/value heads were repeated x{rk[1]} in the graph)"
    elif rk is not None or rv is not None:
        gqa = "repeated in the graph, not folded (key and value are not repeated alike)"
    qdtype = vals["query"].dtype
    dk, dv = _dequantized_fp8(k, qdtype), _dequantized_fp8(v, qdtype)
    kv_cache = dtype_name(tensor_val(k).dtype) if tensor_val(k) is not None else "?"
    fold = None
    if dk is not None and dv is not None and tensor_val(dk.base).dtype == tensor_val(dv.base).dtype:
        fold = {"k_scale": dk, "v_scale": dv}
        k, v = dk.base, dv.base
        folded_chains += dk.chain + dv.chain
        kv_cache = f"{dtype_name(tensor_val(k).dtype)}, dequantised in the graph ({dk.form}): folded"
    kv, vv = tensor_val(k), tensor_val(v)
    sval = tensor_val(sinks) if sinks is not None else None
    try:
        checked = AttentionArgs(vals["query"], kv, vv, tensor_val(mask), is_causal, scale, sinks=sval)
    except AttentionArgumentError as e:
        return f"its operands do not fit rubin.attention: {e}"

    kwargs: dict[str, Any] = {"is_causal": is_causal, "scale": scale}
    if mask is not None:
        kwargs = {"attn_mask": mask, **kwargs}
    with graph.inserting_before(anchor):
        for name, dq in (fold or {}).items():
            scale_node = dq.emit(graph, q, qdtype)
            if scale_node is not None:
                kwargs[name] = scale_node
        if sinks is not None:
            kwargs["sinks"] = sinks
        new = call(graph, torch.ops.rubin.attention.default, (q, k, v), kwargs)

    mval = tensor_val(mask)
    details: dict[str, Any] = {
        **{n: report_value(getattr(checked, n)) for n in ("B", "Hq", "Hkv", "S", "Skv", "D", "Dv")},
        "dtype": dtype_name(qdtype),
        "gqa": gqa,
        "masking": "causal" if is_causal else ("none" if mask is None else "mask"),
        "mask": None
        if mval is None
        else {"dtype": dtype_name(mval.dtype), "shape": [report_value(s) for s in mval.shape]},
        "scale": scale if scale is not None else "1/sqrt(D)",
        "kv_cache": _describe_cache(k, kv_cache),
    }
    return new, folded_chains, details


@dataclass
class _Dequant:
    """An FP8 key / value dequantised in the graph: the FP8 tensor, how it was scaled, the nodes doing it."""

    base: torch.fx.Node
    scale: Any  # None, a Python number, or a node of one float element
    round_to_query: bool  # the graph multiplied in the query's dtype: the scale is rounded to it first
    chain: list[torch.fx.Node]
    form: str

    def emit(self, graph: torch.fx.Graph, query: torch.fx.Node, qdtype: torch.dtype) -> Optional[torch.fx.Node]:
        """The op's ``k_scale`` / ``v_scale`` argument: a float32 node with exactly the value the graph used."""
        if self.scale is None:
            return None
        if not isinstance(self.scale, torch.fx.Node):
            value = torch.tensor(float(self.scale), dtype=qdtype).item() if self.round_to_query else self.scale
            return call(graph, aten.new_full.default, (query, [], float(value)), {"dtype": torch.float32})
        s = self.scale
        if self.round_to_query and tensor_val(s).dtype != qdtype:
            s = call(graph, prims.convert_element_type.default, (s, qdtype))
        if tensor_val(s).dtype != torch.float32:
            s = call(graph, prims.convert_element_type.default, (s, torch.float32))
        return s


def _fp8(node: Any) -> bool:
    val = tensor_val(node)
    return val is not None and val.dtype in KV_FP8_DTYPES


def _one_float(node: Any, zero_dim: bool) -> bool:
    """A number, or a node of one floating-point element (0-dim when ``zero_dim``)."""
    if scalar(node) is not None:
        return True
    val = tensor_val(node)
    if val is None or not val.dtype.is_floating_point:
        return False
    return val.dim() == 0 if zero_dim else (val.numel() == 1 if isinstance(val.numel(), int) else False)


def _dequantized_fp8(node: Any, qdtype: torch.dtype) -> Optional[_Dequant]:
    """If ``node`` dequantises an FP8 tensor to the query's dtype in one of the forms of the module docstring."""
    if not isinstance(node, torch.fx.Node):
        return None
    if is_call(node, prims.convert_element_type.default) and node.args[1] == qdtype:
        inner = node.args[0]
        if _fp8(inner):  # k.to(q.dtype)
            return _Dequant(inner, None, False, [node], "k.to(dtype)")
        if is_call(inner, aten.mul.Tensor):  # (k.float() * s).to(q.dtype)
            a, b = inner.args[:2]
            for x, s in ((a, b), (b, a)):
                if (
                    is_call(x, prims.convert_element_type.default)
                    and x.args[1] == torch.float32
                    and _fp8(x.args[0])
                    and _one_float(s, zero_dim=False)
                    and (scalar(s) is not None or tensor_val(s).dtype == torch.float32)
                ):
                    return _Dequant(x.args[0], s, False, [node, inner, x], "(k.float() * s).to(dtype)")
        return None
    if is_call(node, aten.mul.Tensor):  # k.to(q.dtype) * s, computed in the query's dtype
        a, b = node.args[:2]
        for x, s in ((a, b), (b, a)):
            if (
                is_call(x, prims.convert_element_type.default)
                and x.args[1] == qdtype
                and _fp8(x.args[0])
                and _one_float(s, zero_dim=True)
            ):
                return _Dequant(x.args[0], s, True, [node, x], "k.to(dtype) * s")
    return None


def _describe_cache(key: torch.fx.Node, kv: str) -> str:
    """What the keys are: a static cache updated in this graph (which input, how many positions written), a
    graph input, or computed."""
    if is_call(key, aten.index_put.default, aten.index_put_.default, aten.index_copy.default):
        buf = key.args[0]
        if isinstance(buf, torch.fx.Node) and buf.op == "placeholder":
            bval = tensor_val(buf)
            indices = key.args[2] if is_call(key, aten.index_copy.default) else key.args[1]
            pos = (
                indices
                if isinstance(indices, torch.fx.Node)
                else next((i for i in indices if isinstance(i, torch.fx.Node)), None)
            )
            written = report_value(tensor_val(pos).shape[0]) if pos is not None and tensor_val(pos) is not None else "?"
            return (
                f"static cache: graph input {buf.name} [{', '.join(str(report_value(x)) for x in bval.shape)}] "
                f"(max_cache_len {report_value(bval.shape[2])}), {written} position(s) written in this graph; "
                f"{kv}"
            )
    if key.op == "placeholder":
        return f"graph input {key.name}; {kv}"
    return kv


# --------------------------------------------------------------------------------------------------
# vLLM's attention: kept, and recorded
# --------------------------------------------------------------------------------------------------


def read_vllm_attention(node: torch.fx.Node, ctx: PassContext) -> Optional[dict[str, Any]]:
    """If ``node`` is a vLLM attention call: what rubin knows of it (JSON-able), else None. The layer's facts
    come from the engine adapter (vLLM's forward context at compile time)."""
    mc = decode_mutating_call(node)
    if mc is not None:
        op, args, form = mc.op, mc.args, f"auto_functionalized{'_v2' if mc.version == 2 else ''}"
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        op, args, form = node.target, bound_arguments(node), "direct call"
    else:
        return None
    name = schema_name(op)
    if name not in VLLM_ATTENTION_OPS:
        return None
    record: dict[str, Any] = {"node": node.name, "op": name, "form": form}
    qv = tensor_val(args.get("query", args.get("q")))
    if qv is not None:
        record["query_dtype"] = dtype_name(qv.dtype)
    dep = args.get("kv_cache_dummy_dep")
    if isinstance(dep, torch.fx.Node):
        record["kv_cache_update"] = dep.name
    layer_name = args.get("layer_name")
    value = layer_name.meta.get("val") if isinstance(layer_name, torch.fx.Node) else layer_name
    name = ctx.engine.layer_name(value) if value is not None else None
    layer = ctx.engine.find_layer(name)[0] if name is not None else None
    record["layer"] = name
    if layer is None:
        record["backend"] = None
        record["why_unknown"] = (
            "the layer is not in vLLM's forward context at compile time"
            if name
            else "the layer name could not be read from the graph"
        )
    else:
        record.update(ctx.engine.attention_layer_facts(layer))
    record["target_preference"] = _target_preference(record, ctx)
    return record


def _kv_quant(kv_cache_dtype: Optional[str]) -> str:
    return "fp8_tensor" if isinstance(kv_cache_dtype, str) and kv_cache_dtype.startswith("fp8") else "none"


def _target_preference(record: dict[str, Any], ctx: PassContext) -> dict[str, Any]:
    """What the compile target would run for this layer, from the kernel registry (targets are data): for the
    layer as it is, for a bf16 model when the layer's dtype has no kernel there, and with an FP8 KV cache."""
    target = ctx.target
    pref: dict[str, Any] = {"target": target.name}
    if not target.is_cuda:
        pref["note"] = f"target {target.name} has no GPU attention kernel; vLLM's CPU backend is the one to run"
        return pref
    try:
        act = record.get("query_dtype") or "bfloat16"
        shape = (("D", record["head_size"]),) if isinstance(record.get("head_size"), int) else ()
        quant = _kv_quant(record.get("kv_cache_dtype"))
        kv = record.get("kv_cache_torch_dtype") or act
        as_is = ATTENTION.select(KernelSpec("attention", quant, act, kv, None, shape), target)
        half = act if act in ("bfloat16", "float16") else "bfloat16"
        in_half = as_is
        if as_is.chosen.name == "reference" and half != act:
            in_half = ATTENTION.select(
                KernelSpec("attention", quant, half, half if quant == "none" else kv, None, shape), target
            )
        fp8 = ATTENTION.select(KernelSpec("attention", "fp8_tensor", half, "float8_e4m3fn", None, shape), target)
    except Exception as exc:  # the registry could not answer: say so, keep compiling
        pref["note"] = f"the kernel registry could not answer: {type(exc).__name__}: {exc}"
        return pref
    pref["kernel"] = as_is.chosen.name
    pref["entry"] = as_is.chosen.entry(as_is.spec)
    if as_is.chosen.name == "reference" and as_is.rejected:
        pref["why_none"] = "; ".join(f"{k}: {r}" for k, r in as_is.rejected[:2])
    if in_half is not as_is:
        pref["half_dtype"] = half
        pref["half_kernel"] = in_half.chosen.name
        pref["half_entry"] = in_half.chosen.entry(in_half.spec)
    pref["vllm_switches"] = ctx.engine.attention_switches(in_half.chosen.name)
    pref["fp8_kv_kernel"] = fp8.chosen.name
    pref["fp8_kv_entry"] = fp8.chosen.entry(fp8.spec)
    fp8_switches = ctx.engine.attention_switches(fp8.chosen.name)
    if quant == "none" and fp8_switches:
        pref["fp8_kv_switches"] = f"--kv-cache-dtype fp8 {fp8_switches}"
    return pref


def describe_kept(record: dict[str, Any]) -> str:
    """The report line for one kept vLLM attention call."""
    where = f"layer {record['layer']}" if record.get("layer") else "a layer whose name could not be read"
    if record.get("backend") is None:
        runs = f"vLLM's attention backend could not be read ({record.get('why_unknown')})"
    else:
        kv = record.get("kv_cache_dtype")
        kv_txt = f"{kv} = {record.get('kv_cache_torch_dtype')}" if kv == "auto" else kv
        runs = (
            f"vLLM's {record['backend']} backend runs {record['kernel']} on its paged KV cache ({kv_txt}); "
            f"{record.get('num_heads')} query / {record.get('num_kv_heads')} KV heads, head size "
            f"{record.get('head_size')}"
        )
    pref = record.get("target_preference", {})
    if "kernel" in pref:
        if "half_kernel" in pref:
            want = (
                f"target {pref['target']} has no attention kernel for this layer's {record.get('query_dtype')} "
                f"({pref.get('why_none')}); a {pref['half_dtype']} model would run {pref['half_kernel']} "
                f"({pref['half_entry']})"
            )
        else:
            want = f"target {pref['target']} would prefer {pref['kernel']} ({pref['entry']})"
        if pref.get("vllm_switches"):
            want += f": {pref['vllm_switches']}"
            if record.get("backend") not in (None, "FLASHINFER"):
                want += f" (vLLM runs {record['backend']} now)"
        if pref.get("fp8_kv_switches"):
            want += (
                f"; with an FP8 KV cache it would run {pref['fp8_kv_kernel']} FP8 attention: {pref['fp8_kv_switches']}"
            )
    else:
        want = pref.get("note", "")
    return (
        f"kept vLLM's attention at {record['node']} ({record['op']}, {where}): {runs}. The KV cache and the "
        f"backend stay vLLM's. {want}."
    )


PASS = Pass(NAME, run, reads=("target", "engine"))
