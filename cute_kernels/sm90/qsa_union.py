"""Row-tile union pre-pass of the QSA sparse prefill: per tile of R consecutive query rows, the
sorted union of their selected tokens and, per row, which union entries it selected.

Contract: ``cute_kernels.reference_qsa_union.qsa_union_reference``. A prefill kernel that processes R rows
per CTA gathers this union once instead of R separate lists; a tile it cannot represent gets
``length = -1`` (mixed requests, a row listing a token twice, a union larger than the cap) and is
then served from the rows' own lists.

Design: one CTA of 256 threads per tile, everything in shared memory (about 37 KB and at most
40 registers a thread at the production shape: R = 5, max_tokens 32768, cap 6208), so that six
tiles share an SM and one tile's load latencies and barriers hide behind the others' work. Per
tile the work is ~R x 2048 entries read twice (from DRAM, then from L2) and a few shared-memory
operations per entry; the kernel is bound by integer issue, so every step costs a fixed, small
number of instructions per entry or per bitmap word, with no loop over a word's bits, no branch
per entry and no per-entry 64-bit address arithmetic.

- **Start**: warp 0 reads the rows' counts and requests while every thread clears the bitmap and
  the member words (128-bit stores); one barrier. Then warp r issues L2 prefetches for row r's
  counted columns (one per 128-byte line, no registers held), so the tile's DRAM reads are all in
  flight at once and the loops below hit L2.
- **Iterations**: thread t reads columns ``c0 + b * 256 + t`` (b < CB, CB a power of two with
  about 20 loads per thread) of every row, all loads issued before their use. Iterations whose
  columns are below every row's count come first and need no per-load predicate; the rest go
  one block of 256 columns at a time and each warp stops after its own last column (TOPK 2051
  leaves 3 columns past 2048: one warp, one block, not a whole iteration of every warp).
- **Bitmap of the tile's tokens** (``max_tokens`` bits): each candidate sets its bit with a
  shared ``atom.or``; a token is a candidate iff ``0 <= tok < limit`` with
  ``limit = min(max_tokens, BW * page)`` (one unsigned compare). A non-candidate ORs into its
  lane's sink word after the bitmap instead of branching around the atomic. Pass 1 also counts
  the candidates.
- **Ranks**: one block-wide exclusive scan of the words' popcounts with a single pair of
  barriers: each thread owns a contiguous run of at least 4 words (128-bit shared loads), a warp
  ``shfl.up`` scan of the thread totals, warp totals through shared memory, one barrier, then
  every thread stores its words' base ranks. Its total is U; U > cap falls back here.
- **Membership and union**: a second pass over the same entries; an entry's rank is its word's
  base plus the popcount of the lower bits. It stores the token at its rank in a shared copy of
  the union (rows sharing a token store the same value) and sets the rank's bit in its row's
  member words with a shared ``atom.or``. A non-candidate reads a word kept zero whose base is
  the cap, so its two stores land on sink slots past the union and past its row's member words.
- **Writes**: the union with its -1 padding (up to a multiple of 64) and every member word,
  coalesced from shared memory, whenever U fits the cap; then ``length``. A row that lists a
  token twice has fewer member bits than candidates (the reference counts duplicates twice,
  which a union cannot express): the member bits popcounted during the copy, summed over the
  block, against pass 1's count decide between U and -1 (a falling-back tile's union and member
  words are undefined, so writing them first is allowed).

Nothing is read or written out of bounds whatever the inputs: counts are clamped to
``[0, W - 1]``, prefetches and loads only touch counted columns of rows below ``T`` (the
unpredicated iterations only columns below the smallest count), a candidate is below
``max_tokens``, ranks stay below the cap (checked before the membership pass), the sinks are
allocated, and tiles past the output's length do nothing.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32, const_expr

NUM_THREADS = 256
NUM_WARPS = NUM_THREADS // 32
SCAN_WORDS = 4  # fewest consecutive bitmap words per thread in the scan (one 128-bit load)
LOADS_IN_FLIGHT = 20  # at most this many index loads per thread issued before their use
LINE_INTS = 32  # int32 per 128-byte line: the prefetch stride
SINK = 32  # per-lane scratch words after the bitmap (pass 1's non-candidates)
MAX_CTAS_PER_SM = 6  # the register cap this asks for: 65536 / (6 x 256) rounds down to 40


class Sm90QsaUnion:
    """Kernel object; all fields are compile-time (see :class:`cute_kernels.plans.sm90_qsa_union.QsaUnionConfig`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.R = cfg.rows_per_tile
        self.page = cfg.page_size
        self.max_tokens = cfg.max_tokens
        self.words = cfg.max_tokens // 32  # bitmap words
        self.ucap = cfg.union_cap
        self.member_words = cfg.union_cap // 32  # per row
        # Shared-memory layout. bitmap: the words, one word kept zero (index `words`), then from
        # `words + 4` SINK per-lane words (pass 1's non-candidates); prefix: the words' base
        # ranks, then `ucap` at index `words`; union: the cap, then a sink slot at `ucap`;
        # member: rows of member_words + 1 words, the last one a sink. A non-candidate of pass 2
        # reads the zero word, so its rank is ucap and its stores land on the sinks (see rank).
        self.bitmap_alloc = self.words + 4 + SINK
        self.prefix_alloc = self.words + 4
        self.union_alloc = self.ucap + 4
        self.member_stride = self.member_words + 1
        self.member_alloc = -(-self.R * self.member_stride // 4) * 4  # whole 128-bit stores for the clear
        # consecutive bitmap words per thread in the scan (max_tokens is a power of two >= 1024)
        self.scan_words = max(SCAN_WORDS, self.words // NUM_THREADS)
        # pages a block table needs before max_tokens, not its width, bounds the candidates
        self.full_width = -(-cfg.max_tokens // cfg.page_size)
        # column blocks of 256 per row and iteration: a power of two (so that an iteration's
        # columns divide the 2048 of a full row) with at most LOADS_IN_FLIGHT loads per thread
        cb = max(1, LOADS_IN_FLIGHT // self.R)
        self.col_blocks = 1 << (cb.bit_length() - 1)

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
            bitmap: cute.struct.Align[cute.struct.MemRange[Int32, self.bitmap_alloc], 16]
            prefix: cute.struct.Align[cute.struct.MemRange[Int32, self.prefix_alloc], 16]
            union: cute.struct.Align[cute.struct.MemRange[Int32, self.union_alloc], 16]
            member: cute.struct.Align[cute.struct.MemRange[Int32, self.member_alloc], 16]
            warp_sums: cute.struct.Align[cute.struct.MemRange[Int32, NUM_WARPS], 16]
            counts: cute.struct.MemRange[Int32, 8]  # per row of the tile (R <= 8)
            flags: cute.struct.MemRange[Int32, 2]

        self.storage = Storage
        smem = Storage.size_in_bytes()
        hw = cfg.hw
        if const_expr(smem > hw.MAX_SMEM_PER_CTA):
            raise ValueError(f"{cfg.label()}: {smem} bytes of shared memory do not fit in {hw.MAX_SMEM_PER_CTA}")
        # as many CTAs per SM as shared memory allows, up to the register cap: one tile's load
        # latencies and barriers hide behind the others' work
        occupancy = max(1, min(MAX_CTAS_PER_SM, hw.SMEM_PER_SM // (smem + hw.SMEM_RESERVED_PER_CTA)))
        num_tiles = mLength.shape[0]
        # a launch of zero CTAs is an error; one CTA past the end does nothing
        self.kernel(mIdx, mBlockTable, mTokenToReq, mUnion, mMember, mLength).launch(
            grid=[cutlass.max(num_tiles, 1), 1, 1], block=[NUM_THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=occupancy, preferred_smem_carveout=100)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mBlockTable: cute.Tensor, mTokenToReq: cute.Tensor, mUnion: cute.Tensor,
               mMember: cute.Tensor, mLength: cute.Tensor):
        R = self.R
        tidx, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sBitmap = storage.bitmap.get_tensor(cute.make_layout(self.bitmap_alloc))
        sPrefix = storage.prefix.get_tensor(cute.make_layout(self.prefix_alloc))
        sUnion = storage.union.get_tensor(cute.make_layout(self.union_alloc))
        sMember = storage.member.get_tensor(cute.make_layout(self.member_alloc))
        sWarp = storage.warp_sums.get_tensor(cute.make_layout(NUM_WARPS))
        sCount = storage.counts.get_tensor(cute.make_layout(8))
        sFlags = storage.flags.get_tensor(cute.make_layout(2))  # mixed requests, missing member bits

        if tile < mLength.shape[0]:
            num_rows = mIdx.shape[0]
            topk = mIdx.shape[1] - 1
            row0 = tile * R

            if warp == 0:
                # lane r < R: row r's clamped count (0 past T) and whether its request differs;
                # issued first so that the clears below run under their latency
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
                    sPrefix[self.words] = Int32(self.ucap)  # the rank of pass 2's non-candidates
            # the bitmap with its zero word and the member words start empty (shared memory holds
            # the last CTA's)
            self.clear(sBitmap, self.words + 4, tidx)
            self.clear(sMember, self.member_alloc, tidx)
            cute.arch.sync_threads()

            if sFlags[0] != 0:
                if tidx == 0:
                    mLength[tile] = Int32(-1)
            else:
                self.union_tile(mIdx, mBlockTable, mUnion, mMember, mLength, sBitmap, sPrefix, sUnion, sMember,
                                sWarp, sCount, sFlags, tile, row0, tidx, warp, lane)

    @cute.jit
    def clear(self, sX, n: cutlass.Constexpr, tidx):
        """Zero ``sX[:n]`` (n a multiple of 4), four consecutive words per thread and step (one
        128-bit store)."""
        quads = n // 4
        for i in cutlass.range_constexpr(-(-quads // NUM_THREADS)):
            q = i * NUM_THREADS + tidx
            if const_expr(quads % NUM_THREADS == 0) or q < quads:
                for j in cutlass.range_constexpr(4):
                    sX[q * 4 + j] = Int32(0)

    @cute.jit
    def union_tile(self, mIdx, mBlockTable, mUnion, mMember, mLength, sBitmap, sPrefix, sUnion, sMember, sWarp,
                   sCount, sFlags, tile, row0, tidx, warp, lane):
        """The tile's rows share one request: bitmap, ranks, then membership and the union."""
        R, MW, MS, ucap, CB = self.R, self.member_words, self.member_stride, self.ucap, self.col_blocks

        cmax = Int32(0)
        cmin = Int32(0x7FFFFFFF)
        for r in cutlass.range_constexpr(R):
            cmax = cutlass.max(cmax, sCount[r])
            cmin = cutlass.min(cmin, sCount[r])
        # candidates are the tokens in [0, limit): below max_tokens and on a page inside the
        # block table (tok // page < BW <=> tok < BW * page, which cannot overflow when it is
        # below max_tokens)
        width = mBlockTable.shape[1]
        limit = Int32(self.max_tokens)
        if width < self.full_width:
            limit = width * self.page

        # ---------------- prefetch the tile's counted columns into L2 ----------------
        # warp r takes row r; points 32 ints apart hit every 128-byte line of the row once, the
        # last point moved back to the last counted column so that the final partial line is
        # covered too
        if warp < R:
            count = sCount[warp]
            num_points = (count + 2 * LINE_INTS - 1) // LINE_INTS
            if count == 0:
                num_points = Int32(0)
            row_ptr = mIdx.iterator + cute.crd2idx((row0 + warp, 0), mIdx.layout)
            for k in cutlass.range(lane, num_points, 32, unroll=1):
                col = cutlass.min(k * LINE_INTS, count - 1)
                cute.arch.prefetch((row_ptr + col).to_llvm_ptr(), cache_level="L2")

        # Iterations: thread t reads columns c0 + b * 256 + t (b < CB) of every row. The ones
        # whose columns are all below every row's count come first and need no per-load
        # predicate; the rest go one block of 256 columns at a time, each warp stopping after its
        # own last column (a TOPK of 2051 leaves 3 columns past 2048: one warp, one block).
        step = CB * NUM_THREADS
        wcol = warp * 32
        full_end = Int32(0)
        num = cmin - (CB - 1) * NUM_THREADS - wcol - 32
        if num >= 0:
            full_end = (num // step + 1) * step
        tail_end = cmax - wcol

        # ---------------- pass 1: the set of candidate tokens ----------------
        row0_ptr = mIdx.iterator + cute.crd2idx((row0, tidx), mIdx.layout)  # column tidx of the first row
        found = Int32(0)  # candidates this thread saw, for the duplicate check
        for c0 in cutlass.range(0, full_end, step, unroll=1):
            found = self.mark(mIdx, row0_ptr, sBitmap, sCount, limit, c0, tidx, lane, found, True)
        for c0 in cutlass.range(full_end, tail_end, NUM_THREADS, unroll=1):
            found = self.mark(mIdx, row0_ptr, sBitmap, sCount, limit, c0, tidx, lane, found, False)
        cute.arch.sync_threads()

        # ---------------- ranks: exclusive scan of the words' popcounts ----------------
        # thread t owns words [t * SW, (t + 1) * SW); with a small bitmap the last threads own none
        SW = self.scan_words
        w0 = tidx * SW
        owns = const_expr(self.words >= NUM_THREADS * SW) or w0 < self.words
        total = Int32(0)
        if owns:
            for g in cutlass.range(0, SW, SCAN_WORDS, unroll=1):  # one 128-bit load per step
                for j in cutlass.range_constexpr(SCAN_WORDS):
                    total = total + cute.arch.popc(sBitmap[w0 + g + j])
        incl = total  # inclusive scan over the warp's lanes
        for off in (1, 2, 4, 8, 16):
            up = cute.arch.shuffle_sync_up(incl, off)
            if lane >= off:
                incl = incl + up
        if lane == 31:
            sWarp[warp] = incl
        cute.arch.sync_threads()
        num_union = Int32(0)
        base = incl - total
        for i in cutlass.range_constexpr(NUM_WARPS):
            s = sWarp[i]
            num_union = num_union + s
            if i < warp:
                base = base + s

        if num_union > ucap:
            if tidx == 0:
                mLength[tile] = Int32(-1)
        else:
            if owns:
                for g in cutlass.range(0, SW, SCAN_WORDS, unroll=1):
                    for j in cutlass.range_constexpr(SCAN_WORDS):
                        sPrefix[w0 + g + j] = base
                        base = base + cute.arch.popc(sBitmap[w0 + g + j])
            cute.arch.sync_threads()

            # ---------------- pass 2: ranks, the union and the membership bits ----------------
            for c0 in cutlass.range(0, full_end, step, unroll=1):
                self.rank(mIdx, row0_ptr, sBitmap, sPrefix, sUnion, sMember, sCount, limit, c0, tidx, True)
            for c0 in cutlass.range(full_end, tail_end, NUM_THREADS, unroll=1):
                self.rank(mIdx, row0_ptr, sBitmap, sPrefix, sUnion, sMember, sCount, limit, c0, tidx, False)
            cute.arch.sync_threads()

            # ---------------- writes ----------------
            # The union with its -1 padding up to the next multiple of 64 (at most the cap, itself
            # a multiple of 64), then every member word: consecutive threads, consecutive words.
            # Written before the duplicate check is known: a tile that falls back leaves them
            # undefined anyway. Streaming (evict-first) stores: the prefill kernel reads them much
            # later, and L2 should rather keep the index rows between the two passes.
            # (addresses as offsets from one pointer per thread: recomputed from the tile and the
            # dynamic strides, each store would cost several instructions)
            padded = (num_union + 63) // 64 * 64
            union_ptr = mUnion.iterator + cute.crd2idx((tile, tidx), mUnion.layout)
            for i in cutlass.range(tidx, padded, NUM_THREADS, unroll=2):
                v = Int32(-1)
                if i < num_union:
                    v = sUnion[i]
                cute.arch.store(union_ptr + (i - tidx), v, cop="cs")
            # A row that lists a token twice has fewer member bits than candidates; the member
            # bits of all rows are summed here, the candidates were counted in pass 1.
            missing = found
            member_ptr = mMember.iterator + cute.crd2idx((tile, 0, tidx), mMember.layout)
            for r in cutlass.range_constexpr(R):
                if const_expr(r > 0):
                    member_ptr = member_ptr + mMember.layout.stride[1]
                for i in cutlass.range_constexpr(-(-MW // NUM_THREADS)):
                    col = i * NUM_THREADS + tidx
                    if const_expr(MW % NUM_THREADS == 0) or col < MW:
                        bits = sMember[r * MS + col]
                        missing = missing - cute.arch.popc(bits)
                        cute.arch.store(member_ptr + i * NUM_THREADS, bits, cop="cs")
            missing = cute.arch.warp_redux_sync(missing, "add")
            if lane == 0:
                cute.arch.atomic_add(sFlags.iterator + 1, missing)
            cute.arch.sync_threads()
            if tidx == 0:
                mLength[tile] = num_union if sFlags[1] == 0 else Int32(-1)

    @cute.jit
    def mark(self, mIdx, row0_ptr, sBitmap, sCount, limit, c0, tidx, lane, found, full: cutlass.Constexpr):
        """Pass 1 on one iteration's entries: set each candidate's bit and count it. A
        non-candidate ORs into its lane's sink word instead of branching around the atomic (a
        divergent branch and its reconvergence cost more issue slots; the sinks sit in distinct
        banks)."""
        toks = self.load_entries(mIdx, row0_ptr, sCount, c0, tidx, full, False)
        bitmap_ptr = sBitmap.iterator
        for k in cutlass.range_constexpr(cute.size(toks)):
            tok = toks[k]
            ok = Uint32(tok) < Uint32(limit)  # 0 <= tok < limit
            word = (tok >> 5) if ok else self.words + 4 + lane
            cute.arch.atomic_or(bitmap_ptr + word, Int32(1) << (tok & 31))
            found = found + Int32(ok)
        return found

    @cute.jit
    def rank(self, mIdx, row0_ptr, sBitmap, sPrefix, sUnion, sMember, sCount, limit, c0, tidx,
             full: cutlass.Constexpr):
        """Pass 2 on one iteration's entries: a candidate's rank is its word's base plus the
        popcount of the lower bits; store it in the union and set its row's member bit. A
        non-candidate reads the zero word, whose base is the cap: its stores go to the union's
        and its row's sinks."""
        toks = self.load_entries(mIdx, row0_ptr, sCount, c0, tidx, full, True)
        blocks = cute.size(toks) // self.R
        union_ptr = sUnion.iterator
        member_ptr = sMember.iterator
        for k in cutlass.range_constexpr(cute.size(toks)):
            tok = toks[k]
            ok = Uint32(tok) < Uint32(limit)
            w = (tok >> 5) if ok else Int32(self.words)
            rank = sPrefix[w] + cute.arch.popc(sBitmap[w] & ~(Int32(-1) << (tok & 31)))
            union_ptr[rank] = tok  # every row with this token stores the same value
            bit = Int32(1) << (rank & 31)
            cute.arch.atomic_or(member_ptr + (k // blocks) * self.member_stride + (rank >> 5), bit)

    @cute.jit
    def load_entries(self, mIdx, row0_ptr, sCount, c0, tidx, full: cutlass.Constexpr,
                     last_use: cutlass.Constexpr):
        """This thread's entries of columns ``c0 + b * 256 + tidx`` of every row, entry
        ``r * blocks + b``: the token, or -1 past the row's count (never a candidate). ``full``:
        col_blocks blocks, all below every row's count; else one block, checked against the
        counts. All loads are issued before any is used. ``last_use`` (pass 2): evict-first
        loads, so that L2 keeps the lines other tiles still have to read a second time."""
        blocks = self.col_blocks if const_expr(full) else 1
        cop = "cs" if const_expr(last_use) else None
        toks = cute.make_rmem_tensor((self.R * blocks,), Int32)
        # one address per iteration, the next row one stride further, the column blocks at
        # constant offsets from it (left to itself, the compiler recomputes the 64-bit address
        # per entry)
        ptr = row0_ptr + c0
        for r in cutlass.range_constexpr(self.R):
            if const_expr(r > 0):
                ptr = ptr + mIdx.layout.stride[0]
            if const_expr(full):
                for b in cutlass.range_constexpr(blocks):
                    toks[r * blocks + b] = cute.arch.load(ptr + b * NUM_THREADS, Int32, cop=cop)
            else:
                t = Int32(-1)
                if c0 + tidx < sCount[r]:  # 0 for rows past T
                    t = cute.arch.load(ptr, Int32, cop=cop)
                toks[r] = t
        return toks
