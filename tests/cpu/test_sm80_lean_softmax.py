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
    PREFILL_D128_TW64S_LEAN_KV_DTYPES,
    PREFILL_D128_TW64S_LEAN_PAGE_SIZES,
    Sm80DecodeConfig,
    Sm80PrefillConfig,
    make_prefill_config,
    prefill_d128_tw64s,
    prefill_heads_first,
)
from cute_kernels.plans.sm80_matrix import compile_variants, four_warp_form
from cute_kernels.registry import KERNELS


@pytest.mark.parametrize("cls", [Sm80PrefillConfig, Sm80DecodeConfig])
def test_off_by_default_but_in_the_d128_lean_prefill_default_where_chosen(cls):
    """Off by default; among the registered variants on only where the plan chooses it: the lean
    D 128 prefill default on PREFILL_D128_LEAN_SOFTMAX_TARGETS (the 32-token 128-row CTA) and the
    BF16 one where PREFILL_D128_TW64S is the default (its one-vote form), each form without it
    still registered (``m_tiles=2``; ``PREFILL_D128_TW64S``)."""
    assert {f.name: f.default for f in fields(cls)}["lean_softmax"] is False
    for kid in ("sm80.prefill", "sm80.decode"):
        for cfg in compile_variants(kid):
            tw32 = cfg.target in PREFILL_D128_LEAN_SOFTMAX_TARGETS and (cfg.m_tiles, cfg.tw) == (2, 32)
            tw64s = (cfg.kv_dtype in PREFILL_D128_TW64S_LEAN_KV_DTYPES and cfg.m_tiles == 2 and cfg.tw == 64
                     and cfg.stats_smem and prefill_d128_tw64s(cfg.target, cfg.kv_dtype, True)) if \
                kid == "sm80.prefill" else False
            pingpong = getattr(cfg, "pingpong", False)
            chosen = kid == "sm80.prefill" and cfg.head_dim == 128 and cfg.lean and (tw32 or tw64s or pingpong)
            assert cfg.lean_softmax == ("lean_softmax=True" in cfg.label()), cfg.label()
            if cfg.lean_softmax and not getattr(cfg, "warp_store", False):  # (the opt-in warp_store: registered alone)
                # the form without it: the grid its build keeps without spills (docs/design/sm80.md#the-grid-order)
                # (the ping-pong default's form without it: its four-warp form's, plans.sm80_matrix.four_warp_form)
                base = four_warp_form(cfg) if pingpong else cfg
                rows_first = not prefill_heads_first(cfg.target, 128, 2, base.tw, False)
                assert chosen and replace(base, lean_softmax=False, heads_first=not rows_first) in compile_variants(kid), \
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


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120a"])
@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8_e4m3"])
def test_d128_tw64s_default_takes_the_lean_softmax_for_bf16_caches(target, kv):
    """Where ``PREFILL_D128_TW64S`` is the lean D 128 default, a BF16 cache adds the lean softmax at
    every GQA and layout up to page 64 (``PREFILL_D128_TW64S_LEAN_PAGE_SIZES``); FP16 and FP8 caches, the
    variants that are not lean and the overrides keep the scaled softmax
    (docs/design/sm80.md#in-the-64-token-form)."""
    for group, page, layout in ((1, 16, "HND"), (1, 128, "NHD"), (4, 16, "HND"), (8, 64, "NHD"), (16, 128, "HND"),
                                (7, 32, "HND"), (7, 128, "HND"), (64, 64, "HND")):
        shape = dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=128,
                     group=group, page_size=page, kv_layout=layout)
        cfg = make_prefill_config(**shape)
        if cfg.pingpong:  # the ping-pong default (tests/cpu/test_sm80_pingpong.py): its form before
            cfg = four_warp_form(cfg)
        tw64s = prefill_d128_tw64s(target, kv, True)
        assert cfg.stats_smem == tw64s
        want = target in PREFILL_D128_LEAN_SOFTMAX_TARGETS or (
            tw64s and kv == "bf16" and page <= 64)
        assert cfg.lean_softmax == want, (group, page, layout)
        assert not make_prefill_config(**shape, write_lse=True).lean_softmax
        assert not make_prefill_config(**shape, m_tiles=2, tw=64).lean_softmax
    assert PREFILL_D128_TW64S_LEAN_PAGE_SIZES == (16, 32, 64)
