"""One description of a kernel's arguments, used both to compile it and to call it.

A kernel config (a frozen dataclass) returns its signature as a tuple of :class:`TensorArg` and
:class:`ScalarArg`. The compiler turns that signature into fake CuTe tensors (no GPU, no torch);
the torch op turns it into the positional argument list of the compiled function by name. Both
lists come from the same tuple, so they cannot drift apart.

Extents named by the same string are one symbolic integer: TVM-FFI then checks at call time that
the tensors agree on them (e.g. the head dim of Q and of the output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import cutlass.cute as cute

from .dtypes import DTYPE_BITS, cute_dtype

Extent = Union[int, str]


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument: last dim unit-stride, every other stride dynamic.

    ``align`` is the byte alignment promised for the data pointer and for every dynamic
    stride (in bytes); the op validates it before the call, and TVM-FFI re-checks it.
    ``static_strides`` pins strides known at compile time (None = dynamic), outermost first.
    """

    name: str
    dtype: str
    shape: tuple[Extent, ...]
    align: int = 16
    static_strides: tuple[int | None, ...] | None = None

    @property
    def elem_bits(self) -> int:
        return DTYPE_BITS[self.dtype]

    @property
    def stride_divisibility(self) -> int:
        return max(1, self.align * 8 // self.elem_bits)


@dataclass(frozen=True)
class ScalarArg:
    """A scalar runtime argument (Int32 / Float32 ...)."""

    name: str
    dtype: str


Arg = Union[TensorArg, ScalarArg]


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


def call_arguments(signature: tuple[Arg, ...], values: dict) -> list:
    """Positional arguments of the compiled function, picked from ``values`` by name."""
    missing = [a.name for a in signature if a.name not in values]
    if missing:
        raise KeyError(f"missing kernel arguments: {missing}")
    return [values[a.name] for a in signature]
