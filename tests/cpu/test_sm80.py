"""The portable SM80-class kernels on the CPU: the FP8 bit-trick widening they share with the SM90
kernels proven exact for every e4m3 code (numpy emulation of the same shifts and masks), the
query permutation, the plan's per-target budgets and configs, the op's kernel choice, and
(compile tier) builds that hold only SM80 instructions."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from cute_kernels.jit.spec import ALL_TARGETS
from cute_kernels.plans import hw
from cute_kernels.plans.sm80 import (
    CVT_TARGETS,
    PDL_TARGETS,
    PREFILL_M2_TW32_TARGETS,
    TARGETS,
    Sm80DecodeConfig,
    Sm80PrefillConfig,
    decode_splits,
    make_decode_config,
    make_prefill_config,
    mma_dtype,
    prefill_d128_pingpong,
    prefill_d128_pingpong16,
    prefill_d128_tw64s,
    prefill_d256_w8,
)
from cute_kernels.plans.sm80_matrix import ci_variants, compile_variants
from cute_kernels.roles.fragments import WIDEN_BITS, WIDEN_SHIFT_LOG2, q_permutation

# what the bit trick makes of the two e4m3 NaN codes (0x7F, 0xFF): the finite ±1.875 x 2^8
NAN_AS = 480.0
KB = 1024


def _emulate_widen(codes: np.ndarray, target: str) -> np.ndarray:
    """The values :func:`cute_kernels.roles.fragments.widen_e4m3x4` makes of each e4m3 code, as
    float64 times 2^WIDEN_SHIFT_LOG2 (so directly comparable with the e4m3 values): the same
    shifts and masks as its PTX on a 32-bit word, each code run through all four byte positions
    (which must agree)."""
    sign, em, sh = (np.uint32(v) for v in WIDEN_BITS[target])
    c = np.asarray(codes, dtype=np.uint32)
    outs = []
    for pos in range(4):
        x = (c << np.uint32(8 * pos)).astype(np.uint32)
        lo = (((x << np.uint32(8)) & np.uint32(0xFFFFFFFF)) & sign) | (((x << np.uint32(8) - sh) & np.uint32(0xFFFFFFFF)) & em)
        hi = (x & sign) | ((x >> sh) & em)
        half = ((lo, hi)[pos % 2] >> np.uint32(16 * (pos // 2))) & np.uint32(0xFFFF)
        if target == "fp16":
            val = half.astype(np.uint16).view(np.float16).astype(np.float64)
        else:  # bf16: the upper half of an fp32
            val = (half << np.uint32(16)).astype(np.uint32).view(np.float32).astype(np.float64)
        outs.append(val * 2.0 ** WIDEN_SHIFT_LOG2[target])
    for other in outs[1:]:
        assert np.array_equal(other, outs[0], equal_nan=True), "byte position changes the widened value"
    return outs[0]


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_bit_trick_is_exact_for_every_e4m3_code(target):
    """The widening both kernel families use (SM80-class: fp16; SM90: the query's type)."""
    codes = np.arange(256, dtype=np.uint8)
    got = _emulate_widen(codes, target)
    want = torch.from_numpy(codes).view(torch.float8_e4m3fn).double().numpy()
    nan = np.isnan(want)
    assert nan.sum() == 2 and set(codes[nan]) == {0x7F, 0xFF}
    np.testing.assert_array_equal(got[~nan], want[~nan])  # subnormals, zeros and both signs included
    assert list(got[nan]) == [NAN_AS, -NAN_AS]  # the documented NaN policy (docs/design/sm80.md)
    if target == "fp16":  # the widened values themselves are fp16 numbers (exact products by 2^-8)
        scaled = got[~nan] * 2.0 ** -WIDEN_SHIFT_LOG2["fp16"]
        assert np.all(np.float16(scaled).astype(np.float64) == scaled)


@pytest.mark.parametrize("method", ["bits", "cvt"])
def test_query_permutation_is_a_bijection_of_each_block(method):
    perm = [q_permutation(k, method) for k in range(16)]
    assert sorted(perm) == list(range(16))
    # lane group t's two registers hold head dims 4t .. 4t+3 (one ldmatrix register of K)
    for t in range(4):
        assert sorted(perm[k] for k in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)) == [4 * t + i for i in range(4)]


def test_hardware_facts_per_target():
    """One table in plans/hw.py: the per-CTA opt-in limit is the SM's capacity less the runtime's
    1 KB, 163 / 99 / 227 KB; the SM90 numbers are the ones the SM90 plans use."""
    assert set(hw.SMEM_PER_SM_OF) == set(ALL_TARGETS)
    limits = {t: hw.max_smem_per_cta(t) // KB for t in ALL_TARGETS}
    assert limits == {"sm_80": 163, "sm_86": 99, "sm_89": 99, "sm_90a": 227, "sm_100a": 227, "sm_103a": 227,
                      "sm_120a": 99, "sm_121a": 99}
    assert hw.max_smem_per_cta("sm_90a") == hw.MAX_SMEM_PER_CTA
    assert CVT_TARGETS == tuple(t for t in ALL_TARGETS if t not in ("sm_80", "sm_86"))
    assert PDL_TARGETS == ("sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a")


def test_mma_dtype_rules():
    assert mma_dtype("bf16", "bf16") == "bf16"
    assert mma_dtype("fp16", "fp16") == "fp16"
    assert mma_dtype("bf16", "fp8_e4m3") == mma_dtype("fp16", "fp8_e4m3") == "fp16"
    assert mma_dtype("bf16", "fp16") == "fp16"  # the bf16 query is scaled per row into fp16
    with pytest.raises(ValueError, match="no exact common 16-bit type"):
        mma_dtype("fp16", "bf16")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_every_target_gets_configs_within_its_shared_memory(target, kv, D):
    for group, q_len in ((1, 1), (8, 1), (16, 4), (64, 1)):
        for split in (False, True):
            c = make_decode_config(target=target, q_dtype="bf16", kv_dtype=kv, head_dim=D, group=group, q_len=q_len,
                                   page_size=16, split=split)
            assert c.smem_bytes() <= hw.max_smem_per_cta(target) and c.targets == (target,)
            assert c.rows >= group * q_len and c.threads <= 128
            assert c.widen == ("cvt" if kv == "fp8_e4m3" and target in CVT_TARGETS else "bits")
            assert c.pdl == (target in PDL_TARGETS)
    p = make_prefill_config(target=target, q_dtype="bf16", kv_dtype=kv, head_dim=D, group=4, page_size=16)
    # 128-row CTAs where measured (lean variants up to D 128 on PREFILL_M2_TW32_TARGETS, at D 128 with
    # 64-token stages where prefill_d128_tw64s, eight warps at D 256 where prefill_d256_w8), else 64 rows
    assert p.smem_bytes() <= hw.max_smem_per_cta(target)
    tw64s = D == 128 and prefill_d128_tw64s(target, kv, True)
    w8 = D == 256 and prefill_d256_w8(target, kv, True)
    # and on sm_80 / sm_90a with a BF16 cache the eight-warp ping-pong form of 256 rows
    # (PREFILL_D128_PINGPONG), on the 99 KB targets its 128-row form of 16-row warps (PREFILL_D128_PINGPONG16),
    # which the full shared memory of sm_80 / sm_90a leaves to the four-warp forms
    pp256 = D == 128 and prefill_d128_pingpong(target, True, kv, 16)
    pp128 = (D == 128 and not pp256 and prefill_d128_pingpong16(target, True, kv, 16)
             and hw.SMEM_PER_SM_OF[target] < 128 * 1024)
    assert p.pingpong == (pp256 or pp128)
    assert p.rows == (256 if pp256 else 128 if (D <= 128 and (target in PREFILL_M2_TW32_TARGETS or tw64s))
                      or w8 or pp128 else 64)
    assert (p.tw == 64) == (tw64s or p.pingpong)
    lse = make_prefill_config(target=target, q_dtype="bf16", kv_dtype=kv, head_dim=D, group=4, page_size=16,
                              write_lse=True)
    assert lse.rows == 64 and lse.smem_bytes() <= hw.max_smem_per_cta(target)


def test_small_smem_sizing_runs_anywhere():
    """``smem_target`` sizes the ring for a 99 KB arch while compiling for another (the H200
    tests run the SM86/SM120 tilings this way)."""
    c = make_decode_config(target="sm_90a", q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=8, q_len=1,
                           page_size=16, split=False, smem_target="sm_86")
    assert c.target == "sm_90a" and c.smem_bytes() <= hw.max_smem_per_cta("sm_86")


def test_configs_refuse_what_the_kernels_cannot_do():
    with pytest.raises(ValueError, match="cvt widening needs SM89"):
        Sm80DecodeConfig(target="sm_86", kv_dtype="fp8_e4m3", widen="cvt")
    with pytest.raises(ValueError, match="dependent launch needs SM90"):
        Sm80DecodeConfig(target="sm_80", pdl=True)
    with pytest.raises(ValueError, match="group \\* q_len"):
        Sm80DecodeConfig(group=16, q_len=5, warps_m=4, warps_n=1)
    with pytest.raises(ValueError, match="cannot hold"):
        Sm80DecodeConfig(group=8, q_len=4)  # 32 rows, one 16-row warp row
    with pytest.raises(ValueError, match="no exact common"):
        Sm80PrefillConfig(q_dtype="fp16", kv_dtype="bf16")
    with pytest.raises(ValueError, match="page_size"):
        Sm80PrefillConfig(page_size=8)


def test_signatures_name_the_contract_arguments_in_order():
    d = make_decode_config(target="sm_89", q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1,
                           page_size=16, split=True, kv_form="pair")
    assert not d.fused_merge  # the default: the merge as a second launch
    assert d.arg_names() == ("q", "k_cache", "v_cache", "block_table", "seq_lens", "part_out", "part_lse", "k_scale",
                             "v_scale", "sm_scale")
    assert d.merge_config().pdl is False and d.merge_config().head_dim == 128  # no PDL on SM89
    fused = replace(d, fused_merge=True)  # the opt-in: the last split CTA merges, one launch
    assert fused.arg_names() == ("q", "k_cache", "v_cache", "block_table", "seq_lens", "out", "lse", "part_out",
                                 "part_lse", "counters", "k_scale", "v_scale", "sm_scale")
    assert "fused_merge=True" in fused.label() and "fused_merge" not in d.label()
    with pytest.raises(ValueError, match="fused_merge"):
        replace(d, split=False, fused_merge=True)
    assert not make_decode_config(target="sm_89", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=8, q_len=1,
                                  page_size=16, split=False, fused_merge=True).fused_merge  # nothing to merge
    p = make_prefill_config(target="sm_120a", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=4, page_size=16)
    assert p.arg_names() == ("q", "kv_cache", "block_table", "seq_lens", "query_start_loc", "out", "k_scale",
                             "v_scale", "sm_scale", "max_query_len")
    assert p.heads_first and replace(p, heads_first=False).arg_names() == p.arg_names()  # the grid order only
    p = make_prefill_config(target="sm_120a", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=4, page_size=16,
                            write_lse=True)
    assert "lse" in p.arg_names()


def test_split_schedule_from_shapes_only():
    assert decode_splits(items=8, max_context=32000, num_sms=132, tile=64) == 33  # one wave of 2 CTAs per SM
    assert decode_splits(items=1024, max_context=32000, num_sms=132, tile=64) == 1
    assert decode_splits(items=1, max_context=100, num_sms=132, tile=64) == 2  # never more splits than tiles
    assert decode_splits(items=1, max_context=10 ** 6, num_sms=132, tile=64) == 64  # capped
    assert decode_splits(items=1, max_context=100, num_sms=132, tile=64, num_splits=5) == 5


def test_compile_variants_cover_every_target_and_contain_the_ci_set():
    full, ci = compile_variants(), ci_variants()
    assert len(set(full)) == len(full) and set(ci) <= set(full)
    for t in TARGETS:
        mine = [c for c in full if c.target == t]
        kinds = {(c.kernel_id, c.kv_dtype, c.head_dim) for c in mine}
        assert kinds == {(k, kv, d) for k in ("sm80.decode", "sm80.prefill") for kv in ("bf16", "fp16", "fp8_e4m3")
                         for d in (64, 128, 256)}, t
        assert any(c.kernel_id == "sm80.decode" and c.split for c in mine)
        assert any(c.kernel_id == "sm80.decode" and c.rows == 64 for c in mine)
        assert any(c.kernel_id == "sm80.decode" and (c.q_dtype, c.kv_dtype) == ("bf16", "fp16") for c in mine)
        assert {c.widen for c in mine if c.fp8} == ({"bits", "cvt"} if t in CVT_TARGETS else {"bits"})
        assert any(c.kernel_id == "sm80.decode" for c in ci if c.target == t)
        assert any(c.kernel_id == "sm80.prefill" for c in ci if c.target == t)
    assert compile_variants("sm80.prefill") == [c for c in full if c.kernel_id == "sm80.prefill"]


@pytest.mark.parametrize("target,q,kv,kernel", [
    ("sm_90a", "bf16", "fp8_e4m3", "sm90.decode"),
    ("sm_90a", "fp16", "fp16", "sm90.decode"),
    ("sm_90a", "bf16", "fp16", "sm80.decode"),  # what sm90.decode refuses
    ("sm_80", "bf16", "fp8_e4m3", "sm80.decode"),
    ("sm_86", "bf16", "bf16", "sm80.decode"),
    ("sm_100a", "bf16", "fp8_e4m3", "sm100.decode"),  # compile-verified: chosen like an available one
    ("sm_103a", "bf16", "fp16", "sm80.decode"),  # what sm100.decode refuses
    ("sm_121a", "fp16", "fp8_e4m3", "sm80.decode"),
])
def test_paged_decode_runs_the_registry_choice(target, q, kv, kernel):
    from cute_kernels.ops.paged_decode import decode_kernel

    assert decode_kernel(target, q, kv).id == kernel
    assert decode_kernel(target, q, kv, "sm80").id == "sm80.decode"  # tuning_override(backend="sm80")
    with pytest.raises(ValueError, match="backend must be one of"):
        decode_kernel(target, q, kv, "sm70")


@pytest.mark.parametrize("target,q,kv,group,kernel", [
    ("sm_90a", "bf16", "fp8_e4m3", 4, "sm90.prefill"),
    ("sm_90a", "bf16", "fp16", 4, "sm80.prefill"),  # what the SM90 kernel refuses: the dtype pair
    ("sm_90a", "bf16", "bf16", 256, "sm80.prefill"),  # and a GQA group beyond its 128
    ("sm_86", "fp16", "fp8_e4m3", 8, "sm80.prefill"),
    ("sm_100a", "bf16", "bf16", 8, "sm100.prefill"),  # compile-verified: chosen like an available one
    ("sm_103a", "bf16", "fp8_e4m3", 8, "sm80.prefill"),  # a 16-bit query on FP8: the layer quantizes for sm100
    ("sm_121a", "bf16", "fp8_e4m3", 64, "sm80.prefill"),
])
def test_paged_prefill_runs_the_registry_choice(target, q, kv, group, kernel):
    from cute_kernels.ops.paged_prefill import prefill_kernel

    assert prefill_kernel(target, q, kv, group).id == kernel
    assert prefill_kernel(target, q, kv, group, "sm80").id == "sm80.prefill"
    fp8q = "sm100.prefill" if target.startswith("sm_10") else "sm90.prefill_fp8q"  # the FP8-query kernels
    assert prefill_kernel(target, "fp8_e4m3", "fp8_e4m3", group).id == fp8q
    with pytest.raises(ValueError, match="takes no FP8 query"):
        prefill_kernel(target, "fp8_e4m3", "fp8_e4m3", group, "sm80")


# ----------------------------------------------------------------------------------------------
# compile tier: the builds hold only the SM80 instruction set
# ----------------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
def test_builds_use_only_sm80_instructions(target):
    from cute_kernels.jit.compiler import compile_config

    cfg = make_decode_config(target=target, q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1,
                             page_size=16, split=False, widen="bits")
    ptx = compile_config(cfg, target, artifacts=True).ptx
    assert f".target {target}" in ptx
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", ptx)
    # zero-filling copies (the SM90 helper, with zero immediate offsets)
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\+0\], \[%rd\d+\+0\], 16, %r\d+;", ptx)
    for absent in ("wgmma", "cp.async.bulk", "tcgen05", "mbarrier", "cvt.rn.f16x2.e4m3x2", "setmaxnreg"):
        assert absent not in ptx, absent
    assert ("griddepcontrol" in ptx) == (target == "sm_90a")  # PDL only where it exists


def test_the_fused_merge_is_an_opt_in_that_the_compile_matrix_keeps_building():
    """Every split launch merges in a second launch unless ``fused_merge`` asks for the last CTA's
    merge; the compile matrix builds that form of each split decode except where it spills, and
    counts its L2 round trips per thread (the measured cost, docs/design/sm80.md#the-fused-merge)."""
    from cute_kernels.plans.sm80 import (
        DECODE_XOR_16BIT_D128_SPILL_TARGETS,
        decode_ldsm_xor,
        fused_merge_trips,
        plan_decode,
    )
    from cute_kernels.plans.sm80_matrix import fused_merge_registered

    def config_for(group, q_len, **kw):
        return lambda split: make_decode_config(target="sm_86", q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128,
                                                group=group, q_len=q_len, page_size=16, split=split, **kw)

    splits, cfg = plan_decode(config_for(8, 1), items=64, max_context=4096, num_sms=132, num_splits=None)
    assert splits == 4 and cfg.split and not cfg.fused_merge
    splits, cfg = plan_decode(config_for(8, 1, fused_merge=True), items=64, max_context=4096, num_sms=132,
                              num_splits=None)
    assert splits == 4 and cfg.fused_merge
    splits, cfg = plan_decode(config_for(8, 1, fused_merge=True), items=1024, max_context=4096, num_sms=132,
                              num_splits=None)
    assert splits == 1 and not cfg.fused_merge  # unsplit: nothing to merge
    small = config_for(8, 1)(True)
    assert fused_merge_trips(small, 4) == 2  # 8 rows x 32 chunks over 128 threads, one group of splits
    assert fused_merge_trips(small, 17) == 4 and fused_merge_trips(small, 64) == 8
    assert fused_merge_trips(config_for(16, 4)(True), 2) == 16  # 64 rows: 16 chunks per thread
    full = set(compile_variants("sm80.decode"))
    for c in full:  # the split variants in their default addressing (not the per-address old forms)
        if c.split and not c.fused_merge and c.ldsm_xor == decode_ldsm_xor(c.target, c.kv_dtype, c.head_dim, c.q_len):
            assert (replace(c, fused_merge=True) in full) == fused_merge_registered(c), c.label()
    assert not any(c.fused_merge for c in full if c.target in DECODE_XOR_16BIT_D128_SPILL_TARGETS
                   and c.head_dim == 128 and not c.fp8)
    assert sum(c.fused_merge for c in ci_variants("sm80.decode")) == 1


def test_prefill_grid_order_per_head_dim_and_its_height():
    """The grid with the KV heads fastest (docs/design/sm80.md#the-grid-order) is every prefill
    form's up to head dim 128 but the one whose build spills with it; D 256 keeps the row tiles
    fastest. Its y extent holds ``prefill_heads_first_max_q`` tokens' row tiles, no more."""
    from cute_kernels.plans.sm80 import (
        PREFILL_ROWS_FIRST_FORMS,
        prefill_heads_first,
        prefill_heads_first_max_q,
    )

    for target in TARGETS:
        for D in (64, 128, 256):
            for kv in ("bf16", "fp8_e4m3"):
                for extra in ({}, dict(write_lse=True), dict(m_tiles=1), dict(m_tiles=2) if D <= 128 else {}):
                    cfg = make_prefill_config(target=target, q_dtype="bf16", kv_dtype=kv, head_dim=D, group=4,
                                              page_size=16, **extra)
                    rows_first = (target, cfg.m_tiles, cfg.tw, cfg.lean_softmax) in PREFILL_ROWS_FIRST_FORMS
                    assert cfg.heads_first == (D <= 128 and not rows_first), cfg.label()
                    assert cfg.heads_first == prefill_heads_first(target, D, cfg.m_tiles, cfg.tw, cfg.lean_softmax)
                    assert ("heads_first=True" in cfg.label()) == cfg.heads_first
    for group, rows in ((1, 64), (4, 128), (8, 64), (16, 64), (5, 128)):
        top = prefill_heads_first_max_q(group, rows)
        assert -(-top * group // rows) <= hw.MAX_GRID_Y < -(-(top + 1) * group // rows)


@pytest.mark.parametrize("target", TARGETS)
def test_page_prefetch_is_the_default_at_head_dims_64_and_256(target):
    """Each tile's page ids read a tile ahead (docs/design/sm80.md#page-ids-a-tile-ahead): the
    decode's default at D 64 and 256 on every target and cache dtype (but FP8 at D 64 on sm_100a,
    whose build spills with it), not at D 128; either value is
    one override away and changes no other field; the compile matrix keeps the form without it
    beside every default that takes it (their labels, and so their digests, are the ones before)."""
    from cute_kernels.plans.sm80 import DECODE_PAGE_PREFETCH_HEAD_DIMS, DECODE_PAGE_PREFETCH_SPILLS

    assert DECODE_PAGE_PREFETCH_HEAD_DIMS == (64, 256)
    assert DECODE_PAGE_PREFETCH_SPILLS == (("sm_100a", "fp8_e4m3", 64),)  # that build spills with it
    full = set(compile_variants("sm80.decode"))
    for kv in ("bf16", "fp16", "fp8_e4m3"):
        for D in (64, 128, 256):
            for split in (False, True):
                shape = dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=D,
                             group=8, q_len=1, page_size=16, split=split)
                cfg = make_decode_config(**shape)
                on = D != 128 and (target, kv, D) != ("sm_100a", "fp8_e4m3", 64)
                assert cfg.page_prefetch == on and ("page_prefetch" in cfg.label()) == on
                other = make_decode_config(page_prefetch=not cfg.page_prefetch, **shape)
                assert replace(other, page_prefetch=cfg.page_prefetch) == cfg
                assert cfg in full and replace(cfg, page_prefetch=False) in full
    assert not any(c.page_prefetch for c in full if c.head_dim == 128)


@pytest.mark.parametrize("target", TARGETS)
def test_q_loads_first_is_the_prefill_default(target):
    """The query's loads issued at once (docs/design/sm80.md#the-query-loads-at-once): the default
    of every prefill (each head dim, cache dtype, mask and LSE form) but the two D 128 builds whose
    ptxas spills with it; either value is one override away and changes no other field; the compile
    matrix keeps the form without it beside every default that takes it (their labels, and so their
    digests, are the ones before)."""
    from cute_kernels.plans.sm80 import PREFILL_Q_LOADS_FIRST_SPILLS

    assert PREFILL_Q_LOADS_FIRST_SPILLS == (("sm_89", "fp8_e4m3", 128), ("sm_90a", "fp16", 128))
    full = set(compile_variants("sm80.prefill"))
    for kv in ("bf16", "fp16", "fp8_e4m3"):
        for D in (64, 128, 256):
            for causal, lse in ((True, False), (False, True)):
                shape = dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=D,
                             group=4, page_size=16, causal=causal, write_lse=lse)
                cfg = make_prefill_config(**shape)
                on = (target, kv, D) not in PREFILL_Q_LOADS_FIRST_SPILLS
                assert cfg.q_loads_first == on and ("q_loads_first" in cfg.label()) == on
                other = make_prefill_config(q_loads_first=not cfg.q_loads_first, **shape)
                assert replace(other, q_loads_first=cfg.q_loads_first) == cfg
                if causal:  # the lean default of each (dtype, head dim) is registered, and its form before
                    assert cfg in full and replace(cfg, q_loads_first=False) in full


def test_one_cta_bound_where_ptxas_caps_the_build_at_128_registers():
    """FP8 at D 64 on sm_103a / sm_120a / sm_121a launches with one CTA per SM as its bound
    (docs/design/sm80.md#the-one-cta-bound): the PTX declares ``.minnctapersm 1`` exactly there, and
    the GQA-1 build that ptxas spilled at 128 registers without it builds spill-free."""
    from cute_kernels.jit.evidence import compile_with_evidence
    from cute_kernels.plans.sm80 import PREFILL_ONE_CTA_BOUND

    assert PREFILL_ONE_CTA_BOUND == tuple((t, "fp8_e4m3", 64) for t in ("sm_103a", "sm_120a", "sm_121a"))
    for target in TARGETS:
        for kv in ("bf16", "fp8_e4m3"):
            for D in (64, 128):
                cfg = make_prefill_config(target=target, q_dtype="bf16", kv_dtype=kv, head_dim=D, group=4, page_size=16)
                assert cfg.one_cta_bound == ((target, kv, D) in PREFILL_ONE_CTA_BOUND), cfg.label()
    cfg = make_prefill_config(target="sm_120a", q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=64, group=1,
                              page_size=16)
    for bound in (True, False):
        compiled, ev = compile_with_evidence(replace(cfg, one_cta_bound=bound), "sm_120a")
        assert (".minnctapersm 1" in compiled.ptx) == bound
        assert ("STL" in ev.sass) == (not bound), ev.summary()  # 6 STL at 128 registers without it


def test_warp_store_is_an_opt_in_on_one_token_warp_registered_on_every_target():
    """Each warp writes its own rows' output through its staged query rows (``warp_store``,
    docs/design/sm80.md#the-output-per-warp): an opt-in (1-2 % slower on the long rows than the fp32
    merge rows, measured), one override away on every prefill tiling (all have one token warp) and
    changing no other field, refused with more than one token warp; the compile matrix registers it
    on the default of every cache dtype and head dim, on every target."""
    full = set(compile_variants("sm80.prefill"))
    for target in TARGETS:
        for kv in ("bf16", "fp16", "fp8_e4m3"):
            for D in (64, 128, 256):
                shape = dict(target=target, q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=D,
                             group=4, page_size=16)
                cfg = make_prefill_config(**shape)
                assert not cfg.warp_store and cfg.warps_n == 1 and "warp_store" not in cfg.label()
                on = make_prefill_config(warp_store=True, **shape)
                assert on == replace(cfg, warp_store=True) and on in full
    with pytest.raises(ValueError, match="warp_store .* warps_n=1"):
        make_prefill_config(target="sm_80", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=4, page_size=16,
                            warps_m=2, warps_n=2, m_tiles=1, tw=16, warp_store=True)


def test_warp_store_writes_through_the_query_rows_without_a_cta_barrier():
    """The ping-pong default on sm_90a: with ``warp_store`` its epilogue is the warp's own 32-bit
    shared stores and 8-byte reads (rows / 8 x D / 16 of them per thread) with no CTA barrier after
    the main loop; the form before reads its fp32 merge rows 16 bytes at a time behind two."""
    from cute_kernels.jit.evidence import compile_with_evidence

    cfg = make_prefill_config(target="sm_90a", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=4, page_size=16,
                              warp_store=True)
    assert cfg.pingpong and cfg.m_tiles == 2
    new, _ = compile_with_evidence(cfg, "sm_90a")
    old, _ = compile_with_evidence(replace(cfg, warp_store=False), "sm_90a")
    assert new.ptx.count("ld.shared.v2.b32") == (32 // 8) * (128 // 16)
    assert new.ptx.count("st.shared.b32") >= 2 * 2 * 128 // 8  # a 32-bit pair per n8 tile and row slot
    assert "ld.shared.v2.b32" not in old.ptx
    assert old.ptx.count("bar.sync \t0;") - new.ptx.count("bar.sync \t0;") == 2, "the epilogue's two CTA barriers"
