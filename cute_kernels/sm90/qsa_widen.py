"""Widen the FP8 pages of a QSA prefill batch into a 16-bit copy: the pre-pass that lets an FP8
cache take the 16-bit row-tile kernel.

Why: the row-tile kernel with an FP8 cache must widen every gathered row to fp16 in its gather
warps (WGMMA has no 16-bit x e4m3 form), which takes 8 of the 12 warps a CTA can hold and leaves
room for one consumer warpgroup; with a 16-bit cache it runs two. At 1 x 16384 the FP8 kernel
took 3.40 ms against 2.52-2.71 for BF16 (profiling/NOTES.md). But a prefill's rows select from
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

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..jit.compiler import KernelConfig
from ..jit.dtypes import cute_dtype
from ..jit.spec import TensorArg

_THREADS = 256
VEC = 16  # FP8 elements (16 bytes) per thread, of K and of V
MAX_GRID_Y = 65535


def rows_per_cta(head_dim: int) -> int:
    """(token, head) rows one CTA widens: ``head_dim / VEC`` threads per row."""
    return _THREADS // (head_dim // VEC)


class QsaWidenPages:
    """Kernel: FP8 ``mK``/``mV [NB, PAGE, Hkv, D]`` pages at ``mBlockTable [NR, W]`` ->
    ``mWK``/``mWV [NR * W, PAGE, Hkv, D]`` (q's dtype) and ``mTable [NR, W]``."""

    def __init__(self, cfg: QsaWidenConfig):
        self.cfg = cfg
        self.D = cfg.head_dim
        self.page = cfg.page_size
        self.out_dtype = cute_dtype(cfg.out_dtype)
        self.lanes = self.D // VEC  # threads per (token, head) row
        self.rows_per_cta = rows_per_cta(self.D)

    @cute.jit
    def __call__(self, mK: cute.Tensor, mV: cute.Tensor, mBlockTable: cute.Tensor, mWK: cute.Tensor,
                 mWV: cute.Tensor, mTable: cute.Tensor, stream):
        rows = self.page * mK.shape[2]
        # x: the logical page (up to 2^31 - 1), y: its rows in chunks (the op keeps this <= 65535)
        grid = [mBlockTable.shape[0] * mBlockTable.shape[1], (rows + self.rows_per_cta - 1) // self.rows_per_cta, 1]
        self.kernel(mK, mV, mBlockTable, mWK, mWV, mTable).launch(grid=grid, block=[_THREADS, 1, 1], stream=stream)

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
            k = cute.local_tile(mK[pid, t, h, None], (VEC,), (lane,)).load()
            v = cute.local_tile(mV[pid, t, h, None], (VEC,), (lane,)).load()
            cute.local_tile(mWK[slot, t, h, None], (VEC,), (lane,)).store(self.widen(k))
            cute.local_tile(mWV[slot, t, h, None], (VEC,), (lane,)).store(self.widen(v))

    @cute.jit
    def widen(self, x):
        """Exact: every e4m3 value is representable in bf16 and fp16."""
        if const_expr(self.out_dtype == cutlass.Float16):
            return x.to(cutlass.Float16)
        return x.to(Float32).to(self.out_dtype)


@dataclass(frozen=True)
class QsaWidenConfig(KernelConfig):
    """Compile key of :class:`QsaWidenPages`: the widened dtype (the query's), head dim and page
    size (rows per page are ``page_size * Hkv``)."""

    out_dtype: str = "bf16"
    head_dim: int = 256
    page_size: int = 1568

    kernel_id = "sm90.qsa_widen"
    targets = ("sm_90a",)
    # 16-byte FP8 loads, exact e4m3 -> f16 conversion, 16-byte stores
    evidence = {"sm_90a": (r"ld\.global(\.\w+)*\.v4\.b32", r"cvt\.rn\.f16x2\.e4m3x2", r"st\.global(\.\w+)*\.v4\.b32")}

    def __post_init__(self):
        if self.out_dtype not in ("bf16", "fp16"):
            raise ValueError(f"qsa widen output dtype must be bf16/fp16, got {self.out_dtype}")
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim must be 64, 128 or 256, got {self.head_dim}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    def signature(self):
        D, page = self.head_dim, self.page_size
        cache = ("NB", page, "Hkv", D)
        wide = ("NP", page, "Hkv", D)
        return (
            TensorArg("k_cache", "fp8_e4m3", cache, align=16),
            TensorArg("v_cache", "fp8_e4m3", cache, align=16),
            TensorArg("block_table", "int32", ("NR", "W"), align=4),
            TensorArg("k_wide", self.out_dtype, wide, align=16),
            TensorArg("v_wide", self.out_dtype, wide, align=16),
            TensorArg("table", "int32", ("NR", "W"), align=4),
        )

    def build(self):
        return QsaWidenPages(self)


def widen_grid_rows(page_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Row chunks per page (the launch's grid y): must stay <= 65535."""
    return -(-page_size * num_kv_heads // rows_per_cta(head_dim))


# ----------------------------------------------------------------------------------------------
# host-side selection (no GPU, no tensors)
# ----------------------------------------------------------------------------------------------

# The widened copy's workspace at most (16-bit K and V of every page the block table addresses).
WIDEN_MAX_BYTES = 1 << 30
# ... and at most this much per query row of the batch, so that the widening (reading the FP8
# pages once, writing the copy: ~0.5 ns per copy byte at ~3 TB/s) costs at most about a quarter
# of what the 16-bit kernel saves: 1 x 16384 rows, 3.40 -> ~2.6 ms, i.e. ~50 ns per full-budget
# row; 24 KB of copy is ~12 ns. (The block table's width decides the copy's size: a table
# trimmed to the batch's longest context keeps it small.)
WIDEN_BYTES_PER_ROW = 24 << 10


def widened_bytes(num_reqs: int, width: int, page_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of the widened copy: 16-bit K and V of ``num_reqs x width`` pages."""
    return num_reqs * width * page_size * num_kv_heads * head_dim * 2 * 2


def use_widened_cache(kv_dtype: str, rows: int, num_reqs: int, width: int, page_size: int, num_kv_heads: int,
                      head_dim: int, force: bool | None = None) -> bool:
    """Whether an FP8 prefill's row tiles run on a widened 16-bit copy of the block table's pages
    (see the module docstring): the copy within :data:`WIDEN_MAX_BYTES` and
    :data:`WIDEN_BYTES_PER_ROW` per row, a page's rows within one launch's grid, and at least one
    page in the table. ``force`` (tests, benchmarks): False never, True whenever the cache is FP8,
    the grid fits and the table has a page."""
    if kv_dtype != "fp8_e4m3" or widen_grid_rows(page_size, num_kv_heads, head_dim) > MAX_GRID_Y:
        return False
    if num_reqs * width == 0:  # no page to widen (and no empty grid to launch)
        return False
    if force is not None:
        return bool(force)
    size = widened_bytes(num_reqs, width, page_size, num_kv_heads, head_dim)
    return size <= WIDEN_MAX_BYTES and size <= rows * WIDEN_BYTES_PER_ROW
