"""Inline-PTX primitives of the SM90 kernels (device role helpers): ldmatrix / stmatrix, exact
FP8 -> 16-bit widening, DSMEM / ``.cg`` / shared loads and stores, zero-filling ``cp.async``, the output
gate's sigmoid.

**Why bit tricks.** WGMMA has no BF16 x E4M3 form, so FP8 K/V must be widened before the MMA.
The DSL's generic conversion goes e4m3 -> f16 -> f32 -> bf16 (four SASS ops per pair), which is
too much ALU at HBM speed. An e4m3 code ``s eeee mmm`` maps *exactly* onto a 16-bit float with
the same sign, exponent bits in the low end of the wider exponent field and mantissa bits at the
top of the wider mantissa: the value is the e4m3 value times a fixed power of two (2^-120 for
bf16, 2^-8 for fp16), subnormals included. The power of two is folded into the softmax and
output scales, so the MMA sees exact values. NaN codes (0x7F/0xFF) become finite numbers,
which also means stale cache bytes can never inject NaN into P·V.

**Byte pairing.** One 32-bit register ``x = [b3 b2 b1 b0]`` (four consecutive e4m3 along the
row) widens to two 16-bit pairs: ``lo = (b0, b2)`` and ``hi = (b1, b3)``. Both are a shift and a
masked merge away from ``x``. The MMA then sees the K columns in a permuted order, which the
kernel compensates by permuting Q the same way when it stages Q in shared memory (QK), and by
un-permuting the rows of O (PV): :mod:`.query` and :mod:`.widen`.
"""

from __future__ import annotations

import math

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import T, dsl_user_op

from ..jit.asm import asm

_LOG2E = math.log2(math.e)

EVICT_FIRST_POLICY = 0x12F0000000000000  # L2 cache-policy operand: evict first (CUTLASS CacheHintSm90)

# log2 of the factor the widened values are *smaller* than the e4m3 values by
WIDEN_SHIFT_LOG2 = {"bf16": 120, "fp16": 8}

# per 16-bit lane: sign mask, exponent+mantissa mask after the shift, and the shift amount
# that moves ``e4m3 << 8`` (bits 14:8) to the target's position (bf16: 10:4, fp16: 13:7); the CPU
# tests emulate the instructions with these numbers for every e4m3 code
WIDEN_BITS = {
    "bf16": (0x80008000, 0x07F007F0, 4),
    "fp16": (0x80008000, 0x3F803F80, 1),
}


@dsl_user_op
def ffma(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """``a * b + c`` rounded once (one FFMA: the lean softmaxes' ``exp2(s * scale - max)``)."""
    return Float32(asm([T.f32()], [Float32(a), Float32(b), Float32(c)], "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f",
                       loc=loc, ip=ip))


@dsl_user_op
def widen_e4m3x4(x: Int32, target: str, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """Four e4m3 bytes -> (lo, hi) 16-bit pairs, ``lo = (b0, b2)``, ``hi = (b1, b3)``."""
    sign, em, sh = WIDEN_BITS[target]
    # f = (a & c) | b  ->  LUT (0xF0 & 0xAA) | 0xCC = 0xEC
    text = (
        "{\n\t.reg .b32 t, u;\n\t"
        f"shl.b32 t, $2, {8 - sh};\n\t"
        f"and.b32 t, t, {em:#x};\n\t"
        "shl.b32 u, $2, 8;\n\t"
        f"lop3.b32 $0, u, t, {sign:#x}, 0xEC;\n\t"
        f"shr.b32 t, $2, {sh};\n\t"
        f"and.b32 t, t, {em:#x};\n\t"
        f"lop3.b32 $1, $2, t, {sign:#x}, 0xEC;\n\t"
        "}"
    )
    lo, hi = asm([T.i32(), T.i32()], [Int32(x)], text, "=r,=r,r", loc=loc, ip=ip)
    return Int32(lo), Int32(hi)


@dsl_user_op
def cvt_e4m3x4_f16(x: Int32, pair_tokens: bool, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """Four e4m3 bytes -> two exact f16x2 with ``cvt.rn.f16x2.e4m3x2`` (one SASS op per pair).

    ``lo = (b0, b1)``, ``hi = (b2, b3)``; with ``pair_tokens`` (V^T from ``ldmatrix.trans``, whose
    register holds a 2x2 token x dim block) the bytes are first permuted so that ``lo = (b0, b2)``
    and ``hi = (b1, b3)`` pair the two tokens of one head dim.
    """
    src = "p" if pair_tokens else "$2"
    prmt = "prmt.b32 p, $2, 0, 0x3120;\n\t" if pair_tokens else ""
    text = (
        "{\n\t.reg .b32 p;\n\t.reg .b16 l, h;\n\t" + prmt
        + f"mov.b32 {{l, h}}, {src};\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, l;\n\t"
        "cvt.rn.f16x2.e4m3x2 $1, h;\n\t}"
    )
    lo, hi = asm([T.i32(), T.i32()], [Int32(x)], text, "=r,=r,r", loc=loc, ip=ip)
    return Int32(lo), Int32(hi)


@dsl_user_op
def ldmatrix_x4(smem_addr: Int32, transpose: bool, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: lane l addresses row l % 8 of
    matrix l // 8; result register j holds this lane's part of matrix j."""
    trans = ".trans" if transpose else ""
    regs = asm([T.i32()] * 4, [Int32(smem_addr)],
               f"ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 {{$0, $1, $2, $3}}, [$4];", "=r,=r,=r,=r,r",
               # it reads shared memory written by TMA: it must stay behind the mbarrier wait
               side_effects=True, loc=loc, ip=ip)
    return tuple(Int32(r) for r in regs)


@dsl_user_op
def stmatrix_x4(smem_addr: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """``stmatrix.sync.aligned.m8n8.x4.shared.b16``: lane l addresses row l % 8 of matrix l // 8;
    register j of lane l goes to row l // 4 of matrix j, bytes 4 (l % 4)..4 (l % 4) + 3."""
    asm([], [Int32(smem_addr), Int32(a), Int32(b), Int32(c), Int32(d)],
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", side_effects=True,
        loc=loc, ip=ip)


def q_permutation(k: int, widen: str) -> int:
    """Physical column (within a 16-column block) that logical MMA column ``k`` reads.

    The A fragment of a k16 block holds logical columns (2t, 2t+1) and (2t+8, 2t+9) for lane
    group t, fed from the four bytes 4t..4t+3 of one ldmatrix register:
    - ``"bits"`` widening pairs (b0, b2) and (b1, b3): 2t <- 4t, 2t+1 <- 4t+2, 2t+8 <- 4t+1, 2t+9 <- 4t+3;
    - ``"cvt"`` pairs (b0, b1) and (b2, b3): 2t <- 4t, 2t+1 <- 4t+1, 2t+8 <- 4t+2, 2t+9 <- 4t+3.
    """
    t, r, hi = (k % 8) // 2, k % 2, k >= 8
    if widen == "bits":
        return 4 * t + (2 if r else 0) + (1 if hi else 0)
    return 4 * t + (2 if hi else 0) + r


@dsl_user_op
def load_cg_f32x4(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """``ld.global.cg.v4.f32`` at a 16-byte aligned global address: four floats that other SMs
    wrote in this kernel, read from L2 past L1. Volatile, so it is neither hoisted above the
    acquire fence that makes those writes visible nor merged with another load."""
    vals = asm([T.f32()] * 4, [Int64(addr)], "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l",
               side_effects=True, loc=loc, ip=ip)
    return tuple(Float32(v) for v in vals)


@dsl_user_op
def load_b32_if(gmem_addr: Int64, pred: Int32, fallback: Int32, *, loc=None, ip=None) -> Int32:
    """``@p ld.global.b32``: the word at ``gmem_addr`` if ``pred`` is nonzero, else ``fallback``
    (the address is then not dereferenced). A predicated load instead of a branch around it, so
    that ptxas can schedule it next to the loads around it; volatile, so that it stays behind a
    ``griddepcontrol.wait`` before it."""
    text = ("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $1, 0;\n\tmov.b32 $0, $3;\n\t"
            "@p ld.global.b32 $0, [$2];\n\t}")
    return Int32(asm([T.i32()], [Int32(pred), Int64(gmem_addr), Int32(fallback)], text, "=r,r,l,r",
                     side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def store_shared_f32(smem_addr: Int32, val: Float32, *, loc=None, ip=None) -> None:
    """``st.shared.f32`` at a 32-bit shared-window address (the cluster merge's partials)."""
    asm([], [Int32(smem_addr), Float32(val)], "st.shared.f32 [$0], $1;", "r,f", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def load_dsmem_f32(smem_addr: Int32, rank: Int32, *, loc=None, ip=None) -> Float32:
    """``ld.shared::cluster.f32`` of the word at ``smem_addr`` in the shared memory of cluster CTA
    ``rank`` (``mapa`` maps the local address). Volatile, so it stays behind the cluster barrier
    that publishes the data."""
    text = "{\n\t.reg .b32 a;\n\tmapa.shared::cluster.u32 a, $1, $2;\n\tld.shared::cluster.f32 $0, [a];\n\t}"
    return Float32(asm([T.f32()], [Int32(smem_addr), Int32(rank)], text, "=f,r,r", side_effects=True,
                       loc=loc, ip=ip))


@dsl_user_op
def load_dsmem_f32x4(smem_addr: Int32, rank: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """``ld.shared::cluster.v4.f32``: four floats at a 16-byte aligned ``smem_addr`` of cluster CTA
    ``rank`` (see :func:`load_dsmem_f32`)."""
    text = ("{\n\t.reg .b32 a;\n\tmapa.shared::cluster.u32 a, $4, $5;\n\t"
            "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [a];\n\t}")
    vals = asm([T.f32()] * 4, [Int32(smem_addr), Int32(rank)], text, "=f,=f,=f,=f,r,r", side_effects=True,
               loc=loc, ip=ip)
    return tuple(Float32(v) for v in vals)


@dsl_user_op
def special_register(name: str, *, loc=None, ip=None) -> Int32:
    """``mov.u32`` of a special register (``%tid.x``, ``%ctaid.y``, ``%nctaid.x``...), volatile so
    that the compiler reads it again where it is used instead of keeping an earlier read live in
    a register through the main loop (the cluster merge's indices)."""
    return Int32(asm([T.i32()], [], f"mov.u32 $0, %{name};", "=r", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def cp_async_16(smem_addr: Int32, gmem_addr: Int64, *, loc=None, ip=None) -> None:
    """``cp.async.cg.shared.global [smem], [gmem], 16``: 16 bytes from L2 (past L1) into shared
    memory, without holding registers while in flight (the fused merge's partials)."""
    asm([], [Int32(smem_addr), Int64(gmem_addr)], "cp.async.cg.shared.global [$0], [$1], 16;", "r,l",
        side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def load_shared_f32(smem_addr: Int32, *, loc=None, ip=None) -> Float32:
    """``ld.shared.f32`` at a 32-bit shared-window address (volatile: it stays behind the barrier
    that publishes the data)."""
    return Float32(asm([T.f32()], [Int32(smem_addr)], "ld.shared.f32 $0, [$1];", "=f,r", side_effects=True,
                       loc=loc, ip=ip))


@dsl_user_op
def load_shared_i32(smem_addr: Int32, *, loc=None, ip=None) -> Int32:
    """``ld.volatile.shared.b32`` at a 32-bit shared-window address: read again where it is used
    (by the compiler and by ptxas) rather than kept live in a register from an earlier read (the
    balanced decode's walk state)."""
    return Int32(asm([T.i32()], [Int32(smem_addr)], "ld.volatile.shared.b32 $0, [$1];", "=r,r",
                     side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def load_shared_f32x4(smem_addr: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """``ld.shared.v4.f32``: four floats at a 16-byte aligned shared-window address."""
    vals = asm([T.f32()] * 4, [Int32(smem_addr)], "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
               side_effects=True, loc=loc, ip=ip)
    return tuple(Float32(v) for v in vals)


def sigmoid(x: Float32) -> Float32:
    """(Traced.) fp32 ``1 / (1 + e^-x)`` of the QSA output gate. ``rcp.approx`` (about 1 ulp of
    fp32, far below the bf16 rounding that follows): an IEEE division is a call with a slow-path
    branch per element, a large share of a gated epilogue (docs/design/qsa.md#gated-epilogue).
    Saturates to 0 and 1."""
    return cute.arch.rcp_approx(Float32(1.0) + cute.math.exp2(-x * Float32(_LOG2E), fastmath=True))


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


@dsl_user_op
def store_shared_b32(smem_addr: Int32, a: Int32, *, loc=None, ip=None) -> None:
    """``st.shared.b32``: one 4-byte store (kept in order with the warp barriers around it)."""
    asm([], [Int32(smem_addr), Int32(a)], "st.shared.b32 [$0], $1;", "r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def load_shared_b32x2(smem_addr: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """``ld.shared.v2.b32``: 8 bytes at an 8-byte aligned shared-window address (volatile: it stays
    behind the barrier that publishes them)."""
    regs = asm([T.i32()] * 2, [Int32(smem_addr)], "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r",
               side_effects=True, loc=loc, ip=ip)
    return tuple(Int32(r) for r in regs)
