"""Fake CuTe arguments built from a kernel signature, for compiling without data or a GPU."""

from __future__ import annotations

import cutlass.cute as cute

from .dtypes import cute_dtype
from .spec import Arg, Extent, ScalarArg


def fake_arguments(signature: tuple[Arg, ...]) -> list:
    """Fake CuTe values for compiling ``signature`` without data or a GPU."""
    symbols: dict[str, object] = {}

    def extent(e: Extent):
        if isinstance(e, int):
            return e
        if e not in symbols:
            symbols[e] = cute.sym_int()
        return symbols[e]

    out = []
    for arg in signature:
        if isinstance(arg, ScalarArg):
            out.append(cute_dtype(arg.dtype)(0))
            continue
        rank = len(arg.shape)
        strides = []
        for i in range(rank):
            pinned = arg.static_strides[i] if arg.static_strides else None
            if i == rank - 1:
                strides.append(1)
            elif pinned is not None:
                strides.append(pinned)
            else:
                strides.append(cute.sym_int64(divisibility=arg.stride_divisibility))
        out.append(
            cute.runtime.make_fake_tensor(
                cute_dtype(arg.dtype),
                tuple(extent(e) for e in arg.shape),
                stride=tuple(strides),
                assumed_align=arg.align,
            )
        )
    return out
