"""The portable prefill's ping-pong warps (docs/design/sm80.md#ping-pong-warps): where the plan
chooses the eight-warp form, the four-warp form one override away, the refusals, and (compile
tier) the named-barrier turns in the PTX of the default."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cute_kernels.plans import hw
from cute_kernels.plans.sm80 import (
    PINGPONG_WARPS,
    PREFILL_D128_PINGPONG,
    PREFILL_D128_PINGPONG16,
    PREFILL_D128_PINGPONG16_TARGETS,
    PREFILL_D128_PINGPONG_TARGETS,
    PREFILL_D128_TW64S,
    PREFILL_D128_TW64S_DEFAULT_TARGETS,
    TARGETS,
    make_prefill_config,
    prefill_d128_pingpong,
    prefill_d128_pingpong16,
    prefill_d128_tw64s,
)
from cute_kernels.plans.sm80_matrix import ci_variants, compile_variants, four_warp_form
from cute_kernels.roles.warp_attention import PINGPONG_BARRIER, WarpTileAttention, engine_for


def _cfg(target, kv="bf16", page=16, **extra):
    return make_prefill_config(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=128,
                               group=4, page_size=page, **extra)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8_e4m3"])
@pytest.mark.parametrize("page", [16, 32, 64, 128])
def test_pingpong_is_the_default_exactly_where_chosen(target, kv, page):
    """Lean BF16 variants on sm_90a at pages 16-64 (where PREFILL_D128_TW64S takes the lean
    softmax) and on sm_80 at pages 16-32: the 64-token form with the lean softmax in eight warps of
    32 rows (256), two stages, one CTA that fits the target. Where that form does not fit (the 99 KB
    targets, and a ring sized for one), lean variants of every cache dtype at pages 16-128 on the
    targets that build it without spills: the same turns in eight warps of 16 rows (128, 98 KB).
    Elsewhere off: with a target's full shared memory (sm_80, sm_90a) FP16, FP8 and page 128 keep
    their four-warp forms."""
    cfg = _cfg(target, kv, page)
    rule = prefill_d128_pingpong(target, True, kv, page)
    assert rule == (kv == "bf16" and (target, page) in {("sm_90a", 16), ("sm_90a", 32), ("sm_90a", 64),
                                                         ("sm_80", 16), ("sm_80", 32)})
    rule16 = prefill_d128_pingpong16(target, True, kv, page)
    # FP8 where it is widened with cvt (the bit trick's build lost to sm_86's form)
    assert rule16 == (target in {"sm_86", "sm_89", "sm_90a", "sm_120a", "sm_121a"}
                      and not (kv == "fp8_e4m3" and target == "sm_86"))
    assert cfg.pingpong == (rule or (rule16 and hw.SMEM_PER_SM_OF[target] < 128 * 1024))
    assert not cfg.pingpong or target in PREFILL_D128_PINGPONG_TARGETS + PREFILL_D128_PINGPONG16_TARGETS
    # the stages released at the turn: the 256-row form's default where the wait may suspend (sm_90a)
    assert cfg.ring_release == (rule and target == "sm_90a")
    if rule:
        assert (cfg.warps_m, cfg.warps_n) == PINGPONG_WARPS and cfg.rows == 256 and cfg.stages == 2
        assert cfg.lean_softmax and cfg.stats_smem and cfg.gather_one_base and (cfg.m_tiles, cfg.tw) == (2, 64)
        assert cfg.smem_bytes() <= hw.max_smem_per_cta(target)
        # the default before, four warps of 128 rows (no pingpong in its label), an override away:
        # the same form on sm_90a, sm_80's 32-token CTA with the lean softmax
        four = four_warp_form(cfg)
        if target in PREFILL_D128_TW64S_DEFAULT_TARGETS:
            assert prefill_d128_tw64s(target, kv, True)
            assert four == _cfg(target, kv, page, warps_m=4, pingpong=False)
        else:
            assert four == _cfg(target, kv, page, m_tiles=2, lean_softmax=True, heads_first=True)
            assert (four.tw, four.stats_smem) == (32, False)
        assert four.rows == 128 and four.lean_softmax and "pingpong" not in four.label()
        assert 2 * four.smem_bytes() + 2 * hw.SMEM_RESERVED_PER_CTA <= hw.SMEM_PER_SM_OF[target]  # two per SM
    elif cfg.pingpong:
        _check_pingpong16(cfg, target)
        # the default before, an override away: the four-warp PREFILL_D128_TW64S form on sm_86 /
        # sm_89 (the lean softmax for BF16 at pages 16-64; FP8's three-stage ring), the 64-row
        # 32-token CTA on sm_120a / sm_121a
        four = four_warp_form(cfg)
        if target in PREFILL_D128_TW64S_DEFAULT_TARGETS:
            lean16 = kv == "bf16" and page <= 64
            assert four == _cfg(target, kv, page, **PREFILL_D128_TW64S, lean_softmax=lean16, heads_first=True,
                                stages=3 if kv == "fp8_e4m3" else 2)
        else:
            assert four == _cfg(target, kv, page, m_tiles=1, tw=32)
        assert "pingpong" not in four.label() and four.warps_m == 4
    # a ring sized for a 99 KB target: the 128-row form where the compile target builds it
    s86 = _cfg(target, kv, page, smem_target="sm_86")
    assert s86.pingpong == rule16
    if rule16:
        _check_pingpong16(s86, "sm_86")
    for extra in (dict(write_lse=True), dict(causal=False), dict(kv_form="pair")):
        assert not _cfg(target, kv, page, **extra).pingpong  # non-lean variants keep their forms


def _check_pingpong16(cfg, smem_target):
    assert (cfg.warps_m, cfg.warps_n) == PINGPONG_WARPS and cfg.rows == 128 and cfg.stages == 2
    assert {k: getattr(cfg, k) for k in PREFILL_D128_PINGPONG16} == PREFILL_D128_PINGPONG16
    assert cfg.lean_softmax and cfg.stats_smem and cfg.gather_one_base and cfg.heads_first
    assert cfg.smem_bytes() <= hw.max_smem_per_cta(smem_target)


def test_registered_and_in_the_ci_set():
    """The compile matrix holds each ping-pong default with its four-warp form; the CI set compiles
    the sm_90a one (and the compile tier the sm_80 one)."""
    variants = compile_variants("sm80.prefill")
    pingpong = [c for c in variants if c.pingpong and not c.warp_store]  # (warp_store: an opt-in, registered alone)
    assert pingpong and all(four_warp_form(c) in variants for c in pingpong)
    ci = ci_variants("sm80.prefill")
    assert _cfg("sm_90a") in ci and _cfg("sm_86") in ci and _cfg("sm_90a", smem_target="sm_86") in ci
    assert _cfg("sm_86").rows == 128 and _cfg("sm_86").pingpong


def test_pingpong_refusals_name_the_problem():
    """Any other warp grid is refused (the turns pair warp w with w + 4 on one scheduler), and so is
    the form on a target whose shared memory cannot hold its 136 KB."""
    with pytest.raises(ValueError, match="needs warps 8x1, not 4x1"):
        _cfg("sm_90a", **PREFILL_D128_TW64S, pingpong=True)
    with pytest.raises(ValueError, match="more than sm_86's 101376"):
        _cfg("sm_86", **PREFILL_D128_TW64S, **PREFILL_D128_PINGPONG)
    with pytest.raises(ValueError, match="8x1 warps"):
        WarpTileAttention(D=128, q_dtype="bf16", kv_dtype="bf16", mma_dtype="bf16", widen_method="bits", warps_m=4,
                          warps_n=1, m_tiles=2, tw=64, q_regs=False, pingpong=True)
    # the same override fits sm_80's 164 KB at page 128, where sm_80's default is the 32-token form
    assert _cfg("sm_80", page=128, **PREFILL_D128_TW64S, **PREFILL_D128_PINGPONG).pingpong
    assert not _cfg("sm_80", page=128).pingpong


def test_engine_of_the_default():
    cfg = _cfg("sm_90a")
    eng, gather, ring = engine_for(cfg)
    assert eng.pingpong and eng.threads == 256 and eng.rows == 256 and gather.threads == 256
    assert ring + eng.q_bytes <= cfg.smem_bytes()


@pytest.mark.compile
@pytest.mark.parametrize("target, hmma", [("sm_90a", 256), ("sm_86", 128)])
def test_default_build_takes_turns_on_a_named_barrier(target, hmma):
    """The sm_90a and sm_86 defaults' PTX: the two halves meet on PINGPONG_BARRIER for all 256
    threads (an unaligned ``barrier.sync`` each, the second half's before its QK, the first half's
    after: no ``bar.arrive``, which racecheck cannot follow, and no aligned ``bar.sync`` at two
    instructions, which synccheck refuses), once each per tile; SM80 instructions only, 256
    MMAs per 64-token stage per warp of 32 rows (sm_90a), 128 per warp of 16 rows (sm_86), no
    spills."""
    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.jit.evidence import evidence_of

    cfg = _cfg(target)
    compiled = compile_config(cfg, target, artifacts=True)
    ptx = compiled.ptx or ""
    assert len(re.findall(rf"\bbarrier\.sync\s+{PINGPONG_BARRIER}, 256;", ptx)) == 2
    assert not re.search(rf"\bbar\.sync\s+{PINGPONG_BARRIER}\b", ptx) and "bar.arrive" not in ptx
    assert "wgmma" not in ptx and "cp.async.bulk" not in ptx
    ev = evidence_of(compiled)
    assert not ev.missing
    if compiled.sass is None:
        pytest.skip("no nvdisasm: the spill check needs SASS")
    assert "STL" not in ev.sass and "LDL" not in ev.sass and ev.sass.get("HMMA") == hmma


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cap", [1, 2, 3])
def test_max_ctas_per_sm_caps_the_occupancy_by_shared_memory(target, cap):
    """The measurement knob pads the launch's shared memory so that ``cap`` CTAs fit an SM of the
    target and ``cap + 1`` do not; off (0) it asks for the tiling's own bytes and leaves the label
    (and so every registered digest) as it was."""
    plain = _cfg(target, smem_target="sm_86")
    assert plain.launch_smem_bytes() == plain.smem_bytes() and "max_ctas_per_sm" not in plain.label()
    capped = _cfg(target, smem_target="sm_86", max_ctas_per_sm=cap)
    per_sm, reserved = hw.SMEM_PER_SM_OF[target], hw.SMEM_RESERVED_PER_CTA
    launch = capped.launch_smem_bytes()
    assert launch >= capped.smem_bytes() and f"max_ctas_per_sm={cap}" in capped.label()
    assert (cap + 1) * (launch + reserved) > per_sm
    if launch > capped.smem_bytes():  # padded: exactly the cap fits
        assert cap * (launch + reserved) <= per_sm
    with pytest.raises(ValueError, match="max_ctas_per_sm must be >= 0"):
        _cfg(target, max_ctas_per_sm=-1)


@pytest.mark.parametrize("target, smem_target", [("sm_90a", None), ("sm_90a", "sm_86"), ("sm_86", None),
                                                 ("sm_80", None)])
def test_ring_release_is_an_opt_in_of_the_pingpong_forms(target, smem_target):
    """``ring_release`` enters the label only when set (every registered label and digest stays as
    it was), adds the stages' two mbarriers to the shared memory, still fits the target, and waits
    with ``try_wait`` from SM90 on."""
    extra = dict(smem_target=smem_target) if smem_target else {}
    plain = _cfg(target, ring_release=False, **extra)
    released = _cfg(target, ring_release=True, **extra)
    assert plain.pingpong and not plain.ring_release and "ring_release" not in plain.label()
    assert "ring_release=True" in released.label() and released.label().startswith(plain.label()[:-1])
    assert released.smem_bytes() == plain.smem_bytes() + 2 * 8
    assert released.smem_bytes() <= hw.max_smem_per_cta(smem_target or target)
    assert released.ring_suspend == (target in hw.MBARRIER_TRY_WAIT_TARGETS)
    eng, _, _ = engine_for(released)
    assert eng.ring_release and eng.ring.stages == 2 and eng.ring.threads == released.threads
    assert not engine_for(plain)[0].ring_release


def test_ring_release_refusals_name_the_field():
    """Without the turns nothing frees a stage (the four-warp form, eight warps without turns), and
    a third stage would need another release point: both refused, naming the field."""
    with pytest.raises(ValueError, match="ring_release .* needs pingpong=True .* not pingpong=False"):
        _cfg("sm_90a", warps_m=4, pingpong=False, ring_release=True)
    with pytest.raises(ValueError, match="ring_release .* needs pingpong=True"):
        _cfg("sm_90a", pingpong=False, ring_release=True)
    with pytest.raises(ValueError, match=r"needs pingpong=True and stages=2, not pingpong=True, stages=3"):
        _cfg("sm_90a", stages=3, ring_release=True)
    with pytest.raises(ValueError, match="needs pingpong"):
        WarpTileAttention(D=128, q_dtype="bf16", kv_dtype="bf16", mma_dtype="bf16", widen_method="bits", warps_m=8,
                          warps_n=1, m_tiles=2, tw=64, q_regs=False, ring_release=True)
    assert _cfg("sm_90a", ring_release=True, kv_first=True).kv_first  # kv_first composes with it


def test_ring_release_is_a_benchmark_override():
    """``--variants "plan:;rr:ring_release=true"`` parses, passes the override check of the portable
    kernel and builds the default with the field set (what ``tuning_override(backend="sm80", ...)``
    hands ``make_prefill_config``)."""
    from cute_kernels.bench.sm80 import parse_named_variants
    from cute_kernels.ops.paged_prefill import check_tuning_override

    variants = parse_named_variants("plan:;rr:ring_release=true")
    assert variants == {"plan": {}, "rr": {"ring_release": True}}
    check_tuning_override("sm80.prefill", dict(backend="sm80", **variants["rr"]))
    assert _cfg("sm_90a", **variants["rr"]) == dataclasses.replace(_cfg("sm_90a"), ring_release=True)
    with pytest.raises(TypeError, match="ring_release must be a bool"):
        check_tuning_override("sm80.prefill", dict(backend="sm80", ring_release="yes"))


@pytest.mark.compile
def test_ring_release_build_waits_on_stage_barriers():
    """sm_86's build of the 128-row form with ``ring_release``: one CTA barrier fewer than the
    default's (the main loop's; the one after the query's staging and the epilogue's two stay), the
    turns' two ``bar.sync 1``, three ``cp.async`` arrivals (tiles 0 and 1 before the loop, tile
    i + 1 in it) on the stages' barriers and one polling wait (SM86 has no ``try_wait``), no commit
    groups; 128 MMAs per 64-token stage per warp and no spills."""
    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.jit.evidence import evidence_of

    cfg = _cfg("sm_86", ring_release=True)
    compiled = compile_config(cfg, "sm_86", artifacts=True)
    ptx = compiled.ptx or ""
    assert len(re.findall(r"bar\.sync\s+0;", ptx)) == 3
    assert len(re.findall(rf"\bbarrier\.sync\s+{PINGPONG_BARRIER}, 256;", ptx)) == 2
    assert len(re.findall(r"mbarrier\.init\.shared\.b64 \[%r\d+\], 256;", ptx)) == 2
    assert len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc\.shared\.b64", ptx)) == 3
    assert len(re.findall(r"mbarrier\.test_wait\.parity\.shared\.b64", ptx)) == 1 and "try_wait" not in ptx
    assert "cp.async.commit_group" not in ptx and "cp.async.wait_group" not in ptx and "bar.arrive" not in ptx
    ev = evidence_of(compiled)
    assert not ev.missing
    if compiled.sass is None:
        pytest.skip("no nvdisasm: the spill check needs SASS")
    assert "STL" not in ev.sass and "LDL" not in ev.sass and ev.sass.get("HMMA") == 128
