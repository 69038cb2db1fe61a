"""CPU tests of ``cute_kernels.reference.paged_prefill`` against an independent float64 formula.

The formula here shares no code with the reference: each request's keys and values are read token
by token from the paged cache (position t -> page ``block_table[b, t // page]``, offset
``t % page``), every (row, head) is one dense softmax computed by hand, and the rows a query
sees are listed from the contract (``< seq_len - q_len + j + 1`` when causal, positions past the
block table never, an invalid page as zeros). Hypothesis draws the shapes: varlen batches with
q_len 0 and 1, cached prefixes, GQA 1/4/6/8/16, page sizes, both layouts, (K, V) tuples, causal
and not, 16-bit and FP8 caches, FP8 queries with per-tensor and per-KV-head scales, and the
reference's block sizes.

Tolerances: with ``float64=True`` the reference differs from the formula by float64 rounding only,
so its fp32 LSE must agree to fp32 precision and its output (rounded once to q's dtype) to one
ulp of that dtype: bf16 2^-7 relative, fp16 2^-10; the fp32 default adds fp32 accumulation error
(~1e-6 relative), covered by the same ulp plus 1e-5 absolute near 0.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cute_kernels import reference as ref

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
LN2 = math.log(2.0)
ULP = {BF16: 2.0**-7, FP16: 2.0**-10}


def _gen(*key) -> torch.Generator:
    """A generator seeded from the case (stable across processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# ----------------------------------------------------------------------------------------------
# a problem and the independent formula
# ----------------------------------------------------------------------------------------------


def make_problem(g, *, reqs, Hq, Hkv, D, page, kv_dtype=BF16, q_dtype=BF16, layout="HND", container="single",
                 invalid_pages=0, short_table=False, per_head_q_scale=False):
    """``reqs``: ``(prefix, q_len)`` per request. Returns the op arguments as a dict."""
    lens = [p + n for p, n in reqs]
    pages_per = [math.ceil(L / page) for L in lens]
    P = sum(pages_per) + 3
    perm = torch.randperm(P, generator=g).tolist()
    width = max(pages_per + [1]) + 1
    table = torch.randint(0, P, (len(reqs), width), dtype=torch.int32, generator=g)  # junk past the end
    ofs = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = torch.tensor(perm[ofs:ofs + n], dtype=torch.int32)
        ofs += n
    for i in range(invalid_pages if reqs else 0):  # -1 and past-the-pool ids inside the used range
        b = int(torch.randint(0, len(reqs), (1,), generator=g))
        if pages_per[b]:
            table[b, int(torch.randint(0, pages_per[b], (1,), generator=g))] = -1 if i % 2 == 0 else P + 5
    if short_table:  # the table holds fewer pages than the longest request needs
        table = table[:, :max(1, max(pages_per) - 1)].contiguous()
    shape = (P, 2, Hkv, page, D) if layout == "HND" else (P, 2, page, Hkv, D)
    if kv_dtype == FP8:
        kv = (torch.randn(shape, generator=g) * 40).clamp(-448, 448).to(FP8)
        k_scale, v_scale = 0.05, 0.03
    else:
        kv = torch.randn(shape, generator=g).to(kv_dtype)
        k_scale, v_scale = 1.0, 1.0
    kv_cache = (kv[:, 0].clone(), kv[:, 1].clone()) if container == "tuple" else kv
    T = sum(n for _, n in reqs)
    q = torch.randn(T, Hq, D, generator=g)
    q_scale = None
    if q_dtype == FP8:
        q_scale = torch.rand(Hkv, generator=g) * 0.02 + 0.01 if per_head_q_scale else 0.02
        q_scale_q = q_scale.repeat_interleave(Hq // Hkv).view(1, Hq, 1) if per_head_q_scale else q_scale
        q = (q / q_scale_q * 0.5).clamp(-448, 448).to(FP8)
    else:
        q = q.to(q_dtype)
    starts = [0]
    for _, n in reqs:
        starts.append(starts[-1] + n)
    return dict(q=q, kv_cache=kv_cache, block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32),
                query_start_loc=torch.tensor(starts, dtype=torch.int32), kv_layout=layout, k_scale=k_scale,
                v_scale=v_scale, q_scale=q_scale)


def _token(cache, layout, pid, off, kv):
    """K (kv=0) or V (kv=1) of one token, ``[Hkv, D]`` float64, straight from the caller's cache."""
    if isinstance(cache, tuple):
        t = cache[kv][pid]
        return (t[:, off] if layout == "HND" else t[off]).double()
    return (cache[pid, kv, :, off] if layout == "HND" else cache[pid, kv, off]).double()


def dense_prefill(q, kv_cache, block_table, seq_lens, query_start_loc, *, kv_layout, causal=True, sm_scale=None,
                  q_scale=None, k_scale=1.0, v_scale=1.0, window_left=-1, sinks=None):
    """The contract, directly: float64 ``out [T, Hq, D]`` and base-2 ``lse [T, Hq]`` (with a
    window, row j at ``p = seq_len - q_len + j`` sees keys ``>= p - window_left``; ``sinks[h]``, a
    natural-log logit, joins each row's denominator with no value)."""
    T, Hq, D = q.shape
    first = kv_layout == "HND"
    k0 = kv_cache[0] if isinstance(kv_cache, tuple) else kv_cache[:, 0]
    P, Hkv, page = k0.shape[0], k0.shape[1 if first else 2], k0.shape[2 if first else 1]
    G = Hq // Hkv
    scale = D ** -0.5 if sm_scale is None else sm_scale
    qf = q.double()
    if q_scale is not None:
        per = q_scale.double().repeat_interleave(G).view(1, Hq, 1) if isinstance(q_scale, torch.Tensor) \
            and q_scale.numel() > 1 else float(q_scale)
        qf = qf * per
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    lse = torch.full((T, Hq), float("-inf"), dtype=torch.float64)
    width = block_table.shape[1]
    starts = query_start_loc.tolist()
    for b in range(block_table.shape[0]):
        L, n = int(seq_lens[b]), starts[b + 1] - starts[b]
        K, V = [], []
        for t in range(max(0, min(L, width * page))):  # positions past the table do not exist
            pid = int(block_table[b, t // page])
            if 0 <= pid < P:
                K.append(_token(kv_cache, kv_layout, pid, t % page, 0) * float(k_scale))
                V.append(_token(kv_cache, kv_layout, pid, t % page, 1) * float(v_scale))
            else:
                K.append(torch.zeros(Hkv, D, dtype=torch.float64))
                V.append(torch.zeros(Hkv, D, dtype=torch.float64))
        for j in range(n):
            row = starts[b] + j
            seen = min(len(K), L - n + j + 1) if causal else len(K)
            lo = max(0, L - n + j - window_left) if window_left >= 0 else 0
            if seen <= lo and sinks is None:
                continue
            for h in range(Hq):
                logits = [float(qf[row, h] @ K[t][h // G]) * scale for t in range(lo, seen)]
                terms = logits + ([float(sinks[h])] if sinks is not None else [])
                mx = max(terms)
                if mx == float("-inf"):
                    continue
                w = [math.exp(x - mx) for x in logits]
                total = sum(w) + sum(math.exp(x - mx) for x in terms[len(logits):])
                out[row, h] = sum((wt * V[lo + t][h // G] for t, wt in enumerate(w)),
                                  torch.zeros(D, dtype=torch.float64)) / total
                lse[row, h] = (mx + math.log(total)) / LN2
    return out, lse


def _check(problem, *, float64, causal=True, sm_scale=None, **chunks):
    out, lse = ref.paged_prefill(**problem, causal=causal, sm_scale=sm_scale, return_lse=True, float64=float64,
                                 **chunks)
    want, want_lse = dense_prefill(**problem, causal=causal, sm_scale=sm_scale)
    q = problem["q"]
    out_dtype = BF16 if q.dtype == FP8 else q.dtype
    assert out.dtype == out_dtype and out.shape == q.shape and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], rtol=1e-6 if float64 else 1e-5, atol=1e-5)
    assert (out[~fin] == 0).all()  # rows without KV: exact zeros
    torch.testing.assert_close(out.double(), want.to(out_dtype).double(), rtol=ULP[out_dtype],
                               atol=0 if float64 else 1e-5)
    return out, lse


# ----------------------------------------------------------------------------------------------
# known cases
# ----------------------------------------------------------------------------------------------


CASES = [  # reqs, Hq, Hkv, D, page, kv, q, layout, container
    (((0, 5), (12, 3), (0, 17), (30, 1)), 8, 2, 16, 4, BF16, BF16, "HND", "single"),
    (((7, 9), (0, 0), (3, 1), (0, 2)), 16, 1, 8, 16, FP16, FP16, "NHD", "tuple"),
    (((20, 11), (0, 6)), 6, 1, 8, 2, FP8, BF16, "HND", "tuple"),
    (((5, 7), (40, 4), (0, 1)), 8, 8, 8, 8, FP8, FP8, "NHD", "single"),
]


@pytest.mark.parametrize("float64", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_prefill_matches_dense_formula(case, causal, float64):
    reqs, Hq, Hkv, D, page, kv, qd, layout, container = case
    g = _gen("known", CASES.index(case), causal, float64)
    p = make_problem(g, reqs=reqs, Hq=Hq, Hkv=Hkv, D=D, page=page, kv_dtype=kv, q_dtype=qd, layout=layout,
                     container=container)
    _check(p, float64=float64, causal=causal, q_chunk=4, kv_chunk=6)
    _check(p, float64=float64, causal=causal)  # default blocks: one block per request here


@given(data=st.data())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_prefill_property(data):
    """Random shapes, lengths, containers and blocks against the dense formula."""
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    Hkv = data.draw(st.sampled_from([1, 2]), label="Hkv")
    G = data.draw(st.sampled_from([1, 4, 6, 8, 16]), label="G")
    D = data.draw(st.sampled_from([4, 8, 16]), label="D")
    page = data.draw(st.sampled_from([1, 2, 4, 16]), label="page")
    qk = data.draw(st.sampled_from([(BF16, BF16), (FP16, FP16), (FP8, BF16), (FP8, FP16), (FP8, FP8)]), label="kv,q")
    reqs = data.draw(st.lists(st.tuples(st.sampled_from([0, 0, 1, 3, 16, 33]), st.sampled_from([0, 1, 1, 2, 5, 9])),
                              min_size=0, max_size=4), label="reqs")
    p = make_problem(
        torch.Generator().manual_seed(seed), reqs=reqs, Hq=G * Hkv, Hkv=Hkv, D=D, page=page, kv_dtype=qk[0],
        q_dtype=qk[1], layout=data.draw(st.sampled_from(["HND", "NHD"]), label="layout"),
        container=data.draw(st.sampled_from(["single", "tuple"]), label="container"),
        invalid_pages=data.draw(st.integers(0, 2), label="invalid"),
        short_table=bool(reqs) and data.draw(st.booleans(), label="short_table"),
        per_head_q_scale=qk[1] == FP8 and data.draw(st.booleans(), label="per_head"),
    )
    _check(p, float64=data.draw(st.booleans(), label="float64"), causal=data.draw(st.booleans(), label="causal"),
           sm_scale=data.draw(st.sampled_from([None, 0.07]), label="sm_scale"),
           q_chunk=data.draw(st.integers(1, 12), label="q_chunk"), kv_chunk=data.draw(st.integers(1, 40), label="kv_chunk"))


# ----------------------------------------------------------------------------------------------
# blocks: results independent of the block sizes, memory bounded by them
# ----------------------------------------------------------------------------------------------


def test_results_equal_across_block_sizes():
    g = _gen("blocks")
    p = make_problem(g, reqs=((0, 37), (50, 20), (3, 1), (0, 0), (64, 64)), Hq=8, Hkv=2, D=16, page=16)
    base, base_lse = ref.paged_prefill(**p, return_lse=True, float64=True)
    for q_chunk, kv_chunk in ((1, 1), (3, 7), (16, 16), (64, 5), (1000, 1000)):
        out, lse = ref.paged_prefill(**p, return_lse=True, float64=True, q_chunk=q_chunk, kv_chunk=kv_chunk)
        assert torch.equal(out, base), (q_chunk, kv_chunk)  # float64 sums differ below bf16's rounding
        torch.testing.assert_close(lse, base_lse, rtol=1e-6, atol=1e-6)


def test_memory_is_bounded_by_the_blocks(monkeypatch):
    """An 8k-token prompt (on a 2k cached prefix): every logits block stays within q_chunk x Hq x
    kv_chunk, causal blocks above the diagonal are skipped, and sampled rows match the formula."""
    g = _gen("long")
    Hq, Hkv, D, page = 4, 2, 8, 64
    p = make_problem(g, reqs=((2048, 8192),), Hq=Hq, Hkv=Hkv, D=D, page=page, kv_dtype=FP8, q_dtype=BF16)
    real = ref.prefill_block
    seen = []

    def spy(state, rows, k, v, visible, scale):
        seen.append((rows.shape[0], k.shape[1]))
        return real(state, rows, k, v, visible, scale)

    monkeypatch.setattr(ref, "prefill_block", spy)
    q_chunk, kv_chunk = 512, 1024
    out, lse = ref.paged_prefill(**p, return_lse=True, q_chunk=q_chunk, kv_chunk=kv_chunk)
    assert max(r for r, _ in seen) <= q_chunk and max(k for _, k in seen) <= kv_chunk
    # causal: q block i (rows 2048 + [512 i, 512 (i + 1)) of the sequence) visits ceil(that end / 1024) blocks
    assert len(seen) == sum(math.ceil((2048 + 512 * (i + 1)) / kv_chunk) for i in range(16))
    monkeypatch.undo()
    rows = [0, 1, 511, 512, 5000, 8191]
    sub = dict(p, q=p["q"][rows], seq_lens=torch.tensor([2048 + r + 1 for r in rows], dtype=torch.int32),
               block_table=p["block_table"].expand(len(rows), -1),
               query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32))
    want, want_lse = dense_prefill(**sub)
    torch.testing.assert_close(lse[rows].double(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[rows].double(), want.to(BF16).double(), rtol=ULP[BF16], atol=1e-5)


# ----------------------------------------------------------------------------------------------
# relations to the decode reference and defined results
# ----------------------------------------------------------------------------------------------


def test_one_request_equals_decode_reference_with_its_q_len():
    g = _gen("decode")
    p = make_problem(g, reqs=((29, 7),), Hq=8, Hkv=2, D=16, page=4, kv_dtype=FP8)
    out, lse = ref.paged_prefill(**p, return_lse=True, q_chunk=3, kv_chunk=10)
    d_out, d_lse = ref.paged_decode(p["q"], p["kv_cache"], p["block_table"], p["seq_lens"], kv_layout="HND",
                                    q_len_per_req=7, k_scale=p["k_scale"], v_scale=p["v_scale"], return_lse=True)
    torch.testing.assert_close(out.float(), d_out.float(), rtol=ULP[BF16], atol=1e-5)
    torch.testing.assert_close(lse, d_lse, rtol=1e-5, atol=1e-5)


def test_rows_without_kv_and_positions_past_the_table():
    g = _gen("edge")
    p = make_problem(g, reqs=((0, 4), (10, 3)), Hq=4, Hkv=1, D=8, page=4)
    # request 0: seq_len 2 < q_len 4 -> rows 0 and 1 see nothing; request 1: seq_len 0 -> nothing
    p["seq_lens"] = torch.tensor([2, 0], dtype=torch.int32)
    out, lse = ref.paged_prefill(**p, return_lse=True)
    assert torch.isneginf(lse[:2]).all() and (out[:2] == 0).all()
    assert torch.isfinite(lse[2:4]).all()
    assert torch.isneginf(lse[4:]).all() and (out[4:] == 0).all()
    # seq_len past the table's capacity: the same result as the capacity itself (never zeros that dilute)
    p2 = make_problem(g, reqs=((9, 3),), Hq=4, Hkv=1, D=8, page=4)
    cap = p2["block_table"].shape[1] * 4
    a = ref.paged_prefill(**dict(p2, seq_lens=torch.tensor([cap + 40], dtype=torch.int32)), causal=False)
    b = ref.paged_prefill(**dict(p2, seq_lens=torch.tensor([cap], dtype=torch.int32)), causal=False)
    assert torch.equal(a, b)
    # a huge seq_len costs nothing: the loop is bounded by the table
    ref.paged_prefill(**dict(p2, seq_lens=torch.tensor([2**31 - 1], dtype=torch.int32)))


def test_fp8_query_equals_dequantized_query_and_per_head_scale():
    g = _gen("fp8q")
    p = make_problem(g, reqs=((5, 6), (0, 3)), Hq=8, Hkv=2, D=16, page=4, kv_dtype=FP8, q_dtype=FP8,
                     per_head_q_scale=True)
    qs = p["q_scale"].repeat_interleave(4).view(1, 8, 1)
    deq = (p["q"].float() * qs).double()
    out = ref.paged_prefill(**p, float64=True)
    # the same logits from a float64 "query" would need a float64 q; compare through the formula
    want, _ = dense_prefill(**dict(p, q=deq, q_scale=None))
    torch.testing.assert_close(out.double(), want.to(BF16).double(), rtol=ULP[BF16], atol=0)
    # per tensor: a 0-d, a [1] tensor and a float are one scale
    p1 = make_problem(g, reqs=((2, 4),), Hq=4, Hkv=2, D=8, page=4, kv_dtype=FP8, q_dtype=FP8)
    outs = [ref.paged_prefill(**dict(p1, q_scale=s)) for s in (0.02, torch.tensor(0.02), torch.tensor([0.02]))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p.update(query_start_loc=torch.tensor([0, 5, 3, 20], dtype=torch.int32)), "non-decreasing"),
    (lambda p: p.update(query_start_loc=torch.tensor([1, 5, 9, 20], dtype=torch.int32)), "start at 0"),
    (lambda p: p.update(query_start_loc=torch.tensor([0, 5, 9, 19], dtype=torch.int32)), "end at T=20"),
    (lambda p: p.update(query_start_loc=torch.tensor([0, 5, 20], dtype=torch.int32)), r"query_start_loc must be \[B \+ 1=4\]"),
    (lambda p: p.update(max_query_len=10), r"max_query_len \(10\) is below request 2's query length 11"),
    (lambda p: p.update(seq_lens=p["seq_lens"][:2]), r"seq_lens must be \[B=3\]"),
    (lambda p: p.update(q_scale=0.5), "q_scale applies only to an FP8 query"),
    (lambda p: p.update(q=p["q"].to(FP8)), "an FP8 query needs q_scale"),
    (lambda p: p.update(q=p["q"].to(FP8), q_scale=torch.ones(4)), "per-KV-head q_scale must have Hkv=2"),
    (lambda p: p.update(q=p["q"][..., :4]), "head dim mismatch"),
    (lambda p: p.update(q=p["q"][:, :3]), "multiple of num kv heads"),
    (lambda p: p.update(q_chunk=0), "q_chunk must be a positive int"),
    (lambda p: p.update(kv_layout="HDN"), "kv_layout"),
])
def test_errors_name_the_argument(mutate, match):
    p = make_problem(_gen("err"), reqs=((0, 5), (3, 4), (1, 11)), Hq=8, Hkv=2, D=8, page=4)
    mutate(p)
    with pytest.raises(ValueError, match=match):
        ref.paged_prefill(**p)
