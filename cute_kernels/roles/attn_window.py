"""Which KV positions a query sees, and which KV tiles and pages a CTA must load (arch-neutral).

Visibility (the package contract, :mod:`cute_kernels.reference`): a query at absolute position
``p`` sees keys ``max(0, p - window_left) ... p`` when ``window_left >= 0`` and ``0 ... p``
otherwise (``window_left = -1``), and no key at or past the block table's capacity ``W x page``
(docs/design/inputs.md#lengths). In decode, query token ``j`` of a request with ``q_len`` new
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
def decode_key_range(seq_len, q_len, window_left, kv_end):
    """``[lo, hi)``: the keys any of a request's ``q_len`` draft queries sees (its oldest query's
    window start up to ``kv_end``: the sequence end clamped to the block table's capacity,
    :func:`cute_kernels.roles.prefill_blocks.kv_cap`)."""
    return window_start(seq_len - q_len, window_left), kv_end


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
def prefill_key_range(seq_len, q_len, row_first, row_last, causal: cutlass.Constexpr, window_left, kv_end):
    """``[lo, hi)``: the keys any of rows ``row_first .. row_last`` (within the request's ``q_len``
    new tokens, the last ``q_len`` of its ``seq_len``) sees. Causal: up to the last row's own
    position; else the whole sequence; never at or past ``kv_end`` (the sequence end clamped to
    the block table's capacity). The window trims the start to the first row's window."""
    first_pos = seq_len - q_len + row_first
    hi = kv_end
    if causal:
        hi = cutlass.min(seq_len - q_len + row_last + 1, kv_end)
    return window_start(first_pos, window_left), hi


@cute.jit
def key_visible(k_pos, q_pos, kv_end, causal: cutlass.Constexpr, window_left):
    """Visibility of key ``k_pos`` to the query at ``q_pos``: before ``kv_end`` (a key past the
    sequence or the block table never is), causal, in the window."""
    ok = k_pos < kv_end
    if causal:
        ok = ok and k_pos <= q_pos
    if window_left >= 0:
        ok = ok and k_pos >= q_pos - window_left
    return ok
