"""Attention sinks (arch-neutral): one extra logit per query head that joins the softmax
denominator and contributes no value.

Units: ``sinks[h]`` is in the units of the scaled logits (natural log, as FlashInfer / gpt-oss);
the kernels keep running maxima and the LSE in base 2, so the sink enters as
``sinks[h] * log2(e)``. With running max ``m`` and row sum ``l`` (base 2: ``l = sum 2^(x - m)``):
``M = max(m, s)``, ``l' = l 2^(m - M) + 2^(s - M)``; the output is scaled by ``2^(m - M) / l'``
and the LSE is ``M + log2(l')``. A row that saw no key (``m = -inf``) gets output 0 and LSE
``s``. A split-KV launch adds the sink in split 0 only (the merge then counts it once).
"""

from __future__ import annotations

import math

import cutlass.cute as cute
from cutlass import Float32

LOG2E = math.log2(math.e)


@cute.jit
def fold_sink(m, row_sum, sink_log2):
    """``(M, l', factor)``: the row's maximum and sum with the sink folded in, and the factor by
    which the accumulated output (relative to ``m``) is rescaled before the division by ``l'``."""
    big = cute.arch.fmax(m, sink_log2)
    keep = Float32(0.0)
    if m != -Float32.inf:
        keep = cute.math.exp2(m - big, fastmath=False)
    extra = Float32(0.0)
    if sink_log2 != -Float32.inf:  # (a -inf sink is no sink; -inf - -inf would be NaN)
        extra = cute.math.exp2(sink_log2 - big, fastmath=False)
    return big, row_sum * keep + extra, keep
