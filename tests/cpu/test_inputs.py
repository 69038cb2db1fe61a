"""Every bad-input class has one defined behaviour (docs/design/inputs.md), the same for CPU and
CUDA tensors: a clear error naming the argument, or a documented result. On the CPU:

- an empty KV pool is refused by the attention ops before any launch; the cache write writes
  nothing;
- the kernels' limits (head dims, page sizes, rows per CTA) are refused for CPU tensors too, and
  ``out=`` is honoured;
- 0-d and 1-element tensor scales reach a kernel as a ``[1]`` view (the generated caller);
- checked mode (``CUTE_KERNELS_CHECK=1``) raises on bad data naming the argument and its first bad
  index, and passes good data through to the same result; off, the same data gets its defined
  result;
- workspaces are per (device, stream) and a replaced buffer stays alive until released.
"""

from __future__ import annotations

import math

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops import _launch
from cute_kernels.ops._torch import DeviceBuffer, release_workspaces
from tests.cpu.test_qsa_reference import make_qsa_case

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


@pytest.fixture
def checked():
    previous = _launch.set_checked(True)
    try:
        yield
    finally:
        _launch.set_checked(previous)


def _decode_case(*, B=3, Hq=8, Hkv=2, D=64, page=16, P=12, W=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(BF16)
    kv = torch.randn(P, 2, Hkv, page, D, generator=g).to(BF16)
    bt = torch.randperm(P, generator=g)[:B * W].view(B, W).to(torch.int32)
    sl = torch.tensor([W * page - 3, 1, page + 2][:B], dtype=torch.int32)
    return q, kv, bt, sl


# ----------------------------------------------------------------------------------------------
# the KV pool
# ----------------------------------------------------------------------------------------------


def test_empty_pool_is_refused_by_decode_and_qsa():
    q, kv, bt, sl = _decode_case()
    with pytest.raises(ValueError, match=r"kv_cache has no pages \(P = 0\)"):
        cute_kernels.paged_decode(q, kv[:0], bt, sl)
    with pytest.raises(ValueError, match=r"k_cache has no pages \(P = 0\)"):
        cute_kernels.paged_decode(q, (kv[:0, 0], kv[:0, 1]), bt, sl)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv_cache has no pages \(P = 0\)"):
        cute_kernels.paged_prefill(q, kv[:0], bt, sl, qsl)
    c = make_qsa_case(rows=4, num_q_heads=8, num_kv_heads=2, head_dim=64, page=16, ctx=40)
    args = {k: v for k, v in c.items() if k != "meta"}
    with pytest.raises(ValueError, match=r"k_cache has no blocks \(num_blocks = 0\)"):
        cute_kernels.qsa_sparse_attention(**dict(args, k_cache=args["k_cache"][:0], v_cache=args["v_cache"][:0]),
                                          prefill=False)


def test_empty_pool_cache_write_writes_nothing():
    key = torch.randn(4, 2, 64).to(BF16)
    cache = torch.empty(0, 2, 2, 16, 64, dtype=BF16)
    cute_kernels.write_kv_cache(key, key, cache, torch.tensor([0, 5, -1, 9]))  # every slot is outside
    assert cache.numel() == 0


def test_block_table_of_no_columns_attends_nothing():
    q, kv, bt, sl = _decode_case()
    out, lse = cute_kernels.paged_decode(q, kv, bt[:, :0], sl, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


# ----------------------------------------------------------------------------------------------
# the kernels' limits hold for CPU tensors too; out= is honoured
# ----------------------------------------------------------------------------------------------


def test_decode_limits_hold_on_the_cpu():
    q, kv, bt, sl = _decode_case()
    with pytest.raises(ValueError, match="head_dim must be one of"):
        cute_kernels.paged_decode(q[..., :32].contiguous(), kv[..., :32].contiguous(), bt, sl)
    with pytest.raises(ValueError, match="page size must be one of"):
        cute_kernels.paged_decode(q, kv[:, :, :, :8].contiguous(), bt, sl)
    big = torch.randn(3 * 2, 130, 64).to(BF16)  # 65 heads per KV head x q_len 2
    with pytest.raises(ValueError, match="Hq/Hkv x q_len_per_req must be <= 64"):
        cute_kernels.paged_decode(big, kv[:, :, :1].contiguous(), bt, sl, q_len_per_req=2)
    with pytest.raises(ValueError, match="contiguous heads"):
        cute_kernels.paged_decode(q.transpose(0, 1).contiguous().transpose(0, 1), kv, bt, sl)
    with pytest.raises(ValueError, match="num_splits"):
        cute_kernels.paged_decode(q, kv, bt, sl, num_splits=0)


def test_decode_out_is_honoured_on_the_cpu():
    q, kv, bt, sl = _decode_case()
    out = torch.full_like(q, float("nan"))
    res, lse = cute_kernels.paged_decode(q, kv, bt, sl, out=out, return_lse=True)
    ref_out, ref_lse = reference.paged_decode(q, kv, bt, sl, return_lse=True)
    assert res is out and torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_merge_and_cache_write_limits_hold_on_the_cpu():
    with pytest.raises(ValueError, match="too large for merge_states"):
        cute_kernels.merge_states(torch.zeros(2, 1, 1, 8192), torch.zeros(2, 1, 1))
    key = torch.zeros(2, 1, 8192).to(BF16)
    with pytest.raises(ValueError, match="too large"):
        cute_kernels.write_kv_cache(key, key, torch.zeros(3, 2, 1, 16, 8192, dtype=BF16), torch.tensor([0, 1]))


def test_merge_and_quantize_out_is_honoured_on_the_cpu():
    po, pl = torch.randn(3, 2, 4, 64), torch.randn(3, 2, 4)
    out, out_lse = torch.full((2, 4, 64), float("nan")), torch.full((2, 4), float("nan"))
    res = cute_kernels.merge_states(po, pl, out=out, out_lse=out_lse)
    assert res[0] is out and res[1] is out_lse
    torch.testing.assert_close(out, reference.merge_states(po, pl)[0], rtol=0, atol=0)
    q = torch.randn(3, 4, 64).to(BF16)
    qo = torch.empty(3, 4, 64, dtype=FP8)
    assert cute_kernels.quantize_query(q, 0.5, out=qo) is qo
    assert torch.equal(qo.view(torch.uint8), reference.quantize_query(q, 0.5).view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# 0-d scales: accepted by every op, passed to a kernel as a [1] view
# ----------------------------------------------------------------------------------------------


def test_zero_d_scales_everywhere():
    q, kv, bt, sl = _decode_case()
    zero_d, one = torch.tensor(0.5), torch.tensor([[0.25]])
    ref_out = reference.paged_decode(q, kv, bt, sl, k_scale=0.5, v_scale=0.25)
    torch.testing.assert_close(cute_kernels.paged_decode(q, kv, bt, sl, k_scale=zero_d, v_scale=one), ref_out,
                               rtol=0, atol=0)
    key = torch.randn(2, 2, 64).to(BF16)
    a, b = torch.zeros(4, 2, 2, 16, 64, dtype=FP8), torch.zeros(4, 2, 2, 16, 64, dtype=FP8)
    cute_kernels.write_kv_cache(key, key, a, torch.tensor([3, 17]), k_scale=zero_d, v_scale=one)
    cute_kernels.write_kv_cache(key, key, b, torch.tensor([3, 17]), k_scale=0.5, v_scale=0.25)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    q4 = torch.randn(3, 4, 64).to(BF16)
    assert torch.equal(cute_kernels.quantize_query(q4, zero_d).view(torch.uint8),
                       cute_kernels.quantize_query(q4, 0.5).view(torch.uint8))
    c = make_qsa_case(rows=4, num_q_heads=8, num_kv_heads=2, head_dim=64, page=16, ctx=40)
    args = {k: v for k, v in c.items() if k not in ("meta", "k_scale", "v_scale")}
    torch.testing.assert_close(cute_kernels.qsa_sparse_attention(**args, prefill=False, k_scale=zero_d, v_scale=one),
                               cute_kernels.qsa_sparse_attention(**args, prefill=False, k_scale=0.5, v_scale=0.25),
                               rtol=0, atol=0)


_EMPTY_SCALE = r"must be a float or a tensor holding one value \(or one per KV head\), got shape \(0,\)"


def _prefill_fp8_case():
    q, kv, bt, sl = _decode_case()
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    return q.to(FP8), kv.to(FP8), bt, sl, qsl


@pytest.mark.parametrize("call", [
    pytest.param(lambda s: cute_kernels.quantize_query(torch.randn(3, 8, 64).to(BF16), s), id="quantize_query"),
    pytest.param(lambda s: cute_kernels.quantize_query(torch.randn(3, 8, 64).to(BF16), s, residual=True),
                 id="quantize_query-residual"),
    pytest.param(lambda s: cute_kernels.paged_prefill(*_prefill_fp8_case(), q_scale=s), id="paged_prefill-q_scale"),
    pytest.param(lambda s: cute_kernels.paged_prefill(*_prefill_fp8_case(), q_scale=1.0, k_scale=s),
                 id="paged_prefill-k_scale"),
    pytest.param(lambda s: cute_kernels.paged_decode(*_decode_case(), v_scale=s), id="paged_decode-v_scale"),
])
def test_an_empty_scale_tensor_is_refused_naming_it(call):
    """A tensor scale of no elements holds no value to read: refused naming the scale (it reached a
    modulo by its element count before)."""
    with pytest.raises(ValueError, match=r"_scale " + _EMPTY_SCALE):
        call(torch.ones(0))


def test_an_empty_q_scale_is_refused_by_the_layer():
    from dispatch import AttentionLayer, UnsupportedConfig

    with pytest.raises(UnsupportedConfig, match="q_scale " + _EMPTY_SCALE):
        AttentionLayer(8, 2, 128, kv_cache_dtype="fp8", page_size=16, arch="sm90", q_scale=torch.ones(0),
                       prefill_query_dtype="fp8x2")


@pytest.mark.parametrize("override,exc,match", [
    (dict(bogus=1), ValueError, "'bogus' is not a tuning field of common.quantize_query; its fields: items, pdl, vec"),
    # the call decides the residual: a one-term call with the residual variant had no residual_out
    (dict(residual=True), ValueError, "'residual' is not a tuning field of common.quantize_query \\(the call's"),
    (dict(pdl="yes"), TypeError, "common.quantize_query's pdl must be a bool, got 'yes'"),
    (dict(items="2"), TypeError, "common.quantize_query's items must be an int, got '2'"),
])
@pytest.mark.parametrize("residual", [False, True])
def test_quantize_query_tuning_override_names_the_field(override, exc, match, residual):
    from cute_kernels.ops import quantize_query as qq_op

    with qq_op.tuning_override(**override), pytest.raises(exc, match=match):
        cute_kernels.quantize_query(torch.randn(3, 8, 64).to(BF16), 0.5, residual=residual)


def test_generated_caller_views_a_tensor_scale_of_any_rank_as_one_element():
    """The hot path: a 0-d or [1, 1] scale reaches the compiled function as a [1] view of the same
    memory (read on the device at every replay), a [1] one as itself, a float checked inline."""
    from cute_kernels.jit.spec import ScalarArg, TensorArg

    seen = []
    sig = (TensorArg("x", "fp32", (1,)), TensorArg("k_scale", "fp32", (1,)), ScalarArg("v_scale", "fp32"))
    call = _launch.bind(("x", "k_scale", "v_scale"), (lambda *a: seen.append(a), sig, {"k_scale": "k_scale.view(1)?"},
                                                       None))
    for s in (torch.tensor(2.0), torch.tensor([[2.0]]), torch.tensor([2.0])):
        call(None, s, 0.5)
        got = seen[-1][1]
        assert got.shape == (1,) and got.data_ptr() == s.data_ptr()
        assert got is s if s.dim() == 1 else True
    with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
        call(None, torch.tensor(2.0), float("inf"))


# ----------------------------------------------------------------------------------------------
# checked mode
# ----------------------------------------------------------------------------------------------


def test_checked_mode_is_off_by_default_and_toggles_the_hot_path():
    assert not _launch.checked()
    from cute_kernels.ops.paged_decode import _launcher

    assert _launcher.entries is _launcher.launches
    previous = _launch.set_checked(True)
    try:
        assert _launcher.entries is not _launcher.launches and not _launcher.entries
    finally:
        _launch.set_checked(previous)
    assert _launcher.entries is _launcher.launches


def test_checked_decode_names_the_first_bad_index(checked):
    q, kv, bt, sl = _decode_case()
    cap = bt.shape[1] * 16
    good = cute_kernels.paged_decode(q, kv, bt, sl)
    torch.testing.assert_close(good, reference.paged_decode(q, kv, bt, sl), rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"seq_lens\[1\] = {cap + 1} must lie in \[query length 1, block-table "
                                         rf"capacity {cap}\] or be 0"):
        cute_kernels.paged_decode(q, kv, bt, torch.tensor([5, cap + 1, cap + 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens\[2\] = -4"):
        cute_kernels.paged_decode(q, kv, bt, torch.tensor([5, 0, -4], dtype=torch.int32))
    bad = bt.clone()
    bad[2, 1] = 12  # request 2 (page + 2 tokens) uses columns 0 and 1
    bad[1, 3] = -7  # request 1 (1 token) never reads column 3: fine
    with pytest.raises(ValueError, match=r"block_table\[2, 1\] = 12 is outside \[0, 12\)"):
        cute_kernels.paged_decode(q, kv, bad, sl)
    with pytest.raises(ValueError, match=r"k_scale = nan must be positive and finite"):
        cute_kernels.paged_decode(q, kv, bt, sl, k_scale=torch.tensor(float("nan")))


def test_unchecked_decode_gives_the_defined_results():
    """Without checked mode the same data runs: lengths past the table attend what it addresses,
    invalid pages read as zeros."""
    q, kv, bt, sl = _decode_case()
    cap = bt.shape[1] * 16
    long = torch.tensor([5, cap + 1, 2**31 - 1], dtype=torch.int32)
    torch.testing.assert_close(cute_kernels.paged_decode(q, kv, bt, long),
                               reference.paged_decode(q, kv, bt, torch.tensor([5, cap, cap], dtype=torch.int32)),
                               rtol=0, atol=0)
    bad = bt.clone()
    bad[2, 1] = 99
    zeroed = kv.clone()
    zeroed[bt[2, 1]] = 0
    torch.testing.assert_close(cute_kernels.paged_decode(q, kv, bad, sl), reference.paged_decode(q, zeroed, bt, sl),
                               rtol=0, atol=0)


def test_checked_qsa_names_the_first_bad_index(checked):
    c = make_qsa_case(rows=6, num_q_heads=8, num_kv_heads=2, head_dim=64, page=16, ctx=40, num_reqs=2)
    args = {k: v for k, v in c.items() if k != "meta"}
    cute_kernels.qsa_sparse_attention(**args, prefill=False)  # good data passes
    idx, topk = args["packed_indices"], args["packed_indices"].shape[1] - 1
    W, page = args["block_table"].shape[1], 16

    def bad(**kw):
        return cute_kernels.qsa_sparse_attention(**dict(args, **kw), prefill=False)

    x = idx.clone()
    x[3, topk] = topk + 1
    with pytest.raises(ValueError, match=rf"packed_indices\[3, {topk}\] \(the valid count\) = {topk + 1}"):
        bad(packed_indices=x)
    t2r = args["token_to_req"].clone()
    t2r[4] = 2
    with pytest.raises(ValueError, match=r"token_to_req\[4\] = 2 is outside \[0, 2\)"):
        bad(token_to_req=t2r)
    x = idx.clone()
    x[1, topk] = topk
    x[1, 2] = W * page
    with pytest.raises(ValueError, match=rf"packed_indices\[1, 2\] = {W * page} is neither -1 nor a token"):
        bad(packed_indices=x)
    x = idx.clone()
    x[0, topk] = topk
    x[0, 0] = 0
    bt = args["block_table"].clone()
    bt[int(args["token_to_req"][0]), 0] = args["k_cache"].shape[0]
    with pytest.raises(ValueError, match=r"packed_indices\[0, 0\] = 0 lies on page block_table\[\d, 0\]"):
        bad(packed_indices=x, block_table=bt)


def test_checked_prefill_uses_the_shared_rules(checked):
    q, kv, bt, sl = _decode_case()
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    cute_kernels.paged_prefill(q, kv, bt, sl, qsl)  # good data passes
    with pytest.raises(ValueError, match=r"query_start_loc must be non-decreasing: query_start_loc\[2\] = 0"):
        cute_kernels.paged_prefill(q, kv, bt, sl, torch.tensor([0, 2, 0, 3], dtype=torch.int32))
    cap = bt.shape[1] * 16
    with pytest.raises(ValueError, match=rf"seq_lens\[0\] = {cap + 2} must lie in \[query length 1"):
        cute_kernels.paged_prefill(q, kv, bt, torch.tensor([cap + 2, 1, 5], dtype=torch.int32), qsl)
    with pytest.raises(ValueError, match=r"v_scale = -1.0 must be positive and finite"):
        cute_kernels.paged_prefill(q, kv, bt, sl, qsl, v_scale=torch.tensor(-1.0))


def test_checked_cache_write_merge_and_quantize(checked):
    key = torch.randn(3, 2, 64).to(BF16)
    cache = torch.zeros(4, 2, 2, 16, 64, dtype=BF16)
    cute_kernels.write_kv_cache(key, key, cache, torch.tensor([0, -1, 63]))  # -1 is padding
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 64 is outside \[0, 64\)"):
        cute_kernels.write_kv_cache(key, key, cache, torch.tensor([0, -1, 64]))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = -2"):
        cute_kernels.write_kv_cache(key, key, cache, torch.tensor([-2, 1, 2]))
    pl = torch.randn(2, 3, 4)
    pl[0, 0, 0] = -math.inf  # an empty split is fine
    cute_kernels.merge_states(torch.randn(2, 3, 4, 64), pl)
    pl[1, 2, 3] = math.inf
    with pytest.raises(ValueError, match=r"partial_lse\[1, 2, 3\] = inf must be finite or -inf"):
        cute_kernels.merge_states(torch.randn(2, 3, 4, 64), pl)
    q = torch.randn(3, 4, 64).to(BF16)
    with pytest.raises(ValueError, match=r"q_scale\[1\] = 0.0 must be positive and finite"):
        cute_kernels.quantize_query(q, torch.tensor([0.5, 0.0]))
    cos_sin = torch.randn(10, 64)
    with pytest.raises(ValueError, match=r"positions\[2\] = 10 is outside \[0, 10\)"):
        cute_kernels.quantize_query(q, 0.5, rope=(cos_sin, torch.tensor([0, 9, 10])))


# ----------------------------------------------------------------------------------------------
# workspaces: per (device, stream), replaced buffers kept until released
# ----------------------------------------------------------------------------------------------


def test_workspaces_are_per_stream_and_replaced_buffers_stay_alive():
    buf = DeviceBuffer("test", torch.float32, min_numel=8)
    dev = torch.device("cpu")
    a1, a2 = buf.get(dev, 8, stream=1), buf.get(dev, 8, stream=2)
    assert a1.data_ptr() != a2.data_ptr()  # two streams never share a buffer
    assert buf.get(dev, 4, stream=1) is a1  # a request that fits reuses it
    grown = buf.get(dev, 100, stream=1)
    assert grown.numel() == 100 and buf.get(dev, 8, stream=2) is a2
    assert any(r is a1 for r in buf.retired)  # a captured graph may still address a1: kept alive
    freed = release_workspaces()
    assert freed >= 8 * 4 and not buf.retired
    assert buf.get(dev, 100, stream=1) is grown


def test_zeroed_workspaces_are_disjoint_zeroed_slices():
    """Arrival counters (zero before every launch) are carved from memory zeroed when allocated:
    each stream's slice is disjoint from every other's, so a graph capturing on a new stream takes
    zeros without allocating (inside a capture, an allocation would be zeroed only at replay)."""
    buf = DeviceBuffer("test", torch.int32, zero=True, min_numel=16)
    dev = torch.device("cpu")
    a, b = buf.get(dev, 10, stream=1), buf.get(dev, 40, stream=2)
    assert a.numel() == 16 and b.numel() == 40 and not a.any() and not b.any()
    a.fill_(7)
    assert not b.any() and not buf.get(dev, 16, stream=3).any()
    lo = lambda t: t.data_ptr()  # noqa: E731
    hi = lambda t: t.data_ptr() + t.numel() * t.element_size()  # noqa: E731
    assert hi(a) <= lo(b) or hi(b) <= lo(a)


def test_dropping_launches_keeps_their_workspaces():
    """The launch cache starts over when full; the buffers its launches bound belong to the
    DeviceBuffer, so a graph captured with a dropped launch still writes to live memory."""
    buf = DeviceBuffer("test", torch.float32, min_numel=8)
    cache = _launch.LaunchCache(max_entries=1)
    view = buf.get(torch.device("cpu"), 8)
    cache.put("a", view)
    cache.put("b", None)  # full: "a" dropped
    assert cache.get("a") is None and buf.buffers[(torch.device("cpu"), 0)].data_ptr() == view.data_ptr()


def test_launch_keys_hold_the_stream():
    from cute_kernels.ops import paged_decode as pd
    from cute_kernels.ops import qsa_sparse_attention as qsa

    q, kv, bt, sl = _decode_case()
    key = pd._key(q, kv, kv, False, bt, "HND", 1, None, 1.0, 1.0, None, False, None, True)
    assert 0 in key  # CPU tensors: stream 0 (a CUDA call's current stream otherwise)
    assert pd.stream_id is qsa.stream_id


# ----------------------------------------------------------------------------------------------
# outputs aliasing inputs, empty extents, warm-up arguments
# ----------------------------------------------------------------------------------------------


def _merge_case(seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 4, 64, generator=g), torch.randn(3, 2, 4, generator=g)


@pytest.mark.parametrize("alias,match", [
    # the merged LSE written over the merged output: the reference copied one over the other
    (lambda po, pl: dict(out=(b := torch.empty(2 * 4 * 64)).view(2, 4, 64), out_lse=b[:8].view(2, 4)),
     "out_lse must not overlap out"),
    (lambda po, pl: dict(out=po[0]), "out must not overlap partial_out"),
    (lambda po, pl: dict(out_lse=pl[1]), "out_lse must not overlap partial_lse"),
    (lambda po, pl: dict(out_lse=po[1].view(-1)[:8].view(2, 4)), "out_lse must not overlap partial_out"),
])
def test_merge_outputs_aliasing_an_input_are_refused(alias, match):
    """An output sharing bytes with the partials (or the other output) is refused on every call,
    a cached launch's too: the kernel would race, the reference silently kept one of the two
    outputs (out_lse over out: a wrong ``out``)."""
    po, pl = _merge_case()
    fine, fine_lse = torch.empty(2, 4, 64), torch.empty(2, 4)
    cute_kernels.merge_states(po, pl, out=fine, out_lse=fine_lse)  # a launch keyed on these layouts
    with pytest.raises(ValueError, match=match):
        cute_kernels.merge_states(po, pl, **alias(po, pl))
    ref_out, ref_lse = reference.merge_states(po, pl, float64=True)
    torch.testing.assert_close(fine, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fine_lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_of_no_head_dim_is_refused():
    po, pl = _merge_case()
    with pytest.raises(ValueError, match=r"partial_out must have a head dim >= 1"):
        cute_kernels.merge_states(po[..., :0], pl)


def test_cache_write_refuses_k_and_v_on_one_plane():
    """A (k_cache, v_cache) pair sharing bytes: which of K and V a slot keeps would depend on the
    kernel's write order (the reference wrote V last). The halves of one ``[P, 2, ...]`` tensor, and
    of one ``[P, Hkv, page, 2 D]`` buffer, share none and are taken."""
    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(3, 2, 64, generator=g).to(BF16), torch.randn(3, 2, 64, generator=g).to(BF16)
    slots = torch.tensor([0, 17, 40])
    kv = torch.randn(4, 2, 2, 16, 64, generator=g).to(BF16)
    before = kv.clone()
    for k_plane, v_plane in ((kv[:, 0], kv[:, 0]), (kv[:, 0], kv.view(-1)[64:64 + kv[:, 0].numel()].view(4, 2, 16, 64))):
        with pytest.raises(ValueError, match="v_cache must not overlap k_cache"):
            cute_kernels.write_kv_cache(key, value, (k_plane, v_plane), slots)
    assert torch.equal(kv.view(torch.int16), before.view(torch.int16))  # refused before anything was written
    cute_kernels.write_kv_cache(key, value, (kv[:, 0], kv[:, 1]), slots)
    buf = torch.randn(4, 2, 16, 128, generator=g).to(BF16)
    cute_kernels.write_kv_cache(key, value, (buf[..., :64], buf[..., 64:]), slots)
    ref = before.clone()
    reference.write_kv_cache(key, value, ref, slots)
    assert torch.equal(kv, ref)
    with pytest.raises(ValueError, match="kv_cache tuple must be"):  # a 1-tuple names the container
        cute_kernels.write_kv_cache(key, value, (kv[:, 0],), slots)


def test_cache_write_of_no_page_size_names_the_cache():
    key = torch.randn(3, 2, 64).to(BF16)
    with pytest.raises(ValueError, match=r"kv_cache has a page size of 0"):
        cute_kernels.write_kv_cache(key, key, torch.zeros(4, 2, 2, 0, 64, dtype=BF16), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"k_cache has a page size of 0"):
        z = torch.zeros(4, 2, 0, 64, dtype=BF16)
        cute_kernels.write_kv_cache(key, key, (z, z.clone()), torch.tensor([0, 1, 2]))


_QSA_SHAPE = dict(head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568, kv_cache_dtype="fp8")


@pytest.mark.parametrize("field,value,exc,match", [
    ("head_dim", 0, ValueError, "head_dim must be a positive int, got 0"),  # a ZeroDivisionError before
    ("num_kv_heads", 0, ValueError, "num_kv_heads must be a positive int, got 0"),  # ZeroDivisionError
    ("num_q_heads", 25, ValueError, r"num_q_heads \(25\) must be a multiple of num_kv_heads \(2\)"),  # group 12
    ("head_dim", "256", TypeError, "head_dim must be a positive int, got '256'"),
    ("kv_cache_dtype", "int8", ValueError, "kv_cache_dtype must be one of"),  # a KeyError before
    ("kv_cache_dtype", None, ValueError, "kv_cache_dtype must be one of"),  # read as q's dtype before
    ("num_sms", 0, ValueError, "num_sms must be a positive int"),  # an IndexError before
    ("topk", 0, ValueError, "topk must be a positive int"),
    ("block_table_width", 0, ValueError, "block_table_width must be a positive int"),
    ("gates", "yes", TypeError, "gates must be a sequence of"),
    ("gates", (), ValueError, "gates must hold one or more of"),
    ("scale_tensors", (1,), ValueError, "scale_tensors must hold one or more of"),
])
def test_qsa_warmup_names_a_bad_shape(field, value, exc, match):
    with pytest.raises(exc, match=match):
        cute_kernels.qsa_warmup(arch="sm_90a", progress=False, **{**_QSA_SHAPE, field: value})


@pytest.mark.parametrize("field,value,exc,match", [
    ("head_dim", 0, ValueError, "head_dim must be a positive int, got 0"),  # a ZeroDivisionError before
    ("num_q_heads", 12, ValueError, r"num_q_heads \(12\) must be a multiple of num_kv_heads \(8\)"),
    ("page_size", 16.0, TypeError, "page_size must be a positive int"),
    ("kv_dtypes", "fp8", TypeError, "kv_dtypes must be a sequence of"),  # read letter by letter before
])
def test_warmup_names_a_bad_shape(field, value, exc, match):
    shape = dict(head_dim=128, num_q_heads=32, num_kv_heads=8, page_size=16, kv_dtypes=("fp8",))
    with pytest.raises(exc, match=match):
        cute_kernels.warmup(arch="sm_90a", progress=False, **{**shape, field: value})


def test_warmup_functions_stay_callable_after_their_modules_are_imported():
    """Importing ``cute_kernels.warmup`` (for ``decode_variants``) bound the module over the public
    function: ``cute_kernels.warmup(...)`` raised "'module' object is not callable". A fresh
    interpreter, so that no earlier test resolved the names first."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import cute_kernels\n"
            "from cute_kernels.warmup import decode_variants\n"
            "from cute_kernels.qsa_warmup import qsa_variants\n"
            "for name in ('warmup', 'qsa_warmup'):\n"
            "    try:\n"
            "        getattr(cute_kernels, name)(arch='sm_90a', head_dim=0, num_q_heads=2, num_kv_heads=1, page_size=16)\n"
            "    except ValueError as e:\n"
            "        assert 'head_dim must be a positive int' in str(e), e\n"
            "    else:\n"
            "        raise AssertionError(name)\n"
            "print('callable')\n")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)}, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "callable", run.stderr[-2000:]
