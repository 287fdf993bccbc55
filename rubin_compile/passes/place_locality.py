"""place_locality: run decode-sized MoE split-N over locality domains.

Decode MoE is bound by reading expert weights. On Rubin (sm_107) HBM is split into locality domains and an
SM reads its own domain's memory faster, so the announcement's scheme gives each domain half of each GEMM's
output columns, in its own memory, read only by its own SMs (about 1.2x on FC1 + FC2 for MiniMax M3 shapes;
docs/pdl_locality.md has the cost model). For each ``rubin.moe`` node (and vLLM layer node) whose kernel has
a split-N form (``Kernel.placements``), this pass writes the node's ``placement`` argument::

    rubin.moe(..., impl="triton@sm107", placement="split_n:backfill:2:16")

which the kernel runs as: FC1 split over the intermediate dimension I (each gate row kept with its up row),
FC2 split over the hidden dimension H, a cross-domain join between them (each FC2 reads every domain's
part of the intermediate), each domain's kernels on its own stream over its own weight shard. Shards are
made once per weight and cached (runtime/locality.py); on GPUs with uniform memory they are views. Calls
with more tokens than the threshold (prefill) run whole: decided here when the token count is static or
its range says so, else per call by the kernel from the same number.

``options.locality``: ``"auto"`` places only where the target has HBM locality domains (sm_107, backfill;
our Triton kernels launch no clusters, so backfill's one limit does not bite); ``"default"`` / ``"backfill"``
force green-context domains elsewhere too (on the H200: to measure the overhead); ``"off"``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from rubin_compile.ops.registry import Placement, bound_nodes
from rubin_compile.passes.base import Decision, Pass, PassContext, PassResult
from rubin_compile.passes.fx import bound_arguments, dotted_name, set_argument, tensor_val
from rubin_compile.runtime import locality

NAME = "place_locality"


def token_range(node: torch.fx.Node) -> tuple[Optional[int], Optional[int]]:
    """(lowest, highest) token count of the node's hidden states: equal for a static shape; from the shape
    environment's value range for a dynamic one (None where unbounded or unknown)."""
    val = tensor_val(bound_arguments(node).get("hidden_states"))
    if val is None or val.dim() != 2:
        return None, None
    t = val.shape[0]
    if isinstance(t, int):
        return t, t
    try:
        vr = t.node.shape_env.bound_sympy(t.node.expr)
        lo, hi = vr.lower, vr.upper
        return (int(lo) if lo.is_finite else None), (int(hi) if hi.is_finite else None)
    except Exception:
        return None, None


def domain_mode(option: str) -> str:
    """The locality mode ``options.locality`` asks for: ``"auto"`` places in backfill mode (our Triton kernels
    launch no clusters, so backfill's one limit does not bite); ``"default"`` / ``"backfill"`` as they are."""
    return "backfill" if option == "auto" else option


def decide(
    mode: str,
    target: Any,
    kernel: Any,
    spec: Any,
    count: Optional[int],
    max_tokens: int,
    tokens: tuple[Optional[int], Optional[int]],
) -> tuple[Optional[str], str, dict[str, Any]]:
    """(placement or None, why, details) for one MoE node."""
    if mode == "off":
        return None, "options locality='off'", {}
    if not target.is_cuda:
        return None, f"target {target.name} has no GPU: one domain", {}
    if mode == "auto" and target.locality_domains is None:
        return (
            None,
            (
                f"locality='auto': {target.name} has uniform memory (no HBM locality domains), where a "
                "split only adds a fork and a join; force it with locality='default' or 'backfill'"
            ),
            {},
        )
    mode = domain_mode(mode)
    if not target.green_contexts:
        return None, f"target {target.name} has no green contexts", {}
    if "split_n" not in kernel.placements:
        return None, f"kernel {kernel.name} has no split-N form", {}
    lo, hi = tokens
    if lo is not None and lo > max_tokens:
        return None, f"T >= {lo} > locality_max_tokens={max_tokens}: not decode-sized", {}
    n = count if count is not None else (target.locality_domains.count if target.locality_domains else 2)
    I, H = spec.dim("I"), spec.dim("H")
    if I is None or H is None:
        return None, "the node's I and H are not known statically", {}
    why = locality.split_n_unsupported(None, I, H, n, spec.block_shape)
    if why is not None:
        return None, why, {}
    try:
        plan = locality.plan(target, mode, n)
    except ValueError as exc:
        return None, str(exc), {}
    ib, hb = locality.split_bounds(I, n), locality.split_bounds(H, n)
    details = {
        "domains": plan.describe(),
        "FC1 I shares": [b - a for a, b in ib],
        "FC2 H shares": [b - a for a, b in hb],
        "tokens": "per call" if hi is None or hi > max_tokens else "always",
    }
    if plan.localized_memory:
        E = spec.dim("E")
        elt = 1 if spec.weight_dtype.startswith("float8") else 2
        if E is not None:
            details["shard copies"] = (
                f"{E * 3 * H * I * elt / 2**20:.0f} MiB once per layer (the experts in domain memory)"
            )
    else:
        details["shards"] = "views of the weights (uniform memory: no copy)"
    when = f"T <= {max_tokens}" if details["tokens"] == "per call" else f"T in [{lo}, {hi}]"
    return Placement(plan.mode, n, max_tokens).encode(), f"decode-sized MoE ({when}) on {target.name}", details


def run(graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    opts = ctx.options
    placed = 0
    for node, bound in bound_nodes(graph, ctx.target):
        if bound.op.name != "moe":
            continue
        args = bound_arguments(node)
        if "placement" not in args:
            continue
        placement, why, details = decide(
            opts.locality,
            bound.target,
            bound.kernel,
            bound.spec,
            opts.domains,
            opts.locality_max_tokens,
            token_range(node),
        )
        if (args.get("placement") or "") != (placement or ""):
            set_argument(node, "placement", placement or "")
            result.changed = True
        placed += placement is not None
        result.decisions.append(
            Decision(node.name, dotted_name(node.target), placement or "whole (current stream)", why, details)
        )
    target = ctx.target
    if target.locality_domains is not None and opts.locality != "off":
        mode = domain_mode(opts.locality)
        result.notes.append(f"{target.name} domains ({mode}): {locality.plan(target, mode, opts.domains).describe()}")
    if result.decisions:
        result.notes.append(
            f"{placed} of {len(result.decisions)} MoE node(s) split over locality domains (locality={opts.locality!r})"
        )
    return result


PASS = Pass(NAME, run, reads=("options", "target"))
