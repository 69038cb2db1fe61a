"""NVTX ranges around every public op, free when no profiler is attached.

Each op runs inside a push/pop range whose message is exactly ``cute_kernels.<op>`` (see
:func:`range_name`), so that Nsight Compute selects an op's kernels by name:
``ncu --nvtx --nvtx-include "cute_kernels.paged_decode/" ...``. A second range nested inside it
carries the shapes and dtypes (``q=bfloat16[8,32,128] kv_cache=float8_e4m3fn[...]``) for the
Nsight Systems timeline: NVTX payloads hold numbers only, and a name with shapes in it matches no
fixed include pattern. Nsight tools inject themselves through ``NVTX_INJECTION64_PATH``; without
it NVTX calls are no-ops anyway, so the hot paths skip even building the message
(docs/design/sm90-decode.md#host-path). ``CUTE_KERNELS_NVTX=1`` forces ranges on, ``=0`` forces
them off.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

_forced = os.environ.get("CUTE_KERNELS_NVTX")
ENABLED = (_forced == "1") or (_forced != "0" and bool(os.environ.get("NVTX_INJECTION64_PATH")))

try:  # nvtx is a runtime dependency, but keep the ops importable without it
    import nvtx as _nvtx
except Exception:  # pragma: no cover
    _nvtx = None
    ENABLED = False

PREFIX = "cute_kernels."

# reusable: the ops' hot paths use it instead of building an NVTX range when ranges are off
NULL_RANGE = contextlib.nullcontext()


def range_name(op: str) -> str:
    """The NVTX range of op ``op``: ``cute_kernels.paged_decode`` (what ``--nvtx-include`` names)."""
    return PREFIX + op


def describe(**tensors: Any) -> str:
    """``q=bfloat16[8,32,128] kv=float8_e4m3fn[...]`` for tensors; plain ``k=v`` for anything else."""
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


class OpRange:
    """The range ``cute_kernels.<op>`` with the call's shapes in a range nested inside it."""

    __slots__ = ("name", "detail")

    def __init__(self, op: str, detail: str):
        self.name, self.detail = range_name(op), detail

    def __enter__(self) -> OpRange:
        _nvtx.push_range(message=self.name)
        if self.detail:
            _nvtx.push_range(message=self.detail)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.detail:
            _nvtx.pop_range()
        _nvtx.pop_range()


def op_range(op: str, **tensors: Any) -> contextlib.AbstractContextManager:
    """Context manager: the NVTX ranges of one call of ``op`` (a shared null context when off)."""
    if not ENABLED:
        return NULL_RANGE
    return OpRange(op, describe(**tensors))
