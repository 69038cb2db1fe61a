"""The merge recurrences of the device code, emulated in fp32 on the CPU, against an exact float64
merge for any finite LSE (docs/design/merge.md#any-finite-lse).

Three recurrences combine split partials ``(O_s, L_s)``:

- ``RowMerge.merge_groups`` (``roles/merge.py``: ``merge_states`` and the QSA merge): groups of
  splits, a running max, the sums rescaled when it moves;
- the QSA merge's lanes (``sm90/qsa_merge.py``): ``lanes`` threads each merge every
  ``lanes``-th split with ``merge_groups``, then combine their states with butterfly shuffles;
- ``SplitMerge.merge_row_chunk`` (``roles/split_merge.py``: the decode's fused and cluster merges).

Each model below follows its kernel line by line (fp32 arithmetic, ``ex2.approx.ftz`` flushing to
0 and overflowing to inf, loads past the last split predicated off or clamped, empty splits
selected away) and is fed LSEs of magnitude up to 1e4 with mixed signs and empty splits. The
recurrence as it was before the fix (the sums rescaled from a shift of 0 while every split so far
was empty) is modelled too: for a first non-empty group whose max is below -128 it gives NaN,
which is what the GPU showed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

F32 = np.float32
NEG_INF = F32(-np.inf)
_TINY = 2.0 ** -126


def ex2(x) -> np.float32:
    """``ex2.approx.ftz.f32``: 2^x in fp32, subnormal results flushed to 0, inf past 2^128."""
    with np.errstate(over="ignore"):
        r = np.exp2(F32(x), dtype=F32)
    return F32(0.0) if 0 < abs(float(r)) < _TINY else r


def lg2(x) -> np.float32:
    return np.log2(F32(x), dtype=F32)


def fmax(a, b) -> np.float32:
    return F32(np.fmax(F32(a), F32(b)))


def add_split(acc, vals, lse, shift):
    """``roles.merge.add_split``: acc += 2^(lse - shift) * vals, an empty split selected away."""
    w = ex2(F32(lse) - F32(shift))
    keep = w > 0
    for e in range(len(acc)):
        acc[e] = F32(acc[e] + (F32(vals[e] * w) if keep else F32(0.0)))
    return w


def merge_groups(lses, parts, group, first=0, stride=1, *, fixed=True):
    """``RowMerge.merge_groups``: (acc, weight_sum, shift). ``fixed=False``: the sums rescaled
    from ``shift`` (0 while every split so far is empty), as before the fix."""
    S, D = parts.shape
    acc = [F32(0.0)] * D
    weight_sum = F32(0.0)
    shift = F32(0.0)
    lse_max = NEG_INF
    for s0 in range(first, S, group * stride):
        idx = [s0 + j * stride for j in range(group)]
        grp = [F32(lses[s]) if s < S else NEG_INF for s in idx]  # past the last split: empty
        vals = [parts[s] if s < S else np.full(D, np.nan, dtype=F32) for s in idx]
        prev_max = lse_max
        for v in grp:
            lse_max = fmax(lse_max, v)
        new_shift = lse_max if lse_max != NEG_INF else F32(0.0)
        scale = ex2(F32(prev_max - new_shift) if fixed else F32(shift - new_shift))
        with np.errstate(invalid="ignore"):  # the recurrence before the fix: 0 * inf
            acc = [F32(a * scale) for a in acc]
            weight_sum = F32(weight_sum * scale)
        shift = new_shift
        for v, p in zip(grp, vals):
            weight_sum = F32(weight_sum + add_split(acc, p, v, shift))
    return acc, weight_sum, shift


def finish(acc, weight_sum, shift):
    """The merge kernel's output: ``O = acc * inv`` with ``inv = 1 / weight_sum`` (0 unless the
    sum is positive), ``L = shift + log2(weight_sum)`` (-inf unless it is positive)."""
    inv = F32(F32(1.0) / weight_sum) if weight_sum > 0 else F32(0.0)
    with np.errstate(invalid="ignore"):
        out = np.array([F32(a * inv) for a in acc], dtype=F32)
    return out, F32(shift + lg2(weight_sum)) if weight_sum > 0 else NEG_INF


def merge_states_model(lses, parts, *, fixed=True):
    """``MergeStates.merge_row``: groups of 2 for S <= 2, else of 8."""
    group = 2 if len(lses) <= 2 else 8
    return finish(*merge_groups(lses, parts, group, fixed=fixed))


def qsa_merge_model(lses, parts, group, lanes, *, fixed=True):
    """``QsaMerge.merge_row`` with ``lanes`` threads per chunk: each merges splits ``sub, sub +
    lanes, ...``, then the states combine with butterfly shuffles (rescaled to the larger max; an
    empty state has max -inf and weight 0)."""
    states = []
    for sub in range(lanes):
        acc, ws, shift = merge_groups(lses, parts, group, sub, lanes, fixed=fixed)
        states.append([acc, ws, shift if ws > 0 else NEG_INF])
    k = 1
    while k < lanes:
        nxt = []
        for i in range(lanes):
            acc, ws, m = states[i]
            acc_o, ws_o, m_o = states[i ^ k]
            m_new = fmax(m, m_o)
            sh = m_new if m_new != NEG_INF else F32(0.0)
            a, b = ex2(F32(m - sh)), ex2(F32(m_o - sh))
            nxt.append([[F32(F32(x * a) + F32(y * b)) for x, y in zip(acc, acc_o)], F32(F32(ws * a) + F32(ws_o * b)),
                        m_new])
        states, k = nxt, 2 * k
    acc, ws, m = states[0]
    return finish(acc, ws, m if m != NEG_INF else F32(0.0))


def decode_chunk_model(lses, parts, group):
    """``SplitMerge.merge_row_chunk``: indices past the last split clamped to it and weighted as
    empty; the running max starts at -inf."""
    S, D = parts.shape
    m = NEG_INF
    total = F32(0.0)
    acc = [F32(0.0)] * D
    for g in range((S + group - 1) // group):
        idx = [min(g * group + j, S - 1) for j in range(group)]
        grp = [F32(lses[s]) if g * group + j < S else NEG_INF for j, s in enumerate(idx)]
        new_m = m
        for v in grp:
            new_m = fmax(new_m, v)
        shift = new_m if new_m != NEG_INF else F32(0.0)
        alpha = ex2(F32(m - shift))
        total = F32(total * alpha)
        acc = [F32(a * alpha) for a in acc]
        for v, s in zip(grp, idx):
            total = F32(total + add_split(acc, parts[s], v, shift))
        m = new_m
    return finish(acc, total, m)


def exact_merge(lses, parts):
    """float64: ``L = log2 sum 2^L_s``, ``O = sum 2^(L_s - L) O_s`` over the non-empty splits."""
    live = [s for s, v in enumerate(lses) if v != -math.inf]
    if not live:
        return np.zeros(parts.shape[1]), -math.inf
    m = max(float(lses[s]) for s in live)
    w = np.array([2.0 ** (float(lses[s]) - m) for s in live])
    out = (w[:, None] * parts[live].astype(np.float64)).sum(0) / w.sum()
    return out, m + math.log2(w.sum())


def check(got, want, lses):
    out, lse = got
    ref_out, ref_lse = want
    assert not np.isnan(out).any(), f"NaN output for LSEs {list(lses)}"
    assert not math.isnan(float(lse)), f"NaN LSE for LSEs {list(lses)}"
    if ref_lse == -math.inf:
        assert lse == -np.inf and not out.any()
        return
    assert abs(float(lse) - ref_lse) <= 1e-6 * max(1.0, abs(ref_lse)) + 1e-5, (float(lse), ref_lse, list(lses))
    scale = max(1.0, float(np.abs(ref_out).max()))
    assert np.abs(out.astype(np.float64) - ref_out).max() <= 2e-5 * scale, list(lses)


_FINITE = st.floats(-1e4, 1e4, allow_nan=False, width=32)
_LSE = st.one_of(_FINITE, st.floats(-400, 400, allow_nan=False, width=32), st.just(-math.inf))


@st.composite
def splits(draw, max_splits=40):
    S = draw(st.integers(1, max_splits))
    lses = np.array(draw(st.lists(_LSE, min_size=S, max_size=S)), dtype=F32)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    parts = rng.standard_normal((S, 4)).astype(F32)
    parts[lses == -np.inf] = np.nan  # an empty split's partial is garbage, never read into the sum
    return lses, parts


_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(splits())
def test_merge_states_recurrence_is_exact_for_any_finite_lse(case):
    lses, parts = case
    check(merge_states_model(lses, parts), exact_merge(lses, parts), lses)


@_SETTINGS
@given(splits(), st.sampled_from([(4, 1), (8, 1), (16, 1), (2, 2), (4, 2), (8, 4)]))
def test_qsa_merge_recurrence_is_exact_for_any_finite_lse(case, shape):
    lses, parts = case
    group, lanes = shape
    check(qsa_merge_model(lses, parts, group, lanes), exact_merge(lses, parts), lses)


@_SETTINGS
@given(splits(), st.sampled_from([8, 16]))
def test_decode_merge_recurrence_is_exact_for_any_finite_lse(case, group):
    """The decode's fused and cluster merges start their running max at -inf: exact already."""
    lses, parts = case
    check(decode_chunk_model(lses, parts, group), exact_merge(lses, parts), lses)


@pytest.mark.parametrize("lses", [
    [-300.0, -301.0],  # the first group's max below -128
    [-math.inf, -math.inf, -200.0],  # empty splits first
    [-math.inf] * 8 + [-1000.0, -999.5],  # a whole empty group, then a very negative one
    [-9000.0, -8000.0, -math.inf],
])
def test_recurrence_before_the_fix_gave_nan(lses):
    """The inputs that broke ``merge_states``: the old recurrence (the sums rescaled from a shift
    of 0) gives NaN on them, the current one the exact merge."""
    lses = np.array(lses, dtype=F32)
    parts = np.random.default_rng(0).standard_normal((len(lses), 4)).astype(F32)
    parts[lses == -np.inf] = np.nan
    old_out, old_lse = merge_states_model(lses, parts, fixed=False)
    assert np.isnan(old_out).any() or math.isnan(float(old_lse))
    check(merge_states_model(lses, parts), exact_merge(lses, parts), lses)
    check(qsa_merge_model(lses, parts, 4, 2), exact_merge(lses, parts), lses)


def test_all_empty_rows_give_zero_and_minus_inf():
    lses = np.full(5, -np.inf, dtype=F32)
    parts = np.full((5, 4), np.nan, dtype=F32)
    for got in (merge_states_model(lses, parts), qsa_merge_model(lses, parts, 4, 2), decode_chunk_model(lses, parts, 8)):
        out, lse = got
        assert lse == -np.inf and not np.isnan(out).any() and not out.any()
