"""Q staging of the SM90 attention consumers (device role): the query rows of one KV group into
shared memory, as the WGMMA operand, with the FP8 paths' scaling.

Row ``n`` of the staged tile is head ``n % G`` of query token ``n // G`` of the CTA's tokens;
padding rows are zeros. For an FP8 cache the widened K fragments see their columns permuted
within 16-column blocks, so Q is staged with the same permutation (``q_permuted``) and scaled by
a power of two: fixed (``q_pre``, the bit widening's range guard) or, for a BF16 query feeding
fp16 MMAs (``dynamic_q_scale``), ``2^(14 - e)`` with ``e`` the exponent of the tile's max |q|, so
that nothing overflows fp16 and the scale is exact. Design: docs/design/sm90-decode.md#fp8-widening-hardware-conversion.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .fragments import q_permutation
from .softmax import BAR_MMA


class QueryStager:
    """Stages ``rows = G x tokens`` query rows (``N`` rows with padding) of head dim ``D`` with a
    warpgroup of ``warps`` warps. ``tokens``: query tokens of one CTA (consecutive rows of ``mQ``
    from ``cta_index * tokens``); ``bounded``: those tokens may run past the end of ``mQ`` (a
    partial row tile), so each is checked. ``widen``: the FP8 widening whose column order Q takes
    (with ``q_permuted``)."""

    def __init__(self, D: int, N: int, G: int, tokens: int, *, bounded: bool, dynamic_q_scale: bool, q_pre: int,
                 q_permuted: bool, widen: str, warps: int):
        self.D, self.N, self.G, self.tokens = D, N, G, tokens
        self.rows = G * tokens
        self.dynamic_q_scale, self.q_pre, self.q_permuted, self.widen = dynamic_q_scale, q_pre, q_permuted, widen
        self.warps = warps
        self.load_q_chunk = self.load_q_chunk_bounded if bounded else self.load_q_chunk_group

    @cute.jit
    def load_q_chunk_group(self, mQ, idx, batch_idx, kv_head, work):
        """16 consecutive Q elements (row n, 16-column chunk c) of work item ``idx`` as fp32;
        zeros for padding rows and for ``idx >= work``."""
        chunks = self.D // 16
        n = idx // chunks
        vals = cute.make_rmem_tensor((16,), Float32)
        vals.fill(0.0)
        if n < self.rows and idx < work:
            token = batch_idx * self.tokens + n // self.G
            head = kv_head * self.G + n % self.G
            vals.store(cute.local_tile(mQ[token, head, None], (16,), (idx % chunks,)).load().to(Float32))
        return vals

    @cute.jit
    def load_q_chunk_bounded(self, mQ, idx, batch_idx, kv_head, work):
        """16 consecutive Q elements (column n, 16-element chunk c) of work item ``idx`` as fp32;
        zeros for padding columns, rows past the last (a partial row tile) and ``idx >= work``."""
        chunks = self.D // 16
        n = idx // chunks
        vals = cute.make_rmem_tensor((16,), Float32)
        vals.fill(0.0)
        token = batch_idx * self.tokens + n // self.G
        if n < self.rows and idx < work and token < mQ.shape[0]:
            head = kv_head * self.G + n % self.G
            vals.store(cute.local_tile(mQ[token, head, None], (16,), (idx % chunks,)).load().to(Float32))
        return vals

    @cute.jit
    def stage_q(self, mQ, sQ, sRed, batch_idx, kv_head, tidx, warp, lane):
        """Q rows of this KV group -> sQ, zero padding rows; FP8 caches: columns permuted within
        16-column blocks to match the widened K fragments, values pre-scaled by a power of two.
        Returns log2 of that scale (the logits divide it out)."""
        D, N = self.D, self.N
        chunks = D // 16
        work = N * chunks
        iters = (work + self.warps * 32 - 1) // (self.warps * 32)
        q_log2 = Float32(self.q_pre)
        # Q stays in registers between the max and the store when it is small (the usual case:
        # one 16-element chunk per thread); larger groups are simply loaded twice.
        keep = iters <= 2
        held = []
        if const_expr(self.dynamic_q_scale):
            # BF16 -> FP16: scale by 2^(14 - e), e = exponent of max|q|, so that the largest
            # element lands near [2^14, 2^15) and nothing overflows fp16; the scale is exact.
            amax = Float32(0.0)
            for it in cutlass.range_constexpr(iters):
                idx = it * self.warps * 32 + tidx
                vals = self.load_q_chunk(mQ, idx, batch_idx, kv_head, work)
                if const_expr(keep):
                    held.append(vals)
                for k in cutlass.range_constexpr(16):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(vals[k], -vals[k]))
            for off in (1, 2, 4, 8, 16):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, off))
            if lane == 0:
                sRed[warp, 0] = amax
            cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)
            amax = cute.arch.fmax(cute.arch.fmax(sRed[0, 0], sRed[1, 0]), cute.arch.fmax(sRed[2, 0], sRed[3, 0]))
            cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)  # sRed reused later
            # e within 1 of floor(log2 amax) (truncation, approximate log2): fp16's range
            # (max 2^16) leaves room for that
            e = Int32(0)
            if amax > Float32(0.0):
                e = Int32(cute.math.log2(amax, fastmath=True))
            q_log2 = Float32(cutlass.min(cutlass.max(Int32(14) - e, Int32(-100)), Int32(100)))
        scale = cute.math.exp2(q_log2, fastmath=False)
        for it in cutlass.range_constexpr(iters):
            idx = it * self.warps * 32 + tidx
            vals = held[it] if const_expr(keep and self.dynamic_q_scale) else self.load_q_chunk(
                mQ, idx, batch_idx, kv_head, work)
            if idx < work:
                n = idx // chunks
                c = idx % chunks
                for k in cutlass.range_constexpr(16):
                    src = q_permutation(k, self.widen) if const_expr(self.q_permuted) else k
                    sQ[n, c * 16 + k, 0] = (vals[src] * scale).to(sQ.element_type)
        return q_log2
