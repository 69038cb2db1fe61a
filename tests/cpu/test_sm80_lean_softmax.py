"""The portable kernels' lean softmax (``lean_softmax=True``; docs/design/sm80.md#the-lean-softmax-opt-in):
off by default but in the D 128 lean prefill default of PREFILL_D128_LEAN_SOFTMAX_TARGETS, named when set, and
compiled with the SM80 evidence, no spills and the rescale's warp vote, for the prefill and the
decode on sm_80 and sm_90a. The same softmax's numerics are emulated in
tests/cpu/test_prefill_lean_softmax.py; the kernels run in tests/gpu/test_sm80_{prefill,decode}_gpu.py."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from cute_kernels.plans.sm80 import (
    PREFILL_D128_LEAN_SOFTMAX_TARGETS,
    Sm80DecodeConfig,
    Sm80PrefillConfig,
    prefill_heads_first,
)
from cute_kernels.plans.sm80_matrix import compile_variants
from cute_kernels.registry import KERNELS


@pytest.mark.parametrize("cls", [Sm80PrefillConfig, Sm80DecodeConfig])
def test_off_by_default_but_in_the_d128_lean_prefill_default_where_chosen(cls):
    """Off by default; among the registered variants on only where the plan chooses it: the lean
    D 128 prefill default on PREFILL_D128_LEAN_SOFTMAX_TARGETS (the 32-token 128-row CTA), whose
    form without it stays registered (``m_tiles=2``)."""
    assert {f.name: f.default for f in fields(cls)}["lean_softmax"] is False
    for kid in ("sm80.prefill", "sm80.decode"):
        for cfg in compile_variants(kid):
            chosen = (kid == "sm80.prefill" and cfg.head_dim == 128 and cfg.lean
                      and cfg.target in PREFILL_D128_LEAN_SOFTMAX_TARGETS and cfg.m_tiles == 2 and cfg.tw == 32)
            assert cfg.lean_softmax == ("lean_softmax=True" in cfg.label()), cfg.label()
            if cfg.lean_softmax:
                # the form without it: the grid its build keeps without spills (docs/design/sm80.md#the-grid-order)
                rows_first = not prefill_heads_first(cfg.target, 128, 2, 32, False)
                assert chosen and replace(cfg, lean_softmax=False, heads_first=not rows_first) in compile_variants(kid), \
                    cfg.label()
    for t in PREFILL_D128_LEAN_SOFTMAX_TARGETS:
        assert any(c.lean_softmax and c.target == t for c in compile_variants("sm80.prefill"))
    cfg = compile_variants("sm80.prefill")[0]
    lean = replace(cfg, lean_softmax=True)
    assert lean.label().replace(",lean_softmax=True", "") == cfg.label() and "lean_softmax=True" in lean.label()
    assert lean.signature() == cfg.signature()


def _pick(kid, target, head_dim):
    return next(c for c in KERNELS[kid].variants() if c.target == target and c.head_dim == head_dim)


@pytest.mark.compile
@pytest.mark.parametrize("kid,target,head_dim", [("sm80.prefill", "sm_80", 64), ("sm80.prefill", "sm_90a", 256),
                                                 ("sm80.decode", "sm_90a", 128)])
def test_lean_builds_compile_without_spills(kid, target, head_dim):
    """The lean build of a registered variant: the variant's SM80 evidence, no STL / LDL, and the
    warp vote that skips O's rescale."""
    from cute_kernels.jit.evidence import compile_with_evidence

    cfg = replace(_pick(kid, target, head_dim), lean_softmax=True)
    compiled, ev = compile_with_evidence(cfg, target)
    assert ev.ptx_target == target and not ev.missing, ev.missing
    assert "vote.sync.any.pred" in (compiled.ptx or "")
    if compiled.sass is None:
        pytest.skip("no nvdisasm: the spill check needs SASS")
    assert "STL" not in compiled.sass and "LDL" not in compiled.sass, cfg.label()
