"""The 128-row ``sm80.prefill`` tiling (two 16-row tiles per warp) on the CPU: its ``ldmatrix``
addresses (one base per operand, XOR or immediate steps) proven equal, lane by lane, to the
swizzled addresses of the 64-row kernel; the k-blocked Q layout a bijection whose reads are the
same elements and free of bank conflicts; the plan's tiling per target (design:
docs/design/sm80.md#128-row-ctas). The builds themselves are in the compile matrix."""

from __future__ import annotations

import pytest

from cute_kernels.plans import hw
from cute_kernels.plans.sm80 import PREFILL_M2_TW32_TARGETS, TARGETS, compile_variants, make_prefill_config
from cute_kernels.roles.cp_async_pages import swizzle
from cute_kernels.roles.warp_attention import WarpTileAttention, engine_for

LANES = range(32)


def _engine(D: int, kv: str, tw: int, m_tiles: int = 2) -> WarpTileAttention:
    return WarpTileAttention(D=D, q_dtype="bf16", kv_dtype=kv, mma_dtype="fp16" if kv == "fp8_e4m3" else "bf16",
                             widen_method="bits", warps_m=4, warps_n=1, m_tiles=m_tiles, tw=tw, q_regs=False,
                             ldsm_xor=True)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("tw", [16, 32])
def test_kv_addresses_equal_the_swizzled_ones(D, kv, tw):
    """K (both element sizes) and V (``ldmatrix.trans``): base XOR a column constant plus a
    16-row immediate is the swizzled address of the same (row, column), for every lane, k-step,
    token block and stage base (1024-byte aligned stages, V a tile after K)."""
    eng = _engine(D, kv, tw)
    rb, wn = eng.kv_row_bytes, 0
    fp8 = kv == "fp8_e4m3"
    for stage in (0, 1024 * 16, 1024 * 48):
        for lane in LANES:
            mi = lane // 8
            k_lane = eng.kv_lane(stage, wn, lane, fp8)
            v_lane = eng.kv_lane(stage + eng.tile * rb, wn, lane, True)
            for n16 in range(tw // 16):
                for cb in range(rb // 32):  # 32-byte column steps: k-blocks (16-bit) or pairs of them (FP8)
                    if fp8:
                        row, col = wn * tw + n16 * 16 + (mi % 2) * 8 + lane % 8, cb * 32 + (mi // 2) * 16
                    else:
                        row, col = wn * tw + n16 * 16 + (mi // 2) * 8 + lane % 8, cb * 32 + (mi % 2) * 16
                    assert eng.ldsm_address(k_lane, rb, n16, cb * 32) == stage + swizzle(row * rb + col)
                    v_row, v_col = wn * tw + n16 * 16 + (mi % 2) * 8 + lane % 8, cb * 32 + (mi // 2) * 16
                    assert (eng.ldsm_address(v_lane, rb, n16, cb * 32)
                            == stage + eng.tile * rb + swizzle(v_row * rb + v_col))


@pytest.mark.parametrize("D", [64, 128])
def test_blocked_q_layout_reads_what_the_swizzled_one_did(D):
    """Q staged k-blocked: every 16-byte piece (row, k-block, half) has its own place; the
    ``ldmatrix`` of (warp, lane, m-tile, k-block) reads the piece the swizzled layout's read
    (row, 8 columns), and the 8 rows of each of its matrices cover the 8 16-byte bank groups."""
    eng = _engine(D, "bf16", 32)
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


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("D", [64, 128])
def test_128_row_tiling_per_target(target, kv, D):
    cfg = make_prefill_config(target=target, q_dtype="bf16", kv_dtype=kv, head_dim=D, group=4, page_size=16,
                              m_tiles=2)
    assert (cfg.rows, cfg.q_regs, cfg.ldsm_xor) == (128, False, True)
    assert cfg.tw == (32 if D == 64 or target in PREFILL_M2_TW32_TARGETS else 16)
    assert cfg.smem_bytes() <= hw.max_smem_per_cta(target)
    eng, gather, ring = engine_for(cfg)
    # the merge rows overlay the ring and the staged Q right after it (both 1024-byte aligned)
    assert ring % 1024 == 0 and ring >= cfg.stages * gather.stage_bytes
    assert ring + eng.q_bytes >= eng.merge_bytes
    assert cfg.smem_bytes() == ring + eng.q_bytes + eng.stats_bytes + eng.rows * 4
    assert cfg in compile_variants("sm80.prefill")


def test_default_tiling_is_untouched_and_256_is_refused():
    cfg = make_prefill_config(target="sm_90a", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=4, page_size=16)
    assert (cfg.m_tiles, cfg.ldsm_xor, cfg.q_regs) == (1, False, True)
    assert "ldsm_xor" not in cfg.label()
    with pytest.raises(ValueError, match="m_tiles"):
        make_prefill_config(target="sm_90a", q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=4, page_size=16,
                            m_tiles=2)
