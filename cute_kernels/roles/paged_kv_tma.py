"""Paged K/V tiles by TMA: one box per page (or a tile-sized piece of a larger page), its page id
looked up in the block table by one lane per box.

A box whose page id is outside ``[0, P)``, or that lies at or past the request's attendable KV
(:func:`~cute_kernels.roles.prefill_blocks.kv_cap`), gets the page coordinate ``P``: out of the
tensor's bounds, so TMA fills it with zeros and no page id can make the kernel read outside the
cache. Every box still delivers its full byte count, so a stage's transaction count is fixed.
Design: docs/design/sm90-prefill.md#paged-kv.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .prefill_blocks import box_source


def cache_views(mKc, mVc, kv_form: str, kv_layout: str):
    """(Traced, host side.) ``(mK, mV, num_pages)``: K and V as ``(token in page, d, kv head,
    page)`` views of the cache (one 5-D tensor whose dim 1 selects K/V, or two 4-D ones)."""
    if const_expr(kv_form == "single"):
        mK4 = mKc[None, 0, None, None, None]
        mV4 = mVc[None, 1, None, None, None]
    else:
        mK4, mV4 = mKc, mVc
    tok, head = (2, 1) if const_expr(kv_layout == "HND") else (1, 2)
    mK = cute.make_tensor(mK4.iterator, cute.select(mK4.layout, mode=[tok, 3, head, 0]))
    mV = cute.make_tensor(mV4.iterator, cute.select(mV4.layout, mode=[tok, 3, head, 0]))
    return mK, mV, mK4.shape[0]


def transposed(mX):
    """(Traced, host side.) ``(d, token in page, kv head, page)``: the view a 16-bit V tile is
    loaded through into an MN-major (d-contiguous) WGMMA B operand."""
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 0, 2, 3]))


def box_atom(mX, box_layout, box_shape):
    """(Traced, host side.) The TMA atom and its coordinate tensor for boxes of ``box_shape``."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX, box_layout, box_shape)


class PagedTiles:
    """One K-or-V tile source: ``tile_n`` KV tokens as ``tile_n // box`` TMA boxes.

    ``token_major``: the smem tile is (token, d) (K, FP8 staging) rather than (d, token) (a 16-bit
    V read through :func:`transposed`)."""

    def __init__(self, tile_n: int, box: int, page_size: int, head_dim: int, token_major: bool):
        self.tile_n, self.box, self.page, self.D = tile_n, box, page_size, head_dim
        self.nb = tile_n // box
        self.token_major = token_major

    @cute.jit
    def partition(self, tma, mX, sX, kv_head):
        """(smem boxes, gmem boxes) of this KV head: ``tXsX[None, j, stage]`` is box j of a stage,
        ``tXgX[None, box_in_page, page]`` a box of the cache."""
        box, D = self.box, self.D
        if const_expr(self.token_major):
            gX = cute.local_tile(mX[None, None, kv_head, None], (box, D), (None, 0, None))
            sX_boxes = cute.flat_divide(sX, (box, D))  # (box, D, nb, 1, stages)
        else:
            gX = cute.local_tile(mX[None, None, kv_head, None], (D, box), (0, None, None))
            sX_boxes = cute.flat_divide(sX, (D, box))  # (D, box, 1, nb, stages)
        tXsX, tXgX = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sX_boxes, 0, 2),
                                           cute.group_modes(gX, 0, 2))
        return tXsX, tXgX

    @cute.jit
    def lookup(self, mBlockTable, batch, tile, cap, num_pages, lane, lo=None):
        """The page id of box ``lane`` of KV tile ``tile`` (lanes past the tile's boxes: unused):
        ``num_pages`` past ``cap`` or for an id outside ``[0, num_pages)``, and (a sliding window)
        for a box wholly before ``lo``, a page no row of the block sees. The table is read only
        below ``cap`` (so never past its width)."""
        token, logical_page, _ = box_source(tile, lane, self.tile_n, self.box, self.page)
        page_id = Int32(num_pages)
        if lane < self.nb:
            if token < cap:
                raw = mBlockTable[batch, logical_page]
                if raw >= 0 and raw < num_pages:
                    page_id = raw
            if const_expr(lo is not None):
                if token + self.box <= lo:
                    page_id = Int32(num_pages)
        return page_id

    @cute.jit
    def issue(self, tma, tXgX, tXsX, page_ids, tile, stage, bar, cache_policy=None):
        """Issue the tile's boxes into ``stage`` on the transaction barrier ``bar`` (one lane)."""
        boxes_per_page = self.page // self.box
        for j in cutlass.range_constexpr(self.nb):
            pid = cute.arch.shuffle_sync(page_ids, j)
            sub = 0
            if const_expr(boxes_per_page > 1):
                sub = box_source(tile, j, self.tile_n, self.box, self.page)[2]
            if const_expr(self.token_major):
                dst = tXsX[None, j, 0, stage]
            else:
                dst = tXsX[None, 0, j, stage]
            if const_expr(cache_policy is None):
                cute.copy(tma, tXgX[None, sub, pid], dst, tma_bar_ptr=bar)
            else:
                cute.copy(tma, tXgX[None, sub, pid], dst, tma_bar_ptr=bar, cache_policy=cache_policy)
