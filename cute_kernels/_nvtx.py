"""NVTX ranges around every public op, free when no profiler is attached.

Each op runs inside a range named ``cute_kernels.<op>`` whose message lists its shapes and
dtypes. Nsight tools inject themselves through ``NVTX_INJECTION64_PATH``; without it NVTX calls
are no-ops anyway, so the hot paths skip even building the message (docs/design/sm90-decode.md#host-path).
``CUTE_KERNELS_NVTX=1`` forces ranges on, ``=0`` forces them off.
"""

from __future__ import annotations

import contextlib
import os

_forced = os.environ.get("CUTE_KERNELS_NVTX")
ENABLED = (_forced == "1") or (_forced != "0" and bool(os.environ.get("NVTX_INJECTION64_PATH")))

try:  # nvtx is a runtime dependency, but keep the ops importable without it
    import nvtx as _nvtx
except Exception:  # pragma: no cover
    _nvtx = None
    ENABLED = False

# reusable: the ops' hot paths use it instead of building an NVTX range when ranges are off
NULL_RANGE = contextlib.nullcontext()


def describe(**tensors) -> str:
    """``q=bf16[8,32,128] kv=fp8_e4m3[...]`` for tensors; plain ``k=v`` for anything else."""
    parts = []
    for name, t in tensors.items():
        if t is None:
            continue
        shape = getattr(t, "shape", None)
        if shape is not None and hasattr(t, "dtype"):
            dt = str(t.dtype).replace("torch.", "")
            parts.append(f"{name}={dt}[{','.join(str(s) for s in shape)}]")
        else:
            parts.append(f"{name}={t}")
    return " ".join(parts)


def op_range(op: str, **tensors):
    """Context manager: an NVTX range ``cute_kernels.<op>`` (a shared null context when off)."""
    if not ENABLED:
        return NULL_RANGE
    return _nvtx.annotate(message=f"cute_kernels.{op} {describe(**tensors)}")
