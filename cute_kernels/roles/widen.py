"""FP8 -> 16-bit widening of the K/V register fragments of the swap-AB consumer (device role).

WGMMA has no 16-bit x e4m3 form, so FP8 K and V tiles are read from shared memory with
``ldmatrix`` (V with ``.trans``) and widened exactly in registers to the A operands of RS
WGMMAs: QK keeps 16-bit precision and no 16-bit copy of a tile is ever written to shared memory.
Two widenings (:mod:`.fragments`): ``"bits"`` (integer ops, the query's type, values scaled by a
power of two) and ``"cvt"`` (the exact ``cvt.rn.f16x2.e4m3x2``, fp16). The byte pairing of both
puts the even head dim of a pair on logical row r and the odd one on r + 8, which
:meth:`Fp8Fragments.physical_d` undoes for the output. Design: docs/design/sm90-decode.md#fp8-widening-hardware-conversion.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .fragments import cvt_e4m3x4_f16, ldmatrix_x4, widen_e4m3x4


class Fp8Fragments:
    """K and V fragment loaders of a ``tile`` x ``D`` FP8 tile for a warpgroup whose warps own 16
    rows of each ``mma_m``-token M block. ``fp8`` False: 16-bit caches (only :meth:`physical_d`,
    the identity, is used); ``cvt``: the exact hardware conversion to fp16, else the bit widening
    to ``q_dtype`` (``"bf16"``/``"fp16"``)."""

    def __init__(self, D: int, tile: int, fp8: bool, cvt: bool, q_dtype: str, mma_m: int):
        self.D, self.tile, self.fp8, self.cvt, self.q_dtype, self.mma_m = D, tile, fp8, cvt, q_dtype, mma_m

    @cute.jit
    def physical_d(self, m_static, m_thread):
        """Head-dim index of logical O^T row ``m`` (identity for 16-bit caches). For FP8, the
        V^T fragments put the even d of a byte pair on logical row r and the odd on r + 8."""
        if const_expr(self.fp8):
            m = m_static + m_thread
            r16 = m % 16
            return (m - r16) + (r16 % 8) * 2 + r16 // 8
        else:
            return m_static + m_thread

    @cute.jit
    def widen(self, x, transposed: bool):
        if const_expr(self.cvt):
            return cvt_e4m3x4_f16(x, transposed)
        return widen_e4m3x4(x, self.q_dtype)

    @cute.jit
    def load_k_fragments(self, tSrK, k_base, k_layout, stage, warp, lane):
        """K tile (FP8, tokens x D) -> widened A fragments of S^T = K Q^T, two k16 blocks per
        ldmatrix.x4: matrices (rows 0-7 | 8-15) x (chunk c | c+1) of this warp's 16 tokens of
        each 64-token M block."""
        q = lane // 8
        mblocks = self.tile // self.mma_m
        regs = cute.recast_tensor(tSrK, Int32)  # index (kb * mblocks + mb) * 4 + R
        for mb in cutlass.range_constexpr(mblocks):
            row = mb * self.mma_m + warp * 16 + (q % 2) * 8 + lane % 8
            for cc in cutlass.range_constexpr(self.D // 32):
                col = (2 * cc + q // 2) * 16
                addr = k_base + cute.crd2idx((row, col, stage), k_layout)
                r = ldmatrix_x4(addr, False)
                for j in cutlass.range_constexpr(4):
                    lo, hi = self.widen(r[j], False)
                    base = ((2 * cc + j // 2) * mblocks + mb) * 4
                    # register j: rows (r | r+8) = j % 2; lo -> (2t, 2t+1) = R0/R1, hi -> (2t+8, 2t+9) = R2/R3
                    regs[base + (j % 2)] = lo
                    regs[base + 2 + (j % 2)] = hi

    @cute.jit
    def load_v_fragments(self, tOrV, v_base, v_layout, stage, warp, lane):
        """V tile (FP8, tokens x D) -> widened A fragments of O^T = V^T P^T. ldmatrix.trans of
        8 tokens x 8 byte-pairs gives lane (pair p, tokens 2t, 2t+1): widening puts d = 2p on
        logical row r (lo) and d = 2p + 1 on row r + 8 (hi); see :meth:`physical_d`."""
        q = lane // 8
        regs = cute.recast_tensor(tOrV, Int32)  # index: (m_tile * 4 + kb) * 4 + R
        m_tiles = self.D // 64
        for mt in cutlass.range_constexpr(m_tiles):
            col = (mt * 4 + warp) * 16  # this warp's 16 head dims of the m-tile
            for kk in cutlass.range_constexpr(self.tile // 32):
                row = kk * 32 + q * 8 + lane % 8
                addr = v_base + cute.crd2idx((row, col, stage), v_layout)
                r = ldmatrix_x4(addr, True)
                for j in cutlass.range_constexpr(4):
                    lo, hi = self.widen(r[j], True)
                    kb = 2 * kk + j // 2
                    base = (kb * m_tiles + mt) * 4
                    regs[base + 2 * (j % 2)] = lo
                    regs[base + 2 * (j % 2) + 1] = hi

    @cute.jit
    def zero_v_fragment_tail(self, tOrV, valid, lane):
        """FP8 via cvt: stale bytes past the sequence end may be e4m3 NaN codes, which the exact
        conversion keeps as NaN (P = 0 would not cancel them). Zero the widened V^T values of
        tokens >= valid; a register holds tokens (2t, 2t + 1) of one head dim."""
        regs = cute.recast_tensor(tOrV, Int32)
        m_tiles = self.D // 64
        t2 = (lane % 4) * 2
        for kb in cutlass.range_constexpr(self.tile // 16):
            for half in cutlass.range_constexpr(2):
                tok = kb * 16 + half * 8 + t2
                keep_lo = Int32(0xFFFF) if tok < valid else Int32(0)
                keep_hi = Int32(-65536) if tok + 1 < valid else Int32(0)  # 0xFFFF0000
                keep = keep_lo | keep_hi
                for mt in cutlass.range_constexpr(m_tiles):
                    base = (kb * m_tiles + mt) * 4 + 2 * half
                    regs[base] = regs[base] & keep
                    regs[base + 1] = regs[base + 1] & keep
