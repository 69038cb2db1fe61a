"""FP8 e4m3 -> fp16, exactly, in registers: by bit operations (any arch from SM80) or by the
``cvt.rn.f16x2.e4m3x2`` instruction (SM89 and newer).

**Bits.** An e4m3 code ``s eeee mmm`` placed in an fp16 lane as ``s 0eeee mmm0000000`` (sign at
bit 15, exponent and mantissa shifted into bits 13..7) is an fp16 number equal to the e4m3 value
times 2^-8, subnormals included: both formats put the implicit bit at the same place relative to
their exponent bias (7 and 15), and an e4m3 subnormal (exponent 0) lands on an fp16 subnormal.
The factor 2^-8 (:data:`BITS_SCALE_LOG2`) is exact and folds into the logit and output scales,
so the MMA sees exact values. The two NaN codes (``0x7F``, ``0xFF``) become the finite values
±480 · 2^-8 (the bit trick has no NaN): a cache that holds e4m3 NaN reads as ±480 here, where the
``cvt`` path and the reference propagate NaN. Seven integer operations widen four bytes.

**Pairing.** One 32-bit register ``x = [b3 b2 b1 b0]`` gives two fp16x2 registers. The bit trick
pairs ``lo = (b0, b2)``, ``hi = (b1, b3)`` (each lane keeps its byte's position, no byte moves);
``cvt`` pairs ``(b0, b1)``, ``(b2, b3)``, or ``(b0, b2)``, ``(b1, b3)`` after one ``prmt``
(``pair="02"``). The kernels choose the pairing that puts the right elements in each MMA
fragment register and permute the query's columns to match (:func:`qk_permutation`).
"""

from __future__ import annotations

from cutlass import Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from ..jit.asm import asm

BITS_SCALE_LOG2 = 8  # widened = e4m3 value * 2^-BITS_SCALE_LOG2
SIGN_MASK = 0x80008000
EM_MASK = 0x3F803F80  # fp16 bits 13..7 of both lanes: where eeee mmm goes
NAN_AS = 480.0  # what the bit trick makes of the e4m3 NaN codes (times the sign), before 2^-8


@dsl_user_op
def widen_bits(x: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """Four e4m3 bytes -> fp16x2 ``(b0, b2)``, ``(b1, b3)``, each value times 2^-8."""
    # lo lanes take b0 / b2 (bits 7..0 / 23..16): sign from x << 8, eeee mmm from x << 7;
    # hi lanes take b1 / b3 (bits 15..8 / 31..24): sign in place, eeee mmm from x >> 1.
    # lop3 0xEC: (a & c) | b with c the sign mask
    text = (
        "{\n\t.reg .b32 s, e;\n\t"
        "shl.b32 s, $2, 8;\n\t"
        "shl.b32 e, $2, 7;\n\t"
        f"and.b32 e, e, {EM_MASK:#x};\n\t"
        f"lop3.b32 $0, s, e, {SIGN_MASK:#x}, 0xEC;\n\t"
        "shr.b32 e, $2, 1;\n\t"
        f"and.b32 e, e, {EM_MASK:#x};\n\t"
        f"lop3.b32 $1, $2, e, {SIGN_MASK:#x}, 0xEC;\n\t"
        "}"
    )
    lo, hi = asm([T.i32(), T.i32()], [Int32(x)], text, "=r,=r,r", loc=loc, ip=ip)
    return Int32(lo), Int32(hi)


@dsl_user_op
def widen_cvt(x: Int32, pair: str, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """Four e4m3 bytes -> exact fp16x2 with ``cvt.rn.f16x2.e4m3x2`` (SM89+): ``pair="01"`` gives
    ``(b0, b1)``, ``(b2, b3)``; ``pair="02"`` gives ``(b0, b2)``, ``(b1, b3)`` (one ``prmt`` more)."""
    prmt = "prmt.b32 p, $2, 0, 0x3120;\n\t" if pair == "02" else "mov.b32 p, $2;\n\t"
    text = (
        "{\n\t.reg .b32 p;\n\t.reg .b16 l, h;\n\t" + prmt
        + "mov.b32 {l, h}, p;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, l;\n\t"
        "cvt.rn.f16x2.e4m3x2 $1, h;\n\t}"
    )
    lo, hi = asm([T.i32(), T.i32()], [Int32(x)], text, "=r,=r,r", loc=loc, ip=ip)
    return Int32(lo), Int32(hi)


def widen(x, method: str, pair: str):
    """(Traced.) ``method`` "bits" (pairs (b0, b2), (b1, b3) always) or "cvt" with ``pair``."""
    if method == "bits":
        return widen_bits(x)
    return widen_cvt(x, pair)


def widen_scale_log2(method: str) -> int:
    """log2 of the factor a widened value is smaller than the e4m3 value by."""
    return BITS_SCALE_LOG2 if method == "bits" else 0


def qk_permutation(k: int, method: str) -> int:
    """Head-dim column (within a 16-column block) that logical MMA column ``k`` of Q·Kᵀ reads when
    K is widened from one 32-bit register of four consecutive e4m3 columns ``4t .. 4t+3`` per
    lane group t. The fragment holds logical columns (2t, 2t+1) in its first register and
    (2t+8, 2t+9) in its second: with (b0, b2) / (b1, b3) pairs that is 4t, 4t+2 / 4t+1, 4t+3;
    with (b0, b1) / (b2, b3) pairs 4t, 4t+1 / 4t+2, 4t+3. The query is staged with the same
    permutation, so the dot products are unchanged."""
    t, odd, high = (k % 8) // 2, k % 2, k >= 8
    if method == "bits":
        return 4 * t + 2 * odd + high
    return 4 * t + 2 * high + odd


def emulate_bits(codes):
    """Host emulation (numpy) of :func:`widen_bits` on every byte of ``codes`` (uint8 array):
    the fp16 values it produces, as float64, times 2^BITS_SCALE_LOG2 (so directly comparable with
    the e4m3 values). Each code is run through all four byte positions of a 32-bit word with
    the same shifts and masks as the PTX, and the four results must agree."""
    import numpy as np

    c = np.asarray(codes, dtype=np.uint32)
    outs = []
    for pos in range(4):
        x = (c << np.uint32(8 * pos)).astype(np.uint32)
        s = (x << np.uint32(8)) & np.uint32(0xFFFFFFFF)
        e = ((x << np.uint32(7)) & np.uint32(0xFFFFFFFF)) & np.uint32(EM_MASK)
        lo = (s & np.uint32(SIGN_MASK)) | e
        e = (x >> np.uint32(1)) & np.uint32(EM_MASK)
        hi = (x & np.uint32(SIGN_MASK)) | e
        word = (lo, hi)[pos % 2]
        half = (word >> np.uint32(16 * (pos // 2))) & np.uint32(0xFFFF)
        outs.append(half.astype(np.uint16).view(np.float16).astype(np.float64) * 2.0 ** BITS_SCALE_LOG2)
    for other in outs[1:]:
        same = (other == outs[0]) | (np.isnan(other) & np.isnan(outs[0]))
        if not same.all():
            raise AssertionError("byte position changes the widened value")
    return outs[0]
