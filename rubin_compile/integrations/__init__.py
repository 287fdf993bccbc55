"""Where rubin meets other frameworks (vLLM first), without importing them before they are used.

The framework's own modules are never imported from here; ``after_import`` lets rubin finish its side of
a handshake (register an op schema that names a vLLM type, declare a pass as vLLM's ``InductorPass``) at
the moment the framework module appears, whichever of the two packages was imported first.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Callable

_lock = threading.Lock()
_pending: dict[str, list[Callable[[], None]]] = {}


def after_import(module_name: str, callback: Callable[[], None]) -> None:
    """Run ``callback()`` once ``module_name`` is imported: now if it already is, else right after its
    import completes. Errors in the callback propagate to whoever imports the module."""
    with _lock:
        if module_name not in sys.modules:
            first = module_name not in _pending
            _pending.setdefault(module_name, []).append(callback)
            if first and not any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
                sys.meta_path.insert(0, _AfterImportFinder())
            return
    callback()


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it wraps the real loader so callbacks run after exec."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CallbackLoader(spec.loader, fullname)
                return spec
        return None


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec):  # type: ignore[override]
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:  # type: ignore[override]
        module.__spec__.loader = self._loader  # the module keeps its real loader (reloads, resources)
        self._loader.exec_module(module)
        with _lock:
            callbacks = _pending.pop(self._name, [])
        for callback in callbacks:
            callback()

    def __getattr__(self, name: str):  # get_resource_reader, is_package, get_code ...
        return getattr(self._loader, name)
