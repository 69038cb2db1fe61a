"""CPU tests of the sliding window (``window_left``) and the sinks of
``cute_kernels.reference.paged_prefill`` against the independent float64 formula of
``test_prefill_reference`` (``dense_prefill``: each row's visible keys listed from the contract,
the sink added to the denominator by hand): row j of request b at ``p = seq_len - q_len + j`` sees keys ``p - w ... p``
(causal) or ``p - w ... seq_len - 1`` (not causal); ``sinks[h]`` (natural log) joins the
denominator with no value; a row that sees no key gives 0 and LSE ``sinks[h] / ln 2``. The
reference's blocks (``q_chunk``, ``kv_chunk``) are drawn so that windows start inside blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cute_kernels import reference as ref

from .test_prefill_reference import BF16, FP8, FP16, LN2, ULP, _gen, dense_prefill, make_problem


def _check(problem, *, causal, window_left, sinks, **chunks):
    out, lse = ref.paged_prefill(**problem, causal=causal, window_left=window_left, sinks=sinks, return_lse=True,
                                 float64=True, **chunks)
    want, want_lse = dense_prefill(**problem, causal=causal, window_left=window_left, sinks=sinks)
    q = problem["q"]
    out_dtype = BF16 if q.dtype == FP8 else q.dtype
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], rtol=1e-6, atol=1e-5)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), want.to(out_dtype).double(), rtol=ULP[out_dtype], atol=0)


@pytest.mark.parametrize("window_left", [-1, 0, 3, 17])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_window_and_sinks_match_dense_formula(window_left, with_sinks, causal):
    g = _gen("pf-win-sink", window_left, with_sinks, causal)
    p = make_problem(g, reqs=((0, 9), (20, 5), (3, 0), (40, 13), (0, 1)), Hq=8, Hkv=2, D=16, page=4)
    sinks = torch.randn(8, generator=g) * 2 if with_sinks else None
    _check(p, causal=causal, window_left=window_left, sinks=sinks, q_chunk=4, kv_chunk=6)
    _check(p, causal=causal, window_left=window_left, sinks=sinks)


def test_sink_known_answers():
    """A -inf sink is no sink; a row that sees no key (a causal row of a request whose q_len exceeds
    its seq_len) gets 0 and the sink's LSE."""
    g = _gen("pf-sink-known")
    p = make_problem(g, reqs=((0, 6), (10, 3)), Hq=4, Hkv=1, D=8, page=4)
    p["seq_lens"] = torch.tensor([3, 13], dtype=torch.int32)  # request 0: rows 0-2 see nothing
    base = ref.paged_prefill(**p, return_lse=True)
    none = ref.paged_prefill(**p, sinks=torch.full((4,), float("-inf")), return_lse=True)
    assert torch.equal(base[0], none[0]) and torch.equal(base[1], none[1])
    sinks = torch.randn(4, generator=g)
    out, lse = ref.paged_prefill(**p, sinks=sinks, return_lse=True)
    assert torch.all(out[:3] == 0)
    torch.testing.assert_close(lse[:3], (sinks / LN2).expand(3, 4), rtol=1e-6, atol=1e-6)


def test_keys_outside_every_window_are_never_read():
    """A page no row of its request sees may be freed: NaN or an invalid id changes nothing."""
    g = _gen("pf-freed")
    page, w = 4, 5
    p = make_problem(g, reqs=((40, 6), (25, 9)), Hq=4, Hkv=2, D=8, page=page, kv_dtype=FP16, q_dtype=FP16)
    clean = ref.paged_prefill(**p, window_left=w, return_lse=True, q_chunk=4, kv_chunk=6)
    kv, table = p["kv_cache"].clone(), p["block_table"].clone()
    for b, ((_prefix, n), L) in enumerate(zip(((40, 6), (25, 9)), p["seq_lens"].tolist())):
        for pg in range(max(0, L - n - w) // page):
            kv[int(table[b, pg])] = float("nan")
            table[b, pg] = -1 if pg % 2 else 10_000
    dirty = ref.paged_prefill(**{**p, "kv_cache": kv, "block_table": table}, window_left=w, return_lse=True,
                              q_chunk=4, kv_chunk=6)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


def test_bad_window_and_sinks_are_refused():
    p = make_problem(_gen("pf-bad"), reqs=((0, 3),), Hq=4, Hkv=1, D=8, page=4)
    with pytest.raises(ValueError, match="window_left"):
        ref.paged_prefill(**p, window_left=-2)
    with pytest.raises(ValueError, match="sinks"):
        ref.paged_prefill(**p, sinks=torch.zeros(3))


@given(data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_window_sink_property(data):
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    Hkv = data.draw(st.sampled_from([1, 2]), label="Hkv")
    G = data.draw(st.sampled_from([1, 4]), label="G")
    page = data.draw(st.sampled_from([1, 4, 16]), label="page")
    qk = data.draw(st.sampled_from([(BF16, BF16), (FP16, FP16), (FP8, BF16), (FP8, FP8)]), label="kv,q")
    reqs = data.draw(st.lists(st.tuples(st.sampled_from([0, 1, 5, 33]), st.sampled_from([0, 1, 4, 9])),
                              min_size=1, max_size=3), label="reqs")
    g = torch.Generator().manual_seed(seed)
    p = make_problem(g, reqs=reqs, Hq=G * Hkv, Hkv=Hkv, D=8, page=page, kv_dtype=qk[0], q_dtype=qk[1],
                     layout=data.draw(st.sampled_from(["HND", "NHD"]), label="layout"),
                     invalid_pages=data.draw(st.integers(0, 1), label="invalid"))
    window = data.draw(st.sampled_from([-1, 0, 1, 2, 7, 40]), label="window_left")
    sinks = torch.randn(G * Hkv, generator=g) * 3 if data.draw(st.booleans(), label="sinks") else None
    _check(p, causal=data.draw(st.booleans(), label="causal"), window_left=window, sinks=sinks,
           q_chunk=data.draw(st.sampled_from([1, 3, 256]), label="q_chunk"),
           kv_chunk=data.draw(st.sampled_from([1, 5, 2048]), label="kv_chunk"))
