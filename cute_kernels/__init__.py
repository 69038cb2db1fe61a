"""cute-kernels: attention kernels for LLM serving in the CuTe Python DSL.

Public ops (each in its own module under ``cute_kernels.ops``, listed in the registry's
:data:`~cute_kernels.registry.OPS`) are imported lazily, so that ``import cute_kernels`` and the
dispatch layer stay cheap on machines without the DSL or a GPU. Map of the package:
docs/design/architecture.md.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"


def _ops() -> dict:
    from .registry import OPS  # the registry loads the plans: only when an op is first asked for

    return OPS


def __getattr__(name):
    if name == "__all__":
        value = sorted(_ops()) + ["reference", "__version__"]
    elif name == "reference":
        value = importlib.import_module("cute_kernels.reference")
    elif name in _ops():
        module, attr = _ops()[name]
        value = getattr(importlib.import_module(module), attr)
    else:
        raise AttributeError(f"module 'cute_kernels' has no attribute {name!r}")
    # bound once: later lookups find it in the module dict and skip this hook (an import-system
    # round trip on every `cute_kernels.paged_decode(...)` call otherwise)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_ops()) | {"reference"})
