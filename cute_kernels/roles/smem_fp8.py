"""FP8 tiles rewritten in shared memory for a 16-bit or an e4m3 WGMMA, the query narrowed to fp16,
and P packed into WGMMA A fragments.

- **Widening** (16-bit query, FP8 cache): an e4m3 tile (token, d) TMA'd into a staging buffer is
  converted exactly to fp16 (``cvt.rn.f16x2.e4m3x2``: e4m3 values are all fp16 values) into the
  swizzled 16-bit K tile (token, d) or V tile (d-contiguous), 16 bytes in, 32 bytes out.
- **Transposing** (FP8 query, the opt-out ``vt_transpose="words"``): FP8 WGMMA reads both operands
  K-major, so P·V needs V^T with the tokens contiguous. Four 4-byte words (4 tokens x 4 dims) are
  byte-transposed with 8 ``prmt`` and stored as 4 words (4 dims x 4 tokens). The tokens inside
  each 32-token block are stored in the order P's accumulator registers hold them (:func:`p_token`),
  so P needs no shuffles.
- **Narrowing** (bf16 query with widened K/V): each query row is scaled by a power of two that
  puts its largest element in [2^14, 2^15) and rounded to fp16 in place; the exponent goes to
  shared memory and divides the row's logits back out.
- **Transposing by matrices** (the FP8 query's default, ``vt_transpose="ldsm"``): the same V^T
  bytes. ``ldmatrix.trans`` moves 16-bit elements, so it transposes (token, dim-pair) and a lane
  gets two tokens x two dims per register; one ``prmt`` per output word splits the dims and joins
  two registers' tokens (:func:`ldsm_unit`), and ``stmatrix`` writes the words: 16 bytes per lane
  per instruction instead of 4.
- Positions at or past the request's KV (``valid`` rows of a tile) are written as zeros: their
  cache bytes are stale, and 0 x NaN would reach the output through P·V.

Design: docs/design/sm90-prefill.md#fp8.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op

from ..jit.asm import asm
from .fragments import ldmatrix_x4, stmatrix_x4, store_shared_b32x4

# the query rows' fp16 exponent shift is clamped to this range (an all-zero row gets 0)
Q_SHIFT_MIN, Q_SHIFT_MAX = -100, 100
# FP8 P is stored as e4m3(P * 2^P_SHIFT): P <= 1 uses e4m3's range up to 256 (max 448)
P_SHIFT = 8


def p_token(k: int) -> int:
    """The token (within a 32-token block) whose P value sits at logical K index ``k`` of an e4m3
    A fragment when the fragment is filled straight from the QK accumulator: a thread's
    accumulator holds columns ``8 j + 2 t + {0, 1}``, its A fragment K indices ``16 h + 4 t +
    {0..3}``."""
    h, q = divmod(k, 16)
    t, j = divmod(q, 4)
    return 16 * h + 8 * (j // 2) + 2 * t + j % 2


# ---- addresses ---------------------------------------------------------------------------------


def smem_offset(crd, layout, elem_bytes: int):
    """(Traced.) Byte offset of ``crd`` in a swizzled shared-memory layout (a ComposedLayout from
    ``make_smem_layout_a/b``). Its swizzle acts on *byte* addresses, as the DSL's swizzled tensors
    and the TMA / WGMMA swizzle modes apply it: ``crd2idx`` of the composed layout would apply it
    to element indices, which is wrong for 16-bit elements."""
    off = cute.crd2idx(crd, layout.outer) * elem_bytes
    sw = layout.inner
    mask = ((1 << sw.num_bits) - 1) << sw.num_base
    return off ^ ((off >> sw.num_shift) & mask)


# ---- inline PTX -------------------------------------------------------------------------------


@dsl_user_op
def ld_shared_v4(addr: Int32, *, loc=None, ip=None):
    """``ld.shared.v4.b32`` (volatile: it stays behind the barrier wait that publishes the data)."""
    regs = asm([T.i32()] * 4, [Int32(addr)], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
               side_effects=True, loc=loc, ip=ip)
    return tuple(Int32(r) for r in regs)


@dsl_user_op
def ld_shared_b32(addr: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(asm([T.i32()], [Int32(addr)], "ld.shared.b32 $0, [$1];", "=r,r", side_effects=True, loc=loc,
                     ip=ip))


@dsl_user_op
def st_shared_b32(addr: Int32, a: Int32, *, loc=None, ip=None):
    asm([], [Int32(addr), Int32(a)], "st.shared.b32 [$0], $1;", "r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def e4m3x4_to_f16x4(x: Int32, *, loc=None, ip=None):
    """Four e4m3 bytes (element 0 lowest) -> two f16x2 words, in order."""
    text = ("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, $2;\n\t"
            "cvt.rn.f16x2.e4m3x2 $0, l;\n\tcvt.rn.f16x2.e4m3x2 $1, h;\n\t}")
    lo, hi = asm([T.i32(), T.i32()], [Int32(x)], text, "=r,=r,r", loc=loc, ip=ip)
    return Int32(lo), Int32(hi)


# byte selectors of the 4 x 4 byte transpose: interleave the bytes of two words (low / high pairs),
# then the 16-bit halves of two interleaved words (emulated in tests/cpu/test_prefill_plan.py)
PRMT_BYTES = (0x5140, 0x7362)
PRMT_HALVES = (0x5410, 0x7632)


def transpose_block(b, groups: int):
    """Block ``b`` of a V^T transpose with ``groups = tile_n // 4``: ``(q, d0, tokens)``, the four
    tokens (within the tile) whose dims ``d0..d0+3`` become V^T K indices ``4q..4q+3``: the K index
    ``k`` holds token ``32 (k // 32) + p_token(k % 32)``. Pure arithmetic (traced or Python ints).

    The 32 lanes of a warp take 4 consecutive dim quads x 8 consecutive token groups: with the
    128/64-byte swizzles that is 2 shared-memory wavefronts per 4-byte load and per store (taking
    32 token groups of one dim quad instead, the loads of a 128-token tile cost 8)."""
    per_q = groups // 8
    q = ((b // 32) % per_q) * 8 + (b // 4) % 8
    d0 = ((b // 32 // per_q) * 4 + b % 4) * 4
    tok0 = (q // 8) * 32 + ((q % 8) // 4) * 16 + (q % 4) * 2
    return q, d0, (tok0, tok0 + 1, tok0 + 8, tok0 + 9)


@dsl_user_op
def transpose_bytes_4x4(w0: Int32, w1: Int32, w2: Int32, w3: Int32, *, loc=None, ip=None):
    """Byte ``i`` of word ``j`` -> byte ``j`` of word ``i``."""
    lo, hi = PRMT_BYTES
    h0, h1 = PRMT_HALVES
    text = ("{\n\t.reg .b32 a, b, c, d;\n\t"
            f"prmt.b32 a, $4, $5, {lo:#x};\n\tprmt.b32 b, $4, $5, {hi:#x};\n\t"
            f"prmt.b32 c, $6, $7, {lo:#x};\n\tprmt.b32 d, $6, $7, {hi:#x};\n\t"
            f"prmt.b32 $0, a, c, {h0:#x};\n\tprmt.b32 $1, a, c, {h1:#x};\n\t"
            f"prmt.b32 $2, b, d, {h0:#x};\n\tprmt.b32 $3, b, d, {h1:#x};\n\t}}")
    regs = asm([T.i32()] * 4, [Int32(w0), Int32(w1), Int32(w2), Int32(w3)], text, "=r,=r,=r,=r,r,r,r,r",
               loc=loc, ip=ip)
    return tuple(Int32(r) for r in regs)


@dsl_user_op
def pack_e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """Four fp32 -> e4m3 (round to nearest, saturating) packed with ``a`` in the lowest byte."""
    text = ("{\n\t.reg .b16 l, h;\n\tcvt.rn.satfinite.e4m3x2.f32 l, $2, $1;\n\t"
            "cvt.rn.satfinite.e4m3x2.f32 h, $4, $3;\n\tmov.b32 $0, {l, h};\n\t}")
    return Int32(asm([T.i32()], [Float32(a), Float32(b), Float32(c), Float32(d)], text, "=r,f,f,f,f", loc=loc,
                     ip=ip))


@dsl_user_op
def pack_16x2(a: Float32, b: Float32, dtype: str, *, loc=None, ip=None) -> Int32:
    """Two fp32 -> one bf16x2 / f16x2 word (round to nearest), ``a`` in the low half."""
    ty = "bf16x2" if dtype == "bf16" else "f16x2"
    return Int32(asm([T.i32()], [Float32(a), Float32(b)], f"cvt.rn.{ty}.f32 $0, $2, $1;", "=r,f,f", loc=loc,
                     ip=ip))


# ---- P as the PV WGMMA's A operand -------------------------------------------------------------


def p_fragment_map(qk_mma, pv_mma, tile_n: int, fp8: bool) -> list[int]:
    """(Trace time.) For each value of the PV A fragment, the index of the QK accumulator value
    that fills it (the same in every thread). 16-bit: P's columns in order; e4m3: column
    ``p_token(k)`` of its 32-block for logical K index ``k`` (V^T is stored in that order). Checked
    on four threads' static coordinates, so a layout the map does not fit fails the trace."""
    ident_s = cute.make_identity_tensor((64, tile_n))
    for t in (0, 1, 4, 37):
        cS = qk_mma.get_slice(t).partition_C(ident_s)
        cA = pv_mma.get_slice(t).partition_A(ident_s)
        where = {tuple(cS[e]): e for e in range(cute.size(cS))}
        out = []
        for i in range(cute.size(cA)):
            m, k = cA[i]
            col = (k // 32) * 32 + p_token(k % 32) if fp8 else k
            if (m, col) not in where:
                raise ValueError(f"P fragment value {i} ({m}, {k}) of thread {t} is not in its accumulator")
            out.append(where[(m, col)])
        if t == 0:
            first = out
        elif out != first:
            raise ValueError(f"thread {t} maps P differently from thread 0")
    per_reg = 4 if fp8 else 2
    cA = pv_mma.get_slice(0).partition_A(ident_s)
    for i in range(0, cute.size(cA), per_reg):  # a register holds consecutive K of one row
        m, k = cA[i]
        assert all(tuple(cA[i + j]) == (m, k + j) for j in range(per_reg)), "A register layout"
    return first


@cute.jit
def pack_p(acc_s: cute.Tensor, tOrP: cute.Tensor, pmap: cutlass.Constexpr, kind: cutlass.Constexpr):
    """P (fp32, in ``acc_s``) -> the A fragment ``tOrP``: bf16 / fp16 pairs, or e4m3 quads of
    ``P * 2^P_SHIFT`` (``"e4m3_scaled"``: P already carries the factor, from the softmax's exponent)."""
    regs = cute.recast_tensor(tOrP, Int32)
    if const_expr(kind in ("e4m3", "e4m3_scaled")):
        for r in cutlass.range_constexpr(cute.size(regs)):
            quad = [acc_s[pmap[4 * r + j]] for j in range(4)]
            if const_expr(kind == "e4m3"):
                quad = [x * Float32(2.0 ** P_SHIFT) for x in quad]
            regs[r] = pack_e4m3x4(*quad)
    else:
        for r in cutlass.range_constexpr(cute.size(regs)):
            regs[r] = pack_16x2(acc_s[pmap[2 * r]], acc_s[pmap[2 * r + 1]], kind)


# ---- tile rewrites (the producer warpgroup) ---------------------------------------------------


@cute.jit
def widen_tile(src_base: Int32, src_layout, src_stage, dst_base: Int32, dst_layout, dst_stage,
               token_major: cutlass.Constexpr, tile_n: cutlass.Constexpr, D: cutlass.Constexpr, valid, tid,
               nthreads: cutlass.Constexpr):
    """e4m3 (token, d) staging tile -> fp16 tile, (token, d) when ``token_major`` (K) else
    (d, token) (V); tokens ``>= valid`` become zeros."""
    chunks = D // 16
    # partly rolled: fully unrolled, ptxas keeps every chunk's swizzled addresses live (spills)
    for it in cutlass.range(tile_n * chunks // nthreads, unroll=2):
        c = it * nthreads + tid
        row = c // chunks
        col = (c % chunks) * 16
        w = ld_shared_v4(src_base + smem_offset((row, col, src_stage), src_layout, 1))
        out = cute.make_rmem_tensor((8,), Int32)
        for j in cutlass.range_constexpr(4):
            lo, hi = e4m3x4_to_f16x4(w[j])
            out[2 * j] = lo
            out[2 * j + 1] = hi
        if row >= valid:
            out.fill(0)
        # lanes in an odd 64-column atom store their upper 8 columns first: the 8 lanes of a store
        # phase then hit 8 distinct 16-byte chunks of the 128-byte swizzle (else 2 per chunk)
        odd = (col // 64) % 2 == 1
        for h in cutlass.range_constexpr(2):
            c0 = col + 8 * h
            c1 = col + 8 * (1 - h)
            c = c1 if odd else c0
            if const_expr(token_major):
                crd = (row, c, dst_stage)
            else:
                crd = (c, row, dst_stage)
            w = cute.make_rmem_tensor((4,), Int32)
            for j in cutlass.range_constexpr(4):
                w[j] = out[4 * (1 - h) + j] if odd else out[4 * h + j]
            store_shared_b32x4(dst_base + smem_offset(crd, dst_layout, 2), w[0], w[1], w[2], w[3])


@cute.jit
def transpose_tile(src_base: Int32, src_layout, src_stage, dst_base: Int32, dst_layout, dst_stage,
                   tile_n: cutlass.Constexpr, D: cutlass.Constexpr, valid, tid, nthreads: cutlass.Constexpr):
    """e4m3 V staging tile (token, d) -> V^T (d, k) with token ``32 (k // 32) + p_token(k % 32)``
    at K index k; tokens ``>= valid`` become zeros. Thread ``tid`` takes 4 x 4 byte blocks
    (:func:`transpose_block`)."""
    groups = tile_n // 4  # 4-token groups; group q is K indices 4q..4q+3
    for it in cutlass.range(groups * (D // 4) // nthreads, unroll=2):
        q, d0, toks = transpose_block(it * nthreads + tid, groups)
        w = cute.make_rmem_tensor((4,), Int32)
        for j in cutlass.range_constexpr(4):
            tok = toks[j]
            w[j] = ld_shared_b32(src_base + smem_offset((tok, d0, src_stage), src_layout, 1))
            if tok >= valid:
                w[j] = Int32(0)
        o = transpose_bytes_4x4(w[0], w[1], w[2], w[3])
        for i in cutlass.range_constexpr(4):
            st_shared_b32(dst_base + smem_offset((d0 + i, 4 * q, dst_stage), dst_layout, 1), o[i])


# ---- V^T by ldmatrix.trans + stmatrix (vt_transpose="ldsm"): docs/design/sm90-prefill.md#fp8 ----
# ldmatrix.trans of an 8 x 8 b16 matrix whose rows are 8 tokens of 16 bytes (8 dim pairs): lane l
# gets dim pair l // 4 of tokens 2 (l % 4) and 2 (l % 4) + 1, bytes (a, 2p) (a, 2p+1) (a+1, 2p)
# (a+1, 2p+1). With the matrix of the 8 tokens after (a+8, a+9, prmt bytes 4..7), the bytes of dim
# 2p are 0, 2, 4, 6 and of dim 2p+1 are 1, 3, 5, 7: tokens a, a+1, a+8, a+9, which are exactly the
# K indices 4 (l % 4)..+3 of the 16-token block (p_token), so a prmt gives the finished V^T word.
PRMT_DIM_EVEN, PRMT_DIM_ODD = 0x6420, 0x7531


def ldsm_unit(b, tokens_16: int):
    """Unit ``b`` of the ldmatrix transpose (one x4 load and store of a warp): ``(h, c)``, the
    16-token block ``h`` (K indices ``16 h..16 h + 15`` of V^T) and the 32-dim block ``c``, ``h``
    fastest. ``tokens_16 = tile_n // 16``. Pure arithmetic (traced or Python ints)."""
    return b % tokens_16, b // tokens_16


def ldsm_rows(lane):
    """(Pure arithmetic.) The rows lane ``lane`` addresses in a unit: its ldmatrix row (token
    offset in the 16-token block, dim offset in the 32-dim block) and its stmatrix row (dim offset
    in the 32-dim block). stmatrix matrix ``m`` takes the words of dim ``2r + s`` of the 16-dim
    half ``m // 2`` in row ``r``, ``s = (r // 4) ^ (m % 2)``: the rows of one matrix then cover 8
    distinct dims mod 8 (0 2 4 6 9 11 13 15), one 16-byte bank group each under the 64- and
    128-byte swizzles (even dims alone would put two rows on one group)."""
    m, r = lane // 8, lane % 8
    ld = (8 * (m % 2) + r, 16 * (m // 2))
    st = 16 * (m // 2) + 2 * r + ((r // 4) ^ (m % 2))
    return ld, st


@dsl_user_op
def prmt_b32(a: Int32, b: Int32, sel: Int32, *, loc=None, ip=None) -> Int32:
    """``prmt.b32`` with a register selector: byte ``i`` is byte ``sel[4i+3:4i]`` of ``b:a``."""
    return Int32(asm([T.i32()], [Int32(a), Int32(b), Int32(sel)], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                     loc=loc, ip=ip))


@dsl_user_op
def token_keep_mask(v: Int32, *, loc=None, ip=None) -> Int32:
    """The bytes of a V^T word with tokens ``a, a+1, a+8, a+9`` that are inside the sequence, for
    ``v = valid - a``: 0xFF where the token is ``< valid``, else 0."""
    text = ("{\n\t.reg .pred p;\n\t.reg .b32 m;\n\t"
            "setp.gt.s32 p, $1, 0;\n\tselp.b32 m, 0xFF, 0, p;\n\t"
            "setp.gt.s32 p, $1, 1;\n\t@p or.b32 m, m, 0xFF00;\n\t"
            "setp.gt.s32 p, $1, 8;\n\t@p or.b32 m, m, 0xFF0000;\n\t"
            "setp.gt.s32 p, $1, 9;\n\t@p or.b32 m, m, 0xFF000000;\n\t"
            "mov.b32 $0, m;\n\t}")
    return Int32(asm([T.i32()], [Int32(v)], text, "=r,r", loc=loc, ip=ip))


@cute.jit
def transpose_tile_ldsm(src_base: Int32, src_layout, src_stage, dst_base: Int32, dst_layout, dst_stage,
                        tile_n: cutlass.Constexpr, D: cutlass.Constexpr, valid, tid, nthreads: cutlass.Constexpr):
    """:func:`transpose_tile`'s result (V^T in the same K order, tokens ``>= valid`` zero) by
    ``ldmatrix.x4.trans`` + 4 ``prmt`` + ``stmatrix.x4`` per 16 tokens x 32 dims of a warp."""
    warps = nthreads // 32
    warp, lane = tid // 32, tid % 32
    (ld_tok, ld_dim), st_dim = ldsm_rows(lane)
    # lanes of stmatrix rows 4..7 hold the odd dim in matrices 0 / 2 (ldsm_rows)
    odd = (lane // 16) % 2
    sel_0 = Int32(PRMT_DIM_EVEN) + odd * Int32(PRMT_DIM_ODD - PRMT_DIM_EVEN)
    sel_1 = Int32(PRMT_DIM_ODD) - odd * Int32(PRMT_DIM_ODD - PRMT_DIM_EVEN)
    tokens_16 = tile_n // 16
    for it in cutlass.range(tokens_16 * (D // 32) // warps, unroll=2):
        h, c = ldsm_unit(it * warps + warp, tokens_16)
        r = ldmatrix_x4(src_base + smem_offset((16 * h + ld_tok, 32 * c + ld_dim, src_stage), src_layout, 1), True)
        w = cute.make_rmem_tensor((4,), Int32)
        w[0] = prmt_b32(r[0], r[1], sel_0)
        w[1] = prmt_b32(r[0], r[1], sel_1)
        w[2] = prmt_b32(r[2], r[3], sel_0)
        w[3] = prmt_b32(r[2], r[3], sel_1)
        if valid < tile_n:  # the sequence's last tile: its stale cache bytes become zeros
            keep = token_keep_mask(valid - (16 * h + 2 * (lane % 4)))
            for j in cutlass.range_constexpr(4):
                w[j] = w[j] & keep
        stmatrix_x4(dst_base + smem_offset((32 * c + st_dim, 16 * h, dst_stage), dst_layout, 1), w[0], w[1], w[2],
                    w[3])


@cute.jit
def narrow_q_rows(q_base: Int32, q_layout, D: cutlass.Constexpr, sShift: cute.Tensor, tid):
    """bf16 query row ``tid`` (of the 128 staged, ``(64, D, 2)`` halves) -> fp16 in place, scaled
    by ``2^shift`` with ``shift = 14 - floor(log2 max|q|)``; ``sShift[tid] = shift``."""
    row = tid % 64
    half = tid // 64
    amax = Float32(0.0)
    # rolled loops: the per-chunk swizzled addresses are recomputed, not kept live (spills)
    for c in cutlass.range(D // 8, unroll=1):
        w = ld_shared_v4(q_base + smem_offset((row, c * 8, half), q_layout, 2))
        for j in cutlass.range_constexpr(4):
            lo = _bf16_lo(w[j])
            hi = _bf16_hi(w[j])
            amax = cute.arch.fmax(amax, cute.arch.fmax(cute.arch.fmax(lo, -lo), cute.arch.fmax(hi, -hi)))
    shift = Int32(0)
    if amax > Float32(0.0):
        e = ((_f32_bits(amax) >> 23) & 0xFF) - 127
        shift = cutlass.min(cutlass.max(Int32(14) - e, Int32(Q_SHIFT_MIN)), Int32(Q_SHIFT_MAX))
    s = cute.math.exp2(Float32(shift), fastmath=False)
    for c in cutlass.range(D // 8, unroll=1):
        addr = q_base + smem_offset((row, c * 8, half), q_layout, 2)
        w = ld_shared_v4(addr)
        o = cute.make_rmem_tensor((4,), Int32)
        for j in cutlass.range_constexpr(4):
            o[j] = pack_16x2(_bf16_lo(w[j]) * s, _bf16_hi(w[j]) * s, "fp16")
        store_shared_b32x4(addr, o[0], o[1], o[2], o[3])
    sShift[tid] = Float32(shift)


@dsl_user_op
def _bf16_lo(w: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(asm([T.f32()], [Int32(w)], "shl.b32 $0, $1, 16;", "=f,r", loc=loc, ip=ip))


@dsl_user_op
def _bf16_hi(w: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(asm([T.f32()], [Int32(w)], "and.b32 $0, $1, 0xFFFF0000;", "=f,r", loc=loc, ip=ip))


@dsl_user_op
def _f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(asm([T.i32()], [Float32(x)], "mov.b32 $0, $1;", "=r,f", loc=loc, ip=ip))
