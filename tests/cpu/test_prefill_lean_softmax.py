"""The SM90 prefill's lean softmax (the default; ``lean_softmax=False`` is the opt-out
``sm90.prefill_scaled_softmax``; docs/design/sm90-prefill.md#the-lean-softmax) on the CPU: the online
softmax of ``roles/online_softmax.py`` emulated in float32 in both forms, tile by tile as the
kernel runs it (masked tiles, rows that see nothing, P rounded to e4m3, sinks in the epilogue),
against float64 attention; the config field, the registry entry and the bench entries. The kernel
runs in tests/gpu/test_prefill_lean_softmax_gpu.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from cute_kernels.bench import prefill as bench_prefill
from cute_kernels.plans import sm90_prefill as plan
from cute_kernels.registry import KERNELS
from cute_kernels.roles.smem_fp8 import P_SHIFT

F32 = np.float32
E4M3_MAX = 448.0


def e4m3(x: np.ndarray) -> np.ndarray:
    """Round to e4m3 (saturating, as ``cvt.rn.satfinite``) and back to float32."""
    t = torch.from_numpy(np.clip(x, -E4M3_MAX, E4M3_MAX).astype(F32))
    return t.to(torch.float8_e4m3fn).to(torch.float32).numpy()


def online_softmax(S, V, scale, tile, *, lean: bool, fp8_p: bool, sink=None, limit=None):
    """Rows ``S`` (raw QK scores, [rows, n]) against ``V`` [n, D], KV tiles of ``tile`` walked from
    the last, as the kernel's consumer does; ``limit[row]``: the first masked column (the kernel's
    select; the scores past it may be NaN). Returns (out, LSE base 2, the largest P fed to the MMA)."""
    rows, n = S.shape
    row_max = np.full(rows, -np.inf, F32)
    row_sum = np.zeros(rows, F32)
    out = np.zeros((rows, V.shape[1]), F32)
    p_log2 = P_SHIFT if (lean and fp8_p) else 0
    scale = F32(scale)
    p_max = 0.0
    for start in reversed(range(0, n, tile)):
        cols = np.arange(start, min(start + tile, n))
        acc = S[:, cols].astype(F32)
        if limit is not None:
            acc = np.where(cols[None, :] >= limit[:, None], F32(-np.inf), acc)
        if lean:  # the max over the raw scores (scale > 0), then one FFMA per score
            t = acc.max(axis=1) * scale
        else:
            acc = (acc * scale).astype(F32)
            t = acc.max(axis=1)
        new_max = np.maximum(row_max, t)
        shift = np.where(new_max == -np.inf, F32(0), new_max).astype(F32)
        alpha = np.exp2(row_max - shift).astype(F32)
        if lean:
            # a single rounding of acc * scale - (shift - p_log2), as fma.rn.f32
            arg = (acc.astype(np.float64) * np.float64(scale) + (np.float64(p_log2) - shift)[:, None]).astype(F32)
        else:
            arg = (acc - shift[:, None]).astype(F32)
        p = np.exp2(arg).astype(F32)
        row_max, row_sum = new_max, (row_sum * alpha + p.sum(axis=1, dtype=F32)).astype(F32)
        if fp8_p:
            p_mma = e4m3(p) if lean else e4m3((p * F32(2.0 ** P_SHIFT)).astype(F32))
        else:
            p_mma = p
        p_max = max(p_max, float(np.abs(p_mma).max()) if p_mma.size else 0.0)
        keep = alpha if (not lean or (alpha < 1).any()) else np.ones_like(alpha)  # the warp's skip is exact
        out = (out * keep[:, None] + p_mma @ V[cols].astype(F32)).astype(F32)
    out_scale = F32(2.0 ** -P_SHIFT) if (fp8_p and not lean) else F32(1.0)
    if lean:
        row_max = (row_max - F32(p_log2)).astype(F32)  # reference_shift
    if sink is not None:  # add_sink
        big = np.maximum(row_max, F32(sink))
        keep = np.where(row_max == -np.inf, F32(0), np.exp2(row_max - big)).astype(F32)
        row_sum = (row_sum * keep + np.exp2(F32(sink) - big)).astype(F32)
        out = (out * keep[:, None]).astype(F32)
        row_max = big
    inv = np.where(row_sum > 0, out_scale / np.where(row_sum > 0, row_sum, 1), 0).astype(F32)
    lse = np.where(row_sum > 0, row_max + np.log2(np.where(row_sum > 0, row_sum, 1)), -np.inf)
    return out * inv[:, None], lse, p_max


def attention64(S, V, scale, sink=None, limit=None):
    """float64 softmax(S * scale) V and its base-2 LSE (masked past ``limit``; a sink joins the
    denominator)."""
    z = S.astype(np.float64) * scale
    if limit is not None:
        z = np.where(np.arange(S.shape[1])[None, :] >= limit[:, None], -np.inf, z)
    cols = [z] if sink is None else [z, np.full((S.shape[0], 1), float(sink))]
    zz = np.concatenate(cols, axis=1)
    m = zz.max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    w = np.exp2(zz - m)
    denom = w.sum(axis=1)
    out = np.where(denom[:, None] > 0, (w[:, :S.shape[1]] @ V.astype(np.float64)) / np.where(denom > 0, denom, 1)[:, None], 0)
    lse = np.where(denom > 0, m[:, 0] + np.log2(np.where(denom > 0, denom, 1)), -np.inf)
    return out, lse


@pytest.mark.parametrize("fp8_p", [False, True], ids=["16-bit P", "e4m3 P"])
@pytest.mark.parametrize("seed", range(4))
def test_both_forms_meet_float64_attention(fp8_p, seed):
    """The lean form computes the same attention as the default form: outputs within the P
    rounding's error of float64 (and of each other), LSEs within fp32's, the e4m3 P inside e4m3's
    range (P <= 2^P_SHIFT), with causal-style masks, NaN scores past the mask, rows that see no key
    and a sink."""
    rng = np.random.default_rng(seed)
    rows, n, D, tile = 16, 300, 32, 64
    S = (rng.standard_normal((rows, n)) * 6).astype(F32)
    V = rng.standard_normal((n, D)).astype(F32)
    limit = rng.integers(0, n + 1, rows)
    limit[0], limit[1] = 0, n  # a row that sees nothing, a row that sees everything
    S[np.arange(n)[None, :] >= limit[:, None]] = np.nan  # the kernel selects them away
    scale = 0.125 * 1.4426950408889634
    sink = 2.5 if seed % 2 else None
    want, want_lse = attention64(np.nan_to_num(S, nan=0.0), V, scale, sink=sink, limit=limit)
    outs = {}
    for lean in (False, True):
        out, lse, p_max = online_softmax(S, V, scale, tile, lean=lean, fp8_p=fp8_p, sink=sink, limit=limit)
        assert np.isfinite(out).all()
        err = np.linalg.norm(out - want) / np.linalg.norm(want)
        assert err <= (6e-2 if fp8_p else 1e-5), (lean, err)
        fin = np.isfinite(want_lse)
        assert (np.isfinite(lse) == fin).all()
        assert np.abs(lse[fin] - want_lse[fin]).max() <= 1e-4, lean
        if fp8_p:
            assert p_max <= 2.0 ** P_SHIFT <= E4M3_MAX
        outs[lean] = out
    assert np.linalg.norm(outs[True] - outs[False]) / np.linalg.norm(want) <= (2e-2 if fp8_p else 1e-5)
    assert not outs[True][0].any()  # the row that saw nothing: 0 (its LSE -inf, or the sink's)


def test_the_rescale_skip_is_exact():
    """A warp skips O's rescale only when every alpha of its rows is 1 (alpha <= 1 always): o * 1 is o."""
    o = np.random.default_rng(0).standard_normal(1000).astype(F32)
    assert np.array_equal(o * F32(1.0), o)


FP8Q = dict(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16)


@pytest.mark.parametrize("problem", [FP8Q, dict(q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=8, page_size=16),
                                     dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=256, group=4, page_size=32)])
def test_lean_softmax_field(problem):
    """On by default and out of the label; off, it names itself, keeps everything else (tiles,
    schedule, shared memory), and belongs to the opt-out's entry and family."""
    default = plan.make_prefill_config(**problem)
    scaled = plan.make_prefill_config(**problem, lean_softmax=False)
    assert default.lean_softmax and "lean_softmax" not in default.label()
    assert scaled.label() == default.label()[:-1] + ",lean_softmax=False]"
    assert replace(scaled, lean_softmax=True) == default and plan.smem_bytes(scaled) == plan.smem_bytes(default)
    assert plan.check_registry_id(default) == plan.registry_id(problem["q_dtype"], problem["kv_dtype"])
    assert plan.check_registry_id(scaled) == plan.SCALED_SOFTMAX_ID
    assert plan.config_family(default) == plan.family(problem["q_dtype"], problem["kv_dtype"], problem["head_dim"])
    assert plan.config_family(scaled) == plan.config_family(default) + "/scaled_softmax"
    assert plan.config_family(scaled) == KERNELS[plan.SCALED_SOFTMAX_ID].family(
        problem["q_dtype"], problem["kv_dtype"], problem["head_dim"])
    both = plan.make_prefill_config(**problem, lean_softmax=False, window=True, sinks=True)
    assert plan.check_registry_id(both) == plan.SCALED_SOFTMAX_ID
    assert plan.config_family(both).endswith("/scaled_softmax+window+sinks")


def test_scaled_softmax_registry_entry():
    """The former default, verified on the GPU, opt-out only (``tuning_override(lean_softmax=False)``);
    its compile matrix covers every kind and head dim, each q_scale form and a window with sinks; every
    other entry's variants run the lean softmax."""
    info = KERNELS[plan.SCALED_SOFTMAX_ID]
    assert info.status == "available" and info.opt_in and info.call_site is None
    variants = info.variants()
    assert all(not v.lean_softmax and plan.check_registry_id(v) == info.id for v in variants)
    assert {v.kind for v in variants} == {"16", "widen", "fp8"}
    assert {v.head_dim for v in variants if v.kind == "fp8"} == {64, 128, 256}
    assert {v.q_scale for v in variants if v.kind == "fp8"} == {"scalar", "tensor", "per_head"}
    assert any(v.window and v.sinks and v.kind == "fp8" and not v.lean_softmax for v in variants)
    assert all(v.lean_softmax for kid, k in KERNELS.items() if kid.startswith("sm90.prefill")
               and kid != info.id for v in k.variants())


def test_bench_entries():
    """``ours_scaled`` / ``ours_fp8q_scaled`` are ``ours`` / ``ours_fp8q`` under the opt-out: the A/B."""
    assert {"ours_scaled", "ours_fp8q_scaled"} <= set(bench_prefill.PEERS)
    assert bench_prefill.ENTRIES["ours_scaled"].func is bench_prefill.ours
    assert bench_prefill.ENTRIES["ours_scaled"].keywords == {"lean_softmax": False}
    assert bench_prefill.ENTRIES["ours_fp8q_scaled"].func is bench_prefill.ours_fp8q
    assert bench_prefill.ENTRIES["ours_fp8q_scaled"].keywords == {"lean_softmax": False}
