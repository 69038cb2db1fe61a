"""The paged K/V producer of the SM90 paged decode (device role): TMA page boxes into an mbarrier
pipeline, with page-table lookahead and invalid pages read as zeros.

A CTA walks its KV tiles of ``tile`` tokens; one TMA box is ``box = min(page, tile)`` tokens of one
page x the full head dim, so a tile is ``tile / box`` boxes. The producer warp looks the pages up in
the block table 32 boxes at a time (one page id per lane, ahead of their use) and issues each
tile's K boxes, then its V boxes, into ``stages``-deep pipelines. A page id past the sequence,
past the table, negative or beyond the pool becomes ``num_pages``: TMA zero-fills a box whose
coordinate is out of range, so no page id can make the kernel read outside the cache.

Schedules (per split CTA): a contiguous tile range, strided tiles ``s, s + S, ...`` (whose first
page-table load need not wait for the request's length), or dynamic chunks taken from a shared
counter; :meth:`PagedKVProducer.next_tile` is the consumer's side of the same schedule. With a
sliding window (``window``) the schedule starts at the tile of the oldest row's window start, and
the boxes of that tile wholly before it are out of range too: no page outside the window is read.
Design: docs/design/sm90-decode.md#the-design-as-it-stands.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from .fragments import EVICT_FIRST_POLICY, load_b32_if


class PagedKVProducer:
    """TMA producer of K and V tiles from a paged cache: ``D`` head dims, ``page`` tokens per page,
    ``tile`` tokens per tile, ``stages`` pipeline stages; ``fp8``: V is stored like K (tokens x D,
    widened by the consumer), else as V^T (D x tokens, the MN-major SS operand). ``strided`` /
    ``dynamic``: the split schedule; ``chunk_tiles``: tiles per dynamic grab; ``evict_first``: the
    loads carry the L2 evict-first policy (every KV byte is read once per call); ``tail``: the
    static producer waits, after its last tile, until the consumers have released every stage
    (a CTA of a thread-block cluster, whose shared memory its peers read before it exits);
    ``window``: the static schedule's boxes before ``key_lo`` (the first visible key) are
    zero-filled, not read."""

    def __init__(self, *, D: int, page: int, tile: int, stages: int, fp8: bool, strided: bool, dynamic: bool,
                 evict_first: bool, chunk_tiles_max: int, tail: bool = False, window: bool = False):
        self.D, self.page, self.tile, self.stages, self.fp8 = D, page, tile, stages, fp8
        self.strided, self.dynamic, self.evict_first = strided, dynamic, evict_first
        self.tail, self.window = tail, window
        self.box = min(page, tile)  # tokens per TMA box
        self.boxes_per_tile = tile // self.box
        # dynamic split: tiles per grab (their page ids must fit one per lane of the producer warp)
        self.chunk_tiles = max(1, min(chunk_tiles_max, 32 // self.boxes_per_tile))

    def make_tma_atoms(self, mK, mV, mVt, N: int, kv_dtype):
        """(Traced, host side.) The K and V TMA atoms and their global views: one box of ``box``
        tokens x ``D`` (V^T: ``D`` x ``box``) per copy."""
        D, box = self.D, self.box
        k_box_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (box, N, D), kv_dtype, 1)
        tma_k, tma_tK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(k_box_layout, (None, None, 0)), (box, D)
        )
        if self.fp8:
            tma_v, tma_tV = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mV, cute.slice_(k_box_layout, (None, None, 0)), (box, D)
            )
        else:
            v_box_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (D, N, box), kv_dtype, 1)
            tma_v, tma_tV = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mVt, cute.slice_(v_box_layout, (None, None, 0)), (D, box)
            )
        return tma_k, tma_tK, tma_v, tma_tV

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

    @cute.jit
    def produce(self, tma_k, mK, tma_v, mV, sK, sV, pipe_k, pipe_v, mBlockTable, num_pages,
                batch_idx, kv_head, seq_len, tile_begin, tile_end, tile_step, lane, first_raw, key_lo=None,
                states=None):
        """Static split: this CTA's tiles ``tile_begin, tile_begin + tile_step, ... < tile_end``
        (``key_lo``: the window's first visible key, with ``window``). ``states``: the pipelines'
        producer states to continue from (a balanced chunk's next request), returned advanced."""
        nb = self.boxes_per_tile
        tKsK, tKgK, tVsV, tVgV = self.partition_tma(tma_k, mK, tma_v, mV, sK, sV, kv_head)
        if const_expr(states is None):
            state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        else:
            state_k, state_v = states
        # Page ids are fetched 32 boxes at a time, one per lane, well ahead of their TMA. The
        # first batch: with strided splits it was loaded together with seq_len (``first_raw``:
        # one L2 round trip less before the first TMA of every split CTA).
        box0 = self.box_of(tile_begin, tile_step, Int32(0), lane)
        if const_expr(not self.strided or self.window):  # (a window's first tile waits for seq_len)
            first_raw = self.load_page_raw(mBlockTable, batch_idx, box0)
        page_id = self.mask_page(first_raw, num_pages, seq_len, box0, key_lo)
        k = Int32(0)
        for tile in cutlass.range(tile_begin, tile_end, tile_step, unroll=1):
            rel = k * nb  # box index relative to this CTA's first box
            if rel % 32 == 0 and k > 0:
                page_id = self.lookup_page(mBlockTable, num_pages, batch_idx, seq_len,
                                           self.box_of(tile_begin, tile_step, k, lane), key_lo)
            k += 1
            pipe_k.producer_acquire(state_k)
            self.load_tile(tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, pipe_k, pipe_v, state_k, state_v, page_id, rel, tile)
            state_k.advance()
            state_v.advance()
        if const_expr(self.tail):
            # every phase the consumers complete on the empty barriers is waited for before this
            # warp leaves its loop: no arrive is left pending on this CTA's barriers when the
            # cluster merge starts (docs/design/sm90-decode.md#cluster-merge-exit)
            pipe_k.producer_tail(state_k)
            pipe_v.producer_tail(state_v)
        return state_k, state_v

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

    def box_of(self, tile_begin, tile_step, k0, lane):
        """(Traced.) The box this lane looks up for the batch of 32 boxes starting at the CTA's
        ``k0``-th tile: box ``lane % nb`` of its ``(k0 + lane // nb)``-th tile."""
        nb = self.boxes_per_tile
        return (tile_begin + (k0 + lane // nb) * tile_step) * nb + lane % nb

    @cute.jit
    def lookup_page(self, mBlockTable, num_pages, batch_idx, seq_len, box_idx, key_lo=None):
        """Physical page of box ``box_idx`` (one per lane); ``num_pages`` (out of range: TMA
        zero-fill) past the sequence, past the table or for an invalid id."""
        return self.mask_page(self.load_page_raw(mBlockTable, batch_idx, box_idx), num_pages, seq_len, box_idx,
                              key_lo)

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
    def mask_page(self, raw, num_pages, seq_len, box_idx, key_lo=None):
        """``raw`` as a TMA page coordinate: ``num_pages`` (out of range: zero-fill) past the
        sequence or for an invalid id (negative ones too; clamped only to keep it int32); with
        ``window``, also for a box wholly before ``key_lo``."""
        page_id = raw
        if box_idx * self.box >= seq_len or raw < 0 or raw >= num_pages:
            page_id = Int32(num_pages)
        if const_expr(self.window):
            if box_idx * self.box + self.box <= key_lo:
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
        if self.evict_first:
            return dict(cache_policy=cutlass.Int64(EVICT_FIRST_POLICY))
        return {}

    @cute.jit
    def next_tile(self, pipe_k, state_k, sTileId, tile, tile_end, tile_step):
        """The tile after ``tile``, or -1. Static: ``tile + tile_step`` below ``tile_end``. Dynamic:
        the index the producer stored with the next K stage (waited for here; ``issue_qk`` waits
        again, at once)."""
        nxt = Int32(-1)
        if const_expr(self.dynamic):
            pipe_k.consumer_wait(state_k)
            nxt = sTileId[state_k.index]
        else:
            if tile + tile_step < tile_end:
                nxt = tile + tile_step
        return nxt
