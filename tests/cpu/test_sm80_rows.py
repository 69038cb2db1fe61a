"""One ``ldmatrix`` base per operand (``ldsm_xor``) on the CPU, for the 128-row ``sm80.prefill``
tiling (two 16-row tiles per warp) and the head-dim-256 ``sm80.decode`` (one tile per warp, up to
four token warps): the addresses (XOR or immediate steps) proven equal, lane by lane and warp by
warp, to the swizzled addresses of the default build; the k-blocked Q layout a bijection whose
reads are the same elements and free of bank conflicts; the plan's tilings per target (design:
docs/design/sm80.md#128-row-ctas, docs/design/sm80.md#head-dim-256-decode). The builds
themselves are in the compile matrix."""

from __future__ import annotations

from dataclasses import replace
from itertools import product

import pytest

from cute_kernels.plans import hw
from cute_kernels.plans.sm80 import (
    KV_DTYPES,
    PREFILL_D128_TW64,
    PREFILL_D128_TW64_TARGETS,
    PREFILL_D256_TW32X,
    PREFILL_D256_W8,
    PREFILL_D256_W8_TARGETS,
    PREFILL_M2_TW32_TARGETS,
    TARGETS,
    make_decode_config,
    make_prefill_config,
    mma_dtype,
    prefill_d128_lean_softmax,
    prefill_d128_tw64s,
    prefill_d256_tw32x,
    prefill_heads_first,
)
from cute_kernels.plans.sm80_matrix import (
    ci_variants,
    compile_variants,
    d128_tw64_form,
    d256_tw32x_form,
    four_warp_form,
    old_form,
    rows128_form,
)
from cute_kernels.roles.cp_async_pages import swizzle, swizzle_period
from cute_kernels.roles.warp_attention import WarpTileAttention, engine_for

LANES = range(32)
# (warps_m, warps_n, m_tiles): the 128-row prefill, then the decode grids the plan builds
TILINGS = [(4, 1, 2), (1, 4, 1), (1, 2, 1), (2, 2, 1), (2, 1, 1), (4, 1, 1)]


def _engine(D: int, kv: str, tw: int, m_tiles: int = 2, warps_m: int = 4, warps_n: int = 1) -> WarpTileAttention:
    return WarpTileAttention(D=D, q_dtype="bf16", kv_dtype=kv, mma_dtype="fp16" if kv == "fp8_e4m3" else "bf16",
                             widen_method="bits", warps_m=warps_m, warps_n=warps_n, m_tiles=m_tiles, tw=tw,
                             q_regs=False, ldsm_xor=True)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("tw", [16, 32, 64])
@pytest.mark.parametrize("tiling", TILINGS, ids=[f"{m}x{n}m{t}" for m, n, t in TILINGS])
def test_kv_addresses_equal_the_swizzled_ones(D, kv, tw, tiling):
    """K (both element sizes) and V (``ldmatrix.trans``): base XOR a column constant plus a
    16-row immediate is the swizzled address of the same (row, column), for every lane, token
    warp, k-step, token block and stage base (1024-byte aligned, the ring's own stage bases
    among them; V a tile after K)."""
    warps_m, warps_n, m_tiles = tiling
    eng = _engine(D, kv, tw, m_tiles, warps_m, warps_n)
    rb = eng.kv_row_bytes
    fp8 = kv == "fp8_e4m3"
    ring = [s * 2 * eng.tile * rb for s in range(3)]  # PagedKVGather's stages: K then V, a tile each
    for stage, wn, lane in product(sorted({0, 1024 * 16, 1024 * 48, *ring}), range(warps_n), LANES):
        mi = lane // 8
        k_lane = eng.kv_lane(stage, wn, lane, fp8)
        v_lane = eng.kv_lane(stage + eng.tile * rb, wn, lane, True)
        for n16 in range(tw // 16):
            for cb in range(rb // 32):  # 32-byte column steps: k-blocks (16-bit) or pairs of them (FP8)
                if fp8:
                    row, col = wn * tw + n16 * 16 + (mi % 2) * 8 + lane % 8, cb * 32 + (mi // 2) * 16
                else:
                    row, col = wn * tw + n16 * 16 + (mi // 2) * 8 + lane % 8, cb * 32 + (mi % 2) * 16
                assert eng.ldsm_address(k_lane, rb, n16, cb * 32) == stage + swizzle(row * rb + col, rb)
                v_row, v_col = wn * tw + n16 * 16 + (mi % 2) * 8 + lane % 8, cb * 32 + (mi // 2) * 16
                assert (eng.ldsm_address(v_lane, rb, n16, cb * 32)
                        == stage + eng.tile * rb + swizzle(v_row * rb + v_col, rb))


@pytest.mark.parametrize("row_bytes", [64, 128, 256, 512])
def test_swizzle_spreads_eight_rows_over_eight_bank_groups(row_bytes):
    """Eight consecutive rows from a multiple of eight (an ``ldmatrix`` matrix) read at one
    16-byte column land in eight distinct 16-byte bank groups, for every row length the
    kernels stage (64-byte FP8 rows at D 64 up to 512-byte 16-bit rows at D 256): no bank
    conflict. The swizzle is a bijection of each period onto itself."""
    period = swizzle_period(row_bytes)
    for first in range(0, 2 * period // row_bytes, 8):
        for col in range(0, row_bytes, 16):
            groups = {swizzle((first + r) * row_bytes + col, row_bytes) % 128 // 16 for r in range(8)}
            assert len(groups) == 8, (row_bytes, first, col)
    assert sorted(swizzle(o, row_bytes) for o in range(0, period, 16)) == list(range(0, period, 16))


def test_swizzle_keeps_the_line_form_up_to_128_byte_rows():
    """Rows of up to 128 bytes keep the 128-byte line's XOR (their builds unchanged); longer rows
    XOR with the row index, not the line index (which repeats every 4 or 2 rows of them)."""
    for o in range(0, 4096, 16):
        line = o ^ (((o >> 7) & 7) << 4)
        assert swizzle(o, 64) == swizzle(o, 128) == line
        assert swizzle(o, 256) == o ^ (((o >> 8) & 7) << 4)
        assert swizzle(o, 512) == o ^ (((o >> 9) & 7) << 4)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("tiling", TILINGS, ids=[f"{m}x{n}m{t}" for m, n, t in TILINGS])
def test_blocked_q_layout_reads_what_the_swizzled_one_did(D, tiling):
    """Q staged k-blocked: every 16-byte piece (row, k-block, half) has its own place; the
    ``ldmatrix`` of (warp, lane, m-tile, k-block) reads the piece the swizzled layout's read
    (row, 8 columns), and the 8 rows of each of its matrices cover the 8 16-byte bank groups."""
    warps_m, warps_n, m_tiles = tiling
    eng = _engine(D, "bf16", 32, m_tiles, warps_m, warps_n)
    pieces = [eng.q_blocked(r, c, h) for r in range(eng.rows) for c in range(D // 16) for h in range(2)]
    assert sorted(pieces) == list(range(0, eng.q_bytes, 16))
    for wm in range(eng.warps_m):
        for mt in range(eng.m_tiles):
            for kb in range(D // 16):
                groups: dict[int, set[int]] = {}
                for lane in LANES:
                    mi = lane // 8
                    q_lane = eng.q_blocked(wm * eng.m_tiles * 16 + (mi % 2) * 8 + lane % 8, 0, mi // 2)
                    got = q_lane + eng.q_blocked(mt * 16, kb, 0)
                    row = (wm * eng.m_tiles + mt) * 16 + (mi % 2) * 8 + lane % 8
                    col = kb * 16 + (mi // 2) * 8
                    assert got == eng.q_blocked(row, col // 16, (col % 16) // 8)
                    groups.setdefault(mi, set()).add(got % 128 // 16)
                assert all(len(g) == 8 for g in groups.values())


NOT_LEAN = (dict(write_lse=True), dict(k_scale_tensor=True, v_scale_tensor=True), dict(kv_form="pair"),
            dict(causal=False))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("D", [64, 128])
def test_128_row_tiling_per_target(target, kv, D):
    """The 128-row CTA with 32-token stages is the default only where it was measured: lean
    variants on PREFILL_M2_TW32_TARGETS (at D 128 but where PREFILL_D128_TW64S is the default,
    tests/cpu/test_sm80_tw64s.py); every other variant and target keeps the 64-row CTA (the old
    form), and ``m_tiles=2`` reaches the 128-row one there too (16-token stages at D 128)."""
    shape = dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=D, group=4,
                 page_size=16)
    for extra in ({}, *NOT_LEAN):
        measured = target in PREFILL_M2_TW32_TARGETS and not extra
        tw64s = D == 128 and prefill_d128_tw64s(target, kv, not extra)
        cfg = make_prefill_config(**shape, **extra)
        if cfg.pingpong:  # the ping-pong default (tests/cpu/test_sm80_pingpong.py): its form before
            cfg = four_warp_form(cfg)
        m2 = make_prefill_config(**shape, **extra, m_tiles=2)
        # at D 128 the lean default adds the lean softmax where the plan says (PREFILL_D128_LEAN_SOFTMAX_TARGETS,
        # PREFILL_D128_TW64S with a BF16 cache: tests/cpu/test_sm80_lean_softmax.py)
        lean_sm = D == 128 and not extra and prefill_d128_lean_softmax(target, True, kv, 16)
        assert cfg.lean_softmax == lean_sm and not m2.lean_softmax
        assert m2 == rows128_form(cfg) and (m2 == replace(cfg, lean_softmax=False, heads_first=m2.heads_first)) == (
            measured and not tw64s), extra
        assert m2.heads_first == prefill_heads_first(target, D, 2, m2.tw, False)  # docs/design/sm80.md#the-grid-order
        assert (m2.rows, m2.q_regs, m2.ldsm_xor) == (128, False, True)
        assert m2.tw == (32 if D == 64 or measured else 16), extra
        if not (measured or tw64s):  # the 64-row form, as before the measured defaults
            assert cfg == old_form(cfg) == make_prefill_config(**shape, **extra, m_tiles=1, tw=32)
            assert (cfg.rows, cfg.tw, cfg.q_regs, cfg.ldsm_xor) == (64, 32, True, False)
            assert "ldsm_xor" not in cfg.label()
        for c in (cfg, m2):
            assert c.smem_bytes() <= hw.max_smem_per_cta(target)
        eng, gather, ring = engine_for(m2)
        # the merge rows overlay the ring and the staged Q right after it (both 1024-byte aligned)
        assert ring % 1024 == 0 and ring >= m2.stages * gather.stage_bytes
        assert ring + eng.q_bytes >= eng.merge_bytes
        assert m2.smem_bytes() == ring + eng.q_bytes + eng.stats_bytes + eng.rows * 4
    lean = make_prefill_config(**shape)
    assert {lean, old_form(lean), rows128_form(lean)} <= set(compile_variants("sm80.prefill"))


def test_128_row_overrides_in_the_ci_set():
    """The unmeasured 16-token 128-row form stays an override whose spill-free build the CI set asserts
    on every target, next to the 64-row default of the same variant."""
    ci = set(ci_variants("sm80.prefill"))
    for target in TARGETS:
        shape = dict(target=target, q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=4, page_size=16,
                     write_lse=True)
        default, m2 = make_prefill_config(**shape), make_prefill_config(**shape, m_tiles=2)
        assert (default.m_tiles, default.tw, m2.m_tiles, m2.tw) == (1, 32, 2, 16)
        assert {default, m2} <= ci


OLD_PREFILL = [  # 64-row forms m_tiles=1 selects (the old form where the 128-row CTA is the default)
    ("sm_90a", "bf16", 128, 32, 3), ("sm_80", "fp8_e4m3", 64, 32, 3), ("sm_86", "bf16", 128, 32, 3),
    ("sm_120a", "fp8_e4m3", 128, 32, 3), ("sm_90a", "bf16", 256, 16, 3), ("sm_80", "bf16", 256, 16, 3),
]


@pytest.mark.parametrize("target,kv,D,tw,stages", OLD_PREFILL)
def test_prefill_overrides_reach_the_64_row_forms(target, kv, D, tw, stages):
    shape = dict(target=target, q_dtype="bf16", kv_dtype=kv, head_dim=D, group=4, page_size=16)
    cfg = make_prefill_config(**shape, m_tiles=1, tw=tw)
    assert (cfg.m_tiles, cfg.rows, cfg.tw, cfg.stages, cfg.q_regs, cfg.ldsm_xor) == (1, 64, tw, stages, D <= 128, False)
    assert "ldsm_xor" not in cfg.label() and cfg.smem_bytes() <= hw.max_smem_per_cta(target)
    assert cfg == old_form(make_prefill_config(**shape)) and cfg in compile_variants("sm80.prefill")


# variants whose PREFILL_D256_TW32X build ptxas spills on some targets (docs/design/sm80.md#head-dim-256-prefill)
D256_EXTRA = ({}, dict(write_lse=True), dict(causal=False), dict(kv_form="pair"), dict(page_size=32),
              dict(page_size=64), dict(k_scale_tensor=True, v_scale_tensor=True), dict(page_size=32, causal=False))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("extra", D256_EXTRA, ids=lambda e: "-".join(f"{k}{v}" for k, v in e.items()) or "lean")
def test_head_dim_256_prefill_default(target, kv, extra):
    """Eight warps (PREFILL_D256_W8) for lean variants with 16-bit caches on PREFILL_D256_W8_TARGETS;
    else 32-token stages with one ldmatrix base (PREFILL_D256_TW32X) everywhere but where ptxas
    spills them: a 16-bit cache at page 32 (not on sm_80), a 16-bit cache with scale tensors on
    sm_120a / sm_121a; those keep the 16-token form before (the old form); 128-row CTAs of two
    tiles per warp are refused at D 256."""
    shape = dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=256, group=4,
                 page_size=16)
    shape.update(extra)
    cfg = make_prefill_config(**shape)
    lean = extra in ({}, dict(page_size=32), dict(page_size=64))
    w8 = lean and kv != "fp8_e4m3" and target in PREFILL_D256_W8_TARGETS
    x = kv == "fp8_e4m3" or not (
        (shape["page_size"] == 32 and target != "sm_80")
        or ("k_scale_tensor" in extra and target in ("sm_120a", "sm_121a")))
    assert x == prefill_d256_tw32x(target, kv, shape["page_size"], "k_scale_tensor" in extra)
    previous = old_form(cfg)
    assert (previous.m_tiles, previous.rows, previous.tw, previous.q_regs, previous.ldsm_xor) == (1, 64, 16, False,
                                                                                                 False)
    if w8:
        assert cfg == replace(cfg, warps_n=1, **PREFILL_D256_W8) and cfg.rows == 128 and cfg.threads == 256
    else:
        assert cfg == (d256_tw32x_form(cfg) if x else previous)
        assert (cfg.tw, cfg.ldsm_xor, "ldsm_xor=True" in cfg.label()) == ((32, True, True) if x else (16, False,
                                                                                                     False))
    assert cfg.smem_bytes() <= hw.max_smem_per_cta(target)
    # the overrides reach the 16-token form before everywhere
    assert make_prefill_config(**shape, tw=16) == previous
    with pytest.raises(ValueError, match="m_tiles"):
        make_prefill_config(**shape, m_tiles=2)
    if kv != "fp8_e4m3":  # two 64 KB stages and Q exceed 99 KB: a clear refusal, not an oversized ring
        with pytest.raises(ValueError, match="64-token stages fits sm_86"):
            make_prefill_config(**dict(shape, target="sm_86"), tw=64)
    if not extra:  # the full set's lean variant of each cache dtype, all its forms
        assert {cfg, previous, d256_tw32x_form(cfg)} <= set(compile_variants("sm80.prefill"))


@pytest.mark.parametrize("target", TARGETS)
def test_head_dim_256_eight_warps_where_their_ring_fits(target):
    """PREFILL_D256_W8 is the lean 16-bit default only on PREFILL_D256_W8_TARGETS: 128 rows, Q and
    the merge rows sharing shared memory, a two-stage 32-token ring within the target's per-CTA
    limit; sized for a 99 KB target it does not fit, and the four-warp form is kept."""
    shape = dict(q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=2, page_size=16)
    cfg = make_prefill_config(target=target, **shape)
    assert (cfg.warps_m == 8) == (target in PREFILL_D256_W8_TARGETS)
    if cfg.warps_m == 8:
        assert (cfg.tw, cfg.stages, cfg.ldsm_xor, cfg.q_regs) == (32, 2, True, False)
        assert hw.SMEM_PER_SM_OF[target] < 2 * cfg.smem_bytes() <= 2 * hw.max_smem_per_cta(target)
        # the kernel's storage is the plan's: the merge rows overlay the ring and Q in 128-row CTAs
        eng, gather, ring = engine_for(cfg)
        assert ring < 2 * gather.stage_bytes + eng.q_bytes and ring + eng.q_bytes >= eng.merge_bytes
        assert cfg.smem_bytes() == ring + eng.q_bytes + eng.stats_bytes + eng.rows * 4
        small = make_prefill_config(target=target, smem_target="sm_86", **shape)
        assert small.warps_m == 4 and small.smem_bytes() <= hw.max_smem_per_cta("sm_86")
        assert make_prefill_config(target=target, **dict(shape, kv_dtype="fp8_e4m3")).warps_m == 4
        assert make_prefill_config(target=target, write_lse=True, **shape).warps_m == 4


def test_head_dim_256_default_follows_the_compile_target():
    """The spill exceptions are facts of the compile target's ptxas: a ring sized for sm_120a on an
    sm_90a build keeps sm_90a's choice (and the reverse)."""
    shape = dict(q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=4, page_size=16, k_scale_tensor=True,
                 v_scale_tensor=True)
    on_90 = make_prefill_config(target="sm_90a", smem_target="sm_120a", **shape)
    assert (on_90.tw, on_90.ldsm_xor, on_90.stages) == (32, True, 2)
    on_120 = make_prefill_config(target="sm_120a", **shape)
    assert (on_120.tw, on_120.ldsm_xor) == (16, False)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_head_dim_256_tw32x_form(target, kv):
    """PREFILL_D256_TW32X reaches 32-token stages with one ldmatrix base per operand, its ring the
    deepest that fits: two CTAs per SM on the 227 KB targets (16-bit caches: two stages), one
    elsewhere (sm_80: three stages); the default of the lean variant, registered for every target."""
    shape = dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=256, group=4,
                 page_size=16)
    default = make_prefill_config(**shape)
    cfg = make_prefill_config(**shape, **PREFILL_D256_TW32X)
    assert cfg == d256_tw32x_form(default) and cfg in compile_variants("sm80.prefill")
    assert (cfg == default) == (kv == "fp8_e4m3" or target not in PREFILL_D256_W8_TARGETS)
    assert (cfg.m_tiles, cfg.rows, cfg.tw, cfg.q_regs, cfg.ldsm_xor) == (1, 64, 32, False, True)
    assert cfg.smem_bytes() <= hw.max_smem_per_cta(target)
    ctas = 2 if hw.SMEM_PER_SM_OF[target] >= 2 * (cfg.smem_bytes() + hw.SMEM_RESERVED_PER_CTA) else 1
    assert ctas == (2 if hw.SMEM_PER_SM_OF[target] == hw.SMEM_PER_SM else 1)
    if ctas == 2 and kv != "fp8_e4m3":
        assert cfg.stages == 2
    # where it is not the default, the override still reaches it
    page32 = make_prefill_config(**dict(shape, page_size=32), **PREFILL_D256_TW32X)
    assert (page32.tw, page32.ldsm_xor) == (32, True)


def test_head_dim_256_in_the_ci_set():
    """The CI set builds the D 256 default (lean BF16) on sm_90a, sm_86 and sm_120a (255 registers
    there, the tightest), the eight-warp one on sm_80 and the 16-token form before on sm_90a."""
    ci = set(ci_variants("sm80.prefill"))
    d256 = [c for c in ci if c.head_dim == 256]
    for t in ("sm_90a", "sm_86", "sm_120a"):
        assert any(c.target == t and c.tw == 32 and c.ldsm_xor and c.causal and c.kv_dtype == "bf16" for c in d256)
    assert any(c.target == "sm_80" and c.warps_m == 8 and c.causal and c.kv_dtype == "bf16" for c in d256)
    assert any(c.target == "sm_90a" and c.tw == 16 and not c.ldsm_xor for c in d256)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("extra", [{}, dict(write_lse=True), dict(causal=False, kv_form="pair", kv_layout="NHD")],
                         ids=["lean", "lse", "pair-full"])
def test_head_dim_128_tw64_override(target, kv, extra):
    """The override reaches 128-row CTAs with 64-token stages (the ring the deepest that fits: two
    16-bit stages and two CTAs per SM on sm_90a, three stages at one CTA on sm_80, two on the 99 KB
    targets); only the 64-token 128-row forms of two tiles per warp mask relative to the tile
    (PREFILL_D128_TW64S among them, not the 16-row warps of PREFILL_D128_PINGPONG16); registered
    (and in the CI set) only where ptxas keeps it spill-free."""
    shape = dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=128, group=4,
                 page_size=16, **extra)
    default = make_prefill_config(**shape)
    cfg = make_prefill_config(**shape, **PREFILL_D128_TW64)
    assert cfg == d128_tw64_form(default) != default
    assert (cfg.m_tiles, cfg.rows, cfg.tw, cfg.q_regs, cfg.ldsm_xor) == (2, 128, 64, False, True)
    assert cfg.smem_bytes() <= hw.max_smem_per_cta(target)
    ctas = 2 if hw.SMEM_PER_SM_OF[target] >= 2 * (cfg.smem_bytes() + hw.SMEM_RESERVED_PER_CTA) else 1
    if kv != "fp8_e4m3":
        assert (ctas, cfg.stages) == {"sm_80": (1, 3)}.get(target, (2 if target in ("sm_90a", "sm_100a", "sm_103a")
                                                                   else 1, 2))
    assert engine_for(cfg)[0].relative_mask and engine_for(default)[0].relative_mask == (default.tw == 64 and default.m_tiles == 2)
    assert not any(engine_for(c)[0].relative_mask for c in (old_form(default), rows128_form(default)))
    registered = target in PREFILL_D128_TW64_TARGETS and kv == "bf16" and extra in ({}, dict(write_lse=True))
    assert (cfg in compile_variants("sm80.prefill")) == registered
    assert (cfg in ci_variants("sm80.prefill")) == (registered and not extra)
    with pytest.raises(ValueError, match="m_tiles"):  # D 256 holds one tile's O per warp
        make_prefill_config(**dict(shape, head_dim=256), **PREFILL_D128_TW64)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("rows", [(8, 1), (2, 2), (16, 2), (16, 4)], ids=lambda r: f"g{r[0]}q{r[1]}")
def test_decode_ldsm_xor_default_changes_nothing_but_the_addressing(target, kv, D, rows):
    """The decode's default addressing: one ``ldmatrix`` base per operand from D 128 on (not for
    16-bit caches at D 128 and q_len 1 where ptxas spills it), per address below; ``ldsm_xor`` either way
    selects the other form with the same tiling, ring and shared memory; the default and the old
    form (per-address, a split's merge as a second launch) of GQA 8 at q_len 1 are in every
    target's compile list."""
    group, q_len = rows
    shape = dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=D, group=group,
                 q_len=q_len, page_size=16)
    xor_default = D >= 128 and not (D == 128 and kv != "fp8_e4m3" and q_len == 1
                                    and target in ("sm_100a", "sm_103a"))
    for split in (False, True):
        cfg = make_decode_config(split=split, **shape)
        assert cfg.ldsm_xor == xor_default and ("ldsm_xor" in cfg.label()) == xor_default
        for other in (make_decode_config(split=split, ldsm_xor=not xor_default, **shape), old_form(cfg)):
            assert replace(other, ldsm_xor=cfg.ldsm_xor, fused_merge=cfg.fused_merge) == cfg
            assert other.smem_bytes() == cfg.smem_bytes()
            assert engine_for(other)[2] == engine_for(cfg)[2]
        if rows == (8, 1):
            assert {cfg, old_form(cfg)} <= set(compile_variants("sm80.decode"))
        # a ring sized for a 99 KB target keeps the compile target's addressing
        assert make_decode_config(split=split, smem_target="sm_86", **shape).ldsm_xor == xor_default
    with pytest.raises(ValueError, match="no exact common 16-bit type"):
        mma_dtype("fp16", "bf16")


@pytest.mark.parametrize("text,fields", [
    ("x:ldsm_xor=true", {"x": {"ldsm_xor": True}}),
    ("a:tw=32+stages=4;b:ldsm_xor=False+m_tiles=2", {"a": {"tw": 32, "stages": 4},
                                                     "b": {"ldsm_xor": False, "m_tiles": 2}}),
    ("s80:m_tiles=2+smem_target=sm_80", {"s80": {"m_tiles": 2, "smem_target": "sm_80"}}),
])
def test_bench_variants_take_flags(text, fields):
    from cute_kernels.bench.sm80 import parse_named_variants

    got = parse_named_variants(text)
    assert got == fields and all(type(v) is type(fields[n][k]) for n in got for k, v in got[n].items())
