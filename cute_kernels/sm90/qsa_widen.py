"""Widen the FP8 pages of a QSA prefill batch into a 16-bit copy: the pre-pass that lets an FP8
cache take the 16-bit row-tile kernel.

Why: the row-tile kernel with an FP8 cache must widen every gathered row to fp16 in its gather
warps (WGMMA has no 16-bit x e4m3 form), which takes 8 of the 12 warps a CTA can hold and leaves
room for one consumer warpgroup; with a 16-bit cache it runs two, and runs faster
(docs/design/qsa.md#fp8-prefill-on-a-widened-copy). But a prefill's rows select from
few distinct tokens: one request's whole context (16384 tokens x 2 KV heads x 256 x 2 bytes, K and
V) is 16 MB of FP8, while the gather reads ~32 GB of selected rows. Widening every page the
batch's block table addresses once (a streaming copy, ~3 bytes moved per cache byte) and running
the 16-bit kernel on the copy costs a few microseconds per request.

The copy is indexed by *logical* page: slot ``r * W + j`` holds page ``block_table[r, j]`` (W the
table's width), so its size is known on the host from the table's shape (the op's workspace, see
``qsa_sparse_attention``), and the kernel also writes the table the row-tile kernel then uses:
``slot`` for a valid page id (``0 <= id < num_blocks``), -1 for an invalid one (not read; entries
on it stay invalid). e4m3 values are exact in bf16 and fp16 (the widening is the DSL's
conversion through fp32, exact), so the scales apply unchanged.

Memory-bound: a thread moves 16 consecutive elements of one (token, head) row, of K and of V
(16-byte loads, two 16-byte stores each); rows are ordered head-major within a page, so that a
warp's rows are consecutive tokens of one head (contiguous in the production layout, where a
token's K and V rows are adjacent).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..jit.dtypes import cute_dtype


class QsaWidenPages:
    """Kernel: FP8 ``mK``/``mV [NB, PAGE, Hkv, D]`` pages at ``mBlockTable [NR, W]`` ->
    ``mWK``/``mWV [NR * W, PAGE, Hkv, D]`` (q's dtype) and ``mTable [NR, W]``."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.D = cfg.head_dim
        self.page = cfg.page_size
        self.out_dtype = cute_dtype(cfg.out_dtype)
        self.vec = cfg.vec  # FP8 elements (16 bytes) per thread, of K and of V
        self.num_threads = cfg.num_threads
        self.lanes = self.D // self.vec  # threads per (token, head) row
        self.rows_per_cta = cfg.rows_per_cta

    @cute.jit
    def __call__(self, mK: cute.Tensor, mV: cute.Tensor, mBlockTable: cute.Tensor, mWK: cute.Tensor,
                 mWV: cute.Tensor, mTable: cute.Tensor, stream):
        rows = self.page * mK.shape[2]
        # x: the logical page (up to 2^31 - 1), y: its rows in chunks (the op keeps this <= 65535)
        grid = [mBlockTable.shape[0] * mBlockTable.shape[1], (rows + self.rows_per_cta - 1) // self.rows_per_cta, 1]
        self.kernel(mK, mV, mBlockTable, mWK, mWV, mTable).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mV: cute.Tensor, mBlockTable: cute.Tensor, mWK: cute.Tensor,
               mWV: cute.Tensor, mTable: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        slot, chunk, _ = cute.arch.block_idx()
        width = mBlockTable.shape[1]
        r = slot // width
        j = slot - r * width
        pid = mBlockTable[r, j]
        ok = pid >= 0 and pid < mK.shape[0]
        if chunk == 0 and tidx == 0:
            mTable[r, j] = slot if ok else Int32(-1)
        hkv = mK.shape[2]
        row = chunk * self.rows_per_cta + tidx // self.lanes
        lane = tidx % self.lanes
        if ok and row < self.page * hkv:
            h = row // self.page  # head-major: a warp's rows are consecutive tokens of one head
            t = row - h * self.page
            # both loads in flight before either store
            k = cute.local_tile(mK[pid, t, h, None], (self.vec,), (lane,)).load()
            v = cute.local_tile(mV[pid, t, h, None], (self.vec,), (lane,)).load()
            cute.local_tile(mWK[slot, t, h, None], (self.vec,), (lane,)).store(self.widen(k))
            cute.local_tile(mWV[slot, t, h, None], (self.vec,), (lane,)).store(self.widen(v))

    @cute.jit
    def widen(self, x):
        """Exact: every e4m3 value is representable in bf16 and fp16."""
        if const_expr(self.out_dtype == cutlass.Float16):
            return x.to(cutlass.Float16)
        return x.to(Float32).to(self.out_dtype)
