"""SM80-class paged prefill (varlen, chunked against a cached prefix, causal or not), FA2-style
on warp-level ``mma.sync``: a tile of packed query rows in registers, K/V pages gathered with
16-byte ``cp.async`` into a shared-memory ring. Design: docs/design/sm80.md.

One CTA per (row tile, KV head, request); with ``heads_first`` the KV heads are the grid's fastest
dimension, so each request's longest row tiles of every head start first
(docs/design/sm80.md#the-grid-order). Request b's new tokens are ``q[query_start_loc[b] :
query_start_loc[b + 1]]``, the last ``q_len`` of its ``seq_lens[b]`` positions; its query rows
are packed (row p: token p // group, head p % group) so that one K/V tile serves the whole GQA
group. Causal: tiles past the tile's last row are never loaded, and only tiles that cross a
row's limit are masked. The grid's row-tile extent comes from ``max_query_len`` (no host sync);
tiles past a request's rows do nothing, and the largest row tiles (most KV under a causal mask)
are scheduled first.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..jit.spec import bind_arguments
from ..roles.cp_async_pages import cache_views
from ..roles.warp_attention import LOG2E, engine_for
from ..roles.warp_rows_out import stage_own_rows, store_own_rows


class Sm80PagedPrefill:
    """Kernel object; every field is compile-time (see ``plans.sm80.Sm80PrefillConfig``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.arg_names = cfg.arg_names()
        self.G = cfg.group
        self.engine, self.gather, self.kv_region = engine_for(cfg)

    @cute.jit
    def __call__(self, *args):
        """The config's arguments (``Sm80PrefillConfig.signature()``: one cache tensor or K and V,
        the LSE only where it is written) and the stream."""
        a = bind_arguments(self.arg_names, args)
        if const_expr(self.cfg.kv_form == "single"):
            mKc = mVc = a["kv_cache"]
        else:
            mKc, mVc = a["k_cache"], a["v_cache"]
        mLse = a["lse"] if const_expr(self.cfg.write_lse) else a["out"]
        self.launch(a["q"], mKc, mVc, a["block_table"], a["seq_lens"], a["query_start_loc"], a["out"], mLse,
                    a["k_scale"], a["v_scale"], a["sm_scale"], a["max_query_len"], a["stream"])

    @cute.jit
    def launch(self, mQ, mKc, mVc, mBlockTable, mSeqLens, mQStart, mO, mLse, k_scale, v_scale, sm_scale: Float32,
               max_query_len: Int32, stream):
        cfg, eng = self.cfg, self.engine
        mK, mV, num_pages, num_kv_heads = cache_views(mKc, mVc, cfg.kv_form, cfg.kv_layout)
        self.storage = eng.storage(self.kv_region)
        m_blocks = (max_query_len * self.G + eng.rows - 1) // eng.rows
        kernel = self.kernel(mQ, mK, mV, num_pages, mBlockTable, mSeqLens, mQStart, mO, mLse, k_scale, v_scale,
                             sm_scale)
        # heads_first: the op keeps m_blocks within the grid's y extent (plans.sm80.prefill_heads_first_max_q)
        grid = [num_kv_heads, m_blocks, mBlockTable.shape[0]] if const_expr(cfg.heads_first) else \
            [m_blocks, num_kv_heads, mBlockTable.shape[0]]
        # max_ctas_per_sm: a launch padded to cap the CTAs per SM (docs/design/sm80.md#ping-pong-in-99-kb)
        smem = self.storage.size_in_bytes()
        if const_expr(cfg.max_ctas_per_sm > 0):
            smem = max(smem, cfg.launch_smem_bytes())
        # one_cta_bound: else ptxas may cap the build at 128 registers (docs/design/sm80.md#the-one-cta-bound); 0: no bound
        kernel.launch(grid=grid, block=[eng.threads, 1, 1], smem=smem, stream=stream, use_pdl=cfg.pdl,
                      min_blocks_per_mp=int(cfg.one_cta_bound))

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, num_pages: Int32, mBlockTable: cute.Tensor,
               mSeqLens: cute.Tensor, mQStart: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, k_scale, v_scale,
               sm_scale: Float32):
        cfg, eng, G = self.cfg, self.engine, self.G
        tidx, _, _ = cute.arch.thread_idx()
        bx, kv_head, batch_idx = cute.arch.block_idx()
        if const_expr(cfg.heads_first):  # block indices, not computed values: ptxas re-reads them at will
            kv_head, by = bx, kv_head
            m_block = cute.arch.grid_dim()[1] - 1 - by  # every head's longest causal rows first
        else:
            m_block = cute.arch.grid_dim()[0] - 1 - bx  # the longest causal rows first
        warp_id = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        wm = warp_id // eng.warps_n
        wn = warp_id % eng.warps_n

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_wait()

        q_start = mQStart[batch_idx]
        q_len = mQStart[batch_idx + 1] - q_start
        row0 = m_block * eng.rows  # first packed row of this tile
        if row0 < q_len * G:
            self.row_tile(mQ, mK, mV, num_pages, mBlockTable, mSeqLens, mO, mLse, k_scale, v_scale, sm_scale,
                          storage, q_start, q_len, row0, kv_head, batch_idx, tidx, wm, wn, lane)
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def row_tile(self, mQ, mK, mV, num_pages, mBlockTable, mSeqLens, mO, mLse, k_scale, v_scale, sm_scale, storage,
                 q_start, q_len, row0, kv_head, batch_idx, tidx, wm, wn, lane):
        """The attention of one tile of packed rows (``row0 ..``) that holds at least one real row."""
        cfg, eng, G = self.cfg, self.engine, self.G
        kv_base = storage.kv.data_ptr().toint()
        sq_base = storage.q.data_ptr().toint()
        sStats = storage.stats.get_tensor(eng.stats_layout())
        sScale = storage.scale.get_tensor(cute.make_layout(eng.rows))
        ks = k_scale[0] if const_expr(isinstance(k_scale, cute.Tensor)) else Float32(k_scale)
        vs = v_scale[0] if const_expr(isinstance(v_scale, cute.Tensor)) else Float32(v_scale)
        seq_len = mSeqLens[batch_idx]
        # positions at or past the block table's capacity are not attended (docs/design/inputs.md#lengths)
        kv_cap = cutlass.min(seq_len, mBlockTable.shape[1] * cfg.page_size)
        prefix = seq_len - q_len

        def row_token_head(r):
            return q_start + (row0 + r) // G, kv_head * G + (row0 + r) % G

        def row_valid(r):
            return row0 + r < q_len * G

        def row_limit(r):
            lim = kv_cap
            if const_expr(cfg.causal):
                lim = cutlass.min(prefix + (row0 + r) // G + 1, kv_cap)
            return lim

        def tile_of(i):
            return i

        def tile_span():  # what the tile's last row sees: no tile past it is loaded
            last_row = cutlass.min(row0 + eng.rows, q_len * G) - 1 - row0
            return row_limit(last_row)

        def tile_count(kv_end):
            return cutlass.max((kv_end + eng.tile - 1) // eng.tile, Int32(0))

        def issue_to(kv_end):
            def issue(tile_idx, stage_addr):
                self.gather.issue(mK, mV, mBlockTable, num_pages, batch_idx, kv_head, tile_idx, kv_end, stage_addr,
                                  tidx)
            return issue

        g = self.gather
        if const_expr(cfg.ring_release):  # the stages' barriers, made visible by the barrier after Q
            full_base = storage.full.data_ptr().toint()
            eng.init_ring(full_base, tidx)
        if const_expr(cfg.kv_first):  # the first stages' copies in flight while Q is staged
            kv_end = tile_span()
            n_tiles = tile_count(kv_end)
            eng.prologue(issue_to(kv_end), tile_of, n_tiles, cfg.stages, kv_base, g.stage_bytes)

        logit_scale = sm_scale * ks * Float32(LOG2E * 2.0 ** eng.widen_log2)
        eng.stage_q(mQ, row_token_head, row_valid, logit_scale, sq_base, sScale, tidx)
        cute.arch.barrier()
        state = eng.make_state()
        eng.load_q_all(state[2], sq_base, wm, lane)
        row_scale, limits = eng.row_setup(sScale, wm, lane, row_limit)
        # (the default keeps its statements' order: its PTX is the one before kv_first existed)
        if const_expr(not cfg.kv_first):
            kv_end = tile_span()
        min_limit = row_limit(Int32(0))
        if const_expr(not cfg.kv_first):
            n_tiles = tile_count(kv_end)
        if const_expr(cfg.ring_release):
            eng.released_mainloop(issue_to(kv_end), tile_of, n_tiles, kv_base, g.stage_bytes, g.tile_bytes, state,
                                  sq_base, row_scale, limits, min_limit, wm, wn, lane, sStats, full_base,
                                  cfg.kv_first)
        else:
            eng.mainloop(issue_to(kv_end), tile_of, n_tiles, cfg.stages, kv_base, g.stage_bytes, g.tile_bytes,
                         state, sq_base, row_scale, limits, min_limit, wm, wn, lane, sStats, issued=cfg.kv_first)
        if const_expr(cfg.warp_store):  # each warp's rows out on their own (docs/design/sm80.md#the-output-per-warp)
            def out_row(r):  # (real row, token, head) of CTA row r
                p = row0 + r
                return p < q_len * G, q_start + p // G, kv_head * G + p % G

            stage_own_rows(eng, state, sq_base, sStats, wm, lane, vs, mO.element_type, out_row,
                           mLse if const_expr(cfg.write_lse) else None)
            store_own_rows(eng, sq_base, wm, lane, out_row, mO)
        else:
            sO = cute.make_tensor(cute.recast_ptr(storage.kv.data_ptr(), dtype=Float32), eng.o_layout())
            eng.finish(state, sO, sStats, wm, wn, lane, vs)
            self.store(mO, mLse, sO, sStats, q_start, q_len, row0, kv_head, tidx)

    @cute.jit
    def store(self, mO, mLse, sO, sStats, q_start, q_len, row0, kv_head, tidx):
        """Coalesced output of the tile's valid rows (four dims per thread and step), and their
        LSE when the variant writes it."""
        G = self.G
        chunks = self.engine.D // 4
        rows = cutlass.min(q_len * G - row0, self.engine.rows)
        work = rows * chunks
        for it in cutlass.range((work + self.engine.threads - 1) // self.engine.threads, unroll=1):
            idx = it * self.engine.threads + tidx
            if idx < work:
                r = idx // chunks
                d0 = (idx % chunks) * 4
                token = q_start + (row0 + r) // G
                head = kv_head * G + (row0 + r) % G
                vals = self.engine.output_chunk(sO, r, d0)
                cute.local_tile(mO[token, head, None], (4,), (d0 // 4,)).store(vals.load().to(mO.element_type))
                if const_expr(self.cfg.write_lse):
                    if d0 == 0:
                        mLse[token, head] = sStats[2 * self.engine.warps_n, r]

