"""SM90 paged decode: BF16/FP16 queries against an FP8 (or BF16/FP16) paged KV cache.

Design, with the measurements behind each choice: docs/design/sm90-decode.md. Plan (config,
limits, tuning, launch schedule): :mod:`cute_kernels.plans.sm90_decode`; the parts are roles
(:mod:`cute_kernels.roles`):

- **One CTA per (split, KV head, request)**, 4 consumer warps (one warpgroup) plus one producer
  warp. The producer walks the CTA's 64-token KV tiles, looks the pages up in the block table
  (32 page ids per warp-wide load, ahead of use) and issues one TMA box per page piece into a
  ``stages``-deep mbarrier pipeline for K and one for V. TMA zero-fills boxes whose page id is
  out of range, so no page id can make the kernel read outside the cache.
- **Swap-AB WGMMA.** The query rows of the KV group (``group`` heads x ``q_len`` draft tokens,
  padded to a multiple of 8 = ``n_pad``) are the MMA's N; the 64 tokens of a tile are its M:
  ``S^T[64, n] = K[64, D] . Q^T`` and ``O^T[D, n] += V^T[D, 64] . P^T``. Q (once) and P (per
  tile) live in shared memory as the B operand.
- **FP8 cache: register-sourced A.** K and V^T fragments are read from the TMA'd FP8 tile with
  ``ldmatrix`` (V with ``.trans``) and widened exactly to a 16-bit type (``roles/widen.py``),
  then fed to RS WGMMA: QK keeps 16-bit precision and no 16-bit copy of the tile is ever written
  to shared memory. The bit widening scales K and V by a power of two; Q and P are pre-scaled by
  powers of two so every product stays in fp32's normal range, and all of it folds into the logit
  scale and the output scale.
- **16-bit cache: SS WGMMA** straight from the TMA'd tiles (V^T as an MN-major A operand).
- Online softmax over tokens (the M dim): per-column maxima cross the 4 warps through shared
  memory once per tile; row sums stay per thread until the end.
- ``split``: each split CTA normalizes its fp32 partial and base-2 LSE, and the splits of a
  (request, KV head) merge without a second launch: through global memory, where the last CTA to
  arrive (an arrival counter) reads every partial from L2, or (``cluster``, small grids) as one
  thread-block cluster whose CTAs each merge a share of the output from the others' shared
  memory (DSMEM). Unsplit, the output (in the query dtype) and the LSE are written directly.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..jit.dtypes import cute_dtype
from ..jit.spec import bind_arguments
from ..roles.attn_window import window_start
from ..roles.balanced_chunks import BalancedChunks
from ..roles.fragments import WIDEN_SHIFT_LOG2, load_shared_i32, special_register, store_shared_f32
from ..roles.paged_kv import PagedKVProducer
from ..roles.query import QueryStager
from ..roles.sinks import fold_sink
from ..roles.softmax import BAR_MMA, LOG2E, SwapAbSoftmax, slot_column, slot_of, swap_ab_mmas
from ..roles.split_merge import SplitMerge
from ..roles.widen import Fp8Fragments

# Powers of two applied to Q and P before they enter an MMA whose K/V operand was widened from
# FP8 (K/V scaled by 2^-WIDEN): keeps every product and partial sum in fp32's normal range.
Q_PRESCALE_LOG2 = {"bf16": 64, "fp16": 0}
P_PRESCALE_LOG2 = {"bf16": 64, "fp16": 0}


class Sm90PagedDecode:
    """Kernel object of :class:`cute_kernels.plans.sm90_decode.Sm90DecodeConfig`; every field is
    compile-time. It composes the paged K/V producer, the FP8 fragment widening, the Q staging,
    the swap-AB online softmax and the split output/merges (``cute_kernels.roles``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.arg_names = cfg.arg_names()
        # one consumer warpgroup (warps 0-3) and one producer warp; the WGMMA's M is the tile's rows
        self.warps = cfg.consumer_warps
        self.producer_warp = self.warps
        self.num_threads = cfg.num_threads
        self.mma_m = cfg.hw.WGMMA_M
        self.q_dtype = cute_dtype(cfg.q_dtype)
        self.kv_dtype = cute_dtype(cfg.kv_dtype)
        self.fp8 = cfg.kv_dtype == "fp8_e4m3"
        self.q_permuted = self.fp8  # Q columns match the register-widened K fragments
        self.D = cfg.head_dim
        self.G = cfg.group
        self.q_len = cfg.q_len
        self.rows = cfg.group * cfg.q_len
        self.N = cfg.n_pad
        self.page = cfg.page_size
        self.tile = cfg.tile
        self.stages = cfg.stages
        # FP8 "bits": exact widening to the query's type by bit operations (values x 2^-shift);
        # FP8 "cvt": exact hardware e4m3 -> f16 conversion, so the MMAs run in fp16 and a BF16
        # query is rescaled by a power of two into fp16's range (``dynamic_q_scale``).
        self.cvt = self.fp8 and cfg.widen == "cvt"
        self.mma_dtype = cute_dtype("fp16") if self.cvt else self.q_dtype
        self.dynamic_q_scale = self.cvt and cfg.q_dtype == "bf16"
        if self.fp8 and not self.cvt:
            widen = WIDEN_SHIFT_LOG2[cfg.q_dtype]
            self.q_pre = Q_PRESCALE_LOG2[cfg.q_dtype]
            self.p_pre = P_PRESCALE_LOG2[cfg.q_dtype]
            self.logit_log2 = widen - self.q_pre  # logits = S_acc * 2^this * sm_scale * k_scale
            self.out_log2 = widen - self.p_pre  # O = O_acc * 2^this * v_scale / l
        else:
            self.q_pre = self.p_pre = self.logit_log2 = self.out_log2 = 0
        # the roles this kernel composes
        self.kv = PagedKVProducer(D=self.D, page=self.page, tile=self.tile, stages=self.stages, fp8=self.fp8,
                                  strided=cfg.strided, dynamic=cfg.dynamic, evict_first=cfg.evict_first,
                                  chunk_tiles_max=cfg.chunk_tiles_max, tail=cfg.cluster,
                                  window=cfg.window)
        self.frags = Fp8Fragments(self.D, self.tile, self.fp8, self.cvt, cfg.q_dtype, self.mma_m)
        self.query = QueryStager(self.D, self.N, self.G, self.q_len, bounded=False,
                                 dynamic_q_scale=self.dynamic_q_scale, q_pre=self.q_pre, q_permuted=self.q_permuted,
                                 widen=cfg.widen, warps=self.warps)
        self.softmax = SwapAbSoftmax(self.N, self.D, self.tile, self.p_pre, self.warps)
        self.split_merge = SplitMerge(
            D=self.D, N=self.N, G=self.G, q_len=self.q_len, merge=cfg.merge, smem_merge=cfg.smem_merge,
            dynamic=cfg.dynamic, merge_slots=cfg.merge_slots(), merge_slot_bytes=cfg.merge_slot_bytes(),
            merge_group=cfg.merge_group, cluster_group=cfg.cluster_group, warps=self.warps,
            num_threads=self.num_threads)
        self.chunks = BalancedChunks(tile=self.tile, min_chunk=cfg.balance_min_chunk, max_parts=cfg.balance_max_parts)

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def __call__(self, *args):
        """The config's arguments (``Sm90DecodeConfig.signature()``: a variant takes only the ones
        it uses, each costs host time per call) and the stream. Arguments a variant does not
        take are passed to :meth:`launch` as unused placeholders."""
        a = bind_arguments(self.arg_names, args)
        mQ, mBlockTable, mSeqLens, mO, mLse = a["q"], a["block_table"], a["seq_lens"], a["out"], a["lse"]
        if const_expr(self.cfg.kv_form == "single"):
            mKc = mVc = a["kv_cache"]
        else:
            mKc, mVc = a["k_cache"], a["v_cache"]
        mPartO, mPartLse, mCounter, num_splits = mO, mLse, mSeqLens, 1
        if const_expr(self.cfg.merge == "global"):
            mPartO, mPartLse, mCounter = a["part_out"], a["part_lse"], a["counters"]
            num_splits = mPartO.shape[0]
            if const_expr(self.cfg.balanced):
                num_splits = mPartO.shape[0] // 2  # chunks per KV head: each has two partial slots
        elif const_expr(self.cfg.merge == "cluster"):
            num_splits = a["num_splits"]
        # the window / sink variants' runtime inputs (absent from the other variants' launches)
        mSinks = a["sinks"] if const_expr(self.cfg.sinks) else None
        window_left = a["window_left"] if const_expr(self.cfg.window) else None
        self.launch(mQ, mKc, mVc, mBlockTable, mSeqLens, mO, mLse, mPartO, mPartLse, mCounter, a["k_scale"],
                    a["v_scale"], a["sm_scale"], num_splits, a["stream"], mSinks, window_left)

    @cute.jit
    def launch(
        self,
        mQ: cute.Tensor,  # [T, Hq, D]
        mKc: cute.Tensor,  # 5-D cache (then mVc is the same tensor) or K ...
        mVc: cute.Tensor,  # ... and V
        mBlockTable: cute.Tensor,  # [B, max_pages] int32
        mSeqLens: cute.Tensor,  # [B] int32
        mO: cute.Tensor,  # [T, Hq, D] in the query's dtype
        mLse: cute.Tensor,  # [T, Hq] fp32
        mPartO: cute.Tensor,  # global merge: [S, T, Hq, D] fp32 partials (else: mO again, unused)
        mPartLse: cute.Tensor,  # global merge: [S, T, Hq] (else: mLse again, unused)
        mCounter: cute.Tensor,  # global merge: int32 [>= B * Hkv] arrival counters, zero between launches
        k_scale,  # Float32 or [1] fp32 tensor
        v_scale,
        sm_scale: Float32,
        num_splits,  # the grid's split count (1 without split)
        stream,
        mSinks=None,  # sinks: [Hq] fp32 sink logits (natural log)
        window_left=None,  # window: Int32, -1 = no window
    ):
        D, N = self.D, self.N
        cfg = self.cfg
        # (token, d, head, page) views of the caches, taken inside the kernel's host function so
        # that the torch side never slices (each torch view op costs microseconds per call)
        if const_expr(cfg.kv_form == "single"):
            mK4 = mKc[None, 0, None, None, None]
            mV4 = mVc[None, 1, None, None, None]
        else:
            mK4, mV4 = mKc, mVc
        tok, head = (2, 1) if const_expr(cfg.kv_layout == "HND") else (1, 2)
        mK = cute.make_tensor(mK4.iterator, cute.select(mK4.layout, mode=[tok, 3, head, 0]))
        mVt = cute.make_tensor(mV4.iterator, cute.select(mV4.layout, mode=[3, tok, head, 0]))  # (d, tok, ...)
        mV = cute.make_tensor(mV4.iterator, cute.select(mV4.layout, mode=[tok, 3, head, 0]))

        mma_dtype = self.mma_dtype
        qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout = swap_ab_mmas(
            D, N, self.tile, self.stages, self.kv_dtype, mma_dtype, self.fp8, self.mma_m)
        # one TMA box = `box` tokens of one page x the full head dim
        tma_k, tma_tK, tma_v, tma_tV = self.kv.make_tma_atoms(mK, mV, mVt, N, self.kv_dtype)

        @cute.struct
        class Storage:
            k_bar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            v_bar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            red: cute.struct.MemRange[Float32, self.warps * cfg.n_pad]
            flag: cute.struct.MemRange[Int32, 4]
            # dynamic: the tile each K stage holds; balanced: the chunk walk's state (6)
            tile_id: cute.struct.MemRange[Int32, max(cfg.stages, 6) if cfg.balanced else cfg.stages]
            sK: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, cute.cosize(k_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, cute.cosize(v_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(q_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(p_layout)], 1024]

        self.storage = Storage
        num_kv_heads = mK4.shape[head]
        batch = mBlockTable.shape[0]
        if const_expr(cfg.balanced):
            batch = 1  # a chunk finds its requests from the lengths
        kernel = self.kernel(
            mQ, tma_k, tma_tK, tma_v, tma_tV, mK4.shape[0], mBlockTable, mSeqLens, mO, mLse, mPartO, mPartLse,
            mCounter, k_scale, v_scale, sm_scale, qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout,
            mSinks, window_left,
        )
        # cluster merge: the splits of one (KV head, request) form one cluster and merge through DSMEM
        kernel.launch(grid=[num_splits, num_kv_heads, batch], block=[self.num_threads, 1, 1], stream=stream,
                      cluster=[num_splits, 1, 1] if const_expr(cfg.cluster) else None,
                      min_blocks_per_mp=cfg.occupancy, preferred_smem_carveout=100, use_pdl=cfg.pdl)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        num_pages: Int32,
        mBlockTable: cute.Tensor,
        mSeqLens: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        mCounter: cute.Tensor,
        k_scale,
        v_scale,
        sm_scale: Float32,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        k_layout,
        v_layout,
        q_layout,
        p_layout,
        mSinks,
        window_left,
    ):
        D, N = self.D, self.N
        tidx, _, _ = cute.arch.thread_idx()
        split, kv_head, batch_idx = cute.arch.block_idx()
        num_splits = cute.arch.grid_dim()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        if const_expr(self.cfg.prefetch_desc):
            if warp == self.producer_warp:
                # the TMA descriptors are kernel parameters, not outputs of the previous kernel:
                # fetching them now keeps that round trip off the first page load after the wait
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sRed = storage.red.get_tensor(cute.make_layout((self.warps, N), stride=(N, 1)))

        kv_bytes = self.tile * D * self.kv_dtype.width // 8
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.k_bar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.warps),
            tx_count=kv_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True,
        )
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.v_bar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.warps),
            tx_count=kv_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        if const_expr(self.cfg.cluster_init_sync):
            # the whole cluster, not only this CTA, past the barriers' initialization before any TMA
            # completes on them, as CUTLASS's cluster kernels order it
            # (docs/design/sm90-decode.md#cluster-merge-exit)
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if const_expr(self.cfg.pdl):
            # a programmatic dependent launch may start while the previous kernel in the stream
            # still runs: everything above touched only shared memory; from here on we read its
            # outputs (and overwrite what it may read), which is safe after this wait
            cute.arch.griddepcontrol_wait()

        if const_expr(self.cfg.balanced):
            # the chunk of the batch's tiles this CTA takes, from the lengths (balanced schedule)
            self.run_chunk(mQ, tma_k, mK, tma_v, mV, num_pages, mBlockTable, mSeqLens, mO, mLse, mPartO, mPartLse,
                           mCounter, k_scale, v_scale, sm_scale, qk_mma, pv_mma, k_layout, v_layout,
                           (sK, sV, sQ, sP, sRed), storage, pipe_k, pipe_v, kv_head, tidx, warp, lane)
        else:
            # this CTA's tiles: split s takes a contiguous chunk of the request's tiles, or (strided)
            # tiles s, s + S, s + 2 S, ..., whose page-table entries are known before seq_len: the
            # producer's first lookup is issued ahead of the seq_len load (nothing that waits for
            # seq_len may come before it, or the two loads are serialized again)
            first_raw = Int32(-1)
            if const_expr(self.cfg.strided and not self.cfg.window):
                # every warp loads (a branch on the role would let ptxas put seq_len's uses first)
                first_raw = self.kv.load_page_raw(mBlockTable, batch_idx,
                                                  self.kv.box_of(split, num_splits, Int32(0), lane), predicated=True)
            seq_len = mSeqLens[batch_idx]
            # positions at or past the block table's capacity are not attended, so the tiles end there
            # (a seq_len past it, even a corrupted huge one, costs no more than a full table):
            # docs/design/inputs.md#lengths
            kv_cap = mBlockTable.shape[1] * self.page
            num_tiles = (cutlass.min(seq_len, kv_cap) + self.tile - 1) // self.tile
            tile_step = Int32(1)
            key_lo = None
            if const_expr(self.cfg.window):
                # the oldest draft row's window start: tiles (and pages) wholly before it are never
                # loaded; the schedule spreads the remaining tiles over the splits
                key_lo = window_start(seq_len - self.q_len, window_left)
                first_tile = key_lo // self.tile
                if const_expr(self.cfg.strided):
                    tile_begin = first_tile + split
                    tile_step = num_splits
                    tile_end = num_tiles
                else:
                    per_split = (num_tiles - first_tile + num_splits - 1) // num_splits
                    tile_begin = first_tile + split * per_split
                    tile_end = cutlass.min(tile_begin + per_split, num_tiles)
            elif const_expr(self.cfg.strided):
                tile_begin = split
                tile_step = num_splits
                tile_end = num_tiles
            else:
                per_split = (num_tiles + num_splits - 1) // num_splits
                tile_begin = split * per_split
                tile_end = cutlass.min(tile_begin + per_split, num_tiles)

            sTileId = storage.tile_id.get_tensor(cute.make_layout(self.stages))
            if warp == self.producer_warp:
                if const_expr(self.cfg.dynamic):
                    # this item's chunk counter sits behind the B x Hkv arrival counters
                    grab = mCounter.iterator + (cute.arch.grid_dim()[2] * cute.arch.grid_dim()[1]
                                                + batch_idx * cute.arch.grid_dim()[1] + kv_head)
                    self.kv.produce_dynamic(tma_k, mK, tma_v, mV, sK, sV, pipe_k, pipe_v, mBlockTable, num_pages,
                                         batch_idx, kv_head, seq_len, num_tiles, grab, sTileId, lane)
                else:
                    self.kv.produce(tma_k, mK, tma_v, mV, sK, sV, pipe_k, pipe_v, mBlockTable, num_pages,
                                 batch_idx, kv_head, seq_len, tile_begin, tile_end, tile_step, lane, first_raw, key_lo)
            else:
                k_base = storage.sK.data_ptr().toint()
                v_base = storage.sV.data_ptr().toint()
                sFlag = storage.flag.get_tensor(cute.make_layout(4))
                merge = (mPartO, mPartLse, mCounter, sFlag, num_splits)
                self.consume(mQ, sK, sV, sQ, sP, sRed, pipe_k, pipe_v, mO, mLse, k_scale, v_scale, sm_scale,
                             qk_mma, pv_mma, k_layout, v_layout, k_base, v_base, batch_idx, kv_head, split,
                             seq_len, kv_cap, tile_begin, tile_end, tile_step, tidx, warp, lane, merge, sTileId, mSinks,
                             window_left)
            if const_expr(self.cfg.cluster):
                # every thread of the CTA, the producer warp too: the cluster barriers count them all
                self.split_merge.cluster_merge(mO, mLse, storage.sK.data_ptr().toint())

    @cute.jit
    def run_chunk(self, mQ, tma_k, mK, tma_v, mV, num_pages, mBlockTable, mSeqLens, mO, mLse, mPartO, mPartLse,
                  mCounter, k_scale, v_scale, sm_scale, qk_mma, pv_mma, k_layout, v_layout, smem, storage, pipe_k,
                  pipe_v, kv_head, tidx, warp, lane):
        """Balanced schedule: this CTA's chunk of the batch's tiles (for its KV head), request segment
        after request segment, the producer and the consumers walking the same segments with their
        pipeline states carried across them (docs/design/sm90-decode.md#balanced-schedule-opt-in)."""
        sK, sV, sQ, sP, sRed = smem
        chunk = cute.arch.block_idx()[0]
        chunks = cute.arch.grid_dim()[0]
        kv_cap = mBlockTable.shape[1] * self.page
        start, end, request, first, q, r = self.chunks.locate(mSeqLens, kv_cap, chunk, chunks, lane)
        # the walk: request `request` starts at unit `first`; this chunk is at unit max(first, start)
        if warp == self.producer_warp:
            state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            while cutlass.max(first, start) < end:
                seq_len = mSeqLens[request]
                units, _, lo, hi, *_ = self.chunks.segment(seq_len, kv_cap, chunk, chunks, start, end, first, q, r)
                state_k, state_v = self.kv.produce(tma_k, mK, tma_v, mV, sK, sV, pipe_k, pipe_v, mBlockTable,
                                                   num_pages, request, kv_head, seq_len, lo, hi, Int32(1), lane,
                                                   Int32(-1), states=(state_k, state_v))
                first = first + units
                request = request + 1
        else:
            # The walk's state waits in shared memory (the dynamic schedule's tile ids, unused here):
            # the chunk's bounds, the partition's quotients, the current request and its first unit,
            # the tiles consumed so far (the pipelines' position), read with volatile loads where
            # used; the CTA's indices are read again per segment. Kept in registers through the
            # consumer's loop and its merges, they made the larger variants spill.
            sWalk = storage.tile_id.get_tensor(cute.make_layout(7))
            walk = storage.tile_id.data_ptr().toint()
            if tidx == 0:
                sWalk[0], sWalk[1], sWalk[2], sWalk[3], sWalk[4], sWalk[5] = start, end, q, r, first, request
                sWalk[6] = Int32(0)
            cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)
            sFlag = storage.flag.get_tensor(cute.make_layout(4))
            sTileId = storage.tile_id.get_tensor(cute.make_layout(self.stages))
            while cutlass.max(load_shared_i32(walk + 16), load_shared_i32(walk)) < load_shared_i32(walk + 4):
                seq_len = mSeqLens[load_shared_i32(walk + 20)]
                _, _, lo, hi, *_ = self.walk_segment(seq_len, mBlockTable, walk)
                self.consume(
                    mQ, sK, sV, sQ, sP, sRed, pipe_k, pipe_v, mO, mLse, k_scale, v_scale, sm_scale, qk_mma, pv_mma,
                    k_layout, v_layout, storage.sK.data_ptr().toint(), storage.sV.data_ptr().toint(),
                    load_shared_i32(walk + 20), special_register("ctaid.y"), Int32(0), seq_len,
                    mBlockTable.shape[1] * self.page, lo, hi, Int32(1), tidx, warp, lane,
                    (mPartO, mPartLse, mCounter, sFlag, None), sTileId,
                    segment=(load_shared_i32(walk + 24),
                             lambda seq_len=seq_len: self.walk_segment(seq_len, mBlockTable, walk)[4:]))
                # every warp is done with this segment (its reads of the walk, sRed, sFlag): move the walk on
                cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)
                if tidx == 0:
                    units, _, lo, hi, *_ = self.walk_segment(mSeqLens[sWalk[5]], mBlockTable, walk)
                    sWalk[4] = sWalk[4] + units
                    sWalk[5] = sWalk[5] + 1
                    sWalk[6] = sWalk[6] + hi - lo
                cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)
            if const_expr(self.cfg.pdl):
                cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def walk_segment(self, seq_len, mBlockTable, walk):
        """The consumers' current segment (:meth:`BalancedChunks.segment`) from the walk's state in
        shared memory at ``walk`` (``run_chunk``: start, end, q, r, first unit, request, tiles
        consumed) and the CTA's indices, read again."""
        start, end, q, r, first = (load_shared_i32(walk + 4 * i) for i in range(5))
        return self.chunks.segment(seq_len, mBlockTable.shape[1] * self.page, special_register("ctaid.x"),
                                   special_register("nctaid.x"), start, end, first, q, r)

    @cute.jit
    def consume(self, mQ, sK, sV, sQ, sP, sRed, pipe_k, pipe_v, mO, mLse, k_scale, v_scale, sm_scale,
                qk_mma, pv_mma, k_layout, v_layout, k_base, v_base, batch_idx, kv_head, split,
                seq_len, kv_cap, tile_begin, tile_end, tile_step, tidx, warp, lane, merge, sTileId, mSinks=None,
                window_left=None, segment=None):
        """One request's tiles ``tile_begin, tile_begin + tile_step, ... < tile_end``: stage Q,
        the pipelined QK / softmax / PV loop, the epilogue (output, split partial, merges).
        ``segment`` (balanced schedule): ``(consumed, where)``, the tiles the chunk's earlier
        segments consumed (the pipelines' position: K and V advance together) and a function giving
        where the result goes, ``(whole, slot, parts, slot0, c0)``
        (:func:`cute_kernels.roles.balanced_chunks.segment_of`), called after the main loop so
        that none of it is live through the loop."""
        cfg = self.cfg
        mPartO, mPartLse, mCounter, sFlag, num_splits = merge
        D, N, G = self.D, self.N, self.G
        q_log2 = self.query.stage_q(mQ, sQ, sRed, batch_idx, kv_head, tidx, warp, lane)
        cute.arch.fence_proxy("async.shared", space="cta")  # sQ is read by WGMMA (async proxy)
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)

        if const_expr(isinstance(k_scale, cute.Tensor)):
            ks = k_scale[0]
        else:
            ks = Float32(k_scale)
        if const_expr(isinstance(v_scale, cute.Tensor)):
            vs = v_scale[0]
        else:
            vs = Float32(v_scale)
        # logits in log2 units = S_acc * c
        c = sm_scale * ks * Float32(LOG2E * 2.0 ** self.logit_log2) * cute.math.exp2(-q_log2 + Float32(self.q_pre), fastmath=False)

        thr_qk, thr_pv, cS0, cS, cO0, acc_s, acc_o, row_max, row_sum = self.softmax.consumer_state(qk_mma, pv_mma, tidx)
        nS = cute.size(acc_s)
        n_base = cS[0][1] - cS0[0][1]  # this thread's column offset (2 * (lane % 4))
        m_base = cS[0][0] - cS0[0][0]  # this thread's row offset (lane / 4 + 16 * warp)
        nslots = N // 4  # columns owned by a thread: 8 * j + n_base + {0, 1}
        limit = cute.make_rmem_tensor((nslots,), Int32)
        for s in cutlass.range_constexpr(nslots):
            n = slot_column(s, n_base)
            # query row n is draft token n // G: it sees positions < seq_len - q_len + j + 1, and
            # none at or past the block table's capacity
            limit[s] = cutlass.min(seq_len - self.q_len + n // G + 1, kv_cap)
        if const_expr(cfg.window):
            # ... and (window_left = w >= 0) positions >= its own position - w
            lower = cute.make_rmem_tensor((nslots,), Int32)
            for s in cutlass.range_constexpr(nslots):
                lower[s] = Int32(0)
                if window_left >= 0:
                    lower[s] = seq_len - self.q_len + slot_column(s, n_base) // G - window_left

        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        tSrQ = qk_mma.make_fragment_B(thr_qk.partition_B(sQ))
        tOrP = pv_mma.make_fragment_B(thr_pv.partition_B(sP))
        if const_expr(self.fp8):
            tSrK = cute.make_rmem_tensor(thr_qk.partition_A(cute.make_identity_tensor((self.tile, D))).shape, self.mma_dtype)
            tOrV = cute.make_rmem_tensor(thr_pv.partition_A(cute.make_identity_tensor((D, self.tile))).shape, self.mma_dtype)
        else:
            tSrK = qk_mma.make_fragment_A(thr_qk.partition_A(sK))
            tOrV = pv_mma.make_fragment_A(thr_pv.partition_A(sV))

        if const_expr(segment is None):
            state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        else:
            consumed, where = segment
            index, phase = consumed % self.stages, (consumed // self.stages) % 2
            state_k = pipeline.PipelineState(self.stages, consumed, index, phase)
            state_v = pipeline.PipelineState(self.stages, consumed, index, phase)
        mma = (qk_mma, pv_mma, acc_s, acc_o, tSrK, tSrQ, tOrV, tOrP)
        # Software pipeline: QK(t+1) is issued right behind PV(t), so the widening of K(t+1)
        # runs while PV(t) is in the tensor cores and the two MMAs overlap. The tile sequence is
        # this CTA's static range, or (dynamic split) whatever the producer took, read from the
        # K stage (-1 ends it).
        tile = self.kv.next_tile(pipe_k, state_k, sTileId, tile_begin - tile_step, tile_end, tile_step)
        if tile >= 0:
            self.issue_qk(mma, pipe_k, state_k, k_base, k_layout, warp, lane)
        while tile >= 0:
            warpgroup.wait_group(0)  # S(tile) is complete (O(tile - 1) was waited for below)
            pipe_k.consumer_release(state_k)
            state_k.advance()

            # ---------------- online softmax over the tile's tokens ----------------
            masked = (tile + 1) * self.tile > cutlass.min(seq_len - self.q_len + 1, kv_cap)
            if const_expr(cfg.window):
                if window_left >= 0:
                    if tile * self.tile < seq_len - 1 - window_left:  # the newest row's window start
                        masked = True
            tile_max = cute.make_rmem_tensor((nslots,), Float32)
            tile_max.fill(-Float32.inf)
            for i in cutlass.range_constexpr(nS):
                s_val = acc_s[i] * c
                sl = slot_of(cS0[i][1])
                if masked:
                    pos = tile * self.tile + cS0[i][0] + m_base
                    if pos >= limit[sl]:
                        s_val = -Float32.inf
                    if const_expr(cfg.window):
                        if pos < lower[sl]:
                            s_val = -Float32.inf
                acc_s[i] = s_val
                tile_max[sl] = cute.arch.fmax(tile_max[sl], s_val)
            self.softmax.softmax_tile(acc_s, acc_o, tile_max, row_max, row_sum, sRed, sP, cS0, cO0, n_base, m_base, warp,
                              lane)

            # ---------------- O^T += V^T P^T, then S^T(tile + 1) = K Q^T ----------------
            pipe_v.consumer_wait(state_v)
            if const_expr(self.fp8):
                self.frags.load_v_fragments(tOrV, v_base, v_layout, state_v.index, warp, lane)
                if const_expr(self.cvt):
                    if masked:
                        self.frags.zero_v_fragment_tail(tOrV, seq_len - tile * self.tile, lane)
            else:
                if masked:
                    self.zero_v_tail(sV, state_v.index, seq_len - tile * self.tile, tidx)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(self.tile // 16):
                if const_expr(self.fp8):
                    cute.gemm(pv_mma, acc_o, tOrV[None, None, kb], tOrP[None, None, kb, 0], acc_o)
                else:
                    cute.gemm(pv_mma, acc_o, tOrV[None, None, kb, state_v.index], tOrP[None, None, kb, 0], acc_o)
            warpgroup.commit_group()
            nxt = self.kv.next_tile(pipe_k, state_k, sTileId, tile, tile_end, tile_step)
            if nxt >= 0:
                self.issue_qk(mma, pipe_k, state_k, k_base, k_layout, warp, lane)
                warpgroup.wait_group(1)  # O(tile) done; S(tile + 1) may still run
            else:
                warpgroup.wait_group(0)
            pipe_v.consumer_release(state_v)
            state_v.advance()
            tile = nxt

        if const_expr(cfg.pdl and not cfg.balanced):  # (balanced: once the chunk's last segment is done)
            # only the epilogue is left: the next kernel in the stream may start launching (its
            # CTAs take the SM slots ours free and wait in griddepcontrol.wait for our writes)
            cute.arch.griddepcontrol_launch_dependents()
        # ---------------- epilogue ----------------
        if const_expr(segment is not None):
            whole, slot, parts, slot0, c0 = where()
            if const_expr(self.fp8):
                # the thread's indices read again: the epilogue's index math, the same in every
                # segment, is then not hoisted out of the chunk's loop into registers live through
                # the main loop (the FP8 kernel spilled). Its WGMMAs are serialized anyway
                # (docs/design/sm90-decode.md#occupancy-against-wgmma-serialization); in the 16-bit
                # kernels this re-read made ptxas serialize them (C7520)
                tidx = special_register("tid.x")
                warp = cute.arch.make_warp_uniform(tidx // 32)
                lane = tidx % 32
                thr_pv = pv_mma.get_slice(tidx)
                n_base = 2 * (lane % 4)
            else:
                # nothing is in flight: said where every thread is, so that ptxas does not wait for
                # the WGMMAs on a divergent path of the chunk's loop and serialize them (C7518)
                warpgroup.wait_group(0)
        self.softmax.publish_slot_reduction(row_sum, sRed, n_base, warp, lane, lambda a, b: a + b)
        inv = cute.make_rmem_tensor((nslots,), Float32)
        for s in cutlass.range_constexpr(nslots):
            n = slot_column(s, n_base)
            total = sRed[0, n] + sRed[1, n] + sRed[2, n] + sRed[3, n]
            inv[s] = Float32(0.0)
            lse = -Float32.inf
            if const_expr(cfg.sinks):
                # the sink joins the denominator once: unsplit, or in split 0 (the merge adds the rest)
                m_row = row_max[s]
                keep = Float32(1.0)
                if split == 0:
                    head_sink = kv_head * G + cutlass.min(n, Int32(self.rows - 1)) % G
                    m_row, total, keep = fold_sink(m_row, total, mSinks[head_sink] * Float32(LOG2E))
                if total > Float32(0.0):
                    inv[s] = vs * keep * Float32(2.0 ** self.out_log2) / total
                    lse = m_row + cute.math.log2(total, fastmath=True)
            elif total > Float32(0.0):
                inv[s] = vs * Float32(2.0 ** self.out_log2) / total
                lse = row_max[s] + cute.math.log2(total, fastmath=True)
            if warp == 0:
                if lane < 4:
                    if n < self.rows:
                        token = batch_idx * self.q_len + n // G
                        head = kv_head * G + n % G
                        if const_expr(cfg.cluster):
                            store_shared_f32(k_base + self.split_merge.part_lse_offset(n), lse)
                        elif const_expr(cfg.balanced):
                            if whole == 1:
                                mLse[token, head] = lse
                            else:  # a partial slot holds one request's rows: (slot, draft token, head)
                                mPartLse[slot, n // G, head] = lse
                        elif const_expr(cfg.split):
                            mPartLse[split, token, head] = lse
                        else:
                            mLse[token, head] = lse
        cO = thr_pv.partition_C(cute.make_identity_tensor((D, N)))
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            n = cO[i][1]
            if n < self.rows:
                d = self.frags.physical_d(cO0[i][0], cO[i][0] - cO0[i][0])
                token = batch_idx * self.q_len + n // G
                head = kv_head * G + n % G
                val = acc_o[i] * inv[slot_of(cO0[i][1])]
                if const_expr(cfg.cluster):
                    # the K stages are free now (every tile consumed, no TMA in flight)
                    store_shared_f32(k_base + (n * D + d) * 4, val)
                elif const_expr(cfg.balanced):
                    if whole == 1:
                        mO[token, head, d] = val.to(mO.element_type)
                    else:
                        mPartO[slot, n // G, head, d] = val
                elif const_expr(cfg.split):
                    mPartO[split, token, head, d] = val
                else:
                    mO[token, head, d] = val.to(mO.element_type)
        if const_expr(cfg.balanced):
            if whole == 0:  # the last of the request's chunks to arrive merges its partials in chunk order
                self.split_merge.merge_splits(mO, mLse, mPartO, mPartLse, mCounter, sFlag, parts, batch_idx, kv_head,
                                              tidx, (k_base, v_base), slots=(slot0, c0))
        elif const_expr(cfg.split and not cfg.cluster):
            self.split_merge.merge_splits(mO, mLse, mPartO, mPartLse, mCounter, sFlag, num_splits, batch_idx, kv_head, tidx,
                              (k_base, v_base))
        return state_k, state_v

    @cute.jit
    def issue_qk(self, mma, pipe_k, state_k, k_base, k_layout, warp, lane):
        """Wait for K(tile), widen it (FP8) and issue S^T = K Q^T as one commit group."""
        qk_mma, pv_mma, acc_s, acc_o, tSrK, tSrQ, tOrV, tOrP = mma
        pipe_k.consumer_wait(state_k)
        if const_expr(self.fp8):
            self.frags.load_k_fragments(tSrK, k_base, k_layout, state_k.index, warp, lane)
        # local atoms: mutating the shared tiled MMA's accumulate flag inside a branch would leak
        # a value out of that branch
        first = cute.make_mma_atom(qk_mma.op)
        first.set(warpgroup.Field.ACCUMULATE, False)
        rest = cute.make_mma_atom(qk_mma.op)
        rest.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(self.D // 16):
            atom = first if kb == 0 else rest
            if const_expr(self.fp8):
                cute.gemm(atom, acc_s, tSrK[None, None, kb], tSrQ[None, None, kb, 0], acc_s)
            else:
                cute.gemm(atom, acc_s, tSrK[None, None, kb, state_k.index], tSrQ[None, None, kb, 0], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def zero_v_tail(self, sV, stage, valid, tidx):
        """16-bit caches: zero V^T columns (tokens) >= valid in this stage, so that stale
        (possibly NaN) cache rows past the sequence end cannot turn 0 * NaN into NaN."""
        D = self.D
        for it in cutlass.range_constexpr((D * self.tile + self.warps * 32 - 1) // (self.warps * 32)):
            idx = it * self.warps * 32 + tidx
            d = idx % D
            t = idx // D
            if t < self.tile and t >= valid:
                sV[d, t, stage] = sV.element_type(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)
