"""SM80-class paged decode (SM80/86/89/120/121, and SM90/SM100 where their own kernels do not
serve a shape): warp-level ``mma.sync`` m16n8k16, ``ldmatrix``, 16-byte ``cp.async`` page gathers
into a shared-memory ring; no TMA, no WGMMA. Design: docs/design/sm80.md.

One CTA per (split, KV head, request). Its query rows are the KV group's ``group x q_len`` rows
(row r: draft token r // group, head r % group), padded to 16-row MMA tiles; the ``warps_n``
warps of a row tile split each stage's tokens and keep separate softmax states, merged once at
the end (:mod:`~cute_kernels.roles.warp_attention`). Split s takes tiles s, s + S, ...; a split
launch writes fp32 partials and their base-2 LSE, which the last split CTA of each (request, KV
head) merges (``fused_merge``, :mod:`~cute_kernels.roles.split_merge`) or
:mod:`cute_kernels.common.merge` does in a second launch.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..jit.spec import bind_arguments
from ..roles.cp_async_pages import cache_views
from ..roles.split_merge import SplitMerge
from ..roles.warp_attention import LOG2E, engine_for


class Sm80PagedDecode:
    """Kernel object; every field is compile-time (see ``plans.sm80.Sm80DecodeConfig``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.arg_names = cfg.arg_names()
        self.G, self.q_len = cfg.group, cfg.q_len
        self.R = cfg.group * cfg.q_len
        self.engine, self.gather, self.kv_region = engine_for(cfg)
        self.stages = cfg.stages
        # the SM90 decode's global merge: partials read back from L2 (no shared-memory staging)
        self.split_merge = SplitMerge(
            D=cfg.head_dim, N=self.R, G=self.G, q_len=self.q_len, merge="global" if cfg.fused_merge else None,
            smem_merge=False, dynamic=False, merge_slots=0, merge_slot_bytes=0, merge_group=cfg.merge_group,
            cluster_group=1, warps=self.engine.warps, num_threads=self.engine.threads)

    @cute.jit
    def __call__(self, *args):
        """The config's arguments (``Sm80DecodeConfig.signature()``: one cache tensor or K and V,
        the output and LSE or a split's partials) and the stream."""
        a = bind_arguments(self.arg_names, args)
        if const_expr(self.cfg.kv_form == "single"):
            mKc = mVc = a["kv_cache"]
        else:
            mKc, mVc = a["k_cache"], a["v_cache"]
        merge = ()  # the fused merge's (partials, partial LSEs, arrival counters): kernel parameters only there
        if const_expr(self.cfg.fused_merge):
            mO, mLse, num_splits = a["out"], a["lse"], a["part_out"].shape[0]
            merge = (a["part_out"], a["part_lse"], a["counters"])
        elif const_expr(self.cfg.split):
            mO, mLse, num_splits = a["part_out"], a["part_lse"], a["part_out"].shape[0]
        else:
            mO, mLse, num_splits = a["out"], a["lse"], 1
        self.launch(a["q"], mKc, mVc, a["block_table"], a["seq_lens"], mO, mLse, a["k_scale"], a["v_scale"],
                    a["sm_scale"], num_splits, merge, a["stream"])

    @cute.jit
    def launch(self, mQ, mKc, mVc, mBlockTable, mSeqLens, mO, mLse, k_scale, v_scale, sm_scale: Float32,
               num_splits, merge, stream):
        cfg, eng = self.cfg, self.engine
        mK, mV, num_pages, num_kv_heads = cache_views(mKc, mVc, cfg.kv_form, cfg.kv_layout)
        self.storage = eng.storage(self.kv_region)
        kernel = self.kernel(mQ, mK, mV, num_pages, mBlockTable, mSeqLens, mO, mLse, k_scale, v_scale, sm_scale,
                             *merge)
        kernel.launch(grid=[num_splits, num_kv_heads, mBlockTable.shape[0]], block=[eng.threads, 1, 1],
                      smem=self.storage.size_in_bytes(), stream=stream, use_pdl=cfg.pdl)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, num_pages: Int32, mBlockTable: cute.Tensor,
               mSeqLens: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, k_scale, v_scale, sm_scale: Float32,
               mPartO: cute.Tensor = None, mPartLse: cute.Tensor = None, mCounter: cute.Tensor = None):
        cfg, eng, G = self.cfg, self.engine, self.G
        tidx, _, _ = cute.arch.thread_idx()
        split, kv_head, batch_idx = cute.arch.block_idx()
        num_splits = cute.arch.grid_dim()[0]
        warp_id = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        wm = warp_id // eng.warps_n
        wn = warp_id % eng.warps_n

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        kv_base = storage.kv.data_ptr().toint()
        sq_base = storage.q.data_ptr().toint()
        sStats = storage.stats.get_tensor(eng.stats_layout())
        sScale = storage.scale.get_tensor(cute.make_layout(eng.rows))
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_wait()

        ks = k_scale[0] if const_expr(isinstance(k_scale, cute.Tensor)) else Float32(k_scale)
        vs = v_scale[0] if const_expr(isinstance(v_scale, cute.Tensor)) else Float32(v_scale)
        seq_len = mSeqLens[batch_idx]
        # positions at or past the block table's capacity are not attended (docs/design/inputs.md#lengths)
        kv_end = cutlass.min(seq_len, mBlockTable.shape[1] * cfg.page_size)
        q_len = self.q_len

        def row_token_head(r):
            return batch_idx * q_len + r // G, kv_head * G + r % G

        def row_valid(r):
            return r < self.R

        def tile_of(i):
            return split + i * num_splits

        g = self.gather
        pids = None
        if const_expr(cfg.page_prefetch):  # tile_of(0)'s page ids; each issue loads its successor's
            pids = g.make_page_ids()
            g.load_page_ids(mBlockTable, batch_idx, tile_of(0), kv_end, tidx, pids)

        def issue(tile_idx, stage_addr):  # the ring issues this split's tiles in order
            g.issue(mK, mV, mBlockTable, num_pages, batch_idx, kv_head, tile_idx, kv_end, stage_addr, tidx, pids)
            if const_expr(cfg.page_prefetch):
                g.load_page_ids(mBlockTable, batch_idx, tile_idx + num_splits, kv_end, tidx, pids)

        def tiles_mine():  # tiles split, split + S, ...
            num_tiles = (kv_end + eng.tile - 1) // eng.tile
            return cutlass.max((num_tiles - split + num_splits - 1) // num_splits, Int32(0))

        if const_expr(cfg.kv_first):  # the first stages' copies in flight while Q is staged
            n_mine = tiles_mine()
            eng.prologue(issue, tile_of, n_mine, self.stages, kv_base, g.stage_bytes)

        logit_scale = sm_scale * ks * Float32(LOG2E * 2.0 ** eng.widen_log2)
        eng.stage_q(mQ, row_token_head, row_valid, logit_scale, sq_base, sScale, tidx)
        cute.arch.barrier()

        state = eng.make_state()
        eng.load_q_all(state[2], sq_base, wm, lane)

        def row_limit(r):  # draft token r // G sees positions < seq_len - q_len + r // G + 1
            return cutlass.min(seq_len - q_len + r // G + 1, kv_end)

        row_scale, limits = eng.row_setup(sScale, wm, lane, row_limit)
        min_limit = cutlass.min(seq_len - q_len + 1, kv_end)

        if const_expr(not cfg.kv_first):
            n_mine = tiles_mine()
        eng.mainloop(issue, tile_of, n_mine, self.stages, kv_base, g.stage_bytes, g.tile_bytes, state, sq_base,
                     row_scale, limits, min_limit, wm, wn, lane, issued=cfg.kv_first)
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_launch_dependents()

        sO = cute.make_tensor(cute.recast_ptr(storage.kv.data_ptr(), dtype=Float32), eng.o_layout())
        eng.finish(state, sO, sStats, wm, wn, lane, vs)
        if const_expr(cfg.fused_merge):
            self.store(mPartO, mPartLse, sO, sStats, batch_idx, kv_head, split, tidx)
            # the arrival flag overlays the logit scales, dead since the main loop began
            sFlag = cute.make_tensor(cute.recast_ptr(storage.scale.data_ptr(), dtype=Int32), cute.make_layout(4))
            # (no staged merge: the ring's address only fills the role's never-taken staging branch)
            self.split_merge.merge_splits(mO, mLse, mPartO, mPartLse, mCounter, sFlag, num_splits, batch_idx,
                                          kv_head, tidx, (kv_base, kv_base))
        else:
            self.store(mO, mLse, sO, sStats, batch_idx, kv_head, split, tidx)

    @cute.jit
    def store(self, mO, mLse, sO, sStats, batch_idx, kv_head, split, tidx):
        """Coalesced output: four dims per thread and step, row by row. Split: fp32 partial
        ``mO[split, token, head, d]`` and ``mLse[split, token, head]`` (the partials); else the
        query's dtype."""
        G = self.G
        chunks = self.engine.D // 4
        work = self.R * chunks
        for it in cutlass.range((work + self.engine.threads - 1) // self.engine.threads, unroll=1):
            idx = it * self.engine.threads + tidx
            if idx < work:
                r = idx // chunks
                d0 = (idx % chunks) * 4
                token = batch_idx * self.q_len + r // G
                head = kv_head * G + r % G
                vals = self.engine.output_chunk(sO, r, d0)
                if const_expr(self.cfg.split):  # fp32 partials (fused_merge too)
                    cute.local_tile(mO[split, token, head, None], (4,), (d0 // 4,)).store(vals.load())
                    if d0 == 0:
                        mLse[split, token, head] = sStats[2 * self.engine.warps_n, r]
                else:
                    cute.local_tile(mO[token, head, None], (4,), (d0 // 4,)).store(vals.load().to(mO.element_type))
                    if d0 == 0:
                        mLse[token, head] = sStats[2 * self.engine.warps_n, r]

