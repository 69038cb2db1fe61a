"""SM90 QSA sparse GQA attention: split-K partial kernel over the packed top-k index buffer.

Contract: ``cute_kernels.reference.qsa_sparse_attention`` (docs: ../shared/docs/qsa-contract.md).

Design:

- **One CTA per (query row, KV head, split)**: 4 consumer warps (one warpgroup) and one producer
  warp. Split ``s`` of ``S`` visits the row's tiles ``s, s + S, ...`` below
  ``ceil(min(valid_count, TOPK) / tile)``, so the few tiles of a short row spread over the splits.
- **Gather with 16-byte cp.async.** Selected tokens are scattered (random 4-token blocks), so
  TMA tiles do not apply. The producer warp looks up a tile's tokens (one or more per lane: index,
  ``t // PAGE`` with a compile-time page size, block table, bounds checks), then copies each
  token's K and V row (``D`` elements, contiguous) with ``cp.async`` into the swizzled
  shared-memory tiles that WGMMA (or ldmatrix) reads, one warp-wide instruction per row (or per
  several rows when a row is shorter than 512 bytes). Invalid entries are copied with source size 0, i.e. zero-filled without any
  global read, so no index can make the kernel read outside the cache and stale shared memory
  can never inject NaN into P.V. A per-tile validity bitmask (``vote.ballot``) goes to shared
  memory with the tile. Lookups run two tiles ahead of the copies (index loads for tile i + 2,
  block-table loads for tile i + 1), so their dependent global loads never stall the gather.
- **Pipeline.** ``stages`` shared-memory slots, each guarded by a "full" mbarrier (32 no-inc
  ``cp.async.mbarrier.arrive`` of the producer lanes + one ordinary arrive of lane 0 after it
  wrote the bitmask, which releases that store) and an "empty" mbarrier (128 consumer arrives).
  With ``kv_barriers`` a slot's K rows are copied first and released by "full" alone, its V rows
  after them by a second barrier, so QK and the softmax run while V is still arriving.
- **Swap-AB WGMMA** (as in ``decode.py``, whose helpers this kernel inherits): the KV group's
  ``G`` query heads are the MMA's N (padded to 8/16), the tile's tokens its M. 16-bit caches run
  SS WGMMA straight from the gathered tiles (after a ``fence.proxy.async``, since cp.async
  writes through the generic proxy); FP8 caches are read with ``ldmatrix`` and widened exactly to
  fp16 in registers (``cvt.rn.f16x2.e4m3x2``) for RS WGMMA, with the query rescaled by a power of
  two into fp16 range (exact).
- **Online softmax** in base 2, masked entries at -inf; k_scale folds into the logit scale,
  v_scale into the output normalizer, the LSE stays unscaled.
- **Output.** ``split``: fp32 partial O ``[S, rows, Hq, D]`` and base-2 LSE ``[S, rows, Hq]``
  (64-bit strides; an empty split writes 0 and -inf) for ``qsa_merge``; otherwise O rounded to
  q's dtype, times ``sigmoid(gate)`` in fp32 when gated, and the LSE.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from ..jit.asm import asm
from ..jit.dtypes import cute_dtype
from ..jit.spec import DTYPE_BITS
from ..roles.fragments import EVICT_FIRST_POLICY, cvt_e4m3x4_f16, sigmoid
from .decode import BAR_MMA, MMA_M, MMA_WARPS, Sm90PagedDecode, slot_column, slot_of

PRODUCER_WARP = MMA_WARPS  # the first producer warp
LOG2E = math.log2(math.e)


@dsl_user_op
def cp_async_zfill_16_at(smem_addr: Int32, gmem_addr: Int64, src_bytes: Int32, smem_off: int, gmem_off: int,
                         policy: Int64 | None = None, *, loc=None, ip=None) -> None:
    """``cp.async.cg.shared.global [smem + smem_off], [gmem + gmem_off], 16, src_bytes``: copies
    ``src_bytes`` (16 or 0) and zero-fills the rest; with 0 nothing is read from global memory.
    ``.cg``: L2 only, the gathered rows are used once per CTA. The byte offsets are compile-time
    immediates (no address arithmetic per copy); with ``policy``, an L2 cache-policy operand
    (``.L2::cache_hint``)."""
    if policy is None:
        asm([], [Int32(smem_addr), Int64(gmem_addr), Int32(src_bytes)],
            f"cp.async.cg.shared.global [$0+{int(smem_off)}], [$1+{int(gmem_off)}], 16, $2;", "r,l,r",
            side_effects=True, loc=loc, ip=ip)
    else:
        asm([], [Int32(smem_addr), Int64(gmem_addr), Int32(src_bytes), Int64(policy)],
            f"cp.async.cg.shared.global.L2::cache_hint [$0+{int(smem_off)}], [$1+{int(gmem_off)}], 16, $2, $3;",
            "r,l,r,l", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def load_nc_b32x4(gmem_addr: Int64, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """``ld.global.nc.L1::no_allocate.v4.b32``: 16 bytes of the (read-only) cache, kept out of L1
    (each gathered row is used once per CTA)."""
    regs = asm([T.i32()] * 4, [Int64(gmem_addr)],
               "ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", loc=loc, ip=ip)
    return tuple(Int32(r) for r in regs)


@dsl_user_op
def store_shared_b32x4(smem_addr: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """``st.shared.v4.b32``: one 16-byte store."""
    asm([], [Int32(smem_addr), Int32(a), Int32(b), Int32(c), Int32(d)], "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r", side_effects=True, loc=loc, ip=ip)


def smem_byte_offset(layout, crd, elem_bytes: int):
    """Byte offset of ``crd`` in a swizzled shared-memory layout (``swizzle o outer``, base aligned
    to the swizzle period). The swizzle acts on *byte* addresses (what WGMMA descriptors and the
    DSL's own smem accesses use), so it is applied after scaling the element offset; for 16-bit
    types ``cute.crd2idx`` on the composed layout would swizzle element offsets instead."""
    sw = layout.inner
    x = cute.crd2idx(crd, layout.outer) * elem_bytes
    mask = ((1 << sw.num_bits) - 1) << (sw.num_base + sw.num_shift)
    return x ^ ((x & mask) >> sw.num_shift)


class Sm90QsaAttention(Sm90PagedDecode):
    """Kernel object; all fields are compile-time (see :class:`Sm90QsaConfig`).

    Inherits the query staging (``stage_q``), the FP8 fragment loaders (``load_k_fragments``,
    ``load_v_fragments``, ``widen``, ``physical_d``) of the paged decode kernel, whose fragment
    layouts and precision scheme it shares; the pipeline, gather, softmax masking and epilogue
    are its own.
    """

    def __init__(self, cfg):
        # not decode's __init__ (it takes a decode config): set the attributes its helpers read
        self.cfg = cfg
        self.q_dtype = cute_dtype(cfg.q_dtype)
        self.kv_dtype = cute_dtype(cfg.kv_dtype)
        self.fp8 = cfg.kv_dtype == "fp8_e4m3"
        self.q_permuted = self.fp8
        # FP8 rows converted to fp16 by the gather warps (row-tile kernel) instead of in the
        # consumer's registers: the shared-memory tiles then hold mma_dtype
        self.widen_in_producer = False
        self.D = cfg.head_dim
        self.G = cfg.group
        # query rows per CTA (the row-tile kernel packs R rows x G heads into the WGMMA's N)
        self.R = getattr(cfg, "rows_per_cta", 1)
        self.q_len = self.R
        self.rows = cfg.group * self.R
        self.N = cfg.n_pad
        self.page = cfg.page_size
        self.tile = cfg.tile
        self.stages = cfg.stages
        self.cvt = self.fp8
        self.mma_dtype = cute_dtype("fp16") if self.fp8 else self.q_dtype
        self.dynamic_q_scale = self.fp8 and cfg.q_dtype == "bf16"
        # cvt widening is exact and unscaled: no power-of-two pre/post scales (see decode.py)
        self.q_pre = self.p_pre = self.logit_log2 = self.out_log2 = 0
        self.kv_bytes = DTYPE_BITS[cfg.kv_dtype] // 8
        self.chunk_elems = 16 // self.kv_bytes  # elements per 16-byte cp.async
        self.chunks_per_row = self.D // self.chunk_elems
        self.rows_per_copy = max(1, 32 // self.chunks_per_row)  # token rows per warp-wide copy
        self.words = self.tile // 32  # validity bitmask words per tile (per row)
        # lanes that publish bitmask words per tile: lane 0 for one row, lane j < R * words
        # (row j // words, word j % words) for a row tile
        # producer warps: one owns all words; P = k * words: one word and a k-th of its rows each
        self.P = cfg.producers
        self.local_words = self.words if self.P == 1 else 1
        self.parts = 1 if self.P == 1 else self.P // self.words
        self.num_threads = (MMA_WARPS + self.P) * 32
        if self.R > 1:
            self.mask_writers = self.R * self.words
        else:
            self.mask_writers = 1 if self.P == 1 else self.words

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [T, Hq, D]
        mK: cute.Tensor,  # [NB, PAGE, Hkv, D]
        mV: cute.Tensor,  # [NB, PAGE, Hkv, D]
        mIdx: cute.Tensor,  # [T, TOPK + 1] int32
        mBlockTable: cute.Tensor,  # [R, W] int32
        mTokenToReq: cute.Tensor,  # [T] int32
        mO: cute.Tensor,  # [T, Hq, D] (q dtype) or split: [S, T, Hq, D] fp32
        mLse: cute.Tensor,  # [T, Hq] or split: [S, T, Hq] fp32
        mGate: cute.Tensor,  # [T, Hq, D] (read only when cfg.gate)
        k_scale: Float32,
        v_scale: Float32,
        stream,
    ):
        num_splits = mO.shape[0] if const_expr(self.cfg.split) else 1
        self.launch(self.kernel, (mQ, mK, mV, mIdx, mBlockTable, mTokenToReq, mO, mLse, mGate, k_scale, v_scale),
                    [mQ.shape[0], mK.shape[2], num_splits], stream)

    def launch(self, kernel, args, grid, stream):
        """(Traced inside ``__call__``.) The shared-memory plan and the launch of ``kernel(*args,
        MMAs, layouts)``; shared by the row-tile kernel."""
        cfg = self.cfg
        mma_dtype = self.mma_dtype
        self.smem_kv_dtype = mma_dtype if self.widen_in_producer else self.kv_dtype
        # each gathered token row is 16-byte chunks that the K/V swizzle keeps whole
        qk_mma, pv_mma, k_layout, v_layout, q_layout, p_layout = self.mmas_and_layouts()

        # built from evaluated annotations: this module's ``from __future__ import annotations``
        # would leave a class body's annotations as strings outside a traced function
        fields = {
            # kv_barriers: the V halves' barriers follow the K halves' (full + stages + s)
            "full": cute.struct.MemRange[cutlass.Int64, cfg.stages * (2 if cfg.kv_barriers else 1)],
            "empty": cute.struct.MemRange[cutlass.Int64, cfg.stages],
            "mask": cute.struct.MemRange[Int32, cfg.stages * self.R * (cfg.tile // 32)],
            "red": cute.struct.MemRange[Float32, MMA_WARPS * cfg.n_pad],
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

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mIdx: cute.Tensor,
        mBlockTable: cute.Tensor,
        mTokenToReq: cute.Tensor,
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
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        row, kv_head, split = cute.arch.block_idx()
        num_splits = cute.arch.grid_dim()[2]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        if const_expr(cfg.split):
            # let the merge kernel (programmatic dependent launch) get scheduled behind us
            cute.arch.griddepcontrol_launch_dependents()
        storage, sQ, sP, sRed, sMask, full, empty = self.setup_shared(q_layout, p_layout, tidx)
        if const_expr(cfg.pdl):
            # launched as a programmatic dependent: the setup above overlapped the previous
            # kernel's tail; nothing it writes (q, indices, caches) is read before this returns
            cute.arch.griddepcontrol_wait()

        if warp >= PRODUCER_WARP:
            self.produce(mK, mV, mIdx, mBlockTable, mTokenToReq, storage, k_layout, v_layout, sMask, full,
                         empty, row, kv_head, split, num_splits, warp - PRODUCER_WARP, lane)
        else:
            _, my_tiles = self.row_tiles(mIdx, row, split, num_splits)
            self.consume_tiles(mQ, storage, sQ, sP, sRed, sMask, full, empty, mO, mLse, mGate, k_scale,
                               v_scale, qk_mma, pv_mma, k_layout, v_layout, row, kv_head, split, my_tiles,
                               tidx, warp, lane)

    # ------------------------------------------------------------------------------------------

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
        sRed = storage.red.get_tensor(cute.make_layout((MMA_WARPS, self.N), stride=(self.N, 1)))
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
                cute.arch.mbarrier_init(empty + s, MMA_WARPS * 32)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return storage, sQ, sP, sRed, sMask, full, empty

    @cute.jit
    def row_tiles(self, mIdx, row, split, num_splits):
        """``(count, my_tiles)``: the row's columns to visit, ``min(valid_count, TOPK)`` (a garbage
        count is clamped, never used as a token), and how many of its tiles split ``s`` visits
        (tiles ``s, s + S, ...`` below ``ceil(count / tile)``)."""
        topk = mIdx.shape[1] - 1
        count = cutlass.min(cutlass.max(mIdx[row, topk], Int32(0)), topk)
        num_tiles = (count + self.tile - 1) // self.tile
        return count, cutlass.max(num_tiles - split + num_splits - 1, Int32(0)) // num_splits

    @cute.jit
    def produce(self, mK, mV, mIdx, mBlockTable, mTokenToReq, storage, k_layout, v_layout, sMask, full, empty,
                row, kv_head, split, num_splits, pw, lane):
        """The row's tiles ``split, split + S, ...`` from its own index list (see ``gather_list``)."""
        topk = mIdx.shape[1] - 1
        count, my_tiles = self.row_tiles(mIdx, row, split, num_splits)
        self.gather_list(mK, mV, mIdx, row, topk, count, split, num_splits, my_tiles, Int32(0),
                         mTokenToReq[row], mBlockTable, storage, k_layout, v_layout, sMask, full, empty,
                         kv_head, pw, lane, None, 0, Int32(0))

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
        computed once per row (:meth:`copy_lines`; before: ~20 instructions of shuffles and
        swizzle arithmetic per 512-byte row copy).

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

    # ------------------------------------------------------------------------------------------

    @cute.jit
    def consume_tiles(self, mQ, storage, sQ, sP, sRed, sMask, full, empty, mO, mLse, mGate, k_scale, v_scale,
                      qk_mma, pv_mma, k_layout, v_layout, row, kv_head, split, my_tiles, tidx, warp, lane):
        D, N = self.D, self.N
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        k_base = storage.sK.data_ptr().toint()
        v_base = storage.sV.data_ptr().toint()
        q_log2 = self.stage_q(mQ, sQ, sRed, row, kv_head, tidx, warp, lane)
        cute.arch.fence_proxy("async.shared", space="cta")  # sQ is read by WGMMA (async proxy)
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=MMA_WARPS * 32)

        # logits in log2 units = S_acc * c (the query was scaled by 2^q_log2 when staged)
        c = Float32(self.D ** -0.5 * LOG2E) * k_scale * cute.math.exp2(-q_log2, fastmath=False)

        thr_qk, thr_pv, cS0, cS, cO0, acc_s, acc_o, row_max, row_sum = self.consumer_state(qk_mma, pv_mma, tidx)
        nS = cute.size(acc_s)
        n_base = cS[0][1] - cS0[0][1]  # this thread's column offset (2 * (lane % 4))
        nslots = N // 4  # columns owned by a thread: 8 * j + n_base + {0, 1}
        mblocks = self.tile // MMA_M
        # this thread's token rows of M block mb are mb * 64 + 16 * warp + lane / 4 + {0, 8}: bits
        # 16 * (warp % 2) + lane / 4 + {0, 8} of bitmask word 2 * mb + warp / 2
        mask_shift = (warp % 2) * 16 + lane // 4

        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        tSrQ = qk_mma.make_fragment_B(thr_qk.partition_B(sQ))
        tOrP = pv_mma.make_fragment_B(thr_pv.partition_B(sP))
        if const_expr(self.fp8):
            tSrK = cute.make_rmem_tensor(thr_qk.partition_A(cute.make_identity_tensor((self.tile, D))).shape,
                                         self.mma_dtype)
            tOrV = cute.make_rmem_tensor(thr_pv.partition_A(cute.make_identity_tensor((D, self.tile))).shape,
                                         self.mma_dtype)
        else:
            tSrK = qk_mma.make_fragment_A(thr_qk.partition_A(sK))
            tOrV = pv_mma.make_fragment_A(thr_pv.partition_A(sV))

        for i in cutlass.range(my_tiles, unroll=1):
            stage = i % self.stages
            cute.arch.mbarrier_wait(full + stage, (i // self.stages) % 2)
            if const_expr(not self.fp8):
                # the gathered rows were written by cp.async (generic proxy); WGMMA reads them
                # through the async proxy
                cute.arch.fence_proxy("async.shared", space="cta")

            # ---------------- S^T = K Q^T ----------------
            if const_expr(self.fp8):
                self.load_k_fragments(tSrK, k_base, k_layout, stage, warp, lane)
            first = cute.make_mma_atom(qk_mma.op)
            first.set(warpgroup.Field.ACCUMULATE, False)
            rest = cute.make_mma_atom(qk_mma.op)
            rest.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(D // 16):
                atom = first if kb == 0 else rest
                if const_expr(self.fp8):
                    cute.gemm(atom, acc_s, tSrK[None, None, kb], tSrQ[None, None, kb, 0], acc_s)
                else:
                    cute.gemm(atom, acc_s, tSrK[None, None, kb, stage], tSrQ[None, None, kb, 0], acc_s)
            warpgroup.commit_group()
            mbits = cute.make_rmem_tensor((mblocks,), Int32)
            for mb in cutlass.range_constexpr(mblocks):
                mbits[mb] = sMask[2 * mb + warp // 2, stage] >> mask_shift
            warpgroup.wait_group(0)

            # ---------------- online softmax over the tile's tokens ----------------
            tile_max = cute.make_rmem_tensor((nslots,), Float32)
            tile_max.fill(-Float32.inf)
            for e in cutlass.range_constexpr(nS):
                s_val = acc_s[e] * c
                r = cS0[e][0]
                if (mbits[r // MMA_M] >> (r % MMA_M)) & 1 == 0:
                    s_val = -Float32.inf
                acc_s[e] = s_val
                sl = slot_of(cS0[e][1])
                tile_max[sl] = cute.arch.fmax(tile_max[sl], s_val)
            self.softmax_tile(acc_s, acc_o, tile_max, row_max, row_sum, sRed, sP, cS0, cO0, n_base,
                              cS[0][0] - cS0[0][0], warp, lane)

            # ---------------- O^T += V^T P^T ----------------
            if const_expr(self.cfg.kv_barriers):
                cute.arch.mbarrier_wait(full + self.stages + stage, (i // self.stages) % 2)
                if const_expr(not self.fp8):
                    cute.arch.fence_proxy("async.shared", space="cta")  # V, as K above
            if const_expr(self.fp8):
                # after QK: the K fragments are dead, so K and V fragments share registers
                self.load_v_fragments(tOrV, v_base, v_layout, stage, warp, lane)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(self.tile // 16):
                if const_expr(self.fp8):
                    cute.gemm(pv_mma, acc_o, tOrV[None, None, kb], tOrP[None, None, kb, 0], acc_o)
                else:
                    cute.gemm(pv_mma, acc_o, tOrV[None, None, kb, stage], tOrP[None, None, kb, 0], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(empty + stage)

        self.epilogue(acc_o, row_max, row_sum, sRed, cO0, thr_pv, mO, mLse, mGate, v_scale, row, kv_head, split,
                      n_base, warp, lane)

    # ------------------------------------------------------------------------------------------

    @cute.jit
    def out_row(self, mO, row, kv_head, n):
        """``(token, head, live)`` of WGMMA column ``n`` (head n of the KV group; padding columns
        are not live)."""
        return row, kv_head * self.G + n, n < self.G

    @cute.jit
    def load_q_chunk(self, mQ, idx, batch_idx, kv_head, work):
        """16 consecutive Q elements (column n, 16-element chunk c) of work item ``idx`` as fp32;
        zeros for padding columns, rows past the last (a partial row tile) and ``idx >= work``."""
        chunks = self.D // 16
        n = idx // chunks
        vals = cute.make_rmem_tensor((16,), Float32)
        vals.fill(0.0)
        token = batch_idx * self.R + n // self.G
        if n < self.rows and idx < work and token < mQ.shape[0]:
            head = kv_head * self.G + n % self.G
            vals.store(cute.local_tile(mQ[token, head, None], (16,), (idx % chunks,)).load().to(Float32))
        return vals

    @cute.jit
    def epilogue(self, acc_o, row_max, row_sum, sRed, cO0, thr_pv, mO, mLse, mGate, v_scale, row, kv_head, split,
                 n_base, warp, lane):
        """Normalize and store: fp32 partials + LSE (split), or O in q's dtype (gated) + LSE.
        A row (or split) without a valid entry gets O = 0 and LSE = -inf."""
        cfg = self.cfg
        D, N = self.D, self.N
        nslots = N // 4

        self.publish_slot_reduction(row_sum, sRed, n_base, warp, lane, lambda a, b: a + b)
        inv = cute.make_rmem_tensor((nslots,), Float32)
        for s in cutlass.range_constexpr(nslots):
            n = slot_column(s, n_base)
            total = sRed[0, n] + sRed[1, n] + sRed[2, n] + sRed[3, n]
            inv[s] = Float32(0.0)
            lse = -Float32.inf
            if total > Float32(0.0):
                inv[s] = v_scale / total
                lse = row_max[s] + cute.math.log2(total, fastmath=True)
            if warp == 0:
                if lane < 4:
                    token, head, live = self.out_row(mO, row, kv_head, n)
                    if live:
                        if const_expr(cfg.split):
                            mLse[split, token, head] = lse
                        else:
                            mLse[token, head] = lse
        cO = thr_pv.partition_C(cute.make_identity_tensor((D, N)))
        n = cute.size(acc_o)
        if const_expr(not cfg.gate or cfg.split):
            for e in cutlass.range_constexpr(n):
                token, head, live = self.out_row(mO, row, kv_head, cO[e][1])
                if live:
                    d = self.physical_d(cO0[e][0], cO[e][0] - cO0[e][0])
                    val = acc_o[e] * inv[slot_of(cO0[e][1])]
                    if const_expr(cfg.split):
                        mO[split, token, head, d] = val
                    else:
                        mO[token, head, d] = val.to(mO.element_type)
        else:
            # Every gate load before the first output store, outside any branch: the compiler
            # cannot move a load of the gate above a store to the output (they may alias), and a
            # load used only under a branch waits inside it; one load per element between stores
            # was a serial L2 round trip each. A padding column reads the group's last head and
            # discards it; every gated value is computed before the stores.
            gv = cute.make_rmem_tensor((n,), mGate.element_type)
            for e in cutlass.range_constexpr(n):
                token, head, _ = self.out_row(mO, row, kv_head, cutlass.min(cO[e][1], self.G - 1))
                gv[e] = mGate[token, head, self.physical_d(cO0[e][0], cO[e][0] - cO0[e][0])]
            ov = cute.make_rmem_tensor((n,), mO.element_type)
            for e in cutlass.range_constexpr(n):
                # round the attention output first, then the fp32 gate product
                o = (acc_o[e] * inv[slot_of(cO0[e][1])]).to(mO.element_type)
                ov[e] = (o.to(Float32) * sigmoid(gv[e].to(Float32))).to(mO.element_type)
            for e in cutlass.range_constexpr(n):
                token, head, live = self.out_row(mO, row, kv_head, cO[e][1])
                if live:
                    mO[token, head, self.physical_d(cO0[e][0], cO[e][0] - cO0[e][0])] = ov[e]


def __getattr__(name):
    # Host-side names that moved to cute_kernels.plans.sm90_qsa, still imported by the lab scripts
    # under profiling/ until the benchmark tool moves into the package (see
    # tests/cpu/test_architecture.py, ALLOWED_UPWARD), resolved only when asked for.
    if name in ('select_config',):
        from ..plans import sm90_qsa

        return getattr(sm90_qsa, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
