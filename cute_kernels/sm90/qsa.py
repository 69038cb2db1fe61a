"""SM90 QSA sparse GQA attention: split-K partial kernel over the packed top-k index buffer.

Contract: ``cute_kernels.reference.qsa_sparse_attention`` (docs: ../shared/docs/qsa-contract.md).

Design:

- **One CTA per (query row, KV head, split)**: 4 consumer warps (one warpgroup) and one producer
  warp. Split ``s`` of ``S`` visits the row's tiles ``s, s + S, ...`` below
  ``ceil(min(valid_count, TOPK) / tile)``, so the few tiles of a short row spread over the splits.
- **Gather with 16-byte cp.async** into a ``stages``-deep mbarrier pipeline, invalid entries
  zero-filled without a global read, lookups two tiles ahead
  (:class:`~cute_kernels.roles.qsa_gather.QsaGather`).
- **Swap-AB WGMMA** (as in ``decode.py``: the same roles): the KV group's
  ``G`` query heads are the MMA's N (padded to 8/16), the tile's tokens its M. 16-bit caches run
  SS WGMMA straight from the gathered tiles (after a ``fence.proxy.async``, since cp.async
  writes through the generic proxy); FP8 caches are read with ``ldmatrix`` and widened exactly to
  fp16 in registers (``cvt.rn.f16x2.e4m3x2``) for RS WGMMA, with the query rescaled by a power of
  two into fp16 range (exact).
- **Online softmax** in base 2, masked entries at -inf; k_scale folds into the logit scale,
  v_scale into the output normalizer, the LSE stays unscaled.
- **Output.** ``split``: fp32 partial O ``[S, rows, Hq, D]`` and base-2 LSE ``[S, rows, Hq]``
  (64-bit strides; an empty split writes 0 and -inf) for ``qsa_merge``; otherwise O rounded to
  q's dtype, times ``sigmoid(gate)`` in fp32 when gated, and the LSE.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..jit.dtypes import cute_dtype
from ..roles.fragments import sigmoid
from ..roles.qsa_gather import QsaGather
from ..roles.query import QueryStager
from ..roles.softmax import BAR_MMA, LOG2E, SwapAbSoftmax, slot_column, slot_of, swap_ab_mmas
from ..roles.widen import Fp8Fragments


class Sm90QsaAttention:
    """Kernel object of :class:`cute_kernels.plans.sm90_qsa.Sm90QsaConfig`; every field is
    compile-time. It composes the QSA gather, the swap-AB consumer of the paged decode (Q staging,
    FP8 fragment widening, online softmax) and its own masking and gated epilogue."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.q_dtype = cute_dtype(cfg.q_dtype)
        self.kv_dtype = cute_dtype(cfg.kv_dtype)
        self.fp8 = cfg.kv_dtype == "fp8_e4m3"
        self.D = cfg.head_dim
        self.G = cfg.group
        self.N = cfg.n_pad
        self.tile = cfg.tile
        self.stages = cfg.stages
        # one consumer warpgroup (warps 0-3), then the gather warps
        self.warps = cfg.consumer_warps
        self.producer_warp = self.warps
        self.mma_m = cfg.hw.WGMMA_M
        self.num_threads = (self.warps + cfg.producers) * 32
        # FP8: the exact cvt widening to fp16 in the consumer's registers (no power-of-two scales:
        # the query is rescaled into fp16 range instead)
        self.mma_dtype = cute_dtype("fp16") if self.fp8 else self.q_dtype
        self.gather = QsaGather(cfg, R=1, producers=cfg.producers, N=self.N, warps=self.warps,
                                num_threads=self.num_threads, mma_dtype=self.mma_dtype, kv_dtype=self.kv_dtype,
                                widen_in_producer=False)
        self.frags = Fp8Fragments(self.D, self.tile, self.fp8, self.fp8, cfg.q_dtype, self.mma_m)
        self.query = QueryStager(self.D, self.N, self.G, 1, bounded=True,
                                 dynamic_q_scale=self.fp8 and cfg.q_dtype == "bf16", q_pre=0, q_permuted=self.fp8,
                                 widen=cfg.widen, warps=self.warps)
        self.softmax = SwapAbSoftmax(self.N, self.D, self.tile, 0, self.warps)

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
        mBlockTable: cute.Tensor,  # [R, W] int32
        mTokenToReq: cute.Tensor,  # [T] int32
        mO: cute.Tensor,  # [T, Hq, D] (q dtype) or split: [S, T, Hq, D] fp32
        mLse: cute.Tensor,  # [T, Hq] or split: [S, T, Hq] fp32
        mGate: cute.Tensor,  # [T, Hq, D] (read only when cfg.gate)
        k_scale,  # Float32, or a [1] fp32 tensor (k_scale_tensor)
        v_scale,  # Float32, or a [1] fp32 tensor (v_scale_tensor)
        stream,
    ):
        num_splits = mO.shape[0] if const_expr(self.cfg.split) else 1
        mmas = swap_ab_mmas(self.D, self.N, self.tile, self.stages, self.kv_dtype, self.mma_dtype, self.fp8, self.mma_m)
        self.gather.launch(self.kernel, (mQ, mK, mV, mIdx, mBlockTable, mTokenToReq, mO, mLse, mGate, k_scale, v_scale),
                           [mQ.shape[0], mK.shape[2], num_splits], stream, mmas)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mIdx: cute.Tensor,
        mBlockTable: cute.Tensor,
        mTokenToReq: cute.Tensor,
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
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        row, kv_head, split = cute.arch.block_idx()
        num_splits = cute.arch.grid_dim()[2]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        if const_expr(cfg.split):
            # let the merge kernel (programmatic dependent launch) get scheduled behind us
            cute.arch.griddepcontrol_launch_dependents()
        storage, sQ, sP, sRed, sMask, full, empty = self.gather.setup_shared(q_layout, p_layout, tidx)
        if const_expr(cfg.pdl):
            # launched as a programmatic dependent: the setup above overlapped the previous
            # kernel's tail; nothing it writes (q, indices, caches) is read before this returns
            cute.arch.griddepcontrol_wait()

        if warp >= self.producer_warp:
            self.produce(mK, mV, mIdx, mBlockTable, mTokenToReq, storage, k_layout, v_layout, sMask, full,
                         empty, row, kv_head, split, num_splits, warp - self.producer_warp, lane)
        else:
            _, my_tiles = self.row_tiles(mIdx, row, split, num_splits)
            self.consume_tiles(mQ, storage, sQ, sP, sRed, sMask, full, empty, mO, mLse, mGate, k_scale,
                               v_scale, qk_mma, pv_mma, k_layout, v_layout, row, kv_head, split, my_tiles,
                               tidx, warp, lane)

    @cute.jit
    def row_tiles(self, mIdx, row, split, num_splits):
        """``(count, my_tiles)``: the row's columns to visit, ``min(valid_count, TOPK)`` (a garbage
        count is clamped, never used as a token), and how many of its tiles split ``s`` visits
        (tiles ``s, s + S, ...`` below ``ceil(count / tile)``)."""
        topk = mIdx.shape[1] - 1
        count = cutlass.min(cutlass.max(mIdx[row, topk], Int32(0)), topk)
        num_tiles = (count + self.tile - 1) // self.tile
        return count, cutlass.max(num_tiles - split + num_splits - 1, Int32(0)) // num_splits

    @cute.jit
    def produce(self, mK, mV, mIdx, mBlockTable, mTokenToReq, storage, k_layout, v_layout, sMask, full, empty,
                row, kv_head, split, num_splits, pw, lane):
        """The row's tiles ``split, split + S, ...`` from its own index list (see ``gather_list``)."""
        topk = mIdx.shape[1] - 1
        count, my_tiles = self.row_tiles(mIdx, row, split, num_splits)
        self.gather.gather_list(mK, mV, mIdx, row, topk, count, split, num_splits, my_tiles, Int32(0),
                         mTokenToReq[row], mBlockTable, storage, k_layout, v_layout, sMask, full, empty,
                         kv_head, pw, lane, None, 0, Int32(0))

    @cute.jit
    def consume_tiles(self, mQ, storage, sQ, sP, sRed, sMask, full, empty, mO, mLse, mGate, k_scale, v_scale,
                      qk_mma, pv_mma, k_layout, v_layout, row, kv_head, split, my_tiles, tidx, warp, lane):
        D, N = self.D, self.N
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        k_base = storage.sK.data_ptr().toint()
        v_base = storage.sV.data_ptr().toint()
        q_log2 = self.query.stage_q(mQ, sQ, sRed, row, kv_head, tidx, warp, lane)
        cute.arch.fence_proxy("async.shared", space="cta")  # sQ is read by WGMMA (async proxy)
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=self.warps * 32)

        ks = k_scale
        if const_expr(self.cfg.k_scale_tensor):
            ks = k_scale[0]  # read on the device: a replayed CUDA graph sees the current value
        # logits in log2 units = S_acc * c (the query was scaled by 2^q_log2 when staged)
        c = Float32(self.D ** -0.5 * LOG2E) * ks * cute.math.exp2(-q_log2, fastmath=False)

        thr_qk, thr_pv, cS0, cS, cO0, acc_s, acc_o, row_max, row_sum = self.softmax.consumer_state(qk_mma, pv_mma, tidx)
        nS = cute.size(acc_s)
        n_base = cS[0][1] - cS0[0][1]  # this thread's column offset (2 * (lane % 4))
        nslots = N // 4  # columns owned by a thread: 8 * j + n_base + {0, 1}
        mblocks = self.tile // self.mma_m
        # this thread's token rows of M block mb are mb * 64 + 16 * warp + lane / 4 + {0, 8}: bits
        # 16 * (warp % 2) + lane / 4 + {0, 8} of bitmask word 2 * mb + warp / 2
        mask_shift = (warp % 2) * 16 + lane // 4

        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        tSrQ = qk_mma.make_fragment_B(thr_qk.partition_B(sQ))
        tOrP = pv_mma.make_fragment_B(thr_pv.partition_B(sP))
        if const_expr(self.fp8):
            tSrK = cute.make_rmem_tensor(thr_qk.partition_A(cute.make_identity_tensor((self.tile, D))).shape,
                                         self.mma_dtype)
            tOrV = cute.make_rmem_tensor(thr_pv.partition_A(cute.make_identity_tensor((D, self.tile))).shape,
                                         self.mma_dtype)
        else:
            tSrK = qk_mma.make_fragment_A(thr_qk.partition_A(sK))
            tOrV = pv_mma.make_fragment_A(thr_pv.partition_A(sV))

        for i in cutlass.range(my_tiles, unroll=1):
            stage = i % self.stages
            cute.arch.mbarrier_wait(full + stage, (i // self.stages) % 2)
            if const_expr(not self.fp8):
                # the gathered rows were written by cp.async (generic proxy); WGMMA reads them
                # through the async proxy
                cute.arch.fence_proxy("async.shared", space="cta")

            # ---------------- S^T = K Q^T ----------------
            if const_expr(self.fp8):
                self.frags.load_k_fragments(tSrK, k_base, k_layout, stage, warp, lane)
            first = cute.make_mma_atom(qk_mma.op)
            first.set(warpgroup.Field.ACCUMULATE, False)
            rest = cute.make_mma_atom(qk_mma.op)
            rest.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(D // 16):
                atom = first if kb == 0 else rest
                if const_expr(self.fp8):
                    cute.gemm(atom, acc_s, tSrK[None, None, kb], tSrQ[None, None, kb, 0], acc_s)
                else:
                    cute.gemm(atom, acc_s, tSrK[None, None, kb, stage], tSrQ[None, None, kb, 0], acc_s)
            warpgroup.commit_group()
            mbits = cute.make_rmem_tensor((mblocks,), Int32)
            for mb in cutlass.range_constexpr(mblocks):
                mbits[mb] = sMask[2 * mb + warp // 2, stage] >> mask_shift
            warpgroup.wait_group(0)

            # ---------------- online softmax over the tile's tokens ----------------
            tile_max = cute.make_rmem_tensor((nslots,), Float32)
            tile_max.fill(-Float32.inf)
            for e in cutlass.range_constexpr(nS):
                s_val = acc_s[e] * c
                r = cS0[e][0]
                if (mbits[r // self.mma_m] >> (r % self.mma_m)) & 1 == 0:
                    s_val = -Float32.inf
                acc_s[e] = s_val
                sl = slot_of(cS0[e][1])
                tile_max[sl] = cute.arch.fmax(tile_max[sl], s_val)
            self.softmax.softmax_tile(acc_s, acc_o, tile_max, row_max, row_sum, sRed, sP, cS0, cO0, n_base,
                              cS[0][0] - cS0[0][0], warp, lane)

            # ---------------- O^T += V^T P^T ----------------
            if const_expr(self.cfg.kv_barriers):
                cute.arch.mbarrier_wait(full + self.stages + stage, (i // self.stages) % 2)
                if const_expr(not self.fp8):
                    cute.arch.fence_proxy("async.shared", space="cta")  # V, as K above
            if const_expr(self.fp8):
                # after QK: the K fragments are dead, so K and V fragments share registers
                self.frags.load_v_fragments(tOrV, v_base, v_layout, stage, warp, lane)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(self.tile // 16):
                if const_expr(self.fp8):
                    cute.gemm(pv_mma, acc_o, tOrV[None, None, kb], tOrP[None, None, kb, 0], acc_o)
                else:
                    cute.gemm(pv_mma, acc_o, tOrV[None, None, kb, stage], tOrP[None, None, kb, 0], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(empty + stage)

        vs = v_scale
        if const_expr(self.cfg.v_scale_tensor):
            vs = v_scale[0]
        self.epilogue(acc_o, row_max, row_sum, sRed, cO0, thr_pv, mO, mLse, mGate, vs, row, kv_head, split,
                      n_base, warp, lane)

    @cute.jit
    def out_row(self, mO, row, kv_head, n):
        """``(token, head, live)`` of WGMMA column ``n`` (head n of the KV group; padding columns
        are not live)."""
        return row, kv_head * self.G + n, n < self.G

    @cute.jit
    def epilogue(self, acc_o, row_max, row_sum, sRed, cO0, thr_pv, mO, mLse, mGate, v_scale, row, kv_head, split,
                 n_base, warp, lane):
        """Normalize and store: fp32 partials + LSE (split), or O in q's dtype (gated) + LSE.
        A row (or split) without a valid entry gets O = 0 and LSE = -inf."""
        cfg = self.cfg
        D, N = self.D, self.N
        nslots = N // 4

        self.softmax.publish_slot_reduction(row_sum, sRed, n_base, warp, lane, lambda a, b: a + b)
        inv = cute.make_rmem_tensor((nslots,), Float32)
        for s in cutlass.range_constexpr(nslots):
            n = slot_column(s, n_base)
            total = sRed[0, n] + sRed[1, n] + sRed[2, n] + sRed[3, n]
            inv[s] = Float32(0.0)
            lse = -Float32.inf
            if total > Float32(0.0):
                inv[s] = v_scale / total
                lse = row_max[s] + cute.math.log2(total, fastmath=True)
            if warp == 0:
                if lane < 4:
                    token, head, live = self.out_row(mO, row, kv_head, n)
                    if live:
                        if const_expr(cfg.split):
                            mLse[split, token, head] = lse
                        else:
                            mLse[token, head] = lse
        cO = thr_pv.partition_C(cute.make_identity_tensor((D, N)))
        n = cute.size(acc_o)
        if const_expr(not cfg.gate or cfg.split):
            for e in cutlass.range_constexpr(n):
                token, head, live = self.out_row(mO, row, kv_head, cO[e][1])
                if live:
                    d = self.frags.physical_d(cO0[e][0], cO[e][0] - cO0[e][0])
                    val = acc_o[e] * inv[slot_of(cO0[e][1])]
                    if const_expr(cfg.split):
                        mO[split, token, head, d] = val
                    else:
                        mO[token, head, d] = val.to(mO.element_type)
        else:
            # Every gate load before the first output store, outside any branch: the compiler
            # cannot move a load of the gate above a store to the output (they may alias), and a
            # load used only under a branch waits inside it; one load per element between stores
            # was a serial L2 round trip each. A padding column reads the group's last head and
            # discards it; every gated value is computed before the stores.
            gv = cute.make_rmem_tensor((n,), mGate.element_type)
            for e in cutlass.range_constexpr(n):
                token, head, _ = self.out_row(mO, row, kv_head, cutlass.min(cO[e][1], self.G - 1))
                gv[e] = mGate[token, head, self.frags.physical_d(cO0[e][0], cO[e][0] - cO0[e][0])]
            ov = cute.make_rmem_tensor((n,), mO.element_type)
            for e in cutlass.range_constexpr(n):
                # round the attention output first, then the fp32 gate product
                o = (acc_o[e] * inv[slot_of(cO0[e][1])]).to(mO.element_type)
                ov[e] = (o.to(Float32) * sigmoid(gv[e].to(Float32))).to(mO.element_type)
            for e in cutlass.range_constexpr(n):
                token, head, live = self.out_row(mO, row, kv_head, cO[e][1])
                if live:
                    mO[token, head, self.frags.physical_d(cO0[e][0], cO[e][0] - cO0[e][0])] = ov[e]
