"""SM100 / SM103 paged prefill: the FA4 / CUTLASS Blackwell FMHA structure on a paged KV cache.

One CTA per (pair of 128-row Q tiles of one request, query head), 16 warps
(docs/design/sm100.md#prefill):

- warps 0-3 and 4-7, softmax: one warpgroup per Q tile (thread t = query row t = TMEM lane t).
  Each reads its S row (QK^T, n_block keys) from TMEM, masks (causal, window, sequence end),
  keeps the running row maximum (rescaling only when it grows by more than ``RESCALE_LOG2``),
  writes P = 2^(s - m) back into the same TMEM columns (S and P aliased: P is the PV MMA's A
  operand), and hands the correction factor to the correction warpgroup. The two warpgroups work
  on alternate MMAs (ping-pong): while one computes its softmax the tensor core runs the other's.
- warps 8-11, correction: rescales O (in TMEM) between PV MMAs when a row maximum moved; at the
  end divides by the row sum (the sink folded in) and writes the output rows and the LSE.
- warp 12, MMA: S_0(j) = Q_0 K_j^T, S_1(j), then per tile PV_s(j) followed by QK_s(j + 1), so
  that one tile's MMAs run while the other tile's softmax does.
- warp 13, load: the two Q tiles, then per KV block its K and V through two TMA rings, one box
  per page (zero-filled outside the sequence or the window, never read).

Varlen: ``query_start_loc`` gives each request's query rows (the last ``q_len`` of its
``seq_len`` tokens); CTAs past a request's rows do nothing. FP8: e4m3 Q, K, V (kind::f8f6f4, P
quantized to e4m3), 16-bit otherwise; scales fold into the logit scale and the output.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from ..jit.spec import bind_arguments
from ..roles.attn_window import box_visible, key_visible, prefill_key_range
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

M_TILE = 128
RESCALE_LOG2 = 8.0  # as in decode: P <= 2^8 between rescales
CORR_COLS = 32  # O columns per tcgen05.ld / st of the correction and the epilogue
MMA_WARP, LOAD_WARP = 12, 13


class Sm100PagedPrefill:
    """Kernel object; all fields are compile-time (see :class:`~cute_kernels.plans.sm100.Sm100PrefillConfig`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.arg_names = cfg.arg_names()
        self.q_dtype, self.kv_dtype, self.mma_dtype, self.out_dtype = config_dtypes(cfg)
        self.D, self.n = cfg.head_dim, cfg.n_block
        self.qs = cfg.q_stages
        self.page = cfg.page_size
        self.box = min(cfg.page_size, cfg.n_block)  # tokens per K / V box
        self.regs = cfg.registers

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------

    def mmas(self):
        """QK: A = Q (smem, K-major), B = K (smem, K-major), C = S (TMEM, 128 x n_block).
        PV: A = P (TMEM, aliased on S), B = V (smem, D contiguous), C = O (TMEM, 128 x D)."""
        qk = sm100_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            tcgen05.CtaGroup.ONE, (M_TILE, self.n))
        pv = sm100_utils.make_trivial_tiled_mma(
            self.mma_dtype, self.mma_dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            tcgen05.CtaGroup.ONE, (M_TILE, self.D), tcgen05.OperandSource.TMEM)
        return qk, pv

    def layouts(self, qk, pv):
        cfg = self.cfg
        q_layout = sm100_utils.make_smem_layout_a(qk, (M_TILE, self.n, self.D), self.mma_dtype, self.qs)
        k_layout = sm100_utils.make_smem_layout_b(qk, (M_TILE, self.n, self.D), self.kv_dtype, cfg.stages)
        v_layout = sm100_utils.make_smem_layout_b(pv, (M_TILE, self.D, self.n), self.kv_dtype, cfg.stages)
        return q_layout, k_layout, v_layout

    @cute.jit
    def __call__(self, *args):
        """The config's arguments in signature order (a variant takes only the ones it uses), then
        the stream; :meth:`launch` receives them by name."""
        self.launch(**bind_arguments(self.arg_names, args))

    @cute.jit
    def launch(self, q, block_table, seq_lens, query_start_loc, out, k_scale, v_scale, sm_scale: Float32,
               max_query_len: Int32, window_left: Int32, stream, kv_cache=None, k_cache=None, v_cache=None,
               lse=None, q_scale=None, sinks=None):
        """Arguments by their signature names (plans/sm100.py); absent ones are None."""
        cfg = self.cfg
        if const_expr(cfg.kv_form == "single"):
            mK4 = kv_cache[None, 0, None, None, None]
            mV4 = kv_cache[None, 1, None, None, None]
        else:
            mK4, mV4 = k_cache, v_cache
        tok, head = (2, 1) if const_expr(cfg.kv_layout == "HND") else (1, 2)
        mK = cute.make_tensor(mK4.iterator, cute.select(mK4.layout, mode=[tok, 3, head, 0]))  # (tok, d, h, page)
        mVt = cute.make_tensor(mV4.iterator, cute.select(mV4.layout, mode=[3, tok, head, 0]))  # (d, tok, h, page)
        mQv = cute.make_tensor(q.iterator, cute.select(q.layout, mode=[0, 2, 1]))  # (token, d, head)

        qk, pv = self.mmas()
        q_layout, k_layout, v_layout = self.layouts(qk, pv)
        op = cpasync.CopyBulkTensorTileG2SOp()
        q_box = cute.select(logical_view(q_layout, M_TILE, self.D), mode=[0, 1])
        tma_q, tma_tQ = cpasync.make_tiled_tma_atom(op, mQv, q_box, (M_TILE, self.D))
        k_box = cute.composition(cute.select(logical_view(k_layout, self.n, self.D), mode=[0, 1]),
                                 cute.make_layout((self.box, self.D), stride=(1, self.n)))
        tma_k, tma_tK = cpasync.make_tiled_tma_atom(op, mK, k_box, (self.box, self.D))
        v_box = cute.composition(cute.select(logical_view(v_layout, self.D, self.n), mode=[0, 1]),
                                 cute.make_layout((self.D, self.box)))
        tma_v, tma_tV = cpasync.make_tiled_tma_atom(op, mVt, v_box, (self.D, self.box))

        @cute.struct
        class Storage:
            k_bar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            v_bar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            q_full: cute.struct.MemRange[cutlass.Int64, 2]
            s_full: cute.struct.MemRange[cutlass.Int64, 2]
            p_ready: cute.struct.MemRange[cutlass.Int64, 2]
            scale_ready: cute.struct.MemRange[cutlass.Int64, 2]
            o_done: cute.struct.MemRange[cutlass.Int64, 2]
            o_fixed: cute.struct.MemRange[cutlass.Int64, 2]
            stats_ready: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_ptr: cute.struct.MemRange[Int32, 4]
            scale: cute.struct.MemRange[Float32, 2 * M_TILE]
            row_max: cute.struct.MemRange[Float32, 2 * M_TILE]
            row_sum: cute.struct.MemRange[Float32, 2 * M_TILE]
            sQ: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, cute.cosize(k_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, cute.cosize(v_layout)], 1024]

        self.storage = Storage
        check_smem(Storage.size_in_bytes(), cfg)
        num_q_heads = q.shape[1]
        batch = block_table.shape[0]
        q_tiles = (max_query_len + M_TILE * self.qs - 1) // (M_TILE * self.qs)
        self.kernel(
            tma_q, tma_tQ, tma_k, tma_tK, tma_v, tma_tV, mK4.shape[0], block_table, seq_lens, query_start_loc,
            out, lse, k_scale, v_scale, q_scale, sinks, sm_scale, window_left, q_layout, k_layout, v_layout,
        ).launch(grid=[q_tiles, num_q_heads, batch], block=[self.regs.threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1, use_pdl=cfg.pdl)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tma_q, mQv, tma_k, mK, tma_v, mVt, num_pages: Int32, mBlockTable, mSeqLens, mQsl, mO, mLse,
               k_scale, v_scale, q_scale, mSinks, sm_scale: Float32, window_left: Int32, q_layout, k_layout,
               v_layout):
        cfg = self.cfg
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)

        if warp == LOAD_WARP:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        if warp == MMA_WARP:
            cute.arch.alloc_tmem(cfg.tmem_cols, storage.tmem_ptr.data_ptr())
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(storage.q_full.data_ptr() + s, 1)
                    cute.arch.mbarrier_init(storage.s_full.data_ptr() + s, 1)
                    cute.arch.mbarrier_init(storage.p_ready.data_ptr() + s, M_TILE)
                    cute.arch.mbarrier_init(storage.scale_ready.data_ptr() + s, M_TILE)
                    cute.arch.mbarrier_init(storage.o_done.data_ptr() + s, 1)
                    cute.arch.mbarrier_init(storage.o_fixed.data_ptr() + s, M_TILE)
                    cute.arch.mbarrier_init(storage.stats_ready.data_ptr() + s, M_TILE)
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        kv_bytes = cfg.kv_tile_bytes
        pipe_k = pipeline.PipelineTmaUmma.create(barrier_storage=storage.k_bar.data_ptr(), num_stages=cfg.stages,
                                                 producer_group=one, consumer_group=one, tx_count=kv_bytes,
                                                 defer_sync=True)
        pipe_v = pipeline.PipelineTmaUmma.create(barrier_storage=storage.v_bar.data_ptr(), num_stages=cfg.stages,
                                                 producer_group=one, consumer_group=one, tx_count=kv_bytes,
                                                 defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_wait()

        # Each role derives its work after setmaxnreg (values live across it would be spilled).
        holder = storage.tmem_ptr.data_ptr()
        if warp < 4:
            set_registers(self.regs, "softmax0")
            self.softmax(0, storage, sV, pipe_v, mSeqLens, mQsl, mBlockTable, k_scale, q_scale, sm_scale, window_left,
                         holder)
            cute.arch.sync_threads()
        elif warp < 8:
            set_registers(self.regs, "softmax1")
            if const_expr(self.qs == 2):
                self.softmax(1, storage, sV, pipe_v, mSeqLens, mQsl, mBlockTable, k_scale, q_scale, sm_scale,
                             window_left, holder)
            cute.arch.sync_threads()
        elif warp < 12:
            set_registers(self.regs, "correction")
            self.correction(storage, mSeqLens, mQsl, mBlockTable, mO, mLse, mSinks, v_scale, window_left, holder)
            cute.arch.sync_threads()
        else:
            set_registers(self.regs, "mma_load")
            w = fresh_warp_index()
            if w == MMA_WARP:
                self.mma(storage, sQ, sK, sV, pipe_k, pipe_v, mSeqLens, mQsl, mBlockTable, window_left, holder)
            elif w == LOAD_WARP:
                self.load(tma_q, mQv, tma_k, mK, tma_v, mVt, sQ, sK, sV, storage, pipe_k, pipe_v, mBlockTable,
                          num_pages, mSeqLens, mQsl, window_left)
            cute.arch.sync_threads()
            if w == MMA_WARP:
                cute.arch.relinquish_tmem_alloc_permit()
                cute.arch.dealloc_tmem(tmem_base(holder), cfg.tmem_cols)

    @cute.jit
    def work(self, mSeqLens, mQsl, mBlockTable, window_left):
        """This CTA's request geometry: ``(seq_len, kv_end, q_start, q_len, m0, first_block,
        blocks)``; no blocks when the CTA's first row is past the request's rows. ``kv_end``: the
        length clamped to the block table's capacity, past which nothing is attended (so a huge,
        corrupted length costs what a full table costs: docs/design/inputs.md#lengths)."""
        b = cute.arch.block_idx()[2]
        q_start = mQsl[b]
        q_len = mQsl[b + 1] - q_start
        seq_len = mSeqLens[b]
        kv_end = kv_cap(seq_len, mBlockTable.shape[1], self.page, cutlass.min, cutlass.max)
        m0 = cute.arch.block_idx()[0] * (M_TILE * self.qs)
        rows = cutlass.min(q_len - m0, Int32(M_TILE * self.qs))
        first = Int32(0)
        blocks = Int32(0)
        if rows > 0:
            lo, hi = prefill_key_range(seq_len, q_len, m0, m0 + rows - 1, self.cfg.causal, window_left, kv_end)
            first = lo // self.n
            blocks = cutlass.max((hi + self.n - 1) // self.n - first, Int32(0))
        return seq_len, kv_end, q_start, q_len, m0, first, blocks

    # ------------------------------------------------------------------------------------------
    # load warp
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def load(self, tma_q, mQv, tma_k, mK, tma_v, mVt, sQ, sK, sV, storage, pipe_k, pipe_v, mBlockTable, num_pages,
             mSeqLens, mQsl, window_left):
        cfg = self.cfg
        seq_len, kv_end, q_start, q_len, m0, first, blocks = self.work(mSeqLens, mQsl, mBlockTable, window_left)
        h = cute.arch.block_idx()[1]
        b = cute.arch.block_idx()[2]
        kv_head = h // cfg.group
        lane = cute.arch.lane_idx()
        # Q: the request's rows m0 .. m0 + 255 (TMA zero-fills past the last token)
        gQ = cute.local_tile(cute.domain_offset((q_start + m0, 0), mQv[None, None, h]), (M_TILE, self.D), (None, 0))
        sQ3 = cute.make_tensor(sQ.iterator, logical_view(sQ.layout, M_TILE, self.D))
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ3, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        if blocks > 0:
            for s in cutlass.range_constexpr(self.qs):
                bar = storage.q_full.data_ptr() + s
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, M_TILE * self.D * self.mma_dtype.width // 8)
                cute.copy(tma_q, tQgQ[None, s], tQsQ[None, s], tma_bar_ptr=bar)
        # K / V boxes: (box tokens, D) of a page; V^T boxes (D, box tokens)
        gK = cute.local_tile(mK[None, None, kv_head, None], (self.box, self.D), (None, 0, None))
        sK_boxes = cute.flat_divide(cute.make_tensor(sK.iterator, logical_view(sK.layout, self.n, self.D)),
                                    (self.box, self.D))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK_boxes, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        gV = cute.local_tile(mVt[None, None, kv_head, None], (self.D, self.box), (0, None, None))
        sV_boxes = cute.flat_divide(cute.make_tensor(sV.iterator, logical_view(sV.layout, self.D, self.n)),
                                    (self.D, self.box))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV_boxes, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        lo, hi = prefill_key_range(seq_len, q_len, m0, cutlass.min(q_len, m0 + M_TILE * self.qs) - 1, cfg.causal,
                                   window_left, kv_end)
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        boxes = self.n // self.box
        for j in cutlass.range(blocks, unroll=1):
            blk = first + j
            # lane i: the page coordinate of box i (out of range = zero fill: TMA reads nothing)
            start = blk * self.n + lane * self.box
            page_id = Int32(num_pages)
            if lane < boxes and start // self.page < mBlockTable.shape[1]:
                raw = mBlockTable[b, start // self.page]
                if raw >= 0 and raw < num_pages and box_visible(start, self.box, lo, hi):
                    page_id = raw
            pipe_k.producer_acquire(state_k)
            for i in cutlass.range_constexpr(boxes):
                pid = cute.arch.shuffle_sync(page_id, i)
                sub = ((blk * self.n + i * self.box) % self.page) // self.box
                cute.copy(tma_k, tKgK[None, sub, pid], tKsK[None, i, 0, state_k.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(state_k))
            pipe_k.producer_commit(state_k)
            state_k.advance()
            pipe_v.producer_acquire(state_v)
            for i in cutlass.range_constexpr(boxes):
                pid = cute.arch.shuffle_sync(page_id, i)
                sub = ((blk * self.n + i * self.box) % self.page) // self.box
                cute.copy(tma_v, tVgV[None, sub, pid], tVsV[None, 0, i, state_v.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(state_v))
            pipe_v.producer_commit(state_v)
            state_v.advance()

    # ------------------------------------------------------------------------------------------
    # MMA warp
    # ------------------------------------------------------------------------------------------

    def tmem_tensors(self, qk, pv, holder):
        """(Traced.) S (one stage per Q tile), O (one per Q tile) and P: S's columns from
        ``p_offset`` on, seen as the PV MMA's A operand (mma dtype elements)."""
        cfg = self.cfg
        tmem = tmem_base(holder)
        tStS = cute.make_tensor(tmem, qk.get_slice(0).make_fragment_C(
            qk.partition_shape_C((M_TILE, self.n, self.qs))).layout)
        tOtO = cute.make_tensor(tmem + cfg.s_cols, pv.get_slice(0).make_fragment_C(
            pv.partition_shape_C((M_TILE, self.D, self.qs))).layout)
        ratio = 32 // self.mma_dtype.width
        tP = pv.get_slice(0).make_fragment_A(pv.partition_shape_A((M_TILE, self.n)))
        tOrP = cute.make_tensor(cute.recast_ptr(tmem + cfg.p_offset, dtype=self.mma_dtype),
                                cute.append(tP.layout, cute.make_layout((self.qs,), stride=(self.n * ratio,))))
        return tStS, tOtO, tOrP

    @cute.jit
    def mma(self, storage, sQ, sK, sV, pipe_k, pipe_v, mSeqLens, mQsl, mBlockTable, window_left, holder):
        seq_len, kv_end, q_start, q_len, m0, first, blocks = self.work(mSeqLens, mQsl, mBlockTable, window_left)
        qk, pv = self.mmas()
        tStS, tOtO, tOrP = self.tmem_tensors(qk, pv, holder)
        tCrQ = qk.get_slice(0).make_fragment_A(sQ)
        tCrK = qk.get_slice(0).make_fragment_B(sK)
        tCrV = pv.get_slice(0).make_fragment_B(sV)
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
        if blocks > 0:
            for s in cutlass.range_constexpr(self.qs):
                cute.arch.mbarrier_wait(storage.q_full.data_ptr() + s, 0)
            pipe_k.consumer_wait(state_k)
            for s in cutlass.range_constexpr(self.qs):
                tS = last_mode(tStS, s)
                for kb in cutlass.range_constexpr(cute.size(tCrQ, mode=[2])):
                    qk.set(tcgen05.Field.ACCUMULATE, kb != 0)
                    cute.gemm(qk, tS, tCrQ[None, None, kb, s], tCrK[None, None, kb, state_k.index], tS)
                self.commit(storage.s_full.data_ptr() + s)
            pipe_k.consumer_release(state_k)
            state_k.advance()
        for j in cutlass.range(blocks, unroll=1):
            pipe_v.consumer_wait(state_v)
            for s in cutlass.range_constexpr(self.qs):
                cute.arch.mbarrier_wait(storage.p_ready.data_ptr() + s, j % 2)
                if j > 0:
                    cute.arch.mbarrier_wait(storage.o_fixed.data_ptr() + s, (j - 1) % 2)
                tO = last_mode(tOtO, s)
                for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    if const_expr(kb == 0):
                        pv.set(tcgen05.Field.ACCUMULATE, j > 0)
                    else:
                        pv.set(tcgen05.Field.ACCUMULATE, True)
                    cute.gemm(pv, tO, tOrP[None, None, kb, s], tCrV[None, None, kb, state_v.index], tO)
                self.commit(storage.o_done.data_ptr() + s)
                # the next block's QK of this tile: after its PV in issue order (S and P share TMEM)
                if j + 1 < blocks:
                    if const_expr(s == 0):
                        pipe_k.consumer_wait(state_k)
                    tS = last_mode(tStS, s)
                    for kb in cutlass.range_constexpr(cute.size(tCrQ, mode=[2])):
                        qk.set(tcgen05.Field.ACCUMULATE, kb != 0)
                        cute.gemm(qk, tS, tCrQ[None, None, kb, s], tCrK[None, None, kb, state_k.index], tS)
                    self.commit(storage.s_full.data_ptr() + s)
                    if const_expr(s == self.qs - 1):
                        pipe_k.consumer_release(state_k)
                        state_k.advance()
            pipe_v.consumer_release(state_v)
            state_v.advance()

    @staticmethod
    def commit(bar):
        """(Traced.) tcgen05.commit: ``bar`` completes when the MMAs issued so far have."""
        with cute.arch.elect_one():
            tcgen05.commit(bar)

    # ------------------------------------------------------------------------------------------
    # softmax warpgroups
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def softmax(self, s: cutlass.Constexpr, storage, sV, pipe_v, mSeqLens, mQsl, mBlockTable, k_scale, q_scale,
                sm_scale, window_left, holder):
        cfg = self.cfg
        seq_len, kv_end, q_start, q_len, m0, first, blocks = self.work(mSeqLens, mQsl, mBlockTable, window_left)
        t = cute.arch.thread_idx()[0] % M_TILE
        q_pos = seq_len - q_len + m0 + s * M_TILE + t
        c = sm_scale * scalar(k_scale) * Float32(LOG2E)
        if const_expr(cfg.q_dtype == "fp8_e4m3"):
            c = c * scalar(q_scale)
        qk, pv = self.mmas()
        tStS, tOtO, tOrP = self.tmem_tensors(qk, pv, holder)
        tS = tStS[(None, None), 0, 0, s]  # (128, n_block)
        ld = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), Float32)
        t_load = tcgen05.make_tmem_copy(ld, tS).get_slice(t)
        tStS_r = t_load.partition_S(tS)
        rS = cute.make_rmem_tensor(t_load.partition_D(cute.make_identity_tensor((M_TILE, self.n))).shape, Float32)
        # P: the same row as fp32 words (two 16-bit or four 8-bit P per word), from S + p_offset
        words = self.n * self.mma_dtype.width // 32
        tStP = cute.make_tensor(tS.iterator + cfg.p_offset, cute.composition(tS.layout,
                                                                           cute.make_layout((M_TILE, words))))
        st = cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(words)), Float32)
        t_store = tcgen05.make_tmem_copy(st, tStP).get_slice(t)
        tStP_r = t_store.partition_D(tStP)
        rP32 = cute.make_rmem_tensor(t_store.partition_S(cute.make_identity_tensor((M_TILE, words))).shape, Float32)
        rP = cute.make_tensor(cute.recast_ptr(rP32.iterator, dtype=self.mma_dtype), cute.make_layout(self.n))
        sScale = storage.scale.get_tensor(cute.make_layout((2, M_TILE), stride=(M_TILE, 1)))

        m_ref = -Float32.inf
        row_sum = Float32(0.0)
        for j in cutlass.range(blocks, unroll=1):
            k0 = (first + j) * self.n
            cute.arch.mbarrier_wait(storage.s_full.data_ptr() + s, j % 2)
            cute.copy(t_load, tStS_r, rS)
            cute.arch.fence_view_async_tmem_load()
            edge = self.block_needs_mask(k0, q_pos, kv_end, window_left)
            tmax = -Float32.inf
            for i in cutlass.range_constexpr(self.n):
                v = rS[i] * c
                if edge:
                    if not key_visible(k0 + i, q_pos, kv_end, cfg.causal, window_left):
                        v = -Float32.inf
                rS[i] = v
                tmax = cute.arch.fmax(tmax, v)
            scale = Float32(1.0)
            if tmax > m_ref + Float32(RESCALE_LOG2):
                scale = cute.math.exp2(m_ref - tmax, fastmath=True)
                m_ref = tmax
            if j > 0:  # the correction warpgroup rescales O by this before the next PV
                sScale[s, t] = scale
                cute.arch.mbarrier_arrive(storage.scale_ready.data_ptr() + s)
            m_use = m_ref
            if m_use == -Float32.inf:
                m_use = Float32(0.0)
            row_sum = row_sum * scale
            for i in cutlass.range_constexpr(self.n):
                p = cute.math.exp2(rS[i] - m_use, fastmath=True)
                row_sum = row_sum + p
                rS[i] = p
            rP.store(rS.load().to(self.mma_dtype).reshape(rP.shape))  # packed conversions
            if const_expr(s == 0):
                if k0 + self.n > kv_end:
                    self.zero_v_tail(sV, pipe_v, j, kv_end - k0, t)
            cute.copy(t_store, rP32, tStP_r)
            cute.arch.fence_view_async_tmem_store()
            cute.arch.mbarrier_arrive(storage.p_ready.data_ptr() + s)
        storage.row_max.get_tensor(cute.make_layout(2 * M_TILE))[s * M_TILE + t] = m_ref
        storage.row_sum.get_tensor(cute.make_layout(2 * M_TILE))[s * M_TILE + t] = row_sum
        cute.arch.mbarrier_arrive(storage.stats_ready.data_ptr() + s)

    @cute.jit
    def block_needs_mask(self, k0, q_pos, kv_end, window_left):
        """Whether keys ``k0 .. k0 + n_block`` cross ``kv_end`` (the sequence end or the table's
        capacity), the causal diagonal or the window start for the query at ``q_pos`` (other
        blocks skip the per-key test)."""
        edge = k0 + self.n > kv_end
        if const_expr(self.cfg.causal):
            if k0 + self.n - 1 > q_pos:
                edge = True
        if window_left >= 0:
            if k0 < q_pos - window_left:
                edge = True
        return edge

    @cute.jit
    def zero_v_tail(self, sV, pipe_v, j, valid, t):
        """Keys >= ``valid`` of block j's V: zero them once the TMA landed (past the sequence end
        the cache may hold NaN; 0 x NaN in the PV MMA is NaN). Softmax warpgroup 0 does it before
        it releases its P, which the block's first PV waits for."""
        cfg = self.cfg
        stage = j % cfg.stages
        cute.arch.mbarrier_wait(pipe_v.sync_object_full.get_barrier(stage), (j // cfg.stages) % 2)
        sV3 = cute.make_tensor(sV.iterator, logical_view(sV.layout, self.D, self.n))
        for d0 in cutlass.range_constexpr(0, self.D, M_TILE):
            if d0 + t < self.D:
                for k in cutlass.range(cutlass.max(valid, Int32(0)), self.n, unroll=1):
                    sV3[d0 + t, k, stage] = self.kv_dtype(0.0)
        cute.arch.fence_view_async_shared()  # before this thread's P arrival releases the PV MMA

    # ------------------------------------------------------------------------------------------
    # correction warpgroup
    # ------------------------------------------------------------------------------------------

    def o_copies(self, tOtO, t):
        """(Traced.) tcgen05.ld / st of CORR_COLS columns of O row ``t``, per Q tile."""
        tO = tOtO[(None, None), 0, 0, 0]  # (128, D)
        ld = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(CORR_COLS)), Float32)
        st = cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(CORR_COLS)), Float32)
        chunk = cute.flat_divide(tO, (M_TILE, CORR_COLS))[None, None, 0, 0]  # one 128 x 32 chunk
        t_load = tcgen05.make_tmem_copy(ld, chunk).get_slice(t)
        t_store = tcgen05.make_tmem_copy(st, chunk).get_slice(t)
        return t_load, t_store

    @cute.jit
    def correction(self, storage, mSeqLens, mQsl, mBlockTable, mO, mLse, mSinks, v_scale, window_left, holder):
        cfg = self.cfg
        seq_len, kv_end, q_start, q_len, m0, first, blocks = self.work(mSeqLens, mQsl, mBlockTable, window_left)
        t = cute.arch.thread_idx()[0] % M_TILE
        h = cute.arch.block_idx()[1]
        qk, pv = self.mmas()
        tStS, tOtO, tOrP = self.tmem_tensors(qk, pv, holder)
        t_load, t_store = self.o_copies(tOtO, t)
        o_shape = t_load.partition_D(cute.make_identity_tensor((M_TILE, CORR_COLS))).shape
        sScale = storage.scale.get_tensor(cute.make_layout((2, M_TILE), stride=(M_TILE, 1)))
        chunks = self.D // CORR_COLS
        for j in cutlass.range(1, blocks, unroll=1):
            for s in cutlass.range_constexpr(self.qs):
                cute.arch.mbarrier_wait(storage.scale_ready.data_ptr() + s, (j - 1) % 2)
                cute.arch.mbarrier_wait(storage.o_done.data_ptr() + s, (j - 1) % 2)
                scale = sScale[s, t]
                if cute.arch.vote_any_sync(scale != Float32(1.0)):  # tcgen05.ld/st are warp-wide
                    for ci in cutlass.range_constexpr(chunks):
                        tO = self.o_chunk(tOtO, s, ci)
                        o = cute.make_rmem_tensor(o_shape, Float32)
                        cute.copy(t_load, t_load.partition_S(tO), o)
                        cute.arch.fence_view_async_tmem_load()
                        for i in cutlass.range_constexpr(cute.size(o)):
                            o[i] = o[i] * scale
                        cute.copy(t_store, o, t_store.partition_D(tO))
                    cute.arch.fence_view_async_tmem_store()
                cute.arch.mbarrier_arrive(storage.o_fixed.data_ptr() + s)
        # ---- epilogue: O / l (the sink folded in), the output rows and the LSE ----
        vs = scalar(v_scale)
        sink = -Float32.inf
        if const_expr(cfg.sinks):
            sink = mSinks[h] * Float32(LOG2E)
        for s in cutlass.range_constexpr(self.qs):
            cute.arch.mbarrier_wait(storage.stats_ready.data_ptr() + s, 0)
            if blocks > 0:
                cute.arch.mbarrier_wait(storage.o_done.data_ptr() + s, (blocks - 1) % 2)
            m = storage.row_max.get_tensor(cute.make_layout(2 * M_TILE))[s * M_TILE + t]
            total = storage.row_sum.get_tensor(cute.make_layout(2 * M_TILE))[s * M_TILE + t]
            keep = Float32(1.0)
            if const_expr(cfg.sinks):
                m, total, keep = fold_sink(m, total, sink)
            factor = Float32(0.0)
            lse = -Float32.inf
            if total > Float32(0.0):
                factor = keep * vs / total
                lse = m + cute.math.log2(total, fastmath=True)
            r = m0 + s * M_TILE + t
            for ci in cutlass.range_constexpr(chunks):
                tO = self.o_chunk(tOtO, s, ci)
                o = cute.make_rmem_tensor(o_shape, Float32)
                if blocks > 0:
                    cute.copy(t_load, t_load.partition_S(tO), o)
                    cute.arch.fence_view_async_tmem_load()
                else:
                    o.fill(0.0)
                if r < q_len:
                    out = cute.make_rmem_tensor((CORR_COLS,), self.out_dtype)
                    for i in cutlass.range_constexpr(CORR_COLS):
                        out[i] = (o[i] * factor).to(self.out_dtype)
                    cute.autovec_copy(out, cute.local_tile(mO[q_start + r, h, None], (CORR_COLS,), (ci,)))
            if const_expr(cfg.write_lse):
                if r < q_len:
                    mLse[q_start + r, h] = lse

    def o_chunk(self, tOtO, s, ci):
        """(Traced.) Columns ``ci * 32 ...`` of Q tile ``s``'s O (128 x 32)."""
        tO = tOtO[(None, None), 0, 0, s]
        return cute.flat_divide(tO, (M_TILE, CORR_COLS))[None, None, 0, ci]
