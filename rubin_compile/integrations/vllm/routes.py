"""rubin inside vLLM: the post-grad pass vLLM runs, and what keeps vLLM's compile caches honest about it.

Two routes (docs/vllm.md has the details)::

    # the pass route: vLLM compiles as usual and runs rubin's pipeline as its post-grad custom pass
    LLM(model, compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "rubin_compile.vllm_pass"}})

    # the backend route: Dynamo hands the whole graph to torch.compile(backend="rubin")
    LLM(model, compilation_config={"mode": 2, "backend": "rubin"}, **backend_route_cache_key())

Options come from ``RUBIN_*`` environment variables (read when the pass runs) or from the constructor,
``VllmPass(options={...})``, for a pass object given to vLLM from Python.

vLLM resolves ``"rubin_compile.vllm_pass"`` with ``__import__("rubin_compile").__dict__["vllm_pass"]``
(vllm/config/compilation.py), so the object lives at the package top. vLLM then keeps it only if it is
an instance of *its* ``InductorPass``; anything else it wraps in ``CallableInductorPass``, whose uuid is a
hash of the wrapper's class source, so the pass's own uuid would never reach a cache key and a change of
rubin's code or options would reuse stale compiled graphs. ``VllmPass`` is therefore declared a virtual
subclass of vLLM's ``InductorPass`` the moment vLLM's module is imported (vLLM itself is never imported
from here), and its ``uuid()`` then keys Inductor's graph cache, vLLM's config hash and with it vLLM's AOT
compile cache (``VLLM_USE_AOT_COMPILE``, on by default with torch >= 2.10).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional, Union

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from rubin_compile.integrations import after_import
from rubin_compile.integrations.vllm.engine import VllmEngine
from rubin_compile.options import RubinOptions
from rubin_compile.passes.manager import PassManager

OptionsLike = Union[None, RubinOptions, Mapping[str, Any]]


class VllmPass(CustomGraphPass):
    """rubin's pass pipeline as vLLM's ``post_grad_custom_post_pass``.

    Parameters
    ----------
    options:
        ``RubinOptions`` or a dict of them; ``None`` (the default, and what ``rubin_compile.vllm_pass``
        uses) reads the ``RUBIN_*`` environment variables each time the pass runs or is hashed.

    Attributes
    ----------
    last_report:
        The pipeline report of the last graph this object rewrote (rewrites, reasons, timings), as
        ``PassManager.run`` returns it; ``None`` before the first graph.
    """

    def __init__(self, options: OptionsLike = None) -> None:
        self._options = options
        self.last_report: Optional[dict[str, Any]] = None

    def options(self) -> RubinOptions:
        return RubinOptions.resolve(self._options)

    def manager(self) -> PassManager:
        return PassManager(self.options(), source="vllm", engine=VllmEngine(route="pass"))

    def __call__(self, graph: torch.fx.Graph) -> None:
        manager = self.manager()
        manager(graph)
        self.last_report = manager.last_report

    def uuid(self) -> str:
        """Changes whenever rubin's code, the behaviour-changing options or the target change (the
        pass manager's uuid hashes all three), so no vLLM or Inductor cache outlives them."""
        key = {"pipeline": self.manager().uuid(), "integration": "vllm post_grad_custom_post_pass"}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    # vLLM's InductorPass interface (PostGradPassManager asks every pass it runs).
    def is_applicable_for_range(self, compile_range: Any) -> bool:
        return True

    def __getstate__(self) -> dict[str, Any]:  # vLLM pickles its config (with this pass) to its workers
        return {"_options": self._options, "last_report": None}

    def __repr__(self) -> str:
        return f"VllmPass(options={self._options!r})"


def _declare_vllm_inductor_pass() -> None:
    from vllm.compilation.passes.inductor_pass import InductorPass

    InductorPass.register(VllmPass)


after_import("vllm.compilation.passes.inductor_pass", _declare_vllm_inductor_pass)

vllm_pass = VllmPass()
"""The object ``"rubin_compile.vllm_pass"`` names (re-exported at the package top)."""


def backend_route_cache_key(options: OptionsLike = None) -> dict[str, Any]:
    """``additional_config`` for ``vllm.LLM`` on the backend route, so vLLM's AOT compile cache is keyed
    on rubin's code and options.

    On the backend route vLLM calls ``torch.compile(backend="rubin")`` with no options (``RUBIN_*``
    variables configure it) and saves the compiled artifact under a hash of its own config and the model's
    source files only: without this key, changing rubin's code or ``RUBIN_*`` settings would load the
    artifact compiled before. ``additional_config`` is part of vLLM's config hash and read by nothing else.

    Examples
    --------
    >>> LLM(model, compilation_config={"mode": 2, "backend": "rubin"}, **backend_route_cache_key())
    """
    uuid = PassManager(RubinOptions.resolve(options), source="backend").uuid()
    return {"additional_config": {"rubin_uuid": uuid}}
