"""cute-kernels: attention kernels for LLM serving in the CuTe Python DSL.

Public ops (each in its own module under ``cute_kernels.ops``) are imported lazily, so that
``import cute_kernels`` and the dispatch layer stay cheap on machines without the DSL or a GPU.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers see; at run time the ops load on first use (__getattr__)
    from . import reference as reference
    from .ops.merge_states import merge_states as merge_states
    from .ops.paged_decode import paged_decode as paged_decode
    from .ops.qsa_sparse_attention import qsa_sparse_attention as qsa_sparse_attention
    from .ops.quantize_query import quantize_query as quantize_query
    from .ops.write_kv_cache import write_kv_cache as write_kv_cache
    from .qsa_warmup import qsa_warmup as qsa_warmup
    from .warmup import warmup as warmup

_OPS = {
    "merge_states": "cute_kernels.ops.merge_states",
    "paged_decode": "cute_kernels.ops.paged_decode",
    "qsa_sparse_attention": "cute_kernels.ops.qsa_sparse_attention",
    "qsa_warmup": "cute_kernels.qsa_warmup",
    "quantize_query": "cute_kernels.ops.quantize_query",
    "write_kv_cache": "cute_kernels.ops.write_kv_cache",
    "warmup": "cute_kernels.warmup",
}

__all__ = sorted(_OPS) + ["reference", "__version__"]


def __getattr__(name):
    if name in _OPS:
        value = getattr(importlib.import_module(_OPS[name]), name)
    elif name == "reference":
        value = importlib.import_module("cute_kernels.reference")
    else:
        raise AttributeError(f"module 'cute_kernels' has no attribute {name!r}")
    # bound once: later lookups find it in the module dict and skip this hook (an import-system
    # round trip of ~0.5 us on every `cute_kernels.paged_decode(...)` call otherwise)
    globals()[name] = value
    return value
