"""Converter warpgroup (SM100): FP8 K/V chunks in shared memory -> exact fp16 -> tensor memory.

The tcgen05 kind::f16 MMA can read its A operand from TMEM. A 16-bit query against an FP8 cache
therefore never needs a 16-bit copy of K or V in shared memory: four converter warps ``ldmatrix``
each FP8 chunk the TMA landed (V transposed, so that TMEM lane = row of D), widen it exactly
(``cvt.rn.f16x2.e4m3x2``: every e4m3 value is an fp16 value), and ``tcgen05.st`` it into a ring
of TMEM stages that the MMA warp consumes in the same order: the K chunks of tile i + 1, then the
V chunks of tile i. The copies are derived from the TMEM store's thread layout
(``make_tiled_copy_S``), as in CUTLASS's mixed-input FMHA decode. Cache rows past the sequence
end (stale, possibly NaN) are zeroed in V, since the PV MMA would turn 0 x NaN into NaN.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import tcgen05, warp

KV_TILE = 128


class ConvertRole:
    def __init__(self, kernel):
        self.kernel = kernel
        self.cfg = kernel.cfg
        self.chunk = kernel.chunk
        self.kv_dtype = kernel.kv_dtype
        self.mma_dtype = kernel.mma_dtype

    def copies(self, mma, tCtX, sX, transpose: bool, wtidx):
        """(Traced.) ldmatrix from the staged chunk and tcgen05.st into the TMEM stages, both
        partitioned for thread ``wtidx`` of the warpgroup, plus the (row, k) coordinate of each
        register (the token is k for V^T)."""
        bits = self.chunk * self.mma_dtype.width
        st_atom = cute.make_copy_atom(tcgen05.St16x256bOp(tcgen05.Repetition(bits // 256)), self.mma_dtype)
        tmem_store = tcgen05.make_tmem_copy(st_atom, tCtX[None, None, None, 0])
        thr_st = tmem_store.get_slice(wtidx)
        if transpose:
            ld_op = warp.LdMatrix16x16x8bOp(transpose=True, num_matrices=2)
        else:
            ld_op = warp.LdMatrix8x16x8bOp(num_matrices=4)
        smem_load = cute.make_tiled_copy_S(cute.make_copy_atom(ld_op, self.kv_dtype), tmem_store)
        thr_ld = smem_load.get_slice(wtidx)
        tXsX = thr_ld.partition_S(sX)
        r8_shape = thr_ld.partition_D(sX).shape[:-1]
        tXtX = thr_st.partition_D(tCtX)
        r16_shape = thr_st.partition_S(tCtX).shape[:-1]
        thr_mma = mma.get_slice(0)
        coords = thr_ld.partition_S(thr_mma.partition_A(cute.make_identity_tensor((KV_TILE, self.chunk))))
        return thr_ld, thr_st, tXsX, tXtX, r8_shape, r16_shape, coords

    @cute.jit
    def run(self, sK, sV, tCtC, pipe_k, pipe_v, pipe_c, kv_end, first, step, count):
        cfg = self.cfg
        wtidx = cute.arch.thread_idx()[0] % 128
        qk, pv = self.kernel.mmas()
        tCtK = tCtC
        tCtV = cute.make_tensor(tCtC.iterator, pv.get_slice(0).make_fragment_A(
            pv.partition_shape_A((KV_TILE, self.chunk, cfg.cvt_stages))).layout)
        k_copies = self.copies(qk, tCtK, sK, False, wtidx)
        v_copies = self.copies(pv, tCtV, sV, True, wtidx)
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        state_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.cvt_stages)
        for it in cutlass.range(count + 1, unroll=1):
            if it < count:
                for _ in cutlass.range_constexpr(cfg.k_chunks):
                    self.convert(k_copies, pipe_k, state_k, pipe_c, state_c, KV_TILE)
                    state_k.advance()
                    state_c.advance()
            if it > 0:
                valid = kv_end - (first + (it - 1) * step) * KV_TILE  # tokens of the tile before the end
                for _ in cutlass.range_constexpr(cfg.m_blocks):
                    for kt in cutlass.range_constexpr(KV_TILE // self.chunk):
                        self.convert(v_copies, pipe_v, state_v, pipe_c, state_c, valid - kt * self.chunk)
                        state_v.advance()
                        state_c.advance()

    @cute.jit
    def convert(self, copies, pipe_in, state_in, pipe_c, state_c, valid):
        """One chunk: wait for its TMA, ldmatrix, free the stage, widen (zeroing tokens >=
        ``valid``), wait for a free TMEM stage, tcgen05.st, hand it to the MMA."""
        thr_ld, thr_st, tXsX, tXtX, r8_shape, r16_shape, coords = copies
        pipe_in.consumer_wait(state_in)
        r8 = cute.make_rmem_tensor(r8_shape, self.kv_dtype)
        cute.copy(thr_ld, tXsX[None, None, None, None, state_in.index], r8)
        cute.arch.fence_view_async_shared()  # the reads are done before TMA may overwrite the stage
        pipe_in.consumer_release(state_in)
        r16 = cute.make_rmem_tensor(r16_shape, self.mma_dtype)
        r16.store(r8.load().to(self.mma_dtype).reshape(r16_shape))
        if valid < self.chunk:
            for i in cutlass.range_constexpr(cute.size(r16)):
                if coords[i][1] >= valid:
                    r16[i] = self.mma_dtype(0.0)
        pipe_c.producer_acquire(state_c)
        cute.copy(thr_st, r16, tXtX[None, None, None, None, state_c.index])
        cute.arch.fence_view_async_tmem_store()
        pipe_c.producer_commit(state_c)
