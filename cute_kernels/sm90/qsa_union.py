"""Row-tile union pre-pass of the QSA sparse prefill: per tile of R consecutive query rows, the
sorted union of their selected tokens and, per row, which union entries it selected.

Contract: ``cute_kernels.reference.qsa_union_reference``. A prefill kernel that processes R rows
per CTA gathers this union once instead of R separate lists; a tile it cannot represent gets
``length = -1`` (mixed requests, a row listing a token twice, a union larger than the cap) and is
then served from the rows' own lists.

Design: one CTA of 512 threads per tile, everything in shared memory.

- **Bitmap of the tile's tokens** (``max_tokens`` bits): all threads stride over the rows'
  counted columns (coalesced, several rows' loads in flight per thread) and set each candidate's
  bit with a shared ``atom.or``. Each thread also keeps the largest candidate; a warp shuffle
  reduction and one shared ``atom.max`` per warp give the tile's, so the steps below only walk
  the bitmap words up to it (a prefill tile early in a long request touches a short prefix).
- **Ranks**: a block-wide exclusive scan of the words' popcounts, in rounds of 2048 words (4
  consecutive words per thread, warp ``shfl.up`` scan, warp totals through shared memory, double
  buffered so one barrier per round suffices). It stores each word's base rank and writes the
  union straight from the set bits (ascending by construction). Its total is U.
- **Membership**: a second pass over the same entries; an entry's rank is its word's base plus
  the popcount of the lower bits, and a shared ``atom.or`` sets that bit in its row's member
  words. An old value with the bit already set means the row lists the token twice: the
  reference counts duplicates twice, which a union cannot express, so the tile falls back.
- Writes: ``length`` always; the union's padding (-1 up to a multiple of 64) and every member
  word only when the tile does not fall back.

Nothing is read or written out of bounds whatever the inputs: counts are clamped to
``[0, W - 1]``, a token is a candidate only if ``0 <= tok < max_tokens`` and its page is inside
the block table's width, ranks stay below the cap (checked before the membership pass), and rows
past ``T`` (and tiles past the output's length) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ..jit.compiler import KernelConfig
from ..jit.spec import TensorArg

NUM_THREADS = 512
NUM_WARPS = NUM_THREADS // 32
SCAN_WORDS = 4  # consecutive bitmap words per thread in one scan round
LOADS_IN_FLIGHT = 8  # index loads per thread issued before their atomics (latency hiding)
MAX_SMEM = 227 * 1024  # what one CTA may hold on SM90


class Sm90QsaUnion:
    """Kernel object; all fields are compile-time (see :class:`QsaUnionConfig`)."""

    def __init__(self, cfg: QsaUnionConfig):
        self.cfg = cfg
        self.R = cfg.rows_per_tile
        self.page = cfg.page_size
        self.max_tokens = cfg.max_tokens
        self.words = cfg.max_tokens // 32  # bitmap words
        self.ucap = cfg.union_cap
        self.member_words = cfg.union_cap // 32  # per row
        # columns of every row handled per pass iteration: about LOADS_IN_FLIGHT loads per thread
        self.col_blocks = max(1, -(-LOADS_IN_FLIGHT // self.R))

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mIdx: cute.Tensor,  # [T, W] int32: W - 1 token columns, then the count
        mBlockTable: cute.Tensor,  # [NR, BW] int32 (only its width is used)
        mTokenToReq: cute.Tensor,  # [T] int32
        mUnion: cute.Tensor,  # [NT, UCAP] int32
        mMember: cute.Tensor,  # [NT, R, UCAP / 32] int32
        mLength: cute.Tensor,  # [NT] int32
        stream,
    ):
        cfg = self.cfg

        @cute.struct
        class Storage:
            bitmap: cute.struct.Align[cute.struct.MemRange[Int32, self.words], 16]
            prefix: cute.struct.Align[cute.struct.MemRange[Int32, self.words], 16]
            member: cute.struct.Align[cute.struct.MemRange[Int32, self.R * self.member_words], 16]
            warp_sums: cute.struct.MemRange[Int32, 2 * NUM_WARPS]
            counts: cute.struct.MemRange[Int32, 8]  # per row of the tile (R <= 8)
            flags: cute.struct.MemRange[Int32, 4]

        self.storage = Storage
        smem = Storage.size_in_bytes()
        if const_expr(smem > MAX_SMEM):
            raise ValueError(f"{cfg.label()}: {smem} bytes of shared memory do not fit in {MAX_SMEM}")
        num_tiles = mLength.shape[0]
        # a launch of zero CTAs is an error; one CTA past the end does nothing
        self.kernel(mIdx, mBlockTable, mTokenToReq, mUnion, mMember, mLength).launch(
            grid=[cutlass.max(num_tiles, 1), 1, 1], block=[NUM_THREADS, 1, 1], stream=stream)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mBlockTable: cute.Tensor, mTokenToReq: cute.Tensor, mUnion: cute.Tensor,
               mMember: cute.Tensor, mLength: cute.Tensor):
        R, MW = self.R, self.member_words
        tidx, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sBitmap = storage.bitmap.get_tensor(cute.make_layout(self.words))
        sPrefix = storage.prefix.get_tensor(cute.make_layout(self.words))
        sMember = storage.member.get_tensor(cute.make_layout(R * MW))
        sWarp = storage.warp_sums.get_tensor(cute.make_layout(2 * NUM_WARPS))
        sCount = storage.counts.get_tensor(cute.make_layout(8))
        sFlags = storage.flags.get_tensor(cute.make_layout(4))  # mixed requests, duplicate, max token

        if tile < mLength.shape[0]:
            num_rows = mIdx.shape[0]
            topk = mIdx.shape[1] - 1
            row0 = tile * R

            # the bitmap and the member words start empty (shared memory holds the last CTA's)
            for i in cutlass.range_constexpr(-(-self.words // NUM_THREADS)):
                w = i * NUM_THREADS + tidx
                if const_expr(self.words % NUM_THREADS == 0) or w < self.words:
                    sBitmap[w] = Int32(0)
            for i in cutlass.range_constexpr(-(-(R * MW) // NUM_THREADS)):
                w = i * NUM_THREADS + tidx
                if const_expr((R * MW) % NUM_THREADS == 0) or w < R * MW:
                    sMember[w] = Int32(0)
            if warp == 0:
                # lane r < R: row r's clamped count (0 past T) and whether its request differs
                count = Int32(0)
                differs = False
                if lane < R:
                    row = row0 + lane
                    if row < num_rows:
                        if topk > 0:
                            count = cutlass.min(cutlass.max(mIdx[row, topk], Int32(0)), topk)
                        differs = mTokenToReq[row] != mTokenToReq[row0]
                    sCount[lane] = count
                mixed = cute.arch.vote_ballot_sync(differs)
                if lane == 0:
                    sFlags[0] = mixed
                    sFlags[1] = Int32(0)
                    sFlags[2] = Int32(-1)
            cute.arch.sync_threads()

            if sFlags[0] != 0:
                if tidx == 0:
                    mLength[tile] = Int32(-1)
            else:
                self.union_tile(mIdx, mBlockTable, mUnion, mMember, mLength, sBitmap, sPrefix, sMember, sWarp,
                                sCount, sFlags, tile, row0, tidx, warp, lane)

    @cute.jit
    def union_tile(self, mIdx, mBlockTable, mUnion, mMember, mLength, sBitmap, sPrefix, sMember, sWarp, sCount,
                   sFlags, tile, row0, tidx, warp, lane):
        """The tile's rows share one request: bitmap, ranks and union, then membership."""
        R, MW, ucap = self.R, self.member_words, self.ucap
        bitmap_ptr = sBitmap.iterator
        flags_ptr = sFlags.iterator

        # ---------------- pass 1: the set of candidate tokens ----------------
        hi = Int32(-1)  # largest candidate this thread saw
        cmax = Int32(0)
        for r in cutlass.range_constexpr(R):
            cmax = cutlass.max(cmax, sCount[r])
        for c0 in cutlass.range(0, cmax, self.col_blocks * NUM_THREADS, unroll=1):
            toks = self.load_entries(mIdx, mBlockTable, sCount, row0, c0, tidx)
            for k in cutlass.range_constexpr(R * self.col_blocks):
                tok = toks[k]
                if tok >= 0:
                    cute.arch.atomic_or(bitmap_ptr + (tok >> 5), Int32(1) << (tok & 31))
                    hi = cutlass.max(hi, tok)
        hi = cute.arch.warp_reduction_max(hi)
        if lane == 0:
            cute.arch.atomic_max(flags_ptr + 2, hi)
        cute.arch.sync_threads()

        # ---------------- ranks: exclusive scan of the words' popcounts, emitting the union ----------------
        num_words = (sFlags[2] + 32) // 32  # words up to the largest candidate (0 without one)
        per_round = NUM_THREADS * SCAN_WORDS
        carry = Int32(0)  # tokens in earlier rounds
        for rnd in cutlass.range((num_words + per_round - 1) // per_round, unroll=1):
            w0 = rnd * per_round + tidx * SCAN_WORDS
            x = cute.make_rmem_tensor((SCAN_WORDS,), Int32)
            total = Int32(0)
            for j in cutlass.range_constexpr(SCAN_WORDS):
                v = Int32(0)
                if const_expr(self.words % per_round == 0) or w0 + j < self.words:
                    v = sBitmap[w0 + j]
                x[j] = v
                total = total + cute.arch.popc(v)
            incl = total  # inclusive scan over the warp's lanes
            for off in (1, 2, 4, 8, 16):
                up = cute.arch.shuffle_sync_up(incl, off)
                if lane >= off:
                    incl = incl + up
            buf = (rnd % 2) * NUM_WARPS  # double buffer: round r + 1 may write while round r reads
            if lane == 31:
                sWarp[buf + warp] = incl
            cute.arch.sync_threads()
            warp_base = Int32(0)
            round_total = Int32(0)
            for i in cutlass.range_constexpr(NUM_WARPS):
                s = sWarp[buf + i]
                round_total = round_total + s
                if i < warp:
                    warp_base = warp_base + s
            base = carry + warp_base + incl - total
            for j in cutlass.range_constexpr(SCAN_WORDS):
                w = w0 + j
                if const_expr(self.words % per_round == 0) or w < self.words:
                    sPrefix[w] = base
                    # the set bits in ascending order: lowest bit, clear it, repeat
                    bits = x[j]
                    pos = base
                    while bits != 0:
                        low = bits & (Int32(0) - bits)
                        if pos < ucap:
                            mUnion[tile, pos] = w * 32 + cute.arch.popc(low - 1)
                        pos = pos + 1
                        bits = bits ^ low
                    base = pos
            carry = carry + round_total
        num_union = carry

        if num_union > ucap:
            if tidx == 0:
                mLength[tile] = Int32(-1)
        else:
            # -1 padding up to the next multiple of 64 (at most the cap, itself a multiple of 64)
            if tidx < 64:
                j = num_union + tidx
                if j < (num_union + 63) // 64 * 64:
                    mUnion[tile, j] = Int32(-1)
            cute.arch.sync_threads()  # the word bases of the last round

            # ---------------- pass 2: membership bits and duplicate detection ----------------
            member_ptr = sMember.iterator
            dup = Int32(0)
            for c0 in cutlass.range(0, cmax, self.col_blocks * NUM_THREADS, unroll=1):
                toks = self.load_entries(mIdx, mBlockTable, sCount, row0, c0, tidx)
                for k in cutlass.range_constexpr(R * self.col_blocks):
                    tok = toks[k]
                    if tok >= 0:
                        w = tok >> 5
                        b = tok & 31
                        rank = sPrefix[w] + cute.arch.popc(sBitmap[w] & ((Int32(1) << b) - 1))
                        bit = Int32(1) << (rank & 31)
                        old = cute.arch.atomic_or(member_ptr + (k // self.col_blocks) * MW + (rank >> 5), bit)
                        dup = dup | (old & bit)
            if dup != 0:
                sFlags[1] = Int32(1)  # every writer stores the same value
            cute.arch.sync_threads()

            if sFlags[1] != 0:
                if tidx == 0:
                    mLength[tile] = Int32(-1)
            else:
                for i in cutlass.range_constexpr(-(-(R * MW) // NUM_THREADS)):
                    f = i * NUM_THREADS + tidx
                    if const_expr((R * MW) % NUM_THREADS == 0) or f < R * MW:
                        r = f // MW
                        mMember[tile, r, f - r * MW] = sMember[f]
                if tidx == 0:
                    mLength[tile] = num_union

    @cute.jit
    def load_entries(self, mIdx, mBlockTable, sCount, row0, c0, tidx):
        """This thread's entries of columns ``c0 + b * 512 + tidx`` (b < col_blocks) of every row,
        entry ``r * col_blocks + b``: the token if it is a candidate, else -1. All loads are
        issued before any is used."""
        width = mBlockTable.shape[1]
        toks = cute.make_rmem_tensor((self.R * self.col_blocks,), Int32)
        for r in cutlass.range_constexpr(self.R):
            count = sCount[r]  # 0 for rows past T
            for b in cutlass.range_constexpr(self.col_blocks):
                col = c0 + b * NUM_THREADS + tidx
                t = Int32(-1)
                if col < count:
                    t = mIdx[row0 + r, col]
                toks[r * self.col_blocks + b] = t
        for k in cutlass.range_constexpr(self.R * self.col_blocks):
            t = toks[k]
            ok = t >= 0 and t < self.max_tokens
            if ok:
                ok = t // self.page < width
            toks[k] = t if ok else Int32(-1)
        return toks


@dataclass(frozen=True)
class QsaUnionConfig(KernelConfig):
    """Compile key of :class:`Sm90QsaUnion`.

    ``rows_per_tile``: R, the query rows of one tile (1..8). ``page_size``: tokens per cache page
    (any; only ``t // page`` against the block table's width, by a compile-time constant).
    ``max_tokens``: the bitmap's capacity, a power of two in [1024, 524288]; tokens at or above
    it are never candidates (the host picks it >= the block table's width x page). ``union_cap``:
    the most union entries a tile may have (a multiple of 64); a larger union falls back.
    """

    rows_per_tile: int = 5
    page_size: int = 1568
    max_tokens: int = 16384
    union_cap: int = 4160

    kernel_id = "sm90.qsa_union"
    targets = ("sm_90a",)
    # shared-memory atomics build the bitmap and the member words; popcounts give the ranks
    evidence = {"sm_90a": (r"atom(\.\w+)*\.shared(::cta)?(\.\w+)*\.or\.b32", r"popc\.b32")}

    def __post_init__(self):
        if not 1 <= self.rows_per_tile <= 8:
            raise ValueError(f"rows_per_tile must be in [1, 8], got {self.rows_per_tile}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        mt = self.max_tokens
        if mt < 1024 or mt > 524288 or mt & (mt - 1):
            raise ValueError(f"max_tokens must be a power of two in [1024, 524288], got {mt}")
        if self.union_cap < 64 or self.union_cap % 64:
            raise ValueError(f"union_cap must be a positive multiple of 64, got {self.union_cap}")

    def signature(self):
        R, U = self.rows_per_tile, self.union_cap
        return (
            TensorArg("packed_indices", "int32", ("T", "W"), align=4),
            TensorArg("block_table", "int32", ("NR", "BW"), align=4),
            TensorArg("token_to_req", "int32", ("T",), align=4),
            TensorArg("union", "int32", ("NT", U), align=4),
            TensorArg("member", "int32", ("NT", R, U // 32), align=4),
            TensorArg("length", "int32", ("NT",), align=4),
        )

    def build(self):
        return Sm90QsaUnion(self)
