"""A consumer warpgroup's 64-row O tile written through shared memory (the SM90 prefill's opt-in
``epilogue="smem"``): the normalized fp32 accumulator goes to a 128-byte-swizzled 16-bit tile in
4-byte pairs (a warp's eight quads write eight rows, whose 16-byte columns the swizzle spreads
over all banks), then each thread moves 16-byte row chunks to global memory (eight consecutive
threads cover one 128-byte swizzle row: conflict-free reads, coalesced writes).

Rows at or past ``q_len`` are not written: with varlen packing they are the next request's rows
(or padding after the last request). A TMA store of the tile would need a per-request bounded
tensor for that, so the copy is 16-byte ``st.global`` with a per-row predicate instead.
Design: docs/design/sm90-prefill.md#epilogue-through-shared-memory-opt-in-epiloguesmem.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from ..jit.asm import asm
from .smem_fp8 import ld_shared_v4, pack_16x2, smem_offset, st_shared_b32

CHUNK = 8  # 16-bit elements per 16-byte chunk


@dsl_user_op
def st_global_v4(gmem_addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """``st.global.v4.b32``: one 16-byte store at a 16-byte aligned global address."""
    asm([], [Int64(gmem_addr), Int32(a), Int32(b), Int32(c), Int32(d)], "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r", side_effects=True, loc=loc, ip=ip)


def o_tile_layout(rows: int, head_dim: int, dtype):
    """(Trace time.) The swizzled (rows, D) 16-bit layout of one warpgroup's O tile: the K-major A
    operand layout WGMMA would use (128-byte swizzle for D >= 64)."""
    return sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (rows, 8, head_dim), dtype, 1)


@cute.jit
def store_o_tile(acc_o: cute.Tensor, inv: cute.Tensor, cO0: cute.Tensor, m_off, n_off, base: Int32, layout,
                 dtype_name: cutlass.Constexpr, mO: cute.Tensor, q_start, q_len, j_first, head, tid,
                 rows: cutlass.Constexpr, head_dim: cutlass.Constexpr, nthreads: cutlass.Constexpr,
                 bar_id: cutlass.Constexpr):
    """Write this warpgroup's rows ``j_first ..`` of O (``acc_o * inv`` per row; ``cO0`` thread
    0's accumulator coordinates, ``m_off`` / ``n_off`` this thread's offsets) to ``mO`` (T, Hq, D)
    through the tile at shared address ``base`` (``layout``: :func:`o_tile_layout`), which the
    caller guarantees no one else reads or writes now. ``bar_id``: a named barrier of the
    warpgroup's ``nthreads`` threads."""
    for e in cutlass.range_constexpr(0, cute.size(acc_o), 2):
        h = cO0[e][0] // 8
        word = pack_16x2(acc_o[e] * inv[h], acc_o[e + 1] * inv[h], dtype_name)
        st_shared_b32(base + smem_offset((m_off + cO0[e][0], cO0[e][1] + n_off, 0), layout, 2), word)
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=nthreads)
    chunks = head_dim // CHUNK
    for k in cutlass.range_constexpr(rows * chunks // nthreads):
        c = tid + k * nthreads
        r = c // chunks
        col = (c % chunks) * CHUNK
        j = j_first + r
        if j < q_len:
            a, b, c2, d = ld_shared_v4(base + smem_offset((r, col, 0), layout, 2))
            addr = (mO.iterator + cute.crd2idx((q_start + j, head, col), mO.layout)).toint()
            st_global_v4(addr, a, b, c2, d)
