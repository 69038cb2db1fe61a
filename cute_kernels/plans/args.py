"""Host-only checks of the warm-up enumerations' arguments (``qsa_variants``, ``decode_variants``
via :func:`cute_kernels.warmup`): a bad model shape or option list is named before any plan
divides by it or looks it up; and of the ops' scalar arguments the kernels take as int32
(docs/design/inputs.md#the-classes)."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

INT32_MAX = 2**31 - 1  # the largest value of a kernel's int32 scalar argument (window_left)
FP32_MAX = 3.4028234663852886e38  # the largest finite float32: float scales reach the kernels as fp32 scalars


def positive_fp32(value: Any) -> bool:
    """Whether ``value`` is a positive Python float or int (bools refused) that stays finite as the
    kernels' fp32 scalar: ``0 < value <= FP32_MAX`` (NaN fails every comparison)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= FP32_MAX


def fp32_note(value: Any) -> str:
    """What an error adds for a finite float beyond :data:`FP32_MAX` (it would reach a kernel as inf)."""
    return (f" (a float32 scalar on the GPU: at most {FP32_MAX:.7g})"
            if isinstance(value, (int, float)) and not isinstance(value, bool) and FP32_MAX < value < math.inf else "")


def check_window_left(value: Any) -> int:
    """``window_left``: an int in ``[-1, INT32_MAX]`` (-1: no window; the kernels take it as an
    int32: a larger one does not fit); ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= INT32_MAX:
        raise ValueError(f"window_left must be an int in [-1, {INT32_MAX}] (-1: no window), got {value!r}")
    return value


def check_positive_ints(**sizes: Any) -> None:
    """Each of ``sizes`` a positive Python int (bools refused); ``ValueError`` / ``TypeError``
    naming it."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be a positive int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_flags(**flags: Any) -> None:
    """Each of ``flags`` a bool (a truthy string or int is refused, never read as one);
    ``TypeError`` naming it."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def check_workers(workers: Any) -> None:
    """A compile pool's ``workers``: None (the default size) or a positive int."""
    if workers is not None:
        check_positive_ints(workers=workers)


def check_sequence(name: str, values: Any, what: str) -> tuple:
    """``values`` an iterable other than a bare string (which would be read letter by letter), as a
    tuple; ``TypeError`` "``name`` must be a sequence of ``what``" otherwise."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of {what}, got {values!r}")
    return tuple(values)


def check_layer_shape(*, head_dim: Any, num_q_heads: Any, num_kv_heads: Any, page_size: Any, **more: Any) -> None:
    """Each size a positive Python int (bools refused), ``num_q_heads`` a multiple of
    ``num_kv_heads``; ``ValueError`` / ``TypeError`` naming the argument."""
    check_positive_ints(head_dim=head_dim, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                        **more)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def check_choices(name: str, values: Any, allowed: Collection) -> tuple:
    """``values`` a non-empty sequence (not a bare string, which would be read letter by letter)
    of members of ``allowed``; returned as a tuple."""
    values = check_sequence(name, values, str(sorted(map(repr, allowed))))
    bad = [v for v in values if isinstance(v, bool) is not all(isinstance(a, bool) for a in allowed)
           or v not in allowed]
    if not values or bad:
        raise ValueError(f"{name} must hold one or more of {sorted(map(repr, allowed))}, got {values!r}")
    return values
