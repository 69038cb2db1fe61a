"""CPU tests of ``cute_kernels.reference``, the semantics every kernel is tested against.

The reference is checked against known answers and against a deliberately different float64
implementation written here (explicit loops over batch / query row / head, each request's K/V
assembled token by token from ``block_table``, softmax by hand), never only against itself.

Tolerances (all justified where they are defined):
- the reference does its math in fp32 (relative error ~1e-6 at these sizes) and rounds the output
  once to q's dtype; an fp32 error can flip that final rounding, so outputs are compared to the
  float64 formulas within one ulp of the output dtype (bf16: 2^-7 relative, fp16: 2^-10) plus a
  small absolute term for results near zero;
- LSE is fp32 from fp32 math: 1e-5 relative / absolute.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from cute_kernels import reference as ref

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
F64 = torch.float64
LN2 = math.log(2.0)
NEG_INF = float("-inf")

# One ulp of the output dtype, relative (bf16 keeps 8 significant bits, fp16 11), plus 1e-5
# absolute for outputs near 0, where the fp32 accumulation error (~1e-6 * max|v|) dominates.
OUT_TOL = {BF16: dict(rtol=2.0**-7, atol=1e-5), FP16: dict(rtol=2.0**-10, atol=1e-5)}
# fp32 log-sum-exp of fp32 logits against float64: errors ~1e-6; 1e-5 leaves margin.
LSE_TOL = dict(rtol=1e-5, atol=1e-5)
EXACT = dict(rtol=0.0, atol=0.0)


def _gen(*key) -> torch.Generator:
    """A generator seeded from the test's parameters (stable across processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


# ----------------------------------------------------------------------------------------------
# building paged caches
# ----------------------------------------------------------------------------------------------


def _alloc(shape, dtype, view):
    """A tensor of logical ``shape`` (last dim contiguous) with the requested memory arrangement.

    ``contig``: plain contiguous. ``page_stride``: every other page of a pool twice as large (the
    page-dim stride is doubled; the skipped pages hold NaN, which must never be read).
    ``permuted``: the leading dims are stored in reverse order, only the last dim is contiguous.
    """
    if view == "contig":
        return torch.empty(shape, dtype=dtype)
    if view == "page_stride":
        pool = torch.full((2 * shape[0], *shape[1:]), float("nan"), dtype=dtype)
        return pool[1::2]
    if view == "permuted":
        n = len(shape)
        phys = [shape[i] for i in reversed(range(n - 1))] + [shape[-1]]
        return torch.empty(phys, dtype=dtype).permute(*reversed(range(n - 1)), n - 1)
    raise AssertionError(view)


def make_cache(g, *, layout, container, dtype, P, Hkv, page, D, view="contig", scale=1.5):
    """Random paged KV cache in the reference's accepted input forms."""
    tok = (Hkv, page) if layout == "HND" else (page, Hkv)
    if container == "single":
        shape = (P, 2, *tok, D)
        t = _alloc(shape, dtype, view)
        t.copy_(_randn(g, *shape, scale=scale).to(dtype))
        if view != "contig":
            assert not t.is_contiguous() and t.stride(-1) == 1
        return t
    halves = []
    for _ in range(2):
        shape = (P, *tok, D)
        t = _alloc(shape, dtype, view)
        t.copy_(_randn(g, *shape, scale=scale).to(dtype))
        halves.append(t)
    return tuple(halves)


def cache_dims(kv_cache, layout):
    """``(P, Hkv, page, D)`` read directly from the shapes (independent of ``split_kv_cache``)."""
    if isinstance(kv_cache, tuple):
        P, a, b, D = kv_cache[0].shape
    else:
        P, two, a, b, D = kv_cache.shape
        assert two == 2
    return (P, a, b, D) if layout == "HND" else (P, b, a, D)


def token_kv(kv_cache, layout, page_id, off, Hkv, D):
    """``(k, v)`` of one cached token as float64 ``[Hkv, D]``; a page id outside ``[0, P)`` is zeros."""
    P = kv_cache[0].shape[0] if isinstance(kv_cache, tuple) else kv_cache.shape[0]
    if not 0 <= page_id < P:
        z = torch.zeros(Hkv, D, dtype=F64)
        return z, z
    if isinstance(kv_cache, tuple):
        kc, vc = kv_cache
        if layout == "HND":
            return kc[page_id, :, off, :].double(), vc[page_id, :, off, :].double()
        return kc[page_id, off, :, :].double(), vc[page_id, off, :, :].double()
    if layout == "HND":
        return kv_cache[page_id, 0, :, off, :].double(), kv_cache[page_id, 1, :, off, :].double()
    return kv_cache[page_id, 0, off, :, :].double(), kv_cache[page_id, 1, off, :, :].double()


def make_block_table(g, seq_lens, page, P, max_pages):
    """Random distinct physical pages per request; unused entries hold garbage (some out of range)."""
    need = [(int(L) + page - 1) // page for L in seq_lens]
    assert sum(need) <= P and max(need) <= max_pages
    perm = torch.randperm(P, generator=g)
    bt = torch.randint(-3, 3 * P, (len(seq_lens), max_pages), generator=g)
    pos = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[pos:pos + n]
        pos += n
    return bt.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# independent float64 implementations
# ----------------------------------------------------------------------------------------------


def naive_decode(q, kv_cache, layout, block_table, seq_lens, q_len, *, sm_scale=None, q_scale=None,
                 k_scale=1.0, v_scale=1.0):
    """Straightforward float64 paged decode: returns ``(out [T, Hq, D], lse [T, Hq])`` in float64.
    Token t of request b is position t: visible to draft row j iff ``t < L - q_len + j + 1`` and its
    page ``t // page`` is a column of the block table."""
    P, Hkv, page, D = cache_dims(kv_cache, layout)
    T, Hq, Dq = q.shape
    assert Dq == D and Hq % Hkv == 0
    group = Hq // Hkv
    sm = D ** -0.5 if sm_scale is None else float(sm_scale)
    qf = q.double() * (1.0 if q_scale is None else float(q_scale))
    bt = block_table.tolist()
    out = torch.zeros(T, Hq, D, dtype=F64)
    lse = torch.full((T, Hq), NEG_INF, dtype=F64)
    for b, L in enumerate(int(x) for x in seq_lens.tolist()):
        ks, vs = [], []
        for t in range(L):  # assemble the request token by token
            if t // page >= len(bt[b]):
                break  # past the block table: not attended
            k, v = token_kv(kv_cache, layout, bt[b][t // page], t % page, Hkv, D)
            ks.append(k * float(k_scale))
            vs.append(v * float(v_scale))
        K = torch.stack(ks) if ks else torch.zeros(0, Hkv, D, dtype=F64)  # [L, Hkv, D]
        V = torch.stack(vs) if vs else torch.zeros(0, Hkv, D, dtype=F64)
        for j in range(q_len):
            row = b * q_len + j
            n_vis = min(L - q_len + j + 1, len(ks))  # causal within the draft, inside the table
            if n_vis <= 0:
                continue  # sees nothing: out 0, lse -inf
            for h in range(Hq):
                kvh = h // group
                logits = (K[:n_vis, kvh] @ qf[row, h]) * sm
                m = logits.max()
                e = torch.exp(logits - m)
                denom = e.sum()
                out[row, h] = (e / denom) @ V[:n_vis, kvh]
                lse[row, h] = (m + torch.log(denom)) / LN2
    return out, lse


def dense_attention(q, K, V, q_len, *, sm_scale):
    """Float64 attention of one request from dense ``K, V [L, Hkv, D]`` (no paging at all)."""
    L, Hkv, D = K.shape
    Hq = q.shape[1]
    qf, Kf, Vf = q.double(), K.double(), V.double()
    Kr = Kf.repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]
    Vr = Vf.repeat_interleave(Hq // Hkv, dim=1)
    out = torch.zeros(q_len, Hq, D, dtype=F64)
    lse = torch.full((q_len, Hq), NEG_INF, dtype=F64)
    for j in range(q_len):
        n = L - q_len + j + 1
        if n <= 0:
            continue
        s = torch.einsum("hd,lhd->hl", qf[j], Kr[:n]) * sm_scale
        lse[j] = torch.logsumexp(s, dim=-1) / LN2
        out[j] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), Vr[:n])
    return out, lse


def naive_merge(partial_out, partial_lse):
    """Float64 merge with explicit loops: ``lse = log2(sum 2^lse_s)``, ``out = sum 2^(lse_s-lse) o_s``."""
    S, N, H, D = partial_out.shape
    out = torch.zeros(N, H, D, dtype=F64)
    lse = torch.full((N, H), NEG_INF, dtype=F64)
    po, pl = partial_out.double(), partial_lse.double()
    for n in range(N):
        for h in range(H):
            live = [s for s in range(S) if pl[s, n, h].item() != NEG_INF]
            if not live:
                continue
            m = max(pl[s, n, h].item() for s in live)
            total = math.log2(sum(2.0 ** (pl[s, n, h].item() - m) for s in live)) + m
            lse[n, h] = total
            for s in live:
                out[n, h] += 2.0 ** (pl[s, n, h].item() - total) * po[s, n, h]
    return out, lse


# All finite non-negative float8_e4m3fn values, indexed by their code 0..126 (0x7F is NaN).
FP8_POS = torch.arange(127, dtype=torch.uint8).view(FP8).double()


def rne_fp8_codes(y: torch.Tensor) -> torch.Tensor:
    """Independent saturate(round-to-nearest-even(y)) to e4m3fn, as uint8 codes (y float64)."""
    a = y.abs().clamp(max=ref.FP8_MAX)
    i = torch.searchsorted(FP8_POS, a).clamp(1, 126)  # FP8_POS[i-1] <= a <= FP8_POS[i]
    lo, hi = FP8_POS[i - 1], FP8_POS[i]
    d_lo, d_hi = a - lo, hi - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (i % 2 == 0))  # tie -> even code
    code = torch.where(pick_hi, i, i - 1).to(torch.uint8)
    return torch.where(torch.signbit(y), code | 0x80, code)


def codes(x: torch.Tensor) -> torch.Tensor:
    assert x.dtype == FP8
    return x.contiguous().view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# 1. paged_decode against the float64 implementation
# ----------------------------------------------------------------------------------------------


def _decode_problem(g, *, q_len, page, P=11, max_pages=4):
    """Five requests: partial last page, empty, exact full pages, one partial page, tiny."""
    lens = [
        2 * page + int(torch.randint(1, page, (1,), generator=g)),
        0,
        3 * page,
        int(torch.randint(1, page, (1,), generator=g)),
        max(q_len - 1, 1),  # with q_len > 1 the first draft rows see nothing
    ]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return seq_lens, make_block_table(g, lens, page, P, max_pages)


def _check_against_naive(q, kv, layout, bt, seq_lens, q_len, **kw):
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, kv_layout=layout, q_len_per_req=q_len,
                                return_lse=True, **kw)
    exp_out, exp_lse = naive_decode(q, kv, layout, bt, seq_lens, q_len, **kw)
    out_dtype = BF16 if q.dtype == FP8 else q.dtype
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    torch.testing.assert_close(out.double(), exp_out, **OUT_TOL[out_dtype])
    torch.testing.assert_close(lse.double(), exp_lse, **LSE_TOL)
    return out, lse


# (GQA group, head dim, page size). Every dtype x layout x container x q_len combination runs
# once, with the shapes assigned in rotation (each shape meets every dtype, layout and q_len).
SHAPES = [(1, 128, 16), (4, 64, 32), (6, 128, 32), (6, 64, 16)]
_NAIVE_CASES = [
    pytest.param(SHAPES[i % len(SHAPES)], dt, layout, container, q_len,
                 id=f"{name}-{layout}-{container}-q{q_len}-g{SHAPES[i % len(SHAPES)][0]}"
                    f"-d{SHAPES[i % len(SHAPES)][1]}-p{SHAPES[i % len(SHAPES)][2]}")
    for i, (q_len, (dt, name), layout, container) in enumerate(
        (q, d, lay, c) for q in (1, 2, 4) for d in ((BF16, "bf16"), (FP16, "fp16"), (FP8, "fp8"))
        for lay in ("HND", "NHD") for c in ("single", "tuple"))
]


@pytest.mark.parametrize("shape, kv_dtype, layout, container, q_len", _NAIVE_CASES)
def test_paged_decode_matches_float64_loops(shape, kv_dtype, layout, container, q_len):
    group, D, page = shape
    Hkv = 2
    g = _gen("naive", shape, str(kv_dtype), layout, container, q_len)
    seq_lens, bt = _decode_problem(g, q_len=q_len, page=page)
    kv = make_cache(g, layout=layout, container=container, dtype=kv_dtype, P=11, Hkv=Hkv, page=page, D=D)
    q_dtype = FP16 if kv_dtype == FP16 else BF16
    q = _randn(g, len(seq_lens) * q_len, group * Hkv, D).to(q_dtype)
    scales = dict(k_scale=0.37, v_scale=1.7) if kv_dtype == FP8 else dict(k_scale=0.8, v_scale=1.25)
    out, lse = _check_against_naive(q, kv, layout, bt, seq_lens, q_len, **scales)
    # seq_len 0 (request 1): exactly 0 and -inf
    assert torch.all(out[q_len:2 * q_len] == 0)
    assert torch.all(lse[q_len:2 * q_len] == NEG_INF)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("view", ["page_stride", "permuted"])
@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("container", ["single", "tuple"])
def test_paged_decode_non_contiguous_cache(view, kv_dtype, layout, container):
    g = _gen("view", view, str(kv_dtype), layout, container)
    page, D, Hkv, group, q_len = 16, 64, 2, 4, 2
    seq_lens, bt = _decode_problem(g, q_len=q_len, page=page)
    kv = make_cache(g, layout=layout, container=container, dtype=kv_dtype, P=11, Hkv=Hkv, page=page, D=D,
                    view=view)
    q = _randn(g, len(seq_lens) * q_len, group * Hkv, D).to(BF16)
    out, _ = _check_against_naive(q, kv, layout, bt, seq_lens, q_len, k_scale=0.6, v_scale=1.1)
    # a contiguous copy of the same cache gives the same bits
    kv_c = tuple(t.contiguous() for t in kv) if container == "tuple" else kv.contiguous()
    out_c = ref.paged_decode(q, kv_c, bt, seq_lens, kv_layout=layout, q_len_per_req=q_len,
                             k_scale=0.6, v_scale=1.1)
    torch.testing.assert_close(out, out_c, **EXACT)


def test_paged_decode_halves_of_one_pool_and_int64_block_table():
    """(k, v) given as the two (non-contiguous) halves of one 5-D pool; block table as int64."""
    g = _gen("halves")
    page, D, Hkv, group, q_len = 32, 128, 2, 6, 1
    seq_lens, bt = _decode_problem(g, q_len=q_len, page=page)
    pool = make_cache(g, layout="NHD", container="single", dtype=BF16, P=11, Hkv=Hkv, page=page, D=D)
    kv = (pool[:, 0], pool[:, 1])
    q = _randn(g, len(seq_lens) * q_len, group * Hkv, D).to(BF16)
    out, lse = _check_against_naive(q, kv, "NHD", bt, seq_lens, q_len)
    out2, lse2 = ref.paged_decode(q, pool, bt.long(), seq_lens, kv_layout="NHD", return_lse=True)
    torch.testing.assert_close(out2, out, **EXACT)
    torch.testing.assert_close(lse2, lse, **EXACT)


def test_paged_decode_explicit_sm_scale_and_fp8_query():
    g = _gen("fp8q")
    page, D, Hkv, group, q_len = 16, 128, 2, 4, 2
    seq_lens, bt = _decode_problem(g, q_len=q_len, page=page)
    kv = make_cache(g, layout="HND", container="single", dtype=FP8, P=11, Hkv=Hkv, page=page, D=D)
    q = _randn(g, len(seq_lens) * q_len, group * Hkv, D, scale=3.0).to(FP8)
    _check_against_naive(q, kv, "HND", bt, seq_lens, q_len, sm_scale=0.3, q_scale=0.37, k_scale=0.45,
                         v_scale=0.9)


# ----------------------------------------------------------------------------------------------
# 2. paged_decode known answers
# ----------------------------------------------------------------------------------------------


def test_uniform_logits_give_mean_of_visible_values():
    """Every key of a KV head is the same vector: logits are uniform over the visible keys, so the
    output is the mean of the visible values times v_scale, and lse = logit/ln2 + log2(n_visible)."""
    g = _gen("uniform")
    page, D, Hkv, group, q_len, P = 16, 64, 2, 3, 2, 8
    seq_lens = torch.tensor([37, 20, 2], dtype=torch.int32)
    bt = make_block_table(g, seq_lens.tolist(), page, P, 3)
    kv = make_cache(g, layout="HND", container="single", dtype=BF16, P=P, Hkv=Hkv, page=page, D=D)
    k_vec = _randn(g, Hkv, D).to(BF16)
    kv[:, 0] = k_vec.view(1, Hkv, 1, D)  # all keys of head h identical
    ks, vs = 0.5, 1.5
    q = _randn(g, 3 * q_len, group * Hkv, D).to(BF16)
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, q_len_per_req=q_len, k_scale=ks, v_scale=vs,
                                return_lse=True)
    for b, L in enumerate(seq_lens.tolist()):
        V = torch.stack([token_kv(kv, "HND", int(bt[b, t // page]), t % page, Hkv, D)[1] for t in range(L)])
        for j in range(q_len):
            n = L - q_len + j + 1
            for h in range(group * Hkv):
                kvh = h // group
                exp_out = V[:n, kvh].mean(0) * vs
                logit = float(q[b * q_len + j, h].double() @ k_vec[kvh].double()) * ks * D ** -0.5
                torch.testing.assert_close(out[b * q_len + j, h].double(), exp_out, **OUT_TOL[BF16])
                torch.testing.assert_close(lse[b * q_len + j, h].item(), logit / LN2 + math.log2(n), **LSE_TOL)


@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_single_visible_key_is_exact(kv_dtype):
    """A row that sees exactly one key returns that value times v_scale (softmax weight exactly 1;
    v_scale = 0.75 keeps the product exact, so the bf16 output must match bit for bit) and
    lse = its scaled logit / ln 2. A row that sees nothing returns 0 and -inf."""
    g = _gen("single", str(kv_dtype))
    page, D, Hkv, group, q_len, P = 16, 64, 2, 4, 2, 6
    # request 0: rows see 1 and 2 keys; request 1: rows see 0 and 1 key; request 2 like request 0
    seq_lens = torch.tensor([2, 1, 2], dtype=torch.int32)
    bt = make_block_table(g, seq_lens.tolist(), page, P, 2)
    kv = make_cache(g, layout="NHD", container="tuple", dtype=kv_dtype, P=P, Hkv=Hkv, page=page, D=D)
    ks, vs = 0.3, 0.75
    q = _randn(g, 3 * q_len, group * Hkv, D).to(BF16)
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, kv_layout="NHD", q_len_per_req=q_len, k_scale=ks,
                                v_scale=vs, return_lse=True)
    for row, b in ((0, 0), (3, 1), (4, 2)):  # rows that see exactly position 0 of request b
        k0, v0 = token_kv(kv, "NHD", int(bt[b, 0]), 0, Hkv, D)
        for h in range(group * Hkv):
            expected = (v0[h // group] * vs).to(BF16)  # exact in float64, one rounding to bf16
            torch.testing.assert_close(out[row, h], expected, **EXACT)
            logit = float(q[row, h].double() @ k0[h // group]) * ks * D ** -0.5
            torch.testing.assert_close(lse[row, h].item(), logit / LN2, **LSE_TOL)
    assert torch.all(out[2] == 0) and torch.all(lse[2] == NEG_INF)


def test_k_scale_and_v_scale_are_not_interchangeable():
    """Swapping k_scale and v_scale changes the answer; the right assignment equals decoding a bf16
    cache pre-multiplied by hand (K * k_scale, V * v_scale), bit for bit (the products are exact)."""
    g = _gen("swap")
    page, D, Hkv, group, P = 16, 64, 2, 2, 10
    seq_lens = torch.tensor([40, 25, 9], dtype=torch.int32)
    bt = make_block_table(g, seq_lens.tolist(), page, P, 3)
    kv = make_cache(g, layout="HND", container="single", dtype=FP8, P=P, Hkv=Hkv, page=page, D=D)
    q = _randn(g, 3, group * Hkv, D).to(BF16)
    ks, vs = 0.5, 3.0
    right = ref.paged_decode(q, kv, bt, seq_lens, k_scale=ks, v_scale=vs, return_lse=True)
    swapped = ref.paged_decode(q, kv, bt, seq_lens, k_scale=vs, v_scale=ks, return_lse=True)
    manual = torch.stack([kv[:, 0].float() * ks, kv[:, 1].float() * vs], dim=1)
    assert torch.equal(manual.to(BF16).float(), manual)  # fp8 * {0.5, 3} is exact in bf16
    by_hand = ref.paged_decode(q, manual.to(BF16), bt, seq_lens, return_lse=True)
    torch.testing.assert_close(right[0], by_hand[0], **EXACT)
    torch.testing.assert_close(right[1], by_hand[1], **EXACT)
    assert (right[0].float() - swapped[0].float()).abs().max() > 0.5
    assert (right[1] - swapped[1]).abs().max() > 0.5
    exp_out, exp_lse = naive_decode(q, kv, "HND", bt, seq_lens, 1, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(right[0].double(), exp_out, **OUT_TOL[BF16])
    torch.testing.assert_close(right[1].double(), exp_lse, **LSE_TOL)


def test_draft_of_two_equals_two_sequential_decodes():
    """q_len 2 == a q_len 1 call with seq_len - 1 (first draft row) and one with seq_len (second),
    same pages. Different reduction lengths may change fp32 sums in the last bits, so outputs are
    compared within one bf16 ulp and lse within a few fp32 ulps."""
    g = _gen("draft")
    page, D, Hkv, group, P = 16, 128, 2, 4, 10
    seq_lens = torch.tensor([2 * page + 3, 5, page + 1, 2], dtype=torch.int32)
    bt = make_block_table(g, seq_lens.tolist(), page, P, 3)
    kv = make_cache(g, layout="NHD", container="single", dtype=BF16, P=P, Hkv=Hkv, page=page, D=D)
    q = _randn(g, 8, group * Hkv, D).to(BF16)
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, kv_layout="NHD", q_len_per_req=2, k_scale=0.7,
                                v_scale=1.3, return_lse=True)
    for j, lens in ((0, seq_lens - 1), (1, seq_lens)):
        o1, l1 = ref.paged_decode(q[j::2], kv, bt, lens, kv_layout="NHD", k_scale=0.7, v_scale=1.3,
                                  return_lse=True)
        torch.testing.assert_close(out[j::2].float(), o1.float(), rtol=2.0**-7, atol=1e-5)
        torch.testing.assert_close(lse[j::2], l1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("D", [64, 128])
def test_default_sm_scale_is_inverse_sqrt_head_dim(D):
    g = _gen("sm", D)
    page, Hkv, group, P = 32, 2, 2, 6
    seq_lens = torch.tensor([50, 17], dtype=torch.int32)
    bt = make_block_table(g, seq_lens.tolist(), page, P, 2)
    kv = make_cache(g, layout="HND", container="tuple", dtype=BF16, P=P, Hkv=Hkv, page=page, D=D)
    q = _randn(g, 2, group * Hkv, D).to(BF16)
    default = ref.paged_decode(q, kv, bt, seq_lens, return_lse=True)
    explicit = ref.paged_decode(q, kv, bt, seq_lens, sm_scale=1.0 / math.sqrt(D), return_lse=True)
    torch.testing.assert_close(default[0], explicit[0], **EXACT)
    torch.testing.assert_close(default[1], explicit[1], **EXACT)
    other = ref.paged_decode(q, kv, bt, seq_lens, sm_scale=1.0, return_lse=True)
    assert (other[1] - default[1]).abs().max() > 0.1


def test_fp8_query_equals_dequantized_bf16_query():
    """An FP8 query with q_scale == the bf16 query q_fp8.float() * q_scale. With q_scale = 0.375 the
    dequantized query is exact in bf16, so both paths do the same fp32 math: equal bit for bit."""
    g = _gen("fp8q-deq")
    page, D, Hkv, group, q_len, P = 16, 64, 2, 4, 2, 8
    seq_lens = torch.tensor([33, 7, 16], dtype=torch.int32)
    bt = make_block_table(g, seq_lens.tolist(), page, P, 3)
    kv = make_cache(g, layout="NHD", container="single", dtype=FP8, P=P, Hkv=Hkv, page=page, D=D)
    q8 = _randn(g, 6, group * Hkv, D, scale=4.0).to(FP8)
    for qs in (0.375, torch.tensor([0.375])):
        deq = q8.float() * 0.375
        assert torch.equal(deq.to(BF16).float(), deq)
        a = ref.paged_decode(q8, kv, bt, seq_lens, kv_layout="NHD", q_len_per_req=q_len, q_scale=qs,
                             k_scale=0.4, v_scale=2.0, return_lse=True)
        b = ref.paged_decode(deq.to(BF16), kv, bt, seq_lens, kv_layout="NHD", q_len_per_req=q_len,
                             k_scale=0.4, v_scale=2.0, return_lse=True)
        assert a[0].dtype == BF16
        torch.testing.assert_close(a[0], b[0], **EXACT)
        torch.testing.assert_close(a[1], b[1], **EXACT)


def test_q_scale_rules():
    g = _gen("qs-rules")
    kv = make_cache(g, layout="HND", container="single", dtype=BF16, P=2, Hkv=1, page=16, D=64)
    bt = torch.tensor([[0]], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    qb = _randn(g, 1, 2, 64).to(BF16)
    with pytest.raises(ValueError, match="q_scale"):
        ref.paged_decode(qb, kv, bt, lens, q_scale=1.0)
    with pytest.raises(ValueError, match="q_scale"):
        ref.paged_decode(qb.to(FP16), kv, bt, lens, q_scale=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="q_scale"):
        ref.paged_decode(qb.to(FP8), kv, bt, lens)
    with pytest.raises(ValueError, match="k_scale"):
        ref.paged_decode(qb, kv, bt, lens, k_scale=torch.tensor([1.0, 2.0]))


def test_tensor_scales_equal_float_scales():
    """Scales as 1-element fp32 tensors ([1] or 0-d) give the same bits as the same Python floats."""
    g = _gen("tensor-scales")
    page, D, Hkv, group, P = 16, 64, 2, 2, 6
    seq_lens = torch.tensor([30, 11], dtype=torch.int32)
    bt = make_block_table(g, seq_lens.tolist(), page, P, 2)
    kv = make_cache(g, layout="NHD", container="tuple", dtype=FP8, P=P, Hkv=Hkv, page=page, D=D)
    q8 = _randn(g, 2, group * Hkv, D).to(FP8)
    qs, ks, vs = (torch.tensor(x, dtype=torch.float32) for x in (0.37, 0.81, 1.7))
    base = ref.paged_decode(q8, kv, bt, seq_lens, kv_layout="NHD", q_scale=qs.item(), k_scale=ks.item(),
                            v_scale=vs.item(), return_lse=True)
    for shape in ((1,), ()):
        t = ref.paged_decode(q8, kv, bt, seq_lens, kv_layout="NHD", q_scale=qs.reshape(shape),
                             k_scale=ks.reshape(shape), v_scale=vs.reshape(shape), return_lse=True)
        torch.testing.assert_close(t[0], base[0], **EXACT)
        torch.testing.assert_close(t[1], base[1], **EXACT)


def test_out_of_range_page_reads_as_zeros():
    """What is checked: a block_table entry outside [0, P) (here -1, P and P + 100) behaves exactly
    like a resident page whose K and V are all zero. Its tokens stay *visible*: each has logit 0 and
    contributes exp(0) to the softmax denominator, and 0 to the output. Whatever the clamped-to
    pages (0 and P - 1) hold, here NaN and inf, must not leak. With every page out of range the
    answer is known in closed form: out = 0, lse = log2(n_visible)."""
    g = _gen("oob")
    page, D, Hkv, group, q_len, P = 16, 64, 2, 2, 2, 6
    seq_lens = torch.tensor([3 * page - 5, 2 * page, page - 4], dtype=torch.int32)
    bt = torch.tensor([[2, -1, P], [P + 100, 3, 0], [-1, 0, 0]], dtype=torch.int32)
    kv = make_cache(g, layout="HND", container="single", dtype=BF16, P=P, Hkv=Hkv, page=page, D=D)
    kv[0] = float("nan")
    kv[P - 1, 0] = float("inf")
    kv[P - 1, 1] = float("nan")
    q = _randn(g, 3 * q_len, group * Hkv, D).to(BF16)
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, q_len_per_req=q_len, return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    exp_out, exp_lse = naive_decode(q, kv, "HND", bt, seq_lens, q_len)  # zeros for ids outside [0, P)
    torch.testing.assert_close(out.double(), exp_out, **OUT_TOL[BF16])
    torch.testing.assert_close(lse.double(), exp_lse, **LSE_TOL)
    # request 2 reads only out-of-range pages: closed form
    for j in range(q_len):
        n = int(seq_lens[2]) - q_len + j + 1
        assert torch.all(out[2 * q_len + j] == 0)
        torch.testing.assert_close(lse[2 * q_len + j], torch.full((group * Hkv,), math.log2(n)), **LSE_TOL)


@pytest.mark.parametrize("q_len", [1, 3])
def test_seq_lens_past_the_block_table_attend_only_what_it_addresses(q_len):
    """A ``seq_len`` beyond the table's capacity (``max_pages * page``) attends the positions the
    table addresses, with each draft row's causal limit clamped to the capacity: the same rule as
    the prefill kernel's, and the decode kernel's (which ends its tiles there). A request whose
    table has no column sees nothing (0 and -inf); a huge corrupted length costs nothing more."""
    g = _gen("capacity", q_len)
    page, D, Hkv, group, P, W = 16, 64, 2, 2, 9, 3
    seq_lens = torch.tensor([W * page + 5, W * page + 1, 2 ** 31 - 1, W * page - 1, 7], dtype=torch.int32)
    bt = torch.randint(0, P, (len(seq_lens), W), generator=g).to(torch.int32)
    kv = make_cache(g, layout="HND", container="single", dtype=BF16, P=P, Hkv=Hkv, page=page, D=D)
    q = _randn(g, len(seq_lens) * q_len, group * Hkv, D).to(BF16)
    out, lse = _check_against_naive(q, kv, "HND", bt, seq_lens, q_len)
    assert not torch.isnan(out).any() and not torch.isneginf(lse[:4 * q_len]).any()
    # every row of requests 0 and 2 sees exactly the table's W * page positions: the same as with
    # the smallest length whose draft rows all reach the capacity (request 1's first rows, with
    # q_len 3, stop below it and its last ones are clamped: checked against the loops above)
    for b in (0, 2):
        assert int(seq_lens[b]) - q_len + 1 >= W * page
        rows = slice(b * q_len, (b + 1) * q_len)
        cap_out, cap_lse = ref.paged_decode(q[rows], kv, bt[b:b + 1],
                                            torch.tensor([W * page + q_len - 1], dtype=torch.int32),
                                            q_len_per_req=q_len, return_lse=True)
        torch.testing.assert_close(out[rows], cap_out, **EXACT)
        torch.testing.assert_close(lse[rows], cap_lse, **EXACT)
    # no column: nothing is attended
    empty_out, empty_lse = ref.paged_decode(q[:q_len], kv, bt[:1, :0], seq_lens[:1], q_len_per_req=q_len,
                                            return_lse=True)
    assert torch.all(empty_out == 0) and torch.all(empty_lse == NEG_INF)


# ----------------------------------------------------------------------------------------------
# 3. merge_states
# ----------------------------------------------------------------------------------------------

# merge_states in fp32 vs float64: weights 2^(lse_s - m) carry ~|lse_s - m| * 6e-8 relative error
# (|lse_s - m| <= ~30 here), outputs are convex combinations of O(1) values: 1e-5 covers it.
MERGE_TOL = dict(rtol=1e-5, atol=1e-5)


def _random_partials(g, S, N, H, D, p_empty=0.25):
    po = _randn(g, S, N, H, D, scale=2.0)
    pl = torch.rand(S, N, H, generator=g) * 30 - 10
    empty = torch.rand(S, N, H, generator=g) < p_empty
    return po, pl.masked_fill(empty, NEG_INF), empty


@pytest.mark.parametrize("S", [2, 3, 7])
def test_merge_states_matches_float64_formula(S):
    g = _gen("merge", S)
    po, pl, _ = _random_partials(g, S, 5, 3, 16)
    out, lse = ref.merge_states(po, pl)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    exp_out, exp_lse = naive_merge(po, pl)
    torch.testing.assert_close(out.double(), exp_out, **MERGE_TOL)
    torch.testing.assert_close(lse.double(), exp_lse, **MERGE_TOL)
    out64, lse64 = ref.merge_states(po, pl, float64=True)
    torch.testing.assert_close(out64.double(), exp_out, **MERGE_TOL)
    torch.testing.assert_close(lse64.double(), exp_lse, **MERGE_TOL)


def test_merge_states_empty_splits_contribute_nothing():
    g = _gen("merge-garbage")
    S, N, H, D = 4, 6, 2, 8
    po, pl, empty = _random_partials(g, S, N, H, D, p_empty=0.4)
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
    junk = garbage[torch.randint(0, 4, (S, N, H, D), generator=g)]
    dirty = torch.where(empty.unsqueeze(-1), junk, po)
    clean = torch.where(empty.unsqueeze(-1), 0.0, po)
    out, lse = ref.merge_states(dirty, pl)
    assert torch.isfinite(out).all()
    out_c, lse_c = ref.merge_states(clean, pl)
    torch.testing.assert_close(out, out_c, **EXACT)
    torch.testing.assert_close(lse, lse_c, **EXACT)
    exp_out, exp_lse = naive_merge(clean, pl)
    torch.testing.assert_close(out.double(), exp_out, **MERGE_TOL)
    torch.testing.assert_close(lse.double(), exp_lse, **MERGE_TOL)


def test_merge_states_all_empty():
    g = _gen("merge-empty")
    S, N, H, D = 3, 4, 2, 8
    po = _randn(g, S, N, H, D)
    po[:, 1] = float("nan")
    pl = torch.rand(S, N, H, generator=g) * 4
    pl[:, :2] = NEG_INF  # rows 0 and 1 have every split empty (row 1's partials are NaN)
    out, lse = ref.merge_states(po, pl)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[:2] == 0) and torch.all(lse[:2] == NEG_INF)
    torch.testing.assert_close(out[2:].double(), naive_merge(po[:, 2:], pl[:, 2:])[0], **MERGE_TOL)


def test_merge_states_zero_splits():
    """S = 0: no split has anything, so every row is empty: 0 and -inf (what the CUDA op returns)."""
    out, lse = ref.merge_states(torch.zeros(0, 3, 2, 8), torch.zeros(0, 3, 2))
    assert out.shape == (3, 2, 8) and lse.shape == (3, 2)
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)


def test_merge_states_single_split_is_identity():
    g = _gen("merge-one")
    po, pl, empty = _random_partials(g, 1, 7, 3, 16)
    out, lse = ref.merge_states(po, pl)
    keep = ~empty[0]
    torch.testing.assert_close(out[keep], po[0][keep], **EXACT)  # weight 2^0 = 1, total 1: exact
    torch.testing.assert_close(lse, pl[0], **EXACT)
    assert torch.all(out[~keep] == 0)


def test_merge_of_real_splits_equals_unsplit_decode():
    """Split each request's KV at page boundaries into 4 chunks (some empty for the short request),
    decode each chunk as its own paged problem (shifted block table, chunk length as seq_len),
    merge, and compare with the unsplit decode. Done twice: with the float64 implementation for
    the chunks (tight), and with reference.paged_decode (its bf16 outputs carry 2^-9 relative
    rounding each, so the merged result is compared within 1e-2 absolute / relative)."""
    g = _gen("merge-real")
    page, D, Hkv, group, P = 16, 64, 2, 4, 10
    seq_lens = torch.tensor([70, 20], dtype=torch.int32)
    bt = make_block_table(g, seq_lens.tolist(), page, P, 5)
    kv = make_cache(g, layout="NHD", container="tuple", dtype=BF16, P=P, Hkv=Hkv, page=page, D=D)
    q = _randn(g, 2, group * Hkv, D).to(BF16)
    kw = dict(k_scale=0.9, v_scale=1.1)
    # chunk boundaries in pages, per request
    bounds = [[0, 2, 3, 4, 5], [0, 1, 2, 2, 2]]
    pos, pls, pos64, pls64 = [], [], [], []
    for s in range(4):
        sub_bt = torch.full((2, 5), -1, dtype=torch.int32)
        sub_len = torch.zeros(2, dtype=torch.int32)
        for b in range(2):
            a, e = bounds[b][s], bounds[b][s + 1]
            sub_bt[b, :e - a] = bt[b, a:e]
            sub_len[b] = max(0, min(int(seq_lens[b]), e * page) - a * page)
        o, lse_s = ref.paged_decode(q, kv, sub_bt, sub_len, kv_layout="NHD", return_lse=True, **kw)
        pos.append(o.float())
        pls.append(lse_s)
        o64, l64 = naive_decode(q, kv, "NHD", sub_bt, sub_len, 1, **kw)
        pos64.append(o64.float())
        pls64.append(l64.float())
    assert torch.all(pls[3][1] == NEG_INF)  # request 1's last split is empty
    full_out, full_lse = ref.paged_decode(q, kv, bt, seq_lens, kv_layout="NHD", return_lse=True, **kw)
    exp_out, exp_lse = naive_decode(q, kv, "NHD", bt, seq_lens, 1, **kw)

    m_out, m_lse = ref.merge_states(torch.stack(pos64), torch.stack(pls64))
    torch.testing.assert_close(m_out.double(), exp_out, **MERGE_TOL)
    torch.testing.assert_close(m_lse.double(), exp_lse, **MERGE_TOL)

    m_out, m_lse = ref.merge_states(torch.stack(pos), torch.stack(pls))
    torch.testing.assert_close(m_out, full_out.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(m_lse, full_lse, **LSE_TOL)


# ----------------------------------------------------------------------------------------------
# 4. quantize_fp8 / quantize_query
# ----------------------------------------------------------------------------------------------


def test_fp8_saturates_to_448():
    x = torch.tensor([1e4, -1e4, 448.0, -448.0, 449.0, 464.0, 470.0, 479.0, -479.0, 500.0, 1e30,
                      float("inf"), -float("inf")])
    expected = torch.tensor([448.0, -448, 448, -448, 448, 448, 448, 448, -448, 448, 448, 448, -448])
    y = ref.quantize_fp8(x, 1.0)
    assert y.dtype == FP8
    torch.testing.assert_close(y.float(), expected, **EXACT)
    torch.testing.assert_close(ref.quantize_fp8(torch.tensor([100.0, -100.0]), 0.1).float(),
                               torch.tensor([448.0, -448.0]), **EXACT)
    q = torch.tensor([[[1e4, -1e4, 3.0, -2.0]]], dtype=BF16)
    torch.testing.assert_close(ref.quantize_query(q, 1.0).float(),
                               torch.tensor([[[448.0, -448.0, 3.0, -2.0]]]), **EXACT)


# (x, value it must round to): exact midpoints between adjacent e4m3 values go to the even code
KNOWN_TIES = [
    (1.0625, 1.0), (1.1875, 1.25), (-1.0625, -1.0), (-1.1875, -1.25),  # spacing 1/8 in [1, 2)
    (17.0, 16.0), (19.0, 20.0),  # spacing 2 in [16, 32)
    (400.0, 384.0), (432.0, 448.0),  # spacing 32 in [256, 448]
    (2.0**-10, 0.0), (3 * 2.0**-10, 2.0**-8), (5 * 2.0**-10, 2.0**-8), (7 * 2.0**-10, 2.0**-7),  # subnormals
    (-(2.0**-10), -0.0),
]


def test_fp8_round_to_nearest_even_known_ties():
    x = torch.tensor([t[0] for t in KNOWN_TIES])
    expected = torch.tensor([t[1] for t in KNOWN_TIES])
    y = ref.quantize_fp8(x, 1.0).float()
    torch.testing.assert_close(y, expected, **EXACT)
    assert torch.equal(torch.signbit(y), torch.signbit(expected))
    # the same ties reached through the scale: 2.125 / 2 = 1.0625 -> 1.0, 2.375 / 2 = 1.1875 -> 1.25
    torch.testing.assert_close(ref.quantize_fp8(torch.tensor([2.125, 2.375]), 2.0).float(),
                               torch.tensor([1.0, 1.25]), **EXACT)
    # and through quantize_query on a bf16 query (both inputs are exact in bf16)
    q = torch.tensor([[[1.0625, 1.1875]]], dtype=BF16)
    torch.testing.assert_close(ref.quantize_query(q, 1.0).float(), torch.tensor([[[1.0, 1.25]]]), **EXACT)


def test_fp8_every_tie_rounds_to_even_code():
    """Exhaustive: the midpoint between every pair of adjacent finite e4m3 values (both signs) maps
    to the even code; the fp32 neighbours of the midpoint map to the nearer value."""
    lo, hi = FP8_POS[:-1], FP8_POS[1:]
    mid = ((lo + hi) / 2).float()
    assert torch.equal(mid.double(), (lo + hi) / 2)  # midpoints are exact in fp32
    codes_lo = torch.arange(126, dtype=torch.uint8)
    even = torch.where(codes_lo % 2 == 0, codes_lo, codes_lo + 1)
    assert torch.equal(codes(ref.quantize_fp8(mid, 1.0)), even)
    assert torch.equal(codes(ref.quantize_fp8(-mid, 1.0)), even | 0x80)
    below = torch.nextafter(mid, torch.zeros_like(mid))
    above = torch.nextafter(mid, torch.full_like(mid, 1e9))
    assert torch.equal(codes(ref.quantize_fp8(below, 1.0)), codes_lo)
    assert torch.equal(codes(ref.quantize_fp8(above, 1.0)), codes_lo + 1)


@pytest.mark.parametrize("dtype", [torch.float32, BF16, FP16])
def test_quantize_fp8_matches_independent_rne(dtype):
    g = _gen("rne", str(dtype))
    mag = 10.0 ** (torch.rand(4096, generator=g) * 8 - 5)  # 1e-5 .. 1e3 before the scale
    x = (torch.randn(4096, generator=g).sign() * mag).to(dtype)
    for scale in (0.37, 1.0, 2.5):
        y = x.float() / torch.tensor(scale, dtype=torch.float32)  # "computed in fp32"
        assert torch.equal(codes(ref.quantize_fp8(x, scale)), rne_fp8_codes(y.double()))


def _near_midpoint_inputs(scale):
    """fp32 x (both signs) with x / scale within a few fp32 ulps of every e4m3 rounding midpoint."""
    base = ((FP8_POS[:-1] + FP8_POS[1:]) / 2 * scale).float()
    xs, up, down = [base], base, base
    for _ in range(3):
        up = torch.nextafter(up, torch.full_like(base, math.inf))
        down = torch.nextafter(down, torch.zeros_like(base))
        xs += [up, down]
    x = torch.cat(xs)
    return torch.cat([x, -x])


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("scale", [0.37, 0.3, 1.7, 0.1])
def test_fp8_conversion_divides_exactly(scale, device):
    """RNE of the exact fp32 quotient x / scale, not of x * (1 / scale): the inputs sit next to the
    e4m3 rounding midpoints, where the reciprocal's 1-ulp error flips roundings (asserted below, so
    the test can tell the two apart). On CUDA, torch computes `tensor / host scalar` that way, so
    this also holds the reference to the contract there (scale as float, CPU or CUDA tensor)."""
    x = _near_midpoint_inputs(scale)
    s32 = torch.tensor(scale, dtype=torch.float32)
    expected = rne_fp8_codes((x / s32).double())
    assert not torch.equal(expected, rne_fp8_codes((x * (1 / s32)).double()))
    xd = x.to(device)
    for sc in (scale, s32, s32.reshape(1).to(device)):
        assert torch.equal(codes(ref.quantize_fp8(xd, sc).cpu()), expected)
    # quantize_query and write_kv_cache (fp8 cache, K and V) use the same conversion
    T, D = 28, x.numel() // 28
    assert torch.equal(codes(ref.quantize_query(xd.view(T, 1, D), scale).cpu()).flatten(), expected)
    kv = torch.zeros(2, 2, 1, 16, D, dtype=FP8, device=device)
    slots = torch.arange(T, dtype=torch.int64, device=device)
    ref.write_kv_cache(xd.view(T, 1, D), -xd.view(T, 1, D), kv, slots, k_scale=scale, v_scale=s32)
    stored_k = kv[:, 0].cpu().permute(0, 2, 1, 3).reshape(-1, D)[:T]  # HND [P, 1, page, D] -> tokens
    stored_v = kv[:, 1].cpu().permute(0, 2, 1, 3).reshape(-1, D)[:T]
    assert torch.equal(codes(stored_k).flatten(), expected)
    assert torch.equal(codes(stored_v).flatten(), rne_fp8_codes((-x / s32).double()))


def test_quantize_query_strided_view_of_fused_qkv():
    g = _gen("qkv")
    T, Hq, Hkv, D = 5, 8, 2, 64
    qkv = _randn(g, T, (Hq + 2 * Hkv) * D, scale=3.0).to(BF16)
    qkv[1, 3] = 1e3  # saturates at this scale
    q = qkv[:, :Hq * D].view(T, Hq, D)
    assert q.stride(0) == (Hq + 2 * Hkv) * D
    out = ref.quantize_query(q, 0.05)
    assert out.dtype == FP8 and out.shape == (T, Hq, D)
    assert torch.equal(codes(out), codes(ref.quantize_query(q.contiguous(), 0.05)))
    y = q.float() / torch.tensor(0.05, dtype=torch.float32)
    assert torch.equal(codes(out), rne_fp8_codes(y.double()))
    assert out[1, 0, 3].float() == 448


def test_quantize_query_per_kv_head_scale():
    """q_scale of shape [Hkv]: query head h uses q_scale[h // (Hq // Hkv)] (consecutive heads share)."""
    g = _gen("perhead")
    T, Hq, Hkv, D = 4, 8, 2, 32
    q = _randn(g, T, Hq, D).to(BF16)
    scale = torch.tensor([0.5, 0.03])
    out = ref.quantize_query(q, scale)
    for h in range(Hq):
        s = float(scale[h // (Hq // Hkv)])
        assert torch.equal(codes(out[:, h]), codes(ref.quantize_fp8(q[:, h], s)))
        y = q[:, h].float() / scale[h // (Hq // Hkv)]
        assert torch.equal(codes(out[:, h]), rne_fp8_codes(y.double()))
    # the tiled mapping h % Hkv would give different codes: the test can tell them apart
    tiled = torch.stack([ref.quantize_fp8(q[:, h], float(scale[h % Hkv])) for h in range(Hq)], dim=1)
    assert not torch.equal(codes(out), codes(tiled))
    with pytest.raises(ValueError):
        ref.quantize_query(q, torch.tensor([0.5, 0.2, 0.1]))  # 8 heads not a multiple of 3


def test_quantize_query_float_and_tensor_scale_identical():
    g = _gen("qscale-forms")
    q = _randn(g, 6, 4, 64, scale=5.0).to(BF16)
    base = codes(ref.quantize_query(q, 0.37))
    for s in (torch.tensor([0.37]), torch.tensor(0.37), torch.tensor([[0.37]])):
        assert torch.equal(codes(ref.quantize_query(q, s)), base)
    assert torch.equal(codes(ref.quantize_fp8(q, 0.37)), base)


# ----------------------------------------------------------------------------------------------
# 5. write_kv_cache
# ----------------------------------------------------------------------------------------------


def _fill_sentinel(g, kv_cache):
    """Random bytes everywhere (whatever they decode to, NaN included): untouched bytes must keep them."""
    for t in (kv_cache if isinstance(kv_cache, tuple) else (kv_cache,)):
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def _snapshot(kv_cache):
    return [t.clone() for t in (kv_cache if isinstance(kv_cache, tuple) else (kv_cache,))]


def _slot(layout, container, snap, which, p, h, off):
    """The D-vector of the snapshot that holds K (which=0) or V (1) of head h at (page p, offset off)."""
    if container == "tuple":
        t = snap[which]
        return t[p, h, off] if layout == "HND" else t[p, off, h]
    t = snap[0]
    return t[p, which, h, off] if layout == "HND" else t[p, which, off, h]


def _slots_for(bt_row, start, n, page):
    return [int(bt_row[t // page]) * page + t % page for t in range(start, start + n)]


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("container", ["single", "tuple"])
def test_write_kv_cache(slot_dtype, kv_dtype, layout, container):
    g = _gen("write", str(slot_dtype), str(kv_dtype), layout, container)
    P, Hkv, Hq, page, D = 7, 2, 6, 16, 64
    kv = make_cache(g, layout=layout, container=container, dtype=kv_dtype, P=P, Hkv=Hkv, page=page, D=D)
    _fill_sentinel(g, kv)
    before = _snapshot(kv)
    bt = make_block_table(g, [2 * page + 5, 2 * page], page, P, 3)
    # request 0: a prefill of 2 pages + 5 (partial last page); request 1: 7 tokens appended at
    # positions 20..26 (middle of its second page); then padding (-1) and out-of-range slots.
    slots = _slots_for(bt[0], 0, 2 * page + 5, page) + _slots_for(bt[1], 20, 7, page) + [-1, -1, P * page,
                                                                                              10**6]
    T = len(slots)
    perm = torch.randperm(T, generator=g)
    slot_mapping = torch.tensor(slots, dtype=slot_dtype)[perm]
    qkv = _randn(g, T, (Hq + 2 * Hkv) * D, scale=2.0).to(BF16)
    first_valid = next(i for i, s in enumerate(slot_mapping.tolist()) if 0 <= s < P * page)
    qkv[first_valid, Hq * D] = 3e4  # key head 0, element 0: saturates in fp8
    key = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    value = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    assert not key.is_contiguous() and not value.is_contiguous()
    if kv_dtype == FP8:
        ks, vs = 0.37, torch.tensor([1.7])
    else:
        ks, vs = 0.5, torch.tensor([2.0])
    ref.write_kv_cache(key, value, kv, slot_mapping, kv_layout=layout, k_scale=ks, v_scale=vs)

    expected = [t.clone() for t in before]
    n_written = 0
    for i, s in enumerate(slot_mapping.tolist()):
        if not 0 <= s < P * page:
            continue
        n_written += 1
        p, off = divmod(s, page)
        for h in range(Hkv):
            for which, x, sc in ((0, key, ks), (1, value, vs)):
                if kv_dtype == FP8:
                    stored = ref.quantize_fp8(x[i, h], sc)
                    assert torch.equal(codes(stored), rne_fp8_codes((x[i, h].float() / sc).double()))
                else:
                    stored = (x[i, h].double() / float(sc)).to(BF16)  # exact: power-of-two scales
                _slot(layout, container, expected, which, p, h, off).copy_(stored)
    assert n_written == 2 * page + 12
    after = _snapshot(kv)
    for e, a in zip(expected, after):
        assert torch.equal(e.view(torch.uint8), a.view(torch.uint8))
    if kv_dtype == FP8:  # the 3e4 key saturated
        assert (after[0].float().abs() == 448).any()


def _fp8_error_bounds(q, K, V, q_len, sm, ks, vs):
    """Worst-case effect of storing K, V in e4m3 (|x' - x| <= 2^-4 |x| + 2^-10 * scale: half an ulp
    with 3 mantissa bits, or half the subnormal spacing 2^-9), per (row, head):
    logits move by at most d = sm * sum_d |q_d| (2^-4 |k_d| + 2^-10 ks), so |lse' - lse| <= d / ln 2,
    each softmax weight by a factor within e^(+-2d), so |out' - out| <= vmax (e^(2d) - 1) + max |v' - v|.
    Returns (out bound [q_len, Hq, 1], lse bound [q_len, Hq]), with 1e-5 added for the fp32 math."""
    L, Hkv, D = K.shape
    Hq = q.shape[1]
    qa = q.double().abs()
    Ka = K.double().abs().repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]
    Va = V.double().abs().repeat_interleave(Hq // Hkv, dim=1)
    out_b = torch.full((q_len, Hq, 1), 1e-5, dtype=F64)
    lse_b = torch.full((q_len, Hq), 1e-5, dtype=F64)
    for j in range(q_len):
        n = L - q_len + j + 1
        if n <= 0:
            continue
        d = sm * torch.einsum("hd,lhd->hl", qa[j], 2.0**-4 * Ka[:n] + 2.0**-10 * ks).amax(dim=-1)  # [Hq]
        vmax = Va[:n].amax(dim=(0, 2))  # [Hq]
        out_b[j, :, 0] += vmax * torch.expm1(2 * d) + 2.0**-4 * vmax + 2.0**-10 * vs
        lse_b[j] += d / LN2
    return out_b, lse_b


@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("container", ["single", "tuple"])
def test_write_then_decode_round_trip(kv_dtype, layout, container):
    """K/V written through write_kv_cache and read back by paged_decode give the attention computed
    directly from the original dense K/V. bf16 with power-of-two scales stores exactly: one bf16 ulp.
    fp8 stores K/V with 3 mantissa bits: against attention on the dequantized K/V it must agree to
    one bf16 ulp; against the original K/V it must stay within the worst-case fp8 error bound
    derived in _fp8_error_bounds (plus the final bf16 rounding)."""
    g = _gen("roundtrip", str(kv_dtype), layout, container)
    P, Hkv, group, page, D, q_len = 9, 2, 3, 16, 64, 2
    Hq = group * Hkv
    lens = [2 * page + 5, page - 3, 2]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    bt = make_block_table(g, lens, page, P, 3)
    kv = make_cache(g, layout=layout, container=container, dtype=kv_dtype, P=P, Hkv=Hkv, page=page, D=D)
    _fill_sentinel(g, kv)  # random bytes (NaN included) in the never-written tails of the last pages
    Ks = [_randn(g, L, Hkv, D).to(BF16) for L in lens]
    Vs = [_randn(g, L, Hkv, D).to(BF16) for L in lens]
    slots, keys, values = [], [], []
    for b, L in enumerate(lens):
        slots += _slots_for(bt[b], 0, L, page) + [-1]
        keys += [Ks[b], torch.zeros(1, Hkv, D, dtype=BF16)]
        values += [Vs[b], torch.zeros(1, Hkv, D, dtype=BF16)]
    ks, vs = (0.02, 0.03) if kv_dtype == FP8 else (0.5, 2.0)
    ref.write_kv_cache(torch.cat(keys), torch.cat(values), kv, torch.tensor(slots, dtype=torch.int32),
                       kv_layout=layout, k_scale=ks, v_scale=vs)
    q = _randn(g, len(lens) * q_len, Hq, D).to(BF16)
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, kv_layout=layout, q_len_per_req=q_len, k_scale=ks,
                                v_scale=vs, return_lse=True)
    sm = D ** -0.5
    for b in range(len(lens)):
        rows = slice(b * q_len, (b + 1) * q_len)
        if kv_dtype == FP8:
            Kd = ref.quantize_fp8(Ks[b], ks).double() * ks
            Vd = ref.quantize_fp8(Vs[b], vs).double() * vs
            e_out, e_lse = dense_attention(q[rows], Kd, Vd, q_len, sm_scale=sm)
            torch.testing.assert_close(out[rows].double(), e_out, **OUT_TOL[BF16])
            torch.testing.assert_close(lse[rows].double(), e_lse, **LSE_TOL)
            o_out, o_lse = dense_attention(q[rows], Ks[b], Vs[b], q_len, sm_scale=sm)
            out_bound, lse_bound = _fp8_error_bounds(q[rows], Ks[b], Vs[b], q_len, sm, ks, vs)
            assert torch.all((out[rows].double() - o_out).abs() <= out_bound + 2.0**-8 * o_out.abs())
            vis = torch.isfinite(o_lse)
            assert torch.equal(torch.isfinite(lse[rows]), vis)
            assert torch.all((lse[rows].double() - o_lse)[vis].abs() <= lse_bound[vis])
        else:
            e_out, e_lse = dense_attention(q[rows], Ks[b], Vs[b], q_len, sm_scale=sm)
            torch.testing.assert_close(out[rows].double(), e_out, **OUT_TOL[BF16])
            torch.testing.assert_close(lse[rows].double(), e_lse, **LSE_TOL)


# ----------------------------------------------------------------------------------------------
# helpers: split_kv_cache, scale_value
# ----------------------------------------------------------------------------------------------


def test_split_kv_cache_views_share_memory():
    g = _gen("split")
    P, Hkv, page, D = 3, 2, 16, 8
    nhd = make_cache(g, layout="NHD", container="single", dtype=BF16, P=P, Hkv=Hkv, page=page, D=D)
    k, v = ref.split_kv_cache(nhd, "NHD")
    assert k.shape == v.shape == (P, Hkv, page, D)
    assert torch.equal(k[1, 0, 5], nhd[1, 0, 5, 0]) and torch.equal(v[2, 1, 3], nhd[2, 1, 3, 1])
    k[0, 1, 2] = 7.0
    assert torch.all(nhd[0, 0, 2, 1] == 7.0)  # a view, not a copy
    tk, tv = ref.split_kv_cache((nhd[:, 0], nhd[:, 1]), "NHD")
    assert torch.equal(tk, k) and torch.equal(tv, v)
    with pytest.raises(ValueError):
        ref.split_kv_cache(nhd, "HDN")
    with pytest.raises(ValueError):
        ref.split_kv_cache((nhd[:, 0], nhd[:, 1, :, :1]), "NHD")


def test_scale_value_forms():
    assert ref.scale_value(2) == 2.0 and isinstance(ref.scale_value(2), float)
    t = ref.scale_value(torch.tensor([0.25], dtype=torch.float64))
    assert t.shape == () and t.dtype == torch.float32 and t.item() == 0.25
    with pytest.raises(ValueError, match="k_scale"):
        ref.scale_value(torch.tensor([1.0, 2.0]), "k_scale")
