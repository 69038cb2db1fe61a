"""Paged K/V gather into shared-memory stages with 16-byte ``cp.async`` (no TMA): any page size
that is a power of two from 16 to 128 tokens, either cache layout, one 5-D ``[P, 2, ...]`` tensor
or a (K, V) pair.

Every thread of the CTA copies ``tile * D * bytes / 16 / threads`` 16-byte chunks of K and as many
of V per stage. Token rows are stored at ``D * bytes`` bytes each with the XOR swizzle of their length
(:func:`swizzle`), K first, then V, one stage after the other. A
row past ``limit`` (the sequence's end, or what the CTA's queries can see), of a page past the
block-table row, or of a page id outside ``[0, P)`` is zero-filled and never read: stale cache
bytes can then neither leak NaN into P·V nor be dereferenced. Page ids are read once per thread
and page: a stage's rows of one thread share their page when a page holds several row steps.
Addresses are 32-bit shared-window addresses (``smem_ptr.toint()``): the inner loops compute them
with plain integer arithmetic, no layout algebra. Design: docs/design/sm80.md#kv-gather-and-the-ring.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from .fragments import cp_async_zfill_16_at


def swizzle_shift(row_bytes: int) -> int:
    """log2 of the span whose index mod 8 picks a 16-byte chunk's XOR: the 128-byte line for rows
    of up to 128 bytes, else the row. Rows of 256 or 512 bytes swizzled by their 128-byte line would
    put rows r and r + 4 (r + 2) under one XOR, a 2-way (4-way) bank conflict on every ``ldmatrix``
    (docs/design/sm80.md#the-swizzle-per-row-length)."""
    return max(row_bytes, 128).bit_length() - 1


def swizzle_period(row_bytes: int) -> int:
    """Bytes after which :func:`swizzle` repeats (eight of its spans): a region base or a row step
    that is a multiple of it leaves the swizzled bits alone."""
    return 8 << swizzle_shift(row_bytes)


def swizzle(byte_offset, row_bytes: int):
    """(Traced or int.) The XOR swizzle of a byte offset into ``row_bytes``-byte rows (a power of
    two, 64 to 512) from a region base aligned to ``max(row_bytes, 128)``: the 16-byte chunk within
    each 128-byte line is XORed with the line index mod 8 (rows of up to 128 bytes) or the row
    index mod 8 (longer rows). Eight consecutive rows read at the same column (``ldmatrix``) then
    hit eight different bank groups, whatever the row length."""
    return byte_offset ^ (((byte_offset >> swizzle_shift(row_bytes)) & 7) << 4)


def cache_views(mKc, mVc, kv_form: str, kv_layout: str):
    """(Traced.) ``(mK, mV, num_pages, num_kv_heads)`` with K and V as (token-in-page, d, head,
    page) views of a 5-D ``[P, 2, ...]`` cache (``kv_form`` "single": ``mKc`` is ``mVc``) or of a
    (K, V) pair of 4-D caches, HND or NHD."""
    if kv_form == "single":
        mK4 = mKc[None, 0, None, None, None]
        mV4 = mVc[None, 1, None, None, None]
    else:
        mK4, mV4 = mKc, mVc
    tok, head = (2, 1) if kv_layout == "HND" else (1, 2)
    mK = cute.make_tensor(mK4.iterator, cute.select(mK4.layout, mode=[tok, 3, head, 0]))
    mV = cute.make_tensor(mV4.iterator, cute.select(mV4.layout, mode=[tok, 3, head, 0]))
    return mK, mV, mK4.shape[0], mK4.shape[head]


class PagedKVGather:
    """Static geometry of the gather: ``tile`` tokens per stage, head dim ``D``, ``kv_bytes`` per
    element, ``threads`` copying, ``page`` tokens per page. ``one_base``: a thread's shared-memory
    destinations are one swizzled base plus immediate row steps (a row step of whole swizzle
    periods leaves the swizzled bits alone), not one swizzled address per row that ptxas
    hoists out of the main loop (docs/design/sm80.md#64-token-stages-at-head-dim-128)."""

    def __init__(self, tile: int, D: int, kv_bytes: int, threads: int, page: int, one_base: bool = False):
        self.tile, self.D, self.kv_bytes, self.threads, self.page = tile, D, kv_bytes, threads, page
        self.row_bytes = D * kv_bytes
        self.chunks = self.row_bytes // 16  # 16-byte chunks per token row
        if threads % self.chunks and self.chunks % threads:
            raise ValueError(f"{threads} threads cannot share rows of {self.chunks} chunks")
        self.step = max(1, threads // self.chunks)  # token rows between a thread's rows
        self.rows_per_thread = max(1, tile // self.step)
        self.chunks_per_row_thread = max(1, self.chunks // threads)  # >1 only for 1-warp CTAs at D 256
        if tile % self.step:
            raise ValueError(f"tile {tile} is not a multiple of the row step {self.step}")
        self.tile_bytes = tile * self.row_bytes
        if one_base and ((self.step * self.row_bytes) % swizzle_period(self.row_bytes)
                         or self.chunks_per_row_thread != 1):
            raise ValueError(f"one_base needs a row step of whole {swizzle_period(self.row_bytes)}-byte swizzle "
                             f"periods and one chunk per row and thread, not {self.step} rows of "
                             f"{self.row_bytes} bytes")
        self.one_base = one_base
        self.stage_bytes = 2 * self.tile_bytes

    def page_slot(self, k: int) -> int:
        """Which of the thread's page ids row ``k`` of a stage uses (trace-time)."""
        if self.page >= self.tile:
            return 0  # a stage never straddles a page (both powers of two, stages tile-aligned)
        if self.step < self.page:
            return (self.step * k) // self.page  # the thread's first row is below the step
        return k

    @property
    def page_ids_per_thread(self) -> int:
        return max(self.page_slot(k) for k in range(self.rows_per_thread)) + 1

    def make_page_ids(self):
        """(Traced.) A thread's page ids of one stage (:meth:`load_page_ids`)."""
        return cute.make_rmem_tensor((self.page_ids_per_thread,), Int32)

    @cute.jit
    def load_page_ids(self, mBlockTable, batch_idx, tile_idx, limit, tidx, pids):
        """This thread's page ids of tile ``tile_idx`` into ``pids`` (-1: a row past ``limit`` or
        the block-table row), for :meth:`issue`. Loaded a tile ahead, the block-table read leaves the
        copies' critical path (``page_prefetch``, docs/design/sm80.md#page-ids-a-tile-ahead)."""
        r0 = tidx // self.chunks if const_expr(self.chunks <= self.threads) else Int32(0)
        self._page_ids(mBlockTable, batch_idx, tile_idx * self.tile, r0, limit, pids)

    @cute.jit
    def _page_ids(self, mBlockTable, batch_idx, t0, r0, limit, pids):
        width = mBlockTable.shape[1]
        for j in cutlass.range_constexpr(self.page_ids_per_thread):
            # first row of the thread that uses page id j
            k = next(k for k in range(self.rows_per_thread) if self.page_slot(k) == j)
            lp = (t0 + r0 + self.step * k) // self.page
            pid = Int32(-1)
            if lp < width and t0 + r0 + self.step * k < limit:
                pid = mBlockTable[batch_idx, lp]
            pids[j] = pid

    @cute.jit
    def issue(self, mK, mV, mBlockTable, num_pages, batch_idx, kv_head, tile_idx, limit, smem_base, tidx,
              pids=None):
        """Issue the copies of tile ``tile_idx`` (tokens ``tile * tile_idx ...``) of this request and
        KV head into the stage at shared address ``smem_base`` (K, then V). ``mK`` / ``mV`` are
        (token-in-page, d, head, page) views of the cache. ``pids``: the tile's page ids, loaded
        already (:meth:`load_page_ids`); else they are read here."""
        t0 = tile_idx * self.tile
        r0 = tidx // self.chunks if const_expr(self.chunks <= self.threads) else Int32(0)
        c0 = tidx % self.chunks if const_expr(self.chunks <= self.threads) else tidx
        if const_expr(pids is None):
            pids = self.make_page_ids()
            self._page_ids(mBlockTable, batch_idx, t0, r0, limit, pids)
        for k in cutlass.range_constexpr(self.rows_per_thread):
            row = r0 + self.step * k
            token = t0 + row
            pid = pids[self.page_slot(k)]
            ok = token < limit and pid >= 0 and pid < num_pages
            nbytes = Int32(16) if ok else Int32(0)
            safe = pid if ok else Int32(0)
            slot = token % self.page
            for cc in cutlass.range_constexpr(self.chunks_per_row_thread):
                c = c0 + cc * self.threads
                d = c * (16 // self.kv_bytes)
                for which in cutlass.range_constexpr(2):
                    src_t = mK if const_expr(which == 0) else mV
                    src = (src_t.iterator + cute.crd2idx((slot, d, kv_head, safe), src_t.layout)).toint()
                    if const_expr(self.one_base):
                        dst = (smem_base + swizzle(r0 * self.row_bytes + c * 16, self.row_bytes)
                               + (which * self.tile_bytes + self.step * k * self.row_bytes))
                    else:
                        dst = (smem_base + which * self.tile_bytes
                               + swizzle(row * self.row_bytes + c * 16, self.row_bytes))
                    cp_async_zfill_16_at(dst, Int64(src), nbytes, 0, 0)
