"""SM90 QSA sparse prefill over row tiles: R consecutive query rows share one gathered K/V stream.

Neighbouring prefill rows select mostly the same tokens (RFC vllm#55394 measured a Jaccard
similarity of 87-94 % between neighbouring rows), so gathering each row's ~2048 tokens separately
moves several times the bytes the tile needs. This kernel runs one CTA per (tile of R rows, KV
head) over the sorted union of the tile's selections built by the pre-pass (``qsa_union.py``):
every union token is gathered once, the R rows x G query heads are the WGMMA's M (64 columns,
see :class:`Sm90QsaTileAttention`), and a per-row membership bitmask masks the logits of the rows
that did not select a token. A tile the pre-pass marked ``length = -1`` (rows of different
requests, a row listing a token twice, a union over the cap) walks its rows' own lists one after
the other instead, each 64-token tile of row r masked to row r's columns: the per-row kernel's
result, with its gathered bytes.

The gather (index and page lookups, zero-filling cp.async; FP8 widened to fp16 by the gather
warps here), the pipeline and the Q staging are the roles the per-row kernel uses too
(:mod:`cute_kernels.roles.qsa_gather`, :mod:`cute_kernels.roles.query`), with R rows per CTA; the
consumer and epilogue are this module's. No split-K: prefill batches fill the machine.

Warp roles (``TILE_SCHEDULE`` in the plan, docs/design/qsa.md#row-tile-warp-roles): 16-bit caches run two consumer warpgroups on alternate
union tiles of the same rows (each its own running max, sum and O, combined at the end through the
idle K tiles); FP8 caches run one consumer and two groups of gather warps on alternate pipeline
slots, so two tiles are widened at once, and that one consumer issues each tile's QK together
with the previous tile's PV so that its softmax overlaps the tensor cores (``overlap``). Both are
384 threads, with the registers rebalanced by ``setmaxnreg`` within the launch's 168 per thread.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..jit.dtypes import cute_dtype
from ..roles.fragments import sigmoid
from ..roles.qsa_gather import QsaGather
from ..roles.query import QueryStager
from ..roles.softmax import BAR_MMA, LOG2E, QuadSoftmax, query_on_m_mmas

BAR_CONSUMERS = BAR_MMA + 1  # named barrier of both consumer warpgroups (BAR_MMA: the first's own)


class Sm90QsaTileAttention:
    """Kernel object of :class:`cute_kernels.plans.sm90_qsa_tile.Sm90QsaTileConfig`; every field
    is compile-time.

    The MMAs run the FlashAttention way round: the tile's R x G query columns are the WGMMA's M
    (64, one warpgroup), the KV tokens its N. Then a query's logits live in one quad of threads:
    the softmax needs two shuffles and no shared-memory reduction or barrier, and P goes from the
    QK accumulators straight into registers as the A operand of an RS PV WGMMA (no P round trip
    through shared memory), where the swap-AB consumer (tokens on M) reduces across the
    warpgroup twice per tile and stages P in shared memory (docs/design/qsa.md#row-tiles-over-the-union).
    FP8 caches use the same consumer: the gather warps widen their rows to fp16 tiles, and the
    query is scaled into fp16 range by a power of two.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.q_dtype = cute_dtype(cfg.q_dtype)
        self.kv_dtype = cute_dtype(cfg.kv_dtype)
        self.fp8 = cfg.kv_dtype == "fp8_e4m3"
        self.D = cfg.head_dim
        self.G = cfg.group
        self.R = cfg.rows_per_cta  # query rows per CTA: R rows x G heads are the WGMMA's M
        self.tile = cfg.tile
        self.stages = cfg.stages
        self.words = self.tile // 32  # membership words per tile (per row)
        self.warps = cfg.consumer_warps
        self.mma_m = cfg.hw.WGMMA_M
        self.N = self.mma_m  # Q rows staged (zeros past R x G)
        # FP8: the gather warps widen rows to fp16 tiles (exact), K and V are then plain B
        # operands in natural column order, and Q is rescaled into fp16 range (dynamic scale)
        self.mma_dtype = cute_dtype("fp16") if self.fp8 else self.q_dtype
        # consumer warpgroups: with two, each takes every other union tile of the same rows (its
        # own running max, sum and O), so one group's softmax overlaps the other's MMAs; they
        # combine at the end through shared memory
        self.consumers = cfg.consumers
        self.producer_warp = self.warps * self.consumers
        self.num_threads = (self.producer_warp + cfg.producers) * 32
        # gather groups: each group of producers // groups warps fills every groups-th slot, so
        # that many tiles are in flight at once. FP8's widening gather is synchronous (loads, then
        # convert, then store), so one group keeps a single tile in flight
        self.groups = cfg.gather_groups
        self.P = cfg.producers // self.groups  # the gather's work split is per group
        self.gather = QsaGather(cfg, R=self.R, producers=self.P, N=self.N, warps=self.warps,
                                num_threads=self.num_threads, mma_dtype=self.mma_dtype, kv_dtype=self.kv_dtype,
                                widen_in_producer=self.fp8)
        self.query = QueryStager(self.D, self.N, self.G, self.R, bounded=True,
                                 dynamic_q_scale=self.fp8 and cfg.q_dtype == "bf16", q_pre=0, q_permuted=False,
                                 widen=cfg.widen, warps=self.warps)
        self.softmax = QuadSoftmax(self.words)

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [T, Hq, D]
        mK: cute.Tensor,  # [NB, PAGE, Hkv, D]
        mV: cute.Tensor,  # [NB, PAGE, Hkv, D]
        mIdx: cute.Tensor,  # [T, TOPK + 1] int32
        mBlockTable: cute.Tensor,  # [NR, BW] int32
        mTokenToReq: cute.Tensor,  # [T] int32
        mUnion: cute.Tensor,  # [NT, UCAP] int32: the tile's sorted union (pre-pass)
        mMember: cute.Tensor,  # [NT, R, UCAP / 32] int32: per-row membership bits
        mLen: cute.Tensor,  # [NT] int32: union length, -1 = walk the rows' own lists
        mO: cute.Tensor,  # [T, Hq, D]
        mLse: cute.Tensor,  # [T, Hq] fp32
        mGate: cute.Tensor,  # [T, Hq, D] (read only when cfg.gate)
        k_scale,  # Float32, or a [1] fp32 tensor (k_scale_tensor)
        v_scale,  # Float32, or a [1] fp32 tensor (v_scale_tensor)
        stream,
    ):
        mmas = query_on_m_mmas(self.D, self.tile, self.stages, self.mma_dtype, self.mma_m)
        self.gather.launch(self.tile_kernel, (mQ, mK, mV, mIdx, mBlockTable, mTokenToReq, mUnion, mMember, mLen, mO,
                                              mLse, mGate, k_scale, v_scale),
                           [mLen.shape[0], mK.shape[2], 1], stream, mmas)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def tile_kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mIdx: cute.Tensor,
        mBlockTable: cute.Tensor,
        mTokenToReq: cute.Tensor,
        mUnion: cute.Tensor,
        mMember: cute.Tensor,
        mLen: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mGate: cute.Tensor,
        k_scale,
        v_scale,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        k_layout,
        v_layout,
        q_layout,
        p_layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile, kv_head, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        storage, sQ, sP, sRed, sMask, full, empty = self.gather.setup_shared(q_layout, p_layout, tidx)
        if warp >= self.producer_warp:
            if const_expr(self.cfg.producer_regs > 0):
                cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            self.produce_tile(mK, mV, mIdx, mBlockTable, mTokenToReq, mUnion, mMember, mLen, storage, k_layout,
                              v_layout, sMask, full, empty, tile, kv_head, warp - self.producer_warp, lane)
        else:
            if const_expr(self.cfg.consumer_regs > 0):
                cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            self.consume_mq(mQ, storage, sQ, sRed, sMask, full, empty, mO, mLse, mGate, k_scale, v_scale, qk_mma,
                            pv_mma, k_layout, v_layout, tile, kv_head, self.tile_count(mIdx, mLen, tile), tidx, warp,
                            lane)

    @cute.jit
    def consume_mq(self, mQ, storage, sQ, sRed, sMask, full, empty, mO, mLse, mGate, k_scale, v_scale, qk_mma,
                   pv_mma, k_layout, v_layout, tile, kv_head, my_tiles, tidx, warp, lane):
        """The consumer warpgroup with the query columns on M (16-bit caches, see the class)."""
        D, T, G, R, words = self.D, self.tile, self.G, self.R, self.words
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        wg = Int32(0)
        if const_expr(self.consumers == 1):
            q_log2 = self.query.stage_q(mQ, sQ, sRed, tile, kv_head, tidx, warp, lane)
            cute.arch.fence_proxy("async.shared", space="cta")  # sQ is read by WGMMA (async proxy)
            cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)
        else:
            wg = warp // self.warps
            tidx = tidx % (self.warps * 32)  # the thread's index in its warpgroup (MMA slices)
            q_log2 = self.stage_q_shared(mQ, sQ, sRed, tile, kv_head, tidx, warp, lane, wg)
        ks = k_scale
        if const_expr(self.cfg.k_scale_tensor):
            ks = k_scale[0]  # read on the device: a replayed CUDA graph sees the current value
        # logits in log2 units (the query was scaled by 2^q_log2 when staged: FP8 -> fp16 MMAs)
        c = Float32(D ** -0.5 * LOG2E) * ks * cute.math.exp2(-q_log2, fastmath=False)

        thr_qk = qk_mma.get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sV))
        # static coordinates of thread 0 plus this thread's offsets (rows 16 warp + lane / 4 + {0, 8},
        # columns 2 (lane % 4) + 8 j + {0, 1})
        cS0 = qk_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.mma_m, T)))
        cS = thr_qk.partition_C(cute.make_identity_tensor((self.mma_m, T)))
        cO0 = pv_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.mma_m, D)))
        cO = thr_pv.partition_C(cute.make_identity_tensor((self.mma_m, D)))
        m_off = cS[0][0] - cS0[0][0]
        n_off = cS[0][1] - cS0[0][1]
        acc_s = cute.make_rmem_tensor(cS.shape, Float32)
        acc_o = cute.make_rmem_tensor(cO.shape, Float32)
        acc_o.fill(0.0)
        # P as the PV A operand: the accumulator's values (col pair, row half, 8-col block j) are
        # the A fragment's (col pair, row half, k half) of 16-column block j // 2
        sc, sh, sj = acc_s.layout.stride[0]
        p_view = cute.make_tensor(acc_s.iterator, cute.make_layout(((2, 2, 2), 1, T // 16),
                                                                   stride=((sc, sh, sj), 0, 2 * sj)))
        tOrP = cute.make_rmem_tensor(thr_pv.partition_shape_A((self.mma_m, T)), self.mma_dtype)
        # the bitmask words of the thread's two query columns' tile rows (padding columns: the
        # last row's, their output is dropped)
        word_base = cute.make_rmem_tensor((2,), Int32)
        for h in cutlass.range_constexpr(2):
            word_base[h] = cutlass.min((m_off + 8 * h) // G, Int32(R - 1)) * words
        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        # what the per-tile steps below share (the pipeline, the MMAs and their fragments, the
        # softmax state), passed as one bundle
        cs = SimpleNamespace(full=full, empty=empty, sMask=sMask, qk_mma=qk_mma, pv_mma=pv_mma, acc_s=acc_s,
                             acc_o=acc_o, tSrQ=tSrQ, tSrK=tSrK, tOrV=tOrV, p_view=p_view, cS0=cS0, cO0=cO0,
                             mw=cute.make_rmem_tensor((2 * words,), Int32), word_base=word_base, n_off=n_off, c=c,
                             row_max=row_max, row_sum=row_sum)
        if const_expr(self.cfg.overlap):
            self.consume_overlapped(cs, tOrP, my_tiles)
        else:
            for i in cutlass.range(wg, my_tiles, self.consumers, unroll=1):
                stage = i % self.stages
                self.wait_full(cs, i)
                warpgroup.fence()
                self.issue_qk(cs, stage)
                warpgroup.commit_group()
                self.load_mask(cs, stage)
                warpgroup.wait_group(0)
                alpha, grew = self.softmax.softmax_tile(cs)
                tOrP.store(p_view.load().to(self.mma_dtype))
                if grew:  # the running max moved: rescale the output rows (skipped on most tiles)
                    self.softmax.rescale(cs, alpha)
                warpgroup.fence()
                self.issue_pv(cs, tOrP, stage)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(empty + stage)

        n = cute.size(acc_o)
        vs = v_scale
        if const_expr(self.cfg.v_scale_tensor):
            vs = v_scale[0]
        if const_expr(self.consumers == 1):
            self.store_rows(acc_o, row_max, row_sum, cO0, cO, m_off, mO, mLse, mGate, vs, tile, kv_head, lane,
                            0, n)
        else:
            # each group finishes half of the elements (the epilogue is serial work of the CTA)
            self.combine_consumers(storage, acc_o, row_max, row_sum, cO0, wg, tidx)
            if wg == 0:
                self.store_rows(acc_o, row_max, row_sum, cO0, cO, m_off, mO, mLse, mGate, vs, tile, kv_head,
                                lane, 0, n // 2)
            else:
                self.store_rows(acc_o, row_max, row_sum, cO0, cO, m_off, mO, mLse, mGate, vs, tile, kv_head,
                                lane, n // 2, n)

    @cute.jit
    def consume_overlapped(self, cs, tOrP, my_tiles):
        """One consumer warpgroup, its tensor cores kept busy through the softmax (FA3's
        intra-warpgroup overlap): tile i's QK and tile i-1's PV are issued together, the softmax
        of tile i runs while PV(i-1) is on the tensor cores, and stage i-1 is released when PV(i-1)
        completes. P alternates between two register buffers (the loop is unrolled by two), so
        P(i) is written while PV(i-1) still reads P(i-1); with one buffer ptxas had to move the
        PV wait up into the softmax. O is rescaled after PV(i-1). The consumer holds two stages
        at a time, one more than the serial loop."""
        tOrP2 = cute.make_rmem_tensor(tOrP.shape, self.mma_dtype)
        if my_tiles > 0:
            # tile 0: scores only; its PV goes out with tile 1's QK (O is zero: no rescale)
            self.wait_full(cs, Int32(0))
            warpgroup.fence()
            self.issue_qk(cs, Int32(0))
            warpgroup.commit_group()
            self.load_mask(cs, Int32(0))
            warpgroup.wait_group(0)
            self.softmax.softmax_tile(cs)
            tOrP.store(cs.p_view.load().to(self.mma_dtype))
            # P of an even tile in tOrP, of an odd one in tOrP2
            for i in cutlass.range(1, my_tiles, 2, unroll=1):
                self.overlap_step(cs, tOrP, tOrP2, i)
                if i + 1 < my_tiles:
                    self.overlap_step(cs, tOrP2, tOrP, i + 1)
            last = my_tiles - 1
            warpgroup.fence()
            if last % 2 == 0:
                self.issue_pv(cs, tOrP, last % self.stages)
            else:
                self.issue_pv(cs, tOrP2, last % self.stages)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(cs.empty + last % self.stages)

    @cute.jit
    def overlap_step(self, cs, p_prev, p_next, i):
        """Tile i of :meth:`consume_overlapped`: QK(i) and PV(i-1) (P(i-1) in ``p_prev``), the
        softmax of tile i into ``p_next`` while PV(i-1) runs, then stage i-1 released and O
        rescaled."""
        stage = i % self.stages
        prev = (i - 1) % self.stages
        self.wait_full(cs, i)
        warpgroup.fence()
        self.issue_qk(cs, stage)
        warpgroup.commit_group()
        self.issue_pv(cs, p_prev, prev)
        warpgroup.commit_group()
        self.load_mask(cs, stage)
        warpgroup.wait_group(1)  # QK(i) done (groups complete in order); PV(i-1) may still run
        alpha, grew = self.softmax.softmax_tile(cs)
        p_next.store(cs.p_view.load().to(self.mma_dtype))
        warpgroup.wait_group(0)  # PV(i-1) done: O is free, and so is stage i-1
        cute.arch.mbarrier_arrive(cs.empty + prev)
        if grew:
            self.softmax.rescale(cs, alpha)

    @cute.jit
    def wait_full(self, cs, i):
        """Wait until union tile ``i``'s stage is gathered. Its rows were written by cp.async or
        st.shared (generic proxy); the WGMMAs read them through the async proxy."""
        cute.arch.mbarrier_wait(cs.full + i % self.stages, (i // self.stages) % 2)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def issue_qk(self, cs, stage):
        """S = Q K^T of the stage's tile into ``cs.acc_s`` (not committed)."""
        first = cute.make_mma_atom(cs.qk_mma.op)
        first.set(warpgroup.Field.ACCUMULATE, False)
        rest = cute.make_mma_atom(cs.qk_mma.op)
        rest.set(warpgroup.Field.ACCUMULATE, True)
        for kb in cutlass.range_constexpr(self.D // 16):
            cute.gemm(first if kb == 0 else rest, cs.acc_s, cs.tSrQ[None, None, kb, 0], cs.tSrK[None, None, kb, stage],
                      cs.acc_s)

    @cute.jit
    def issue_pv(self, cs, tOrP, stage):
        """O += P V of the stage's tile, P from the registers ``tOrP`` (not committed)."""
        for kb in cutlass.range_constexpr(self.tile // 16):
            cute.gemm(cs.pv_mma, cs.acc_o, tOrP[None, None, kb], cs.tOrV[None, None, kb, stage], cs.acc_o)

    @cute.jit
    def load_mask(self, cs, stage):
        """The membership words of the thread's two query columns' rows for the stage's tile."""
        for h in cutlass.range_constexpr(2):
            for k in cutlass.range_constexpr(self.words):
                cs.mw[h * self.words + k] = cs.sMask[cs.word_base[h] + k, stage] >> cs.n_off

    @cute.jit
    def stage_q_shared(self, mQ, sQ, sRed, tile, kv_head, tidx, warp, lane, wg):
        """Two consumer warpgroups: the first stages Q and publishes its scale exponent (FP8),
        then both wait for sQ. Returns that exponent."""
        if wg == 0:
            q_log2 = self.query.stage_q(mQ, sQ, sRed, tile, kv_head, tidx, warp, lane)
            if tidx == 0:
                sRed[0, 1] = q_log2  # column 0 is stage_q's scratch
            cute.arch.fence_proxy("async.shared", space="cta")  # sQ is read by WGMMA (async proxy)
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=2 * self.warps * 32)
        return sRed[0, 1]

    @cute.jit
    def combine_consumers(self, storage, acc_o, row_max, row_sum, cO0, wg, tidx):
        """Fold the two consumer warpgroups' running states together, each group keeping half
        of the O fragment: both groups have the same thread-to-element map, so thread t of each
        group hands the half the other finishes (elements [0, n/2) go to group 0, the rest to
        group 1), plus its maxima and sums, to thread t of the other group through the idle K
        tiles (element-major: conflict-free)."""
        n = cute.size(acc_o)
        half = n // 2
        nt = self.warps * 32
        sX = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), dtype=Float32),
                              cute.make_layout((2, half + 4, nt), stride=((half + 4) * nt, nt, 1)))
        # both groups' last WGMMAs (async proxy) are done before the K tiles are overwritten
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=2 * nt)
        if wg == 1:  # to group 0: elements [0, half)
            for e in cutlass.range_constexpr(half):
                sX[0, e, tidx] = acc_o[e]
            for h in cutlass.range_constexpr(2):
                sX[0, half + h, tidx] = row_max[h]
                sX[0, half + 2 + h, tidx] = row_sum[h]
        else:  # to group 1: elements [half, n)
            for e in cutlass.range_constexpr(half):
                sX[1, e, tidx] = acc_o[half + e]
            for h in cutlass.range_constexpr(2):
                sX[1, half + h, tidx] = row_max[h]
                sX[1, half + 2 + h, tidx] = row_sum[h]
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=2 * nt)
        a0 = cute.make_rmem_tensor((2,), Float32)
        a1 = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            m1 = sX[wg, half + h, tidx]
            m = cute.arch.fmax(row_max[h], m1)
            safe = m if m != -Float32.inf else Float32(0.0)
            a0[h] = cute.math.exp2(row_max[h] - safe, fastmath=True)
            a1[h] = cute.math.exp2(m1 - safe, fastmath=True)
            row_sum[h] = row_sum[h] * a0[h] + sX[wg, half + 2 + h, tidx] * a1[h]
            row_max[h] = m
        if wg == 0:
            for e in cutlass.range_constexpr(half):
                acc_o[e] = acc_o[e] * a0[cO0[e][0] // 8] + sX[0, e, tidx] * a1[cO0[e][0] // 8]
        else:
            for e in cutlass.range_constexpr(half):
                acc_o[half + e] = acc_o[half + e] * a0[cO0[half + e][0] // 8] + sX[1, e, tidx] * a1[cO0[half + e][0] // 8]

    @cute.jit
    def store_rows(self, acc_o, row_max, row_sum, cO0, cO, m_off, mO, mLse, mGate, v_scale, tile, kv_head, lane,
                   e0: cutlass.Constexpr, e1: cutlass.Constexpr):
        """The epilogue of accumulator elements [e0, e1): one query column per quad; O rows in q's
        dtype (gated), and the LSE (by the group that stores element 0)."""
        G, R = self.G, self.R
        inv = cute.make_rmem_tensor((2,), Float32)
        token = cute.make_rmem_tensor((2,), Int32)
        head = cute.make_rmem_tensor((2,), Int32)
        live = cute.make_rmem_tensor((2,), Int32)
        for h in cutlass.range_constexpr(2):
            total = row_sum[h]
            for off in (1, 2):
                total = total + cute.arch.shuffle_sync_bfly(total, off)
            inv[h] = Float32(0.0)
            lse = -Float32.inf
            if total > Float32(0.0):
                inv[h] = v_scale / total
                lse = row_max[h] + cute.math.log2(total, fastmath=True)
            m = m_off + 8 * h
            r = m // G
            token[h] = tile * R + r
            head[h] = kv_head * G + (m - r * G)
            live[h] = Int32(1) if m < R * G and token[h] < mO.shape[0] else Int32(0)
            if const_expr(e0 == 0):
                if lane % 4 == 0 and live[h] != 0:
                    mLse[token[h], head[h]] = lse
        # Elements (e, e + 1) of the accumulator are adjacent columns of one row (checked at
        # trace time), so O (and an aligned gate) move as 4-byte pairs: half the accesses.
        n = e1 - e0
        assert e0 % 2 == 0 and n % 2 == 0
        for e in cutlass.range_constexpr(e0, e1, 2):
            assert cO0[e + 1][0] == cO0[e][0] and cO0[e + 1][1] == cO0[e][1] + 1
        if const_expr(not self.cfg.gate):
            o2 = cute.make_rmem_tensor((2,), mO.element_type)
            for e in cutlass.range_constexpr(e0, e1, 2):
                h = cO0[e][0] // 8
                if live[h] != 0:
                    for i in cutlass.range_constexpr(2):
                        o2[i] = (acc_o[e + i] * inv[h]).to(mO.element_type)
                    cute.local_tile(mO[token[h], head[h], None], (2,), (cO[e][1] // 2,)).store(o2.load())
        else:
            # All gate loads are in flight before the first output store (all n elements fit in
            # registers as packed 16-bit values): the compiler cannot move a load of mGate above a
            # store to mO (they may alias), and a load under a branch waits inside it, so one load
            # per element between stores serialized an L2 round trip each
            # (docs/design/qsa.md#gated-epilogue). A dead row's gate is read from token 0 (which
            # exists) and never used: no branch.
            gtok = cute.make_rmem_tensor((2,), Int32)
            for h in cutlass.range_constexpr(2):
                gtok[h] = token[h] * live[h]
            w = self.cfg.gate_vec
            gv = cute.make_rmem_tensor((n,), mGate.element_type)
            for k in cutlass.range_constexpr(0, n, w):
                h = cO0[e0 + k][0] // 8
                src = cute.local_tile(mGate[gtok[h], head[h], None], (w,), (cO[e0 + k][1] // w,))
                cute.local_tile(gv, (w,), (k // w,)).store(src.load())
            # every element's gated value first (dead rows too), so that no gate load is consumed
            # only under a row's branch, where the compiler would sink it
            ov = cute.make_rmem_tensor((n,), mO.element_type)
            for k in cutlass.range_constexpr(n):
                # round the attention output first, then the fp32 gate product
                o = (acc_o[e0 + k] * inv[cO0[e0 + k][0] // 8]).to(mO.element_type)
                ov[k] = (o.to(Float32) * sigmoid(gv[k].to(Float32))).to(mO.element_type)
            for k in cutlass.range_constexpr(0, n, 2):
                h = cO0[e0 + k][0] // 8
                if live[h] != 0:
                    dst = cute.local_tile(mO[token[h], head[h], None], (2,), (cO[e0 + k][1] // 2,))
                    dst.store(cute.local_tile(ov, (2,), (k // 2,)).load())

    @cute.jit
    def row_count(self, mIdx, row):
        """Columns of ``row`` to visit: ``min(valid_count, TOPK)``; 0 past the last row."""
        topk = mIdx.shape[1] - 1
        count = Int32(0)
        if row < mIdx.shape[0]:
            count = cutlass.min(cutlass.max(mIdx[row, topk], Int32(0)), topk)
        return count

    @cute.jit
    def tile_count(self, mIdx, mLen, tile):
        """KV tiles the CTA walks: the union's, or the sum of its rows' (fallback)."""
        length = mLen[tile]
        n = Int32(0)
        if length >= 0:
            n = (length + self.tile - 1) // self.tile
        else:
            for r in cutlass.range_constexpr(self.R):
                n = n + (self.row_count(mIdx, tile * self.R + r) + self.tile - 1) // self.tile
        return n

    @cute.jit
    def produce_tile(self, mK, mV, mIdx, mBlockTable, mTokenToReq, mUnion, mMember, mLen, storage, k_layout,
                     v_layout, sMask, full, empty, tile, kv_head, pw, lane):
        """The tile's pipeline slots: its union's tiles, or (``length = -1``) its rows' own tiles one
        row after another. Gather group ``g`` of ``groups`` fills slots ``g, g + groups, ...``
        (one group: every slot; the single-group arithmetic is resolved at trace time)."""
        groups = self.groups
        g = 0
        if const_expr(groups > 1):
            pw, g = pw % self.P, pw // self.P  # the warp's index in its group, the group
        length = mLen[tile]
        row0 = tile * self.R
        if length >= 0:
            req = Int32(-1)
            if row0 < mTokenToReq.shape[0]:
                req = mTokenToReq[row0]  # the pre-pass checked that every row shares it
            n = (length + self.tile - 1) // self.tile
            mine = n if const_expr(groups == 1) else (n - g + groups - 1) // groups
            self.gather.gather_list(mK, mV, mUnion, tile, length, length, Int32(g), Int32(groups), mine, Int32(g), req,
                             mBlockTable, storage, k_layout, v_layout, sMask, full, empty, kv_head, pw, lane, mMember,
                             1, Int32(0), groups)
        else:
            topk = mIdx.shape[1] - 1
            i0 = Int32(0)
            for r in cutlass.range(self.R, unroll=1):
                row = row0 + r
                count = self.row_count(mIdx, row)
                n = (count + self.tile - 1) // self.tile
                j0 = 0  # the row's first tile in this group's slots
                mine = n
                if const_expr(groups > 1):
                    j0 = (g + groups - i0 % groups) % groups
                    mine = (n - j0 + groups - 1) // groups
                if n > j0:
                    self.gather.gather_list(mK, mV, mIdx, row, topk, count, Int32(j0), Int32(groups), mine, i0 + j0,
                                     mTokenToReq[row], mBlockTable, storage, k_layout, v_layout, sMask, full, empty,
                                     kv_head, pw, lane, None, 2, r, groups)
                i0 = i0 + n
