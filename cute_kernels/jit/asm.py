"""One wrapper for the kernels' inline PTX (LLVM inline asm in AT&T dialect).

``results`` is the list of result types (``T.i32()``, ``T.f32()``; empty for none); several results
come back as a tuple. ``side_effects=True`` keeps the statement in program order relative to other
side-effecting operations (loads of memory written by TMA or by other SMs, stores, barriers) and
keeps it from being merged or removed; pure arithmetic leaves it False so that LLVM may schedule it.
"""

from __future__ import annotations

from cutlass._mlir.dialects import llvm


def asm(results: list, operands: list, text: str, constraints: str, *, side_effects: bool = False,
        loc=None, ip=None):
    """Emit ``text`` with ``operands`` (DSL values, converted with ``ir_value``)."""
    if not results:
        ret = None
    elif len(results) == 1:
        ret = results[0]
    else:
        ret = llvm.StructType.get_literal(list(results))
    res = llvm.inline_asm(
        ret,
        [v.ir_value(loc=loc, ip=ip) for v in operands],
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    if len(results) > 1:
        return tuple(llvm.extractvalue(t, res, [j], loc=loc, ip=ip) for j, t in enumerate(results))
    return res
