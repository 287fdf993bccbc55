"""The pass manager: runs the pipeline (``passes/__init__.py``'s ``PIPELINE``) on one post-grad graph, in order.

    canonicalize -> match_moe -> match_attention -> match_gemm -> select_kernels -> place_locality -> chain_pdl

It is an Inductor ``CustomGraphPass`` (so the same object serves ``torch.compile(backend="rubin")`` and
vLLM's ``post_grad_custom_post_pass``), and it owns what every pass shares: timing, a dump after each pass
that changed the graph, the report, strict mode, and ``uuid()`` for compile caches.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from rubin_compile.debug.dump import GraphDump, graph_code
from rubin_compile.passes import PIPELINE
from rubin_compile.passes.base import Engine, PassContext, PassResult, RubinStrictError

if TYPE_CHECKING:  # type-only: options.py imports the pipeline to validate pass names
    from rubin_compile.options import RubinOptions

log = logging.getLogger("rubin_compile")

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """Hash of every source file of the package: any change to pass, op or kernel code changes uuid()."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE_ROOT.rglob("*")):
        if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


class PassManager(CustomGraphPass):
    """Runs the rubin pipeline on a ``torch.fx.Graph`` (in place) and keeps the report of its last run.

    Parameters
    ----------
    options:
        The settings (``RubinOptions.resolve(...)``).
    source:
        Who calls us, for reports: ``"backend"`` or ``"vllm"``.
    engine:
        The adapter of the inference engine the graph comes from (integrations/vllm/engine.py); the base
        ``Engine`` when there is none.
    """

    def __init__(self, options: RubinOptions, source: str = "backend", engine: Optional[Engine] = None) -> None:
        self.options = options
        self.source = source
        self.engine = engine if engine is not None else Engine()
        self.last_report: Optional[dict[str, Any]] = None

    # Inductor's cache key: pass code + behaviour-changing options + the torch version.
    def uuid(self) -> str:
        key = {
            "sources": _source_hash(),
            "options": self.options.behaviour_key(),
            "torch": torch.__version__,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.run(graph)

    def run(self, graph: torch.fx.Graph) -> dict[str, Any]:
        """Run every enabled pass on ``graph`` in place; return (and keep) the report."""
        enabled = self.options.enabled_passes()
        dump = GraphDump.create(self.options.dump_dir, _compile_id()) if self.options.dump_dir else None
        graph_id = dump.graph_id if dump else _compile_id()
        target = self.options.resolved_target()
        ctx = PassContext(options=self.options, target=target, engine=self.engine, graph_id=graph_id)
        previous = graph_code(graph)
        _trace_artifact("rubin_graph_input", previous)
        if dump:
            dump.write_stage(0, "input", previous, None)
        results: list[PassResult] = []
        for index, step in enumerate(PIPELINE, start=1):
            if step.name not in enabled:
                results.append(PassResult(step.name, notes=["disabled by options.passes"]))
                continue
            start = time.perf_counter()
            result = step.run(graph, step.context(ctx))
            result.seconds = time.perf_counter() - start
            results.append(result)
            if result.changed:
                code = graph_code(graph)
                _trace_artifact(f"rubin_graph_after_{step.name}", code)
                if dump:
                    dump.write_stage(index, step.name, code, previous)
                previous = code
        report = {
            "graph_id": graph_id,
            "source": self.source,
            "target": {"name": target.name, "description": target.description, **target.features()},
            "options": self.options.behaviour_key(),
            "uuid": self.uuid(),
            "passes": [r.to_json() for r in results],
        }
        self.last_report = report
        _trace_artifact("rubin_report", json.dumps(report, indent=1), encoding="json")
        if dump:
            dump.write_report(report)
        _log_summary(report)
        if self.options.strict:
            left = [(r.name, u) for r in results for u in r.unchanged]
            if left:
                lines = "\n".join(f"  - {u.node} ({u.idiom}, in {name}): {u.reason}" for name, u in left)
                raise RubinStrictError(
                    f"rubin (strict): {len(left)} recognised idiom(s) in graph {graph_id} were left "
                    f"unchanged:\n{lines}\nFix the model or the matcher, or drop strict=True to let "
                    "Inductor compile them as they are."
                )
        return report


def _compile_id() -> str:
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return str(cid).replace("/", "_") if cid is not None else "eager"


def _trace_artifact(name: str, payload: str, encoding: str = "string") -> None:
    """Send an artifact to TORCH_TRACE (shown by tlparse); free when tracing is off."""
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=lambda: payload,
    )


def _log_summary(report: dict[str, Any]) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    for p in report["passes"]:
        if p["rewrites"] or p["unchanged"]:
            log.info(
                "rubin %s: %s rewrote %d node(s), left %d unchanged",
                report["graph_id"],
                p["name"],
                len(p["rewrites"]),
                len(p["unchanged"]),
            )
