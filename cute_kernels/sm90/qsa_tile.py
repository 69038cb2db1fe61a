"""SM90 QSA sparse prefill over row tiles: R consecutive query rows share one gathered K/V stream.

Neighbouring prefill rows select mostly the same tokens (RFC vllm#55394 measured a Jaccard
similarity of 87-94 % between neighbouring rows), so gathering each row's ~2048 tokens separately
moves several times the bytes the tile needs. This kernel runs one CTA per (tile of R rows, KV
head) over the sorted union of the tile's selections built by the pre-pass
(``qsa_union.py``): the R rows x G query heads are the columns of the swap-AB WGMMA (N = R * G
padded to a multiple of 8), every union token is gathered once, and a per-row membership bitmask
masks the logits of the rows that did not select it. A tile the pre-pass marked ``length = -1``
(rows of different requests, a row listing a token twice, a union over the cap) walks its rows'
own lists one after the other instead, each tile of row r masked to row r's columns: the same
result as the per-row kernel, with the same gathered bytes.

Everything else (gather with zero-filling cp.async, pipeline, WGMMA, online softmax, gated
epilogue) is :class:`~cute_kernels.sm90.qsa.Sm90QsaAttention`'s, which takes R from the config.
No split-K: prefill batches fill the machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..jit.dtypes import DTYPE_BITS
from ..jit.spec import ScalarArg, TensorArg
from .qsa import PRODUCER_WARP, Sm90QsaAttention, Sm90QsaConfig, qsa_tuning

MAX_COLUMNS = 64  # R * G: the O^T accumulator is D x N fp32 in one warpgroup's registers
# gather warps: one CTA per SM (its registers and shared memory) and one producer warp issued
# the copies too slowly (H200, 1 x 16384 BF16 correlated: 7.36 ms with one, 6.24 with two, 6.09
# with four)
TILE_PRODUCERS = 4


class Sm90QsaTileAttention(Sm90QsaAttention):
    """Kernel object; all fields are compile-time (see :class:`Sm90QsaTileConfig`)."""

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
        k_scale: Float32,
        v_scale: Float32,
        stream,
    ):
        self.launch(self.tile_kernel, (mQ, mK, mV, mIdx, mBlockTable, mTokenToReq, mUnion, mMember, mLen, mO, mLse,
                                       mGate, k_scale, v_scale),
                    [mLen.shape[0], mK.shape[2], 1], stream)

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
        k_scale: Float32,
        v_scale: Float32,
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
        storage, sQ, sP, sRed, sMask, full, empty = self.setup_shared(q_layout, p_layout, tidx)
        if warp >= PRODUCER_WARP:
            self.produce_tile(mK, mV, mIdx, mBlockTable, mTokenToReq, mUnion, mMember, mLen, storage, k_layout,
                              v_layout, sMask, full, empty, tile, kv_head, warp - PRODUCER_WARP, lane)
        else:
            self.consume_tiles(mQ, storage, sQ, sP, sRed, sMask, full, empty, mO, mLse, mGate, k_scale, v_scale,
                               qk_mma, pv_mma, k_layout, v_layout, tile, kv_head, Int32(0),
                               self.tile_count(mIdx, mLen, tile), tidx, warp, lane)

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
        length = mLen[tile]
        row0 = tile * self.R
        if length >= 0:
            req = Int32(-1)
            if row0 < mTokenToReq.shape[0]:
                req = mTokenToReq[row0]  # the pre-pass checked that every row shares it
            self.gather_list(mK, mV, mUnion, tile, length, length, Int32(0), Int32(1),
                             (length + self.tile - 1) // self.tile, Int32(0), req, mBlockTable, storage, k_layout,
                             v_layout, sMask, full, empty, kv_head, pw, lane, mMember, 1, Int32(0))
        else:
            topk = mIdx.shape[1] - 1
            i0 = Int32(0)
            for r in cutlass.range(self.R, unroll=1):
                row = row0 + r
                count = self.row_count(mIdx, row)
                n = (count + self.tile - 1) // self.tile
                if n > 0:
                    self.gather_list(mK, mV, mIdx, row, topk, count, Int32(0), Int32(1), n, i0, mTokenToReq[row],
                                     mBlockTable, storage, k_layout, v_layout, sMask, full, empty, kv_head, pw,
                                     lane, None, 2, r)
                i0 = i0 + n


@dataclass(frozen=True)
class Sm90QsaTileConfig(Sm90QsaConfig):
    """Compile key of :class:`Sm90QsaTileAttention`: :class:`Sm90QsaConfig`'s fields (``split``
    must be False) plus ``rows_per_cta`` (R; R * group <= 64)."""

    rows_per_cta: int = 5

    kernel_id = "sm90.qsa_tile"

    def __post_init__(self):
        super().__post_init__()
        if self.split:
            raise ValueError("the row-tile kernel does not split")
        if not 1 <= self.rows_per_cta or self.rows_per_cta * self.group > MAX_COLUMNS:
            raise ValueError(f"rows_per_cta * group must be in [1, {MAX_COLUMNS}], got {self.rows_per_cta} x "
                             f"{self.group}")

    @property
    def n_pad(self) -> int:
        return max(8, (self.rows_per_cta * self.group + 7) // 8 * 8)

    def signature(self):
        D, R = self.head_dim, self.rows_per_cta
        cache = ("NB", self.page_size, "Hkv", D)
        return (
            TensorArg("q", self.q_dtype, ("T", "Hq", D)),
            TensorArg("k_cache", self.kv_dtype, cache),
            TensorArg("v_cache", self.kv_dtype, cache),
            TensorArg("packed_indices", "int32", ("T", "W"), align=4),
            TensorArg("block_table", "int32", ("NR", "BW"), align=4),
            TensorArg("token_to_req", "int32", ("T",), align=4),
            TensorArg("union", "int32", ("NT", "UCAP"), align=4),
            TensorArg("member", "int32", ("NT", R, "UW"), align=4),
            TensorArg("length", "int32", ("NT",), align=4),
            TensorArg("out", self.q_dtype, ("T", "Hq", D), align=4),
            TensorArg("lse", "fp32", ("T", "Hq"), align=4),
            TensorArg("gate", self.q_dtype, ("GT", "GH", D), align=2),
            ScalarArg("k_scale", "fp32"),
            ScalarArg("v_scale", "fp32"),
        )

    def build(self):
        return Sm90QsaTileAttention(self)


MAX_ROWS = 8  # the union pre-pass's limit


def tile_rows(kv_dtype: str, group: int) -> int:
    """R of the row-tile kernel: as many rows (up to 8) as fit the WGMMA's N budget, measured
    with ptxas at D = 256 for no spills: 64 columns for 16-bit caches (248 registers at 5 x 12),
    40 for FP8, whose widened K/V fragments also live in registers (250 at 3 x 12)."""
    budget = MAX_COLUMNS if DTYPE_BITS[kv_dtype] == 16 else 40
    return max(1, min(MAX_ROWS, budget // group))


def make_qsa_tile_config(*, q_dtype: str, kv_dtype: str, head_dim: int, group: int, page_size: int, gate: bool,
                         **override) -> Sm90QsaTileConfig:
    """The config the op, the warm-up and the compile matrix use (tuning filled in here);
    ``override`` replaces fields (benchmarks)."""
    rows = override.pop("rows_per_cta", tile_rows(kv_dtype, group))
    tile = override.pop("tile", 64)
    stages, occupancy = qsa_tuning(kv_dtype, head_dim, rows * group, tile, TILE_PRODUCERS)
    fields = dict(q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group, page_size=page_size,
                  tile=tile, stages=stages, split=False, gate=gate, occupancy=occupancy, rows_per_cta=rows,
                  producers=TILE_PRODUCERS)
    fields.update(override)
    return Sm90QsaTileConfig(**fields)


# ----------------------------------------------------------------------------------------------
# host-side selection (no GPU, no tensors)
# ----------------------------------------------------------------------------------------------

TILE_MIN_ROWS = 64  # below this a prefill batch is decode-sized: the per-row kernel (with splits)
MAX_BITMAP_TOKENS = 1 << 19  # the pre-pass's token bitmap (64 KB + 64 KB of ranks in shared memory)


@dataclass(frozen=True)
class RowTilePlan:
    """What the row-tile path needs for one launch shape: R, the pre-pass's bitmap capacity (a
    power of two >= block-table width x page) and union cap (a multiple of 64), tiles."""

    rows_per_cta: int
    max_tokens: int
    union_cap: int
    num_tiles: int


def row_tile_plan(rows: int, prefill: bool, kv_dtype: str, group: int, page_size: int, table_width: int,
                  topk: int, rows_per_cta: int | None = None) -> RowTilePlan | None:
    """The row-tile path for a prefill launch of ``rows`` rows, or None for the per-row kernel:
    decode-profile and small batches (split-K serves them better), one-row tiles, and block tables
    addressing more than 2^19 tokens (the pre-pass bitmap would not fit in shared memory).

    The union cap is ``min(R, 3) * TOPK`` rounded up to 64: a tile whose union is larger walks its
    rows' own lists (no loss against the per-row kernel), and the workspace stays below
    ``ceil(rows / R) * cap * 4.2`` bytes (81 MB + 13 MB at 16384 rows, R 5, TOPK 2051)."""
    R = tile_rows(kv_dtype, group) if rows_per_cta is None else rows_per_cta
    tokens = table_width * page_size
    if not prefill or rows < TILE_MIN_ROWS or R < 2 or tokens > MAX_BITMAP_TOKENS or topk < 1:
        return None
    max_tokens = 1024
    while max_tokens < tokens:
        max_tokens *= 2
    cap = -(-min(R, 3) * topk // 64) * 64
    return RowTilePlan(R, max_tokens, cap, -(-rows // R))
