"""SM90 paged prefill: varlen, chunked (a cached prefix before each request's new tokens), causal
or not, on WGMMA with K/V pages loaded by TMA. Config, limits and grid:
``cute_kernels/plans/sm90_prefill.py``; design: docs/design/sm90-prefill.md.

- **One CTA per (query head, 128-row query block, request)**, three warpgroups. Warpgroup 0
  produces: its first warp TMAs the query block and the K/V tiles (one box per page, page ids
  from the block table, invalid or out-of-sequence boxes zero-filled); for an FP8 cache all four
  warps rewrite each FP8 tile in shared memory (widened to fp16 for a 16-bit query, V transposed
  for an FP8 query). Warpgroups 1 and 2 consume: each owns 64 query rows, S = Q K^T (SS WGMMA),
  online softmax in registers, O += P V with P from registers (RS WGMMA).
- **KV tiles** of ``tile_n`` tokens are walked from the last one down: the first tiles are the
  masked ones (causal diagonal, sequence tail), the rest need no mask; tiles above the diagonal
  or past the sequence are never loaded.
- ``overlap``: each consumer issues tile n's QK together with tile n-1's PV and computes the
  softmax while PV runs; ``pingpong``: the two consumers take turns issuing WGMMAs.
- ``persistent`` (opt-in): a fixed grid of ``num_ctas`` CTAs walks the (query block, request,
  head) tiles longest first; the pipeline's stages and phases run on from tile to tile.
- ``epilogue="smem"`` (opt-in): O goes to global memory through a shared-memory tile that is free
  by then, in 16-byte row chunks (:mod:`..roles.o_tile_store`).
- ``q_terms=2`` (opt-in, FP8 query): the query's e4m3 residual is TMA'd next to it (the query
  buffer holds both terms) and each tile's QK group issues both terms into one S accumulator.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..jit.dtypes import cute_dtype
from ..jit.spec import bind_arguments
from ..roles import online_softmax as softmax
from ..roles.fragments import store_shared_b32x4
from ..roles.o_tile_store import o_tile_layout, store_o_tile
from ..roles.paged_kv_tma import PagedTiles, box_atom, cache_views, transposed
from ..roles.prefill_blocks import (
    kv_cap,
    m_block_of,
    n_block_range,
    persistent_tile,
    request_rows,
    window_tiles,
)
from ..roles.smem_fp8 import (
    P_SHIFT,
    narrow_q_rows,
    p_fragment_map,
    pack_p,
    smem_offset,
    transpose_tile,
    transpose_tile_ldsm,
    widen_tile,
)

LOG2E = math.log2(math.e)
# named barriers (0 is __syncthreads)
BAR_Q_READY = 1  # producer warpgroup -> consumers: the narrowed query is in place
BAR_SCHED = 2  # 2, 3: the consumer warpgroups' turns (pingpong)
BAR_PRODUCER = 4  # the producer warpgroup's four warps
BAR_CONSUMER = 5  # 5, 6: one consumer warpgroup
BAR_TILE = 7  # persistent + pingpong: both consumer warpgroups end a tile together (also: the
# FP8 query's shared-memory epilogue, whose O tiles take K/V stages both warpgroups read)


def _at(i, base):
    """The pipeline index of a tile's i-th K/V step: ``i`` in a one-tile CTA, ``base + i`` in a
    persistent CTA, whose stages and phases run on across its tiles."""
    return i if base is None else base + i


class Sm90PagedPrefill:
    """Kernel object; all fields are compile-time (see ``Sm90PrefillConfig``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.arg_names = cfg.arg_names()
        # three warpgroups (a producer, two consumers of one 64-row WGMMA M each)
        self.tile_m = cfg.tile_m
        self.num_threads = cfg.num_threads
        self.mma_m = cfg.hw.WGMMA_M
        self.wg_threads = cfg.hw.WARPGROUP_WARPS * 32
        self.kind = cfg.kind
        self.D = cfg.head_dim
        self.tile_n = cfg.tile_n
        self.stages = cfg.stages
        self.staging = cfg.staging
        self.q_dtype = cute_dtype(cfg.q_dtype)
        self.kv_dtype = cute_dtype(cfg.kv_dtype)
        self.mma_dtype = cute_dtype(cfg.mma_dtype)
        self.out_dtype = cute_dtype(cfg.out_dtype)
        self.narrow_q = self.kind == "widen" and cfg.q_dtype == "bf16"
        self.q_terms = cfg.q_terms
        # lean_softmax: FP8 P's 2^P_SHIFT comes from the softmax's exponent
        # (docs/design/sm90-prefill.md#the-lean-softmax)
        self.p_log2 = P_SHIFT if cfg.lean_softmax and self.kind == "fp8" else 0
        self.k_tiles = PagedTiles(cfg.tile_n, cfg.box, cfg.page_size, cfg.head_dim, token_major=True)
        self.v_tiles = PagedTiles(cfg.tile_n, cfg.box, cfg.page_size, cfg.head_dim, token_major=self.kind != "16")

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def __call__(self, *args):
        """The config's arguments (``Sm90PrefillConfig.signature()``) and the stream."""
        arg = bind_arguments(self.arg_names, args)
        stream = arg["stream"]
        cfg = self.cfg
        D, n = self.D, self.tile_n
        mQ = arg["q"]
        mQv = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1]))  # (T, D, Hq)
        if const_expr(cfg.kv_form == "single"):
            mK, mV, num_pages = cache_views(arg["kv_cache"], arg["kv_cache"], cfg.kv_form, cfg.kv_layout)
        else:
            mK, mV, num_pages = cache_views(arg["k_cache"], arg["v_cache"], cfg.kv_form, cfg.kv_layout)

        qk_mma, pv_mma = self.mmas()
        L = self.layouts()
        box = cfg.box
        q_box = cute.slice_(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.mma_m, n, D), self.q_dtype, 1),
                            (None, None, 0))
        tma_q, tma_tQ = box_atom(mQv, q_box, (self.mma_m, D))
        residual = ()
        if const_expr(self.q_terms == 2):  # the residual term: the query's layout, its own tensor map
            mQ2 = arg["q_residual"]
            residual = box_atom(cute.make_tensor(mQ2.iterator, cute.select(mQ2.layout, mode=[0, 2, 1])), q_box,
                                (self.mma_m, D))
        k_box = cute.slice_(sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.mma_m, box, D), self.kv_dtype, 1),
                            (None, None, 0))
        tma_k, tma_tK = box_atom(mK, k_box, (box, D))
        if const_expr(self.kind == "16"):
            v_box = cute.slice_(sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (self.mma_m, D, box), self.kv_dtype, 1),
                                (None, None, 0))
            tma_v, tma_tV = box_atom(transposed(mV), v_box, (D, box))
        else:
            tma_v, tma_tV = box_atom(mV, k_box, (box, D))

        self.storage = self.shared_storage(L)
        num_q_heads = mQ.shape[1]
        batch = arg["block_table"].shape[0]
        # at least one query block: a launch with max_query_len 0 exits at once instead of failing
        m_blocks = cutlass.max((arg["max_query_len"] + self.tile_m - 1) // self.tile_m, 1)
        grid = [num_q_heads, m_blocks, batch]
        sched = (None, None)
        if const_expr(cfg.persistent):
            # a fixed grid of num_ctas CTAs (SMs x CTAs per SM, from the op) walks every (query block,
            # request, head) tile: docs/design/sm90-prefill.md#scheduling
            grid = [cutlass.max(cutlass.min(arg["num_ctas"], num_q_heads * m_blocks * batch), 1), 1, 1]
            sched = (m_blocks, num_q_heads)
        self.kernel(
            tma_q, tma_tQ, tma_k, tma_tK, tma_v, tma_tV, num_pages, arg["block_table"], arg["seq_lens"],
            arg["query_start_loc"], mQ.shape[0], arg["out"], arg.get("lse"), arg["k_scale"], arg["v_scale"],
            arg.get("q_scale"), arg["sm_scale"], qk_mma, pv_mma, L["q"], L["k"], L["v"], L.get("ks"), L.get("vs"),
            arg.get("sinks"), arg.get("window_left"),  # the window / sink variants' inputs (else None)
            *sched,  # the persistent variant's tile count (else None)
            *residual,  # the two-term query's residual (tensor map, coordinates)
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def mmas(self):
        """QK: SS, both K-major. PV: P from registers; V an MN-major B (16-bit) or, for e4m3
        (which reads only K-major operands), V^T."""
        dt = self.mma_dtype
        qk = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
                                               tiler_mn=(self.mma_m, self.tile_n))
        v_major = OperandMajorMode.K if self.kind == "fp8" else OperandMajorMode.MN
        pv = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, v_major, Float32, (1, 1, 1),
                                               tiler_mn=(self.mma_m, self.D), a_source=warpgroup.OperandSource.RMEM)
        return qk, pv

    def layouts(self) -> dict:
        """Shared-memory layouts: ``q`` (64, D, 2 halves); ``k`` (tile_n, D, stages) K-major;
        ``v`` (D, tile_n, stages) d-contiguous, or V^T with tokens contiguous (FP8 query);
        ``ks`` / ``vs`` the FP8 staging tiles (tile_n, D, staging) as TMA writes them."""
        D, n, dt = self.D, self.tile_n, self.mma_dtype
        q_store = self.q_dtype if self.kind != "widen" else cute_dtype("fp16")  # narrowed in place
        # two 64-row halves per query term (q_terms = 2: hi halves, then lo halves)
        L = dict(q=sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.mma_m, n, D), q_store, 2 * self.q_terms),
                 k=sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.mma_m, n, D), dt, self.stages))
        if const_expr(self.kind == "fp8"):
            L["v"] = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.mma_m, D, n), dt, self.stages)
        else:
            L["v"] = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (self.mma_m, D, n), dt, self.stages)
        if const_expr(self.kind != "16"):
            L["vs"] = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.mma_m, n, D), self.kv_dtype, self.staging)
        if const_expr(self.kind == "widen"):
            L["ks"] = L["vs"]
        return L

    def shared_storage(self, L):
        S, C = max(self.staging, 1), self.stages
        mma_dt, kv_dt = self.mma_dtype, self.kv_dtype
        q_dt = self.q_dtype if self.kind != "widen" else cute_dtype("fp16")
        # staging buffers only where FP8 tiles are rewritten (an 8-byte placeholder otherwise, unaligned
        # so that it costs no 1 KB alignment pad)
        sKs_t = (cute.struct.Align[cute.struct.MemRange[kv_dt, cute.cosize(L["ks"])], 1024] if self.kind == "widen"
                 else cute.struct.MemRange[kv_dt, 8])
        sVs_t = (cute.struct.Align[cute.struct.MemRange[kv_dt, cute.cosize(L["vs"])], 1024] if self.kind != "16"
                 else cute.struct.MemRange[kv_dt, 8])

        @cute.struct
        class Storage:
            q_full: cute.struct.MemRange[cutlass.Int64, 2]  # one used
            k_full: cute.struct.MemRange[cutlass.Int64, C]
            k_empty: cute.struct.MemRange[cutlass.Int64, C]
            v_full: cute.struct.MemRange[cutlass.Int64, C]
            v_empty: cute.struct.MemRange[cutlass.Int64, C]
            s_full: cute.struct.MemRange[cutlass.Int64, S]  # staging (FP8 caches)
            q_shift: cute.struct.MemRange[Float32, self.tile_m]
            sQ: cute.struct.Align[cute.struct.MemRange[q_dt, cute.cosize(L["q"])], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[mma_dt, cute.cosize(L["k"])], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[mma_dt, cute.cosize(L["v"])], 1024]
            sKs: sKs_t
            sVs: sVs_t

        if Storage.size_in_bytes() > self.cfg.hw.MAX_SMEM_PER_CTA:
            raise ValueError(f"sm90.prefill: {Storage.size_in_bytes()} bytes of shared memory exceed {self.cfg.hw.MAX_SMEM_PER_CTA}")
        return Storage

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tma_q, mQt, tma_k, mKt, tma_v, mVt, num_pages: Int32, mBlockTable: cute.Tensor,
               mSeqLens: cute.Tensor, mQsl: cute.Tensor, total_rows: Int32, mO: cute.Tensor, mLse, k_scale, v_scale,
               q_scale, sm_scale: Float32, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, lq, lk, lv, lks, lvs,
               mSinks, window_left, m_blocks, num_q_heads, tma_q2=None, mQ2t=None):
        cfg = self.cfg
        L = dict(q=lq, k=lk, v=lv, ks=lks, vs=lvs)
        scales = (k_scale, v_scale, q_scale, sm_scale)
        tidx, _, _ = cute.arch.thread_idx()
        rows = (mQsl, mSeqLens, mBlockTable, total_rows, window_left)
        kv = (tma_q, mQt, tma_k, mKt, tma_v, mVt, num_pages, mBlockTable)
        if const_expr(self.q_terms == 2):
            kv = kv + (tma_q2, mQ2t)
        if const_expr(not cfg.persistent):
            head, grid_y, batch = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            m_block = m_block_of(grid_y, cute.arch.grid_dim()[1])
            req, count, win = self.tile_work(m_block, batch, head, rows)

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        if tidx == 0:
            cute.arch.mbarrier_init(storage.q_full.data_ptr(), 1)
            if const_expr(cfg.persistent):  # the second slot: the query buffer is free again
                cute.arch.mbarrier_init(storage.q_full.data_ptr() + 1, 8)
            # full: one TMA arrival (with its bytes), or one per rewriting thread; empty: one per consumer warp
            k_count = self.wg_threads if const_expr(self.kind == "widen") else 1
            v_count = 1 if const_expr(self.kind == "16") else self.wg_threads
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(storage.k_full.data_ptr() + s, k_count)
                cute.arch.mbarrier_init(storage.v_full.data_ptr() + s, v_count)
                cute.arch.mbarrier_init(storage.k_empty.data_ptr() + s, 8)
                cute.arch.mbarrier_init(storage.v_empty.data_ptr() + s, 8)
            for s in cutlass.range_constexpr(max(self.staging, 1)):
                cute.arch.mbarrier_init(storage.s_full.data_ptr() + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if const_expr(cfg.persistent):
            self.persistent_ctas(kv, rows, storage, L, scales, qk_mma, pv_mma, mO, mLse, mSinks, tidx, m_blocks,
                                 num_q_heads)
        else:
            if m_block * self.tile_m < req[2]:  # a block past the request's rows has nothing to do
                if warp < 4:
                    cute.arch.setmaxregister_decrease(cfg.producer_regs)
                    if count > 0:
                        self.produce(kv, storage, L, req, tidx, warp, win)
                else:
                    cute.arch.setmaxregister_increase(cfg.consumer_regs)
                    self.consume(storage, L, qk_mma, pv_mma, mO, mLse, scales, req, tidx % self.wg_threads,
                                 warp // 4 - 1, win, mSinks)

    def tile_work(self, m_block, batch, head, rows):
        """``(req, count, win)`` of one (query block, request, head) tile: the request's rows and
        KV extent, the KV tiles walked and a sliding window's bounds (None without one)."""
        cfg = self.cfg
        mQsl, mSeqLens, mBlockTable, total_rows, window_left = rows
        q_start, q_len = request_rows(mQsl[batch], mQsl[batch + 1], total_rows, cutlass.min, cutlass.max)
        seq_len = mSeqLens[batch]
        cap = kv_cap(seq_len, mBlockTable.shape[1], cfg.page_size, cutlass.min, cutlass.max)
        n_max, n_unmasked = n_block_range(m_block, self.tile_m, self.tile_n, q_len, seq_len, cap, cfg.causal,
                                          cutlass.min, cutlass.max)
        kv_head = head // cfg.group
        req = (batch, q_start, q_len, seq_len, cap, m_block, n_max, n_unmasked, head, kv_head)
        # a sliding window: the block walks tiles [n_min, n_max) only (docs/design/sm90-prefill.md#sliding-window-and-sinks)
        count, win = n_max, None
        if cfg.window:
            n_min, lo_first, lo_last = window_tiles(m_block, self.tile_m, self.tile_n, q_len, seq_len, window_left,
                                                    n_max, cutlass.min, cutlass.max)
            win = (n_max - n_min, lo_first, lo_last, window_left)
            count = win[0]
        return req, count, win

    @cute.jit
    def produce(self, kv, storage, L, req, tidx, warp, win, sched=None):
        """The producer warpgroup's work on one tile (warp 0 alone for a 16-bit cache)."""
        tma_q, mQt, tma_k, mKt, tma_v, mVt, num_pages, mBlockTable = kv[:8]
        if const_expr(self.kind == "16"):
            if warp == 0:
                self.produce_direct(tma_q, mQt, tma_k, mKt, tma_v, mVt, num_pages, mBlockTable, storage, L, req, win,
                                    sched)
        else:
            self.produce_rewrite(tma_q, mQt, tma_k, mKt, tma_v, mVt, num_pages, mBlockTable, storage, L, req, tidx,
                                 warp, win, sched, kv[8:])

    @cute.jit
    def persistent_ctas(self, kv, rows, storage, L, scales, qk_mma, pv_mma, mO, mLse, mSinks, tidx, m_blocks,
                        num_q_heads):
        """A fixed grid: CTA c takes tiles c, c + gridDim.x, ... of the longest-first order
        (``persistent_tile``). The producer and both consumer warpgroups walk the same sequence;
        ``kv_it`` (K/V steps so far) and ``q_it`` (query blocks loaded so far) carry the stages'
        and the query buffer's phases from one tile to the next (docs/design/sm90-prefill.md#scheduling)."""
        cfg = self.cfg
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta, _, _ = cute.arch.block_idx()
        step = cute.arch.grid_dim()[0]
        batch_size = rows[2].shape[0]
        tiles = num_q_heads * m_blocks * batch_size
        kv_it = Int32(0)
        q_it = Int32(0)
        if warp < 4:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            for t in cutlass.range(cta, tiles, step, unroll=1):
                m_block, batch, head = persistent_tile(t, num_q_heads, batch_size, m_blocks)
                req, count, win = self.tile_work(m_block, batch, head, rows)
                if count > 0:  # 0 for a block past the request's rows too
                    self.produce(kv, storage, L, req, tidx, warp, win, (kv_it, q_it))
                kv_it = kv_it + count
                q_it = q_it + cutlass.min(count, 1)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            for t in cutlass.range(cta, tiles, step, unroll=1):
                m_block, batch, head = persistent_tile(t, num_q_heads, batch_size, m_blocks)
                req, count, win = self.tile_work(m_block, batch, head, rows)
                if m_block * self.tile_m < req[2]:
                    self.consume(storage, L, qk_mma, pv_mma, mO, mLse, scales, req, tidx % self.wg_threads,
                                 warp // 4 - 1, win, mSinks, (kv_it, q_it))
                kv_it = kv_it + count
                q_it = q_it + cutlass.min(count, 1)

    # ---- producer ------------------------------------------------------------------------------

    @cute.jit
    def load_q(self, tma_q, mQt, sQ, bar, req, q_it=None, residual=()):
        """Both 64-row halves of the query block (rows past the tensor are zero-filled; rows of the
        next request are loaded and never stored). ``q_it``: a persistent CTA's query blocks so far
        (the buffer is reused once both consumers release it: ``bar + 1``). ``residual``: the
        two-term query's ``(tma, coordinates)``, whose halves follow the query's in the buffer."""
        batch, q_start, q_len, seq_len, cap, m_block, n_max, n_unmasked, head, kv_head = req
        if const_expr(q_it is not None):
            cute.arch.mbarrier_wait(bar + 1, (q_it % 2) ^ 1)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.q_terms * self.tile_m * self.D * self.q_dtype.width // 8)
        for t, (tma, mt) in enumerate(((tma_q, mQt), *((residual,) if const_expr(len(residual)) else ()))):
            gQ = cute.local_tile(cute.domain_offset((q_start, 0), mt[None, None, head]), (self.mma_m, self.D), (None, 0))
            tQsQ, tQgQ = cute.nvgpu.cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                                          cute.group_modes(gQ, 0, 2))
            for h in cutlass.range_constexpr(2):
                cute.copy(tma, tQgQ[None, 2 * m_block + h], tQsQ[None, 2 * t + h], tma_bar_ptr=bar)

    @cute.jit
    def produce_direct(self, tma_q, mQt, tma_k, mKt, tma_v, mVt, num_pages, mBlockTable, storage, L, req, win=None,
                       sched=None):
        """16-bit cache, one warp: the query, then K(i) ahead of V(i-1) (the consumer needs K(i)
        first), each into its stage once the consumers have released it (``count`` tiles from
        ``n_max - 1`` down: all of them, or a window's). ``sched``: a persistent CTA's
        ``(kv_it, q_it)``."""
        batch, q_start, q_len, seq_len, cap, m_block, n_max, n_unmasked, head, kv_head = req
        base, q_it = (None, None) if const_expr(sched is None) else sched
        count, lo = n_max, None
        if const_expr(win is not None):
            count, lo = win[0], win[1]
        lane = cute.arch.lane_idx()
        sQ = storage.sQ.get_tensor(L["q"].outer, swizzle=L["q"].inner)
        sK = storage.sK.get_tensor(L["k"].outer, swizzle=L["k"].inner)
        sV = storage.sV.get_tensor(L["v"].outer, swizzle=L["v"].inner)
        self.load_q(tma_q, mQt, sQ, storage.q_full.data_ptr(), req, q_it)
        tKsK, tKgK = self.k_tiles.partition(tma_k, mKt, sK, kv_head)
        tVsV, tVgV = self.v_tiles.partition(tma_v, mVt, sV, kv_head)
        k_full, k_empty = storage.k_full.data_ptr(), storage.k_empty.data_ptr()
        v_full, v_empty = storage.v_full.data_ptr(), storage.v_empty.data_ptr()
        tile_bytes = self.tile_n * self.D * self.kv_dtype.width // 8
        ids_next = self.k_tiles.lookup(mBlockTable, batch, n_max - 1, cap, num_pages, lane, lo)
        ids_prev = ids_next
        for i in cutlass.range(count + 1, unroll=1):
            ids = ids_next
            if i + 1 < count:  # the next tile's page ids, loaded one tile ahead
                ids_next = self.k_tiles.lookup(mBlockTable, batch, n_max - 2 - i, cap, num_pages, lane, lo)
            if i < count:
                stage, phase = _at(i, base) % self.stages, (_at(i, base) // self.stages) % 2
                cute.arch.mbarrier_wait(k_empty + stage, phase ^ 1)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(k_full + stage, tile_bytes)
                self.k_tiles.issue(tma_k, tKgK, tKsK, ids, n_max - 1 - i, stage, k_full + stage)
            if i > 0:
                j = i - 1
                stage, phase = _at(j, base) % self.stages, (_at(j, base) // self.stages) % 2
                cute.arch.mbarrier_wait(v_empty + stage, phase ^ 1)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(v_full + stage, tile_bytes)
                self.v_tiles.issue(tma_v, tVgV, tVsV, ids_prev, n_max - 1 - j, stage, v_full + stage)
            ids_prev = ids

    @cute.jit
    def produce_rewrite(self, tma_q, mQt, tma_k, mKt, tma_v, mVt, num_pages, mBlockTable, storage, L, req, tidx,
                        warp, win=None, sched=None, residual=()):
        """FP8 cache, the whole warpgroup: warp 0 TMAs the query (``residual``: and its second
        term's) and each tile's FP8 K and V (FP8
        query: K straight into its consumer stage, V into staging) ``staging`` tiles ahead; all
        four warps then rewrite each staged tile into the consumers' stage (widen K and V, or
        transpose V), publish it (proxy fence + arrival) and free the staging slot. ``sched``: a
        persistent CTA's ``(kv_it, q_it)``."""
        batch, q_start, q_len, seq_len, cap, m_block, n_max, n_unmasked, head, kv_head = req
        base, q_it = (None, None) if const_expr(sched is None) else sched
        count, lo = n_max, None
        if const_expr(win is not None):
            count, lo = win[0], win[1]
        lane = cute.arch.lane_idx()
        n, D = self.tile_n, self.D
        sQ = storage.sQ.get_tensor(L["q"].outer, swizzle=L["q"].inner, dtype=self.q_dtype)
        sVs = storage.sVs.get_tensor(L["vs"].outer, swizzle=L["vs"].inner)
        k_full, k_empty = storage.k_full.data_ptr(), storage.k_empty.data_ptr()
        v_full, v_empty = storage.v_full.data_ptr(), storage.v_empty.data_ptr()
        s_full = storage.s_full.data_ptr()
        tile_bytes = n * D  # one FP8 tile
        widen = self.kind == "widen"
        if const_expr(widen):
            sKs = storage.sKs.get_tensor(L["ks"].outer, swizzle=L["ks"].inner)
            tKs, tKg = self.k_tiles.partition(tma_k, mKt, sKs, kv_head)
        else:
            sK = storage.sK.get_tensor(L["k"].outer, swizzle=L["k"].inner)
            tKs, tKg = self.k_tiles.partition(tma_k, mKt, sK, kv_head)
        tVs, tVg = self.v_tiles.partition(tma_v, mVt, sVs, kv_head)
        if warp == 0:
            self.load_q(tma_q, mQt, sQ, storage.q_full.data_ptr(), req, q_it, residual)
            for i in cutlass.range(cutlass.min(self.staging, count), unroll=1):
                self.issue_staged(tma_k, tKg, tKs, tma_v, tVg, tVs, mBlockTable, batch, n_max - 1 - i, _at(i, base), cap,
                                  num_pages, lane, s_full, k_full, k_empty, tile_bytes, lo)
        if const_expr(self.narrow_q):
            cute.arch.mbarrier_wait(storage.q_full.data_ptr(), 0 if const_expr(q_it is None) else q_it % 2)
            narrow_q_rows(storage.sQ.data_ptr().toint(), L["q"], D,
                          storage.q_shift.get_tensor(cute.make_layout(self.tile_m)), tidx)
            cute.arch.fence_proxy("async.shared", space="cta")  # read by WGMMA
            cute.arch.barrier_arrive(barrier_id=BAR_Q_READY, number_of_threads=self.num_threads)
        src_v = storage.sVs.data_ptr().toint()
        dst_v = storage.sV.data_ptr().toint()
        for i in cutlass.range(count, unroll=1):
            tile = n_max - 1 - i
            g = _at(i, base)
            slot, s_phase = g % self.staging, (g // self.staging) % 2
            stage, phase = g % self.stages, (g // self.stages) % 2
            valid = cap - tile * n  # tokens of the tile inside the sequence
            cute.arch.mbarrier_wait(s_full + slot, s_phase)
            if const_expr(widen):
                cute.arch.mbarrier_wait(k_empty + stage, phase ^ 1)
                widen_tile(storage.sKs.data_ptr().toint(), L["ks"], slot, storage.sK.data_ptr().toint(), L["k"],
                           stage, True, n, D, valid, tidx, self.wg_threads)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.mbarrier_arrive(k_full + stage)
            cute.arch.mbarrier_wait(v_empty + stage, phase ^ 1)
            if const_expr(widen):
                widen_tile(src_v, L["vs"], slot, dst_v, L["v"], stage, False, n, D, valid, tidx, self.wg_threads)
            elif const_expr(self.cfg.vt_transpose == "ldsm"):
                transpose_tile_ldsm(src_v, L["vs"], slot, dst_v, L["v"], stage, n, D, valid, tidx, self.wg_threads)
            else:
                transpose_tile(src_v, L["vs"], slot, dst_v, L["v"], stage, n, D, valid, tidx, self.wg_threads)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(v_full + stage)
            # every warp is done reading the staging slot: refill it
            cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=self.wg_threads)
            if warp == 0:
                if i + self.staging < count:
                    self.issue_staged(tma_k, tKg, tKs, tma_v, tVg, tVs, mBlockTable, batch,
                                      n_max - 1 - i - self.staging, _at(i, base) + self.staging, cap, num_pages, lane, s_full,
                                      k_full, k_empty, tile_bytes, lo)

    @cute.jit
    def issue_staged(self, tma_k, tKg, tKs, tma_v, tVg, tVs, mBlockTable, batch, tile, i, cap, num_pages, lane,
                     s_full, k_full, k_empty, tile_bytes, lo=None):
        """(Warp 0.) Tile ``tile`` (the i-th walked): K and V into staging slot ``i % staging``
        (widen), or K into consumer stage ``i % stages`` and V into staging (FP8 query)."""
        ids = self.k_tiles.lookup(mBlockTable, batch, tile, cap, num_pages, lane, lo)
        slot = i % self.staging
        if const_expr(self.kind == "widen"):
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(s_full + slot, 2 * tile_bytes)
            self.k_tiles.issue(tma_k, tKg, tKs, ids, tile, slot, s_full + slot)
        else:
            stage, phase = i % self.stages, (i // self.stages) % 2
            cute.arch.mbarrier_wait(k_empty + stage, phase ^ 1)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(k_full + stage, tile_bytes)
            self.k_tiles.issue(tma_k, tKg, tKs, ids, tile, stage, k_full + stage)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(s_full + slot, tile_bytes)
        self.v_tiles.issue(tma_v, tVg, tVs, ids, tile, slot, s_full + slot)

    # ---- consumers -----------------------------------------------------------------------------

    @cute.jit
    def consume(self, storage, L, qk_mma, pv_mma, mO, mLse, scales, req, tid, wg, win=None, mSinks=None, sched=None):
        """One consumer warpgroup: rows ``64 wg ..`` of the query block; ``tid`` is the thread's
        index inside its warpgroup (the MMA slices and the shared work loops count from it).
        ``win``: a sliding window's ``(count, lo_first, lo_last, window_left)``; ``mSinks``: the
        fp32 [Hq] sink logits; ``sched``: a persistent CTA's ``(kv_it, q_it)``."""
        cfg = self.cfg
        base, q_it = (None, None) if const_expr(sched is None) else sched
        batch, q_start, q_len, seq_len, cap, m_block, n_max, n_unmasked, head, kv_head = req
        D, n = self.D, self.tile_n
        fp8 = self.kind == "fp8"
        sQ = storage.sQ.get_tensor(L["q"].outer, swizzle=L["q"].inner, dtype=self.mma_dtype)
        sK = storage.sK.get_tensor(L["k"].outer, swizzle=L["k"].inner)
        sV = storage.sV.get_tensor(L["v"].outer, swizzle=L["v"].inner)
        thr_qk = qk_mma.get_slice(tid)
        thr_pv = pv_mma.get_slice(tid)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sV))
        tOrP = cute.make_rmem_tensor(thr_pv.partition_shape_A((self.mma_m, n)), self.mma_dtype)
        pmap = p_fragment_map(qk_mma, pv_mma, n, fp8)
        p_kind = ("e4m3_scaled" if cfg.lean_softmax else "e4m3") if fp8 else ("fp16" if self.kind == "widen" else cfg.q_dtype)
        cS0 = qk_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.mma_m, n)))
        cS = thr_qk.partition_C(cute.make_identity_tensor((self.mma_m, n)))
        cO0 = pv_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.mma_m, D)))
        m_off = cS[0][0] - cS0[0][0]  # this thread's first row (16 warp + lane / 4)
        n_off = cS[0][1] - cS0[0][1]  # and first column (2 (lane % 4))
        acc_s = cute.make_rmem_tensor(cS.shape, Float32)
        acc_o = cute.make_rmem_tensor(cO0.shape, Float32)
        acc_o.fill(0.0)
        row_max, row_sum = softmax.new_state()
        j_first = m_block * self.tile_m + self.mma_m * wg  # request row of this warpgroup's row 0
        limit = softmax.row_limits(m_off, j_first, q_len, seq_len, cap, cfg.causal)
        count = n_max
        if const_expr(win is not None):
            count = win[0]

        k_scale, v_scale, q_scale, sm_scale = scales
        ks = k_scale[0] if const_expr(isinstance(k_scale, cute.Tensor)) else Float32(k_scale)
        vs = v_scale[0] if const_expr(isinstance(v_scale, cute.Tensor)) else Float32(v_scale)
        c = sm_scale * ks * Float32(LOG2E)
        if const_expr(cfg.q_scale == "scalar"):
            c = c * Float32(q_scale)
        elif const_expr(cfg.q_scale == "tensor"):
            c = c * q_scale[0]
        elif const_expr(cfg.q_scale == "per_head"):
            c = c * q_scale[kv_head]
        # FP8 P is P * 2^P_SHIFT (e4m3's range); with lean_softmax the softmax's exponent carries the
        # factor and the max the epilogue reads drops by it instead (softmax.reference_shift)
        out_scale = vs * Float32(2.0 ** -P_SHIFT) if const_expr(fp8 and not cfg.lean_softmax) else vs

        st = dict(qk_mma=qk_mma, pv_mma=pv_mma, tSrQ=tSrQ[None, None, None, wg], tSrK=tSrK, tOrV=tOrV, tOrP=tOrP,
                  acc_s=acc_s, acc_o=acc_o, cS0=cS0, cO0=cO0, row_max=row_max, row_sum=row_sum, limit=limit,
                  pmap=pmap, p_kind=p_kind, n_off=n_off, v_base=storage.sV.data_ptr().toint(), v_layout=L["v"],
                  tid=tid, wg=wg)
        if const_expr(self.q_terms == 2):
            st["tSrQ2"] = tSrQ[None, None, None, 2 + wg]  # the residual term's half
        if const_expr(win is not None):
            st["lower"] = softmax.row_lower(m_off, j_first, q_len, seq_len, win[3])
            st["lo_last"] = win[2]
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)  # O starts at zero
        scale = cute.make_rmem_tensor((softmax.ROWS,), Float32)  # per row: logits in log2 units = S * scale
        st["scale"] = scale
        if count > 0:
            if const_expr(self.narrow_q):
                cute.arch.barrier(barrier_id=BAR_Q_READY, number_of_threads=self.num_threads)
                sShift = storage.q_shift.get_tensor(cute.make_layout(self.tile_m))
                for h in cutlass.range_constexpr(softmax.ROWS):
                    scale[h] = c * cute.math.exp2(-sShift[self.mma_m * wg + m_off + 8 * h], fastmath=False)
            else:
                cute.arch.mbarrier_wait(storage.q_full.data_ptr(), 0 if const_expr(q_it is None) else q_it % 2)
                scale.fill(c)
            self.mainloop(st, storage, n_max, n_unmasked, cap, count, base)
            if const_expr(sched is not None):
                # the query buffer is free for the CTA's next tile; with pingpong both warpgroups
                # finish this tile's turns before either takes the next tile's
                if cute.arch.lane_idx() == 0:
                    cute.arch.mbarrier_arrive(storage.q_full.data_ptr() + 1)
                if const_expr(cfg.pingpong):
                    cute.arch.barrier(barrier_id=BAR_TILE, number_of_threads=2 * self.wg_threads)
        softmax.reference_shift(row_max, self.p_log2)
        sink_log2 = None
        if const_expr(cfg.sinks):
            sink_log2 = mSinks[head] * Float32(LOG2E)
        self.epilogue(acc_o, row_max, row_sum, cO0, m_off, n_off, out_scale, mO, mLse, q_start, q_len, j_first,
                      head, tid, sink_log2, (storage, wg))

    @cute.jit
    def mainloop(self, st, storage, n_max, n_unmasked, cap, count=None, base=None):
        """The KV tiles from ``n_max - 1`` down: ``count`` of them (all ``n_max``, or a window's;
        see the module docstring); ``base``: a persistent CTA's K/V steps before this tile."""
        if const_expr(count is None):
            count = n_max
        k_full, k_empty = storage.k_full.data_ptr(), storage.k_empty.data_ptr()
        v_full, v_empty = storage.v_full.data_ptr(), storage.v_empty.data_ptr()
        wg = st["wg"]
        zero_tail = self.kind == "16"  # FP8 rewrites zero the tail themselves
        if const_expr(self.cfg.overlap):
            # tile 0: scores only; its PV goes out with tile 1's QK
            self.wait(k_full, _at(0, base))
            self.issue_qk(st, _at(0, base))
            warpgroup.wait_group(0)
            self.release(k_empty, _at(0, base))
            self.softmax(st, n_max - 1, n_unmasked)
            pack_p(st["acc_s"], st["tOrP"], st["pmap"], st["p_kind"])
            for i in cutlass.range(1, count, unroll=1):
                self.wait(k_full, _at(i, base))
                if const_expr(self.cfg.pingpong):
                    if wg == 1 or i > 1:  # balanced: wg 0 goes first, wg 1 skips its last turn's handoff
                        cute.arch.barrier(barrier_id=BAR_SCHED + wg, number_of_threads=2 * self.wg_threads)
                self.issue_qk(st, _at(i, base))
                self.wait(v_full, _at(i - 1, base))
                if const_expr(zero_tail):
                    if i == 1:
                        self.zero_v_tail(st, _at(i - 1, base) % self.stages, n_max, cap)
                self.issue_pv(st, _at(i - 1, base))
                if const_expr(self.cfg.pingpong):
                    if wg == 0 or i < count - 1:
                        cute.arch.barrier_arrive(barrier_id=BAR_SCHED + 1 - wg, number_of_threads=2 * self.wg_threads)
                warpgroup.wait_group(1)  # QK(i) done (groups retire in order); PV(i-1) may run on
                self.release(k_empty, _at(i, base))
                alpha = self.softmax(st, n_max - 1 - i, n_unmasked)
                warpgroup.wait_group(0)
                self.release(v_empty, _at(i - 1, base))
                pack_p(st["acc_s"], st["tOrP"], st["pmap"], st["p_kind"])
                self.rescale(st, alpha)
            last = count - 1
            self.wait(v_full, _at(last, base))
            if const_expr(zero_tail):
                if last == 0:
                    self.zero_v_tail(st, _at(0, base) % self.stages, n_max, cap)
            self.issue_pv(st, _at(last, base))
            warpgroup.wait_group(0)
            self.release(v_empty, _at(last, base))
        else:
            for i in cutlass.range(count, unroll=1):
                self.wait(k_full, _at(i, base))
                self.issue_qk(st, _at(i, base))
                warpgroup.wait_group(0)
                self.release(k_empty, _at(i, base))
                alpha = self.softmax(st, n_max - 1 - i, n_unmasked)
                pack_p(st["acc_s"], st["tOrP"], st["pmap"], st["p_kind"])
                self.rescale(st, alpha)
                self.wait(v_full, _at(i, base))
                if const_expr(zero_tail):
                    if i == 0:
                        self.zero_v_tail(st, _at(0, base) % self.stages, n_max, cap)
                self.issue_pv(st, _at(i, base))
                warpgroup.wait_group(0)
                self.release(v_empty, _at(i, base))

    @cute.jit
    def rescale(self, st, alpha):
        """O's rows by the softmax's ``alpha``; the lean softmax skips a warp's rescale when no max
        of its rows moved (bit-identical: docs/design/sm90-prefill.md#the-lean-softmax)."""
        if const_expr(self.cfg.lean_softmax):
            softmax.rescale_rows_if_moved(st["acc_o"], st["cO0"], alpha)
        else:
            softmax.rescale_rows(st["acc_o"], st["cO0"], alpha)

    @cute.jit
    def wait(self, full, i):
        cute.arch.mbarrier_wait(full + i % self.stages, (i // self.stages) % 2)

    @cute.jit
    def release(self, empty, i):
        """One arrival per consumer warp (its lanes are past the WGMMA wait that read the stage)."""
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(empty + i % self.stages)

    @cute.jit
    def issue_qk(self, st, i):
        """S = Q K^T of the i-th tile walked (a pipeline index), committed as one group (two query
        terms: S = hi K^T + lo K^T, both in the group)."""
        qk_mma = st["qk_mma"]
        first = cute.make_mma_atom(qk_mma.op)
        first.set(warpgroup.Field.ACCUMULATE, False)
        rest = cute.make_mma_atom(qk_mma.op)
        rest.set(warpgroup.Field.ACCUMULATE, True)
        stage = i % self.stages
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(st["tSrQ"].shape[2])):
            cute.gemm(first if kb == 0 else rest, st["acc_s"], st["tSrQ"][None, None, kb],
                      st["tSrK"][None, None, kb, stage], st["acc_s"])
        if const_expr(self.q_terms == 2):
            for kb in cutlass.range_constexpr(cute.size(st["tSrQ2"].shape[2])):
                cute.gemm(rest, st["acc_s"], st["tSrQ2"][None, None, kb], st["tSrK"][None, None, kb, stage],
                          st["acc_s"])
        warpgroup.commit_group()

    @cute.jit
    def issue_pv(self, st, i):
        """O += P V of the i-th tile walked (P in ``tOrP``), committed as one group."""
        pv_mma = st["pv_mma"]
        stage = i % self.stages
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(st["tOrP"].shape[2])):
            cute.gemm(pv_mma, st["acc_o"], st["tOrP"][None, None, kb], st["tOrV"][None, None, kb, stage],
                      st["acc_o"])
        warpgroup.commit_group()

    @cute.jit
    def softmax(self, st, tile, n_unmasked):
        """Scale, mask (the tiles at or past ``n_unmasked``) and exponentiate the tile's scores."""
        col0 = tile * self.tile_n + st["n_off"]
        alpha = cute.make_rmem_tensor((softmax.ROWS,), Float32)
        if const_expr("lower" in st):
            # a window masks the tiles before its newest row's window start too
            if tile >= n_unmasked or tile * self.tile_n < st["lo_last"]:
                softmax.softmax_step(st["acc_s"], st["cS0"], st["scale"], st["row_max"], st["row_sum"], True,
                                     st["limit"], col0, alpha, st["lower"], self.cfg.lean_softmax, self.p_log2)
            else:
                softmax.softmax_step(st["acc_s"], st["cS0"], st["scale"], st["row_max"], st["row_sum"], False,
                                     st["limit"], col0, alpha, None, self.cfg.lean_softmax, self.p_log2)
        elif tile >= n_unmasked:
            softmax.softmax_step(st["acc_s"], st["cS0"], st["scale"], st["row_max"], st["row_sum"], True,
                                 st["limit"], col0, alpha, None, self.cfg.lean_softmax, self.p_log2)
        else:
            softmax.softmax_step(st["acc_s"], st["cS0"], st["scale"], st["row_max"], st["row_sum"], False,
                                 st["limit"], col0, alpha, None, self.cfg.lean_softmax, self.p_log2)
        return alpha

    @cute.jit
    def zero_v_tail(self, st, stage, n_max, cap):
        """16-bit cache, the last tile: V rows past the sequence hold stale cache bytes (0 x NaN
        would reach O), so this warpgroup zeroes them in the stage before its PV (the other
        warpgroup writes the same zeros) and publishes them to its own WGMMAs."""
        valid = cap - (n_max - 1) * self.tile_n
        if valid < self.tile_n:
            chunks = self.D // 8
            z = Int32(0)
            for c in cutlass.range(st["tid"], (self.tile_n - valid) * chunks, self.wg_threads, unroll=1):
                tok = valid + c // chunks
                d0 = (c % chunks) * 8
                store_shared_b32x4(st["v_base"] + smem_offset((d0, tok, stage), st["v_layout"], 2), z, z, z, z)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=BAR_CONSUMER + st["wg"], number_of_threads=self.wg_threads)

    @cute.jit
    def epilogue(self, acc_o, row_max, row_sum, cO0, m_off, n_off, out_scale, mO, mLse, q_start, q_len, j_first,
                 head, tid, sink_log2=None, smem=None):
        """Normalize (with the head's sink in the denominator, ``sink_log2``), write the rows of
        this request (rows past ``q_len`` belong to the next request and are skipped) and, when
        asked, their base-2 LSE. O goes out in 4-byte pairs from registers, or (``epilogue="smem"``,
        ``smem``: the storage and this warpgroup's index) through shared memory."""
        if const_expr(sink_log2 is not None):
            softmax.rescale_rows(acc_o, cO0, softmax.add_sink(row_max, row_sum, sink_log2, tid % 4 == 0))
        inv, lse = softmax.finalize(row_max, row_sum, out_scale)
        if const_expr(self.cfg.epilogue == "smem"):
            self.store_o_smem(acc_o, inv, cO0, m_off, n_off, mO, q_start, q_len, j_first, head, tid, *smem)
        else:
            self.store_o_registers(acc_o, inv, cO0, m_off, n_off, mO, q_start, q_len, j_first, head)
        if const_expr(self.cfg.write_lse):
            if tid % 4 == 0:
                for h in cutlass.range_constexpr(softmax.ROWS):
                    j = j_first + m_off + 8 * h
                    if j < q_len:
                        mLse[q_start + j, head] = lse[h]

    @cute.jit
    def store_o_smem(self, acc_o, inv, cO0, m_off, n_off, mO, q_start, q_len, j_first, head, tid, storage, wg):
        """The O tile through shared memory that is free by now: this warpgroup's half of the query
        buffer (its own QK WGMMAs have retired; a 16-bit or narrowed query has the output's 2-byte
        width), or for an FP8 query (1-byte sQ) a K/V stage buffer (K for warpgroup 0, V for 1)
        once both warpgroups are past their last WGMMA (the producer loads nothing more in a
        one-tile CTA). docs/design/sm90-prefill.md#epilogue-through-shared-memory-opt-in-epiloguesmem"""
        o_bytes = self.mma_m * self.D * 2
        if const_expr(self.kind == "fp8"):
            k_base = storage.sK.data_ptr().toint()
            base = k_base + wg * (storage.sV.data_ptr().toint() - k_base)
            cute.arch.barrier(barrier_id=BAR_TILE, number_of_threads=2 * self.wg_threads)
        else:
            base = storage.sQ.data_ptr().toint() + wg * o_bytes
            cute.arch.barrier(barrier_id=BAR_CONSUMER + wg, number_of_threads=self.wg_threads)
        store_o_tile(acc_o, inv, cO0, m_off, n_off, base, o_tile_layout(self.mma_m, self.D, self.out_dtype),
                     self.cfg.out_dtype, mO, q_start, q_len, j_first, head, tid, self.mma_m, self.D, self.wg_threads,
                     BAR_CONSUMER + wg)

    @cute.jit
    def store_o_registers(self, acc_o, inv, cO0, m_off, n_off, mO, q_start, q_len, j_first, head):
        """O straight from the accumulator, one 4-byte pair per store."""
        for e in cutlass.range_constexpr(0, cute.size(acc_o), 2):
            h = cO0[e][0] // 8
            j = j_first + m_off + cO0[e][0]
            if j < q_len:
                pair = cute.make_rmem_tensor((2,), Float32)
                pair[0] = acc_o[e] * inv[h]
                pair[1] = acc_o[e + 1] * inv[h]
                col = cO0[e][1] + n_off
                dst = cute.local_tile(mO[q_start + j, head, None], (2,), (col // 2,))
                dst.store(pair.load().to(self.out_dtype))
