"""Correctly rounded fp32 division by one scale, cheaper than a ``div.rn.f32`` per element.

The quantizing kernels compute ``RN(x / s)`` for every element with the same ``s``; the codes must
equal the reference's (torch's IEEE division), so a multiply by ``RN(1/s)`` (one ulp off for many
inputs, which then flips FP8 roundings) is not allowed. ``div.rn.f32`` per element is exact but
costs ~11 instructions and a branch (``MUFU.RCP`` + ``FCHK`` + refinement), which made the
quantize kernels issue-bound rather than memory-bound.

Here the reciprocal ``r = RN(1/s)`` is computed once per thread with ``div.rn.f32``, and each
element costs one multiply and two remainder corrections (the sequence of CUDA's own fast path,
with an exactly rounded reciprocal): ``q0 = RN(x r)``; ``e = RN(x - s q0)`` (one FMA, exact);
``q1 = RN(q0 + e r)``, which is within an ulp of ``x/s``; then the same step again from ``q1``,
which by Markstein's theorem (reciprocal within half an ulp, quotient within one ulp, remainder
exact) is ``RN(x/s)``. The theorem needs no overflow or underflow in ``q`` and ``e``: the fast path
is taken only for ``2^-30 <= s <= 2^30`` and ``2^-60 <= |x| <= 2^60`` or ``x = ±0`` (quotients
within ``2^±90``, remainders around ``|x| 2^-24``, all normal; a subnormal ``x`` would make the
remainder inexact, which flips ties when the result is rounded to bf16 — found by the GPU test);
``copysign`` keeps the sign of ``-0``, which the corrections would turn into ``+0``. Anything else
(NaN, ±inf, subnormal or huge values, extreme scales) takes ``div.rn.f32`` for the whole fragment.
The GPU tests check every bf16 and fp16 input value against torch for a spread of scales, into
FP8 and 16-bit results.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op

from ..jit.asm import asm

_FAST_SCALE_MIN, _FAST_SCALE_MAX = 2.0**-30, 2.0**30
_FAST_X_MIN, _FAST_X_MAX = 2.0**-60, 2.0**60


@dsl_user_op
def div_by_reciprocal(x: Float32, recip: Float32, neg_s: Float32, *, loc=None, ip=None) -> Float32:
    """``RN(x / s)`` from ``recip = RN(1/s)`` and ``neg_s = -s``, inside the fast-path range.

    Inline PTX so that the multiply is never contracted with the FMAs around it."""
    res = asm(
        [T.f32()],
        [Float32(v) for v in (x, recip, neg_s)],
        "{\n\t.reg .f32 quo, rem;\n"
        "\tmul.rn.f32 quo, $1, $2;\n"
        "\tfma.rn.f32 rem, $3, quo, $1;\n"
        "\tfma.rn.f32 quo, rem, $2, quo;\n"
        "\tfma.rn.f32 rem, $3, quo, $1;\n"
        "\tfma.rn.f32 quo, rem, $2, quo;\n"
        "\tcopysign.f32 $0, $1, quo;\n\t}",
        "=f,f,f,f",
        loc=loc,
        ip=ip,
    )
    return Float32(res)


@cute.jit
def divide_by_scale(tXrX: cute.Tensor, scale: Float32, exact_subnormals: bool = True):
    """``tXrX[e] = RN(tXrX[e] / scale)`` in place for every element of a register fragment,
    bit-exact with ``div.rn.f32`` for every input and scale.

    ``exact_subnormals=False`` (results that are converted to FP8 e4m3): tiny inputs stay on the
    fast path. Their quotient may then be off by an ulp, but with ``s >= 2^-30`` an FP8 code other
    than ±0 needs ``|x/s| >= 2^-11``, hence ``|x| >= 2^-41``, where everything is exact; below,
    the result stays far under 2^-10 (it rounds to ±0) and ``copysign`` keeps its sign."""
    n = cute.size(tXrX)
    fast = scale >= Float32(_FAST_SCALE_MIN) and scale <= Float32(_FAST_SCALE_MAX)
    for e in cutlass.range_constexpr(n):
        ax = cute.math.abs(tXrX[e])
        if const_expr(exact_subnormals):
            fast = fast and ax <= Float32(_FAST_X_MAX) and (ax >= Float32(_FAST_X_MIN) or ax == Float32(0.0))
        else:
            fast = fast and ax <= Float32(_FAST_X_MAX)
    if fast:
        recip = Float32(1.0) / scale  # div.rn.f32, once per fragment
        neg_s = -scale
        for e in cutlass.range_constexpr(n):
            tXrX[e] = div_by_reciprocal(tXrX[e], recip, neg_s)
    else:
        for e in cutlass.range_constexpr(n):
            tXrX[e] = tXrX[e] / scale  # div.rn.f32
