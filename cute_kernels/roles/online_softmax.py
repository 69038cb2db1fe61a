"""Online softmax over KV tiles with the query rows on the WGMMA's M (the FlashAttention
orientation): a thread owns two rows of its warpgroup's 64 (``r`` and ``r + 8``) and, in each,
columns ``8 j + 2 (lane % 4) + {0, 1}``; a row lives in one quad, so its max and sum need two
shuffles and no shared memory.

State per thread: the running max (log2 units) and this thread's share of the running sum of
each of its two rows. The sum is reduced over the quad once, in :func:`finalize`. A row whose max
is still -inf shifts by 0, so ``exp2(-inf) = 0`` and no ``inf - inf`` appears; a row that saw no
KV finishes with sum 0, output 0 and LSE -inf. Design: docs/design/sm90-prefill.md#softmax.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .fragments import ffma
from .prefill_blocks import row_limit

ROWS = 2  # rows per thread in an m64 accumulator


def new_state():
    """(row_max, row_sum) rmem tensors: -inf and 0."""
    row_max = cute.make_rmem_tensor((ROWS,), Float32)
    row_sum = cute.make_rmem_tensor((ROWS,), Float32)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)
    return row_max, row_sum


@cute.jit
def softmax_step(acc_s: cute.Tensor, cS0: cute.Tensor, scale: cute.Tensor, row_max: cute.Tensor,
                 row_sum: cute.Tensor, masked: cutlass.Constexpr, limit: cute.Tensor, col0, alpha: cute.Tensor,
                 lower=None, fma: cutlass.Constexpr = False, p_log2: cutlass.Constexpr = 0):
    """One tile in place: ``acc_s`` (the raw QK accumulator) becomes ``P = exp2(s - max)`` with
    ``s = acc * scale[row]`` (log2 units) and, when ``masked``, ``s = -inf`` at columns
    ``col0 + c >= limit[row]`` (and, with ``lower``, a sliding window's ``< lower[row]``;
    ``col0``: the tile's first KV position plus this thread's column offset; ``cS0``: thread 0's
    static coordinates of ``acc_s``). Writes ``alpha``, the factor the output rows must be
    rescaled by (``exp2(old max - new max)``).

    ``fma``: the same softmax with one instruction less per score: the max is taken over the raw
    accumulator (``scale > 0``), and each ``P = exp2(acc * scale - shift)`` is one FFMA before the
    exp2; ``P`` then comes out ``2^p_log2`` times larger (the row sums with it), which
    :func:`reference_shift` takes back before the epilogue.
    docs/design/sm90-prefill.md#the-lean-softmax"""
    tile_max = _masked_tile_max(acc_s, cS0, scale, masked, limit, col0, lower, not fma)
    # per row: the shift P takes (fma: negated, with 2^p_log2 folded in), alpha, the running state
    shift = cute.make_rmem_tensor((ROWS,), Float32)
    for h in cutlass.range_constexpr(ROWS):
        t = tile_max[h]
        for off in (1, 2):
            t = cute.arch.fmax(t, cute.arch.shuffle_sync_bfly(t, off))
        if cutlass.const_expr(fma):
            t = t * scale[h]  # the max of the raw scores, scaled once: -inf stays -inf (scale > 0)
        new_max = cute.arch.fmax(row_max[h], t)
        row_shift = new_max if new_max != -Float32.inf else Float32(0.0)
        alpha[h] = cute.math.exp2(row_max[h] - row_shift, fastmath=True)
        row_max[h] = new_max
        row_sum[h] = row_sum[h] * alpha[h]
        shift[h] = Float32(p_log2) - row_shift if cutlass.const_expr(fma) else row_shift
    for e in cutlass.range_constexpr(cute.size(acc_s)):
        h = cS0[e][0] // 8
        if cutlass.const_expr(fma):
            p = cute.math.exp2(ffma(acc_s[e], scale[h], shift[h]), fastmath=True)
        else:
            p = cute.math.exp2(acc_s[e] - shift[h], fastmath=True)
        row_sum[h] = row_sum[h] + p
        acc_s[e] = p


@cute.jit
def _masked_tile_max(acc_s: cute.Tensor, cS0: cute.Tensor, scale: cute.Tensor, masked: cutlass.Constexpr,
                     limit: cute.Tensor, col0, lower, scaled: cutlass.Constexpr):
    """Each row's max over the tile; ``acc_s`` scaled in place (``scaled``) and, when ``masked``,
    -inf at the masked columns (a select, not a product: the logit may be NaN past the sequence)."""
    tile_max = cute.make_rmem_tensor((ROWS,), Float32)
    tile_max.fill(-Float32.inf)
    for e in cutlass.range_constexpr(cute.size(acc_s)):
        m, n = cS0[e]
        h = m // 8
        v = acc_s[e] * scale[h] if cutlass.const_expr(scaled) else acc_s[e]
        if cutlass.const_expr(masked):
            if col0 + n >= limit[h]:
                v = -Float32.inf
            if cutlass.const_expr(lower is not None):
                if col0 + n < lower[h]:
                    v = -Float32.inf
        if cutlass.const_expr(scaled or masked):
            acc_s[e] = v
        tile_max[h] = cute.arch.fmax(tile_max[h], v)
    return tile_max


@cute.jit
def reference_shift(row_max: cute.Tensor, p_log2: cutlass.Constexpr):
    """After :func:`softmax_step` with ``fma`` and ``p_log2``: the row sums hold
    ``2^p_log2 * sum exp2(s - max)``, i.e. ``sum exp2(s - (max - p_log2))``, so the max the
    epilogue (sink, normalization, LSE) reads becomes ``max - p_log2`` (-inf stays -inf)."""
    if cutlass.const_expr(p_log2 != 0):
        for h in cutlass.range_constexpr(ROWS):
            row_max[h] = row_max[h] - Float32(p_log2)


@cute.jit
def rescale_rows(acc_o: cute.Tensor, cO0: cute.Tensor, alpha: cute.Tensor):
    for e in cutlass.range_constexpr(cute.size(acc_o)):
        acc_o[e] = acc_o[e] * alpha[cO0[e][0] // 8]


@cute.jit
def rescale_rows_if_moved(acc_o: cute.Tensor, cO0: cute.Tensor, alpha: cute.Tensor):
    """:func:`rescale_rows`, skipped by a warp none of whose rows' max moved: every ``alpha`` is
    then exactly 1 (``alpha <= 1`` always), and ``o * 1 = o``, so the result is the same bit for bit."""
    if cute.arch.vote_any_sync(cute.arch.fmin(alpha[0], alpha[1]) < Float32(1.0)):
        rescale_rows(acc_o, cO0, alpha)


@cute.jit
def finalize(row_max: cute.Tensor, row_sum: cute.Tensor, out_scale):
    """(inv, lse) per row: ``out_scale / sum`` to multiply the output rows by, and the base-2
    LSE ``max + log2(sum)``; 0 and -inf for a row that saw nothing."""
    inv = cute.make_rmem_tensor((ROWS,), Float32)
    lse = cute.make_rmem_tensor((ROWS,), Float32)
    for h in cutlass.range_constexpr(ROWS):
        total = row_sum[h]
        for off in (1, 2):
            total = total + cute.arch.shuffle_sync_bfly(total, off)
        inv[h] = Float32(0.0)
        lse[h] = -Float32.inf
        if total > Float32(0.0):
            inv[h] = out_scale / total
            lse[h] = row_max[h] + cute.math.log2(total, fastmath=True)
    return inv, lse


@cute.jit
def add_sink(row_max: cute.Tensor, row_sum: cute.Tensor, sink_log2, first_of_quad):
    """One more logit per row, a sink (log2 units) that adds no value, as an online-softmax step:
    the running max becomes ``max(m, sink)``, every thread's share of the sum is rescaled and the
    sink's ``2^(sink - max)`` joins the share of the quad's first thread (``first_of_quad``).
    Returns the factor the output rows must be rescaled by (then :func:`finalize` as usual; a row
    that saw nothing gets 0 and LSE ``sink_log2``)."""
    alpha = cute.make_rmem_tensor((ROWS,), Float32)
    for h in cutlass.range_constexpr(ROWS):
        big = cute.arch.fmax(row_max[h], sink_log2)
        keep = Float32(0.0)
        if row_max[h] != -Float32.inf:
            keep = cute.math.exp2(row_max[h] - big, fastmath=False)
        extra = Float32(0.0)
        if first_of_quad and sink_log2 != -Float32.inf:  # (a -inf sink is no sink)
            extra = cute.math.exp2(sink_log2 - big, fastmath=False)
        row_sum[h] = row_sum[h] * keep + extra
        row_max[h] = big
        alpha[h] = keep
    return alpha


def row_lower(row0, j_first, q_len, seq_len, window_left):
    """(Traced.) A sliding window's lowest visible key of this thread's two rows (``p - w``; 0
    without a window, ``window_left = -1``)."""
    lower = cute.make_rmem_tensor((ROWS,), Int32)
    on = cutlass.min(cutlass.max(window_left + 1, Int32(0)), Int32(1))  # 1 with a window, 0 without
    for h in range(ROWS):
        lower[h] = (seq_len - q_len + j_first + row0 + 8 * h - window_left) * on
    return lower


def row_limits(row0, j_first, q_len, seq_len, cap, causal: bool):
    """(Traced.) The KV limit of this thread's two rows (query rows ``j_first + row0 + {0, 8}`` of
    the request), as in :func:`cute_kernels.roles.prefill_blocks.row_limit`."""
    limit = cute.make_rmem_tensor((ROWS,), Int32)
    for h in range(ROWS):
        limit[h] = row_limit(j_first + row0 + 8 * h, q_len, seq_len, cap, causal, cutlass.min, cutlass.max)
    return limit


__all__ = ["ROWS", "new_state", "softmax_step", "reference_shift", "rescale_rows", "rescale_rows_if_moved",
           "finalize", "add_sink",
           "row_lower", "row_limits"]
