"""cute-kernels: attention kernels for LLM serving in the CuTe Python DSL.

Public ops (each in its own module under ``cute_kernels.ops``, listed in the registry's
:data:`~cute_kernels.registry.OPS`) are imported lazily, so that ``import cute_kernels`` and the
dispatch layer stay cheap on machines without the DSL or a GPU. Map of the package:
docs/design/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers see; at run time the ops load on first use (__getattr__)
    from . import reference as reference
    from .ops.merge_states import merge_states as merge_states
    from .ops.paged_decode import paged_decode as paged_decode
    from .ops.paged_prefill import paged_prefill as paged_prefill
    from .ops.qsa_sparse_attention import qsa_sparse_attention as qsa_sparse_attention
    from .ops.quantize_query import quantize_query as quantize_query
    from .ops.write_kv_cache import write_kv_cache as write_kv_cache
    from .qsa_warmup import qsa_warmup as qsa_warmup
    from .warmup import warmup as warmup


def _ops() -> dict:
    from .registry import OPS  # the registry loads the plans: only when an op is first asked for

    return OPS


def __getattr__(name: str) -> Any:
    value: Any
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
