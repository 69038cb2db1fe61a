"""The compiled entry point of a kernel with a variable argument list.

A config's signature (``KernelConfig.signature()``) lists exactly the arguments its variant takes:
optional ones (a sink tensor, an FP8 query's scale, a split workspace) are absent rather than
passed as unused placeholders, since every argument costs host time at each TVM-FFI call. One
``@cute.jit`` function per combination would be boilerplate; :func:`entry` instead builds an object
whose jitted ``__call__`` has exactly those parameter names (and the stream) and forwards them by
name to the kernel's launch method, where the absent ones are ``None`` (compile-time).
"""

from __future__ import annotations

import inspect

import cutlass.cute as cute


def entry(kernel, names: tuple[str, ...], launch: str = "launch"):
    """An object to ``cute.compile``: ``obj(*args_in_names_order, stream)`` calls
    ``kernel.<launch>(name=value, ..., stream=stream)``."""
    params = (*names, "stream")

    def __call__(self, *args):  # forwarding only: no control flow for the DSL to rewrite
        return getattr(self.kernel, launch)(**dict(zip(params, args)))

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    __call__.__signature__ = inspect.Signature([inspect.Parameter(p, kind) for p in ("self", *params)])
    cls = type(f"{type(kernel).__name__}Entry", (), {"__call__": cute.jit(preprocess=False)(__call__)})
    obj = cls()
    obj.kernel = kernel
    return obj
