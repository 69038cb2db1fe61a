"""Which KV positions a query sees, and which KV tiles and pages a CTA must load (arch-neutral).

Visibility (the package contract, :mod:`cute_kernels.reference`): a query at absolute position
``p`` sees keys ``max(0, p - window_left) ... p`` when ``window_left >= 0`` and ``0 ... p``
otherwise (``window_left = -1``). In decode, query token ``j`` of a request with ``q_len`` new
tokens sits at ``p = seq_len - q_len + j``. A window is a runtime value: one compiled kernel
serves every window, and tiles / pages wholly outside it are never loaded (not merely masked).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def window_start(q_pos, window_left):
    """First key position visible to a query at ``q_pos`` (0 without a window)."""
    lo = Int32(0)
    if window_left >= 0:
        lo = cutlass.max(q_pos - window_left, Int32(0))
    return lo


@cute.jit
def key_visible(k_pos, q_pos, window_left):
    """Whether the key at ``k_pos`` is visible to the query at ``q_pos``: causal and in the window."""
    ok = k_pos <= q_pos
    if window_left >= 0:
        ok = ok and k_pos >= q_pos - window_left
    return ok


@cute.jit
def decode_key_range(seq_len, q_len, window_left):
    """``[lo, hi)``: the keys any of a request's ``q_len`` draft queries sees (its oldest query's
    window start up to the sequence end)."""
    return window_start(seq_len - q_len, window_left), seq_len


@cute.jit
def split_tiles(lo, hi, tile: cutlass.Constexpr, split, num_splits):
    """Tiles of ``tile`` keys covering ``[lo, hi)`` that split ``split`` of ``num_splits`` takes:
    ``(first, step, count)`` for tiles ``first, first + step, ...`` (strided: every split's first
    tile is known before the others' and the tail is balanced to one tile)."""
    first_tile = lo // tile
    end_tile = (hi + tile - 1) // tile
    total = cutlass.max(end_tile - first_tile, Int32(0))
    count = Int32(0)
    if split < total:
        count = (total - split + num_splits - 1) // num_splits
    return first_tile + split, num_splits, count


@cute.jit
def box_visible(start, length: cutlass.Constexpr, lo, hi):
    """Whether the ``length`` keys from ``start`` overlap ``[lo, hi)``: a box that does not is
    loaded as zeros (an out-of-range page coordinate), costing no memory traffic."""
    return start < hi and start + length > lo


@cute.jit
def prefill_key_range(seq_len, q_len, row_first, row_last, causal: cutlass.Constexpr, window_left):
    """``[lo, hi)``: the keys any of rows ``row_first .. row_last`` (within the request's ``q_len``
    new tokens, the last ``q_len`` of its ``seq_len``) sees. Causal: up to the last row's own
    position; else the whole sequence. The window trims the start to the first row's window."""
    first_pos = seq_len - q_len + row_first
    hi = seq_len
    if causal:
        hi = cutlass.min(seq_len - q_len + row_last + 1, seq_len)
    return window_start(first_pos, window_left), hi


@cute.jit
def key_visible_prefill(k_pos, q_pos, seq_len, causal: cutlass.Constexpr, window_left):
    """Visibility of key ``k_pos`` to the query at ``q_pos`` (a key past the sequence never is)."""
    ok = k_pos < seq_len
    if causal:
        ok = ok and k_pos <= q_pos
    if window_left >= 0:
        ok = ok and k_pos >= q_pos - window_left
    return ok
