"""CPU tests of ``cute_kernels.trtllm`` (FlashInfer's TRT-LLM call, argument for argument): CPU
tensors run the reference, so these check the API's mapping (scale folding, natural-log logits
and sinks, the base-2 LSE, uint32 lengths, 0-d scales, FlashInfer's cache forms, its out_dtype
rule) against the independent float64 loops of ``test_reference_window_sinks`` with FlashInfer's
semantics written out, and every refusal. GPU twins: tests/gpu/test_trtllm_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

from cute_kernels import trtllm
from cute_kernels.ops import _caller_workspace as caller_ws

from .test_reference import BF16, FP8, FP16, LSE_TOL, OUT_TOL, _gen, _randn, make_block_table, make_cache
from .test_reference_window_sinks import naive_window_sink_decode

LN2 = math.log(2.0)


def _problem(g, *, q_len=1, page=16, Hkv=2, group=4, D=64, kv_dtype=BF16, layout="HND", container="single"):
    # a partial last page, an empty request, exact pages, a draft longer than its request's past,
    # seven pages: windows start mid-page and on page boundaries
    lens = [5 * page + 3, 0, 2 * page, max(q_len, 1), 7 * page - 1]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    bt = make_block_table(g, lens, page, P=40, max_pages=8)
    kv = make_cache(g, layout=layout, container=container, dtype=kv_dtype, P=40, Hkv=Hkv, page=page, D=D)
    q = _randn(g, len(lens) * q_len, group * Hkv, D).to(FP16 if kv_dtype == FP16 else BF16)
    return q, kv, bt, seq_lens


def _workspace():
    return torch.zeros(1 << 16, dtype=torch.uint8)


def _expect(q, kv, bt, seq_lens, q_len, *, bmm1, bmm2, window_left=-1, sinks=None, layout="HND"):
    """FlashInfer's semantics in float64: logits = (q . k) * bmm1 (natural log), out = softmax . v *
    bmm2, the sink in the denominator; the loops' LSE is base 2."""
    return naive_window_sink_decode(q, kv, layout, bt, seq_lens, q_len, window_left=window_left, sinks=sinks,
                                    k_scale=1.0, v_scale=bmm2, sm_scale=bmm1)


@pytest.mark.parametrize("window_left", [-1, 0, 5, 16, 37])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_matches_flashinfer_semantics(window_left, with_sinks, q_len):
    """Windows across page boundaries (16-token pages: 5, 16, 37 start mid-page and on a boundary),
    inside the speculative draft (q_len 4 with windows shorter than the draft), sinks."""
    g = _gen("trtllm", window_left, with_sinks, q_len)
    print("seed key:", ("trtllm", window_left, with_sinks, q_len))
    q, kv, bt, seq_lens = _problem(g, q_len=q_len)
    Hq = q.shape[1]
    sinks = (torch.randn(Hq, generator=g) * 2).float() if with_sinks else None
    bmm1, bmm2 = 0.6 * 0.9 * q.shape[2] ** -0.5, 1.3  # sm_scale x q_scale x k_scale, v_scale
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    res, lse = trtllm.batch_decode_with_kv_cache(q, kv, _workspace(), bt, seq_lens, int(seq_lens.max()),
                                                 bmm1_scale=bmm1, bmm2_scale=bmm2, window_left=window_left,
                                                 out=out, sinks=sinks, q_len_per_req=q_len, return_lse=True)
    assert res is out and not torch.isnan(out).any() and not torch.isnan(lse).any()
    exp_out, exp_lse = _expect(q, kv, bt, seq_lens, q_len, bmm1=bmm1, bmm2=bmm2, window_left=window_left, sinks=sinks)
    torch.testing.assert_close(out.double(), exp_out, **OUT_TOL[BF16])
    torch.testing.assert_close(lse.double(), exp_lse, **LSE_TOL)


def test_lse_is_base_two_of_the_natural_log_logits():
    """The LSE is log2(sum exp(logits) + exp(sink)): times ln 2 it is the natural-log logsumexp of
    the scaled logits and the sink, computed here directly for one row."""
    g = _gen("trtllm-lse")
    q, kv, bt, seq_lens = _problem(g, page=16)
    Hq = q.shape[1]
    sinks = torch.randn(Hq, generator=g)
    bmm1 = 0.1
    _, lse = trtllm.batch_decode_with_kv_cache(q, kv, _workspace(), bt, seq_lens, 200, bmm1_scale=bmm1,
                                               sinks=sinks, return_lse=True)
    b, h, L, page = 0, 3, int(seq_lens[0]), 16
    keys = torch.stack([kv[int(bt[b, t // page]), 0, h // 4, t % page].double() for t in range(L)])
    logits = keys @ q[b, h].double() * bmm1
    natural = torch.logsumexp(torch.cat([logits, sinks[h:h + 1].double()]), 0)
    torch.testing.assert_close(lse[b, h].double() * LN2, natural, rtol=1e-6, atol=1e-6)


def test_scale_forms_and_uint32_lengths_agree():
    """bmm scales as floats, 0-d and [1] fp32 tensors; seq_lens int32 or uint32: one result."""
    g = _gen("trtllm-forms")
    q, kv, bt, seq_lens = _problem(g)
    ws = _workspace()
    base = trtllm.batch_decode_with_kv_cache(q, kv, ws, bt, seq_lens, 200, bmm1_scale=0.2, bmm2_scale=0.5,
                                             return_lse=True)
    for b1, b2, lens in ((torch.tensor(0.2), torch.tensor(0.5), seq_lens),
                         (torch.tensor([0.2]), 0.5, seq_lens.to(torch.uint32)),
                         (0.2, torch.tensor([[0.5]]), seq_lens.to(torch.uint32))):
        got = trtllm.batch_decode_with_kv_cache(q, kv, ws, bt, lens, 200, bmm1_scale=b1, bmm2_scale=b2,
                                                return_lse=True)
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_cache_forms(layout):
    """[P, 2, ...], a (k, v) pair, and [P, 1, ...] (K and V the same tensor, as FlashInfer allows)."""
    g = _gen("trtllm-cache", layout)
    q, kv, bt, seq_lens = _problem(g, layout=layout, kv_dtype=FP16)
    sinks = torch.randn(q.shape[1], generator=g)
    ws = _workspace()
    kw = dict(bmm1_scale=0.125, window_left=20, sinks=sinks, kv_layout=layout, return_lse=True)
    single = trtllm.batch_decode_with_kv_cache(q, kv, ws, bt, seq_lens, 200, **kw)
    pair = trtllm.batch_decode_with_kv_cache(q, (kv[:, 0], kv[:, 1]), ws, bt, seq_lens, 200, **kw)
    assert torch.equal(single[0], pair[0]) and torch.equal(single[1], pair[1])
    exp_out, exp_lse = _expect(q, kv, bt, seq_lens, 1, bmm1=0.125, bmm2=1.0, window_left=20, sinks=sinks,
                               layout=layout)
    torch.testing.assert_close(single[0].double(), exp_out, **OUT_TOL[FP16])
    one = kv[:, :1]  # K = V
    got = trtllm.batch_decode_with_kv_cache(q, one, ws, bt, seq_lens, 200, **kw)
    same = trtllm.batch_decode_with_kv_cache(q, (kv[:, 0], kv[:, 0]), ws, bt, seq_lens, 200, **kw)
    assert torch.equal(got[0], same[0]) and torch.equal(got[1], same[1])


def test_fp8_query_and_cache_on_the_cpu():
    """A caller-quantized e4m3 query (its scale folded into bmm1) against an e4m3 cache: the
    reference on CPU tensors; the output is bf16 (out_dtype must say so: FlashInfer's default for
    an FP8 query is an FP8 output, which no kernel here writes)."""
    g = _gen("trtllm-fp8")
    q, kv, bt, seq_lens = _problem(g, kv_dtype=FP8)
    q_scale = 0.05
    q8 = (q.float() / q_scale).clamp(-448, 448).to(FP8)
    bmm1 = q_scale * 0.7 * q.shape[2] ** -0.5
    with pytest.raises(ValueError, match="out_dtype float8_e4m3fn"):
        trtllm.batch_decode_with_kv_cache(q8, kv, _workspace(), bt, seq_lens, 200, bmm1_scale=bmm1)
    out = trtllm.batch_decode_with_kv_cache(q8, kv, _workspace(), bt, seq_lens, 200, bmm1_scale=bmm1,
                                            out_dtype=BF16)
    assert out.dtype == BF16
    exp_out, _ = _expect(q8.float(), kv, bt, seq_lens, 1, bmm1=bmm1, bmm2=1.0)
    torch.testing.assert_close(out.double(), exp_out, **OUT_TOL[BF16])


def _call(q, kv, bt, seq_lens, **kw):
    args = dict(workspace_buffer=_workspace(), max_seq_len=200)
    args.update(kw)
    return trtllm.batch_decode_with_kv_cache(q, kv, block_tables=bt, seq_lens=seq_lens, **args)


@pytest.mark.parametrize("kw, err, match", [
    (dict(bmm1_scale=-1.0), ValueError, "bmm1_scale"),
    (dict(bmm1_scale=float("nan")), ValueError, "bmm1_scale"),
    (dict(bmm2_scale=torch.tensor([1.0, 2.0])), ValueError, "bmm2_scale"),
    (dict(bmm2_scale=torch.tensor(1.0, dtype=torch.float64)), TypeError, "bmm2_scale"),
    (dict(max_seq_len=-1), ValueError, "max_seq_len"),
    (dict(max_seq_len=2.5), ValueError, "max_seq_len"),
    (dict(out_dtype=torch.float16), ValueError, "out_dtype"),
    (dict(out_dtype="nvfp4"), TypeError, "out_dtype"),
    (dict(out_dtype=FP8), ValueError, "FP8 output"),
    (dict(out=torch.empty(5, 8, 64, dtype=torch.float16)), ValueError, "out_dtype"),
    (dict(window_left=-2), ValueError, "window_left"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(8, dtype=torch.float16)), TypeError, "sinks"),
    (dict(kv_layout="XYZ"), ValueError, "kv_layout"),
    (dict(q_len_per_req=0), ValueError, "q_len_per_req"),
    (dict(q_len_per_req=2), ValueError, "query has 5 rows"),
    (dict(workspace_buffer=[0]), TypeError, "workspace_buffer"),
])
def test_bad_inputs_name_the_argument(kw, err, match):
    g = _gen("trtllm-bad")
    q, kv, bt, seq_lens = _problem(g)
    with pytest.raises(err, match=match):
        _call(q, kv, bt, seq_lens, **kw)


def test_bad_tensors_name_the_argument():
    g = _gen("trtllm-bad-tensors")
    q, kv, bt, seq_lens = _problem(g)
    with pytest.raises(TypeError, match="seq_lens must have dtype int32 or uint32"):
        _call(q, kv, bt, seq_lens.long())
    with pytest.raises(ValueError, match="kv_cache must be"):
        _call(q, kv[:, :, 0], bt, seq_lens)
    with pytest.raises(ValueError, match="kv_cache must be a"):
        _call(q, (kv[:, 0],), bt, seq_lens)
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        _call(q.tolist(), kv, bt, seq_lens)
    with pytest.raises(ValueError, match="workspace_buffer must be contiguous"):
        _call(q, kv, bt, seq_lens, workspace_buffer=torch.zeros(64, 64)[:, ::2])


# ---------------------------------------------------------------------------------------------
# the caller's workspace
# ---------------------------------------------------------------------------------------------


def test_workspace_carve_bounds_and_layout():
    """Counters first (zeroed), then the fp32 area at a 256-byte boundary, inside the buffer; a
    buffer one byte short is refused naming it with the bytes needed."""
    need = caller_ws.required_bytes(1000, 10)
    assert need == 256 + 4000
    buf = torch.full((need + 64,), 0xAB, dtype=torch.uint8)
    fp32, counters = caller_ws.carve(buf, buf.device, 1000, 10)
    assert counters.dtype == torch.int32 and counters.numel() == 10 and torch.all(counters == 0)
    assert fp32.dtype == torch.float32 and fp32.numel() == 1000
    assert counters.data_ptr() == buf.data_ptr() and fp32.data_ptr() == buf.data_ptr() + 256
    assert torch.all(buf[40:256] == 0xAB)  # only the counters were zeroed
    fp32.fill_(1.0)
    assert torch.all(buf[need:] == 0xAB)  # nothing past what the call needs
    short = torch.zeros(need - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"workspace_buffer holds {need - 1} bytes; this call needs {need}"):
        caller_ws.carve(short, short.device, 1000, 10)
    wide = torch.zeros(need // 4 + 1, dtype=torch.float32)  # any dtype: read as bytes
    fp32, counters = caller_ws.carve(wide, wide.device, 1000, 10)
    assert fp32.numel() == 1000 and counters.numel() == 10


def test_workspace_key_follows_the_buffer():
    a, b = torch.zeros(1024, dtype=torch.uint8), torch.zeros(1024, dtype=torch.uint8)
    assert caller_ws.workspace_key(None) is None
    assert caller_ws.workspace_key(a) == (a.data_ptr(), 1024)
    assert caller_ws.workspace_key(a) != caller_ws.workspace_key(b)
    assert caller_ws.workspace_key(a[:512]) == (a.data_ptr(), 512)


def test_pages_outside_every_window_are_never_read():
    """A page no query of its request sees (wholly before the oldest draft row's window start) may
    have been freed by the engine: NaN contents or an invalid id change nothing (the kernels skip
    such pages; tests/gpu/test_trtllm_gpu.py checks them the same way)."""
    g = _gen("trtllm-freed")
    page, q_len, w = 16, 2, 21
    q, kv, bt, seq_lens = _problem(g, q_len=q_len, page=page)
    clean = trtllm.batch_decode_with_kv_cache(q, kv, _workspace(), bt, seq_lens, 200, window_left=w,
                                              q_len_per_req=q_len, return_lse=True)
    dirty, table = kv.clone(), bt.clone()
    freed = 0
    for b, L in enumerate(seq_lens.tolist()):
        for p in range(max(0, L - q_len - w) // page):
            dirty[int(bt[b, p])] = float("nan")
            table[b, p] = -1 if p % 2 else 10_000
            freed += 1
    assert freed >= 6
    got = trtllm.batch_decode_with_kv_cache(q, dirty, _workspace(), table, seq_lens, 200, window_left=w,
                                            q_len_per_req=q_len, return_lse=True)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])


def test_archs_without_a_kernel_are_served_by_the_reference(monkeypatch, caplog):
    """SM90 (sm90.decode), SM100/SM103 (sm100.decode) and every other arch (the portable
    sm80.decode) have decode kernels; an arch the registry lists none for gets the reference, with
    one warning per device."""
    import dataclasses
    import logging

    from cute_kernels.registry import KERNELS

    targets = {0: "sm_90a", 1: "sm_100a", 2: "sm_103a", 3: "sm_120a"}
    monkeypatch.setattr(trtllm, "compile_target", lambda device: targets[device.index])
    monkeypatch.setattr(trtllm, "_SERVED", {})
    assert all(trtllm.served("paged_decode", "decode", torch.device("cuda", i)) for i in range(4))
    monkeypatch.setattr(trtllm, "_SERVED", {})
    monkeypatch.setitem(KERNELS, "sm80.decode", dataclasses.replace(KERNELS["sm80.decode"], status="planned"))
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        assert [trtllm.served("paged_decode", "decode", torch.device("cuda", i)) for i in range(4)] == \
            [True, True, True, False]
        assert not trtllm.served("paged_decode", "decode", torch.device("cuda", 3))  # cached: no second warning
    warnings = [r.getMessage() for r in caplog.records if "trtllm" in r.getMessage()]
    assert len(warnings) == 1 and "sm_120a" in warnings[0] and "the reference serves it" in warnings[0]
