"""cute-kernels: attention kernels for LLM serving in the CuTe Python DSL.

Public ops (each in its own module under ``cute_kernels.ops``) are imported lazily, so that
``import cute_kernels`` and the dispatch layer stay cheap on machines without the DSL or a GPU.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_OPS = {
    "merge_states": "cute_kernels.ops.merge_states",
    "paged_decode": "cute_kernels.ops.paged_decode",
    "paged_prefill": "cute_kernels.ops.paged_prefill",
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
