"""The QSA gather (device role): a CTA's selected tokens gathered from the paged cache into a
pipeline of shared-memory tiles, with the pipeline's barriers and shared-memory plan.

Selected tokens are scattered (random 4-token blocks), so TMA tiles do not apply. The producer
warps look up a tile's tokens (one or more per lane: index, ``t // PAGE`` with a compile-time
page size, block table, bounds checks), then copy each token's K and V row (``D`` elements,
contiguous) with ``cp.async`` into the swizzled shared-memory tiles that WGMMA (or ldmatrix)
reads. Invalid entries are copied with source size 0, i.e. zero-filled without any global read,
so no index can make the kernel read outside the cache and stale shared memory can never inject
NaN into P.V. A per-tile validity bitmask (``vote.ballot``) goes to shared memory with the tile.
Lookups run two tiles ahead of the copies (index loads for tile i + 2, block-table loads for tile
i + 1), so their dependent global loads never stall the gather. FP8 rows may instead be widened
to fp16 by the gather warps (``widen_in_producer``: the row-tile kernel).

Pipeline: ``stages`` slots, each guarded by a "full" mbarrier (32 no-inc ``cp.async.mbarrier.arrive``
of each producer lane + one ordinary arrive of each bitmask writer, which releases its store) and
an "empty" mbarrier (one arrive per consumer thread). With ``kv_barriers`` a slot's K rows are
copied first and released by "full" alone, its V rows after them by a second barrier, so QK and the
softmax run while V is still arriving. Design: docs/design/qsa.md#gather-a-line-per-row.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..jit.spec import DTYPE_BITS
from .fragments import (
    EVICT_FIRST_POLICY,
    cp_async_zfill_16_at,
    cvt_e4m3x4_f16,
    load_nc_b32x4,
    store_shared_b32x4,
)


def smem_byte_offset(layout, crd, elem_bytes: int):
    """Byte offset of ``crd`` in a swizzled shared-memory layout (``swizzle o outer``, base aligned
    to the swizzle period). The swizzle acts on *byte* addresses (what WGMMA descriptors and the
    DSL's own smem accesses use), so it is applied after scaling the element offset; for 16-bit
    types ``cute.crd2idx`` on the composed layout would swizzle element offsets instead."""
    sw = layout.inner
    x = cute.crd2idx(crd, layout.outer) * elem_bytes
    mask = ((1 << sw.num_bits) - 1) << (sw.num_base + sw.num_shift)
    return x ^ ((x & mask) >> sw.num_shift)


class QsaGather:
    """The gather of a QSA kernel built from its config ``cfg`` (a per-row or row-tile QSA config:
    head dim, page size, tile, stages, the gather flags, occupancy, PDL): ``R`` query rows per CTA
    (bitmask words per row and tile), ``producers`` gather warps per group of slots, a consumer
    warpgroup of ``warps`` warps, ``num_threads`` per CTA, ``N`` staged query rows (the reduction
    scratch), ``mma_dtype``/``kv_dtype`` (DSL types) and whether FP8 rows are widened here
    (``widen_in_producer``: the tiles then hold ``mma_dtype``)."""

    def __init__(self, cfg, *, R: int, producers: int, N: int, warps: int, num_threads: int, mma_dtype, kv_dtype,
                 widen_in_producer: bool):
        self.cfg = cfg
        self.fp8 = cfg.kv_dtype == "fp8_e4m3"
        self.D, self.page, self.tile, self.stages, self.R, self.N = cfg.head_dim, cfg.page_size, cfg.tile, cfg.stages, R, N
        self.warps, self.num_threads = warps, num_threads
        self.mma_dtype, self.kv_dtype = mma_dtype, kv_dtype
        self.widen_in_producer = widen_in_producer
        self.smem_kv_dtype = mma_dtype if widen_in_producer else kv_dtype
        self.kv_bytes = DTYPE_BITS[cfg.kv_dtype] // 8
        self.chunk_elems = 16 // self.kv_bytes  # elements per 16-byte cp.async
        self.chunks_per_row = self.D // self.chunk_elems
        self.rows_per_copy = max(1, 32 // self.chunks_per_row)  # token rows per warp-wide copy
        self.words = self.tile // 32  # validity bitmask words per tile (per row)
        # producer warps: one owns all words; P = k * words: one word and a k-th of its rows each
        self.P = producers
        self.local_words = self.words if self.P == 1 else 1
        self.parts = 1 if self.P == 1 else self.P // self.words
        # lanes that publish bitmask words per tile: lane 0 for one row, lane j < R * words
        # (row j // words, word j % words) for a row tile
        if self.R > 1:
            self.mask_writers = self.R * self.words
        else:
            self.mask_writers = 1 if cfg.producers == 1 else self.words

    def launch(self, kernel, args, grid, stream, mmas):
        """(Traced, host side.) The shared-memory plan and the launch of ``kernel(*args, *mmas)``,
        ``mmas = (qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout)`` (``p_layout`` None:
        no P tile): each gathered token row is 16-byte chunks that the K/V swizzle keeps whole."""
        cfg = self.cfg
        mma_dtype = self.mma_dtype
        qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout = mmas

        # built from evaluated annotations: this module's ``from __future__ import annotations``
        # would leave a class body's annotations as strings outside a traced function
        fields = {
            # kv_barriers: the V halves' barriers follow the K halves' (full + stages + s)
            "full": cute.struct.MemRange[cutlass.Int64, cfg.stages * (2 if cfg.kv_barriers else 1)],
            "empty": cute.struct.MemRange[cutlass.Int64, cfg.stages],
            "mask": cute.struct.MemRange[Int32, cfg.stages * self.R * (cfg.tile // 32)],
            "red": cute.struct.MemRange[Float32, self.warps * cfg.n_pad],
            "sK": cute.struct.Align[cute.struct.MemRange[self.smem_kv_dtype, cute.cosize(k_layout)], 1024],
            "sV": cute.struct.Align[cute.struct.MemRange[self.smem_kv_dtype, cute.cosize(v_layout)], 1024],
            "sQ": cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(q_layout)], 1024],
        }
        if const_expr(p_layout is not None):  # P through shared memory (swap-AB PV)
            fields["sP"] = cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(p_layout)], 1024]
        Storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        self.storage = Storage
        # a launch asking for more shared memory than a CTA may hold fails at run time: refuse to compile
        smem = Storage.size_in_bytes()
        if const_expr(not cfg.hw.smem_fits(smem, cfg.occupancy)):
            raise ValueError(f"{cfg.label()}: {smem} bytes of shared memory x {cfg.occupancy} CTAs per SM do not fit")
        kernel(*args, qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=cfg.occupancy,
            preferred_smem_carveout=100, use_pdl=cfg.pdl)

    @cute.jit
    def setup_shared(self, q_layout, p_layout, tidx):
        """The shared-memory tensors and the pipeline's mbarriers,
        initialized and published to the whole CTA."""
        cfg = self.cfg
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sP = None
        if const_expr(p_layout is not None):
            sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sRed = storage.red.get_tensor(cute.make_layout((self.warps, self.N), stride=(self.N, 1)))
        nw = self.R * self.words
        sMask = storage.mask.get_tensor(cute.make_layout((nw, cfg.stages), stride=(1, nw)))
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        if tidx == 0:
            for s in cutlass.range_constexpr(cfg.stages):
                # cp.async no-inc arrivals of every producer lane + the bitmask writers' releases
                cute.arch.mbarrier_init(full + s, 32 * self.P + self.mask_writers)
                if const_expr(cfg.kv_barriers):  # V: the cp.async no-inc arrivals only
                    cute.arch.mbarrier_init(full + cfg.stages + s, 32 * self.P)
                cute.arch.mbarrier_init(empty + s, self.warps * 32)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return storage, sQ, sP, sRed, sMask, full, empty

    @cute.jit
    def gather_list(self, mK, mV, mSrc, src_row, limit, count, first_tile, tile_step, n_tiles, i0, req,
                    mBlockTable, storage, k_layout, v_layout, sMask, full, empty, kv_head, pw, lane, mMember,
                    mode: cutlass.Constexpr, row_in_tile, slot_step: cutlass.Constexpr = 1):
        """Gather ``n_tiles`` tiles of the token list ``mSrc[src_row, :]`` (columns below ``limit``
        are read, those below ``count`` used): tile ``first_tile + k * tile_step`` goes to
        pipeline slot ``i0 + k * slot_step`` (``slot_step`` > 1: groups of gather warps taking
        alternate slots). Per tile: publish the validity bitmask of the tile's tokens and
        copy their K and V rows with zero-filling cp.async.

        Work split: one producer warp owns every 32-token word of the tile (lane l: tokens l,
        l + 32, ...); with ``P = k * words`` producer warps, warp ``pw`` owns word ``pw % words``
        and copies the ``pw // words``-th of k slices of its rows. The copies are issue-bound, so
        16-bit and unwidened FP8 rows go out a 128-byte line per row per copy, every address
        computed once per row (:meth:`copy_lines`; docs/design/qsa.md#gather-a-line-per-row).

        ``mode`` (row tiles): 0 = one query row (lane 0 writes the mask words); 1 = the tile's
        union list, row r's words are the validity bits AND its membership bits
        ``mMember[src_row, r, :]``; 2 = the list of row ``row_in_tile`` of the tile, the other
        rows' words are 0.

        The lookups run two tiles ahead so that their dependent global loads (list entry, then
        block table) are in flight while earlier tiles are copied: iteration i issues the list
        loads of tile i + 2 and the block-table loads of tile i + 1, and only consumes values
        loaded by earlier iterations (membership words: one tile ahead)."""
        eb, words, wl = self.kv_bytes, self.words, self.local_words
        cpr, rpc = self.chunks_per_row, self.rows_per_copy
        word0 = Int32(0)
        part = Int32(0)
        if const_expr(self.P > 1):
            word0 = pw % words
            part = pw // words
        rows_per_part = (32 // rpc) // self.parts  # warp-wide copies per word per producer warp
        tok_a = cute.make_rmem_tensor((wl,), Int32)  # tile i + 1: token ids
        tok_b = cute.make_rmem_tensor((wl,), Int32)  # tile i + 2: token ids (loading)
        self.load_tokens(mSrc, src_row, first_tile, tok_a, limit, word0, lane)
        self.load_tokens(mSrc, src_row, first_tile + tile_step, tok_b, limit, word0, lane)

        num_reqs = mBlockTable.shape[0]
        width = mBlockTable.shape[1]
        num_blocks = mK.shape[0]
        req_ok = req >= 0 and req < num_reqs
        # 64-bit byte addressing of the cache rows (phys * block stride overflows int32)
        k_gbase = mK.iterator.toint()
        v_gbase = mV.iterator.toint()
        sKb, sKt, sKh = Int64(mK.stride[0]), Int64(mK.stride[1]), Int64(mK.stride[2])
        sVb, sVt, sVh = Int64(mV.stride[0]), Int64(mV.stride[1]), Int64(mV.stride[2])
        k_head = k_gbase + Int64(kv_head) * sKh * eb
        v_head = v_gbase + Int64(kv_head) * sVh * eb
        # K and V views with the same strides (the two halves of one cache buffer): a row's V
        # address is its K address plus this, so only K's is shuffled to the copying lanes
        kv_delta = v_gbase - k_gbase
        k_sbase = storage.sK.data_ptr().toint()
        v_sbase = storage.sV.data_ptr().toint()
        chunk = lane % cpr
        sub = lane // cpr  # which of the rows of one warp-wide copy this lane serves
        lane_bytes = Int64(chunk * 16)  # this lane's 16-byte chunk of a row
        # row-tile bitmask writers: lane j publishes row m_row's word m_word (one warp: j < R *
        # words, row j // words, word j % words; several: lane j < R of each word's first warp)
        if const_expr(self.P == 1):
            m_row = lane // words
            m_word = lane % words
            writer = lane < self.mask_writers
        else:
            m_row = lane
            m_word = word0
            writer = part == 0 and lane < self.R
        mem_a = Int32(0)  # membership word of tile i (mode 1)
        if const_expr(mode == 1):
            if writer:
                mem_a = mMember[src_row, m_row, first_tile * words + m_word]
        # tile i + 1 after its block-table lookup: physical page (-1 = invalid entry) and offset
        phys_a = cute.make_rmem_tensor((wl,), Int32)
        offs_a = cute.make_rmem_tensor((wl,), Int32)
        self.lookup_pages(mBlockTable, req, req_ok, width, first_tile, count, tok_a, phys_a, offs_a, word0, lane)
        # tile i: per owned token its K and V row addresses (the cache base for invalid entries,
        # which are then copied with source size 0: nothing is read) and the validity bits
        k_addr = cute.make_rmem_tensor((wl,), Int64)
        v_addr = cute.make_rmem_tensor((wl,), Int64)
        bits = cute.make_rmem_tensor((wl,), Int32)
        for k in cutlass.range(n_tiles, unroll=1):
            i = i0 + k if const_expr(slot_step == 1) else i0 + k * slot_step
            stage = i % self.stages
            tile_idx = first_tile + k * tile_step
            for w in cutlass.range_constexpr(wl):
                p = phys_a[w]
                ok = p >= 0 and p < num_blocks
                pp = Int64(p) if ok else Int64(0)
                oo = Int64(offs_a[w]) if ok else Int64(0)
                k_addr[w] = k_head + (pp * sKb + oo * sKt) * eb if ok else k_gbase
                if const_expr(not self.derive_v()):
                    v_addr[w] = v_head + (pp * sVb + oo * sVt) * eb if ok else v_gbase
                bits[w] = cute.arch.vote_ballot_sync(ok)
                tok_a[w] = tok_b[w]
            # ---- lookahead: block table of tile i + 1, list entries of tile i + 2 ----
            self.lookup_pages(mBlockTable, req, req_ok, width, tile_idx + tile_step, count, tok_a, phys_a,
                              offs_a, word0, lane)
            self.load_tokens(mSrc, src_row, tile_idx + 2 * tile_step, tok_b, limit, word0, lane)
            mem_b = Int32(0)
            if const_expr(mode == 1):
                nxt = (tile_idx + tile_step) * words + m_word
                if writer and nxt < mMember.shape[2]:
                    mem_b = mMember[src_row, m_row, nxt]
            # ---- wait until the consumers released this slot ----
            if i >= self.stages:
                cute.arch.mbarrier_wait(empty + stage, ((i // self.stages) - 1) % 2)
            if const_expr(mode == 0):
                if lane == 0 and part == 0:
                    for w in cutlass.range_constexpr(wl):
                        sMask[word0 + w, stage] = bits[w]
            else:
                if writer:
                    b = bits[0]
                    for w in cutlass.range_constexpr(1, wl):
                        if m_word == w:
                            b = bits[w]
                    if const_expr(mode == 1):
                        b = b & mem_a
                    else:
                        b = b if m_row == row_in_tile else Int32(0)
                    sMask[m_row * words + m_word, stage] = b
            # ---- gather: one warp-wide copy covers `rpc` token rows ----
            if const_expr(self.widen_in_producer):
                self.copy_widened(k_addr, v_addr, bits, word0, part, rows_per_part, k_sbase, v_sbase, k_layout,
                                  v_layout, stage, lane_bytes, chunk, sub)
                # plain stores, read by WGMMA through the async proxy
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.mbarrier_arrive(full + stage)
            else:
                # kv_barriers (per-row kernel): K only here, released with the bitmask; V below
                self.copy_lines(self.line_copy_plan(k_layout, v_layout), k_addr, v_addr, kv_delta, bits, word0,
                                part, k_sbase, v_sbase, k_layout, v_layout, stage, lane,
                                "k" if const_expr(self.cfg.kv_barriers) else "kv")
                cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)
            if const_expr(mode == 0):
                if lane == 0 and part == 0:
                    cute.arch.mbarrier_arrive(full + stage)  # releases the bitmask store above
            else:
                if writer:
                    cute.arch.mbarrier_arrive(full + stage)
            if const_expr(self.cfg.kv_barriers):
                self.copy_lines(self.line_copy_plan(k_layout, v_layout), k_addr, v_addr, kv_delta, bits, word0,
                                part, k_sbase, v_sbase, k_layout, v_layout, stage, lane, "v")
                cute.arch.cp_async_mbarrier_arrive_noinc(full + self.stages + stage)
            if const_expr(mode == 1):
                mem_a = mem_b

    def derive_v(self) -> bool:
        """(Trace time.) V row addresses are K's plus a constant (same strides), except in the
        widening gather, whose loads all stay in flight and need no extra live register pair."""
        return self.cfg.kv_same_strides and not self.widen_in_producer

    def v_coord(self, tok, d, stage):
        """The V tile coordinate of (token, element d): (d, token) for 16-bit caches (MN-major B
        operand), (token, d) for FP8 (widened to fragments by the consumer)."""
        return (tok, d, stage) if self.fp8 else (d, tok, stage)

    def line_copy_plan(self, k_layout, v_layout):
        """(Trace time.) Constants of :meth:`copy_lines` per tile (K, V): ``(G, A, xs, stage
        bytes)``; a layout that breaks its assumption is refused (every 16-bit and FP8 tile
        layout of the supported head dims keeps it).

        The assumption, checked for every (token, 16-byte chunk) of the tile: a row is groups of G
        chunks (one 128-byte line for a 128-byte swizzle), group g at byte ``u(t) + g * A``, and
        chunk j of a group at slot ``j ^ X(t)`` with ``X(t) = (u(t) >> xs) mod G``, where ``u(t)``
        is the row's unswizzled offset; stages are ``stage bytes`` apart."""
        eb, E, cpr, T = self.kv_bytes, self.chunk_elems, self.chunks_per_row, self.tile
        rows = 32 // self.parts  # rows of a 32-token word one producer warp copies
        plans = []
        for lay, crd in ((k_layout, lambda t, d, st: (t, d, st)), (v_layout, self.v_coord)):
            sw = lay.inner
            G = 1 << sw.num_bits
            if sw.num_base != 4 or G > cpr or cpr % G or 32 % G or rows % (32 // G):
                raise ValueError(f"{self.cfg.label()}: the line copy needs 16-byte swizzle units and whole "
                                 f"groups of them per row ({sw}, {cpr} chunks, {rows} rows per warp)")
            xs = sw.num_base + sw.num_shift
            u = [cute.crd2idx(crd(t, 0, 0), lay.outer) * eb for t in range(T)]
            A = cute.crd2idx(crd(0, G * E, 0), lay.outer) * eb - u[0] if cpr > G else 0
            st = smem_byte_offset(lay, crd(0, 0, 1), eb) - smem_byte_offset(lay, crd(0, 0, 0), eb)
            for t in range(T):
                x = (u[t] >> xs) % G
                for c in range(cpr):
                    want = u[t] + (c // G) * A + ((c % G) ^ x) * 16
                    for stage in range(self.stages):
                        if smem_byte_offset(lay, crd(t, c * E, stage), eb) != want + stage * st:
                            raise ValueError(f"{self.cfg.label()}: tile layout breaks the line copy at "
                                             f"token {t}, chunk {c}, stage {stage}")
            plans.append((G, A, xs, st))
        return tuple(plans)

    @cute.jit
    def copy_lines(self, plan, k_addr, v_addr, kv_delta, bits, word0, part, k_sbase, v_sbase, k_layout, v_layout,
                   stage, lane, which: cutlass.Constexpr = "kv"):
        """The tile's K and V rows this warp owns, a 128-byte line per row per copy: G lanes (a
        swizzle group) serve one row, 32 / G rows per warp-wide copy, so each copy reads whole
        lines like the per-row copy but every address is computed once per row, not per chunk.
        Lane q of a row writes slot q of each group, reading the row's chunk ``q ^ X(token)``
        there (the swizzle moved to the source side), so the copies of a row differ only by
        compile-time offsets (``[reg + imm]``). ``which``: "kv" both rows of each token, "k" or
        "v" only that half (the separate K and V barriers)."""
        eb, cpr = self.kv_bytes, self.chunks_per_row
        (G, A_k, xs_k, st_k), (_, A_v, xs_v, st_v) = plan
        per_copy = 32 // G  # rows per warp-wide copy
        rows = 32 // self.parts
        q = lane % G
        for w in cutlass.range_constexpr(self.local_words):
            for ps in cutlass.range_constexpr(rows // per_copy):
                row = ps * per_copy + lane // G  # of the 32-token word (owner lane)
                if const_expr(self.parts > 1):
                    row = row + part * rows
                tok = (word0 + w) * 32 + row
                nbytes = ((bits[w] >> row) & 1) * 16
                k_row = cute.arch.shuffle_sync(k_addr[w], row)
                v_row = None
                if const_expr(self.derive_v()):
                    v_row = k_row + kv_delta
                else:
                    v_row = cute.arch.shuffle_sync(v_addr[w], row)
                u_k = cute.crd2idx((tok, 0, 0), k_layout.outer) * eb
                u_v = cute.crd2idx(self.v_coord(tok, 0, 0), v_layout.outer) * eb
                k_dst = k_sbase + stage * st_k + u_k + q * 16
                v_dst = v_sbase + stage * st_v + u_v + q * 16
                k_src = k_row + Int64((q ^ ((u_k >> xs_k) % G)) * 16)
                v_src = v_row + Int64((q ^ ((u_v >> xs_v) % G)) * 16)
                policy = Int64(EVICT_FIRST_POLICY) if const_expr(self.cfg.evict_first) else None
                for g in cutlass.range_constexpr(cpr // G):
                    if const_expr(which != "v"):
                        cp_async_zfill_16_at(k_dst, k_src, nbytes, g * A_k, g * G * 16, policy)
                    if const_expr(which != "k"):
                        cp_async_zfill_16_at(v_dst, v_src, nbytes, g * A_v, g * G * 16, policy)

    @cute.jit
    def copy_widened(self, k_addr, v_addr, bits, word0, part, rows_per_part, k_sbase, v_sbase, k_layout, v_layout,
                     stage, lane_bytes, chunk, sub):
        """FP8 rows -> fp16 tiles: every 16-byte chunk of the warp's rows is loaded first (all in
        flight; invalid entries are not read and become zeros), then widened exactly with
        ``cvt.rn.f16x2.e4m3x2`` and stored as two 16-byte fp16 chunks."""
        wl, rpc, E = self.local_words, self.rows_per_copy, self.chunk_elems
        n = wl * rows_per_part
        buf = cute.make_rmem_tensor((n * 8,), Int32)  # per copy: 4 words of K, 4 of V
        buf.fill(0)
        for w in cutlass.range_constexpr(wl):
            for jl in cutlass.range_constexpr(rows_per_part):
                jj = jl if const_expr(self.parts == 1) else part * rows_per_part + jl
                src = jj * rpc + sub if const_expr(rpc > 1) else jj
                i = w * rows_per_part + jl
                k_src = cute.arch.shuffle_sync(k_addr[w], src) + lane_bytes
                v_src = cute.arch.shuffle_sync(v_addr[w], src) + lane_bytes
                if (bits[w] >> src) & 1 != 0:
                    k4 = load_nc_b32x4(k_src)
                    v4 = load_nc_b32x4(v_src)
                    for q in cutlass.range_constexpr(4):
                        buf[8 * i + q] = k4[q]
                        buf[8 * i + 4 + q] = v4[q]
        for w in cutlass.range_constexpr(wl):
            for jl in cutlass.range_constexpr(rows_per_part):
                jj = jl if const_expr(self.parts == 1) else part * rows_per_part + jl
                src = jj * rpc + sub if const_expr(rpc > 1) else jj
                i = w * rows_per_part + jl
                tok = (word0 + w) * 32 + src
                for kv in cutlass.range_constexpr(2):
                    h = [Int32(0)] * 8
                    for q in cutlass.range_constexpr(4):
                        h[2 * q], h[2 * q + 1] = cvt_e4m3x4_f16(buf[8 * i + 4 * kv + q], False)
                    for half in cutlass.range_constexpr(2):
                        d = chunk * E + 8 * half
                        if const_expr(kv == 0):
                            dst = k_sbase + smem_byte_offset(k_layout, (tok, d, stage), 2)
                        else:
                            dst = v_sbase + smem_byte_offset(v_layout, (d, tok, stage), 2)
                        store_shared_b32x4(dst, h[4 * half], h[4 * half + 1], h[4 * half + 2], h[4 * half + 3])

    @cute.jit
    def load_tokens(self, mSrc, row, tile_idx, tok, limit, word0, lane):
        """Issue the list loads of this lane's columns of tile ``tile_idx`` (its warp's words from
        ``word0``; -1 from ``limit`` on: TOPK for a packed index row); the valid count masks them
        later, so these loads need not wait for it."""
        for w in cutlass.range_constexpr(self.local_words):
            col = tile_idx * self.tile + (word0 + w) * 32 + lane
            t = Int32(-1)
            if col < limit:
                t = mSrc[row, col]
            tok[w] = t

    @cute.jit
    def lookup_pages(self, mBlockTable, req, req_ok, width, tile_idx, count, tok, phys, offs, word0, lane):
        """Issue the block-table loads of tile ``tile_idx``'s tokens: ``phys`` = the physical page
        (-1 when the column is past the count, the token negative, the request or the page out of
        the table; checked against the pool when used), ``offs`` = the offset in the page."""
        for w in cutlass.range_constexpr(self.local_words):
            col = tile_idx * self.tile + (word0 + w) * 32 + lane
            t = tok[w]
            page = t // self.page
            ok = req_ok and col < count and t >= 0 and page < width
            p = Int32(-1)
            if ok:
                p = mBlockTable[req, page]
            phys[w] = p
            offs[w] = t - page * self.page
