"""Readable kernel symbols, given at compile time from the config.

Left alone, the DSL names a kernel after its Python module, class and arguments
(``kernel_cutlass_kernel_cute_kernelssm90decode_SplitSingle_object_at__tensorptrbf16gmem...``),
which is what Nsight tools then show. :func:`kernel_symbol` derives a short name from the config
instead (``cute_kernels_sm90_decode_split``) and :func:`named_kernels` applies it, through the
DSL's own ``set_name_prefix``, to every ``@cute.kernel`` of the kernel object while it compiles;
the DSL appends its per-module launch index (``_0``). No kernel module names itself.

A name needs to be unique only within its compiled module: every compiled variant is loaded as a
CUDA library of its own and its kernels are looked up by name in that library, so variants of one
kernel share a name (as they did before, when the DSL's 180-character cut made them collide).
This module imports neither the DSL nor torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

PREFIX = "cute_kernels"

# Config fields that select a different algorithm, hence a different profile: each one that
# holds adds its word to the symbol, in this order.
VARIANT_WORDS: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("split", lambda c: getattr(c, "split", False) is True),
    ("dynamic", lambda c: getattr(c, "dynamic", False) is True),
    ("cluster", lambda c: getattr(c, "cluster", False) is True),
    ("rope", lambda c: (getattr(c, "rot_dim", 0) or 0) > 0),
    ("gate", lambda c: getattr(c, "gate", False) is True),
    ("overlap", lambda c: getattr(c, "overlap", False) is True),
)


def kernel_symbol(config: Any) -> str:
    """``"sm90.decode"`` with ``split=True`` -> ``"cute_kernels_sm90_decode_split"``.

    Arch-neutral kernels (``common.*``) carry no arch word: ``"cute_kernels_merge_states"``.
    """
    family = config.kernel_id.removeprefix("common.")
    words = [PREFIX, *family.replace(".", "_").split("_")]
    words += [word for word, holds in VARIANT_WORDS if holds(config)]
    return "_".join(words)


def kernel_functions(kernel: Any) -> list[Any]:
    """The ``@cute.kernel`` functions of ``kernel``'s class and its bases (the DSL marks the
    function it wraps with ``_decorator_kind == "kernel"``; ``@cute.jit`` ones say ``"jit"``)."""
    found = []
    for klass in type(kernel).__mro__:
        for attr in vars(klass).values():
            wrapped = getattr(attr, "__wrapped__", None)
            if callable(getattr(attr, "set_name_prefix", None)) and (
                getattr(wrapped, "_decorator_kind", None) == "kernel"
            ):
                found.append(attr)
    return found


_OPTIONS = "_cute_dsl_name_options"  # where set_name_prefix keeps its choice, on the wrapped function


@contextlib.contextmanager
def named_kernels(kernel: Any, symbol: str) -> Iterator[list[Any]]:
    """While active, every ``@cute.kernel`` of ``kernel`` is emitted as ``<symbol>_<index>``.

    The naming choice lives on the (class-level) function, so it is restored on exit; callers
    hold the compile lock, so no other compile of the same class sees it.
    """
    functions = kernel_functions(kernel)
    saved = [(f.__wrapped__, getattr(f.__wrapped__, _OPTIONS, None)) for f in functions]
    try:
        for f in functions:
            f.set_name_prefix(symbol, remove_cutlass_symbol=True, keep_mangled_name=False)
        yield functions
    finally:
        for wrapped, options in saved:
            if options is None:
                with contextlib.suppress(AttributeError):
                    delattr(wrapped, _OPTIONS)
            else:
                setattr(wrapped, _OPTIONS, options)
