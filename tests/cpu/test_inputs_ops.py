"""Bad inputs of the public ops on CPU tensors get the error the GPU path gives (docs/design/inputs.md):

- an output whose elements share memory (an ``expand()``-ed or stride-0 view, an ``as_strided``
  view folding onto itself) is refused naming it, before anything is written, by every op that
  writes one; the launch keys of ``paged_prefill`` / ``paged_decode`` hold ``out``'s strides, so a
  cached launch never takes one either;
- ``paged_decode`` with an FP8 query checks its tensors as the kernel that takes one
  (``sm100.decode``) does, whichever path serves the call (CPU tensors and SM90 run the
  reference): block table and lengths, head dim, page size, ``out`` (bf16, the query's shape);
- ``paged_decode``'s ``return_lse`` is a bool, as ``paged_prefill``'s (1 or None were read as
  truthy / falsy);
- ``window_left`` beyond the kernels' int32 scalar is refused by ``paged_prefill`` and
  ``paged_decode`` (the reference took it, a kernel cannot), ``2^31 - 1`` still taken;
- a float scale finite in Python but beyond float32's largest value (the kernels' scalar type: it
  would reach them as inf) is refused naming it, by every op, the layer and the trtllm API;
- a caller's ``workspace`` (the trtllm API's ``workspace_buffer``) too small for the split
  partials an H200 launch of the call carves is refused on the CPU as on the GPU;
- ``qsa_sparse_attention`` with a cache of page size 0 is refused naming ``k_cache`` (the
  reference divided by zero; the GPU path's config refused it without naming the cache);
- inputs that require grad: CPU tensors run the reference under ``no_grad``, so outputs carry no
  autograd history and an ``out=`` that requires grad is written in place, as the kernels do (it
  was a raw "leaf Variable ... in-place" RuntimeError, and outputs had a grad_fn);
- ``AttentionLayer``: decode rows covering every request with rows left over is named (the
  prefill op refused it as "q has N rows but the batch is empty");
- ``qsa_sparse_attention``'s ``tuning_override`` fields are checked against the two QSA kernels'
  tuning fields and the launch's (a typo was dropped, or failed inside a config on the GPU only),
  on CPU tensors too;
- ``cute_kernels.warmup``'s flags and option lists (``q_lens``, ``scale_tensors``, ``kv_layouts``,
  ``kv_forms``, ``causal``, ``return_lse``, ``q_scale_kinds``, ``workers``) are named before any
  variant is built (a bare string was enumerated letter by letter, a truthy non-bool compiled a
  variant keyed on it).
"""

from __future__ import annotations

import importlib
import itertools
import random

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops import paged_decode as decode_op
from cute_kernels.ops import paged_prefill as prefill_op
from cute_kernels.ops._torch import self_overlapping
from cute_kernels.plans.args import FP32_MAX, INT32_MAX

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
I32 = torch.int32


def _attention_case(seed=0):
    """A decode batch (3 requests, one row each) and a prefill batch (rows 5, 1, 7) on one cache."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(12, 2, 2, 16, 64, generator=g).to(BF16)
    bt = torch.randperm(12, generator=g)[:12].view(3, 4).to(I32)
    q_dec = torch.randn(3, 8, 64, generator=g).to(BF16)
    sl_dec = torch.tensor([61, 1, 18], dtype=I32)
    q_pre = torch.randn(13, 8, 64, generator=g).to(BF16)
    sl_pre = torch.tensor([15, 4, 27], dtype=I32)
    qsl = torch.tensor([0, 5, 6, 13], dtype=I32)
    return kv, bt, q_dec, sl_dec, q_pre, sl_pre, qsl


# ----------------------------------------------------------------------------------------------
# outputs that overlap themselves
# ----------------------------------------------------------------------------------------------


def test_self_overlapping_is_exact_on_small_layouts():
    """The check against a brute-force count of distinct offsets, on random shapes and strides
    (stride 0, interleaved and folded layouts included); seed printed to replay."""
    seed = 1234
    rnd = random.Random(seed)
    base = torch.empty(4096)
    for _ in range(2000):
        shape = [rnd.randint(1, 5) for _ in range(rnd.randint(1, 4))]
        strides = [rnd.randint(0, 9) for _ in shape]
        t = base.as_strided(shape, strides)
        offsets = [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*map(range, shape))]
        assert self_overlapping(t) == (len(set(offsets)) != len(offsets)), (seed, shape, strides)
    assert not self_overlapping(torch.empty(5, 8)[:, ::2])  # a strided slice: disjoint elements
    assert not self_overlapping(torch.empty(0, 4).expand(0, 4))  # no elements
    assert self_overlapping(torch.empty(1, 4).expand(5, 4))


def _expanded(shape, dtype):
    return torch.empty((1, *shape[1:]), dtype=dtype).expand(shape)


def _self_overlapping_outputs():
    kv, bt, q_dec, sl_dec, q_pre, sl_pre, qsl = _attention_case()
    g = torch.Generator().manual_seed(5)
    po, pl = torch.randn(3, 5, 4, 64, generator=g), torch.randn(3, 5, 4, generator=g)
    key = torch.randn(5, 2, 64, generator=g).to(BF16)
    slots = torch.tensor([0, 3, 17, -1, 40], dtype=I32)
    return [
        ("paged_prefill out", "out", lambda: cute_kernels.paged_prefill(
            q_pre, kv, bt, sl_pre, qsl, out=_expanded((13, 8, 64), BF16))),
        ("paged_decode out", "out", lambda: cute_kernels.paged_decode(
            q_dec, kv, bt, sl_dec, out=_expanded((3, 8, 64), BF16))),
        ("merge_states out", "out", lambda: cute_kernels.merge_states(po, pl, out=_expanded((5, 4, 64), torch.float32))),
        ("merge_states out_lse", "out_lse", lambda: cute_kernels.merge_states(
            po, pl, out_lse=torch.empty(1, 4).expand(5, 4))),
        ("quantize_query out", "out", lambda: cute_kernels.quantize_query(q_dec, 0.5, out=_expanded((3, 8, 64), FP8))),
        ("quantize_query residual_out", "residual_out", lambda: cute_kernels.quantize_query(
            q_dec, 0.5, residual=True, residual_out=_expanded((3, 8, 64), FP8))),
        ("write_kv_cache kv_cache", "kv_cache", lambda: cute_kernels.write_kv_cache(
            key, key, _expanded((4, 2, 2, 16, 64), BF16), slots)),
        ("write_kv_cache k_cache", "k_cache", lambda: cute_kernels.write_kv_cache(
            key, key, (_expanded((4, 2, 16, 64), BF16), torch.zeros(4, 2, 16, 64, dtype=BF16)), slots)),
        # a page stride shorter than a page: pages folded onto each other
        ("write_kv_cache folded pages", "kv_cache", lambda: cute_kernels.write_kv_cache(
            key, key, torch.zeros(4 * 2 * 2 * 16 * 64, dtype=BF16).as_strided(
                (4, 2, 2, 16, 64), (2 * 16 * 64, 2 * 2 * 16 * 64, 16 * 64, 64, 1)), slots)),
    ]


@pytest.mark.parametrize("case", range(len(_self_overlapping_outputs())),
                         ids=[name for name, _, _ in _self_overlapping_outputs()])
def test_an_output_overlapping_itself_is_refused_naming_it(case):
    """Parallel writes to one address race on the GPU (and torch refuses the reference's copy with
    a raw RuntimeError): a ValueError naming the output, on every device."""
    _, arg, call = _self_overlapping_outputs()[case]
    with pytest.raises(ValueError, match=rf"^{arg} must not overlap itself"):
        call()


def test_qsa_output_overlapping_itself_is_refused():
    from tests.cpu.test_qsa_reference import make_qsa_case

    case = make_qsa_case(rows=6, num_q_heads=8, num_kv_heads=2, head_dim=64, page=16, num_reqs=2)
    case.pop("meta")
    with pytest.raises(ValueError, match=r"^out must not overlap itself"):
        cute_kernels.qsa_sparse_attention(**case, prefill=False, out=_expanded((6, 8, 64), BF16))


def test_attention_launch_keys_hold_the_output_strides():
    """A launch prepared for one ``out`` layout is not reused for a stride-0 ``out`` (the compiled
    function checks shapes and dtypes, not self-overlap): the keys differ."""
    kv, bt, q_dec, sl_dec, q_pre, sl_pre, qsl = _attention_case()
    dense, folded = torch.empty(3, 8, 64, dtype=BF16), _expanded((3, 8, 64), BF16)
    keys = [decode_op._key(q_dec, kv, kv, False, bt, "HND", 1, None, 1.0, 1.0, o, False, None, True)
            for o in (dense, folded, None)]
    assert len(set(keys)) == 3
    dense, folded = torch.empty(13, 8, 64, dtype=BF16), _expanded((13, 8, 64), BF16)
    keys = [prefill_op._key(q_pre, kv, False, bt, qsl, "HND", True, None, None, 1.0, 1.0, o, False)
            for o in (dense, folded, None)]
    assert len(set(keys)) == 3


# ----------------------------------------------------------------------------------------------
# paged_decode with an FP8 query
# ----------------------------------------------------------------------------------------------


def _fp8_decode_case():
    kv, bt, q, sl, *_ = _attention_case(seed=7)
    return q.to(FP8), kv.to(FP8), bt, sl


@pytest.mark.parametrize("change,exc,match", [
    (lambda q, kv, bt, sl: dict(block_table=bt.long()), TypeError, r"^block_table must have dtype int32"),
    (lambda q, kv, bt, sl: dict(seq_lens=sl.float()), TypeError, r"^seq_lens must have dtype int32"),
    (lambda q, kv, bt, sl: dict(seq_lens=sl[:2]), ValueError, r"^seq_lens must have shape \[3\]"),
    (lambda q, kv, bt, sl: dict(q_len_per_req=2), ValueError, r"^q has 3 rows; expected batch 3 x q_len_per_req 2"),
    (lambda q, kv, bt, sl: dict(q=torch.randn(3, 8, 96).to(FP8), kv_cache=torch.randn(12, 2, 2, 16, 96).to(FP8)),
     ValueError, r"^head_dim must be one of"),
    (lambda q, kv, bt, sl: dict(kv_cache=torch.randn(12, 2, 2, 8, 64).to(FP8)), ValueError, r"^page size must be one of"),
    (lambda q, kv, bt, sl: dict(out=torch.empty(3, 8, 64)), TypeError, r"^out must have dtype bfloat16"),
    (lambda q, kv, bt, sl: dict(out=torch.empty(3, 8, 64, dtype=torch.float16)), TypeError,
     r"^out must have dtype bfloat16"),
    (lambda q, kv, bt, sl: dict(out=torch.empty(3, 8, 32, dtype=BF16)), ValueError, r"^out must have shape"),
    (lambda q, kv, bt, sl: dict(kv_cache=torch.randn(kv.numel() + 1).to(FP8)[1:].view(kv.shape)), ValueError,
     r"^kv_cache data pointer must be 16-byte aligned"),
], ids=["bt-int64", "lens-float", "lens-short", "rows", "head-dim", "page", "out-fp32", "out-fp16", "out-shape",
        "unaligned"])
def test_fp8_query_decode_checks_its_tensors_on_the_cpu(change, exc, match):
    """Before: the reference took these (a raw IndexError / RuntimeError for short lengths or a
    wrong ``out``, a result for the rest) where ``sm100.decode`` refuses them."""
    q, kv, bt, sl = _fp8_decode_case()
    args = dict(q=q, kv_cache=kv, block_table=bt, seq_lens=sl)
    args.update(change(q, kv, bt, sl))
    with pytest.raises(exc, match=match):
        cute_kernels.paged_decode(
            args.pop("q"), args.pop("kv_cache"), args.pop("block_table"), args.pop("seq_lens"), q_scale=0.5, **args)


def test_fp8_query_decode_still_serves_good_calls_on_the_cpu():
    q, kv, bt, sl = _fp8_decode_case()
    out = torch.full((3, 8, 64), float("nan"), dtype=BF16)
    res = cute_kernels.paged_decode(q, kv, bt, sl, q_scale=0.5, out=out)
    assert res is out
    expect = reference.paged_decode(q, kv, bt, sl, q_scale=0.5)
    torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)
    assert not out.isnan().any()


@pytest.mark.parametrize("flag", [1, 0, None, "yes"])
def test_decode_return_lse_must_be_a_bool(flag):
    kv, bt, q_dec, sl_dec, q_pre, sl_pre, qsl = _attention_case()
    for op, args in ((cute_kernels.paged_decode, (q_dec, kv, bt, sl_dec)),
                     (cute_kernels.paged_prefill, (q_pre, kv, bt, sl_pre, qsl))):
        with pytest.raises(TypeError, match=r"^return_lse must be a bool"):
            op(*args, return_lse=flag)


# ----------------------------------------------------------------------------------------------
# int32 scalars
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [INT32_MAX + 1, 2**40])
def test_a_window_beyond_int32_is_refused(window):
    kv, bt, q_dec, sl_dec, q_pre, sl_pre, qsl = _attention_case()
    with pytest.raises(ValueError, match=r"^window_left must be an int in \[-1, 2147483647\]"):
        cute_kernels.paged_prefill(q_pre, kv, bt, sl_pre, qsl, window_left=window)
    with pytest.raises(ValueError, match=r"^window_left must be an int in \[-1, 2147483647\]"):
        cute_kernels.paged_decode(q_dec, kv, bt, sl_dec, window_left=window)


def test_the_largest_int32_window_is_no_window():
    kv, bt, q_dec, sl_dec, q_pre, sl_pre, qsl = _attention_case()
    for call in (lambda w: cute_kernels.paged_prefill(q_pre, kv, bt, sl_pre, qsl, window_left=w),
                 lambda w: cute_kernels.paged_decode(q_dec, kv, bt, sl_dec, window_left=w)):
        assert torch.equal(call(INT32_MAX), call(-1))


# ----------------------------------------------------------------------------------------------
# float scales beyond float32
# ----------------------------------------------------------------------------------------------


def _scale_calls():
    from cute_kernels import trtllm
    from dispatch import AttentionLayer

    kv, bt, q_dec, sl_dec, q_pre, sl_pre, qsl = _attention_case()
    key = q_dec[:, :2]
    ws = torch.empty(1 << 12, dtype=torch.uint8)
    return {
        "paged_prefill sm_scale": ("sm_scale", lambda s: cute_kernels.paged_prefill(q_pre, kv, bt, sl_pre, qsl,
                                                                                     sm_scale=s)),
        "paged_prefill k_scale": ("k_scale", lambda s: cute_kernels.paged_prefill(q_pre, kv, bt, sl_pre, qsl,
                                                                                   k_scale=s)),
        "paged_decode sm_scale": ("sm_scale", lambda s: cute_kernels.paged_decode(q_dec, kv, bt, sl_dec, sm_scale=s)),
        "paged_decode v_scale": ("v_scale", lambda s: cute_kernels.paged_decode(q_dec, kv, bt, sl_dec, v_scale=s)),
        "quantize_query q_scale": ("q_scale", lambda s: cute_kernels.quantize_query(q_dec, s)),
        "write_kv_cache k_scale": ("k_scale", lambda s: cute_kernels.write_kv_cache(
            key, key, kv.clone(), torch.arange(3, dtype=I32), k_scale=s)),
        "layer sm_scale": ("sm_scale", lambda s: AttentionLayer(8, 2, 64, kv_cache_dtype="bf16", page_size=16,
                                                                sm_scale=s)),
        "layer v_scale": ("v_scale", lambda s: AttentionLayer(8, 2, 64, kv_cache_dtype="bf16", page_size=16,
                                                              v_scale=s)),
        "trtllm bmm1_scale": ("bmm1_scale", lambda s: trtllm.batch_decode_with_kv_cache(q_dec, kv, ws, bt, sl_dec, 64,
                                                                                         bmm1_scale=s)),
    }


@pytest.mark.parametrize("name", sorted(_scale_calls()))
def test_a_float_scale_beyond_float32_is_refused_naming_it(name):
    arg, call = _scale_calls()[name]
    for value in (3.5e38, 1e300):
        with pytest.raises(ValueError, match=rf"^{arg} must be a positive finite float.*float32 scalar"):
            call(value)
    call(1.0)  # and a good value still runs
    call(FP32_MAX)  # the largest float32 is a valid (if useless) scale: its products may overflow, as in fp32


def test_generated_caller_refuses_a_float_scale_beyond_float32():
    """The cached GPU path checks a float scale inline (no validation runs there): the same limit."""
    from cute_kernels.jit.spec import ScalarArg
    from cute_kernels.ops import _launch

    seen = []
    call = _launch.bind(("v_scale",), (lambda *a: seen.append(a), (ScalarArg("v_scale", "fp32"),), None, None))
    call(FP32_MAX)
    call(2)  # an int: checked by the slow path, passed as a float
    assert seen == [(FP32_MAX,), (2.0,)]
    for bad in (3.5e38, float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
            call(bad)
    assert len(seen) == 2


# ----------------------------------------------------------------------------------------------
# warm-up options
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,exc,match", [
    ("q_lens", "1", TypeError, "q_lens must be a sequence of positive ints"),  # a raw str + int TypeError before
    ("q_lens", (2.0,), TypeError, r"q_lens\[0\] must be a positive int"),  # a variant of q_len 2.0 before
    ("q_lens", (), ValueError, "q_lens must hold one or more"),
    ("scale_tensors", ("yes",), ValueError, "scale_tensors must hold one or more of"),  # compiled before
    ("scale_tensors", True, TypeError, "scale_tensors must be a sequence of"),
    ("kv_layouts", "HND", TypeError, "kv_layouts must be a sequence of"),  # "bad kv_layout H" before
    ("kv_layouts", ("hnd",), ValueError, "kv_layouts must hold one or more of"),
    ("kv_forms", ("both",), ValueError, "kv_forms must hold one or more of"),
    ("causal", "yes", TypeError, "causal must be a sequence of"),  # variants with causal 'y', 'e', 's' before
    ("return_lse", (1,), ValueError, "return_lse must hold one or more of"),
    ("q_scale_kinds", ("bogus",), ValueError, "q_scale_kinds must hold one or more of"),
    ("fp8_query", "yes", TypeError, "fp8_query must be a bool"),
    ("prefill", "yes", TypeError, "prefill must be a bool"),
    ("progress", "no", TypeError, "progress must be a bool"),
    ("workers", 0, ValueError, "workers must be a positive int"),
])
def test_warmup_names_a_bad_option(monkeypatch, field, value, exc, match):
    # the module (``import cute_kernels.warmup as m`` may give the package's function of that name)
    warmup_module = importlib.import_module("cute_kernels.warmup")

    compiled = []
    monkeypatch.setattr(warmup_module, "precompile", lambda configs, target, **kw: compiled.append(configs))
    shape = dict(head_dim=128, num_q_heads=32, num_kv_heads=8, page_size=16, kv_dtypes=("fp8",), progress=False)
    with pytest.raises(exc, match=match):
        cute_kernels.warmup(arch="sm_90a", **{**shape, field: value})
    assert not compiled
    cute_kernels.warmup(arch="sm_90a", **shape, q_lens=[1, 2], kv_forms=["single", "pair"], causal=(True, False))
    assert compiled and all(c.q_len in (1, 2) for c in compiled[0] if hasattr(c, "q_len"))


@pytest.mark.parametrize("kw,match", [(dict(progress="no"), "progress must be a bool"),
                                      (dict(workers=0), "workers must be a positive int"),
                                      (dict(workers=2.0), "workers must be a positive int")])
def test_layer_warmup_names_a_bad_pool_option(monkeypatch, kw, match):
    import cute_kernels.jit.parallel as parallel
    from dispatch import AttentionLayer, UnsupportedConfig

    compiled = []
    monkeypatch.setattr(parallel, "precompile", lambda configs, target, **k: compiled.append(configs))
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype="bf16", page_size=16, arch="sm90")
    with pytest.raises(UnsupportedConfig, match=match):
        layer.warmup(4, 256, **kw)
    assert not compiled
    layer.warmup(4, 256, workers=1, progress=False)
    assert compiled and compiled[0]


# ----------------------------------------------------------------------------------------------
# caller workspaces
# ----------------------------------------------------------------------------------------------


def _long_decode_case():
    """Two requests of ~4k tokens on 2 KV heads: an H200 launch splits them (partials carved)."""
    g = torch.Generator().manual_seed(11)
    kv = torch.randn(512, 2, 2, 16, 64, generator=g).to(BF16)
    bt = torch.randperm(512, generator=g).view(2, 256).to(I32)
    return torch.randn(2, 8, 64, generator=g).to(BF16), kv, bt, torch.tensor([4000, 3000], dtype=I32)


@pytest.mark.parametrize("backend", [None, "sm80"])
def test_a_workspace_too_small_for_the_split_is_refused_on_the_cpu(backend):
    """Before: CPU tensors never carved the buffer, so any size passed; the GPU raised."""
    from cute_kernels import trtllm

    q, kv, bt, sl = _long_decode_case()
    ctx = decode_op.tuning_override(backend=backend) if backend else decode_op.tuning_override()
    with ctx:
        for nbytes in (16, 4096):
            with pytest.raises(ValueError, match=rf"^workspace_buffer holds {nbytes} bytes; this call needs"):
                cute_kernels.paged_decode(q, kv, bt, sl, workspace=torch.empty(nbytes, dtype=torch.uint8))
        out = cute_kernels.paged_decode(q, kv, bt, sl, workspace=torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"^workspace_buffer holds 4096 bytes"):
        trtllm.batch_decode_with_kv_cache(q, kv, torch.empty(4096, dtype=torch.uint8), bt, sl, 4096)
    torch.testing.assert_close(out.float(), reference.paged_decode(q, kv, bt, sl).float(), atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------
# the layer's metadata
# ----------------------------------------------------------------------------------------------


def test_layer_rows_past_the_last_decode_request_are_named():
    from dispatch import AttentionLayer, AttentionMetadata

    g = torch.Generator().manual_seed(13)
    q = torch.randn(7, 8, 64, generator=g).to(BF16)
    k = torch.randn(7, 2, 64, generator=g).to(BF16)
    kv = torch.zeros(12, 2, 2, 16, 64, dtype=BF16)
    meta = dict(query_start_loc=torch.tensor([0, 1, 2, 7], dtype=I32), seq_lens=torch.tensor([10, 20, 30], dtype=I32),
                block_table=torch.arange(12, dtype=I32).view(3, 4), slot_mapping=torch.arange(7, dtype=I32) + 128)
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype="bf16", page_size=16, arch="sm90")
    with pytest.raises(ValueError, match=r"num_decode_tokens \(3\) makes all 3 requests decode requests, but q has 4"):
        layer(q, k, k, kv.clone(), AttentionMetadata(**meta, num_decode_tokens=3))
    out = layer(q, k, k, kv.clone(), AttentionMetadata(**meta, num_decode_tokens=2))
    assert out.shape == q.shape and not out.isnan().any()


def test_qsa_cache_of_no_page_size_names_the_cache():
    from tests.cpu.test_qsa_reference import make_qsa_case

    case = make_qsa_case(rows=6, num_q_heads=8, num_kv_heads=2, head_dim=64, page=16, num_reqs=2)
    case.pop("meta")
    empty = torch.zeros(11, 0, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match=r"^k_cache has a page size of 0 \(shape \(11, 0, 2, 64\)\)"):
        cute_kernels.qsa_sparse_attention(**{**case, "k_cache": empty, "v_cache": empty.clone()}, prefill=False)


# ----------------------------------------------------------------------------------------------
# inputs that require grad
# ----------------------------------------------------------------------------------------------


def test_ops_are_forward_only_on_the_cpu_as_on_the_gpu():
    kv, bt, q_dec, sl_dec, q_pre, sl_pre, qsl = _attention_case()
    q_grad = q_pre.clone().requires_grad_()
    res = cute_kernels.paged_prefill(q_grad, kv, bt, sl_pre, qsl)
    assert res.grad_fn is None and not res.requires_grad
    torch.testing.assert_close(res, cute_kernels.paged_prefill(q_pre, kv, bt, sl_pre, qsl), atol=0, rtol=0)
    for call, shape in ((lambda o: cute_kernels.paged_prefill(q_pre, kv, bt, sl_pre, qsl, out=o), (13, 8, 64)),
                        (lambda o: cute_kernels.paged_decode(q_dec, kv, bt, sl_dec, out=o), (3, 8, 64))):
        out = torch.full(shape, float("nan"), dtype=BF16, requires_grad=True)
        assert call(out) is out
        assert not out.isnan().any() and torch.equal(out, call(None))
    cache = kv.clone().requires_grad_()
    cute_kernels.write_kv_cache(q_dec[:, :2], q_dec[:, :2], cache, torch.arange(3, dtype=I32))
    assert torch.equal(cache[0, 0, :, 0], q_dec[0, :2])
    merged, lse = cute_kernels.merge_states(torch.randn(2, 3, 4, 64, requires_grad=True), torch.randn(2, 3, 4))
    codes, lo = cute_kernels.quantize_query(q_grad[:3], 0.5, residual=True)
    assert not any(t.requires_grad for t in (merged, lse, codes, lo))


@pytest.mark.parametrize("fields,error,match", [
    (dict(prodcers=2), ValueError, "'prodcers' is not a tuning field of sm90.qsa / sm90.qsa_tile; its fields: "),
    (dict(head_dim=64), ValueError, "'head_dim' is not a tuning field .* \\(the call's arguments decide it\\)"),
    (dict(rows_per_cta=4), ValueError, "'rows_per_cta' is not a tuning field"),  # tile_rows forces it
    (dict(evict_first=1), TypeError, "evict_first must be a bool, got 1"),
    (dict(stages="3"), TypeError, "stages must be an int, got '3'"),
])
def test_qsa_tuning_override_names_a_bad_field(fields, error, match):
    from cute_kernels.ops.qsa_sparse_attention import tuning_override
    from tests.cpu.test_qsa_reference import make_qsa_case

    case = make_qsa_case(rows=6, num_q_heads=8, num_kv_heads=2, head_dim=64, page=16, num_reqs=2)
    case.pop("meta")
    with tuning_override(**fields), pytest.raises(error, match=f"^tuning_override: .*{match}"):
        cute_kernels.qsa_sparse_attention(**case, prefill=False)
    # the launch's fields and both kernels' tuning fields are taken
    with tuning_override(splits=3, tile_rows=1, widen=0, merge_group=2, producers=2, consumers=2, evict_first=True):
        out = cute_kernels.qsa_sparse_attention(**case, prefill=False)
    assert torch.equal(out, cute_kernels.qsa_sparse_attention(**case, prefill=False))
