"""The package facade's callable submodules.

``cute_kernels.warmup`` and ``cute_kernels.qsa_warmup`` are public functions living in modules of
the same name. Importing such a module (``from cute_kernels.warmup import decode_variants``) makes
the import system bind the *module* as the package's attribute, which would shadow the function
the package resolves lazily: ``cute_kernels.warmup(...)`` would raise "'module' object is not
callable". A module made callable here forwards the call to its function, so both spellings work
whatever was imported first.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any


class _CallableModule(types.ModuleType):
    _function: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(*args, **kwargs)


def make_callable(module_name: str, function: Callable[..., Any]) -> None:
    """Calling the module ``module_name`` calls ``function`` (its namesake)."""
    module = sys.modules[module_name]
    module.__class__ = _CallableModule
    module._function = function  # type: ignore[attr-defined]
