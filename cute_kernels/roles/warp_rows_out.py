"""The portable prefill's output per warp (``warp_store``): with one token warp (``warps_n == 1``)
a row's output is one warp's alone, so each warp normalizes its rows, writes them in the output
dtype over its own staged query rows (read by no other warp, and dead after its last QK) and
stores them to global memory from there. No CTA barrier and no fp32 merge rows: a warp's epilogue
overlaps the other warps' last tiles. Design: docs/design/sm80.md#the-output-per-warp.

The staged query's layout (``WarpTileAttention.q_blocked`` or its swizzle) puts the 8 rows of an
``ldmatrix`` phase in 8 different bank groups; the accumulator's 32-bit pairs (8 rows x 16 bytes per
store) and the 8-byte reads below (8 rows x 16 bytes per half warp) have the same shape, so neither
conflicts.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .fragments import load_shared_b32x2, store_shared_b32


def _own_offset(eng, r, dim):
    """(Traced.) Byte offset of head dim ``dim`` (even) of CTA row ``r`` in the staged query's layout."""
    if const_expr(eng.ldsm_xor):
        return eng.q_blocked(r, dim // 16, (dim // 8) % 2) + (dim % 8) * 2
    return eng.q_swizzle(r * eng.q_row_bytes + dim * 2)


def _pairs(eng):
    """The accumulator's pairs of adjacent head dims: ``((n, e), (n, e))`` per pair, lower dim first
    (16-bit caches: the two columns of an n8 tile; FP8: the same column of two n8 tiles, see
    ``WarpTileAttention.o_dim``)."""
    if eng.fp8:
        return [((2 * k, e), (2 * k + 1, e)) for k in range(eng.D // 16) for e in range(2)]
    return [((n, 0), (n, 1)) for n in range(eng.D // 8)]


@cute.jit
def stage_own_rows(eng, state, sq_base, sStats, wm, lane, v_scale, out_dtype, out_row, mLse):
    """This warp's rows, normalized (times ``v_scale`` and the widening factor) and converted to
    ``out_dtype``, over its own staged query rows; each real row's base-2 LSE to ``mLse[token,
    head]`` (None: no LSE) from one thread of the row's quad (``out_row``: see :func:`store_own_rows`)."""
    acc_o, _, _, row_max, row_sum = state
    cute.arch.sync_warp()  # the warp's last ldmatrix of its query rows, and stats_smem's stores, are behind it
    out_scale = v_scale * Float32(2.0 ** eng.widen_log2)
    pairs = _pairs(eng)
    for mt in cutlass.range_constexpr(eng.m_tiles):
        for h in cutlass.range_constexpr(2):
            slot = 2 * mt + h
            r = eng.thread_row(wm, lane, mt, h)
            m = row_max[slot]
            total = row_sum[slot]
            if const_expr(eng.stats_smem):  # sums reduced over the quad already
                m = sStats[0, r]
                total = sStats[1, r]
            else:
                total = total + cute.arch.shuffle_sync_bfly(total, 1)
                total = total + cute.arch.shuffle_sync_bfly(total, 2)
            factor = Float32(0.0)
            lse = -Float32.inf
            if total > Float32(0.0):  # then m is finite
                factor = out_scale / total
                lse = m + cute.math.log2(total, fastmath=True)
            if const_expr(mLse is not None):
                real, token, head = out_row(r)
                if real and lane % 4 == 0:
                    mLse[token, head] = lse
            vals = cute.make_rmem_tensor((2 * len(pairs),), Float32)
            for p in cutlass.range_constexpr(len(pairs)):
                for k in cutlass.range_constexpr(2):
                    n, e = pairs[p][k]
                    vals[2 * p + k] = acc_o[n // 2][2 * h + e + 4 * mt + 4 * eng.m_tiles * (n % 2)]
            narrow = cute.make_rmem_tensor((2 * len(pairs),), out_dtype)
            narrow.store((vals.load() * factor).to(out_dtype))
            words = cute.recast_tensor(narrow, Int32)
            for p in cutlass.range_constexpr(len(pairs)):
                n, e = pairs[p][0]
                store_shared_b32(sq_base + _own_offset(eng, r, eng.o_dim(n, e, lane)), words[p])
    cute.arch.sync_warp()


@cute.jit
def store_own_rows(eng, sq_base, wm, lane, out_row, mO):
    """Copy this warp's staged output rows to ``mO[token, head, :]``, 8 bytes per lane and store:
    a half warp reads 8 rows x 16 bytes, and each row's 32-byte sector is written whole.
    ``out_row(r)``: ``(real, token, head)``, whether CTA row ``r`` is a query row and where it goes."""
    rows_w = 16 * eng.m_tiles
    rr = (lane // 2) % 8
    sub = lane % 2
    cc = lane // 16
    for rg in cutlass.range_constexpr(rows_w // 8):
        r = wm * rows_w + rg * 8 + rr
        real, token, head = out_row(r)
        if real:
            gRow = mO[token, head, None]
            for cg in cutlass.range_constexpr(eng.D // 16):
                chunk = 2 * cg + cc  # 8 head dims
                a, b = load_shared_b32x2(sq_base + _own_offset(eng, r, chunk * 8) + sub * 8)
                words = cute.make_rmem_tensor((2,), Int32)
                words[0] = a
                words[1] = b
                vals = cute.recast_tensor(words, gRow.element_type)
                cute.local_tile(gRow, (4,), (2 * chunk + sub,)).store(vals.load())
