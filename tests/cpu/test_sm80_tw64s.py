"""The register margin of the 64-token 128-row ``sm80.prefill`` (``PREFILL_D128_TW64S``): each row's
online-softmax max and sum in shared memory between tiles (``stats_smem``) and the page gather's
destinations as one base plus immediates (``gather_one_base``). Both fields are off by default
and absent from every existing label; the form shares the tiling and ring of ``PREFILL_D128_TW64``;
the one-base destinations are the swizzled ones, address by address; the form is registered (and
asserted spill-free by the compile tier) exactly where ``PREFILL_D128_TW64S_TARGETS`` says, and is
the D 128 default of the lean variants exactly where :func:`prefill_d128_tw64s` says
(design: docs/design/sm80.md#64-token-stages-at-head-dim-128)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from cute_kernels.plans import hw
from cute_kernels.plans.sm80 import (
    KV_DTYPES,
    PREFILL_D128_PINGPONG,
    PREFILL_D128_PINGPONG_TARGETS,
    PREFILL_D128_TW64,
    PREFILL_D128_TW64S,
    PREFILL_D128_TW64S_DEFAULT_TARGETS,
    PREFILL_D128_TW64S_TARGETS,
    TARGETS,
    Sm80PrefillConfig,
    make_decode_config,
    make_prefill_config,
    prefill_d128_lean_softmax,
    prefill_d128_tw64s,
    prefill_lean,
)
from cute_kernels.plans.sm80_matrix import (
    ci_variants,
    compile_variants,
    d128_tw64_form,
    d128_tw64s_form,
    four_warp_form,
    old_form,
    rows128_form,
)
from cute_kernels.roles.cp_async_pages import PagedKVGather, swizzle
from cute_kernels.roles.warp_attention import WarpTileAttention, engine_for

NEW_FIELDS = ("stats_smem", "gather_one_base")


def _four(cfg):
    """A default in its four-warp form: the ping-pong default's form before (test_sm80_pingpong.py)."""
    return four_warp_form(cfg) if cfg.pingpong else cfg


def _shape(target, kv, page_size=16, **extra):
    return dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=128, group=4,
                page_size=page_size, **extra)


def test_new_fields_default_off_and_out_of_every_existing_label():
    """Every variant the compile matrix held before keeps its label (and so its digest entry):
    the fields are off and unlabelled unless set (by the override or the D 128 default)."""
    defaults = {f.name: f.default for f in fields(Sm80PrefillConfig)}
    assert all(defaults[name] is False for name in NEW_FIELDS)
    for cfg in compile_variants():
        if not getattr(cfg, "stats_smem", False):
            assert not any(name in cfg.label() for name in NEW_FIELDS), cfg.label()
    tw64s = make_prefill_config(**_shape("sm_80", "bf16"), **PREFILL_D128_TW64S)
    assert all(f"{name}=True" in tw64s.label() for name in NEW_FIELDS)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("extra", [{}, dict(write_lse=True), dict(causal=False, kv_form="pair", kv_layout="NHD")],
                         ids=["lean", "lse", "pair-full"])
def test_tw64s_form_is_the_tw64_tiling_with_the_two_fields(target, kv, extra):
    """The override is ``PREFILL_D128_TW64``'s 128-row CTA, 64-token stages and ring (same stages,
    same shared memory: the statistics use slots the one token warp leaves free) plus the fields;
    registered exactly for the lean GQA-4 page-16 variant on its dtype's targets; the CI set holds
    the BF16 one on sm_80 (an override there), the FP8 one on sm_86 and the BF16 one on sm_90a (the
    defaults there, the last with the lean softmax)."""
    default = _four(make_prefill_config(**_shape(target, kv, **extra)))
    cfg = make_prefill_config(**_shape(target, kv, **extra), **PREFILL_D128_TW64S)
    tw64 = make_prefill_config(**_shape(target, kv, **extra), **PREFILL_D128_TW64)
    assert cfg == d128_tw64s_form(default) == d128_tw64s_form(tw64) != tw64
    assert d128_tw64_form(default) == tw64
    assert (cfg.m_tiles, cfg.tw, cfg.stages, cfg.q_regs, cfg.ldsm_xor) == (2, 64, tw64.stages, False, True)
    assert cfg.stats_smem and cfg.gather_one_base
    # the default may add the lean softmax to the form (tests/cpu/test_sm80_lean_softmax.py)
    assert (replace(_four(default), lean_softmax=False) == cfg) == (default.stats_smem or default.gather_one_base) == (
        not extra and prefill_d128_tw64s(target, kv, True))
    assert cfg.smem_bytes() == tw64.smem_bytes() <= hw.max_smem_per_cta(target)
    eng, gather, ring = engine_for(cfg)
    eng0, gather0, ring0 = engine_for(tw64)
    assert eng.stats_smem and gather.one_base and not (eng0.stats_smem or gather0.one_base) and ring == ring0
    assert eng.warps_n == 1  # the statistics' slots 0 and 1 are free during the main loop with one token warp
    registered = not extra and target in PREFILL_D128_TW64S_TARGETS[kv]
    assert (cfg in compile_variants("sm80.prefill")) == registered
    ci = ci_variants("sm80.prefill")
    pingpong = [replace(cfg, lean_softmax=True, **PREFILL_D128_PINGPONG, ring_release=rr)
                for rr in (False, True)] if target in PREFILL_D128_PINGPONG_TARGETS else []
    assert (cfg in ci or replace(cfg, lean_softmax=True) in ci or any(c in ci for c in pingpong)) == (
        not extra and (target, kv) in (("sm_80", "bf16"), ("sm_86", "fp8_e4m3"), ("sm_90a", "bf16")))


# every GQA, page size and layout reachable: the rule is per target and cache dtype (a fact of
# ptxas at 255 registers, docs/design/sm80.md#64-token-stages-at-head-dim-128)
SHAPES = [dict(group=g, page_size=p, kv_layout=lay) for g, p, lay in ((1, 16, "HND"), (4, 16, "HND"), (8, 32, "NHD"),
                                                                     (16, 64, "HND"), (7, 128, "NHD"))]
NOT_LEAN = (dict(write_lse=True), dict(causal=False), dict(k_scale_tensor=True, v_scale_tensor=True),
            dict(kv_form="pair"))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_d128_default_is_the_margin_form_exactly_where_spill_free(target, kv):
    """At D 128 the lean variants on sm_86 / sm_89 take PREFILL_D128_TW64S (spill-free there for
    every cache dtype), and on sm_90a with 16-bit caches, any GQA, page size and layout, the ring sized for the
    compile target; every other variant, head dim and target keeps its default before: the
    32-token 128-row CTA (``m_tiles=2`` alone still reaches it) or the 64-row one (``m_tiles=1``)."""
    rule = target in PREFILL_D128_TW64S_DEFAULT_TARGETS and target in PREFILL_D128_TW64S_TARGETS[kv]
    assert rule == (target in ("sm_86", "sm_89") or (target == "sm_90a" and kv != "fp8_e4m3"))
    for shape in SHAPES:
        for extra in ({}, *NOT_LEAN):
            base = dict(_shape(target, kv, **extra), **shape)
            lean = prefill_lean(causal=base.get("causal", True), write_lse=base.get("write_lse", False),
                                k_scale_tensor=base.get("k_scale_tensor", False),
                                v_scale_tensor=base.get("v_scale_tensor", False), kv_form=base.get("kv_form", "single"))
            assert lean == (not extra)
            cfg = _four(make_prefill_config(**base))
            assert prefill_d128_tw64s(target, kv, lean) == (rule and lean)
            if rule and lean:
                assert cfg.lean_softmax == prefill_d128_lean_softmax(target, lean, kv, shape["page_size"])
                assert replace(_four(cfg), lean_softmax=False) == make_prefill_config(**base, **PREFILL_D128_TW64S) == \
                    d128_tw64s_form(cfg)
                assert (cfg.m_tiles, cfg.tw) == (2, 64) and "stats_smem=True" in cfg.label()
                # the overrides reach the forms before: the 32-token 128-row CTA on sm_80 / sm_86,
                # the 64-row CTA everywhere, PREFILL_D128_TW64 without the margin
                m2 = make_prefill_config(**base, m_tiles=2)
                assert m2 == rows128_form(cfg) and (m2.tw, m2.stats_smem) == (32 if target != "sm_89" else 16, False)
                assert make_prefill_config(**base, m_tiles=1) == old_form(cfg) and not old_form(cfg).stats_smem
                assert make_prefill_config(**base, **PREFILL_D128_TW64) == d128_tw64_form(cfg) != cfg
            else:
                assert not (cfg.stats_smem or cfg.gather_one_base) and cfg.tw in (16, 32)
            for D in (64, 256):
                other = make_prefill_config(**dict(base, head_dim=D))
                assert not (other.stats_smem or other.gather_one_base)


def test_d128_default_follows_the_compile_target():
    """The rule is a fact of the compile target's ptxas: sm_80 keeps the 32-token 128-row CTA
    with a ring sized for sm_86; an sm_86 build sized for sm_80's shared memory is refused (at
    page 128, where sm_86's default is PREFILL_D128_TW64S: three stages sized for sm_80)."""
    on_80 = make_prefill_config(**_shape("sm_80", "bf16"), smem_target="sm_86")
    assert (on_80.m_tiles, on_80.tw, on_80.stats_smem) == (2, 32, False)
    # a ring sized for sm_80's 164 KB cannot launch on an SM86: the plan refuses it by name
    with pytest.raises(ValueError, match="more than sm_86's"):
        make_prefill_config(**_shape("sm_86", "bf16", page_size=128), smem_target="sm_80")


def test_stats_smem_is_refused_where_it_cannot_hold():
    """The decode merges several token warps' statistics through the slots stats_smem uses; the
    engine needs one token warp."""
    with pytest.raises(ValueError, match="prefill field"):
        make_decode_config(target="sm_80", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=8, q_len=1,
                           page_size=16, split=False, stats_smem=True)
    with pytest.raises(ValueError, match="one token warp"):
        make_prefill_config(**_shape("sm_80", "bf16"), **PREFILL_D128_TW64S, warps_n=2)
    with pytest.raises(ValueError, match="warps_n must be 1"):
        WarpTileAttention(D=128, q_dtype="bf16", kv_dtype="bf16", mma_dtype="bf16", widen_method="bits", warps_m=2,
                          warps_n=2, m_tiles=1, tw=16, q_regs=True, stats_smem=True)


@pytest.mark.parametrize("D,kv_bytes,tile,page", [(128, 2, 64, 16), (128, 1, 64, 16), (64, 2, 64, 32),
                                                  (256, 1, 32, 16), (128, 2, 32, 128)])
def test_one_base_destinations_are_the_swizzled_ones(D, kv_bytes, tile, page):
    """``gather_one_base``: a thread's destination of row step k, ``swizzle(r0 row + c 16) + k step
    row`` (K and V, any stage of the ring), is the swizzled address of its row and chunk, for
    every thread of a 128-thread CTA; the rows and chunks of a stage are covered once each."""
    g = PagedKVGather(tile, D, kv_bytes, 128, page, one_base=True)
    seen = set()
    for tidx in range(128):
        r0, c = tidx // g.chunks, tidx % g.chunks
        for k in range(g.rows_per_thread):
            row = r0 + g.step * k
            for which in range(2):
                one_base = swizzle(r0 * g.row_bytes + c * 16, g.row_bytes) + which * g.tile_bytes + g.step * k * g.row_bytes
                assert one_base == which * g.tile_bytes + swizzle(row * g.row_bytes + c * 16, g.row_bytes)
                seen.add(one_base)
    assert seen == {w * g.tile_bytes + r * g.row_bytes + c * 16 for w in range(2) for r in range(tile)
                    for c in range(g.chunks)}


def test_one_base_is_refused_where_a_row_step_moves_swizzled_bits():
    """Eight rows of 64 bytes (one chunk per thread at D 64 with an FP8 cache over 32 threads)
    are 512 bytes: half a swizzle period, so the immediates would not be the swizzled addresses.
    So are four rows of 512 bytes (D 256, 16-bit, 128 threads): the swizzle of such rows repeats
    every eight rows."""
    with pytest.raises(ValueError, match="one_base"):
        PagedKVGather(16, 64, 1, 32, 16, one_base=True)
    assert not PagedKVGather(16, 64, 1, 32, 16).one_base
    with pytest.raises(ValueError, match="4096-byte swizzle periods"):
        PagedKVGather(32, 256, 2, 128, 16, one_base=True)


@pytest.mark.compile
@pytest.mark.parametrize("cfg", [c for c in compile_variants("sm80.prefill") if c.stats_smem],
                         ids=lambda c: f"{c.target}-{c.kv_dtype}")
def test_registered_tw64s_builds_do_not_spill(cfg):
    """The registered builds of the override: the SM80 instruction evidence and no ``STL`` /
    ``LDL`` (the claim of ``PREFILL_D128_TW64S_TARGETS``); the full compile matrix holds them too."""
    from cute_kernels.jit.evidence import compile_with_evidence

    compiled, ev = compile_with_evidence(cfg, cfg.target)
    assert ev.ptx_target == cfg.target and not ev.missing
    if compiled.sass is None:
        pytest.skip("no nvdisasm: the spill check needs SASS")
    assert "STL" not in ev.sass and "LDL" not in ev.sass, f"{cfg.label()}: {ev.sass}"
    # one 64-token stage: 64 MMAs per 16-row tile for QK, 64 for PV; two tiles per warp but in the
    # 16-row warps of PREFILL_D128_PINGPONG16
    assert ev.sass.get("HMMA") == 128 * cfg.m_tiles
