"""SM90 paged decode: BF16/FP16 queries against an FP8 (or BF16/FP16) paged KV cache.

Design (numbers and the alternatives measured are in profiling/NOTES.md):

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
  ``ldmatrix`` (V with ``.trans``) and widened exactly to the query's 16-bit type with bit
  operations (see ``fragments.py``), then fed to RS WGMMA: QK keeps 16-bit precision and no
  16-bit copy of the tile is ever written to shared memory. The widening scales K and V by a
  power of two; Q and P are pre-scaled by powers of two so every product stays in fp32's normal
  range, and all of it folds into the logit scale and the output scale.
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

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..jit.dtypes import cute_dtype
from ..jit.spec import bind_arguments
from ..roles.fragments import (
    EVICT_FIRST_POLICY,
    WIDEN_SHIFT_LOG2,
    cp_async_16,
    cvt_e4m3x4_f16,
    ldmatrix_x4,
    load_b32_if,
    load_cg_f32x4,
    load_dsmem_f32,
    load_dsmem_f32x4,
    load_shared_f32,
    load_shared_f32x4,
    q_permutation,
    special_register,
    store_shared_f32,
    widen_e4m3x4,
)
from ..roles.merge import add_split

MMA_M = 64
MMA_WARPS = 4
PRODUCER_WARP = MMA_WARPS
NUM_THREADS = (MMA_WARPS + 1) * 32
BAR_MMA = 1  # named barrier of the consumer warpgroup (0 is __syncthreads)
LOG2E = math.log2(math.e)


def slot_of(n_static: int) -> int:
    """Register slot of accumulator column ``n_static`` (thread 0's columns 8 j + {0, 1})."""
    return (n_static // 8) * 2 + n_static % 8


def slot_column(s: int, n_base):
    """The accumulator column of register slot ``s`` for a thread whose columns start at
    ``n_base`` (2 (lane % 4)): the inverse of :func:`slot_of`, plus the thread's offset."""
    return (s // 2) * 8 + s % 2 + n_base
# Powers of two applied to Q and P before they enter an MMA whose K/V operand was widened from
# FP8 (K/V scaled by 2^-WIDEN): keeps every product and partial sum in fp32's normal range.
Q_PRESCALE_LOG2 = {"bf16": 64, "fp16": 0}
P_PRESCALE_LOG2 = {"bf16": 64, "fp16": 0}


class Sm90PagedDecode:
    """Kernel object; all fields are compile-time (see :class:`Sm90DecodeConfig`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.arg_names = cfg.arg_names()
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
        self.box = min(cfg.page_size, self.tile)  # tokens per TMA box
        self.boxes_per_tile = self.tile // self.box
        # dynamic split: tiles per grab (their page ids must fit one per lane of the producer warp)
        self.chunk_tiles = max(1, min(cfg.chunk_tiles_max, 32 // self.boxes_per_tile))
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
        elif const_expr(self.cfg.merge == "cluster"):
            num_splits = a["num_splits"]
        self.launch(mQ, mKc, mVc, mBlockTable, mSeqLens, mO, mLse, mPartO, mPartLse, mCounter, a["k_scale"],
                    a["v_scale"], a["sm_scale"], num_splits, a["stream"])

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
        qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout = self.mmas_and_layouts()

        # one TMA box = `box` tokens of one page x the full head dim
        box = self.box
        k_box_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (box, N, D), self.kv_dtype, 1)
        tma_k, tma_tK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(k_box_layout, (None, None, 0)), (box, D)
        )
        if const_expr(self.fp8):
            tma_v, tma_tV = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mV, cute.slice_(k_box_layout, (None, None, 0)), (box, D)
            )
        else:
            v_box_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (D, N, box), self.kv_dtype, 1)
            tma_v, tma_tV = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mVt, cute.slice_(v_box_layout, (None, None, 0)), (D, box)
            )

        @cute.struct
        class Storage:
            k_bar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            v_bar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            red: cute.struct.MemRange[Float32, MMA_WARPS * cfg.n_pad]
            flag: cute.struct.MemRange[Int32, 4]
            tile_id: cute.struct.MemRange[Int32, cfg.stages]  # dynamic: the tile each K stage holds
            sK: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, cute.cosize(k_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.kv_dtype, cute.cosize(v_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(q_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(p_layout)], 1024]

        self.storage = Storage
        num_kv_heads = mK4.shape[head]
        batch = mBlockTable.shape[0]
        kernel = self.kernel(
            mQ, tma_k, tma_tK, tma_v, tma_tV, mK4.shape[0], mBlockTable, mSeqLens, mO, mLse, mPartO, mPartLse,
            mCounter, k_scale, v_scale, sm_scale, qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout,
        )
        # cluster merge: the splits of one (KV head, request) form one cluster and merge through DSMEM
        kernel.launch(grid=[num_splits, num_kv_heads, batch], block=[NUM_THREADS, 1, 1], stream=stream,
                      cluster=[num_splits, 1, 1] if const_expr(cfg.cluster) else None,
                      min_blocks_per_mp=cfg.occupancy, preferred_smem_carveout=100, use_pdl=cfg.pdl)

    def mmas_and_layouts(self):
        """The two tiled WGMMAs (swap-AB: KV tokens on M, the group's query rows on N; A from
        registers for FP8, from shared memory for 16-bit caches) and the shared-memory layouts:
        K tiles (tokens, D) K-major on both paths; V stored the same way for FP8 (ldmatrix.trans
        reads it) and as MN-major V^T for 16-bit SS; Q and P as the B operands. Shared with QSA."""
        D, N, mma_dtype = self.D, self.N, self.mma_dtype
        a_src = warpgroup.OperandSource.RMEM if self.fp8 else warpgroup.OperandSource.SMEM
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            mma_dtype, mma_dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
            tiler_mn=(MMA_M, N), a_source=a_src,
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            mma_dtype, mma_dtype, OperandMajorMode.K if self.fp8 else OperandMajorMode.MN,
            OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(MMA_M, N), a_source=a_src,
        )
        k_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile, N, D), self.kv_dtype, self.stages)
        if self.fp8:
            v_layout = k_layout
        else:
            v_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (D, N, self.tile), self.kv_dtype, self.stages)
        q_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.tile, N, D), mma_dtype, 1)
        p_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (D, N, self.tile), mma_dtype, 1)
        return qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout

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
    ):
        D, N = self.D, self.N
        tidx, _, _ = cute.arch.thread_idx()
        split, kv_head, batch_idx = cute.arch.block_idx()
        num_splits = cute.arch.grid_dim()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        if const_expr(self.cfg.prefetch_desc):
            if warp == PRODUCER_WARP:
                # the TMA descriptors are kernel parameters, not outputs of the previous kernel:
                # fetching them now keeps that round trip off the first page load after the wait
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sRed = storage.red.get_tensor(cute.make_layout((MMA_WARPS, N), stride=(N, 1)))

        kv_bytes = self.tile * D * self.kv_dtype.width // 8
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.k_bar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_WARPS),
            tx_count=kv_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True,
        )
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.v_bar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_WARPS),
            tx_count=kv_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if const_expr(self.cfg.pdl):
            # a programmatic dependent launch may start while the previous kernel in the stream
            # still runs: everything above touched only shared memory; from here on we read its
            # outputs (and overwrite what it may read), which is safe after this wait
            cute.arch.griddepcontrol_wait()

        # this CTA's tiles: split s takes a contiguous chunk of the request's tiles, or (strided)
        # tiles s, s + S, s + 2 S, ..., whose page-table entries are known before seq_len: the
        # producer's first lookup is issued ahead of the seq_len load (nothing that waits for
        # seq_len may come before it, or the two loads are serialized again)
        first_raw = Int32(-1)
        if const_expr(self.cfg.strided):
            # every warp loads (a branch on the role would let ptxas put seq_len's uses first)
            first_raw = self.load_page_raw(mBlockTable, batch_idx, self.box_of(split, num_splits, Int32(0), lane),
                                           predicated=True)
        seq_len = mSeqLens[batch_idx]
        num_tiles = (seq_len + self.tile - 1) // self.tile
        tile_step = Int32(1)
        if const_expr(self.cfg.strided):
            tile_begin = split
            tile_step = num_splits
            tile_end = num_tiles
        else:
            per_split = (num_tiles + num_splits - 1) // num_splits
            tile_begin = split * per_split
            tile_end = cutlass.min(tile_begin + per_split, num_tiles)

        sTileId = storage.tile_id.get_tensor(cute.make_layout(self.stages))
        if warp == PRODUCER_WARP:
            if const_expr(self.cfg.dynamic):
                # this item's chunk counter sits behind the B x Hkv arrival counters
                grab = mCounter.iterator + (cute.arch.grid_dim()[2] * cute.arch.grid_dim()[1]
                                            + batch_idx * cute.arch.grid_dim()[1] + kv_head)
                self.produce_dynamic(tma_k, mK, tma_v, mV, sK, sV, pipe_k, pipe_v, mBlockTable, num_pages,
                                     batch_idx, kv_head, seq_len, num_tiles, grab, sTileId, lane)
            else:
                self.produce(tma_k, mK, tma_v, mV, sK, sV, pipe_k, pipe_v, mBlockTable, num_pages,
                             batch_idx, kv_head, seq_len, tile_begin, tile_end, tile_step, lane, first_raw)
        else:
            k_base = storage.sK.data_ptr().toint()
            v_base = storage.sV.data_ptr().toint()
            sFlag = storage.flag.get_tensor(cute.make_layout(4))
            merge = (mPartO, mPartLse, mCounter, sFlag, num_splits)
            self.consume(mQ, sK, sV, sQ, sP, sRed, pipe_k, pipe_v, mO, mLse, k_scale, v_scale, sm_scale,
                         qk_mma, pv_mma, k_layout, v_layout, k_base, v_base, batch_idx, kv_head, split,
                         seq_len, tile_begin, tile_end, tile_step, tidx, warp, lane, merge, sTileId)
        if const_expr(self.cfg.cluster):
            # every thread of the CTA, the producer warp too: the cluster barriers count them all
            self.cluster_merge(mO, mLse, storage.sK.data_ptr().toint())

    # ------------------------------------------------------------------------------------------

    @cute.jit
    def produce(self, tma_k, mK, tma_v, mV, sK, sV, pipe_k, pipe_v, mBlockTable, num_pages,
                batch_idx, kv_head, seq_len, tile_begin, tile_end, tile_step, lane, first_raw):
        """Static split: this CTA's tiles ``tile_begin, tile_begin + tile_step, ... < tile_end``."""
        nb = self.boxes_per_tile
        tKsK, tKgK, tVsV, tVgV = self.partition_tma(tma_k, mK, tma_v, mV, sK, sV, kv_head)
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        # Page ids are fetched 32 boxes at a time, one per lane, well ahead of their TMA. The
        # first batch: with strided splits it was loaded together with seq_len (``first_raw``:
        # one L2 round trip less before the first TMA of every split CTA).
        box0 = self.box_of(tile_begin, tile_step, Int32(0), lane)
        if const_expr(not self.cfg.strided):
            first_raw = self.load_page_raw(mBlockTable, batch_idx, box0)
        page_id = self.mask_page(first_raw, num_pages, seq_len, box0)
        k = Int32(0)
        for tile in cutlass.range(tile_begin, tile_end, tile_step, unroll=1):
            rel = k * nb  # box index relative to this CTA's first box
            if rel % 32 == 0 and k > 0:
                page_id = self.lookup_page(mBlockTable, num_pages, batch_idx, seq_len,
                                           self.box_of(tile_begin, tile_step, k, lane))
            k += 1
            pipe_k.producer_acquire(state_k)
            self.load_tile(tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, pipe_k, pipe_v, state_k, state_v, page_id, rel, tile)
            state_k.advance()
            state_v.advance()

    @cute.jit
    def partition_tma(self, tma_k, mK, tma_v, mV, sK, sV, kv_head):
        """TMA partitions of this KV head: (box, D, box-in-page, page) global views, stage tiles
        split into boxes."""
        D, box = self.D, self.box
        gK = cute.local_tile(mK[None, None, kv_head, None], (box, D), (None, 0, None))
        sK_boxes = cute.flat_divide(sK, (box, D))  # (box, D, nb, 1, stages)
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK_boxes, 0, 2), cute.group_modes(gK, 0, 2)
        )
        if const_expr(self.fp8):
            gV = cute.local_tile(mV[None, None, kv_head, None], (box, D), (None, 0, None))
            sV_boxes = cute.flat_divide(sV, (box, D))
        else:
            gV = cute.local_tile(mV[None, None, kv_head, None], (D, box), (0, None, None))
            sV_boxes = cute.flat_divide(sV, (D, box))  # (D, box, 1, nb, stages)
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(sV_boxes, 0, 2), cute.group_modes(gV, 0, 2)
        )
        return tKsK, tKgK, tVsV, tVgV

    def box_of(self, tile_begin, tile_step, k0, lane):
        """(Traced.) The box this lane looks up for the batch of 32 boxes starting at the CTA's
        ``k0``-th tile: box ``lane % nb`` of its ``(k0 + lane // nb)``-th tile."""
        nb = self.boxes_per_tile
        return (tile_begin + (k0 + lane // nb) * tile_step) * nb + lane % nb

    @cute.jit
    def lookup_page(self, mBlockTable, num_pages, batch_idx, seq_len, box_idx):
        """Physical page of box ``box_idx`` (one per lane); ``num_pages`` (out of range: TMA
        zero-fill) past the sequence, past the table or for an invalid id."""
        return self.mask_page(self.load_page_raw(mBlockTable, batch_idx, box_idx), num_pages, seq_len, box_idx)

    @cute.jit
    def load_page_raw(self, mBlockTable, batch_idx, box_idx, predicated: cutlass.Constexpr = False):
        """The block-table entry of box ``box_idx``, -1 past the table; read whatever the
        request's length (an address inside the table), so that it need not wait for it.
        ``predicated``: one predicated load instead of a branch around a load."""
        logical_page = box_idx * self.box // self.page
        raw = Int32(-1)
        if const_expr(predicated):
            inside = logical_page < mBlockTable.shape[1]
            lp = cutlass.min(logical_page, mBlockTable.shape[1] - 1)  # an address near the row when outside
            addr = mBlockTable.iterator + cute.crd2idx((batch_idx, lp), mBlockTable.layout)
            raw = load_b32_if(addr.toint(), Int32(inside), raw)
        else:
            if logical_page < mBlockTable.shape[1]:
                raw = mBlockTable[batch_idx, logical_page]
        return raw

    @cute.jit
    def mask_page(self, raw, num_pages, seq_len, box_idx):
        """``raw`` as a TMA page coordinate: ``num_pages`` (out of range: zero-fill) past the
        sequence or for an invalid id (negative ones too; clamped only to keep it int32)."""
        page_id = raw
        if box_idx * self.box >= seq_len or raw < 0 or raw >= num_pages:
            page_id = Int32(num_pages)
        return page_id

    @cute.jit
    def load_tile(self, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, pipe_k, pipe_v, state_k, state_v, page_id, rel, tile):
        """TMA of one tile's K (its stage already acquired) and V boxes; box j's page id is in
        lane (rel + j) % 32."""
        nb = self.boxes_per_tile
        boxes_per_page = self.page // self.box
        for j in cutlass.range_constexpr(nb):
            pid = cute.arch.shuffle_sync(page_id, (rel + j) % 32)
            sub = ((tile * nb + j) % boxes_per_page) if const_expr(boxes_per_page > 1) else 0
            cute.copy(tma_k, tKgK[None, sub, pid], tKsK[None, j, 0, state_k.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(state_k), **self.cache_hint())
        pipe_k.producer_commit(state_k)
        pipe_v.producer_acquire(state_v)
        for j in cutlass.range_constexpr(nb):
            pid = cute.arch.shuffle_sync(page_id, (rel + j) % 32)
            sub = ((tile * nb + j) % boxes_per_page) if const_expr(boxes_per_page > 1) else 0
            if const_expr(self.fp8):
                cute.copy(tma_v, tVgV[None, sub, pid], tVsV[None, j, 0, state_v.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(state_v), **self.cache_hint())
            else:
                cute.copy(tma_v, tVgV[None, sub, pid], tVsV[None, 0, j, state_v.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(state_v), **self.cache_hint())
        pipe_v.producer_commit(state_v)

    def cache_hint(self) -> dict:
        """(Traced.) The K/V TMA loads' L2 policy: evict-first (CUTLASS's CacheHintSm90::EVICT_FIRST)
        when ``evict_first``. Every KV byte is read once per call, so it should not push out what
        is read again soon: the block table, the query, and the split partials the fused merge
        reads back at the end of the kernel."""
        if self.cfg.evict_first:
            return dict(cache_policy=cutlass.Int64(EVICT_FIRST_POLICY))
        return {}

    @cute.jit
    def produce_dynamic(self, tma_k, mK, tma_v, mV, sK, sV, pipe_k, pipe_v, mBlockTable, num_pages,
                        batch_idx, kv_head, seq_len, num_tiles, grab, sTileId, lane):
        """Dynamic split: the CTAs of one (request, KV head) take chunks of ``chunk_tiles`` tiles
        from a shared counter until none is left, so they all finish within about one chunk of
        each other (a CTA that started late or streams slowly simply takes fewer chunks; with
        more CTAs than slots the late ones find little or nothing left). Each K stage carries its
        tile index in ``sTileId``, written before the stage's full-barrier arrive (which releases
        it to the consumers); a stage with index -1 and no TMA ends the consumers' loop."""
        nb, ch = self.boxes_per_tile, self.chunk_tiles
        tKsK, tKgK, tVsV, tVgV = self.partition_tma(tma_k, mK, tma_v, mV, sK, sV, kv_head)
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        chunk = self.grab_chunk(grab, lane)
        while chunk * ch < num_tiles:
            first = chunk * ch
            last = cutlass.min(first + ch, num_tiles)
            page_id = self.lookup_page(mBlockTable, num_pages, batch_idx, seq_len, first * nb + lane)
            for tile in cutlass.range(first, last, unroll=1):
                pipe_k.sync_object_empty.wait(state_k.index, state_k.phase)
                sTileId[state_k.index] = tile
                pipe_k.sync_object_full.arrive(state_k.index, pipe_k.producer_mask)  # + expect_tx
                self.load_tile(tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, pipe_k, pipe_v, state_k, state_v, page_id,
                               (tile - first) * nb, tile)
                state_k.advance()
                state_v.advance()
            chunk = self.grab_chunk(grab, lane)
        # end marker: a K stage with no data; a plain arrive completes its phase (no bytes expected)
        pipe_k.sync_object_empty.wait(state_k.index, state_k.phase)
        sTileId[state_k.index] = Int32(-1)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(pipe_k.producer_get_barrier(state_k))

    @cute.jit
    def grab_chunk(self, grab, lane):
        chunk = Int32(0)
        if lane == 0:
            chunk = cute.arch.atomic_add(grab, Int32(1), sem="relaxed", scope="gpu")
        return cute.arch.shuffle_sync(chunk, 0)

    # ------------------------------------------------------------------------------------------

    @cute.jit
    def load_q_chunk(self, mQ, idx, batch_idx, kv_head, work):
        """16 consecutive Q elements (row n, 16-column chunk c) of work item ``idx`` as fp32;
        zeros for padding rows and for ``idx >= work``."""
        chunks = self.D // 16
        n = idx // chunks
        vals = cute.make_rmem_tensor((16,), Float32)
        vals.fill(0.0)
        if n < self.rows and idx < work:
            token = batch_idx * self.q_len + n // self.G
            head = kv_head * self.G + n % self.G
            vals.store(cute.local_tile(mQ[token, head, None], (16,), (idx % chunks,)).load().to(Float32))
        return vals

    @cute.jit
    def stage_q(self, mQ, sQ, sRed, batch_idx, kv_head, tidx, warp, lane):
        """Q rows of this KV group -> sQ (B operand), zero padding rows. FP8 caches: columns
        permuted within 16-column blocks to match the widened K fragments, values pre-scaled by a
        power of two. Returns log2 of that scale (the logits divide it out)."""
        D, N = self.D, self.N
        chunks = D // 16
        work = N * chunks
        iters = (work + MMA_WARPS * 32 - 1) // (MMA_WARPS * 32)
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
                idx = it * MMA_WARPS * 32 + tidx
                vals = self.load_q_chunk(mQ, idx, batch_idx, kv_head, work)
                if const_expr(keep):
                    held.append(vals)
                for k in cutlass.range_constexpr(16):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(vals[k], -vals[k]))
            for off in (1, 2, 4, 8, 16):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, off))
            if lane == 0:
                sRed[warp, 0] = amax
            cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=MMA_WARPS * 32)
            amax = cute.arch.fmax(cute.arch.fmax(sRed[0, 0], sRed[1, 0]), cute.arch.fmax(sRed[2, 0], sRed[3, 0]))
            cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=MMA_WARPS * 32)  # sRed reused later
            # e within 1 of floor(log2 amax) (truncation, approximate log2): fp16's range
            # (max 2^16) leaves room for that
            e = Int32(0)
            if amax > Float32(0.0):
                e = Int32(cute.math.log2(amax, fastmath=True))
            q_log2 = Float32(cutlass.min(cutlass.max(Int32(14) - e, Int32(-100)), Int32(100)))
        scale = cute.math.exp2(q_log2, fastmath=False)
        for it in cutlass.range_constexpr(iters):
            idx = it * MMA_WARPS * 32 + tidx
            vals = held[it] if const_expr(keep and self.dynamic_q_scale) else self.load_q_chunk(
                mQ, idx, batch_idx, kv_head, work)
            if idx < work:
                n = idx // chunks
                c = idx % chunks
                for k in cutlass.range_constexpr(16):
                    src = q_permutation(k, self.cfg.widen) if const_expr(self.q_permuted) else k
                    sQ[n, c * 16 + k, 0] = (vals[src] * scale).to(sQ.element_type)
        return q_log2

    @cute.jit
    def consume(self, mQ, sK, sV, sQ, sP, sRed, pipe_k, pipe_v, mO, mLse, k_scale, v_scale, sm_scale,
                qk_mma, pv_mma, k_layout, v_layout, k_base, v_base, batch_idx, kv_head, split,
                seq_len, tile_begin, tile_end, tile_step, tidx, warp, lane, merge, sTileId):
        cfg = self.cfg
        mPartO, mPartLse, mCounter, sFlag, num_splits = merge
        D, N, G = self.D, self.N, self.G
        q_log2 = self.stage_q(mQ, sQ, sRed, batch_idx, kv_head, tidx, warp, lane)
        cute.arch.fence_proxy("async.shared", space="cta")  # sQ is read by WGMMA (async proxy)
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=MMA_WARPS * 32)

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

        thr_qk, thr_pv, cS0, cS, cO0, acc_s, acc_o, row_max, row_sum = self.consumer_state(qk_mma, pv_mma, tidx)
        nS = cute.size(acc_s)
        n_base = cS[0][1] - cS0[0][1]  # this thread's column offset (2 * (lane % 4))
        m_base = cS[0][0] - cS0[0][0]  # this thread's row offset (lane / 4 + 16 * warp)
        nslots = N // 4  # columns owned by a thread: 8 * j + n_base + {0, 1}
        limit = cute.make_rmem_tensor((nslots,), Int32)
        for s in cutlass.range_constexpr(nslots):
            n = slot_column(s, n_base)
            # query row n is draft token n // G: it sees positions < seq_len - q_len + j + 1
            limit[s] = seq_len - self.q_len + n // G + 1

        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        tSrQ = qk_mma.make_fragment_B(thr_qk.partition_B(sQ))
        tOrP = pv_mma.make_fragment_B(thr_pv.partition_B(sP))
        if const_expr(self.fp8):
            tSrK = cute.make_rmem_tensor(thr_qk.partition_A(cute.make_identity_tensor((self.tile, D))).shape, self.mma_dtype)
            tOrV = cute.make_rmem_tensor(thr_pv.partition_A(cute.make_identity_tensor((D, self.tile))).shape, self.mma_dtype)
        else:
            tSrK = qk_mma.make_fragment_A(thr_qk.partition_A(sK))
            tOrV = pv_mma.make_fragment_A(thr_pv.partition_A(sV))

        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        mma = (qk_mma, pv_mma, acc_s, acc_o, tSrK, tSrQ, tOrV, tOrP)
        # Software pipeline: QK(t+1) is issued right behind PV(t), so the widening of K(t+1)
        # runs while PV(t) is in the tensor cores and the two MMAs overlap. The tile sequence is
        # this CTA's static range, or (dynamic split) whatever the producer took, read from the
        # K stage (-1 ends it).
        tile = self.next_tile(pipe_k, state_k, sTileId, tile_begin - tile_step, tile_end, tile_step)
        if tile >= 0:
            self.issue_qk(mma, pipe_k, state_k, k_base, k_layout, warp, lane)
        while tile >= 0:
            warpgroup.wait_group(0)  # S(tile) is complete (O(tile - 1) was waited for below)
            pipe_k.consumer_release(state_k)
            state_k.advance()

            # ---------------- online softmax over the tile's tokens ----------------
            masked = (tile + 1) * self.tile > seq_len - self.q_len + 1
            tile_max = cute.make_rmem_tensor((nslots,), Float32)
            tile_max.fill(-Float32.inf)
            for i in cutlass.range_constexpr(nS):
                s_val = acc_s[i] * c
                sl = slot_of(cS0[i][1])
                if masked:
                    pos = tile * self.tile + cS0[i][0] + m_base
                    if pos >= limit[sl]:
                        s_val = -Float32.inf
                acc_s[i] = s_val
                tile_max[sl] = cute.arch.fmax(tile_max[sl], s_val)
            self.softmax_tile(acc_s, acc_o, tile_max, row_max, row_sum, sRed, sP, cS0, cO0, n_base, m_base, warp,
                              lane)

            # ---------------- O^T += V^T P^T, then S^T(tile + 1) = K Q^T ----------------
            pipe_v.consumer_wait(state_v)
            if const_expr(self.fp8):
                self.load_v_fragments(tOrV, v_base, v_layout, state_v.index, warp, lane)
                if const_expr(self.cvt):
                    if masked:
                        self.zero_v_fragment_tail(tOrV, seq_len - tile * self.tile, lane)
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
            nxt = self.next_tile(pipe_k, state_k, sTileId, tile, tile_end, tile_step)
            if nxt >= 0:
                self.issue_qk(mma, pipe_k, state_k, k_base, k_layout, warp, lane)
                warpgroup.wait_group(1)  # O(tile) done; S(tile + 1) may still run
            else:
                warpgroup.wait_group(0)
            pipe_v.consumer_release(state_v)
            state_v.advance()
            tile = nxt

        if const_expr(cfg.pdl):
            # only the epilogue is left: the next kernel in the stream may start launching (its
            # CTAs take the SM slots ours free and wait in griddepcontrol.wait for our writes)
            cute.arch.griddepcontrol_launch_dependents()
        # ---------------- epilogue ----------------
        self.publish_slot_reduction(row_sum, sRed, n_base, warp, lane, lambda a, b: a + b)
        inv = cute.make_rmem_tensor((nslots,), Float32)
        for s in cutlass.range_constexpr(nslots):
            n = slot_column(s, n_base)
            total = sRed[0, n] + sRed[1, n] + sRed[2, n] + sRed[3, n]
            inv[s] = Float32(0.0)
            lse = -Float32.inf
            if total > Float32(0.0):
                inv[s] = vs * Float32(2.0 ** self.out_log2) / total
                lse = row_max[s] + cute.math.log2(total, fastmath=True)
            if warp == 0:
                if lane < 4:
                    if n < self.rows:
                        token = batch_idx * self.q_len + n // G
                        head = kv_head * G + n % G
                        if const_expr(cfg.cluster):
                            store_shared_f32(k_base + self.part_lse_offset(n), lse)
                        elif const_expr(cfg.split):
                            mPartLse[split, token, head] = lse
                        else:
                            mLse[token, head] = lse
        cO = thr_pv.partition_C(cute.make_identity_tensor((D, N)))
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            n = cO[i][1]
            if n < self.rows:
                d = self.physical_d(cO0[i][0], cO[i][0] - cO0[i][0])
                token = batch_idx * self.q_len + n // G
                head = kv_head * G + n % G
                val = acc_o[i] * inv[slot_of(cO0[i][1])]
                if const_expr(cfg.cluster):
                    # the K stages are free now (every tile consumed, no TMA in flight)
                    store_shared_f32(k_base + (n * D + d) * 4, val)
                elif const_expr(cfg.split):
                    mPartO[split, token, head, d] = val
                else:
                    mO[token, head, d] = val.to(mO.element_type)
        if const_expr(cfg.split and not cfg.cluster):
            self.merge_splits(mO, mLse, mPartO, mPartLse, mCounter, sFlag, num_splits, batch_idx, kv_head, tidx,
                              (k_base, v_base))

    def consumer_state(self, qk_mma, pv_mma, tidx):
        """(Traced.) The swap-AB consumer's per-thread state, shared with the QSA kernel: MMA
        slices, the static per-element coordinates of thread 0 (``cS0``, ``cO0``) and of this
        thread (``cS``), so that register indices stay compile-time while rows and columns are
        exact; the S^T and O^T accumulators (O zeroed); running max (-inf) and sum (0) per
        column slot (a thread owns columns 8 j + 2 (lane % 4) + {0, 1}: N / 4 slots)."""
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
        and wait for the warpgroup: the caller then combines ``sRed[0..3, column]``. Shared by the
        softmax's row maxima and the epilogues' row sums (decode and QSA)."""
        nslots = self.N // 4
        for s in cutlass.range_constexpr(nslots):
            v = vals[s]
            for off in (4, 8, 16):
                v = combine(v, cute.arch.shuffle_sync_bfly(v, off))
            vals[s] = v
        if lane < 4:
            for s in cutlass.range_constexpr(nslots):
                sRed[warp, slot_column(s, n_base)] = vals[s]
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=MMA_WARPS * 32)

    @cute.jit
    def softmax_tile(self, acc_s, acc_o, tile_max, row_max, row_sum, sRed, sP, cS0, cO0, n_base, m_base, warp, lane):
        """One online-softmax step (shared with the QSA kernel). In: ``acc_s`` the tile's scaled,
        masked logits (log2 units) and ``tile_max`` this thread's per-slot maxima. Reduces the
        maxima over the warpgroup (shuffles, then ``sRed`` across warps), rescales ``row_sum`` and
        ``acc_o`` by ``exp2(old max - new max)``, and writes ``P = exp2(s - max)`` (times
        ``2^p_pre``) to ``sP`` for the PV WGMMA; ends with the fence and barrier that publish sP.
        A slot whose maximum is still -inf shifts by 0, so exp2(-inf) = 0 and no inf - inf."""
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
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=MMA_WARPS * 32)

    @cute.jit
    def merge_splits(self, mO, mLse, mPartO, mPartLse, mCounter, sFlag, num_splits, batch_idx, kv_head, tidx,
                     kv_bases):
        """The last of the request's split CTAs (per KV head) to finish merges all partials.

        Saves a second kernel launch (about 2 us on the critical path of small batches). Each CTA
        publishes its partial (fence + one atomic per CTA on a per-(request, head) counter); the
        CTA that sees count S-1 reads every split's partial from L2 (``ld.global.cg``: another
        SM wrote them), writes the final output and LSE, and resets the counter to 0 so that the
        next launch (or CUDA-graph replay) starts clean.

        ``smem_merge``: when every split's partial fits the (now idle) K and V stages, the merging
        CTA first copies them all there with ``cp.async`` (every copy in flight at once, no
        registers held) and merges from shared memory: one L2 round trip instead of one per
        ``threads`` chunks x MERGE_GROUP splits (two at Qwen3 B8: 8 rows x 128 dims, 12 splits).
        """
        G = self.G
        threads = MMA_WARPS * 32
        cute.arch.fence_acq_rel_gpu()  # my partial writes before the arrival below
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=threads)
        counter = mCounter.iterator + (batch_idx * cute.arch.grid_dim()[1] + kv_head)
        if tidx == 0:
            sFlag[0] = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=threads)
        if sFlag[0] == num_splits - 1:
            cute.arch.fence_acq_rel_gpu()
            chunks = self.D // 4
            work = self.rows * chunks
            fits = False
            if const_expr(self.cfg.smem_merge):
                fits = num_splits <= self.cfg.merge_slots()
            if fits:
                self.stage_partials(mPartO, mPartLse, num_splits, batch_idx, kv_head, tidx, kv_bases)
            for it in cutlass.range((work + threads - 1) // threads, unroll=1):
                idx = it * threads + tidx
                if idx < work:
                    n = idx // chunks
                    d0 = (idx % chunks) * 4
                    token = batch_idx * self.q_len + n // G
                    head = kv_head * G + n % G
                    if fits:
                        self.merge_row_chunk(mO, mLse, num_splits, token, head, d0, (kv_bases, n), self.cfg.merge_group,
                                             "smem")
                    else:
                        self.merge_row_chunk(mO, mLse, num_splits, token, head, d0, (mPartO, mPartLse),
                                             self.cfg.merge_group, "global")
            if tidx == 0:
                counter.store(Int32(0))
                if const_expr(self.cfg.dynamic):
                    # every CTA of the item has arrived, so none takes chunks any more: reset for
                    # the next launch (its counter sits B x Hkv entries behind the arrival counter)
                    grab = counter + cute.arch.grid_dim()[2] * cute.arch.grid_dim()[1]
                    grab.store(Int32(0))

    def part_lse_offset(self, n):
        """(Traced.) Byte offset of row ``n``'s LSE in a shared-memory partial (the cluster merge's,
        or a slot of the staged fused merge, :func:`merge_slot_bytes`): fp32 ``O[rows, D]`` first,
        then the LSEs."""
        return (self.rows * self.D + n) * 4

    @cute.jit
    def merge_slot(self, s, kv_bases):
        """(Traced.) Shared-window address of split ``s``'s partial: the K stages' slots first,
        then the V stages'."""
        k_base, v_base = kv_bases
        per = self.cfg.merge_slots() // 2
        slot = self.cfg.merge_slot_bytes()
        return k_base + s * slot if s < per else v_base + (s - per) * slot

    @cute.jit
    def stage_partials(self, mPartO, mPartLse, num_splits, batch_idx, kv_head, tidx, kv_bases):
        """Copy every split's partial O rows (16-byte ``cp.async.cg``) and LSEs (``ld.global.cg``
        then a shared store) of this (request, KV head) into shared memory, all in flight
        together, then wait for them and publish them to the merging threads. The K/V stages
        are idle: every tile was consumed and no TMA load is outstanding."""
        G, D, rows = self.G, self.D, self.rows
        threads = MMA_WARPS * 32
        chunks = D // 4
        per_split = rows * chunks
        for i in cutlass.range(tidx, num_splits * per_split, threads, unroll=4):
            s = i // per_split
            rem = i - s * per_split
            n = rem // chunks
            c = rem - n * chunks
            src = mPartO.iterator + cute.crd2idx((s, batch_idx * self.q_len + n // G, kv_head * G + n % G, c * 4),
                                                  mPartO.layout)
            cp_async_16(self.merge_slot(s, kv_bases) + (n * D + c * 4) * 4, src.toint())
        # The LSEs through registers with ld.global.cg: a 4-byte cp.async can only be .ca, and an
        # L1 line of another (request, KV head)'s LSEs, read by an earlier merge on this SM while
        # one of its splits was still running, would hand this merge a stale value.
        for i in cutlass.range(tidx, num_splits * rows, threads, unroll=1):
            s = i // rows
            n = i - s * rows
            lse = self.load_cg(mPartLse, (s, batch_idx * self.q_len + n // G, kv_head * G + n % G))
            store_shared_f32(self.merge_slot(s, kv_bases) + self.part_lse_offset(n), lse)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=threads)

    @cute.jit
    def cluster_merge(self, mO, mLse, part_base):
        """Merge the split partials of one (KV head, request) inside its cluster (``num_splits``
        CTAs, at most MAX_CLUSTER).

        Each split CTA has left its normalized partial O and its LSE in its own shared memory
        (``part_base``). After a cluster barrier (release / acquire) CTA ``rank`` merges its share
        of the ``rows x D / 4`` four-element chunks, reading every split's chunk and LSE through
        DSMEM (CLUSTER_GROUP splits' loads in flight together, ranks past the last clamped to it
        and weighted 0), and writes the output; a second barrier keeps every CTA's shared memory
        alive until all of them have read it. Against the global fused merge this saves the
        fence, the arrival atomic and the last CTA's L2 round trip, and the merge is spread over
        all split CTAs (measured: profiling/NOTES.md "tenth session")."""
        G = self.G
        # indices read again here rather than kept live through the main loop (register pressure)
        tidx = special_register("tid.x")
        rank = special_register("ctaid.x")
        kv_head = special_register("ctaid.y")
        batch_idx = special_register("ctaid.z")
        num_splits = special_register("nctaid.x")
        chunks = self.D // 4
        work = self.rows * chunks
        per = (work + num_splits - 1) // num_splits
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        for j in cutlass.range(tidx, per, NUM_THREADS, unroll=1):
            idx = rank * per + j
            if idx < work:
                n = idx // chunks
                d0 = (idx - n * chunks) * 4
                self.merge_row_chunk(mO, mLse, num_splits, batch_idx * self.q_len + n // G, kv_head * G + n % G,
                                     d0, (part_base, n), self.cfg.cluster_group, "dsmem")
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def merge_row_chunk(self, mO, mLse, num_splits, token, head, d0, src, group: cutlass.Constexpr,
                        source: cutlass.Constexpr):
        """Merge 4 output dims of one query row over all splits, ``group`` splits at a time. The
        partials come from global memory (``source`` "global": ``src = (mPartO, mPartLse)``, the
        fused merge), from this CTA's shared memory ("smem": ``src = ((k_base, v_base), n)``, the
        fused merge after :meth:`stage_partials`) or from the cluster's shared memory ("dsmem":
        ``src = (part_base, n)``, the cluster merge).

        Every load of a group (its LSEs and 16-byte partials) is issued before any is used, so a
        group costs one L2 round trip instead of one per split (this merge is on the critical
        path of every split request); indices past the last split are clamped to it and weighted
        0. Groups are combined with a running max, as in online softmax."""
        m = -Float32.inf
        total = Float32(0.0)
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        lse_g = cute.make_rmem_tensor((group,), Float32)
        o_g = cute.make_rmem_tensor((group, 4), Float32)
        for g in cutlass.range((num_splits + group - 1) // group, unroll=1):
            for j in cutlass.range_constexpr(group):
                s = cutlass.min(g * group + j, num_splits - 1)
                if const_expr(source == "dsmem"):
                    part_base, n = src
                    lse_g[j] = load_dsmem_f32(part_base + self.part_lse_offset(n), s)
                    o_g[j, 0], o_g[j, 1], o_g[j, 2], o_g[j, 3] = load_dsmem_f32x4(part_base + (n * self.D + d0) * 4, s)
                elif const_expr(source == "smem"):
                    kv_bases, n = src
                    slot = self.merge_slot(s, kv_bases)
                    lse_g[j] = load_shared_f32(slot + self.part_lse_offset(n))
                    o_g[j, 0], o_g[j, 1], o_g[j, 2], o_g[j, 3] = load_shared_f32x4(slot + (n * self.D + d0) * 4)
                else:
                    mPartO, mPartLse = src
                    lse_g[j] = self.load_cg(mPartLse, (s, token, head))
                    addr = (mPartO.iterator + cute.crd2idx((s, token, head, d0), mPartO.layout)).toint()
                    o_g[j, 0], o_g[j, 1], o_g[j, 2], o_g[j, 3] = load_cg_f32x4(addr)
            new_m = m
            for j in cutlass.range_constexpr(group):
                if g * group + j >= num_splits:
                    lse_g[j] = -Float32.inf
                new_m = cute.arch.fmax(new_m, lse_g[j])
            # all splits so far empty: shift by 0 so every weight is exp2(-inf) = 0 (no inf - inf)
            shift = new_m if new_m != -Float32.inf else Float32(0.0)
            alpha = cute.math.exp2(m - shift, fastmath=True)
            total = total * alpha
            for e in cutlass.range_constexpr(4):
                acc[e] = acc[e] * alpha
            for j in cutlass.range_constexpr(group):
                total += add_split(acc, o_g[j, None], lse_g[j], shift, 4)
            m = new_m
        inv = Float32(0.0)
        lse = -Float32.inf
        if total > Float32(0.0):
            inv = 1.0 / total
            lse = m + cute.math.log2(total, fastmath=True)
        for e in cutlass.range_constexpr(4):
            mO[token, head, d0 + e] = (acc[e] * inv).to(mO.element_type)
        if d0 == 0:
            mLse[token, head] = lse

    @cute.jit
    def load_cg(self, tensor, coord):
        """A load that bypasses L1 (the data was written by other SMs in this kernel)."""
        return cute.arch.load(tensor.iterator + cute.crd2idx(coord, tensor.layout), Float32, cop="cg")

    # ------------------------------------------------------------------------------------------

    @cute.jit
    def next_tile(self, pipe_k, state_k, sTileId, tile, tile_end, tile_step):
        """The tile after ``tile``, or -1. Static: ``tile + tile_step`` below ``tile_end``. Dynamic:
        the index the producer stored with the next K stage (waited for here; ``issue_qk`` waits
        again, at once)."""
        nxt = Int32(-1)
        if const_expr(self.cfg.dynamic):
            pipe_k.consumer_wait(state_k)
            nxt = sTileId[state_k.index]
        else:
            if tile + tile_step < tile_end:
                nxt = tile + tile_step
        return nxt

    @cute.jit
    def issue_qk(self, mma, pipe_k, state_k, k_base, k_layout, warp, lane):
        """Wait for K(tile), widen it (FP8) and issue S^T = K Q^T as one commit group."""
        qk_mma, pv_mma, acc_s, acc_o, tSrK, tSrQ, tOrV, tOrP = mma
        pipe_k.consumer_wait(state_k)
        if const_expr(self.fp8):
            self.load_k_fragments(tSrK, k_base, k_layout, state_k.index, warp, lane)
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
        return widen_e4m3x4(x, self.cfg.q_dtype)

    @cute.jit
    def load_k_fragments(self, tSrK, k_base, k_layout, stage, warp, lane):
        """K tile (FP8, tokens x D) -> widened A fragments of S^T = K Q^T, two k16 blocks per
        ldmatrix.x4: matrices (rows 0-7 | 8-15) x (chunk c | c+1) of this warp's 16 tokens of
        each 64-token M block."""
        q = lane // 8
        mblocks = self.tile // MMA_M
        regs = cute.recast_tensor(tSrK, Int32)  # index (kb * mblocks + mb) * 4 + R
        for mb in cutlass.range_constexpr(mblocks):
            row = mb * MMA_M + warp * 16 + (q % 2) * 8 + lane % 8
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

    @cute.jit
    def zero_v_tail(self, sV, stage, valid, tidx):
        """16-bit caches: zero V^T columns (tokens) >= valid in this stage, so that stale
        (possibly NaN) cache rows past the sequence end cannot turn 0 * NaN into NaN."""
        D = self.D
        for it in cutlass.range_constexpr((D * self.tile + MMA_WARPS * 32 - 1) // (MMA_WARPS * 32)):
            idx = it * MMA_WARPS * 32 + tidx
            d = idx % D
            t = idx // D
            if t < self.tile and t >= valid:
                sV[d, t, stage] = sV.element_type(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=MMA_WARPS * 32)
