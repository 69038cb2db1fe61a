"""Host-only tests of the Blackwell kernels' plan (cute_kernels/plans/sm100.py): every limit and
budget check, the derived geometry, the signatures (argument names and order), the split schedule
and the self-check families. No DSL, no torch, no GPU."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from cute_kernels.plans import sm100
from cute_kernels.plans.sm100 import (
    SMEM_BYTES,
    TMEM_COLUMNS,
    RegisterBudget,
    Sm100DecodeConfig,
    Sm100PrefillConfig,
    decode_splits,
    family,
    mode_of,
)

DTYPES = (("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8_e4m3"), ("fp16", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"))


def _decode_grid():
    for (q, kv), D, page, group, q_len, split, sinks in itertools.product(
            DTYPES, sm100.HEAD_DIMS, sm100.PAGE_SIZES, (1, 4, 5, 8, 12, 16, 32, 64), (1, 2, 4), (False, True),
            (False, True)):
        yield dict(q_dtype=q, kv_dtype=kv, head_dim=D, page_size=page, group=group, q_len=q_len, split=split,
                   sinks=sinks)


def test_every_decode_config_fits_the_sm():
    """Every dtype pair x head dim x page x group x draft length builds, within 227 KB of shared
    memory, 512 TMEM columns (a power of two), a register pool of 64K, with at least one K/V
    stage and two converted TMEM stages in the cvt mode."""
    n = 0
    for kw in _decode_grid():
        c = Sm100DecodeConfig(**kw)
        assert c.smem_bytes <= SMEM_BYTES and c.stages >= 1
        assert c.tmem_cols <= TMEM_COLUMNS and c.tmem_cols & (c.tmem_cols - 1) == 0
        assert c.s_cols + c.o_cols + c.cvt_stages * c.cvt_cols <= c.tmem_cols
        assert c.n in (16, 32) and c.n >= c.row_tile and c.row_tile * c.row_tiles >= c.rows
        assert c.chunk * c.kv_bytes <= 128 and c.head_dim % c.chunk == 0
        assert (c.cvt_stages >= 2) == (c.mode == "cvt")
        c.registers.check()
        assert c.threads == (384 if c.mode == "cvt" else 256)
        n += 1
    assert n == 5 * 3 * 4 * 8 * 3 * 2 * 2


def test_every_prefill_config_fits_the_sm():
    for (q, kv), D, page, causal in itertools.product(DTYPES, sm100.HEAD_DIMS, sm100.PAGE_SIZES, (True, False)):
        if mode_of(q, kv) == "cvt":
            with pytest.raises(ValueError, match="16-bit query on an FP8 cache"):
                Sm100PrefillConfig(q_dtype=q, kv_dtype=kv, head_dim=D, page_size=page, causal=causal)
            continue
        c = Sm100PrefillConfig(q_dtype=q, kv_dtype=kv, head_dim=D, page_size=page, causal=causal)
        assert c.smem_bytes <= SMEM_BYTES and c.stages >= 2
        assert c.s_cols + c.o_cols <= TMEM_COLUMNS == c.tmem_cols
        assert c.q_stages == (2 if D <= 128 else 1) and c.n_block == (128 if D <= 128 else 64)
        assert c.p_offset + c.n_block * c.mma_bytes // 4 <= c.n_block  # P inside its S columns
        assert c.threads == 512
        c.registers.check()


@pytest.mark.parametrize("cls", [Sm100DecodeConfig, Sm100PrefillConfig])
def test_bad_configs_are_refused(cls):
    for bad, match in ((dict(kv_dtype="int8"), "kv_dtype"), (dict(q_dtype="fp32"), "q_dtype"),
                       (dict(q_dtype="fp16", kv_dtype="bf16"), "same dtype"),
                       (dict(q_dtype="fp8_e4m3", kv_dtype="bf16"), "same dtype"),
                       (dict(head_dim=96), "head_dim"), (dict(page_size=8), "page_size"),
                       (dict(kv_form="triple"), "kv_form"), (dict(kv_layout="HDN"), "kv_layout"),
                       (dict(q_scale_tensor=True), "q_scale applies only"), (dict(group=0), "group")):
        with pytest.raises(ValueError, match=match):
            cls(**bad)
    if cls is Sm100DecodeConfig:
        with pytest.raises(ValueError, match="q_len"):
            cls(q_len=0)


def test_shared_memory_limit_is_checked(monkeypatch):
    monkeypatch.setattr(sm100, "SMEM_BYTES", 40 * 1024)
    with pytest.raises(ValueError, match="shared memory"):
        Sm100DecodeConfig(head_dim=256, group=32)
    with pytest.raises(ValueError, match="shared memory"):
        Sm100PrefillConfig(head_dim=128)


def test_tmem_limits_are_checked(monkeypatch):
    monkeypatch.setattr(sm100, "TMEM_COLUMNS", 64)
    with pytest.raises(ValueError, match="converted stage"):  # cvt: S + O leave no room for 2 stages
        Sm100DecodeConfig(kv_dtype="fp8_e4m3", head_dim=256, group=32)
    with pytest.raises(ValueError, match="TMEM columns"):  # 2 x 32 (S) + 2 x 32 (O) > 64
        Sm100DecodeConfig(head_dim=256, group=32)
    with pytest.raises(ValueError, match="TMEM columns"):
        Sm100PrefillConfig(head_dim=128)
    Sm100DecodeConfig(head_dim=64, group=4)  # 16 (S) x 2 + 16 (O) = 48 fits


def test_prefill_needs_two_stages(monkeypatch):
    monkeypatch.setattr(sm100, "SMEM_BYTES", 140 * 1024)
    with pytest.raises(ValueError, match="need 2"):
        Sm100PrefillConfig(head_dim=128)


def test_register_budget_checks():
    ok = RegisterBudget((("a", 192), ("b", 56)))
    ok.check()
    assert ok.threads == 256 and ok.launch == 248 and ok.total == 248 * 128
    with pytest.raises(ValueError, match="multiple of 8"):
        RegisterBudget((("a", 100), ("b", 56))).check()
    with pytest.raises(ValueError, match="multiple of 8"):
        RegisterBudget((("a", 264), ("b", 56))).check()
    with pytest.raises(ValueError, match="multiple of 8"):
        RegisterBudget((("a", 16), ("b", 56))).check()
    with pytest.raises(ValueError, match="exceed"):  # 4 x 136 x 128 > 128 x 512
        RegisterBudget((("a", 136), ("b", 136), ("c", 136), ("d", 136))).check()
    with pytest.raises(ValueError, match="exceed"):  # two CTAs per SM halve the pool
        RegisterBudget((("a", 192), ("b", 192)), ctas_per_sm=2).check()
    assert RegisterBudget((("a", 24),) * 22).launch < 24
    with pytest.raises(ValueError, match="at launch"):
        RegisterBudget((("a", 24),) * 22).check()


def test_every_budget_of_the_shipped_roles_fits():
    """The role budgets the kernels use fit the pool of their launch (a warpgroup per role)."""
    for c in (*sm100.decode_variants(), *sm100.prefill_variants()):
        b = c.registers
        b.check()
        assert b.total <= b.launch * b.threads <= 64 * 1024
        assert all(r <= 256 for _, r in b.roles)


def test_signatures():
    d = Sm100DecodeConfig(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", sinks=True, split=True, kv_form="pair")
    assert d.arg_names() == ("q", "k_cache", "v_cache", "block_table", "seq_lens", "part_out", "part_lse",
                             "k_scale", "v_scale", "q_scale", "sinks", "sm_scale", "window_left")
    assert Sm100DecodeConfig().arg_names() == ("q", "kv_cache", "block_table", "seq_lens", "out", "lse", "k_scale",
                                               "v_scale", "sm_scale", "window_left")
    # prefill: the agreed order of the prefill kernels, then sinks (when configured) and the window
    p = Sm100PrefillConfig(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", sinks=True, kv_form="pair")
    assert p.arg_names() == ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc", "out", "lse",
                             "k_scale", "v_scale", "q_scale", "sm_scale", "max_query_len", "sinks", "window_left")
    assert "lse" not in Sm100PrefillConfig(write_lse=False).arg_names()
    out = {a.name: a for a in Sm100DecodeConfig(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3").signature()}["out"]
    assert out.dtype == "bf16"  # an FP8 query's output is bf16


def test_evidence_names_the_mma_kind():
    kinds = {c.mode: [n for n, _ in c.evidence["sm_100a"]] for c in sm100.decode_variants()}
    assert "tcgen05.mma kind::f16" in kinds["f16"] and "tcgen05.mma kind::f16" in kinds["cvt"]
    assert "tcgen05.mma kind::f8f6f4" in kinds["f8"]
    assert "cvt e4m3x2->f16x2" in kinds["cvt"] and "cvt e4m3x2->f16x2" not in kinds["f8"]
    for c in (*sm100.decode_variants(), *sm100.prefill_variants()):
        assert set(c.targets) == {"sm_100a", "sm_103a"} and set(c.evidence) == set(c.targets)
        names = [n for n, _ in c.evidence["sm_103a"]]
        assert {"tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "TMA load", "setmaxnreg"} <= set(names)


def test_modes_and_families():
    assert [mode_of(q, kv) for q, kv in DTYPES] == ["f16", "f16", "cvt", "cvt", "f8"]
    assert family("sm100.decode", "bf16", "fp8_e4m3") == "sm100.decode/cvt"
    assert Sm100DecodeConfig(kv_dtype="fp8_e4m3").mma_dtype == "fp16"  # exact widening target
    assert Sm100DecodeConfig(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3").mma_k == 32


def test_row_tiles():
    c = Sm100DecodeConfig(group=16, q_len=4)  # 64 rows: two CTAs of 32
    assert (c.rows, c.row_tile, c.row_tiles, c.n) == (64, 32, 2, 32)
    c = Sm100DecodeConfig(group=5, q_len=8)  # 40 rows: two tiles of 20, N 32
    assert (c.row_tile, c.row_tiles, c.n) == (20, 2, 32)
    assert Sm100DecodeConfig(group=1).n == 16


def test_decode_split_schedule():
    assert decode_splits(items=148, max_context=32768, num_sms=148) == 1
    assert decode_splits(items=8, max_context=32768, num_sms=148) == 18
    assert decode_splits(items=1, max_context=300, num_sms=148) == 3  # never more splits than tiles
    assert decode_splits(items=1, max_context=10 ** 6, num_sms=148) == sm100.MAX_SPLITS


def test_configs_are_hashable_compile_keys():
    a = Sm100DecodeConfig(sinks=True)
    assert a == dataclasses.replace(Sm100DecodeConfig(), sinks=True) and hash(a) == hash(Sm100DecodeConfig(sinks=True))
    assert "sinks=True" in a.label() and a.label().startswith("sm100.decode[")
