"""``RubinOptions``: every setting of the backend, in one dataclass.

Settings come from three places, later ones winning: the defaults below, ``RUBIN_*`` environment
variables, and ``torch.compile(..., backend="rubin", options={...})`` (or the options given to the vLLM
pass). An unknown name is an error that lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from rubin_compile.errors import RubinError
from rubin_compile.ops.registry import CANONICAL_OPS  # filled as ops/ defines each op (the package imports them)
from rubin_compile.passes import PASS_NAMES
from rubin_compile.target import LOCALITY_MODES, UnknownTargetError, locality_mode, resolve

# Options that take one of a few words (``locality``: "strict" is read as "default").
CHOICES: dict[str, tuple[str, ...]] = {
    "pdl": ("auto", "on", "off"),
    "fuse_projections": ("auto", "on", "off"),
    "inline_kernels": ("auto", "on", "off"),
    "locality": ("auto", "off", *LOCALITY_MODES),
}


# options cudagraphs="external": the caller captures the compiled function in a CUDA graph of its own.
EXTERNAL_GRAPHS = "external"


class RubinOptionsError(RubinError, ValueError):
    """Raised for an option that does not exist or has a value it cannot take."""


@dataclass(frozen=True)
class RubinOptions:
    """Settings of the ``rubin`` backend.

    Parameters
    ----------
    dump_dir:
        Write a readable dump of every graph before and after each pass that changed it, with a report,
        under this folder (env ``RUBIN_DUMP_DIR``). ``python -m rubin_compile explain DIR`` reads it.
    strict:
        Raise instead of leaving something we recognise but cannot rewrite unchanged (env ``RUBIN_STRICT=1``).
    passes:
        Names of the passes to run, a subset of the pipeline (env ``RUBIN_PASSES=canonicalize,match_moe``);
        ``None`` runs all of them. The order is always the pipeline's.
    inductor:
        Extra ``torch._inductor.config`` settings for the compile, as ``torch.compile(options=...)`` would
        take them with ``backend="inductor"`` (backend route only). rubin sets ``shape_padding=False``
        (Inductor's compile-time benchmark of padded GEMMs would make the graph our passes see depend on
        timing); ``{"shape_padding": True}`` here turns it back on.
    target:
        The GPU to compile for (env ``RUBIN_TARGET``): ``"sm90"``, ``"sm100"``, ``"sm103"``, ``"sm107"``,
        ``"cpu"``, or ``"auto"`` (the current device; the CPU when there is none). Any machine can compile
        for any target; executing kernels it cannot run raises ``KernelUnavailableError``.
    kernels:
        A forced kernel per canonical op, as vLLM's ``--moe-backend`` / ``--linear-backend`` switches
        (env ``RUBIN_KERNELS="moe=triton,gemm=torch"``), e.g. ``{"moe": "flashinfer_cutedsl"}``. A forced
        kernel that cannot run on the target is rejected with its reason (an error with ``strict``).
    pdl:
        Programmatic Dependent Launch for the kernels that are safe with it (env ``RUBIN_PDL``): ``"auto"``
        (on where the target has PDL and the graph runs under CUDA graphs, where it pays), ``"on"`` (also
        without CUDA graphs), ``"off"``. passes/chain_pdl.py; its decision per node is in the report.
    cudagraphs:
        The compiled graph runs under CUDA graphs (env ``RUBIN_CUDAGRAPHS=1``), as with
        ``mode="reduce-overhead"`` (which sets it; torch.compile takes ``mode`` or ``options``, not both):
        ``True`` turns on Inductor's own CUDA graphs (cudagraph trees). ``"external"`` (env
        ``RUBIN_CUDAGRAPHS=external``): the caller captures the compiled function in a CUDA graph of its own (a
        serving runner's whole-step ``torch.cuda.graph``), so rubin plans for replay from a graph (PDL edges, the
        kernels that pay only there) without turning on cudagraph trees; run it once before the capture (kernels
        compile and weights are prepared on the first call). Inside vLLM, vLLM's own ``cudagraph_mode`` decides
        instead.
    locality:
        Place decode-sized MoE on locality domains, split-N (env ``RUBIN_LOCALITY``): ``"auto"`` (on where
        the target has HBM locality domains: sm_107, backfill mode; off elsewhere, where memory is uniform and
        a split only costs), ``"off"``, ``"default"`` (alias ``"strict"``: equal domains, odd SMs idle) or
        ``"backfill"`` (every SM used). passes/place_locality.py.
    fuse_projections:
        Join linear layers that read one input (q / k / v; gate / up, with ``act(gate) * up`` folded in as the
        gated epilogue) into one ``rubin.gemm`` over weights concatenated once (env ``RUBIN_FUSE_PROJECTIONS``):
        ``"auto"`` (on CUDA targets, where fewer, larger GEMM launches pay at decode; off on the CPU),
        ``"on"``, ``"off"``. The concatenated copy is kept next to the weights: the report says how many bytes.
        passes/fuse_projections.py.
    domains:
        How many domains (env ``RUBIN_DOMAINS``); ``None``: the target's locality-domain count, else 2.
    locality_max_tokens:
        MoE calls of at most this many tokens run split-N (env ``RUBIN_LOCALITY_MAX_TOKENS``); larger ones
        (prefill) run whole, decided per call when the token count is dynamic.
    inline_kernels:
        Trace the launches of our Triton kernels into the graph, so Inductor launches them from its generated
        code as it launches its own, instead of a call of the rubin op per node (env ``RUBIN_INLINE_KERNELS``):
        ``"auto"`` (where the graph does not run under CUDA graphs, whose replays pay no host cost, and the
        node's sizes are static), ``"on"`` (under CUDA graphs too; such launches take no PDL), ``"off"``.
        passes/inline_kernels.py; its decision per node is in the report.
    """

    dump_dir: Optional[str] = None
    strict: bool = False
    passes: Optional[tuple[str, ...]] = None
    inductor: Mapping[str, Any] = field(default_factory=dict)
    target: str = "auto"
    kernels: Mapping[str, str] = field(default_factory=dict)
    pdl: str = "auto"
    cudagraphs: Union[bool, str] = False  # True, False or "external"
    locality: str = "auto"
    domains: Optional[int] = None
    locality_max_tokens: int = 16
    fuse_projections: str = "auto"
    inline_kernels: str = "auto"

    # Options that change what the passes produce: they go into the pass's uuid (dump_dir too, so that a
    # new dump folder forces the compile that writes it instead of a cache hit).
    def behaviour_key(self) -> dict[str, Any]:
        return {
            "dump_dir": self.dump_dir,
            "strict": self.strict,
            "passes": list(self.enabled_passes()),
            "target": self.resolved_target().name,  # "auto" resolves per machine: the uuid follows it
            "kernels": dict(sorted(self.kernels.items())),
            "pdl": self.pdl,
            "cudagraphs": self.cudagraphs,
            "locality": self.locality,
            "domains": self.domains,
            "locality_max_tokens": self.locality_max_tokens,
            "fuse_projections": self.fuse_projections,
            "inline_kernels": self.inline_kernels,
        }

    def resolved_target(self):
        """The ``Target`` this compile is for (``rubin_compile.target.resolve(self.target)``)."""
        return resolve(self.target)

    def enabled_passes(self) -> tuple[str, ...]:
        """The names of the passes that run, in pipeline order (passes/__init__.py)."""
        if self.passes is None:
            return PASS_NAMES
        return tuple(p for p in PASS_NAMES if p in self.passes)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
        """The settings given by ``RUBIN_*`` variables, as a dict of option values. A ``RUBIN_*`` variable that is
        no option (a typo, or another program's ``RUBIN_HOME``) is ignored with a warning: the environment is
        shared, so it must not stop every compile (an unknown name in ``options={...}`` is an error)."""
        environ = os.environ if environ is None else environ
        known = {f"RUBIN_{n.upper()}": n for n in cls.names() if n != "inductor"}
        out: dict[str, Any] = {}
        for key, value in environ.items():
            if not key.startswith("RUBIN_"):
                continue
            if key not in known:
                _warn_unknown_variable(key, tuple(sorted(known)))
                continue
            out[known[key]] = value
        return out

    @classmethod
    def resolve(
        cls, options: Optional[Mapping[str, Any]] = None, environ: Optional[Mapping[str, str]] = None
    ) -> "RubinOptions":
        """Defaults, then ``RUBIN_*`` variables, then ``options``; validated."""
        if isinstance(options, RubinOptions):
            return options
        merged: dict[str, Any] = dict(cls.from_env(environ))
        for key, value in (options or {}).items():
            if key not in cls.names():
                raise RubinOptionsError(
                    f"unknown rubin option {key!r}; valid options are {cls.names()} "
                    "(see `help(rubin_compile.RubinOptions)`)"
                )
            merged[key] = value
        return cls(**{k: _convert(k, v) for k, v in merged.items()})


@functools.lru_cache(maxsize=None)
def _warn_unknown_variable(key: str, known: tuple) -> None:
    """Once per variable and process."""
    warnings.warn(
        f"rubin: ignoring the environment variable {key}, which is no rubin option; the rubin backend reads "
        f"{list(known)}",
        stacklevel=4,
    )


def _convert(name: str, value: Any) -> Any:
    if name == "dump_dir":
        if value in (None, ""):
            return None
        path = os.fspath(value)
        if os.path.exists(path) and not os.path.isdir(path):
            raise RubinOptionsError(
                f"option dump_dir (RUBIN_DUMP_DIR) is {path!r}, which is a file, not a folder; "
                "give a folder (it is created when missing)"
            )
        return path
    if name == "cudagraphs" and isinstance(value, str) and value.strip().lower() == EXTERNAL_GRAPHS:
        return EXTERNAL_GRAPHS
    if name in ("strict", "cudagraphs"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in (
            "1",
            "true",
            "yes",
            "on",
            "0",
            "false",
            "no",
            "off",
            "",
        ):
            return value.strip().lower() in ("1", "true", "yes", "on")
        if name == "cudagraphs":
            raise RubinOptionsError(
                f"option cudagraphs must be a bool (or 0/1 in RUBIN_CUDAGRAPHS), or {EXTERNAL_GRAPHS!r} when you "
                f"capture the compiled function in a CUDA graph yourself; got {value!r}"
            )
        raise RubinOptionsError(f"option {name} must be a bool (or 0/1 in RUBIN_{name.upper()}), got {value!r}")
    if name in CHOICES:
        text = str(value).strip().lower() if value is not None else ""
        if isinstance(value, bool):  # pdl=True / False reads as on / off
            text = "on" if value else "off"
        if name == "locality" and text not in ("auto", "off"):
            try:
                text = locality_mode(text)
            except ValueError:
                pass  # reported below, with every valid word
        if text not in CHOICES[name]:
            raise RubinOptionsError(f"option {name} must be one of {list(CHOICES[name])}, got {value!r}")
        return text
    if name in ("domains", "locality_max_tokens"):
        if value is None or value == "":
            if name == "domains":
                return None
            raise RubinOptionsError("option locality_max_tokens must be a positive integer, got nothing")
        try:
            number = int(value)
        except (TypeError, ValueError):
            number = 0
        if (
            number < (2 if name == "domains" else 1)
            or isinstance(value, bool)
            or (isinstance(value, float) and not value.is_integer())
        ):
            least = 2 if name == "domains" else 1
            raise RubinOptionsError(f"option {name} must be an integer >= {least}, got {value!r}")
        return number
    if name == "passes":
        if value is None:
            return None
        items = [p.strip() for p in value.split(",")] if isinstance(value, str) else list(value)
        items = [p for p in items if p]
        bad = [p for p in items if p not in PASS_NAMES]
        if bad:
            raise RubinOptionsError(f"unknown pass(es) {bad} in option passes; the pipeline is {list(PASS_NAMES)}")
        return tuple(items)
    if name == "inductor":
        if not isinstance(value, Mapping):
            raise RubinOptionsError(f"option inductor must be a dict of Inductor config settings, got {value!r}")
        return dict(value)
    if name == "target":
        value = "auto" if value in (None, "") else str(value).strip().lower()
        try:
            if value != "auto":
                value = resolve(value).name  # "sm_107" / "rubin" -> "sm107"
        except UnknownTargetError as exc:
            raise RubinOptionsError(str(exc)) from None
        return value
    if name == "kernels":
        return _convert_kernels(value)
    return value


def _convert_kernels(value: Any) -> dict[str, str]:
    """``{"moe": "triton"}``, or ``"moe=triton,gemm=torch"`` from RUBIN_KERNELS. Op names are checked
    here; kernel names by select_kernels, which knows each op's candidates."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        pairs = [p.strip() for p in value.split(",") if p.strip()]
        bad = [p for p in pairs if p.count("=") != 1 or not all(x.strip() for x in p.split("="))]
        if bad:
            raise RubinOptionsError(
                f"option kernels: cannot read {bad}; write op=kernel pairs, e.g. RUBIN_KERNELS=moe=triton,gemm=torch"
            )
        value = dict((k.strip(), v.strip()) for k, v in (p.split("=") for p in pairs))
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise RubinOptionsError(f"option kernels must map canonical ops to kernel names, got {value!r}")
    unknown = [op for op in value if op not in CANONICAL_OPS]
    if unknown:
        raise RubinOptionsError(f"option kernels: unknown canonical op(s) {unknown}; the ops are {list(CANONICAL_OPS)}")
    return dict(value)
