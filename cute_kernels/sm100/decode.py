"""SM100 / SM103 paged decode: tcgen05 MMAs accumulating in tensor memory, K/V page boxes by TMA.

Swap-AB, as trtllm-gen's generation kernels: 128 KV tokens are the MMA's M and the KV group's
query rows (heads x draft tokens, ``n`` padded to 16 or 32) its N, so ``S^T[128, n] = K Q^T`` and
``O^T[D, n] += V^T P^T`` run as 128-row tcgen05.mma instructions with both accumulators in TMEM.
One CTA per (split, KV head x row tile, request); warp roles (docs/design/sm100.md#decode):

- warps 0-3, softmax: stage Q, then per tile read S^T from TMEM (thread t = token t), mask
  (causal draft, window), column maxima across the warpgroup, P = 2^(s - m) into shared memory
  (the PV MMA's B operand), row sums; rescale O in TMEM when a maximum grows by more than
  ``RESCALE_LOG2`` (rarely after the first tiles); the epilogue (sinks, LSE, output / partial).
- warp 4, MMA: QK(i + 1) is issued before PV(i), so the softmax of a tile overlaps the MMAs of
  its neighbours (two S^T buffers in TMEM).
- warp 5, TMA: K and V chunks (128 rows x 128 bytes) in two rings, one TMA box per page.
- warps 8-11 (``cvt`` mode only), converter: FP8 K/V chunks from shared memory -> exact fp16 ->
  tensor memory, where they are the MMAs' A operands (CUTLASS's mixed-input decode pattern).

Modes (:attr:`Sm100DecodeConfig.mode`): ``f16`` 16-bit cache, kind::f16 from shared memory;
``f8`` FP8 query and cache, kind::f8f6f4 (P quantized to e4m3); ``cvt`` FP8 cache with a 16-bit
query, widened exactly to fp16 (a bf16 query is rescaled by a power of two into fp16's range).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from ..jit.spec import bind_arguments
from ..roles.attn_window import box_visible, decode_key_range, key_visible, split_tiles
from ..roles.prefill_blocks import kv_cap
from ..roles.sinks import LOG2E, fold_sink
from .kit import (
    check_smem,
    config_dtypes,
    fresh_warp_index,
    last_mode,
    logical_view,
    scalar,
    set_registers,
    tmem_base,
)
from .tmem_convert import ConvertRole

KV_TILE = 128
RESCALE_LOG2 = 8.0  # P <= 2^8 between rescales: exact in bf16/fp16 range, < 448 for e4m3
SOFTMAX_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
TMA_WARP = 5
CVT_WARP0 = 8
BAR_Q = 1  # named barriers (0 is __syncthreads): Q staged (softmax WG + MMA warp)
BAR_SOFTMAX = 2  # the softmax warpgroup's column-max and row-sum exchange
FP16_Q_TARGET_LOG2 = 14  # a bf16 query for fp16 MMAs: max |q| scaled into [2^14, 2^15)


class Sm100PagedDecode:
    """Kernel object; all fields are compile-time (see :class:`~cute_kernels.plans.sm100.Sm100DecodeConfig`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.arg_names = cfg.arg_names()
        self.q_dtype, self.kv_dtype, self.mma_dtype, self.out_dtype = config_dtypes(cfg)
        self.cvt = cfg.mode == "cvt"
        self.D, self.N = cfg.head_dim, cfg.n
        self.G, self.q_len = cfg.group, cfg.q_len
        self.rows, self.row_tile = cfg.rows, cfg.row_tile
        self.page = cfg.page_size
        self.chunk = cfg.chunk
        self.kb = cfg.chunk // cfg.mma_k  # MMA instructions per chunk
        self.box_v = min(cfg.page_size, cfg.chunk)  # tokens per V box (K boxes are whole pages)
        self.stages = cfg.stages
        self.regs = cfg.registers
        self.threads = cfg.threads
        # the query's scale for fp16 MMAs (a bf16 query is rescaled per CTA by a power of two)
        self.dynamic_q_scale = self.cvt and cfg.q_dtype == "bf16"

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------

    def mmas(self):
        """QK (A = K tile, token rows; B = Q, K-major) and PV (A = V^T, B = P^T, MN-major) tiled
        MMAs, M = 128, N = n; in ``cvt`` mode both A operands come from tensor memory."""
        src = tcgen05.OperandSource.TMEM if self.cvt else tcgen05.OperandSource.SMEM
        qk = sm100_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            tcgen05.CtaGroup.ONE, (KV_TILE, self.N), src)
        pv = sm100_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, OperandMajorMode.K if self.cvt else OperandMajorMode.MN,
            OperandMajorMode.MN, Float32, tcgen05.CtaGroup.ONE, (KV_TILE, self.N), src)
        return qk, pv

    def layouts(self, qk, pv):
        """Shared-memory layouts: K chunks (tokens x chunk of D, K-major), V^T chunks (128 rows of
        D x chunk of tokens, D contiguous), Q (n x D) and P^T (128 tokens x n, n contiguous)."""
        k_layout = sm100_utils.make_smem_layout_a(qk, (KV_TILE, self.N, self.chunk), self.kv_dtype, self.stages,
                                                  is_k_major=True)
        v_layout = sm100_utils.make_smem_layout_a(pv, (KV_TILE, self.N, self.chunk), self.kv_dtype, self.stages,
                                                  is_k_major=False)
        q_layout = sm100_utils.make_smem_layout_b(qk, (KV_TILE, self.N, self.D), self.mma_dtype, 1)
        p_layout = sm100_utils.make_smem_layout_b(pv, (KV_TILE, self.N, KV_TILE), self.mma_dtype, 1)
        return k_layout, v_layout, q_layout, p_layout

    @cute.jit
    def __call__(self, *args):
        """The config's arguments in signature order (a variant takes only the ones it uses), then
        the stream; :meth:`launch` receives them by name."""
        self.launch(**bind_arguments(self.arg_names, args))

    @cute.jit
    def launch(self, q, block_table, seq_lens, k_scale, v_scale, sm_scale: Float32, window_left: Int32, stream,
               kv_cache=None, k_cache=None, v_cache=None, out=None, lse=None, part_out=None, part_lse=None,
               q_scale=None, sinks=None):
        """Arguments by their signature names (plans/sm100.py); absent ones are None."""
        cfg = self.cfg
        mQ, mBlockTable, mSeqLens, mSinks = q, block_table, seq_lens, sinks
        mO, mLse = (part_out, part_lse) if const_expr(cfg.split) else (out, lse)
        if const_expr(cfg.kv_form == "single"):
            mK4 = kv_cache[None, 0, None, None, None]
            mV4 = kv_cache[None, 1, None, None, None]
        else:
            mK4, mV4 = k_cache, v_cache
        tok, head = (2, 1) if const_expr(cfg.kv_layout == "HND") else (1, 2)
        mK = cute.make_tensor(mK4.iterator, cute.select(mK4.layout, mode=[tok, 3, head, 0]))  # (tok, d, h, page)
        mVt = cute.make_tensor(mV4.iterator, cute.select(mV4.layout, mode=[3, tok, head, 0]))  # (d, tok, h, page)

        qk, pv = self.mmas()
        k_layout, v_layout, q_layout, p_layout = self.layouts(qk, pv)
        # one TMA box: a page of K (page x chunk), or box_v tokens of V^T (128 rows of D x box_v)
        k_box = cute.select(logical_view(k_layout, KV_TILE, self.chunk), mode=[0, 1])
        k_box = cute.composition(k_box, cute.make_layout((self.page, self.chunk), stride=(1, KV_TILE)))
        v_box = cute.select(logical_view(v_layout, KV_TILE, self.chunk), mode=[0, 1])
        v_box = cute.composition(v_box, cute.make_layout((KV_TILE, self.box_v)))
        tma_k, tma_tK = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mK, k_box,
                                                    (self.page, self.chunk))
        tma_v, tma_tV = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mVt, v_box,
                                                    (KV_TILE, self.box_v))

        @cute.struct
        class Storage:
            k_bar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            v_bar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            s_bar: cute.struct.MemRange[cutlass.Int64, 4]
            cvt_bar: cute.struct.MemRange[cutlass.Int64, 2 * max(1, cfg.cvt_stages)]
            p_full: cute.struct.MemRange[cutlass.Int64, 1]
            o_done: cute.struct.MemRange[cutlass.Int64, 1]
            tmem_ptr: cute.struct.MemRange[Int32, 4]
            red_max: cute.struct.MemRange[Float32, 2 * 4 * cfg.n]
            red_sum: cute.struct.MemRange[Float32, 4 * cfg.n]
            sK: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, cute.cosize(k_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, cute.cosize(v_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, cute.cosize(q_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, cute.cosize(p_layout)], 1024]

        self.storage = Storage
        check_smem(Storage.size_in_bytes(), cfg)
        num_kv_heads = mK4.shape[head]
        batch = mBlockTable.shape[0]
        num_splits = mO.shape[0] if const_expr(cfg.split) else 1
        self.kernel(
            mQ, tma_k, tma_tK, tma_v, tma_tV, mK4.shape[0], mBlockTable, mSeqLens, mO, mLse, k_scale, v_scale,
            q_scale, mSinks, sm_scale, window_left, qk, pv, k_layout, v_layout, q_layout, p_layout,
        ).launch(grid=[num_splits, num_kv_heads * cfg.row_tiles, batch], block=[self.threads, 1, 1],
                 stream=stream, min_blocks_per_mp=1, use_pdl=cfg.pdl)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, mQ, tma_k, mK, tma_v, mVt, num_pages: Int32, mBlockTable, mSeqLens, mO, mLse, k_scale,
               v_scale, q_scale, mSinks, sm_scale: Float32, window_left: Int32, qk: cute.TiledMma,
               pv: cute.TiledMma, k_layout, v_layout, q_layout, p_layout):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        split, hq_tile, b = cute.arch.block_idx()
        num_splits = cute.arch.grid_dim()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        kv_head = hq_tile // cfg.row_tiles
        row0 = (hq_tile % cfg.row_tiles) * self.row_tile

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)

        if warp == TMA_WARP:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        if warp == MMA_WARP:
            cute.arch.alloc_tmem(cfg.tmem_cols, storage.tmem_ptr.data_ptr())

        chunk_tx = cfg.chunk_bytes
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        softmax_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
        if const_expr(self.cvt):
            # TMA -> converter warps (threads), then converter -> MMA through tensor memory
            pipe_k = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.k_bar.data_ptr(), num_stages=cfg.stages, producer_group=one,
                consumer_group=softmax_group, tx_count=chunk_tx, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True)
            pipe_v = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.v_bar.data_ptr(), num_stages=cfg.stages, producer_group=one,
                consumer_group=softmax_group, tx_count=chunk_tx, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True)
            pipe_c = pipeline.PipelineAsyncUmma.create(
                barrier_storage=storage.cvt_bar.data_ptr(), num_stages=cfg.cvt_stages, producer_group=softmax_group,
                consumer_group=one, defer_sync=True)
        else:
            pipe_k = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.k_bar.data_ptr(), num_stages=cfg.stages, producer_group=one,
                consumer_group=one, tx_count=chunk_tx, defer_sync=True)
            pipe_v = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.v_bar.data_ptr(), num_stages=cfg.stages, producer_group=one,
                consumer_group=one, tx_count=chunk_tx, defer_sync=True)
            pipe_c = None
        pipe_s = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.s_bar.data_ptr(), num_stages=2, producer_group=one,
            consumer_group=softmax_group, defer_sync=True)
        p_full = storage.p_full.data_ptr()
        o_done = storage.o_done.data_ptr()
        if warp == MMA_WARP:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(p_full, 128)  # every softmax thread arrives after its P row
                cute.arch.mbarrier_init(o_done, 1)  # tcgen05.commit after each tile's PV MMAs
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_wait()  # from here on we read the previous kernel's outputs

        # Each role derives its own schedule after setmaxnreg: a value live across the register
        # reconfiguration is spilled by ptxas (docs/design/sm100.md#registers).
        tmem_holder = storage.tmem_ptr.data_ptr()
        if warp < 4:
            set_registers(self.regs, "softmax")
            seq_len, lo, hi, first, step, count = self.schedule(mSeqLens, mBlockTable, b, split, num_splits,
                                                                window_left)
            tCtS, tCtO, tCtC = self.tmem_tensors(qk, pv, tmem_holder)
            self.softmax(mQ, sQ, sP, sV, storage, tCtS, tCtO, pipe_s, pipe_v, p_full, o_done, qk, mO, mLse, mSinks,
                         k_scale, v_scale, q_scale, sm_scale, window_left, seq_len, lo, hi, first, step, count,
                         split, b, kv_head, row0)
            cute.arch.sync_threads()  # (every role ends in this barrier: then TMEM is free)
        elif warp < 8:
            set_registers(self.regs, "mma_tma")
            seq_len, lo, hi, first, step, count = self.schedule(mSeqLens, mBlockTable, b, split, num_splits,
                                                                window_left)
            w = fresh_warp_index()
            if w == MMA_WARP:
                tCtS, tCtO, tCtC = self.tmem_tensors(qk, pv, tmem_holder)
                self.mma(sK, sV, sQ, sP, tCtS, tCtO, tCtC, pipe_k, pipe_v, pipe_c, pipe_s, p_full, o_done,
                         count)
            elif w == TMA_WARP:
                self.produce(tma_k, mK, tma_v, mVt, sK, sV, pipe_k, pipe_v, mBlockTable, num_pages, b, kv_head,
                             seq_len, lo, hi, first, step, count)
            cute.arch.sync_threads()
            if w == MMA_WARP:
                cute.arch.relinquish_tmem_alloc_permit()
                cute.arch.dealloc_tmem(tmem_base(tmem_holder), cfg.tmem_cols)
        elif const_expr(self.cvt):
            set_registers(self.regs, "convert")
            seq_len, lo, hi, first, step, count = self.schedule(mSeqLens, mBlockTable, b, split, num_splits,
                                                                window_left)
            tCtS, tCtO, tCtC = self.tmem_tensors(qk, pv, tmem_holder)
            ConvertRole(self).run(sK, sV, tCtC, pipe_k, pipe_v, pipe_c, hi, first, step, count)
            cute.arch.sync_threads()

    @cute.jit
    def schedule(self, mSeqLens, mBlockTable, b, split, num_splits, window_left):
        """The request's length, its visible keys ``[lo, hi)`` and this split's tiles. Positions at
        or past the block table's capacity are not attended: ``hi`` is the length clamped to it, so
        a huge (corrupted) length costs what a full table costs (docs/design/inputs.md#lengths)."""
        seq_len = mSeqLens[b]
        kv_end = kv_cap(seq_len, mBlockTable.shape[1], self.page, cutlass.min, cutlass.max)
        lo, hi = decode_key_range(seq_len, self.q_len, window_left, kv_end)
        first, step, count = split_tiles(lo, hi, KV_TILE, split, num_splits)
        return seq_len, lo, hi, first, step, count

    def tmem_tensors(self, qk, pv, holder):
        """(Traced.) S^T (2 stages), O^T (m_blocks x 128 rows), converted K/V chunks (``cvt``)."""
        cfg = self.cfg
        tmem = tmem_base(holder)
        thr_qk, thr_pv = qk.get_slice(0), pv.get_slice(0)
        tCtS = thr_qk.make_fragment_C(qk.partition_shape_C((KV_TILE, self.N, 2)))
        tCtS = cute.make_tensor(tmem, tCtS.layout)
        offset = cfg.s_cols
        tCtO = thr_pv.make_fragment_C(pv.partition_shape_C((KV_TILE, self.N, cfg.m_blocks)))
        tCtO = cute.make_tensor(tmem + offset, tCtO.layout)
        offset += cfg.o_cols
        tCtC = None
        if const_expr(self.cvt):
            tCtC = thr_qk.make_fragment_A(qk.partition_shape_A((KV_TILE, self.chunk, cfg.cvt_stages)))
            tCtC = cute.make_tensor(cute.recast_ptr(tmem + offset, dtype=self.mma_dtype), tCtC.layout)
        return tCtS, tCtO, tCtC

    # ------------------------------------------------------------------------------------------
    # TMA producer
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def produce(self, tma_k, mK, tma_v, mVt, sK, sV, pipe_k, pipe_v, mBlockTable, num_pages, b, kv_head, seq_len,
                lo, hi, first, step, count):
        """K chunks of tile i + 1 before the V chunks of tile i: the order the MMA consumes them.
        Lane j holds the page id of page j of the current tile (and of the previous one for V);
        a page outside ``[lo, hi)``, past the table or with an invalid id is an out-of-range
        coordinate: TMA fills zeros and reads nothing."""
        cfg = self.cfg
        lane = cute.arch.lane_idx()
        pages = KV_TILE // self.page
        gK = cute.local_tile(mK[None, None, kv_head, None], (self.page, self.chunk), (0, None, None))
        sK_boxes = cute.flat_divide(logical_view(sK.layout, KV_TILE, self.chunk), (self.page, self.chunk))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(
            cute.make_tensor(sK.iterator, sK_boxes), 0, 2), cute.group_modes(gK, 0, 2))
        gV = cute.local_tile(mVt[None, None, kv_head, None], (KV_TILE, self.box_v), (None, None, None))
        sV_boxes = cute.flat_divide(logical_view(sV.layout, KV_TILE, self.chunk), (KV_TILE, self.box_v))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(
            cute.make_tensor(sV.iterator, sV_boxes), 0, 2), cute.group_modes(gV, 0, 2))

        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        pid_prev = Int32(0)
        for it in cutlass.range(count + 1, unroll=1):
            tile = first + it * step
            pid = self.page_of(mBlockTable, num_pages, b, tile, lane, lo, hi)
            if it < count:
                for c in cutlass.range_constexpr(cfg.k_chunks):
                    pipe_k.producer_acquire(state_k)
                    for j in cutlass.range_constexpr(pages):
                        page_id = cute.arch.shuffle_sync(pid, j)
                        cute.copy(tma_k, tKgK[None, c, page_id], tKsK[None, j, 0, state_k.index],
                                  tma_bar_ptr=pipe_k.producer_get_barrier(state_k))
                    pipe_k.producer_commit(state_k)
                    state_k.advance()
            if it > 0:
                for mb in cutlass.range_constexpr(cfg.m_blocks):
                    for kt in cutlass.range_constexpr(KV_TILE // self.chunk):
                        pipe_v.producer_acquire(state_v)
                        for j in cutlass.range_constexpr(self.chunk // self.box_v):
                            tok = kt * self.chunk + j * self.box_v  # within the tile
                            page_id = cute.arch.shuffle_sync(pid_prev, tok // self.page)
                            sub = (tok % self.page) // self.box_v
                            cute.copy(tma_v, tVgV[None, mb, sub, page_id], tVsV[None, 0, j, state_v.index],
                                      tma_bar_ptr=pipe_v.producer_get_barrier(state_v))
                        pipe_v.producer_commit(state_v)
                        state_v.advance()
            pid_prev = pid

    @cute.jit
    def page_of(self, mBlockTable, num_pages, b, tile, lane, lo, hi):
        """Lane j: the TMA page coordinate of page j of ``tile`` (``num_pages``: zero-fill)."""
        pages = KV_TILE // self.page
        logical = tile * pages + lane
        start = logical * self.page
        page_id = Int32(num_pages)
        if lane < pages and logical < mBlockTable.shape[1]:
            raw = mBlockTable[b, logical]
            if raw >= 0 and raw < num_pages and box_visible(start, self.page, lo, hi):
                page_id = raw
        return page_id

    # ------------------------------------------------------------------------------------------
    # MMA warp
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def mma(self, sK, sV, sQ, sP, tCtS, tCtO, tCtC, pipe_k, pipe_v, pipe_c, pipe_s, p_full, o_done, count):
        cfg = self.cfg
        qk, pv = self.mmas()  # our own: the ACCUMULATE field set below makes them loop state
        thr_qk, thr_pv = qk.get_slice(0), pv.get_slice(0)
        tCrQ = thr_qk.make_fragment_B(sQ)
        tCrP = thr_pv.make_fragment_B(sP)
        if const_expr(self.cvt):
            tCrK = tCtC
            tCrV = cute.make_tensor(tCtC.iterator, thr_pv.make_fragment_A(
                pv.partition_shape_A((KV_TILE, self.chunk, cfg.cvt_stages))).layout)
            pipe_a_k, pipe_a_v = pipe_c, pipe_c
        else:
            tCrK = thr_qk.make_fragment_A(sK)
            tCrV = thr_pv.make_fragment_A(sV)
            pipe_a_k, pipe_a_v = pipe_k, pipe_v
        # in cvt mode K and V chunks share one TMEM ring, filled by the converter in this order
        stages_k = cfg.cvt_stages if const_expr(self.cvt) else cfg.stages
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages_k)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        state_s = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        pipeline.NamedBarrier(barrier_id=BAR_Q, num_threads=128 + 32).arrive_and_wait()  # Q is in sQ

        for it in cutlass.range(count + 1, unroll=1):
            if it < count:
                pipe_s.producer_acquire(state_s)
                tS = tCtS[None, None, None, state_s.index]
                for c in cutlass.range_constexpr(cfg.k_chunks):
                    pipe_a_k.consumer_wait(state_k)
                    for kb in cutlass.range_constexpr(self.kb):
                        qk.set(tcgen05.Field.ACCUMULATE, c != 0 or kb != 0)
                        cute.gemm(qk, tS, tCrK[None, None, kb, state_k.index], tCrQ[None, None, c * self.kb + kb, 0],
                                  tS)
                    pipe_a_k.consumer_release(state_k)
                    state_k.advance()
                pipe_s.producer_commit(state_s)
                state_s.advance()
            if it > 0:
                cute.arch.mbarrier_wait(p_full, (it - 1) % 2)
                if const_expr(self.cvt):
                    state_k = self.pv_tile(pv, tCrV, tCrP, tCtO, pipe_a_v, state_k, it)
                else:
                    state_v = self.pv_tile(pv, tCrV, tCrP, tCtO, pipe_a_v, state_v, it)
                with cute.arch.elect_one():
                    tcgen05.commit(o_done)  # O^T of this tile is complete (and P may be rewritten)

    @cute.jit
    def pv_tile(self, pv, tCrV, tCrP, tCtO, pipe_v, state_v, it):
        """O^T += V^T P^T over this tile's V chunks (the first tile overwrites O^T)."""
        for mb in cutlass.range_constexpr(self.cfg.m_blocks):
            tO = tCtO[None, None, None, mb]
            for kt in cutlass.range_constexpr(KV_TILE // self.chunk):
                pipe_v.consumer_wait(state_v)
                for kb in cutlass.range_constexpr(self.kb):
                    if const_expr(kt == 0 and kb == 0):
                        pv.set(tcgen05.Field.ACCUMULATE, it > 1)
                    else:
                        pv.set(tcgen05.Field.ACCUMULATE, True)
                    cute.gemm(pv, tO, tCrV[None, None, kb, state_v.index], tCrP[None, None, kt * self.kb + kb, 0], tO)
                pipe_v.consumer_release(state_v)
                state_v.advance()
        return state_v

    # ------------------------------------------------------------------------------------------
    # softmax warpgroup
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def stage_q(self, mQ, sQ, sRed, b, kv_head, row0, tidx, warp):
        """This CTA's query rows -> sQ (the QK MMA's B operand, n x D), zero padding rows. For
        fp16 MMAs on a bf16 query, scaled by 2^e so that max |q| lands in [2^14, 2^15); returns
        log2 of the scale (the logits divide it out)."""
        D, N = self.D, self.N
        vec = 8
        per_row = D // vec
        work = N * per_row
        iters = (work + 127) // 128
        sQ_nd = cute.composition(sQ, cute.make_layout((N, D), stride=(1, N)))
        q_log2 = Float32(0.0)
        if const_expr(self.dynamic_q_scale):
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(iters):
                vals = self.load_q(mQ, i * 128 + tidx, b, kv_head, row0, work)
                for k in cutlass.range_constexpr(vec):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(vals[k], -vals[k]))
            amax = cute.arch.warp_redux_sync(amax, kind="fmax")
            if cute.arch.lane_idx() == 0:
                sRed[warp] = amax
            pipeline.NamedBarrier(barrier_id=BAR_SOFTMAX, num_threads=128).arrive_and_wait()
            amax = cute.arch.fmax(cute.arch.fmax(sRed[0], sRed[1]), cute.arch.fmax(sRed[2], sRed[3]))
            pipeline.NamedBarrier(barrier_id=BAR_SOFTMAX, num_threads=128).arrive_and_wait()
            e = Int32(0)
            if amax > Float32(0.0):
                e = Int32(cute.math.log2(amax, fastmath=True))
            q_log2 = Float32(cutlass.min(cutlass.max(Int32(FP16_Q_TARGET_LOG2) - e, Int32(-100)), Int32(100)))
        scale = cute.math.exp2(q_log2, fastmath=False)
        for i in cutlass.range_constexpr(iters):
            idx = i * 128 + tidx
            vals = self.load_q(mQ, idx, b, kv_head, row0, work)
            if idx < work:
                n = idx // per_row
                c = idx % per_row
                for k in cutlass.range_constexpr(vec):
                    if const_expr(self.dynamic_q_scale):
                        sQ_nd[n, c * vec + k] = (vals[k] * scale).to(self.mma_dtype)
                    else:
                        sQ_nd[n, c * vec + k] = vals[k].to(self.mma_dtype)
        return q_log2

    @cute.jit
    def load_q(self, mQ, idx, b, kv_head, row0, work):
        """8 consecutive query elements (CTA row ``idx // (D / 8)``) as fp32; zeros for padding."""
        per_row = self.D // 8
        n = idx // per_row
        vals = cute.make_rmem_tensor((8,), Float32)
        vals.fill(0.0)
        r = row0 + n
        if n < self.row_tile and r < self.rows and idx < work:
            token = b * self.q_len + r // self.G
            head = kv_head * self.G + r % self.G
            vals.store(cute.local_tile(mQ[token, head, None], (8,), (idx % per_row,)).load().to(Float32))
        return vals

    @cute.jit
    def softmax(self, mQ, sQ, sP, sV, storage, tCtS, tCtO, pipe_s, pipe_v, p_full, o_done, qk, mO, mLse, mSinks,
                k_scale, v_scale, q_scale, sm_scale, window_left, seq_len, lo, kv_end, first, step, count, split,
                b, kv_head, row0):
        cfg = self.cfg
        N = self.N
        tidx = cute.arch.thread_idx()[0]
        warp = fresh_warp_index()
        lane = cute.arch.lane_idx()
        sMax = storage.red_max.get_tensor(cute.make_layout((2, 4, N), stride=(4 * N, N, 1)))
        sSum = storage.red_sum.get_tensor(cute.make_layout((4, N), stride=(N, 1)))
        q_log2 = self.stage_q(mQ, sQ, cute.make_tensor(sSum.iterator, cute.make_layout(4)), b, kv_head, row0, tidx,
                              warp)
        cute.arch.fence_proxy("async.shared", space="cta")  # sQ is read by the tensor core
        pipeline.NamedBarrier(barrier_id=BAR_Q, num_threads=128 + 32).arrive()

        # logits in log2 units: S_acc * c
        c = sm_scale * scalar(k_scale) * Float32(LOG2E) * cute.math.exp2(-q_log2, fastmath=False)
        if const_expr(cfg.q_dtype == "fp8_e4m3"):
            c = c * scalar(q_scale)

        # thread t reads TMEM lane t: token t of the tile, the n columns of S^T
        t_load_s, t_store_o, tStS, tOtO = self.tmem_copies(tCtS, tCtO, tidx)
        sP_tn = cute.composition(sP, cute.make_layout((KV_TILE, N), stride=(N, 1)))
        m_ref = cute.make_rmem_tensor((N,), Float32)
        m_ref.fill(-Float32.inf)
        row_sum = cute.make_rmem_tensor((N,), Float32)
        row_sum.fill(0.0)
        tCcS = qk.get_slice(0).partition_C(cute.make_identity_tensor((KV_TILE, N)))
        s = cute.make_rmem_tensor(t_load_s.partition_D(tCcS).shape, Float32)
        corr = cute.make_rmem_tensor((N,), Float32)
        state_s = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        bar = pipeline.NamedBarrier(barrier_id=BAR_SOFTMAX, num_threads=128)

        for it in cutlass.range(count, unroll=1):
            tile = first + it * step
            pipe_s.consumer_wait(state_s)
            cute.copy(t_load_s, last_mode(tStS, state_s.index), s)
            cute.arch.fence_view_async_tmem_load()
            pipe_s.consumer_release(state_s)
            state_s.advance()

            # ---- scale, mask, column maxima across the warpgroup ----
            pos = tile * KV_TILE + tidx
            # the causal draft, the sequence end and the table's capacity (kv_end)
            edge = tile * KV_TILE + KV_TILE > cutlass.min(seq_len - self.q_len + 1, kv_end)
            if window_left >= 0:
                if tile * KV_TILE < seq_len - 1 - window_left:  # the window start of the last draft row
                    edge = True
            mine = -Float32.inf
            for n in cutlass.range_constexpr(N):
                v = s[n] * c
                if edge:
                    # the column's query position (padding columns repeat the last row's)
                    q_pos = seq_len - self.q_len + cutlass.min(row0 + n, Int32(self.rows - 1)) // self.G
                    if not key_visible(pos, q_pos, kv_end, True, window_left):
                        v = -Float32.inf
                s[n] = v
                w = cute.arch.warp_redux_sync(v, kind="fmax")
                if lane == n:
                    mine = w
            parity = it % 2
            if lane < N:
                sMax[parity, warp, lane] = mine
            bar.arrive_and_wait()
            rescale = Int32(0)
            for n in cutlass.range_constexpr(N):
                tmax = cute.arch.fmax(cute.arch.fmax(sMax[parity, 0, n], sMax[parity, 1, n]),
                                      cute.arch.fmax(sMax[parity, 2, n], sMax[parity, 3, n]))
                corr[n] = Float32(1.0)
                if tmax > m_ref[n] + Float32(RESCALE_LOG2):
                    corr[n] = cute.math.exp2(m_ref[n] - tmax, fastmath=True)
                    m_ref[n] = tmax
                    rescale = Int32(1)
            # ---- P = 2^(s - m), row sums ----
            for n in cutlass.range_constexpr(N):
                m_use = m_ref[n]
                if m_use == -Float32.inf:
                    m_use = Float32(0.0)
                p = cute.math.exp2(s[n] - m_use, fastmath=True)
                row_sum[n] = row_sum[n] * corr[n] + p
                s[n] = p
            if it > 0:
                cute.arch.mbarrier_wait(o_done, (it - 1) % 2)  # PV(it - 1) is done with P and O
                if rescale != 0:
                    self.rescale_o(t_load_s, t_store_o, tOtO, corr, s)
            rP = cute.make_rmem_tensor((N,), self.mma_dtype)
            for n in cutlass.range_constexpr(N):
                rP[n] = s[n].to(self.mma_dtype)
            cute.autovec_copy(rP, sP_tn[tidx, None])  # the row is n contiguous elements: 16-byte stores
            if tile * KV_TILE + KV_TILE > kv_end:
                if const_expr(not self.cvt):
                    self.zero_v_tail(sV, pipe_v, it, kv_end - tile * KV_TILE, tidx)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(p_full)

        if count > 0:
            cute.arch.mbarrier_wait(o_done, (count - 1) % 2)
        self.epilogue(t_load_s, tOtO, m_ref, row_sum, sSum, mO, mLse, mSinks, v_scale, split, count, b, kv_head,
                      row0, tidx, warp, lane, s)

    def tmem_copies(self, tCtS, tCtO, tidx):
        """(Traced.) tcgen05.ld of n columns of one TMEM lane per thread (32x32b), for S^T and O^T,
        and the matching tcgen05.st for the O correction."""
        ld = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(self.N)), Float32)
        st = cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(self.N)), Float32)
        t_load = tcgen05.make_tmem_copy(ld, tCtS[None, None, None, 0]).get_slice(tidx)
        t_store = tcgen05.make_tmem_copy(st, tCtO[None, None, None, 0]).get_slice(tidx)
        return t_load, t_store, t_load.partition_S(tCtS), t_load.partition_S(tCtO)

    @cute.jit
    def rescale_o(self, t_load, t_store, tOtO, corr, like):
        """O^T *= corr per column (this thread's rows of every M block)."""
        o = cute.make_rmem_tensor_like(like)
        for mb in cutlass.range_constexpr(self.cfg.m_blocks):
            cute.copy(t_load, last_mode(tOtO, mb), o)
            cute.arch.fence_view_async_tmem_load()
            for n in cutlass.range_constexpr(self.N):
                o[n] = o[n] * corr[n]
            cute.copy(t_store, o, last_mode(tOtO, mb))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def zero_v_tail(self, sV, pipe_v, it, valid, tidx):
        """Zero V^T columns (tokens) >= ``valid`` of this tile's V chunks once they have landed:
        cache rows past the sequence end may hold NaN, and 0 * NaN in the PV MMA is NaN."""
        cfg = self.cfg
        sV_dt = logical_view(sV.layout, KV_TILE, self.chunk)
        sV3 = cute.make_tensor(sV.iterator, sV_dt)
        per_tile = cfg.v_chunks
        for mb in cutlass.range_constexpr(cfg.m_blocks):
            for kt in cutlass.range_constexpr(KV_TILE // self.chunk):
                k = it * per_tile + mb * (KV_TILE // self.chunk) + kt
                stage = k % cfg.stages
                cute.arch.mbarrier_wait(pipe_v.sync_object_full.get_barrier(stage), (k // cfg.stages) % 2)
                for t in cutlass.range(cutlass.max(valid - kt * self.chunk, Int32(0)), self.chunk, unroll=1):
                    sV3[tidx, t, stage] = self.kv_dtype(0.0)

    @cute.jit
    def epilogue(self, t_load, tOtO, m_ref, row_sum, sSum, mO, mLse, mSinks, v_scale, split, count, b, kv_head, row0,
                 tidx, warp, lane, like):
        """Row sums across the warpgroup, the sink (unsplit, or split 0), then O^T / l (times
        v_scale unsplit) and the base-2 LSE: the output and LSE, or the split's fp32 partial."""
        cfg = self.cfg
        N = self.N
        mine = Float32(0.0)
        for n in cutlass.range_constexpr(N):
            v = row_sum[n]
            for off in (16, 8, 4, 2, 1):
                v = v + cute.arch.shuffle_sync_bfly(v, off)
            if lane == n:
                mine = v
        if lane < N:
            sSum[warp, lane] = mine
        pipeline.NamedBarrier(barrier_id=BAR_SOFTMAX, num_threads=128).arrive_and_wait()
        vs = Float32(1.0) if const_expr(cfg.split) else scalar(v_scale)
        factor = cute.make_rmem_tensor((N,), Float32)
        lse = cute.make_rmem_tensor((N,), Float32)
        for n in cutlass.range_constexpr(N):
            m = m_ref[n]
            total = sSum[0, n] + sSum[1, n] + sSum[2, n] + sSum[3, n]
            keep = Float32(1.0)
            if const_expr(cfg.sinks):
                r_sink = cutlass.min(row0 + n, Int32(self.rows - 1))
                if split == 0:
                    m, total, keep = fold_sink(m, total, mSinks[kv_head * self.G + r_sink % self.G] * Float32(LOG2E))
            factor[n] = Float32(0.0)
            lse[n] = -Float32.inf
            if total > Float32(0.0):
                factor[n] = keep * vs / total
                lse[n] = m + cute.math.log2(total, fastmath=True)
        o = cute.make_rmem_tensor_like(like)
        for mb in cutlass.range_constexpr(cfg.m_blocks):
            if count > 0:
                cute.copy(t_load, last_mode(tOtO, mb), o)
                cute.arch.fence_view_async_tmem_load()
            else:
                o.fill(0.0)
            d = mb * KV_TILE + tidx
            if d < self.D:
                for n in cutlass.range_constexpr(N):
                    r_out = row0 + n
                    if n < self.row_tile and r_out < self.rows:
                        token = b * self.q_len + r_out // self.G
                        head = kv_head * self.G + r_out % self.G
                        if const_expr(cfg.split):
                            mO[split, token, head, d] = o[n] * factor[n]
                        else:
                            mO[token, head, d] = (o[n] * factor[n]).to(self.out_dtype)
        for n in cutlass.range_constexpr(N):
            r_lse = row0 + n
            if tidx == n and n < self.row_tile and r_lse < self.rows:
                token_l = b * self.q_len + r_lse // self.G
                head_l = kv_head * self.G + r_lse % self.G
                if const_expr(cfg.split):
                    mLse[split, token_l, head_l] = lse[n]
                else:
                    mLse[token_l, head_l] = lse[n]
