"""Host side of ``cute_kernels.paged_prefill`` without a GPU.

- CPU tensors run the reference after the same validation as CUDA tensors (``out=`` honoured);
- the GPU path up to the compiled call, with the device and the compiled function stubbed: the
  arguments reach the kernel in its signature's order, 0-d scales as ``[1]`` views, the default
  ``max_query_len``; a cached call allocates only ``out``/``lse``, never synchronizes, and an
  empty batch returns without compiling;
- bad input: every class of argument error, each naming the argument, on the first (validating)
  call and on the cached fast path;
- the opt-in data check (``CUTE_KERNELS_CHECK=1``).
"""

from __future__ import annotations

import pytest
import torch

from cute_kernels import reference
from cute_kernels.ops import paged_prefill as op
from cute_kernels.plans import sm90_prefill as plan

from .test_prefill_reference import _gen, make_problem

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


def _problem(key, **kw):
    base = dict(reqs=((0, 5), (12, 3), (0, 0), (30, 1)), Hq=4, Hkv=2, D=64, page=16)
    base.update(kw)
    p = make_problem(_gen(key), **base)
    p.pop("q_scale") if p["q"].dtype != FP8 else None
    return p


def _args(p):
    return (p["q"], p["kv_cache"], p["block_table"], p["seq_lens"], p["query_start_loc"])


def _kw(p, **extra):
    kw = {k: v for k, v in p.items() if k in ("kv_layout", "k_scale", "v_scale", "q_scale")}
    kw.update(extra)
    return kw


# ----------------------------------------------------------------------------------------------
# CPU tensors: the reference, validated like CUDA tensors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv,qd,layout,container,causal", [
    (BF16, BF16, "HND", "single", True),
    (FP16, FP16, "NHD", "tuple", False),
    (FP8, BF16, "NHD", "single", True),
    (FP8, FP8, "HND", "tuple", True),
])
def test_cpu_path_equals_reference_and_honours_out(kv, qd, layout, container, causal):
    p = _problem(("cpu", str(kv), str(qd), layout, container), kv_dtype=kv, q_dtype=qd, layout=layout,
                 container=container, per_head_q_scale=qd == FP8)
    want, want_lse = reference.paged_prefill(*_args(p), causal=causal, return_lse=True, **_kw(p))
    got = op.paged_prefill(*_args(p), causal=causal, **_kw(p))
    assert torch.equal(got, want)
    out = torch.full_like(want, float("nan"))
    res, lse = op.paged_prefill(*_args(p), causal=causal, out=out, return_lse=True, max_query_len=5, **_kw(p))
    assert res is out and torch.equal(out, want) and torch.equal(lse, want_lse)
    if qd == FP8:  # an FP8 query may write fp16
        out16 = torch.full(want.shape, float("nan"), dtype=FP16)
        op.paged_prefill(*_args(p), causal=causal, out=out16, **_kw(p))
        assert torch.equal(out16, reference.paged_prefill(*_args(p), causal=causal, out_dtype=FP16, **_kw(p)))


def test_cpu_path_scales_as_tensors_and_empty_batches():
    p = _problem("scales", kv_dtype=FP8)
    want = reference.paged_prefill(*_args(p), **_kw(p))
    for ks in (torch.tensor(p["k_scale"]), torch.tensor([p["k_scale"]])):
        assert torch.equal(op.paged_prefill(*_args(p), **_kw(p, k_scale=ks)), want)
    # T = 0 rows (every request empty) and B = 0 requests
    q0 = p["q"][:0]
    qsl0 = torch.zeros_like(p["query_start_loc"])
    out, lse = op.paged_prefill(q0, p["kv_cache"], p["block_table"], p["seq_lens"], qsl0, return_lse=True, **_kw(p))
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    out = op.paged_prefill(q0, p["kv_cache"], p["block_table"][:0], p["seq_lens"][:0], qsl0[:1], **_kw(p))
    assert out.shape == (0, 4, 64)


# ----------------------------------------------------------------------------------------------
# the GPU path with the device and the compiled function stubbed
# ----------------------------------------------------------------------------------------------


def ffi_checks(signature, args):
    """What TVM-FFI checks at every call of a compiled function: dtype, rank, extents (static and
    shared by name), the alignment of the data pointer."""
    from cute_kernels.ops._torch import dtype_name

    assert len(args) == len(signature)
    extents = {}
    for arg, a in zip(signature, args):
        if not hasattr(arg, "shape"):  # a scalar
            continue
        if not isinstance(a, torch.Tensor) or dtype_name(a.dtype) != arg.dtype or a.dim() != len(arg.shape):
            raise RuntimeError(f"Mismatched Tensor on argument {arg.name}")
        for e, n in zip(arg.shape, a.shape):
            if extents.setdefault(e, n) != n if isinstance(e, str) else e != n:
                raise RuntimeError(f"Mismatched extent {e} on argument {arg.name}")
        if a.data_ptr() % arg.align:
            raise RuntimeError(f"Misaligned argument {arg.name}")


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors take the CUDA path: ``is_cuda`` is True, the target is sm_90a and
    ``get_kernel`` returns a recorder of its calls."""
    calls, compiled = [], []

    def get_kernel(config, target):
        compiled.append((config, target))
        signature = config.signature()

        def fn(*args):
            ffi_checks(signature, args)
            calls.append((config, args))

        return fn

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(op, "compile_target", lambda device: "sm_90a")
    monkeypatch.setattr(op, "get_kernel", get_kernel)
    monkeypatch.setattr(op, "self_check_passes", lambda config, device: True)  # tests/cpu/test_prefill_selfcheck.py
    monkeypatch.setattr(op.sm100, "self_check_passes", lambda config, device: True)  # tests/cpu/test_prefill_sm100.py
    op._cache.entries.clear()
    yield calls, compiled
    op._cache.entries.clear()


@pytest.mark.parametrize("container", ["single", "tuple"])
@pytest.mark.parametrize("qd", [BF16, FP8])
@pytest.mark.parametrize("return_lse", [False, True])
def test_arguments_reach_the_kernel_in_signature_order(fake_gpu, container, qd, return_lse):
    calls, compiled = fake_gpu
    p = _problem(("order", container, str(qd)), kv_dtype=FP8, q_dtype=qd, container=container,
                 per_head_q_scale=qd == FP8)
    ks, vs = torch.tensor(0.05), torch.tensor([0.03])  # 0-d and [1]
    res = op.paged_prefill(*_args(p), **_kw(p, k_scale=ks, v_scale=vs), return_lse=return_lse, sm_scale=0.1)
    config, args = calls[-1]
    assert compiled == [(config, "sm_90a")]
    assert config.write_lse == return_lse and config.k_scale_tensor and config.v_scale_tensor
    assert config.q_scale == ("per_head" if qd == FP8 else "none") and config.kv_form == container.replace("tuple", "pair")
    out, lse = res if return_lse else (res, None)
    k, v = p["kv_cache"] if container == "tuple" else (p["kv_cache"], None)
    values = dict(q=p["q"], kv_cache=k, k_cache=k, v_cache=v, block_table=p["block_table"], seq_lens=p["seq_lens"],
                  query_start_loc=p["query_start_loc"], out=out, lse=lse, v_scale=vs, q_scale=p.get("q_scale"),
                  sm_scale=0.1, max_query_len=p["q"].shape[0])
    names = [a.name for a in config.signature()]
    assert len(args) == len(names)
    for name, a in zip(names, args):
        if name == "k_scale":  # a 0-d scale arrives as a [1] view of the same memory
            assert a.shape == (1,) and a.data_ptr() == ks.data_ptr()
        elif isinstance(values[name], torch.Tensor):
            assert a is values[name], name
        else:
            assert a == values[name], name
    assert out.dtype == BF16 and out.shape == p["q"].shape
    # the cached call: same launch, max_query_len passed through, no new compile
    op.paged_prefill(*_args(p), **_kw(p, k_scale=ks, v_scale=vs), return_lse=return_lse, sm_scale=0.1,
                     max_query_len=7)
    assert calls[-1][1][names.index("max_query_len")] == 7 and len(compiled) == 1


def test_cached_call_allocates_only_out_and_never_syncs(fake_gpu, monkeypatch):
    calls, _ = fake_gpu
    p = _problem("nosync", kv_dtype=FP8)
    out = torch.empty(p["q"].shape, dtype=BF16)
    op.paged_prefill(*_args(p), **_kw(p), out=out)  # validates, selects, caches
    made = []
    real_empty = torch.empty

    def counting_empty(*a, **k):
        made.append(a)
        return real_empty(*a, **k)

    def no_sync(*a, **k):
        raise AssertionError("host sync on the cached path")

    monkeypatch.setattr(torch, "empty", counting_empty)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    res = op.paged_prefill(*_args(p), **_kw(p), out=out)
    op.paged_prefill(*_args(p), **_kw(p), out=out, max_query_len=5)
    assert res is out and made == []
    op.paged_prefill(*_args(p), **_kw(p))  # without out=: one allocation, the output
    assert len(made) == 1
    monkeypatch.undo()
    assert len(calls) == 4


def test_empty_batch_returns_without_compiling(fake_gpu):
    calls, compiled = fake_gpu
    p = _problem("empty")
    q0, qsl0 = p["q"][:0], torch.zeros_like(p["query_start_loc"])
    out, lse = op.paged_prefill(q0, p["kv_cache"], p["block_table"], p["seq_lens"], qsl0, return_lse=True,
                                **_kw(p))
    out2 = op.paged_prefill(q0, p["kv_cache"], p["block_table"][:0], p["seq_lens"][:0], qsl0[:1], **_kw(p))
    assert out.shape == out2.shape == (0, 4, 64) and lse.shape == (0, 4)
    assert compiled == [] and calls == []


def test_a_refused_call_is_validated_in_full(fake_gpu, monkeypatch):
    """When the compiled function raises (TVM-FFI refused an argument), the op re-validates and
    the error names the argument (here a seq_lens of the wrong dtype, which the key leaves out)."""

    def refuse(config, target):
        def fn(*a):
            raise RuntimeError("Mismatched Tensor on argument #3")
        return fn

    monkeypatch.setattr(op, "get_kernel", refuse)
    p = _problem("refuse")
    with pytest.raises(RuntimeError, match="Mismatched"):  # valid arguments: the original error
        op.paged_prefill(*_args(p), **_kw(p))
    bad = dict(p, seq_lens=p["seq_lens"].long())
    with pytest.raises(TypeError, match="seq_lens must have dtype int32"):
        op.paged_prefill(*_args(bad), **_kw(bad))


@pytest.mark.parametrize("target", ["sm_100a", "sm_86"])
def test_other_archs_run_the_portable_kernel(fake_gpu, monkeypatch, target):
    """Off SM90 a 16-bit query on an FP8 cache runs sm80.prefill built for the GPU's target, its
    arguments in its signature's order (on SM100 too: sm100.prefill takes it quantized by the
    layer); an FP8 query runs sm100.prefill on SM100 (tests/cpu/test_prefill_sm100.py), the
    reference on an arch without an FP8-query kernel."""
    calls, compiled = fake_gpu
    monkeypatch.setattr(op, "compile_target", lambda device: target)
    p = _problem(("arch", target), kv_dtype=FP8)
    out = op.paged_prefill(*_args(p), **_kw(p), return_lse=True)[0]
    config, args = calls[-1]
    assert compiled == [(config, target)] and config.kernel_id == "sm80.prefill" and config.target == target
    values = dict(q=p["q"], kv_cache=p["kv_cache"], block_table=p["block_table"], seq_lens=p["seq_lens"],
                  query_start_loc=p["query_start_loc"], out=out, k_scale=p["k_scale"], v_scale=p["v_scale"])
    for name, arg in zip(config.arg_names(), args):
        if name in values:
            assert arg is values[name] or (isinstance(arg, torch.Tensor) and arg.data_ptr() == values[name].data_ptr())
    if target == "sm_100a":
        return
    p = _problem(("arch8", target), kv_dtype=FP8, q_dtype=FP8)
    n = len(compiled)
    want = reference.paged_prefill(*_args(p), **_kw(p))
    assert torch.equal(op.paged_prefill(*_args(p), **_kw(p)), want) and len(compiled) == n


# ----------------------------------------------------------------------------------------------
# bad input: the same errors on the first call and on the cached path, CPU and (stubbed) GPU
# ----------------------------------------------------------------------------------------------


def _set(name, value):
    return lambda p: p.update({name: value(p) if callable(value) else value})


BAD = [
    ("q dtype", _set("q", lambda p: p["q"].float()), TypeError, "q must have dtype"),
    ("q rank", _set("q", lambda p: p["q"][0]), ValueError, "q must be 3-D"),
    ("head dim 96", _set("q", lambda p: torch.zeros(p["q"].shape[0], 4, 96, dtype=BF16)), ValueError,
     "head dim mismatch"),
    ("misaligned q", _set("q", lambda p: torch.zeros(p["q"].numel() + 1, dtype=BF16)[1:].view(p["q"].shape)),
     ValueError, "q data pointer must be 16-byte aligned"),
    ("q last dim", _set("q", lambda p: p["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "q must have a contiguous last dim"),
    ("layout", _set("kv_layout", "HDN"), ValueError, "kv_layout must be 'HND' or 'NHD'"),
    ("no pages", _set("kv_cache", lambda p: p["kv_cache"][:0]), ValueError, r"kv_cache has no pages \(P = 0\)"),
    ("kv 4-D", _set("kv_cache", lambda p: p["kv_cache"][:, 0]), ValueError, "kv_cache must be 5-D"),
    ("kv [P,3]", _set("kv_cache", lambda p: torch.cat([p["kv_cache"], p["kv_cache"][:, :1]], 1)), ValueError,
     r"kv_cache must be \[P, 2, ...\]"),
    ("kv dtype", _set("kv_cache", lambda p: p["kv_cache"].float()), TypeError, "kv_cache dtype must be"),
    ("fp8 q 16-bit kv", _set("q", lambda p: p["q"].to(FP8)), TypeError, "an FP8 query needs a float8_e4m3fn kv_cache"),
    ("q_scale on bf16", _set("q_scale", 0.5), ValueError, "q_scale applies only to an FP8 query"),
    ("k_scale <0", _set("k_scale", -1.0), ValueError, "k_scale must be a positive finite"),
    ("v_scale nan", _set("v_scale", float("nan")), ValueError, "v_scale must be a positive finite"),
    ("k_scale fp64", _set("k_scale", torch.tensor([1.0], dtype=torch.float64)), TypeError, "k_scale must be a float"),
    ("v_scale [2]", _set("v_scale", torch.ones(2)), ValueError, "v_scale must be a float or a 1-element"),
    ("sm_scale", _set("sm_scale", 0.0), ValueError, "sm_scale must be a positive finite"),
    ("causal", _set("causal", 1), TypeError, "causal must be a bool"),
    ("bt dtype", _set("block_table", lambda p: p["block_table"].long()), TypeError, "block_table must have dtype int32"),
    ("bt rank", _set("block_table", lambda p: p["block_table"][0]), ValueError, "block_table must be 2-D"),
    ("seq_lens shape", _set("seq_lens", lambda p: p["seq_lens"][:2]), ValueError, r"seq_lens must have shape \[4\]"),
    ("qsl shape", _set("query_start_loc", lambda p: p["query_start_loc"][:4]), ValueError,
     r"query_start_loc must have shape \[5\]"),
    ("qsl dtype", _set("query_start_loc", lambda p: p["query_start_loc"].long()), TypeError,
     "query_start_loc must have dtype int32"),
    ("max_query_len <0", _set("max_query_len", -1), ValueError, "max_query_len must be None or a non-negative int"),
    ("max_query_len float", _set("max_query_len", 5.0), ValueError, "max_query_len must be None"),
    ("max_query_len small", _set("max_query_len", 1), ValueError, r"max_query_len \(1\) is below every split"),
    ("out dtype", _set("out", lambda p: torch.empty(p["q"].shape, dtype=FP16)), TypeError, "out must have dtype"),
    ("out shape", _set("out", lambda p: torch.empty(3, 4, 64, dtype=BF16)), ValueError, "out must have shape"),
]


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("name,mutate,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(name, mutate, exc, match, path, request):
    if path == "gpu":
        request.getfixturevalue("fake_gpu")
    p = _problem("bad")
    p = dict(p, sm_scale=None, causal=True)
    good = dict(p)
    op.paged_prefill(*_args(good), **_kw(good))  # a cached launch of the good shapes first
    mutate(p)
    extra = {k: p[k] for k in ("sm_scale", "causal", "max_query_len", "out") if k in p}
    with pytest.raises(exc, match=match):
        op.paged_prefill(*_args(p), **_kw(p), **extra)


BAD_OVERRIDES = [
    # before: TypeError "Sm90PrefillConfig.__init__() got an unexpected keyword argument"
    (dict(bogus=1), ValueError, "'bogus' is not a tuning field of sm90.prefill; its fields: consumer_regs, epilogue"),
    (dict(cluster_init_sync=True), ValueError, "'cluster_init_sync' is not a tuning field of sm90.prefill"),
    # before: "make_prefill_config() got multiple values for keyword argument"
    (dict(head_dim=128), ValueError, "'head_dim' is not a tuning field of sm90.prefill \\(the call's arguments"),
    (dict(causal=False), ValueError, "'causal' is not a tuning field"),
    # before: a two-term variant for a call with no q_residual (the kernel's argument left unbound)
    (dict(q_terms=2), ValueError, "'q_terms' is not a tuning field"),
    # before: silently accepted ("no" is true: pingpong on)
    (dict(pingpong="no"), TypeError, "sm90.prefill's pingpong must be a bool, got 'no'"),
    (dict(overlap="yes"), TypeError, "sm90.prefill's overlap must be a bool, got 'yes'"),
    (dict(persistent=1), TypeError, "sm90.prefill's persistent must be a bool, got 1"),
    # before: TypeError "not all arguments converted during string formatting"
    (dict(tile_n="64"), TypeError, "sm90.prefill's tile_n must be an int, got '64'"),
    (dict(backend="sm80", stages="x"), TypeError, "sm80.prefill's stages must be an int, got 'x'"),
    (dict(backend="sm80", tile_n=64), ValueError, "'tile_n' is not a tuning field of sm80.prefill"),
    # the plan's own checks stay what they were
    (dict(pingpong=True, overlap=False), ValueError, "pingpong takes turns between overlapped consumers"),
    (dict(vt_transpose="foo"), ValueError, "vt_transpose must be one of"),
]


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("override,exc,match", BAD_OVERRIDES, ids=[str(b[0]) for b in BAD_OVERRIDES])
def test_a_bad_tuning_override_names_the_field(override, exc, match, path, request):
    """A tuning override is checked against the fields of the config it replaces fields of: a name
    that is no tuning field (or one the call decides) and a value of the wrong type are refused
    naming the field, on the CPU as on the GPU, before any variant is compiled."""
    if path == "gpu":
        request.getfixturevalue("fake_gpu")
    p = _problem("override")
    with op.tuning_override(**override):
        with pytest.raises(exc, match=match):
            op.paged_prefill(*_args(p), **_kw(p))
    if path == "gpu":
        assert not request.getfixturevalue("fake_gpu")[1]  # nothing compiled


def test_valid_tuning_overrides_still_pass():
    p = _problem("override_ok")
    want = op.paged_prefill(*_args(p), **_kw(p))
    for override in (dict(tile_n=64, pingpong=False), dict(persistent=True), dict(epilogue="smem"),
                     dict(backend="sm80", m_tiles=1), dict(backend="sm80", smem_target="sm_80")):
        with op.tuning_override(**override):
            torch.testing.assert_close(op.paged_prefill(*_args(p), **_kw(p)), want, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_kernel_limits_are_the_plan_limits(path, request):
    """Page sizes and head dims outside the plans' limits are refused on the CPU too; a GQA ratio
    beyond the SM90 kernel's goes to the portable kernel."""
    if path == "gpu":
        request.getfixturevalue("fake_gpu")
    assert plan.PAGE_SIZES == (16, 32, 64, 128) and plan.HEAD_DIMS == (64, 128, 256)
    p = _problem("page8", page=8)
    with pytest.raises(ValueError, match=r"page size must be one of \(16, 32, 64, 128\), got 8"):
        op.paged_prefill(*_args(p), **_kw(p))
    p = _problem("d32", D=32)
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 128, 256\), got 32"):
        op.paged_prefill(*_args(p), **_kw(p))
    g = plan.MAX_GROUP * 2  # beyond the SM90 kernel's group: the portable kernel takes it
    p = _problem("group", Hq=g, Hkv=1, reqs=((0, 1),))
    op.paged_prefill(*_args(p), **_kw(p))
    if path == "gpu":
        assert request.getfixturevalue("fake_gpu")[1][-1][0].kernel_id == "sm80.prefill"


def test_fp8_query_scale_rules():
    p = _problem("fp8rules", kv_dtype=FP8, q_dtype=FP8)
    qs = p.pop("q_scale")
    with pytest.raises(ValueError, match="an FP8 query needs q_scale"):
        op.paged_prefill(*_args(p), **_kw(p))
    for bad in (torch.ones(4), torch.ones(3)):  # Hkv = 2: neither one element nor one per KV head
        with pytest.raises(ValueError, match=r"q_scale must be a float or a 1-element tensor or a per-KV-head"):
            op.paged_prefill(*_args(p), **_kw(p, q_scale=bad))
    with pytest.raises(TypeError, match="out must have dtype bfloat16 or float16"):
        op.paged_prefill(*_args(p), **_kw(p, q_scale=qs), out=torch.empty(p["q"].shape, dtype=FP8))
    for s in (qs, torch.tensor(qs), torch.tensor([qs, qs])):
        op.paged_prefill(*_args(p), **_kw(p, q_scale=s))


def test_batch_without_requests_but_with_rows_is_refused():
    p = _problem("norows")
    with pytest.raises(ValueError, match="q has 9 rows but the batch is empty"):
        op.paged_prefill(p["q"], p["kv_cache"], p["block_table"][:0], p["seq_lens"][:0],
                         p["query_start_loc"][:1], **_kw(p))


def test_reference_raises_for_malformed_query_start_loc_on_cpu():
    p = _problem("qsl")
    p["query_start_loc"] = torch.tensor([0, 5, 3, 8, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        op.paged_prefill(*_args(p), **_kw(p))


# ----------------------------------------------------------------------------------------------
# CUTE_KERNELS_CHECK=1
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def checked():
    """Checked mode (CUTE_KERNELS_CHECK=1) for one test: every op validates its data."""
    from cute_kernels.ops import _launch

    previous = _launch.set_checked(True)
    yield
    _launch.set_checked(previous)


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p["query_start_loc"].copy_(torch.tensor([0, 5, 3, 8, 9])), "non-decreasing"),
    (lambda p: p.update(max_query_len=3), r"max_query_len \(3\) is below request 0's query length 5"),
    (lambda p: p["seq_lens"].__setitem__(1, 2), r"seq_lens\[1\] = 2 must lie in \[query length 3"),
    (lambda p: p["seq_lens"].__setitem__(3, 10**6), r"seq_lens\[3\] = 1000000 must lie in"),
    (lambda p: p["block_table"].__setitem__((1, 0), -1), r"block_table\[1, 0\] = -1 is outside"),
    (lambda p: p["block_table"].__setitem__((3, 1), 10**4), r"block_table\[3, 1\] = 10000 is outside"),
])
def test_checked_mode_names_the_first_bad_entry(fake_gpu, checked, mutate, match):
    calls, _ = fake_gpu
    p = _problem("checked")
    op.paged_prefill(*_args(p), **_kw(p))  # well-formed data passes the check
    assert len(calls) == 1
    mutate(p)
    extra = {"max_query_len": p["max_query_len"]} if "max_query_len" in p else {}
    with pytest.raises(ValueError, match=match):
        op.paged_prefill(*_args(p), **_kw(p), **extra)
    assert len(calls) == 1  # nothing launched


# ----------------------------------------------------------------------------------------------
# the warm-up covers the prefill variants the layer launches
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qd,scales_as_tensors,layout,container", [
    (BF16, False, "HND", "single"),
    (BF16, True, "NHD", "tuple"),
    (FP8, False, "HND", "single"),
])
def test_warmup_covers_the_layers_prefill_variants(fake_gpu, monkeypatch, qd, scales_as_tensors, layout, container):
    """What ``AttentionLayer`` passes (``out=`` in the model dtype, causal, no LSE, its scales) selects
    a variant that ``cute_kernels.warmup`` lists for the same shape, and the warm-up compiles it."""
    import importlib

    # the module, by name: `import cute_kernels.warmup as warm` gives the package attribute, which is
    # the warmup function once anything has asked cute_kernels for it
    warm = importlib.import_module("cute_kernels.warmup")

    calls, compiled = fake_gpu
    p = _problem(("warm", str(qd), layout), kv_dtype=FP8, q_dtype=qd, layout=layout, container=container)
    kw = _kw(p)
    if scales_as_tensors:
        kw.update(k_scale=torch.tensor([kw["k_scale"]]), v_scale=torch.tensor([kw["v_scale"]]))
    out = torch.empty(p["q"].shape, dtype=BF16)
    op.paged_prefill(*_args(p), **kw, out=out, max_query_len=5)
    (config, _), = compiled
    seen = []
    monkeypatch.setattr(warm, "precompile", lambda configs, target, **k: seen.extend(configs))
    shape = dict(head_dim=64, num_q_heads=4, num_kv_heads=2, page_size=16, kv_layouts=(layout,),
                 kv_forms=(container.replace("tuple", "pair"),))
    listed = warm.warmup(arch="sm_90a", fp8_query=qd == FP8, progress=False, **shape)
    assert config in listed and config in seen
    assert any(c.kernel_id == "sm90.decode" for c in listed)
    assert config not in warm.warmup(arch="sm_90a", prefill=False, progress=False, **shape)
