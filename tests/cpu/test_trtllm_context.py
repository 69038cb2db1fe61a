"""CPU tests of ``cute_kernels.trtllm.batch_context_with_kv_cache`` (FlashInfer's
``trtllm_batch_context_with_kv_cache`` on ``paged_prefill``): the reference on CPU tensors against
the independent float64 formula of ``test_prefill_window_sinks`` with FlashInfer's scale folding
(``bmm1_scale`` natural-log logits, ``bmm2_scale`` on the output), windows across pages and
inside a request's new tokens, sinks, chunked requests after a cached prefix, uint32 lengths,
0-d scales, an FP8 query, ``cum_seq_lens_kv`` not read, and every refusal naming the argument."""

from __future__ import annotations

import pytest
import torch

from cute_kernels import trtllm

from .test_prefill_reference import BF16, FP8, FP16, ULP, _gen, dense_prefill, make_problem

REQS = ((0, 20), (37, 5), (0, 0), (90, 17), (3, 1))


def _call(p, *, bmm1, bmm2, batch=None, **kw):
    T = p["q"].shape[0]
    starts = p["query_start_loc"]
    B = len(p["seq_lens"]) if batch is None else batch
    q_lens = starts.diff()
    args = dict(workspace_buffer=torch.zeros(256, dtype=torch.uint8), max_q_len=int(q_lens.max()) if T else 0,
                max_kv_len=int(p["seq_lens"].max()), bmm1_scale=bmm1, bmm2_scale=bmm2, batch_size=B,
                cum_seq_lens_q=starts, cum_seq_lens_kv=torch.cat([torch.zeros(1, dtype=torch.int32),
                                                                  p["seq_lens"].cumsum(0).int()]),
                kv_layout=p["kv_layout"])
    args.update(kw)
    return trtllm.batch_context_with_kv_cache(p["q"], p["kv_cache"], block_tables=p["block_table"],
                                              seq_lens=args.pop("seq_lens", p["seq_lens"]), **args)


@pytest.mark.parametrize("window_left", [-1, 0, 5, 16, 37])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("kv", [BF16, FP8])
def test_context_matches_flashinfer_semantics(window_left, with_sinks, kv):
    g = _gen("ctx", window_left, with_sinks, str(kv))
    print("seed key:", ("ctx", window_left, with_sinks, str(kv)))
    p = make_problem(g, reqs=REQS, Hq=8, Hkv=2, D=64, page=16, kv_dtype=kv)
    sinks = torch.randn(8, generator=g) * 2 if with_sinks else None
    bmm1, bmm2 = 0.7 * 64 ** -0.5 * p["k_scale"], 1.3 * p["v_scale"]
    out = torch.full_like(p["q"], float("nan"))
    res, lse = _call(p, bmm1=bmm1, bmm2=bmm2, window_left=window_left, sinks=sinks, out=out, return_lse=True)
    assert res is out and not torch.isnan(out).any() and not torch.isnan(lse).any()
    want, want_lse = dense_prefill(p["q"], p["kv_cache"], p["block_table"], p["seq_lens"], p["query_start_loc"],
                                       kv_layout="HND", causal=True, window_left=window_left, sinks=sinks,
                                       k_scale=bmm1 * 64 ** 0.5, v_scale=bmm2)
    torch.testing.assert_close(out.double(), want.to(BF16).double(), rtol=2 * ULP[BF16], atol=1e-5)
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], rtol=1e-5, atol=1e-5)


def test_forms_agree_and_cum_seq_lens_kv_is_not_read():
    """uint32 lengths and offsets, 0-d / [1] tensor scales, any cum_seq_lens_kv values (vLLM passes
    cumulative pages, others cumulative tokens): one result. Non-causal without a window too."""
    g = _gen("ctx-forms")
    p = make_problem(g, reqs=REQS, Hq=4, Hkv=1, D=64, page=16, kv_dtype=FP16, q_dtype=FP16, layout="NHD",
                     container="tuple")
    base = _call(p, bmm1=0.2, bmm2=0.5, return_lse=True)
    pages = torch.tensor([0, 2, 5, 5, 12, 13], dtype=torch.int32)
    for kw in (dict(bmm1=torch.tensor(0.2), bmm2=torch.tensor([0.5]), cum_seq_lens_kv=pages),
               dict(bmm1=0.2, bmm2=0.5, seq_lens=p["seq_lens"].to(torch.uint32),
                    cum_seq_lens_q=p["query_start_loc"].to(torch.uint32))):
        got = _call(p, return_lse=True, **kw)
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
    dense = _call(p, bmm1=0.2, bmm2=0.5, causal=False)
    want, _ = dense_prefill(p["q"], p["kv_cache"], p["block_table"], p["seq_lens"], p["query_start_loc"],
                                kv_layout="NHD", causal=False, window_left=-1, sinks=None, k_scale=0.2 * 8, v_scale=0.5)
    torch.testing.assert_close(dense.double(), want.to(FP16).double(), rtol=2 * ULP[FP16], atol=1e-5)


def test_fp8_query_writes_bf16_or_fp16():
    g = _gen("ctx-fp8")
    p = make_problem(g, reqs=REQS, Hq=4, Hkv=2, D=64, page=16, kv_dtype=FP8, q_dtype=FP8)
    bmm1 = p["q_scale"] * p["k_scale"] * 64 ** -0.5
    with pytest.raises(ValueError, match="out_dtype float8_e4m3fn"):
        _call(p, bmm1=bmm1, bmm2=p["v_scale"])
    for dt in (BF16, FP16):
        out = _call(p, bmm1=bmm1, bmm2=p["v_scale"], out_dtype=dt)
        assert out.dtype == dt
        want, _ = dense_prefill(p["q"].float(), p["kv_cache"], p["block_table"], p["seq_lens"],
                                    p["query_start_loc"], kv_layout="HND", causal=True, window_left=-1, sinks=None,
                                    k_scale=bmm1 * 8, v_scale=p["v_scale"])
        torch.testing.assert_close(out.double(), want.to(dt).double(), rtol=2 * ULP[dt], atol=1e-5)


@pytest.mark.parametrize("kw, err, match", [
    (dict(batch_size=4), ValueError, r"seq_lens must be \[batch_size\]"),
    (dict(cum_seq_lens_q=torch.tensor([0, 20, 25], dtype=torch.int32)), ValueError, "cum_seq_lens_q must be"),
    (dict(cum_seq_lens_kv=torch.zeros(6, dtype=torch.int64)), TypeError, "cum_seq_lens_kv must have dtype"),
    (dict(max_q_len=-1), ValueError, "max_q_len"),
    (dict(max_q_len=2), ValueError, "max_q_len"),  # below every split of T rows: named as the API names it
    (dict(max_kv_len=None), ValueError, "max_kv_len"),
    (dict(window_left=10, causal=False), NotImplementedError, "causal=True"),
    (dict(causal=1), TypeError, "causal"),
    (dict(window_left=-3), ValueError, "window_left"),
    (dict(sinks=torch.zeros(5)), ValueError, "sinks"),
    (dict(out_dtype=torch.float16), ValueError, "out_dtype"),
    (dict(bmm1=0.0), ValueError, "bmm1_scale"),
    (dict(bmm2=torch.ones(2)), ValueError, "bmm2_scale"),
    (dict(workspace_buffer=None), TypeError, "workspace_buffer"),
])
def test_bad_inputs_name_the_argument(kw, err, match):
    p = make_problem(_gen("ctx-bad"), reqs=REQS, Hq=4, Hkv=2, D=64, page=16)
    scales = dict(bmm1=kw.pop("bmm1", 0.25), bmm2=kw.pop("bmm2", 1.0))
    with pytest.raises(err, match=match):
        _call(p, **scales, **kw)
