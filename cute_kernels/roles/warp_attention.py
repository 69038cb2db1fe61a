"""Attention of one CTA's query rows against a stream of K/V tiles on warp-level MMA
(``mma.sync`` m16n8k16, A and B from ``ldmatrix``): the shared engine of the SM80-class decode and
prefill kernels (design: docs/design/sm80.md).

Orientation: S = Q·Kᵀ with the query rows on M and the KV tokens on N, O = P·V with P taken
straight from S's accumulator registers (the m16n8 C fragment of two adjacent token tiles is the
m16k16 A fragment), so P never goes through shared memory. Warps form a ``warps_m x warps_n``
grid: ``warps_m`` split the rows (``m_tiles`` 16-row tiles each), ``warps_n`` split each stage's
tokens (``tw`` each); every warp keeps its own online-softmax state, and the ``warps_n`` states
of a row merge once, at the end, through shared memory.

MMA operands are 16-bit: the cache's type for a 16-bit cache; fp16 for an FP8 cache (K/V widened
exactly by the SM90 kernels' helpers, :func:`.fragments.widen_e4m3x4` to fp16 with the bit trick,
values times 2^-8, or :func:`.fragments.cvt_e4m3x4_f16`) and for a bf16 query against an fp16 cache. A
bf16 query that enters an fp16 MMA is scaled per row by a power of two into fp16's range (exact;
the logits divide it out). FP8 K is widened from one ldmatrix register of four consecutive head
dims per lane group, so the query's columns are staged permuted the same way; FP8 V is read
transposed by pairs of bytes, which puts O's even and odd head dims in separate MMA tiles (each
thread then owns four consecutive dims of a 16-dim chunk).
"""


import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import warp
from cutlass.cutlass_dsl import dsl_user_op

from ..jit.dtypes import cute_dtype
from .cp_async_barriers import StageBarriers
from .cp_async_pages import PagedKVGather, swizzle, swizzle_period
from .fragments import (
    WIDEN_SHIFT_LOG2,
    cvt_e4m3x4_f16,
    ffma,
    ldmatrix_x4,
    q_permutation,
    store_shared_b32x4,
    widen_e4m3x4,
)

LOG2E = math.log2(math.e)
# the named barrier of pingpong's turns (0 is the CTA's)
PINGPONG_BARRIER = 1
FP16_TARGET_LOG2 = 14  # a row's largest |q| is scaled to [2^13, 2^16) for an fp16 MMA


@dsl_user_op
def turn_barrier(barrier_id: int, threads: int, *, loc=None, ip=None):
    """``barrier.cta.sync`` without ``.aligned``: the two halves reach the named barrier at two
    different instructions, which the aligned form (``bar.sync``) leaves undefined; synccheck reports
    it as divergent threads (docs/design/sm80.md#under-compute-sanitizer)."""
    nvvm.barrier_cta_sync(Int32(barrier_id).ir_value(loc=loc, ip=ip), thread_count=Int32(threads).ir_value(loc=loc, ip=ip),
                          aligned=False, loc=loc, ip=ip)


class RowsOnDemand:
    """Per-row values computed when read (``get(slot)``), where holding them in registers across
    the main loop would crowd the accumulators."""

    def __init__(self, get):
        self.get = get

    def __getitem__(self, slot):
        return self.get(slot)


class SharedRowStats:
    """The online-softmax max and sum of this thread's rows kept in shared memory between tiles
    (``stats_smem``): slots 0 and 1 of the per-row statistics, unused until the epilogue with one
    token warp. Values that cross the main loop's barrier cannot be hoisted into registers, so the
    loop carries O and nothing else per row (docs/design/sm80.md#64-token-stages-at-head-dim-128).
    The sum is the row's whole sum (reduced over the quad at every tile)."""

    def __init__(self, sStats, row_of):
        self.sStats = sStats
        self.row_of = row_of  # (m-tile, half) -> CTA row of this thread

    def max(self, mt, h):
        return self.sStats[0, self.row_of(mt, h)]

    def sum(self, mt, h):
        return self.sStats[1, self.row_of(mt, h)]

    def store(self, mt, h, row_max, row_sum):
        self.sStats[0, self.row_of(mt, h)] = row_max
        self.sStats[1, self.row_of(mt, h)] = row_sum


class WarpTileAttention:
    """Static configuration of the engine (all trace-time).

    ``q_dtype``/``kv_dtype``/``mma_dtype``: dtype names; ``widen``: "bits" or "cvt" (FP8 caches);
    ``warps_m``, ``warps_n``, ``m_tiles`` (16-row tiles per warp), ``tw`` (tokens per warp and
    stage, a multiple of 16); ``q_regs``: Q fragments loaded once into registers (else read from
    shared memory at every tile); ``ldsm_xor``: every ``ldmatrix`` address of an operand is one
    per-thread base XOR a constant (see :meth:`ldsm_address`); ``stats_smem``: each row's
    online-softmax max and sum live in shared memory between tiles (:class:`SharedRowStats`; one
    token warp only)."""

    def __init__(self, *, D: int, q_dtype: str, kv_dtype: str, mma_dtype: str, widen_method: str,
                 warps_m: int, warps_n: int, m_tiles: int, tw: int, q_regs: bool, ldsm_xor: bool = False,
                 stats_smem: bool = False, lean_softmax: bool = False, pingpong: bool = False,
                 ring_release: bool = False, ring_suspend: bool = False, q_loads_first: bool = False):
        self.D = D
        self.q_name, self.kv_name, self.mma_name = q_dtype, kv_dtype, mma_dtype
        self.fp8 = kv_dtype == "fp8_e4m3"
        self.mma_dtype = cute_dtype(mma_dtype)
        self.widen_method = widen_method
        self.row_scaled = q_dtype != mma_dtype  # bf16 query into an fp16 MMA
        self.warps_m, self.warps_n, self.m_tiles, self.tw = warps_m, warps_n, m_tiles, tw
        self.warps = warps_m * warps_n
        self.threads = 32 * self.warps
        self.rows = 16 * m_tiles * warps_m  # query rows of the CTA (padded)
        self.tile = tw * warps_n  # tokens per stage
        self.q_regs = q_regs
        self.ldsm_xor = ldsm_xor
        if stats_smem and warps_n != 1:
            raise ValueError("stats_smem keeps the row statistics in the slots of one token warp: warps_n must be 1")
        self.stats_smem = stats_smem
        # the max over the raw scores, one FFMA per score before its exp2, O's rescale skipped by a
        # warp whose rows' max did not move (docs/design/sm80.md#the-lean-softmax-opt-in)
        self.lean_softmax = lean_softmax
        # the second half of the warps starts a tile's QK once the first half's is issued, so that a
        # half's softmax overlaps the other's MMAs (docs/design/sm80.md#ping-pong-warps)
        if pingpong and (warps_m * warps_n != 8 or warps_n != 1):
            raise ValueError("pingpong pairs warp w with w + 4 on one scheduler: it needs 8x1 warps")
        self.pingpong = pingpong
        # ring_release: a stage's copies tracked by its own mbarrier instead of the per-tile CTA
        # barrier, so the turns alone pace the halves (docs/design/sm80.md#ping-pong-warps);
        # ring_suspend: the wait may suspend the thread (mbarrier.try_wait, SM90+)
        if ring_release and not pingpong:
            raise ValueError("ring_release frees a stage at the ping-pong turn: it needs pingpong")
        self.ring_release = ring_release
        self.ring = StageBarriers(2, self.threads, ring_suspend) if ring_release else None
        # 64-token stages in 128-row CTAs: the causal mask compares one per-row limit relative to
        # the tile (``limit - col0``) with immediates, which keeps that build within 255 registers
        # where the absolute compare spills it (docs/design/sm80.md#64-token-stages-at-head-dim-128)
        self.relative_mask = m_tiles > 1 and tw >= 64
        self.kv_bytes = 1 if self.fp8 else 2
        self.kv_row_bytes = D * self.kv_bytes
        self.q_row_bytes = D * 2
        # log2 of the factor the widened values are smaller than the e4m3 values by (bits: 2^-8)
        self.widen_log2 = WIDEN_SHIFT_LOG2["fp16"] if self.fp8 and widen_method == "bits" else 0
        self.atom_dtype = self.mma_dtype
        # every query load of the staging issued before the first is used, not one round trip per
        # 16-element item (docs/design/sm80.md#the-query-loads-at-once)
        self.q_loads_first = q_loads_first

    def widen(self, x, pair_tokens: bool):
        """(Traced.) Four e4m3 bytes of one ``ldmatrix`` register -> two fp16x2 registers. The bit
        trick pairs ``(b0, b2)``, ``(b1, b3)`` always; ``cvt`` pairs ``(b0, b1)``, ``(b2, b3)``, or
        ``(b0, b2)``, ``(b1, b3)`` with ``pair_tokens`` (V from ``ldmatrix.trans``: the two tokens
        of one head dim)."""
        if self.widen_method == "bits":
            return widen_e4m3x4(x, "fp16")
        return cvt_e4m3x4_f16(x, pair_tokens)

    # ---------------------------------------------------------------------------------------
    # shared-memory footprint (bytes; the kernel's storage struct and the plan use these)
    # ---------------------------------------------------------------------------------------

    @property
    def q_bytes(self) -> int:
        return self.rows * self.q_row_bytes

    @property
    def stats_bytes(self) -> int:
        return (self.warps_n * 2 + 1) * self.rows * 4

    @property
    def merge_bytes(self) -> int:
        return self.warps_n * self.rows * (self.D + 4) * 4

    # ---------------------------------------------------------------------------------------
    # Q staging
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def stage_q(self, mQ, row_token_head, row_valid, logit_scale, sq_base, sScale, tidx):
        """Rows of the CTA -> shared memory (swizzled, in the MMA dtype, FP8: columns permuted)
        and each row's logit multiplier ``logit_scale * 2^-e_row`` (log2 units) -> ``sScale``.
        ``row_token_head(r)`` gives the (token, head) of row r; ``row_valid(r)`` whether it is a
        real query row (padding rows are zeros). 16 consecutive elements per work item; the
        items of a row are held by adjacent lanes, which reduce the row's max |q| by shuffles."""
        D = self.D
        blocks = D // 16
        work = self.rows * blocks
        iters = (work + self.threads - 1) // self.threads
        raws = []
        if const_expr(self.q_loads_first):  # no branch around a load: ptxas issues them all at once
            for it in cutlass.range_constexpr(iters):
                idx = it * self.threads + tidx
                q_row = idx // blocks
                q_token, q_head = row_token_head(q_row)
                ok = idx < work and row_valid(q_row)
                raw = cute.make_rmem_tensor((16,), mQ.element_type)
                raw.store(cute.local_tile(mQ[q_token if ok else Int32(0), q_head if ok else Int32(0), None], (16,),
                                          (idx % blocks,)).load())
                raws.append((raw, ok))
        for it in cutlass.range_constexpr(iters):
            idx = it * self.threads + tidx
            r = idx // blocks
            c = idx % blocks
            vals = cute.make_rmem_tensor((16,), Float32)
            vals.fill(0.0)
            if const_expr(self.q_loads_first):
                if raws[it][1]:  # a padding row or item read row 0: zeros instead
                    vals.store(raws[it][0].load().to(Float32))
            else:
                if idx < work:
                    if row_valid(r):
                        token, head = row_token_head(r)
                        vals.store(cute.local_tile(mQ[token, head, None], (16,), (c,)).load().to(Float32))
            e_shift = Int32(0)
            if const_expr(self.row_scaled):
                amax = Float32(0.0)
                for k in cutlass.range_constexpr(16):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(vals[k], -vals[k]))
                off = 1
                while off < blocks:  # the row's items sit in `blocks` adjacent lanes
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, off))
                    off *= 2
                if amax > Float32(0.0):
                    # within one of floor(log2 amax): the row lands in [2^13, 2^16), inside fp16
                    e = Int32(cute.math.log2(amax, fastmath=True))
                    e_shift = cutlass.min(cutlass.max(Int32(FP16_TARGET_LOG2) - e, Int32(-100)), Int32(100))
            scale = cute.math.exp2(Float32(e_shift), fastmath=False)
            packed = cute.make_rmem_tensor((16,), self.mma_dtype)
            for k in cutlass.range_constexpr(16):
                src = q_permutation(k, self.widen_method) if const_expr(self.fp8) else k
                packed[k] = (vals[src] * scale).to(self.mma_dtype)
            if idx < work:
                words = cute.recast_tensor(packed, Int32)
                if const_expr(self.ldsm_xor):
                    store_shared_b32x4(sq_base + self.q_blocked(r, c, 0), words[0], words[1], words[2], words[3])
                    store_shared_b32x4(sq_base + self.q_blocked(r, c, 1), words[4], words[5], words[6], words[7])
                else:
                    base = r * self.q_row_bytes + c * 32
                    store_shared_b32x4(sq_base + self.q_swizzle(base), words[0], words[1], words[2], words[3])
                    store_shared_b32x4(sq_base + self.q_swizzle(base + 16), words[4], words[5], words[6], words[7])
                if c == 0:
                    sScale[r] = logit_scale * cute.math.exp2(-Float32(e_shift), fastmath=False)

    # ---------------------------------------------------------------------------------------
    # per-warp state
    # ---------------------------------------------------------------------------------------

    def make_state(self):
        """(Traced.) Accumulators and softmax state of one thread: O (zeroed), S, Q fragments,
        running max (-inf) and sum (0) of its 2 * m_tiles rows."""
        mt, nt = self.m_tiles, self.tw // 8
        # O in 16-dim chunks (two n8 tiles each), one tensor per chunk: each P·V MMA then
        # accumulates into a whole tensor in place (no register copies around a sliced view)
        acc_o = [cute.make_rmem_tensor(((2, 2), mt, 2), Float32) for _ in range(self.D // 16)]
        for chunk in acc_o:
            chunk.fill(0.0)
        acc_s = cute.make_rmem_tensor(((2, 2), mt, nt), Float32)
        tSrQ = cute.make_rmem_tensor(((2, 2, 2), mt, self.D // 16 if self.q_regs else 1), self.mma_dtype)
        row_max = cute.make_rmem_tensor((2 * mt,), Float32)
        row_sum = cute.make_rmem_tensor((2 * mt,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return acc_o, acc_s, tSrQ, row_max, row_sum

    @cute.jit
    def row_setup(self, sScale, wm, lane, row_limit):
        """This thread's rows' logit multipliers (from :meth:`stage_q`) and visibility limits
        (``row_limit(r)``: tokens ``< limit`` are visible to CTA row r)."""
        if const_expr(self.m_tiles > 1):
            # two tiles per warp: read per tile, not 4 m_tiles registers held across the main loop
            return (RowsOnDemand(lambda slot: sScale[self.thread_row(wm, lane, slot // 2, slot % 2)]),
                    RowsOnDemand(lambda slot: row_limit(self.thread_row(wm, lane, slot // 2, slot % 2))))
        slots = 2 * self.m_tiles
        row_scale = cute.make_rmem_tensor((slots,), Float32)
        limits = cute.make_rmem_tensor((slots,), Int32)
        for mt in cutlass.range_constexpr(self.m_tiles):
            for h in cutlass.range_constexpr(2):
                r = self.thread_row(wm, lane, mt, h)
                row_scale[2 * mt + h] = sScale[r]
                limits[2 * mt + h] = row_limit(r)
        return row_scale, limits

    def storage(self, kv_region: int):
        """(Traced.) Shared storage: the K/V ring (the fp32 merge rows overlay it), the staged Q
        rows, per-row statistics and logit scales."""

        @cute.struct
        class Storage:
            kv: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, kv_region], 1024]
            q: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.q_bytes], 1024]
            stats: cute.struct.MemRange[Float32, (2 * self.warps_n + 1) * self.rows]
            scale: cute.struct.MemRange[Float32, self.rows]

        if self.ring_release:
            @cute.struct
            class RingStorage:  # the stages' full barriers, outside the ring that sO overlays
                kv: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, kv_region], 1024]
                q: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.q_bytes], 1024]
                stats: cute.struct.MemRange[Float32, (2 * self.warps_n + 1) * self.rows]
                scale: cute.struct.MemRange[Float32, self.rows]
                full: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, self.ring.stages], 8]

            return RingStorage
        return Storage

    def thread_row(self, wm, lane, mt, h):
        """(Traced.) CTA row of this thread's row slot (m-tile ``mt``, half ``h``)."""
        return (wm * self.m_tiles + mt) * 16 + lane // 4 + 8 * h

    def kv_swizzle(self, byte_offset):
        """(Traced.) :func:`swizzle` of an offset into a staged K or V tile."""
        return swizzle(byte_offset, self.kv_row_bytes)

    def q_swizzle(self, byte_offset):
        """(Traced.) :func:`swizzle` of an offset into the staged Q rows (not k-blocked)."""
        return swizzle(byte_offset, self.q_row_bytes)

    def ldsm_lane(self, lane, row_bytes: int, rows_by_mi_low: bool):
        """(Traced.) Swizzled offset of this lane's ``ldmatrix`` row within a 16-row block at
        column block 0: row ``lane % 8`` of matrix ``mi = lane // 8``, whose row half (8 rows) and
        column half (16 bytes) come from ``mi % 2`` and ``mi // 2`` (``rows_by_mi_low``) or the
        other way round."""
        mi = lane // 8
        rh, ch = (mi % 2, mi // 2) if rows_by_mi_low else (mi // 2, mi % 2)
        return swizzle((rh * 8 + lane % 8) * row_bytes + ch * 16, row_bytes)

    def ldsm_address(self, base, row_bytes: int, rows16: int, col_bytes: int):
        """(Traced.) ``base`` (a 1024-byte aligned region plus :meth:`ldsm_lane`, plus whole
        16-row blocks) moved by ``rows16`` 16-row blocks and ``col_bytes`` (a multiple of 32,
        below ``row_bytes``). The swizzle is linear over XOR, and neither a 16-row block (whole
        swizzle periods) nor the region base touches the bits it mixes, so the
        column step is one XOR with a constant and the row step an immediate: an operand needs
        one live register, not one per address (docs/design/sm80.md#128-row-ctas)."""
        assert (16 * row_bytes) % swizzle_period(row_bytes) == 0 and col_bytes % 32 == 0 and col_bytes < row_bytes
        return (base ^ swizzle(col_bytes, row_bytes)) + rows16 * 16 * row_bytes

    def q_blocked(self, r, kb, half):
        """(Traced or int.) Byte offset of the 16-byte half ``half`` of row ``r``'s 16 columns of
        k-block ``kb`` in the k-blocked Q layout of ``ldsm_xor``: each k-block's 32-byte row
        pieces contiguous (so a k-step, like a 16-row step, is an immediate offset), the halves
        swapped in rows with bit 2 set (the 8 rows an ``ldmatrix`` reads then cover all 8
        16-byte bank groups)."""
        return kb * (self.rows * 32) + r * 32 + (half ^ ((r >> 2) & 1)) * 16

    def kv_lane(self, stage_base, wn, lane, rows_by_mi_low: bool):
        """(Traced.) :meth:`ldsm_address` base of this lane in the K or V tile at ``stage_base``
        (this warp's ``tw`` tokens)."""
        return stage_base + wn * (self.tw * self.kv_row_bytes) + self.ldsm_lane(lane, self.kv_row_bytes,
                                                                                 rows_by_mi_low)

    @cute.jit
    def load_q_fragment(self, tSrQ, sq_base, wm, lane, kb, slot):
        """A fragments of k-block ``kb`` for all this warp's m-tiles into ``tSrQ[..., slot]``."""
        regs = cute.recast_tensor(tSrQ, Int32)
        mi = lane // 8
        for mt in cutlass.range_constexpr(self.m_tiles):
            if const_expr(self.ldsm_xor):
                q_lane = sq_base + self.q_blocked((wm * self.m_tiles) * 16 + (mi % 2) * 8 + lane % 8, 0, mi // 2)
                r = ldmatrix_x4(q_lane + self.q_blocked(mt * 16, kb, 0), False)
            else:
                row = (wm * self.m_tiles + mt) * 16 + (mi % 2) * 8 + lane % 8
                col = kb * 16 + (mi // 2) * 8
                r = ldmatrix_x4(sq_base + self.q_swizzle(row * self.q_row_bytes + col * 2), False)
            for j in cutlass.range_constexpr(4):
                regs[j + 4 * mt + 4 * self.m_tiles * slot] = r[j]

    @cute.jit
    def load_q_all(self, tSrQ, sq_base, wm, lane):
        if const_expr(self.q_regs):
            for kb in cutlass.range_constexpr(self.D // 16):
                self.load_q_fragment(tSrQ, sq_base, wm, lane, kb, kb)

    @cute.jit
    def qk(self, acc_s, tSrQ, sq_base, k_base, wm, wn, lane):
        """S = Q Kᵀ of this warp's rows and its ``tw`` tokens of the stage at ``k_base``."""
        atom = cute.make_mma_atom(warp.MmaF16BF16Op(self.mma_dtype, Float32, (16, 8, 16)))
        nt = self.tw // 8
        mi = lane // 8
        acc_s.fill(0.0)
        if const_expr(self.fp8):
            bK = cute.make_rmem_tensor(((2, 2), nt, 2), self.mma_dtype)
            regs = cute.recast_tensor(bK, Int32)
            for kb2 in cutlass.range_constexpr(self.D // 32):
                for n16 in cutlass.range_constexpr(self.tw // 16):
                    if const_expr(self.ldsm_xor):
                        r = ldmatrix_x4(self.ldsm_address(self.kv_lane(k_base, wn, lane, True), self.kv_row_bytes,
                                                          n16, kb2 * 32), False)
                    else:
                        row = wn * self.tw + n16 * 16 + (mi % 2) * 8 + lane % 8
                        col = kb2 * 32 + (mi // 2) * 16
                        r = ldmatrix_x4(k_base + self.kv_swizzle(row * self.kv_row_bytes + col), False)
                    for j in cutlass.range_constexpr(4):
                        lo, hi = self.widen(r[j], False)
                        base = 2 * (2 * n16 + j % 2) + 2 * nt * (j // 2)
                        regs[base] = lo
                        regs[base + 1] = hi
                for kk in cutlass.range_constexpr(2):
                    kb = 2 * kb2 + kk
                    self.gemm_qk(atom, acc_s, tSrQ, bK, sq_base, wm, lane, kb, kk)
        else:
            bK = cute.make_rmem_tensor(((2, 2), nt, 1), self.mma_dtype)
            regs = cute.recast_tensor(bK, Int32)
            for kb in cutlass.range_constexpr(self.D // 16):
                for n16 in cutlass.range_constexpr(self.tw // 16):
                    if const_expr(self.ldsm_xor):
                        r = ldmatrix_x4(self.ldsm_address(self.kv_lane(k_base, wn, lane, False), self.kv_row_bytes,
                                                          n16, kb * 32), False)
                    else:
                        row = wn * self.tw + n16 * 16 + (mi // 2) * 8 + lane % 8
                        col = kb * 16 + (mi % 2) * 8
                        r = ldmatrix_x4(k_base + self.kv_swizzle(row * self.kv_row_bytes + col * 2), False)
                    for j in cutlass.range_constexpr(4):
                        regs[2 * (2 * n16 + j // 2) + j % 2] = r[j]
                self.gemm_qk(atom, acc_s, tSrQ, bK, sq_base, wm, lane, kb, 0)

    @cute.jit
    def gemm_qk(self, atom, acc_s, tSrQ, bK, sq_base, wm, lane, kb, kk):
        if const_expr(self.q_regs):
            cute.gemm(atom, acc_s, tSrQ[None, None, kb], bK[None, None, kk], acc_s)
        else:
            self.load_q_fragment(tSrQ, sq_base, wm, lane, kb, 0)
            cute.gemm(atom, acc_s, tSrQ[None, None, 0], bK[None, None, kk], acc_s)

    @cute.jit
    def softmax(self, acc_s, acc_o, row_max, row_sum, row_scale, limits, tile_start, masked, wn, lane,
                stats=None):
        """Online softmax of the tile in ``acc_s`` (scaled by each row's ``row_scale`` into log2
        units, tokens at or past a row's ``limits`` masked to -inf when ``masked``), leaving
        P = exp2(s - max) in ``acc_s`` and rescaling ``acc_o`` and ``row_sum`` (or the
        :class:`SharedRowStats` ``stats``). A row whose max is still -inf shifts by 0, so
        exp2(-inf) = 0 and no inf - inf."""
        mt_n, nt = self.m_tiles, self.tw // 8
        col0 = tile_start + wn * self.tw + 2 * (lane % 4)
        if const_expr(stats is not None):
            new_stats = cute.make_rmem_tensor((2 * mt_n, 2), Float32)
        # the lean softmax with the statistics in shared memory votes once for the warp's row slots,
        # after the exponentials: one branch where a vote per slot cuts the tile into four, which
        # keeps the 64-token 128-row BF16 builds within 255 registers (docs/design/sm80.md#in-the-64-token-form)
        one_vote = self.lean_softmax and stats is not None
        if const_expr(one_vote):
            alphas = cute.make_rmem_tensor((2 * mt_n,), Float32)
        for mt in cutlass.range_constexpr(mt_n):
            for h in cutlass.range_constexpr(2):
                slot = 2 * mt + h
                scale, limit = row_scale[slot], limits[slot]
                rel = limit - col0 if const_expr(self.relative_mask) else limit
                tmax = -Float32.inf
                for n in cutlass.range_constexpr(nt):
                    for e in cutlass.range_constexpr(2):
                        i = 2 * h + e + 4 * mt + 4 * mt_n * n
                        s = acc_s[i] if const_expr(self.lean_softmax) else acc_s[i] * scale
                        if masked:
                            if const_expr(self.relative_mask):
                                hidden = rel <= 8 * n + e
                            else:
                                hidden = col0 + 8 * n + e >= limit
                            if hidden:
                                s = -Float32.inf
                        acc_s[i] = s
                        tmax = cute.arch.fmax(tmax, s)
                tmax = cute.arch.fmax(tmax, cute.arch.shuffle_sync_bfly(tmax, 1))
                tmax = cute.arch.fmax(tmax, cute.arch.shuffle_sync_bfly(tmax, 2))
                if const_expr(self.lean_softmax):
                    tmax = tmax * scale  # the max of the scaled scores (scale > 0); -inf stays -inf
                if const_expr(stats is None):
                    new_max = cute.arch.fmax(row_max[slot], tmax)
                    safe = new_max if new_max != -Float32.inf else Float32(0.0)
                    alpha = cute.math.exp2(row_max[slot] - safe, fastmath=True)
                    row_max[slot] = new_max
                    total = row_sum[slot] * alpha
                else:
                    old_max = stats.max(mt, h)
                    new_max = cute.arch.fmax(old_max, tmax)
                    safe = new_max if new_max != -Float32.inf else Float32(0.0)
                    alpha = cute.math.exp2(old_max - safe, fastmath=True)
                    new_stats[slot, 0] = new_max
                    total = Float32(0.0)
                if const_expr(one_vote):
                    alphas[slot] = alpha
                elif const_expr(self.lean_softmax):
                    # alpha <= 1, and exactly 1 where the max did not move: o * 1 = o, so a warp
                    # with every row's alpha 1 skips the rescale bit-identically
                    if cute.arch.vote_any_sync(alpha < Float32(1.0)):
                        self.rescale_rows(acc_o, alpha, mt, h)
                else:
                    self.rescale_rows(acc_o, alpha, mt, h)
                neg = -safe
                for n in cutlass.range_constexpr(nt):
                    for e in cutlass.range_constexpr(2):
                        i = 2 * h + e + 4 * mt + 4 * mt_n * n
                        if const_expr(self.lean_softmax):
                            p = cute.math.exp2(ffma(acc_s[i], scale, neg), fastmath=True)
                        else:
                            p = cute.math.exp2(acc_s[i] - safe, fastmath=True)
                        total = total + p
                        acc_s[i] = p
                if const_expr(stats is None):
                    row_sum[slot] = total
                else:
                    total = total + cute.arch.shuffle_sync_bfly(total, 1)
                    total = total + cute.arch.shuffle_sync_bfly(total, 2)
                    new_stats[slot, 1] = stats.sum(mt, h) * alpha + total
        if const_expr(one_vote):
            lowest = alphas[0]
            for slot in cutlass.range_constexpr(1, 2 * mt_n):
                lowest = cute.arch.fmin(lowest, alphas[slot])
            if cute.arch.vote_any_sync(lowest < Float32(1.0)):
                for slot in cutlass.range_constexpr(2 * mt_n):
                    self.rescale_rows(acc_o, alphas[slot], slot // 2, slot % 2)
        if const_expr(stats is not None):
            cute.arch.sync_warp()  # every lane of a row's quad has read the old values
            for slot in cutlass.range_constexpr(2 * mt_n):
                stats.store(slot // 2, slot % 2, new_stats[slot, 0], new_stats[slot, 1])

    @cute.jit
    def rescale_rows(self, acc_o, alpha, mt, h):
        """O's accumulators of slot (``mt``, ``h``) times ``alpha``."""
        mt_n = self.m_tiles
        for n in cutlass.range_constexpr(self.D // 8):
            for e in cutlass.range_constexpr(2):
                i = 2 * h + e + 4 * mt + 4 * mt_n * (n % 2)
                acc_o[n // 2][i] = acc_o[n // 2][i] * alpha

    @cute.jit
    def pv(self, acc_o, acc_s, v_base, wn, lane):
        """O += P V for this warp's ``tw`` tokens of the stage at ``v_base``."""
        atom = cute.make_mma_atom(warp.MmaF16BF16Op(self.mma_dtype, Float32, (16, 8, 16)))
        mt_n = self.m_tiles
        kbs = self.tw // 16
        mi = lane // 8
        for kb in cutlass.range_constexpr(kbs):
            # P of these 16 tokens, converted here so that S's registers die as P's are made
            tOrP = cute.make_rmem_tensor(((2, 2, 2), mt_n, 1), self.mma_dtype)
            for mt in cutlass.range_constexpr(mt_n):
                for e in cutlass.range_constexpr(8):
                    tOrP[e + 8 * mt] = acc_s[e % 4 + 4 * mt + 4 * mt_n * (2 * kb + e // 4)].to(self.mma_dtype)
            row = wn * self.tw + kb * 16 + (mi % 2) * 8 + lane % 8
            if const_expr(self.fp8):
                for dc2 in cutlass.range_constexpr(self.D // 32):
                    if const_expr(self.ldsm_xor):
                        r = ldmatrix_x4(self.ldsm_address(self.kv_lane(v_base, wn, lane, True), self.kv_row_bytes,
                                                          kb, dc2 * 32), True)
                    else:
                        col = dc2 * 32 + (mi // 2) * 16
                        r = ldmatrix_x4(v_base + self.kv_swizzle(row * self.kv_row_bytes + col), True)
                    for half in cutlass.range_constexpr(2):  # 16-dim chunk 2 dc2 + half
                        bV = cute.make_rmem_tensor(((2, 2), 2, 1), self.mma_dtype)
                        regs = cute.recast_tensor(bV, Int32)
                        for j in cutlass.range_constexpr(2 * half, 2 * half + 2):
                            lo, hi = self.widen(r[j], True)
                            regs[j % 2] = lo  # even dims of the chunk
                            regs[2 + j % 2] = hi  # odd dims
                        cute.gemm(atom, acc_o[2 * dc2 + half], tOrP[None, None, 0], bV[None, None, 0],
                                  acc_o[2 * dc2 + half])
            else:
                for dc in cutlass.range_constexpr(self.D // 16):
                    if const_expr(self.ldsm_xor):
                        r = ldmatrix_x4(self.ldsm_address(self.kv_lane(v_base, wn, lane, True), self.kv_row_bytes,
                                                          kb, dc * 32), True)
                    else:
                        col = dc * 16 + (mi // 2) * 8
                        r = ldmatrix_x4(v_base + self.kv_swizzle(row * self.kv_row_bytes + col * 2), True)
                    bV = cute.make_rmem_tensor(((2, 2), 2, 1), self.mma_dtype)
                    regs = cute.recast_tensor(bV, Int32)
                    for j in cutlass.range_constexpr(4):
                        regs[2 * (j // 2) + j % 2] = r[j]
                    cute.gemm(atom, acc_o[dc], tOrP[None, None, 0], bV[None, None, 0], acc_o[dc])

    def o_dim(self, n: int, e: int, lane):
        """(Traced.) Head dim of O accumulator column (n-tile ``n``, element ``e`` of a pair)."""
        t = lane % 4
        if self.fp8:
            return 16 * (n // 2) + 4 * t + 2 * e + n % 2
        return 8 * n + 2 * t + e

    # ---------------------------------------------------------------------------------------
    # main loop and epilogue
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def prologue(self, issue, tile_of, n_tiles, stages: cutlass.Constexpr, kv_base, stage_bytes):
        """The ring's first ``stages - 1`` tiles' copies, one commit group each (empty past
        ``n_tiles``): :meth:`mainloop` issues them itself unless the kernel did first (``kv_first``:
        before staging Q, so that their latencies overlap)."""
        for s in cutlass.range_constexpr(stages - 1):
            if s < n_tiles:
                issue(tile_of(s), kv_base + s * stage_bytes)
            if const_expr(not self.ring_release):  # ring_release: the stages' barriers count them
                cute.arch.cp_async_commit_group()

    @cute.jit
    def loop_stats(self, sStats, wm, lane):
        """The :class:`SharedRowStats` of ``stats_smem`` (set to -inf and 0), else None."""
        stats = None
        if const_expr(self.stats_smem):
            stats = SharedRowStats(sStats, lambda mt, h: self.thread_row(wm, lane, mt, h))
            for slot in cutlass.range_constexpr(2 * self.m_tiles):
                stats.store(slot // 2, slot % 2, -Float32.inf, Float32(0.0))
            cute.arch.sync_warp()
        return stats

    @cute.jit
    def qk_in_turn(self, acc_s, tSrQ, sq_base, stage_base, wm, wn, lane):
        """:meth:`qk`, inside the ping-pong turn where ``pingpong``: the second half meets the first
        half on PINGPONG_BARRIER once the first half's QK is issued. A rendezvous of two unaligned
        syncs: with an arrive racecheck reports the ring's ordered accesses as races, and the aligned
        sync at two instructions is undefined (docs/design/sm80.md#under-compute-sanitizer)."""
        if const_expr(self.pingpong):
            if wm >= self.warps_m // 2:
                turn_barrier(PINGPONG_BARRIER, self.threads)
        self.qk(acc_s, tSrQ, sq_base, stage_base, wm, wn, lane)
        if const_expr(self.pingpong):
            if wm < self.warps_m // 2:
                turn_barrier(PINGPONG_BARRIER, self.threads)

    @cute.jit
    def mainloop(self, issue, tile_of, n_tiles, stages: cutlass.Constexpr, kv_base, stage_bytes, tile_bytes,
                 state, sq_base, row_scale, limits, min_limit, wm, wn, lane, sStats=None,
                 issued: cutlass.Constexpr = False):
        """Stream this CTA's ``n_tiles`` tiles (``tile_of(i)``: the i-th tile's index) through a
        ``stages``-deep cp.async ring: ``issue(tile, stage_address)`` starts a tile's copies;
        one commit group per tile, one barrier per tile (it also frees the stage that the next
        copies overwrite). ``sStats``: the per-row statistics (``stats_smem`` keeps the running
        max and sum there). ``issued``: the kernel ran :meth:`prologue` already."""
        acc_o, acc_s, tSrQ, row_max, row_sum = state
        stats = self.loop_stats(sStats, wm, lane)
        if const_expr(not issued):
            self.prologue(issue, tile_of, n_tiles, stages, kv_base, stage_bytes)
        for i in cutlass.range(n_tiles, unroll=1):
            cute.arch.cp_async_wait_group(stages - 2)
            cute.arch.barrier()
            nxt = i + stages - 1
            if nxt < n_tiles:
                issue(tile_of(nxt), kv_base + (nxt % stages) * stage_bytes)
            cute.arch.cp_async_commit_group()
            tile = tile_of(i)
            stage_base = kv_base + (i % stages) * stage_bytes
            self.qk_in_turn(acc_s, tSrQ, sq_base, stage_base, wm, wn, lane)
            masked = (tile + 1) * self.tile > min_limit
            self.softmax(acc_s, acc_o, row_max, row_sum, row_scale, limits, tile * self.tile, masked, wn, lane,
                         stats)
            self.pv(acc_o, acc_s, stage_base + tile_bytes, wn, lane)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def init_ring(self, full_base, tidx):
        """``ring_release``: the stages' full barriers (one thread), before the CTA barrier that
        follows the query's staging (no thread arrives before it)."""
        self.ring.init(full_base, tidx)

    @cute.jit
    def released_mainloop(self, issue, tile_of, n_tiles, kv_base, stage_bytes, tile_bytes, state, sq_base,
                          row_scale, limits, min_limit, wm, wn, lane, sStats, full_base, issued: cutlass.Constexpr):
        """The ping-pong main loop with the stages released at the turn (``ring_release``): every
        thread waits on the full barrier of the tile it reads, and no CTA barrier re-aligns the
        halves, so the first half's QK of tile i + 1 may overlap the second half's PV of tile i
        (docs/design/sm80.md#ping-pong-warps). Two stages: tiles 0 and 1 are issued here (tile 0
        before the query was staged under ``issued``), tile i + 1 at tile i's turn, where both halves
        are past their PV of tile i - 1, the stage's last reader. Every issued tile is waited for by
        every thread, so no copy is in flight after the loop (the epilogue overlays the ring).
        ``full_base``: the stages' barriers (:meth:`init_ring`); otherwise :meth:`mainloop`'s
        arguments."""
        acc_o, acc_s, tSrQ, row_max, row_sum = state
        stats = self.loop_stats(sStats, wm, lane)
        if n_tiles > 0:
            if const_expr(not issued):
                issue(tile_of(0), kv_base)
            self.ring.arrive(full_base, 0)
        if n_tiles > 1:
            issue(tile_of(1), kv_base + stage_bytes)
            self.ring.arrive(full_base, 1)
        for i in cutlass.range(n_tiles, unroll=1):
            self.ring.wait(full_base, i)
            tile = tile_of(i)
            stage_base = kv_base + (i % 2) * stage_bytes
            self.qk_in_turn(acc_s, tSrQ, sq_base, stage_base, wm, wn, lane)
            nxt = i + 1
            if nxt < n_tiles:
                if i > 0:  # tile 1 came before the loop
                    issue(tile_of(nxt), kv_base + (nxt % 2) * stage_bytes)
                    self.ring.arrive(full_base, nxt % 2)
            masked = (tile + 1) * self.tile > min_limit
            self.softmax(acc_s, acc_o, row_max, row_sum, row_scale, limits, tile * self.tile, masked, wn, lane,
                         stats)
            self.pv(acc_o, acc_s, stage_base + tile_bytes, wn, lane)

    @cute.jit
    def finish(self, state, sO, sStats, wm, wn, lane, v_scale):
        """Merge the ``warps_n`` partial states of every row and leave the normalized output
        (times ``v_scale`` and the widening factor) in ``sO[wn, row, d]`` (fp32, one slice per
        ``wn``; :meth:`output_chunk` sums them) and each row's base-2 LSE in
        ``sStats[2 * warps_n, row]``. ``sO`` overlays the K/V stages: every warp must be past
        the main loop, which the barrier here ensures."""
        acc_o, acc_s, tSrQ, row_max, row_sum = state
        mt_n, WN = self.m_tiles, self.warps_n
        if const_expr(self.stats_smem):
            cute.arch.sync_warp()
            for s in cutlass.range_constexpr(2 * mt_n):  # sums reduced over the quad already
                row_max[s] = sStats[0, self.thread_row(wm, lane, s // 2, s % 2)]
                row_sum[s] = sStats[1, self.thread_row(wm, lane, s // 2, s % 2)]
        else:
            for s in cutlass.range_constexpr(2 * mt_n):
                v = row_sum[s]
                v = v + cute.arch.shuffle_sync_bfly(v, 1)
                v = v + cute.arch.shuffle_sync_bfly(v, 2)
                row_sum[s] = v
        if const_expr(WN > 1):
            if lane % 4 == 0:
                for mt in cutlass.range_constexpr(mt_n):
                    for h in cutlass.range_constexpr(2):
                        r = self.thread_row(wm, lane, mt, h)
                        sStats[2 * wn, r] = row_max[2 * mt + h]
                        sStats[2 * wn + 1, r] = row_sum[2 * mt + h]
        cute.arch.barrier()
        out_scale = v_scale * Float32(2.0 ** self.widen_log2)
        for mt in cutlass.range_constexpr(mt_n):
            for h in cutlass.range_constexpr(2):
                slot = 2 * mt + h
                r = self.thread_row(wm, lane, mt, h)
                m_all = row_max[slot]
                total = row_sum[slot]
                if const_expr(WN > 1):
                    for w in cutlass.range_constexpr(WN):
                        m_all = cute.arch.fmax(m_all, sStats[2 * w, r])
                safe = m_all if m_all != -Float32.inf else Float32(0.0)
                if const_expr(WN > 1):
                    total = Float32(0.0)
                    for w in cutlass.range_constexpr(WN):
                        total = total + sStats[2 * w + 1, r] * cute.math.exp2(sStats[2 * w, r] - safe, fastmath=True)
                factor = Float32(0.0)
                lse = -Float32.inf
                if total > Float32(0.0):
                    factor = cute.math.exp2(row_max[slot] - safe, fastmath=True) * out_scale / total
                    lse = safe + cute.math.log2(total, fastmath=True)
                if wn == 0:
                    if lane % 4 == 0:
                        sStats[2 * WN, r] = lse
                for n in cutlass.range_constexpr(self.D // 8):
                    for e in cutlass.range_constexpr(2):
                        val = acc_o[n // 2][2 * h + e + 4 * mt + 4 * mt_n * (n % 2)]
                        sO[self.o_dim(n, e, lane), r, wn] = val * factor
        cute.arch.barrier()

    @cute.jit
    def output_chunk(self, sO, r, d0):
        """Four output dims ``d0 .. d0 + 3`` of row ``r``, summed over the ``warps_n`` slices."""
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        for w in cutlass.range_constexpr(self.warps_n):
            for e in cutlass.range_constexpr(4):
                acc[e] = acc[e] + sO[d0 + e, r, w]
        return acc

    def o_layout(self):
        """(Traced.) Layout of the fp32 merge rows ``(d, row, wn)``: rows padded by 4 floats."""
        return cute.make_layout((self.D, self.rows, self.warps_n), stride=(1, self.D + 4, (self.D + 4) * self.rows))

    def stats_layout(self):
        """(Traced.) ``(2 * warps_n + 1, rows)``: per wn slice max and sum, then the LSE."""
        return cute.make_layout((2 * self.warps_n + 1, self.rows), stride=(self.rows, 1))


def engine_for(cfg):
    """``(engine, gather, ring bytes)`` of a portable kernel's config: the attention engine, the
    page gather of its stages, and the shared memory of the K/V ring (which the fp32 merge rows
    overlay after the main loop)."""
    engine = WarpTileAttention(
        D=cfg.head_dim, q_dtype=cfg.q_dtype, kv_dtype=cfg.kv_dtype, mma_dtype=cfg.mma_dtype, widen_method=cfg.widen,
        warps_m=cfg.warps_m, warps_n=cfg.warps_n, m_tiles=cfg.m_tiles, tw=cfg.tw, q_regs=cfg.q_regs,
        ldsm_xor=cfg.ldsm_xor, stats_smem=cfg.stats_smem, lean_softmax=cfg.lean_softmax,
        pingpong=getattr(cfg, "pingpong", False), ring_release=getattr(cfg, "ring_release", False),
        ring_suspend=getattr(cfg, "ring_suspend", False), q_loads_first=getattr(cfg, "q_loads_first", False),
    )
    gather = PagedKVGather(engine.tile, cfg.head_dim, engine.kv_bytes, engine.threads, cfg.page_size,
                           one_base=cfg.gather_one_base)
    ring = cfg.stages * gather.stage_bytes
    if engine.rows > 64:
        # 128 rows (two tiles per warp, or eight warps) double the merge rows; Q, dead after the
        # main loop, lies right after the ring (both 1024-byte aligned), so the merge rows overlay
        # both (the plan's smem_bytes)
        return engine, gather, (max(ring, engine.merge_bytes - engine.q_bytes) + 1023) // 1024 * 1024
    return engine, gather, max(ring, engine.merge_bytes)
