"""The online-softmax step of the SM90 attention consumers (device roles).

Two forms, by which MMA dimension holds the KV tokens:

- :class:`SwapAbSoftmax` (paged decode, QSA per-row kernel): "swap-AB" WGMMAs, the tile's tokens
  on M and the KV group's query rows on N (``S^T = K Q^T``, ``O^T += V^T P^T``). A thread owns
  columns ``8 j + 2 (lane % 4) + {0, 1}`` (``N / 4`` "slots"); per-column maxima and sums cross the
  warpgroup's 4 warps through shared memory; P goes to shared memory as the PV B operand.
- :class:`QuadSoftmax` (QSA row tiles): the query columns on M, the tokens on N (``S = Q K^T``),
  so a query's logits live in one quad of threads: two shuffles, no shared memory, and P stays
  in registers as the A operand of the PV WGMMA.

Both run in base 2 with masked logits at -inf; a row whose maximum is still -inf shifts by 0, so
``exp2(-inf) = 0`` and no ``inf - inf``. Design: docs/design/sm90-decode.md#the-design-as-it-stands.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

BAR_MMA = 1  # named barrier of the consumer warpgroup (0 is __syncthreads)
LOG2E = math.log2(math.e)  # logits are scaled into base 2 (exp2 is the hardware's exponential)


def slot_of(n_static: int) -> int:
    """Register slot of accumulator column ``n_static`` (thread 0's columns 8 j + {0, 1})."""
    return (n_static // 8) * 2 + n_static % 8


def slot_column(s: int, n_base):
    """The accumulator column of register slot ``s`` for a thread whose columns start at
    ``n_base`` (2 (lane % 4)): the inverse of :func:`slot_of`, plus the thread's offset."""
    return (s // 2) * 8 + s % 2 + n_base


def swap_ab_mmas(D: int, N: int, tile: int, stages: int, kv_dtype, mma_dtype, fp8: bool, mma_m: int):
    """(Traced.) The two tiled WGMMAs of the swap-AB consumer (KV tokens on M, the group's query
    rows on N; A from registers for FP8, from shared memory for 16-bit caches) and the shared-memory
    layouts: K tiles (tokens, D) K-major on both paths; V stored the same way for FP8
    (ldmatrix.trans reads it) and as MN-major V^T for 16-bit SS; Q and P as the B operands.
    Returns ``(qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout)``."""
    a_src = warpgroup.OperandSource.RMEM if fp8 else warpgroup.OperandSource.SMEM
    qk_mma = sm90_utils.make_trivial_tiled_mma(
        mma_dtype, mma_dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
        tiler_mn=(mma_m, N), a_source=a_src,
    )
    pv_mma = sm90_utils.make_trivial_tiled_mma(
        mma_dtype, mma_dtype, OperandMajorMode.K if fp8 else OperandMajorMode.MN,
        OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(mma_m, N), a_source=a_src,
    )
    k_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (tile, N, D), kv_dtype, stages)
    if fp8:
        v_layout = k_layout
    else:
        v_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (D, N, tile), kv_dtype, stages)
    q_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (tile, N, D), mma_dtype, 1)
    p_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (D, N, tile), mma_dtype, 1)
    return qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout


def query_on_m_mmas(D: int, tile: int, stages: int, dtype, mma_m: int):
    """(Traced.) The WGMMAs of the query-on-M consumer: ``S = Q K^T`` with Q as the SS A operand,
    ``O += P V`` with P from registers; K as B (tokens x D, K-major) and V as MN-major B (D
    contiguous), so a gather's coordinates stay (token, d, stage) and (d, token, stage).
    Returns ``(qk_mma, pv_mma, k_layout, v_layout, q_layout, None)`` (no P tile)."""
    qk_mma = sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                               (1, 1, 1), tiler_mn=(mma_m, tile))
    pv_mma = sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                               (1, 1, 1), tiler_mn=(mma_m, D), a_source=warpgroup.OperandSource.RMEM)
    k_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (mma_m, tile, D), dtype, stages)
    v_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (mma_m, D, tile), dtype, stages)
    q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (mma_m, tile, D), dtype, 1)
    return qk_mma, pv_mma, k_layout, v_layout, q_layout, None


class SwapAbSoftmax:
    """The swap-AB consumer's per-thread state and online-softmax step, for ``N`` query columns,
    ``D`` head dims, ``tile`` tokens per step and a warpgroup of ``warps`` warps. ``p_pre``: log2
    of the power of two P is scaled by before it enters the PV MMA (the FP8 path's range guard)."""

    def __init__(self, N: int, D: int, tile: int, p_pre: int, warps: int):
        self.N, self.D, self.tile, self.p_pre, self.warps = N, D, tile, p_pre, warps

    def consumer_state(self, qk_mma, pv_mma, tidx):
        """(Traced.) MMA slices, the static per-element coordinates of thread 0 (``cS0``, ``cO0``)
        and of this thread (``cS``), so that register indices stay compile-time while rows and
        columns are exact; the S^T and O^T accumulators (O zeroed); running max (-inf) and sum (0)
        per column slot."""
        thr_qk = qk_mma.get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        cS0 = qk_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.tile, self.N)))
        cS = thr_qk.partition_C(cute.make_identity_tensor((self.tile, self.N)))
        cO0 = pv_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.D, self.N)))
        acc_s = cute.make_rmem_tensor(cS.shape, Float32)
        acc_o = cute.make_rmem_tensor(cO0.shape, Float32)
        acc_o.fill(0.0)
        row_max = cute.make_rmem_tensor((self.N // 4,), Float32)
        row_sum = cute.make_rmem_tensor((self.N // 4,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return thr_qk, thr_pv, cS0, cS, cO0, acc_s, acc_o, row_max, row_sum

    @cute.jit
    def publish_slot_reduction(self, vals, sRed, n_base, warp, lane, combine):
        """Reduce this thread's per-slot values ``vals`` (in place) over the 8 quads of its warp
        with ``combine`` (butterfly shuffles), publish each warp's result to ``sRed[warp, column]``
        and wait for the warpgroup: the caller then combines ``sRed[0..3, column]``. Used by the
        softmax's row maxima and the epilogues' row sums."""
        nslots = self.N // 4
        for s in cutlass.range_constexpr(nslots):
            v = vals[s]
            for off in (4, 8, 16):
                v = combine(v, cute.arch.shuffle_sync_bfly(v, off))
            vals[s] = v
        if lane < 4:
            for s in cutlass.range_constexpr(nslots):
                sRed[warp, slot_column(s, n_base)] = vals[s]
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)

    @cute.jit
    def softmax_tile(self, acc_s, acc_o, tile_max, row_max, row_sum, sRed, sP, cS0, cO0, n_base, m_base, warp, lane):
        """One online-softmax step. In: ``acc_s`` the tile's scaled, masked logits (log2 units)
        and ``tile_max`` this thread's per-slot maxima. Reduces the maxima over the warpgroup
        (shuffles, then ``sRed`` across warps), rescales ``row_sum`` and ``acc_o`` by
        ``exp2(old max - new max)``, and writes ``P = exp2(s - max)`` (times ``2^p_pre``) to
        ``sP`` for the PV WGMMA; ends with the fence and barrier that publish sP."""
        nslots = self.N // 4
        self.publish_slot_reduction(tile_max, sRed, n_base, warp, lane, cute.arch.fmax)
        alpha = cute.make_rmem_tensor((nslots,), Float32)
        for s in cutlass.range_constexpr(nslots):
            n = slot_column(s, n_base)
            t_max = cute.arch.fmax(cute.arch.fmax(sRed[0, n], sRed[1, n]), cute.arch.fmax(sRed[2, n], sRed[3, n]))
            new_max = cute.arch.fmax(row_max[s], t_max)
            safe = new_max if new_max != -Float32.inf else Float32(0.0)
            alpha[s] = cute.math.exp2(row_max[s] - safe, fastmath=True)
            row_max[s] = new_max
            row_sum[s] = row_sum[s] * alpha[s]
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            sl = slot_of(cS0[i][1])
            safe = row_max[sl] if row_max[sl] != -Float32.inf else Float32(0.0)
            p = cute.math.exp2(acc_s[i] - safe, fastmath=True)
            row_sum[sl] = row_sum[sl] + p
            if const_expr(self.p_pre):
                p = p * Float32(2.0 ** self.p_pre)
            sP[cS0[i][1] + n_base, cS0[i][0] + m_base, 0] = p.to(sP.element_type)
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] * alpha[slot_of(cO0[i][1])]
        cute.arch.fence_proxy("async.shared", space="cta")  # sP is read by WGMMA
        # also: every warp read sRed for this tile before the next tile overwrites it
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)


class QuadSoftmax:
    """The query-on-M consumer's masked online softmax: a thread holds two query rows (halves
    ``h``), each row's ``tile`` logits spread over one quad; ``words`` 32-token membership words
    per row mask the logits. The state is a bundle ``cs`` (``acc_s``, ``mw``, ``cS0``, ``c``,
    ``row_max``, ``row_sum``, ``acc_o``, ``cO0``)."""

    def __init__(self, words: int):
        self.words = words

    @cute.jit
    def softmax_tile(self, cs):
        """Masked online softmax of one tile in place: ``cs.acc_s`` becomes P, the running max and
        sum move on. Returns (alpha per row half, whether a max grew: O needs rescaling)."""
        words = self.words
        acc_s, mw, cS0, c, row_max, row_sum = cs.acc_s, cs.mw, cs.cS0, cs.c, cs.row_max, cs.row_sum
        tile_max = cute.make_rmem_tensor((2,), Float32)
        tile_max.fill(-Float32.inf)
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            m_s, n_s = cS0[e]
            h = m_s // 8
            v = acc_s[e] * c
            if (mw[h * words + n_s // 32] >> (n_s % 32)) & 1 == 0:
                v = -Float32.inf
            acc_s[e] = v
            tile_max[h] = cute.arch.fmax(tile_max[h], v)
        alpha = cute.make_rmem_tensor((2,), Float32)
        safe = cute.make_rmem_tensor((2,), Float32)
        grew = False
        for h in cutlass.range_constexpr(2):
            t = tile_max[h]
            for off in (1, 2):  # a query's columns live in one quad
                t = cute.arch.fmax(t, cute.arch.shuffle_sync_bfly(t, off))
            new_max = cute.arch.fmax(row_max[h], t)
            safe[h] = new_max if new_max != -Float32.inf else Float32(0.0)
            alpha[h] = cute.math.exp2(row_max[h] - safe[h], fastmath=True)
            grew = grew or new_max > row_max[h]
            row_max[h] = new_max
            row_sum[h] = row_sum[h] * alpha[h]
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            h = cS0[e][0] // 8
            p = cute.math.exp2(acc_s[e] - safe[h], fastmath=True)
            row_sum[h] = row_sum[h] + p
            acc_s[e] = p
        return alpha, grew

    @cute.jit
    def rescale(self, cs, alpha):
        """O rows times their ``alpha`` (after a running max grew)."""
        for e in cutlass.range_constexpr(cute.size(cs.acc_o)):
            cs.acc_o[e] = cs.acc_o[e] * alpha[cs.cO0[e][0] // 8]
