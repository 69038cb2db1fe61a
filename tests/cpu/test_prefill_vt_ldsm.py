"""The FP8-query prefill's V^T transpose by ``ldmatrix.trans`` + ``stmatrix`` (``vt_transpose="ldsm"``,
the FP8 query's default; docs/design/sm90-prefill.md#fp8) on the CPU: the lane bookkeeping emulated
byte for byte (the V^T it writes is the word transpose's, rows past ``valid`` zero, every 8-row matrix
phase on 8 distinct 16-byte bank groups of both swizzles), the config field and its kind-dependent
default, the word-wise opt-out's registry entry (``sm90.prefill_fp8q_words``) and the bench entries.
The kernel runs in tests/gpu/test_prefill_vt_ldsm_gpu.py."""

from __future__ import annotations

import random
from dataclasses import fields, replace

import pytest

from cute_kernels.bench import prefill as bench_prefill
from cute_kernels.plans import sm90_prefill as plan
from cute_kernels.registry import KERNELS
from cute_kernels.roles.smem_fp8 import PRMT_DIM_EVEN, PRMT_DIM_ODD, ldsm_rows, ldsm_unit, p_token

from .conftest import SM90_FAMILIES
from .test_prefill_fragments import prmt

FP8Q = dict(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16)


def bank_group(row: int, col: int, row_bytes: int) -> int:
    """The 16-byte bank group (of 8 per 128 bytes) of byte ``col`` of row ``row`` in a tile of
    ``row_bytes``-byte rows under its WGMMA swizzle (128 B for rows of 128 bytes or more, else 64 B)."""
    chunk = col // 16
    if row_bytes >= 128:
        return (chunk % 8) ^ (row % 8)
    assert row_bytes == 64
    return (row % 2) * 4 + ((chunk % 4) ^ ((row // 2) % 4))


def keep_mask(v: int) -> int:
    """``token_keep_mask`` (inline PTX): bytes of tokens a, a+1, a+8, a+9 inside ``valid = a + v``."""
    return sum(0xFF << (8 * i) for i, off in enumerate((0, 1, 8, 9)) if v > off)


def ldsm_transpose(V, tile_n: int, D: int, valid: int, nthreads: int = 128):
    """Emulates ``transpose_tile_ldsm`` over a warpgroup: V[token][d] bytes -> V^T[d][k]."""
    Vt = [[None] * tile_n for _ in range(D)]
    warps, t16 = nthreads // 32, tile_n // 16
    for it in range(t16 * (D // 32) // warps):
        for warp in range(warps):
            h, c = ldsm_unit(it * warps + warp, t16)
            # ldmatrix.x4.trans: lane l addresses row l % 8 of matrix l // 8 (16 bytes = 8 b16)
            rows = {}
            for lane in range(32):
                (tok, dim), _ = ldsm_rows(lane)
                rows[lane // 8, lane % 8] = (16 * h + tok, 32 * c + dim)
            for m in range(4):
                assert len({bank_group(t, d, D) for t, d in (rows[m, r] for r in range(8))}) == 8, "ldmatrix conflict"
            regs = []
            for lane in range(32):
                r = []
                for m in range(4):  # .trans: lane l gets b16 column l // 4 of rows 2 (l % 4), 2 (l % 4) + 1
                    word = 0
                    for half, row in enumerate((2 * (lane % 4), 2 * (lane % 4) + 1)):
                        tok, d = rows[m, row]
                        b16 = V[tok][d + 2 * (lane // 4)] | V[tok][d + 2 * (lane // 4) + 1] << 8
                        word |= b16 << (16 * half)
                    r.append(word)
                odd = (lane // 16) % 2
                sel0 = PRMT_DIM_ODD if odd else PRMT_DIM_EVEN
                sel1 = PRMT_DIM_EVEN if odd else PRMT_DIM_ODD
                w = [prmt(r[0], r[1], sel0), prmt(r[0], r[1], sel1), prmt(r[2], r[3], sel0), prmt(r[2], r[3], sel1)]
                if valid < tile_n:
                    w = [x & keep_mask(valid - (16 * h + 2 * (lane % 4))) for x in w]
                regs.append(w)
            # stmatrix.x4: lane l addresses row l % 8 of matrix l // 8; register j of lane l goes
            # to row l // 4 of matrix j, bytes 4 (l % 4)..+3
            dst = {(lane // 8, lane % 8): (32 * c + ldsm_rows(lane)[1], 16 * h) for lane in range(32)}
            for m in range(4):
                assert len({bank_group(d, k, tile_n) for d, k in (dst[m, r] for r in range(8))}) == 8, \
                    "stmatrix conflict"
            for lane in range(32):
                for m in range(4):
                    d, k0 = dst[m, lane // 4]
                    for i in range(4):
                        k = k0 + 4 * (lane % 4) + i
                        assert Vt[d][k] is None, "written twice"
                        Vt[d][k] = (regs[lane][m] >> (8 * i)) & 0xFF
    return Vt


@pytest.mark.parametrize("tile_n,D,valid", [(128, 128, 128), (128, 64, 128), (64, 256, 64), (128, 128, 77),
                                            (64, 256, 1), (128, 64, 120), (64, 64, 9)])
def test_ldsm_transpose_writes_the_word_transposes_vt(tile_n, D, valid):
    """Every V^T byte once: K index k holds token ``32 (k // 32) + p_token(k % 32)`` (the order the
    word transpose stores, which P's registers feed), zero at tokens ``>= valid``; each ldmatrix /
    stmatrix matrix reads or writes 8 distinct bank groups."""
    seed = tile_n * 1000 + D + valid
    rng = random.Random(seed)
    V = [[rng.randrange(1, 256) for _ in range(D)] for _ in range(tile_n)]  # never zero: a zero must be masked
    Vt = ldsm_transpose(V, tile_n, D, valid)
    for d in range(D):
        for k in range(tile_n):
            tok = 32 * (k // 32) + p_token(k % 32)
            assert Vt[d][k] == (V[tok][d] if tok < valid else 0), f"seed {seed}: d {d} k {k}"


def test_vt_transpose_field():
    """The FP8 query transposes by ldmatrix unless asked for words; its label names only the opt-out,
    and an explicit ``"ldsm"`` is the default config itself (one compile key, one label)."""
    default = plan.make_prefill_config(**FP8Q)
    words = plan.make_prefill_config(**FP8Q, vt_transpose="words")
    assert default.vt_transpose == "ldsm" and "vt_transpose" not in default.label()
    assert plan.make_prefill_config(**FP8Q, vt_transpose="ldsm") == default
    assert plan.Sm90PrefillConfig(**{f.name: getattr(default, f.name) for f in fields(default)
                                     if f.name != "vt_transpose"}) == default  # the dataclass default too
    assert words.label().endswith(",vt_transpose=words]") and replace(words, vt_transpose="ldsm") == default
    assert words.label()[:-len(",vt_transpose=words]")] == default.label()[:-1]
    assert plan.smem_bytes(words) == plan.smem_bytes(default)
    assert plan.check_registry_id(default) == "sm90.prefill_fp8q" and plan.check_registry_id(words) == plan.VT_WORDS_ID
    assert plan.config_family(default) == "sm90.prefill_fp8q/fp8/d128"
    assert plan.config_family(words) == SM90_FAMILIES[plan.VT_WORDS_ID]("fp8_e4m3", "fp8_e4m3", 128) == \
        "sm90.prefill_fp8q/fp8/d128/vt_words"
    two = plan.make_prefill_config(**FP8Q, q_terms=2)
    two_words = plan.make_prefill_config(**FP8Q, vt_transpose="words", q_terms=2)
    assert two.vt_transpose == "ldsm" and two.label().endswith(",q_terms=2]")
    assert plan.check_registry_id(two) == plan.check_registry_id(two_words) == plan.TWO_TERM_ID  # both self-check
    assert plan.config_family(two).endswith("/two_term") and plan.config_family(two_words).endswith("/two_term+vt_words")
    ev = dict(default.evidence["sm_90a"])
    assert ev["V^T ldmatrix.trans"].startswith(r"ldmatrix\.sync") and ev["V^T stmatrix"].startswith(r"stmatrix\.sync")
    assert "V^T stmatrix" not in dict(words.evidence["sm_90a"])


@pytest.mark.parametrize("q,kv", [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8_e4m3"), ("fp16", "fp8_e4m3")])
def test_other_kinds_keep_words_and_their_labels(q, kv):
    """No other kind transposes V: its field stays "words" (explicit or not, one config), which its
    label never names, so no label of theirs changed with the FP8 query's default."""
    cfg = plan.make_prefill_config(q_dtype=q, kv_dtype=kv, head_dim=128, group=8, page_size=16)
    assert cfg.vt_transpose == "words" and "vt_transpose" not in cfg.label()
    assert plan.make_prefill_config(q_dtype=q, kv_dtype=kv, head_dim=128, group=8, page_size=16,
                                    vt_transpose="words") == cfg
    assert plan.check_registry_id(cfg) == "sm90.prefill" and "vt_words" not in plan.config_family(cfg)


@pytest.mark.parametrize("bad", [dict(FP8Q, vt_transpose="lds"),
                                 dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16,
                                      vt_transpose="ldsm"),
                                 dict(q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=8, page_size=16,
                                      vt_transpose="ldsm")])
def test_vt_transpose_refused(bad):
    with pytest.raises(ValueError, match="vt_transpose must be one of"):
        plan.make_prefill_config(**bad)


def test_vt_words_registry_entry():
    """The opt-out is the former default (verified on the GPU): available, opt-in, the FP8 query's
    compile matrix with words (the two-term one in the two-term entry); the defaults transpose by ldmatrix."""
    info = KERNELS[plan.VT_WORDS_ID]
    assert info.status == "available" and info.opt_in and info.call_site is None
    assert info.kv_dtypes == ("fp8_e4m3",) and info.qk_dtype == "fp8_e4m3"
    variants = info.variants()
    assert all(v.vt_transpose == "words" and v.kind == "fp8" for v in variants)
    assert all(plan.check_registry_id(v) == info.id for v in variants)
    assert {v.head_dim for v in variants} == {64, 128, 256} and {v.tile_n for v in variants} == {64, 128}
    assert [replace(v, vt_transpose="ldsm") for v in variants] == plan.fp8_query_compile_variants()
    assert {v.vt_transpose for v in KERNELS[plan.TWO_TERM_ID].variants()} == {"ldsm", "words"}
    assert all(v.vt_transpose == "ldsm" for v in KERNELS["sm90.prefill_fp8q"].variants())
    assert "sm90.prefill_fp8q_ldsm" not in KERNELS


def test_bench_entries():
    """``ours_fp8q`` runs the default (ldmatrix) transpose, ``ours_fp8q_words`` the opt-out: the A/B."""
    assert {"ours_fp8q", "ours_fp8q_words"} <= set(bench_prefill.PEERS) and "ours_fp8q_ldsm" not in bench_prefill.ENTRIES
    assert bench_prefill.ENTRIES["ours_fp8q"] is bench_prefill.ours_fp8q
    assert bench_prefill.ENTRIES["ours_fp8q_words"].keywords == {"vt_transpose": "words"}
