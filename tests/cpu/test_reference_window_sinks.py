"""CPU tests of the sliding window (``window_left``) and attention sinks (``sinks``) of
``reference.paged_decode`` against an independent float64 implementation written here (loops per
request / query row / head, keys assembled token by token, the sink added to the denominator by
hand) and known answers. Tolerances are those of ``test_reference`` (one ulp of the output dtype;
1e-5 on the fp32 LSE)."""

from __future__ import annotations

import math

import pytest
import torch

from cute_kernels import reference as ref

from .test_reference import (
    BF16,
    F64,
    FP8,
    FP16,
    LSE_TOL,
    NEG_INF,
    OUT_TOL,
    _gen,
    _randn,
    cache_dims,
    make_block_table,
    make_cache,
    token_kv,
)

LN2 = math.log(2.0)


def naive_window_sink_decode(q, kv_cache, layout, block_table, seq_lens, q_len, *, window_left, sinks,
                             k_scale=1.0, v_scale=1.0, sm_scale=None):
    """Float64 decode where query j of request b (position p = L - q_len + j) sees keys
    max(0, p - w) .. p (all keys <= p for w = -1), and ``sinks[h]`` (natural-log logit) joins the
    denominator: out = sum e^l v / (sum e^l + e^s), lse = log2(sum e^l + e^s)."""
    P, Hkv, page, D = cache_dims(kv_cache, layout)
    T, Hq, _ = q.shape
    group = Hq // Hkv
    sm = D ** -0.5 if sm_scale is None else sm_scale
    bt = block_table.tolist()
    out = torch.zeros(T, Hq, D, dtype=F64)
    lse = torch.full((T, Hq), NEG_INF, dtype=F64)
    for b, L in enumerate(int(x) for x in seq_lens.tolist()):
        keys = [token_kv(kv_cache, layout, bt[b][t // page], t % page, Hkv, D) for t in range(max(L, 0))]
        for j in range(q_len):
            row = b * q_len + j
            p = L - q_len + j
            lo = 0 if window_left < 0 else max(0, p - window_left)
            visible = list(range(lo, p + 1)) if p >= 0 else []
            for h in range(Hq):
                logits = [float(keys[t][0][h // group] @ q[row, h].double()) * k_scale * sm for t in visible]
                terms = logits + ([float(sinks[h])] if sinks is not None else [])
                if not terms or max(terms) == NEG_INF:
                    continue
                m = max(terms)
                denom = sum(math.exp(x - m) for x in terms)
                acc = torch.zeros(D, dtype=F64)
                for t, x in zip(visible, logits):
                    acc += math.exp(x - m) * keys[t][1][h // group] * v_scale
                out[row, h] = acc / denom
                lse[row, h] = (m + math.log(denom)) / LN2
    return out, lse


def _problem(g, *, q_len, page, Hkv=2, group=4, D=64, kv_dtype=BF16, layout="HND", container="single"):
    lens = [5 * page + 3, 0, 2 * page, max(q_len - 1, 1), 7 * page - 1]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    bt = make_block_table(g, lens, page, P=40, max_pages=8)
    kv = make_cache(g, layout=layout, container=container, dtype=kv_dtype, P=40, Hkv=Hkv, page=page, D=D)
    q_dtype = FP16 if kv_dtype == FP16 else BF16
    q = _randn(g, len(lens) * q_len, group * Hkv, D).to(q_dtype)
    return q, kv, bt, seq_lens


@pytest.mark.parametrize("window_left", [-1, 0, 1, 15, 37, 200])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("q_len", [1, 3])
def test_window_and_sinks_match_float64_loops(window_left, with_sinks, q_len):
    g = _gen("win-sink", window_left, with_sinks, q_len)
    page = 16
    q, kv, bt, seq_lens = _problem(g, q_len=q_len, page=page, kv_dtype=FP8 if window_left % 2 else BF16)
    Hq = q.shape[1]
    sinks = (torch.randn(Hq, generator=g) * 2.0).float() if with_sinks else None
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, q_len_per_req=q_len, k_scale=0.7, v_scale=1.3,
                                window_left=window_left, sinks=sinks, return_lse=True)
    exp_out, exp_lse = naive_window_sink_decode(q, kv, "HND", bt, seq_lens, q_len, window_left=window_left,
                                                sinks=sinks, k_scale=0.7, v_scale=1.3)
    torch.testing.assert_close(out.double(), exp_out, **OUT_TOL[out.dtype])
    torch.testing.assert_close(lse.double(), exp_lse, **LSE_TOL)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("container", ["single", "tuple"])
def test_window_and_sinks_every_layout(layout, container):
    g = _gen("win-sink-layout", layout, container)
    q, kv, bt, seq_lens = _problem(g, q_len=2, page=32, layout=layout, container=container, kv_dtype=FP16)
    sinks = torch.randn(q.shape[1], generator=g).float()
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, kv_layout=layout, q_len_per_req=2, window_left=40, sinks=sinks,
                                return_lse=True)
    exp_out, exp_lse = naive_window_sink_decode(q, kv, layout, bt, seq_lens, 2, window_left=40, sinks=sinks)
    torch.testing.assert_close(out.double(), exp_out, **OUT_TOL[FP16])
    torch.testing.assert_close(lse.double(), exp_lse, **LSE_TOL)


def test_window_zero_sees_only_itself():
    """window_left = 0: each query attends to its own key only, so the output is that key's V
    (one rounding) and the LSE its logit in base 2."""
    g = _gen("win0")
    page, Hkv, group, D = 16, 1, 2, 64
    lens = [3 * page + 5]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    bt = make_block_table(g, lens, page, P=8, max_pages=4)
    kv = make_cache(g, layout="HND", container="single", dtype=BF16, P=8, Hkv=Hkv, page=page, D=D)
    q = _randn(g, 2, group * Hkv, D).to(BF16)
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, q_len_per_req=2, window_left=0, return_lse=True)
    for j in range(2):
        t = lens[0] - 2 + j
        k, v = token_kv(kv, "HND", int(bt[0, t // page]), t % page, Hkv, D)
        for h in range(group):
            assert torch.equal(out[j, h], v[0].to(BF16))
            torch.testing.assert_close(lse[j, h].double(), (k[0] @ q[j, h].double()) * D ** -0.5 / LN2, **LSE_TOL)


def test_window_covering_everything_equals_no_window():
    g = _gen("win-all")
    q, kv, bt, seq_lens = _problem(g, q_len=2, page=16)
    full = ref.paged_decode(q, kv, bt, seq_lens, q_len_per_req=2, return_lse=True)
    wide = ref.paged_decode(q, kv, bt, seq_lens, q_len_per_req=2, window_left=int(seq_lens.max()), return_lse=True)
    assert torch.equal(full[0], wide[0]) and torch.equal(full[1], wide[1])


def test_sink_known_answers():
    """A -inf sink changes nothing; a sink far above every logit drives the output to 0 and the
    LSE to the sink's (base 2); a row with no visible key gets output 0 and the sink's LSE."""
    g = _gen("sink-known")
    q, kv, bt, seq_lens = _problem(g, q_len=1, page=16)
    Hq = q.shape[1]
    base = ref.paged_decode(q, kv, bt, seq_lens, return_lse=True)
    none = ref.paged_decode(q, kv, bt, seq_lens, sinks=torch.full((Hq,), NEG_INF), return_lse=True)
    assert torch.equal(base[0], none[0]) and torch.equal(base[1], none[1])
    huge = torch.full((Hq,), 80.0)
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, sinks=huge, return_lse=True)
    assert out.abs().max() < 1e-20
    torch.testing.assert_close(lse, torch.full_like(lse, 80.0 / LN2), **LSE_TOL)
    # request 1 has seq_len 0: output 0, lse = sink / ln 2
    sinks = torch.randn(Hq, generator=g)
    out, lse = ref.paged_decode(q, kv, bt, seq_lens, sinks=sinks, return_lse=True)
    assert torch.all(out[1] == 0)
    torch.testing.assert_close(lse[1], sinks / LN2, **LSE_TOL)


def test_sink_in_one_split_merges_to_the_whole():
    """The kernels add the sink in split 0 only: merging a split that holds the sink with one
    that does not gives the single-pass result (the merge needs no knowledge of sinks)."""
    g = _gen("sink-split")
    page = 16
    q, kv, bt, seq_lens = _problem(g, q_len=1, page=page)
    Hq = q.shape[1]
    sinks = torch.randn(Hq, generator=g)
    q = q.double()  # a float64 query keeps the output in float64: the comparison can be tight
    whole_out, whole_lse = ref.paged_decode(q, kv, bt, seq_lens, sinks=sinks, return_lse=True, float64=True)
    # split at a page boundary: keys [0, cut) with the sink, keys [cut, L) without, as windows
    # can't express a prefix, build the two halves from block tables of their own pages
    cut_pages = 2
    first_lens = torch.clamp(seq_lens, max=cut_pages * page)
    second_lens = torch.clamp(seq_lens - cut_pages * page, min=0)
    bt2 = torch.full_like(bt, -1)
    bt2[:, : bt.shape[1] - cut_pages] = bt[:, cut_pages:]
    # the first split's queries must sit after its keys: q_len 1 with L = first_len means the
    # query position is first_len - 1, which sees all of them (no window)
    o1, l1 = ref.paged_decode(q, kv, bt, first_lens, sinks=sinks, return_lse=True, float64=True)
    o2, l2 = ref.paged_decode(q, kv, bt2, second_lens, return_lse=True, float64=True)
    out, lse = ref.merge_states(torch.stack([o1, o2]), torch.stack([l1, l2]), float64=True)
    # fp32 partial LSEs (the reference returns fp32 LSE) bound the agreement
    torch.testing.assert_close(out.double(), whole_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), whole_lse.double(), **LSE_TOL)


def test_bad_window_and_sinks_are_refused():
    g = _gen("bad")
    q, kv, bt, seq_lens = _problem(g, q_len=1, page=16)
    with pytest.raises(ValueError, match="window_left"):
        ref.paged_decode(q, kv, bt, seq_lens, window_left=-2)
    with pytest.raises(ValueError, match="sinks"):
        ref.paged_decode(q, kv, bt, seq_lens, sinks=torch.zeros(3))
