"""The portable SM80-class kernels on the CPU: the FP8 bit-trick widening proven exact for every
e4m3 code (numpy emulation of the same shifts and masks), the query permutation, the plan's
per-arch budgets and configs, and (compile tier) builds that hold only SM80 instructions."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from cute_kernels.plans.sm80 import (
    CVT_TARGETS,
    PDL_TARGETS,
    SMEM_PER_BLOCK,
    TARGETS,
    Sm80DecodeConfig,
    Sm80PrefillConfig,
    decode_splits,
    make_decode_config,
    make_prefill_config,
    mma_dtype,
)
from cute_kernels.roles.fp8_widen_sw import BITS_SCALE_LOG2, NAN_AS, emulate_bits, qk_permutation


def test_bit_trick_is_exact_for_every_e4m3_code():
    codes = np.arange(256, dtype=np.uint8)
    got = emulate_bits(codes)
    want = torch.from_numpy(codes).view(torch.float8_e4m3fn).double().numpy()
    nan = np.isnan(want)
    assert nan.sum() == 2 and set(codes[nan]) == {0x7F, 0xFF}
    np.testing.assert_array_equal(got[~nan], want[~nan])  # subnormals, zeros and both signs included
    assert list(got[nan]) == [NAN_AS, -NAN_AS]  # the documented NaN policy
    # the widened values themselves are fp16 numbers (exact products by 2^-8)
    assert np.all(np.float16(got[~nan] * 2.0 ** -BITS_SCALE_LOG2).astype(np.float64) == got[~nan] * 2.0 ** -8)


@pytest.mark.parametrize("method", ["bits", "cvt"])
def test_query_permutation_is_a_bijection_of_each_block(method):
    perm = [qk_permutation(k, method) for k in range(16)]
    assert sorted(perm) == list(range(16))
    # lane group t's two registers hold head dims 4t .. 4t+3 (one ldmatrix register of K)
    for t in range(4):
        assert sorted(perm[k] for k in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)) == [4 * t + i for i in range(4)]


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
    for group, q_len in ((1, 1), (8, 1), (16, 4)):
        for split in (False, True):
            c = make_decode_config(target=target, q_dtype="bf16", kv_dtype=kv, head_dim=D, group=group, q_len=q_len,
                                   page_size=16, split=split)
            assert c.smem_bytes() <= SMEM_PER_BLOCK[target] and c.targets == (target,)
            assert c.rows >= group * q_len and c.threads <= 128
            assert c.widen == ("cvt" if kv == "fp8_e4m3" and target in CVT_TARGETS else "bits")
            assert c.pdl == (target in PDL_TARGETS)
    p = make_prefill_config(target=target, q_dtype="bf16", kv_dtype=kv, head_dim=D, group=4, page_size=16)
    assert p.smem_bytes() <= SMEM_PER_BLOCK[target] and p.rows == 64


def test_small_smem_sizing_runs_anywhere():
    """``smem_target`` sizes the ring for a 99 KB arch while compiling for another (the H200
    tests run the SM86/SM120 tilings this way)."""
    c = make_decode_config(target="sm_90a", q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=8, q_len=1,
                           page_size=16, split=False, smem_target="sm_86")
    assert c.target == "sm_90a" and c.smem_bytes() <= SMEM_PER_BLOCK["sm_86"]


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
    assert [a.name for a in d.signature()] == ["q", "k_cache", "v_cache", "block_table", "seq_lens", "part_out",
                                              "part_lse", "k_scale", "v_scale", "sm_scale"]
    p = make_prefill_config(target="sm_120a", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=4, page_size=16)
    assert [a.name for a in p.signature()] == ["q", "kv_cache", "block_table", "seq_lens", "query_start_loc", "out",
                                              "k_scale", "v_scale", "sm_scale", "max_query_len"]
    p = make_prefill_config(target="sm_120a", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=4, page_size=16,
                            write_lse=True)
    assert "lse" in [a.name for a in p.signature()]


def test_split_schedule_from_shapes_only():
    assert decode_splits(items=8, max_context=32000, num_sms=132, tile=64) == 33  # one wave of 2 CTAs per SM
    assert decode_splits(items=1024, max_context=32000, num_sms=132, tile=64) == 1
    assert decode_splits(items=1, max_context=100, num_sms=132, tile=64) == 2  # never more splits than tiles
    assert decode_splits(items=1, max_context=10 ** 6, num_sms=132, tile=64) == 64  # capped
    assert decode_splits(items=1, max_context=100, num_sms=132, tile=64, num_splits=5) == 5


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
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", ptx)  # zero-filling copies
    for absent in ("wgmma", "cp.async.bulk", "tcgen05", "mbarrier", "cvt.rn.f16x2.e4m3x2", "setmaxnreg"):
        assert absent not in ptx, absent
    assert ("griddepcontrol" in ptx) == (target == "sm_90a")  # PDL only where it exists
