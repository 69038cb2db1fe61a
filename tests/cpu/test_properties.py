"""Property tests of the reference (the contract every kernel is tested against), with
``hypothesis``: random shapes and inputs, each op against an independent float64 formula written
with plain loops (tests/cpu/test_reference.py, tests/cpu/test_qsa_reference.py). A failure prints
the drawn example (hypothesis shrinks it); ``--hypothesis-seed=N`` replays a run.

Drawn: head dims, GQA ratios, page sizes (1 and non-powers of two included), layouts, containers,
dtypes, q_len, block tables with -1 and out-of-range pages and lengths of 0, 1, page boundaries
and past the table's capacity; scales as floats and 0-d tensors; LSEs of any finite value with
empty splits; FP8 inputs across the whole e4m3 range; QSA selections with every kind of invalid
entry.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cute_kernels import reference as ref
from tests.cpu.test_qsa_reference import formula as qsa_formula
from tests.cpu.test_qsa_reference import make_qsa_case
from tests.cpu.test_reference import LSE_TOL, OUT_TOL, make_cache, naive_decode, naive_merge, rne_fp8_codes

BF16, FP16, FP8, F64 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float64
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.data_too_large])


def _scale(draw, lo, hi):
    v = draw(st.floats(lo, hi))
    return torch.tensor(v) if draw(st.booleans()) else v


# ----------------------------------------------------------------------------------------------
# paged_decode
# ----------------------------------------------------------------------------------------------


@st.composite
def decode_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    Hkv, group, D = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.sampled_from([8, 16, 24]))
    page = draw(st.sampled_from([1, 3, 4, 16]))
    q_len, B, W = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(0, 5))
    P = draw(st.integers(1, 12))
    layout, container = draw(st.sampled_from(["HND", "NHD"])), draw(st.sampled_from(["single", "tuple"]))
    kv_dtype = draw(st.sampled_from([BF16, FP16, FP8]))
    cap = W * page
    lens = draw(st.lists(st.one_of(st.integers(0, cap + 6), st.sampled_from([0, 1, page, cap, cap + 1])),
                         min_size=B, max_size=B))
    table = torch.tensor(draw(st.lists(st.lists(st.integers(-2, P + 1), min_size=W, max_size=W), min_size=B,
                                       max_size=B)), dtype=torch.int32).view(B, W)
    kv = make_cache(g, layout=layout, container=container, dtype=kv_dtype, P=P, Hkv=Hkv, page=page, D=D,
                    scale=32.0 if kv_dtype == FP8 else 1.5)
    q_dtype = FP16 if kv_dtype == FP16 else BF16
    q = torch.randn(B * q_len, group * Hkv, D, generator=g).to(q_dtype)
    lo = 0.01 if kv_dtype == FP8 else 0.5
    scales = dict(k_scale=_scale(draw, lo, 4 * lo), v_scale=_scale(draw, lo, 4 * lo))
    return q, kv, layout, table, torch.tensor(lens, dtype=torch.int32), q_len, scales


@SETTINGS
@given(decode_cases())
def test_paged_decode_reference_against_loops(case):
    q, kv, layout, table, lens, q_len, scales = case
    out, lse = ref.paged_decode(q, kv, table, lens, kv_layout=layout, q_len_per_req=q_len, return_lse=True, **scales)
    want, want_lse = naive_decode(q, kv, layout, table, lens, q_len, k_scale=float(scales["k_scale"]),
                                  v_scale=float(scales["v_scale"]))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), want, **OUT_TOL[out.dtype])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[fin], want_lse[fin], **LSE_TOL)


# ----------------------------------------------------------------------------------------------
# merge_states
# ----------------------------------------------------------------------------------------------

_LSE = st.one_of(st.floats(-1e4, 1e4, width=32), st.floats(-300, 300, width=32), st.just(-math.inf))


@SETTINGS
@given(st.integers(0, 10), st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.data())
def test_merge_states_reference_against_loops(S, N, H, D, data):
    lse = torch.tensor(data.draw(st.lists(_LSE, min_size=S * N * H, max_size=S * N * H)),
                       dtype=torch.float32).view(S, N, H)
    po = torch.randn(S, N, H, D, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))
    po[torch.isneginf(lse)] = float("nan")  # never read
    want, want_lse = naive_merge(po, lse)
    for float64 in (True, False):
        out, out_lse = ref.merge_states(po, lse, float64=float64)
        assert not torch.isnan(out).any() and not torch.isnan(out_lse).any()
        tol = 3e-7 if float64 else 1e-5  # float64 accumulation, fp32 result (one rounding)
        torch.testing.assert_close(out.double(), want, atol=tol * max(1.0, float(want.abs().max())), rtol=tol)
        assert torch.equal(torch.isneginf(out_lse), torch.isneginf(want_lse))
        fin = torch.isfinite(want_lse)
        torch.testing.assert_close(out_lse.double()[fin], want_lse[fin], atol=1e-5, rtol=1e-7)


# ----------------------------------------------------------------------------------------------
# quantize_query and write_kv_cache: FP8 codes
# ----------------------------------------------------------------------------------------------


def _fp32_quotient(x: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32(x / scale), the correctly rounded fp32 quotient, computed in float64 (exact enough:
    53 bits hold the quotient of two fp32 values before its rounding to 24)."""
    return (x.double() / float(torch.tensor(scale, dtype=torch.float32))).float().double()


@SETTINGS
@given(st.integers(0, 9), st.integers(1, 4), st.sampled_from([8, 32]), st.sampled_from([BF16, FP16]),
       st.floats(1e-3, 1e3), st.floats(0.01, 1e4), st.integers(0, 2**31 - 1), st.booleans())
def test_quantize_query_reference_is_saturated_rne(T, Hkv, D, dtype, scale, spread, seed, tensor):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, 2 * Hkv, D, generator=g) * spread).to(dtype)
    s = torch.tensor(scale) if tensor else scale
    got = ref.quantize_query(q, s).view(torch.uint8)
    assert torch.equal(got, rne_fp8_codes(_fp32_quotient(q, scale)))
    # per KV head: head h of the query uses scale h // group
    per_head = torch.rand(Hkv, generator=g) + 0.1
    got = ref.quantize_query(q, per_head).view(torch.uint8)
    want = torch.stack([rne_fp8_codes(_fp32_quotient(q[:, h], float(per_head[h // 2]))) for h in range(2 * Hkv)], 1)
    assert torch.equal(got, want)


@SETTINGS
@given(st.integers(0, 12), st.integers(1, 3), st.sampled_from([4, 16]), st.sampled_from([1, 3, 4]),
       st.integers(1, 5), st.sampled_from(["HND", "NHD"]), st.sampled_from(["single", "tuple"]),
       st.sampled_from([FP8, BF16]), st.floats(0.01, 4.0), st.integers(0, 2**31 - 1))
def test_write_kv_cache_reference_against_loops(T, Hkv, D, page, P, layout, container, cache_dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(T, Hkv, D, generator=g) * 50).to(BF16)
    value = (torch.randn(T, Hkv, D, generator=g) * 50).to(BF16)
    n = P * page
    slots = torch.randperm(max(n, T), generator=g)[:T]
    if T:
        slots[torch.rand(T, generator=g) < 0.3] = -1
    cache = make_cache(g, layout=layout, container=container, dtype=cache_dtype, P=P, Hkv=Hkv, page=page, D=D)
    before = tuple(c.clone() for c in cache) if container == "tuple" else cache.clone()
    ref.write_kv_cache(key, value, cache, slots, kv_layout=layout, k_scale=scale, v_scale=2 * scale)
    halves = cache if container == "tuple" else (cache[:, 0], cache[:, 1])
    old = before if container == "tuple" else (before[:, 0], before[:, 1])
    for which, (x, sc) in enumerate(((key, scale), (value, 2 * scale))):
        want = old[which].clone()
        for i in range(T):
            s = int(slots[i])
            if not 0 <= s < n:
                continue  # skipped: nothing written
            y = _fp32_quotient(x[i], sc)
            val = rne_fp8_codes(y).view(FP8) if cache_dtype == FP8 else y.to(cache_dtype)
            if layout == "HND":
                want[s // page, :, s % page] = val
            else:
                want[s // page, s % page] = val
        bits = torch.uint8 if cache_dtype == FP8 else torch.int16
        assert torch.equal(halves[which].contiguous().view(bits), want.contiguous().view(bits))


# ----------------------------------------------------------------------------------------------
# qsa_sparse_attention
# ----------------------------------------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 2), st.integers(1, 3), st.sampled_from([1, 7, 16]),
       st.sampled_from([BF16, FP8]), st.booleans(), st.floats(0.0, 0.4), st.integers(0, 2**31 - 1), st.data())
def test_qsa_reference_against_loops(rows, Hkv, group, page, kv, gate, holes, seed, data):
    g = torch.Generator().manual_seed(seed)
    reqs = data.draw(st.integers(1, rows))
    c = make_qsa_case(rows=rows, num_q_heads=group * Hkv, num_kv_heads=Hkv, head_dim=16, page=page, kv_dtype=kv,
                      num_reqs=reqs, ctx=data.draw(st.integers(rows, 60)), block_budget=data.draw(st.integers(0, 4)),
                      width=20, holes=holes, gate=gate, k_scale=0.01 if kv == FP8 else 1.0,
                      v_scale=0.02 if kv == FP8 else 1.0, generator=g)
    idx, bt, t2r = c["packed_indices"], c["block_table"], c["token_to_req"]
    for _ in range(data.draw(st.integers(0, 3))):  # invalid entries of every kind
        r = data.draw(st.integers(0, rows - 1))
        kind = data.draw(st.integers(0, 3))
        if kind == 0:
            idx[r, data.draw(st.integers(0, 18))] = data.draw(st.sampled_from([-1, -7, bt.shape[1] * page + 2]))
        elif kind == 1:
            idx[r, 19] = data.draw(st.sampled_from([-4, 0, 25, 2**31 - 1]))
        elif kind == 2:
            bt[0, data.draw(st.integers(0, bt.shape[1] - 1))] = data.draw(st.sampled_from([-1, 10**6]))
        else:
            t2r[r] = data.draw(st.sampled_from([-1, reqs, 50]))
    args = {k: v for k, v in c.items() if k != "meta"}
    out, lse = ref.qsa_sparse_attention(**args, return_lse=True)
    want, want_lse = qsa_formula(c)
    assert not torch.isnan(out).any()
    vmax = float(c["v_cache"].float().nan_to_num(0.0).abs().max()) * float(c["v_scale"])
    tol = dict(OUT_TOL[out.dtype])
    tol["atol"] *= max(1.0, vmax)
    if c.get("output_gate") is not None:
        # the contract rounds twice (round(attn) * sigmoid(gate), rounded again): up to 2 ulps
        tol["rtol"] *= 2
    torch.testing.assert_close(out.double(), want.double(), **tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[fin], want_lse[fin], **LSE_TOL)
