"""AttentionLayer and the glue ops on the CPU: per-phase plans over the arch matrix, forward
through the reference fallbacks against a direct reference computation, and clear errors.

Matrix rationale: planning is pure Python, so the arch matrix is complete (8 archs x 2 cache
dtypes x 3 batch shapes x 2 registry states). Forward passes run the torch reference, so they
use small shapes and a handful of (arch, cache, layout, container) combinations that cover each
value once; what forward adds over planning is the row split, the order of write and attend and
the per-phase query handling, which do not depend on the arch beyond the plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops import quantize_query as qq_op
from cute_kernels.ops import write_kv_cache as kv_op
from cute_kernels.plans.quantize_query import QuantizeQueryConfig
from cute_kernels.plans.write_kv_cache import WriteKVCacheConfig
from dispatch import KERNELS, SUPPORTED_ARCHS, AttentionLayer, AttentionMetadata, UnsupportedConfig

FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
FP8_QK_ARCHS = ("sm100", "sm103")  # archs with a (planned) FP8-QK kernel in the capability table
BUILT = ("sm90.decode", "sm100.decode", "sm100.prefill")


def codes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# a serving step: decode requests first, then prefill requests (vLLM's order)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: object
    metadata: AttentionMetadata
    new_tokens: list  # per request
    kv_layout: str


def make_step(*, decode_ctx=(), q_len_per_req=1, prefill=(), pad_decode=0, Hq=8, Hkv=2, D=64, page=16,
              kv_dtype=FP8, kv_layout="HND", container="single", slot_dtype=torch.int64, fused=True,
              device="cpu", generator=None, spare_pages=5) -> Step:
    """``decode_ctx``: total KV length of each decode request (its ``q_len_per_req`` new tokens
    included); ``prefill``: ``(prior_tokens, new_tokens)`` of each prefill request; ``pad_decode``:
    CUDA-graph padding requests (seq_len 0, slot -1)."""
    g = generator
    new = [q_len_per_req] * (len(decode_ctx) + pad_decode) + [n for _, n in prefill]
    lens = list(decode_ctx) + [0] * pad_decode + [p + n for p, n in prefill]
    num_reqs, T = len(new), sum(new)
    pages_per = [math.ceil(L / page) for L in lens]
    P = sum(pages_per) + spare_pages
    perm = torch.randperm(P, generator=g).tolist()
    width = max(pages_per + [1]) + 1
    table = torch.randint(0, P, (num_reqs, width), dtype=torch.int32, generator=g)  # junk past the end
    ofs = 0
    for r, n in enumerate(pages_per):
        table[r, :n] = torch.tensor(perm[ofs:ofs + n], dtype=torch.int32)
        ofs += n
    slots = []
    for r in range(num_reqs):
        for j in range(new[r]):
            if r >= len(decode_ctx) and r < len(decode_ctx) + pad_decode:
                slots.append(-1)
                continue
            pos = lens[r] - new[r] + j
            slots.append(int(table[r, pos // page]) * page + pos % page)
    shape = (P, 2, Hkv, page, D) if kv_layout == "HND" else (P, 2, page, Hkv, D)
    if kv_dtype == FP8:
        kv = (torch.randn(shape, generator=g) * 32).clamp(-448, 448).to(FP8)
    else:
        kv = torch.randn(shape, generator=g).to(kv_dtype)
    kv_cache = (kv[:, 0].clone(), kv[:, 1].clone()) if container == "tuple" else kv
    width_qkv = (Hq + 2 * Hkv) * D
    qkv = torch.randn(T, width_qkv if fused else Hq * D, generator=g).to(BF16)
    if fused:  # q, k, v are views of one fused projection (token stride (Hq + 2 Hkv) * D)
        q = qkv[:, :Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    else:
        q = qkv.view(T, Hq, D)
        k = torch.randn(T, Hkv, D, generator=g).to(BF16)
        v = torch.randn(T, Hkv, D, generator=g).to(BF16)
    starts = [0] + list(itertools.accumulate(new))

    def dev(t):
        return t.to(device)

    md = AttentionMetadata(
        query_start_loc=dev(torch.tensor(starts, dtype=torch.int32)), seq_lens=dev(torch.tensor(lens, dtype=torch.int32)),
        block_table=dev(table), slot_mapping=dev(torch.tensor(slots, dtype=slot_dtype)),
        num_decode_tokens=(len(decode_ctx) + pad_decode) * q_len_per_req, q_len_per_req=q_len_per_req,
    )
    kv_cache = tuple(dev(c) for c in kv_cache) if container == "tuple" else dev(kv_cache)
    return Step(dev(q), dev(k), dev(v), kv_cache, md, new, kv_layout)


def clone_cache(kv_cache):
    return tuple(c.clone() for c in kv_cache) if isinstance(kv_cache, tuple) else kv_cache.clone()


def reference_step(step: Step, kv_cache, *, k_scale=1.0, v_scale=1.0, q_scale=None, quantize=(False, False),
                   sm_scale=None):
    """Direct reference of one layer step on ``kv_cache`` (modified in place): write, then attend.
    ``quantize`` = (decode, prefill): that phase's query is quantized with q_scale first."""
    md = step.metadata
    reference.write_kv_cache(step.k, step.v, kv_cache, md.slot_mapping, kv_layout=step.kv_layout,
                             k_scale=k_scale, v_scale=v_scale)
    T, Hq, D = step.q.shape
    out = torch.empty(T, Hq, D, dtype=step.q.dtype, device=step.q.device)
    kw = dict(kv_layout=step.kv_layout, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale)

    def query(x, phase):
        if quantize[phase]:
            return reference.quantize_query(x, q_scale), dict(q_scale=q_scale)
        return x, {}

    nd, Bd = md.num_decode_tokens, md.num_decode_reqs
    if nd:
        x, extra = query(step.q[:nd], 0)
        out[:nd] = reference.paged_decode(x, kv_cache, md.block_table[:Bd], md.seq_lens[:Bd],
                                          q_len_per_req=md.q_len_per_req, **kw, **extra)
    if nd < T:  # every prefill request in one call, query_start_loc shifted to start at 0
        x, extra = query(step.q[nd:], 1)
        out[nd:] = reference.paged_prefill(x, kv_cache, md.block_table[Bd:], md.seq_lens[Bd:],
                                           md.query_start_loc[Bd:] - nd, **kw, **extra)
    return out


BATCHES = {
    "decode": dict(decode_ctx=(20, 33, 1, 16)),
    "prefill": dict(prefill=((0, 5), (12, 3), (0, 17))),
    "mixed": dict(decode_ctx=(20, 40), prefill=((0, 6), (9, 4))),
}


def _set_status(monkeypatch, status, *kernel_ids):
    for kid in kernel_ids:
        monkeypatch.setitem(KERNELS, kid, dataclasses.replace(KERNELS[kid], status=status))


@pytest.fixture
def fp8_reference(monkeypatch):
    """Make the reference fallbacks stand in for FP8-QK kernels (they accept an FP8 query with a
    per-tensor q_scale), so the layer's quantize path runs end to end on the CPU."""
    for kid in ("reference.paged_decode", "reference.paged_prefill"):
        monkeypatch.setitem(KERNELS, kid, dataclasses.replace(KERNELS[kid], qk_dtype="fp8_e4m3",
                                                                supports_quant_query_input=True))
    # the portable kernels would serve these phases first: out of the way, the fallbacks plan them
    _set_status(monkeypatch, "planned", "sm80.decode", "sm80.prefill")


# ----------------------------------------------------------------------------------------------
# the arch matrix: plans per phase
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("registry", ["as_registered", "all_built"])
def test_layer_arch_matrix(registry, monkeypatch):
    if registry == "all_built":
        _set_status(monkeypatch, "available", *BUILT)
    cells = 0
    for arch, kv, batch in itertools.product(SUPPORTED_ARCHS, (FP8, BF16), BATCHES):
        step = make_step(**BATCHES[batch], kv_dtype=kv)
        layer = AttentionLayer(8, 2, 64, kv_cache_dtype=kv, page_size=16, arch=arch, q_scale=0.5)
        plans = layer.plans_for(step.metadata)
        assert (plans["decode"] is not None) == (batch != "prefill")
        assert (plans["prefill"] is not None) == (batch != "decode")
        for phase, p in plans.items():
            if p is None:
                continue
            assert (p.arch, p.phase, p.model_dtype) == (arch, phase, "bf16")
            assert p.kv_cache_dtype == ("fp8_e4m3" if kv == FP8 else "bf16")
            k = KERNELS[f"sm100.{phase}"]  # (compile-verified: served once the op is in the build)
            fp8_query = kv == FP8 and arch in FP8_QK_ARCHS and (
                k.status == "available" or (k.status == "compile-verified" and k.op is not None))
            assert p.q_dtype == ("fp8_e4m3" if fp8_query else "bf16"), p
            # q_scale enters the logits exactly when the layer quantizes the query with it
            assert p.quantize_query == p.applies_q_scale == fp8_query, p
            if arch == "sm90" and phase == "decode":
                assert p.kernel == ("sm90.decode" if KERNELS["sm90.decode"].status == "available"
                                    else "sm80.decode")
            elif arch == "sm90":  # the SM90 prefill kernel takes both caches
                assert p.kernel == "sm90.prefill", p
            elif KERNELS[p.kernel].archs != ("sm100", "sm103"):  # the portable kernels everywhere else
                assert p.kernel == f"sm80.{phase}", p
            if phase == "prefill":
                assert p.q_len == step.q.shape[0] - step.metadata.num_decode_tokens
            else:
                assert p.q_len == step.metadata.q_len_per_req
            cells += 1
    assert cells == len(SUPPORTED_ARCHS) * 2 * 4


def test_planning_needs_an_arch_for_cpu_tensors():
    step = make_step(**BATCHES["mixed"])
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16)
    with pytest.raises(UnsupportedConfig, match="pass arch="):
        layer.plans_for(step.metadata)
    assert layer.plans_for(step.metadata, arch="sm_90a")["decode"].arch == "sm90"


def test_skip_layer_plans_on_its_own(monkeypatch):
    """A bf16 skip layer next to an FP8 layer: same arch, same step, its own plans."""
    _set_status(monkeypatch, "available", *BUILT)
    step = make_step(**BATCHES["mixed"])
    for arch in ("sm90", "sm100", "sm89"):
        fp8 = AttentionLayer(8, 2, 64, kv_cache_dtype="fp8", page_size=16, arch=arch, q_scale=0.5)
        skip = AttentionLayer(8, 2, 64, kv_cache_dtype="auto", page_size=16, arch=arch, q_scale=0.5)
        fp8_plans = fp8.plans_for(step.metadata)
        skip_plans = skip.plans_for(step.metadata)
        assert fp8.plans_for(step.metadata) == fp8_plans  # planning the skip layer changed nothing
        for phase in ("decode", "prefill"):
            assert skip_plans[phase].kv_cache_dtype == "bf16"
            assert skip_plans[phase].q_dtype == "bf16" and not skip_plans[phase].applies_q_scale
            assert not skip_plans[phase].quantize_query
            assert fp8_plans[phase].quantize_query == (arch == "sm100")
        if arch == "sm90":  # the SM90 decode kernel converts FP8 K/V on chip: never an FP8 query
            assert fp8_plans["decode"].kernel == "sm90.decode" and fp8_plans["decode"].q_dtype == "bf16"


# ----------------------------------------------------------------------------------------------
# forward on the CPU (reference fallbacks) against a direct reference computation
# ----------------------------------------------------------------------------------------------


FORWARD_CASES = [  # arch, kv dtype, layout, container, q_len_per_req
    ("sm90", FP8, "HND", "single", 1),
    ("sm90", BF16, "NHD", "tuple", 1),
    ("sm89", FP8, "NHD", "single", 2),
    ("sm100", BF16, "HND", "tuple", 1),
    ("sm121", FP8, "HND", "tuple", 3),
]


@pytest.mark.parametrize("arch,kv,layout,container,q_len", FORWARD_CASES)
def test_forward_matches_direct_reference(arch, kv, layout, container, q_len):
    g = torch.Generator().manual_seed(hash((arch, str(kv), layout, container, q_len)) % 2**31)
    step = make_step(decode_ctx=(20, 40, 3), q_len_per_req=q_len, prefill=((0, 6), (9, 4), (15, 1)), kv_dtype=kv,
                     kv_layout=layout, container=container, generator=g)
    ks, vs = (0.0625, 0.03125) if kv == FP8 else (1.0, 1.0)
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=kv, page_size=16, kv_layout=layout, arch=arch, k_scale=ks,
                           v_scale=vs)
    expected_cache = clone_cache(step.kv_cache)
    expected = reference_step(step, expected_cache, k_scale=ks, v_scale=vs)
    out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
    assert out.dtype == BF16 and out.shape == step.q.shape
    # same reference functions on the same values in the same order: equal bit for bit
    caches = step.kv_cache if container == "tuple" else (step.kv_cache,)
    exp = expected_cache if container == "tuple" else (expected_cache,)
    for c, e in zip(caches, exp):
        assert torch.equal(codes(c) if kv == FP8 else c, codes(e) if kv == FP8 else e)
    assert torch.equal(out, expected)


def test_forward_with_tensor_scales_and_sm_scale():
    g = torch.Generator().manual_seed(7)
    step = make_step(**BATCHES["mixed"], generator=g, fused=False, slot_dtype=torch.int32)
    ks, vs = torch.tensor([0.0625]), torch.tensor(0.03125)
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90", k_scale=ks, v_scale=vs,
                           sm_scale=0.3)
    expected = reference_step(step, clone_cache(step.kv_cache), k_scale=ks, v_scale=vs, sm_scale=0.3)
    assert torch.equal(layer(step.q, step.k, step.v, step.kv_cache, step.metadata), expected)


def test_forward_padding_requests_write_nothing_and_output_zeros():
    g = torch.Generator().manual_seed(3)
    step = make_step(decode_ctx=(20, 7), pad_decode=2, generator=g)
    before = step.kv_cache.clone()
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90")
    out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
    pages_changed = (codes(before) != codes(step.kv_cache)).flatten(1).any(1)
    assert int(pages_changed.sum()) <= 2  # one new token for each of the two real requests
    assert (out[2:4] == 0).all()  # the padding requests see no KV
    assert torch.equal(out, reference_step(step, before))


@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm80"])
def test_forward_quantizes_only_phases_whose_plan_says_so(arch, fp8_reference, monkeypatch):
    """With FP8-QK stand-ins, the layer quantizes the query (with q_scale) of FP8-cache phases
    whose plan says so, once per phase (all prefill rows in one call), passes q_scale only to
    them, and a bf16 skip layer's phases are never quantized."""
    calls = []
    real = dict(quantize=cute_kernels.quantize_query, decode=reference.paged_decode,
                prefill=reference.paged_prefill)

    def spy_quantize(q, q_scale, **kw):
        calls.append(("quantize", q.shape[0], q_scale))
        return real["quantize"](q, q_scale, **kw)

    def spy(kind):
        def attend(q, *args, q_scale=None, **kw):
            calls.append((kind, q.dtype, q_scale))
            return real[kind](q, *args, q_scale=q_scale, **kw)
        return attend

    def spying(on: bool):
        monkeypatch.setattr(reference, "paged_decode", spy("decode") if on else real["decode"])
        monkeypatch.setattr(reference, "paged_prefill", spy("prefill") if on else real["prefill"])

    monkeypatch.setattr(cute_kernels, "quantize_query", spy_quantize, raising=False)
    g = torch.Generator().manual_seed(11)
    for kv in (FP8, BF16):
        calls.clear()
        spying(True)
        step = make_step(**BATCHES["mixed"], kv_dtype=kv, generator=g)
        ks = 0.0625 if kv == FP8 else 1.0
        layer = AttentionLayer(8, 2, 64, kv_cache_dtype=kv, page_size=16, arch=arch, q_scale=0.25, k_scale=ks)
        plans = layer.plans_for(step.metadata)
        out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
        # sm90's kernels convert FP8 K/V on chip: the FP8-QK kernels and the reference stand-ins quantize
        quantized = {ph: kv == FP8 and plans[ph].kernel not in ("sm90.decode", "sm90.prefill")
                     for ph in ("decode", "prefill")}
        assert {ph: plans[ph].quantize_query for ph in quantized} == quantized
        quants = [c for c in calls if c[0] == "quantize"]
        assert [c[1] for c in quants] == [n for ph, n in (("decode", 2), ("prefill", 10)) if quantized[ph]]
        assert all(c[2] == 0.25 for c in quants)
        attends = [c for c in calls if c[0] != "quantize"]
        assert [c[0] for c in attends] == ["decode", "prefill"]  # one call per phase
        for _, dtype, qs in attends:
            assert (dtype == FP8) == (qs is not None)
            assert qs in (None, 0.25)
        # the cache already holds the new tokens; the direct reference writes them again (idempotent)
        spying(False)
        expected = reference_step(step, clone_cache(step.kv_cache), k_scale=ks, q_scale=0.25,
                                  quantize=(quantized["decode"], quantized["prefill"]))
        assert torch.equal(out, expected)


def test_fp8_query_plan_without_q_scale_is_refused(fp8_reference):
    step = make_step(**BATCHES["decode"])
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm89")
    with pytest.raises(UnsupportedConfig, match="no q_scale"):
        layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)


def test_plan_without_an_op_is_refused_before_any_work(monkeypatch):
    _set_status(monkeypatch, "available", *BUILT)
    # a kernel "built" but with no op in this build
    monkeypatch.setitem(KERNELS, "sm100.prefill", dataclasses.replace(KERNELS["sm100.prefill"], op=None))
    step = make_step(**BATCHES["prefill"])
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm100", q_scale=0.5)
    monkeypatch.setattr(cute_kernels, "quantize_query", lambda *a, **k: pytest.fail("quantized"), raising=False)
    with pytest.raises(UnsupportedConfig, match="sm100.prefill, which has no prefill op"):
        layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)


def test_decode_only_forward_does_no_host_sync(monkeypatch):
    """The decode-only path (CUDA-graph capturable) never moves device data to the host: with the
    kernels stubbed, any .item()/.tolist()/bool() on a tensor fails the step."""
    _set_status(monkeypatch, "available", "sm90.decode")
    step = make_step(**BATCHES["decode"])
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90")
    assert layer.plans_for(step.metadata)["decode"].kernel == "sm90.decode"
    seen = {}

    def fake_write(key, value, kv_cache, slot_mapping, **kw):
        seen["write"] = (key.shape, slot_mapping.shape, kw["kv_layout"])

    def fake_decode(q, kv_cache, block_table, seq_lens, *, out, **kw):
        seen["decode"] = (q.shape, block_table.shape, kw["q_len_per_req"])
        out.fill_(1.0)
        return out

    monkeypatch.setattr(cute_kernels, "write_kv_cache", fake_write, raising=False)
    monkeypatch.setattr(cute_kernels, "paged_decode", fake_decode, raising=False)

    def no_sync(*a, **k):
        raise AssertionError("host sync in the decode-only path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
    monkeypatch.undo()
    assert seen["write"] == (step.k.shape, step.metadata.slot_mapping.shape, "HND")
    assert seen["decode"] == (step.q.shape, step.metadata.block_table.shape, 1)
    assert (out == 1).all()


# ----------------------------------------------------------------------------------------------
# prefill_query_dtype="fp8": the prefill rows of an FP8 cache on an FP8-QK kernel
# ----------------------------------------------------------------------------------------------


def test_fp8_prefill_query_changes_the_prefill_plan_only():
    step = make_step(**BATCHES["mixed"])
    exact = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90", q_scale=0.5)
    fp8q = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90", q_scale=0.5,
                          prefill_query_dtype="fp8")
    assert exact.prefill_query_dtype == "auto" and fp8q.prefill_query_dtype == "fp8_e4m3"
    a, b = exact.plans_for(step.metadata), fp8q.plans_for(step.metadata)
    assert a["decode"] == b["decode"] and not b["decode"].quantize_query  # decode keeps the bf16 query
    assert (a["prefill"].kernel, a["prefill"].q_dtype) == ("sm90.prefill", "bf16")
    p = b["prefill"]
    assert (p.kernel, p.q_dtype, p.quantize_query, p.applies_q_scale) == ("sm90.prefill_fp8q", "fp8_e4m3", True, True)
    assert "query_dtype='fp8'" in p.reason and "prefill_query_dtype=fp8" in repr(fp8q)
    # the spellings of an FP8 dtype all mean the same option
    for spelling in ("fp8_e4m3", "float8_e4m3fn", FP8):
        layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90", q_scale=0.5,
                               prefill_query_dtype=spelling)
        assert layer.plans_for(step.metadata) == b


@pytest.mark.parametrize("q_scale", [0.03125, torch.tensor([0.0625]), torch.tensor([0.03125, 0.0625])],
                         ids=["float", "tensor1", "per_kv_head"])
def test_fp8_prefill_query_forward_quantizes_the_prefill_rows_only(q_scale, monkeypatch):
    """On the CPU (the ops run the reference): the prefill rows are quantized once with q_scale and
    attend with it, the decode rows keep the bf16 query; the output equals the direct reference of
    that step bit for bit."""
    calls = []
    real = cute_kernels.quantize_query

    def spy(q, qs, **kw):
        calls.append((q.shape[0], qs))
        return real(q, qs, **kw)

    monkeypatch.setattr(cute_kernels, "quantize_query", spy, raising=False)
    seed = 21
    print(f"seed {seed}")
    step = make_step(**BATCHES["mixed"], generator=torch.Generator().manual_seed(seed))
    ks, vs = 0.0625, 0.03125
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90", q_scale=q_scale, k_scale=ks,
                           v_scale=vs, prefill_query_dtype="fp8")
    expected = reference_step(step, clone_cache(step.kv_cache), k_scale=ks, v_scale=vs, q_scale=layer.q_scale,
                              quantize=(False, True))
    out = torch.full_like(step.q, float("nan"))
    out.copy_(layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata))
    nd = step.metadata.num_decode_tokens
    assert [n for n, _ in calls] == [step.q.shape[0] - nd] and calls[0][1] is layer.q_scale
    assert torch.isfinite(out).all() and torch.equal(out, expected)
    exact = reference_step(step, clone_cache(step.kv_cache), k_scale=ks, v_scale=vs)
    assert torch.equal(out[:nd], exact[:nd])  # decode rows: the exact bf16-query result
    err = ((out[nd:].double() - exact[nd:].double()).norm() / exact[nd:].double().norm()).item()
    assert 0 < err < 6e-2, err  # the prefill rows carry the FP8 query's error, and only that


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_cache_dtype=BF16), "prefill_query_dtype='fp8' needs an FP8 KV cache.*kv_cache_dtype is bf16"),
    (dict(kv_cache_dtype="auto"), "needs an FP8 KV cache"),
    (dict(q_scale=None), "prefill_query_dtype='fp8' quantizes .* pass q_scale="),
    (dict(arch="sm89"), "prefill_query_dtype='fp8': .*no prefill kernel computes QK in FP8 on sm89"),
    (dict(arch="sm80"), "no prefill kernel computes QK in FP8 on sm80"),
    (dict(arch="sm120"), "no prefill kernel computes QK in FP8 on sm120"),
    (dict(head_dim=96), r"sm90\.prefill_fp8q needs head_dim 64/128/256 \(got 96\)"),
    (dict(prefill_query_dtype="bf16"), "prefill_query_dtype='bf16' is not supported; expected 'auto' or 'fp8'"),
    (dict(prefill_query_dtype=1), "prefill_query_dtype must be a torch dtype or a dtype name"),
])
def test_fp8_prefill_query_constructor_errors(kwargs, match):
    base = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, kv_cache_dtype=FP8, page_size=16, arch="sm90",
                q_scale=0.5, prefill_query_dtype="fp8")
    base.update(kwargs)
    Hq, Hkv, D = base.pop("num_q_heads"), base.pop("num_kv_heads"), base.pop("head_dim")
    with pytest.raises(UnsupportedConfig, match=match):
        AttentionLayer(Hq, Hkv, D, **base)


def test_fp8_prefill_query_without_arch_is_checked_at_the_first_plan():
    """With the arch taken from the device, the refusal comes at the first plan of a prefill (a
    decode-only step still plans and runs)."""
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, q_scale=0.5, prefill_query_dtype="fp8")
    decode = make_step(**BATCHES["decode"])
    assert layer.plans_for(decode.metadata, arch="sm89")["decode"].kernel == "sm80.decode"
    with pytest.raises(UnsupportedConfig, match="prefill_query_dtype='fp8': .*on sm89 prefill"):
        layer.plans_for(make_step(**BATCHES["mixed"]).metadata, arch="sm89")
    assert layer.plans_for(make_step(**BATCHES["prefill"]).metadata, arch="sm90")["prefill"].kernel == \
        "sm90.prefill_fp8q"


# ----------------------------------------------------------------------------------------------
# bad inputs: the layer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_q_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(head_dim=0), "head_dim must be a positive int"),
    (dict(page_size=-16), "page_size must be a positive int"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8' is not supported"),
    (dict(kv_cache_dtype=torch.uint8), "uint8 is ambiguous"),
    (dict(kv_layout="HDN"), "kv_layout must be 'HND' or 'NHD'"),
    (dict(arch="sm75"), "not supported"),
    (dict(model_dtype=torch.float32), "model_dtype"),
    (dict(q_scale=torch.ones(3)), r"q_scale must be a float or a 1-element tensor or a per-KV-head \[num_kv_heads\]"),
    (dict(q_scale=torch.ones(2, dtype=torch.float64)), "q_scale must be a float or a float32 tensor"),
    (dict(k_scale=torch.ones(2)), "k_scale must be a float or a 1-element tensor"),
    (dict(v_scale=-1.0), "v_scale must be a positive finite float"),
    (dict(sm_scale=float("nan")), "sm_scale"),
    (dict(sm_scale="0.1"), "sm_scale must be a positive finite float, got '0.1'"),  # float()'s own error before
    (dict(sm_scale=True), "sm_scale must be a positive finite float, got True"),
])
def test_layer_constructor_errors(kwargs, match):
    base = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, kv_cache_dtype=FP8, page_size=16)
    base.update(kwargs)
    Hq, Hkv, D = base.pop("num_q_heads"), base.pop("num_kv_heads"), base.pop("head_dim")
    with pytest.raises(UnsupportedConfig, match=match):
        AttentionLayer(Hq, Hkv, D, **base)


def _forward_error(mutate, exc, match, **layer_kw):
    step = make_step(**BATCHES["mixed"])
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=layer_kw.pop("kv", FP8), page_size=16, arch="sm90", **layer_kw)
    args = dict(q=step.q, k=step.k, v=step.v, kv_cache=step.kv_cache, metadata=step.metadata)
    mutate(args, step)
    before = clone_cache(step.kv_cache)
    with pytest.raises(exc, match=match):
        layer.forward(**args)
    assert torch.equal(codes(before), codes(step.kv_cache))  # refused before writing anything


def _md(step, **changes):
    return dataclasses.replace(step.metadata, **changes)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a, s: a.update(q=a["q"].half()), TypeError, "q must have the layer's model dtype bf16"),
    (lambda a, s: a.update(q=a["q"][:, :4]), ValueError, r"q must be \[T, num_q_heads=8, head_dim=64\]"),
    (lambda a, s: a.update(q=a["q"][:, :, :32]), ValueError, r"q must be \[T, num_q_heads=8, head_dim=64\]"),
    (lambda a, s: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "q must have a contiguous last dim"),
    (lambda a, s: a.update(q=torch.cat([a["q"], a["q"]], dim=2)[:, :, :64]), ValueError, "q must have contiguous heads"),
    (lambda a, s: a.update(k=a["k"][:, :1]), ValueError, r"k must be \[T=.*num_kv_heads=2"),
    (lambda a, s: a.update(v=a["v"].float()), TypeError, "v must have the layer's model dtype"),
    (lambda a, s: a.update(k=a["k"].to("meta")), ValueError, "k must be on cpu"),
    (lambda a, s: a.update(kv_cache=a["kv_cache"].view(torch.uint8)), TypeError, "uint8, which is ambiguous"),
    (lambda a, s: a.update(kv_cache=a["kv_cache"].to(BF16)), TypeError, "kv_cache must have this layer's"),
    (lambda a, s: a.update(kv_cache=a["kv_cache"][:, :, :, :8]), ValueError, "pages must be"),
    (lambda a, s: a.update(kv_cache=a["kv_cache"][:, 0]), ValueError, r"kv_cache must be \[P, 2, ...\]"),
    (lambda a, s: a.update(metadata=_md(s, slot_mapping=s.metadata.slot_mapping[:-1])), ValueError,
     r"metadata.slot_mapping must have shape"),
    (lambda a, s: a.update(metadata=_md(s, slot_mapping=s.metadata.slot_mapping.float())), TypeError,
     "metadata.slot_mapping must have dtype"),
    (lambda a, s: a.update(metadata=_md(s, seq_lens=s.metadata.seq_lens.long())), TypeError,
     "metadata.seq_lens must have dtype"),
    (lambda a, s: a.update(metadata=_md(s, query_start_loc=s.metadata.query_start_loc[:-1])), ValueError,
     "metadata.query_start_loc must have shape"),
    (lambda a, s: a.update(metadata=_md(s, block_table=s.metadata.block_table.to("meta"))), ValueError,
     "metadata.block_table must be on cpu"),
    (lambda a, s: a.update(metadata=_md(s, num_decode_tokens=100)), ValueError, "exceeds the batch"),
    # the block table is checked first (it sets the request count): a 1-D one was reported as a
    # query_start_loc of the wrong shape, a list raised an AttributeError
    (lambda a, s: a.update(metadata=_md(s, block_table=s.metadata.block_table[0])), ValueError,
     r"metadata.block_table must be \[num_reqs, max_pages\]"),
    (lambda a, s: a.update(metadata=_md(s, block_table=s.metadata.block_table.tolist())), TypeError,
     "metadata.block_table must be a torch.Tensor, got list"),
    (lambda a, s: a.update(metadata=_md(s, block_table=s.metadata.block_table.long())), TypeError,
     "metadata.block_table must have dtype"),
])
def test_forward_errors(mutate, exc, match):
    _forward_error(mutate, exc, match)


def test_metadata_errors():
    step = make_step(**BATCHES["mixed"])
    with pytest.raises(TypeError, match="num_decode_tokens must be a Python int"):
        _md(step, num_decode_tokens=torch.tensor(2))
    with pytest.raises(ValueError, match="non-negative multiple of q_len_per_req"):
        _md(step, num_decode_tokens=3, q_len_per_req=2)
    with pytest.raises(ValueError, match="q_len_per_req must be >= 1"):
        _md(step, q_len_per_req=0)
    with pytest.raises(TypeError, match="max_query_len must be a Python int"):
        _md(step, max_query_len=torch.tensor(4))
    with pytest.raises(ValueError, match="max_query_len must be >= 0"):
        _md(step, max_query_len=-1)
    # query_start_loc inconsistent with num_decode_tokens: the CPU path (the reference) reads it and
    # raises; a CUDA step never reads it (CUTE_KERNELS_CHECK=1 does)
    bad = step.metadata.query_start_loc.clone()
    bad[2] += 1
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90")
    with pytest.raises(ValueError, match="query_start_loc must start at 0"):
        layer.forward(step.q, step.k, step.v, step.kv_cache, _md(step, query_start_loc=bad))
    bad = step.metadata.query_start_loc.clone()
    bad[3] = bad[4] + 1
    with pytest.raises(ValueError, match="query_start_loc must be non-decreasing"):
        layer.forward(step.q, step.k, step.v, step.kv_cache, _md(step, query_start_loc=bad))
    with pytest.raises(ValueError, match=r"max_query_len \(5\) is below request 0's query length 6"):
        layer.forward(step.q, step.k, step.v, step.kv_cache, _md(step, max_query_len=5))


# ----------------------------------------------------------------------------------------------
# the ops: validation (runs before any GPU work, so the CPU path shows it) and kernel selection
# ----------------------------------------------------------------------------------------------


def _q(T=5, Hq=8, D=64, dtype=BF16):
    return torch.randn(T, Hq, D).to(dtype)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: cute_kernels.quantize_query(_q().float(), 1.0), TypeError, "q must have dtype bfloat16 or float16"),
    (lambda: cute_kernels.quantize_query(_q()[0], 1.0), ValueError, "q must be 3-D"),
    (lambda: cute_kernels.quantize_query(_q().transpose(1, 2), 1.0), ValueError, "q must have a contiguous last dim"),
    (lambda: cute_kernels.quantize_query(_q(), torch.ones(3)), ValueError, "per-KV-head"),
    (lambda: cute_kernels.quantize_query(_q(), torch.ones(2, 1)), ValueError, "per-KV-head"),
    (lambda: cute_kernels.quantize_query(_q(), torch.ones(2, dtype=torch.float16)), TypeError,
     "q_scale must be a float or a float32 tensor"),
    (lambda: cute_kernels.quantize_query(_q(), torch.ones(1, device="meta")), ValueError, "q_scale must be on cpu"),
    (lambda: cute_kernels.quantize_query(_q(), 0.0), ValueError, "q_scale must be a positive finite float"),
    (lambda: cute_kernels.quantize_query(_q(), float("inf")), ValueError, "q_scale must be a positive finite"),
    (lambda: cute_kernels.quantize_query(_q(), 1.0, out=torch.empty(5, 8, 64, dtype=BF16)), TypeError,
     "out must have dtype float8_e4m3fn"),
    (lambda: cute_kernels.quantize_query(_q(), 1.0, out=torch.empty(5, 8, 32, dtype=FP8)), ValueError,
     r"out must have shape \[5, 8, 64\]"),
    (lambda: cute_kernels.quantize_query(_q(), 1.0, rope=torch.ones(4, 64)), TypeError, "rope must be a"),
    (lambda: cute_kernels.quantize_query(_q(), 1.0, rope=(torch.ones(4, 64, dtype=FP16), torch.zeros(5).long())),
     TypeError, "cos_sin_cache must have dtype float32 or bfloat16"),
    (lambda: cute_kernels.quantize_query(_q(), 1.0, rope=(torch.ones(4, 33), torch.zeros(5).long())), ValueError,
     "rot_dim must be even"),
    (lambda: cute_kernels.quantize_query(_q(), 1.0, rope=(torch.ones(4, 66), torch.zeros(5).long())), ValueError,
     "rot_dim must be even"),
    (lambda: cute_kernels.quantize_query(_q(), 1.0, rope=(torch.ones(4, 64), torch.zeros(4).long())), ValueError,
     r"positions must have shape \[5\]"),
    (lambda: cute_kernels.quantize_query(_q(), 1.0, rope=(torch.ones(4, 64), torch.zeros(5))), TypeError,
     "positions must have dtype int32 or int64"),
])
def test_quantize_query_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _kv(T=5, Hkv=2, D=64, P=3, page=16, dtype=FP8, layout="HND"):
    key, value = torch.randn(T, Hkv, D).to(BF16), torch.randn(T, Hkv, D).to(BF16)
    shape = (P, 2, Hkv, page, D) if layout == "HND" else (P, 2, page, Hkv, D)
    return key, value, torch.zeros(shape, dtype=dtype), torch.arange(T)


def _write(mutate):
    key, value, cache, slots = _kv()
    args = dict(key=key, value=value, kv_cache=cache, slot_mapping=slots)
    kw = {}
    mutate(args, kw)
    cute_kernels.write_kv_cache(**args, **kw)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a, k: a.update(key=a["key"].float()), TypeError, "key must have dtype bfloat16 or float16"),
    (lambda a, k: a.update(value=a["value"].half()), TypeError, "value must have dtype bfloat16"),
    (lambda a, k: a.update(value=a["value"][:, :1]), ValueError, r"value must have shape \[5, 2, 64\]"),
    (lambda a, k: a.update(key=a["key"].transpose(1, 2)), ValueError, "key must have a contiguous last dim"),
    (lambda a, k: a.update(kv_cache=a["kv_cache"].view(torch.uint8)), TypeError, "view it as float8_e4m3fn"),
    (lambda a, k: a.update(kv_cache=a["kv_cache"].float()), TypeError, "kv_cache must have dtype"),
    (lambda a, k: a.update(kv_cache=a["kv_cache"][:, 0]), ValueError, "kv_cache must be 5-D"),
    (lambda a, k: a.update(kv_cache=a["kv_cache"][:, :, :1]), ValueError, "num kv heads mismatch"),
    (lambda a, k: a.update(kv_cache=a["kv_cache"][..., :32]), ValueError, "head dim mismatch"),
    (lambda a, k: a.update(kv_cache=(a["kv_cache"][:, 0], a["kv_cache"][:, 1, :, :8])), ValueError,
     "k_cache and v_cache must match"),
    (lambda a, k: a.update(kv_cache=(a["kv_cache"][:, 0],)), ValueError, r"kv_cache tuple must be \(k_cache"),
    (lambda a, k: a.update(kv_cache=a["kv_cache"].to("meta")), ValueError, "kv_cache must be on cpu"),
    (lambda a, k: a.update(slot_mapping=a["slot_mapping"].float()), TypeError, "slot_mapping must have dtype"),
    (lambda a, k: a.update(slot_mapping=a["slot_mapping"][:3]), ValueError, r"slot_mapping must have shape \[5\]"),
    (lambda a, k: k.update(kv_layout="HDN"), ValueError, "kv_layout must be 'HND' or 'NHD'"),
    (lambda a, k: k.update(kv_layout="NHD"), ValueError, "num kv heads mismatch"),
    (lambda a, k: k.update(k_scale=torch.ones(2)), ValueError, "k_scale must be a float or a 1-element tensor"),
    (lambda a, k: k.update(v_scale=torch.ones(1, dtype=torch.float64)), TypeError, "v_scale must be a float"),
    (lambda a, k: k.update(v_scale=-2.0), ValueError, "v_scale must be a positive finite float"),
])
def test_write_kv_cache_errors(mutate, exc, match):
    with pytest.raises(exc, match=match):
        _write(mutate)


def test_ops_cpu_path_equals_reference():
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(6, 8, 64, generator=g) * 20).to(BF16)
    out = torch.full((6, 8, 64), float("nan")).to(FP8)
    assert cute_kernels.quantize_query(q, 0.37, out=out) is out
    assert torch.equal(codes(out), codes(reference.quantize_query(q, 0.37)))
    rope = (torch.randn(40, 32, generator=g), torch.randint(0, 40, (6,), generator=g, dtype=torch.int32))
    per_head = torch.tensor([0.3, 0.7])
    assert torch.equal(codes(cute_kernels.quantize_query(q, per_head, rope=rope)),
                       codes(reference.quantize_query(q, per_head, rope=rope)))
    key, value, cache, _ = _kv(T=6, P=2)
    slots = torch.tensor([0, -1, 31, 32, 5, -7])  # 32 = P * page: out of range, skipped
    expected = cache.clone()
    cute_kernels.write_kv_cache(key, value, cache, slots, k_scale=0.5, v_scale=torch.tensor([0.25]))
    reference.write_kv_cache(key, value, expected, slots, k_scale=0.5, v_scale=torch.tensor([0.25]))
    assert torch.equal(codes(cache), codes(expected))


def test_vector_width_follows_alignment():
    D = 128
    qkv = torch.empty(4, (32 + 16) * D + 8, dtype=BF16)
    fused = qkv[:, :32 * D].view(4, 32, D)  # token stride (48 D + 8) * 2 bytes: 16-byte aligned
    assert qq_op.make_config(fused, False).vec == 16
    shifted = qkv[:, 4:4 + 32 * D].view(4, 32, D)  # 8-byte aligned pointer
    assert qq_op.make_config(shifted, False).vec == 4
    cs = torch.empty(10, 24)  # rot 24: partner offset 12 elements
    cfg = qq_op.make_config(fused, True, None, (cs, torch.zeros(4, dtype=torch.int64)))
    assert (cfg.vec, cfg.rot_dim, cfg.scale_tensor) == (4, 24, True)
    cs = torch.empty(10, 128)  # full rotation: a thread owns a pair of 8-element chunks, not of 16
    rope = (cs, torch.zeros(4, dtype=torch.int64))
    assert qq_op.make_config(fused, False, None, rope).vec == 8
    # rows per thread: 2 for the plain kernel; with RoPE 2 on SM90 (measured), 1 elsewhere
    assert qq_op.make_config(fused, False).items == 2
    assert qq_op.make_config(fused, False, None, rope, "sm_90a").items == 2
    assert qq_op.make_config(fused, False, None, rope, "sm_100a").items == 1
    odd = qkv[:, :31 * D].view(4, 31, D)  # 31 heads: a thread's 2 rows would span two tokens
    assert qq_op.make_config(odd, False, None, rope, "sm_90a").items == 1
    assert qq_op.make_config(torch.empty(3, 4, 72, dtype=FP16), False).vec == 8
    out = torch.empty(4, 32, D + 2, dtype=FP8)[..., :D]  # 2-byte aligned strides
    assert qq_op.make_config(fused, False, out).vec == 2
    key, value, cache, slots = _kv(D=128)
    cfg = kv_op.make_config(key, value, cache, slots, "HND", False, True)
    assert (cfg.vec, cfg.cache_dtype, cfg.kv_form, cfg.v_scale_tensor) == (16, "fp8_e4m3", "single", True)
    cfg = kv_op.make_config(key, value, (cache[:, 0].to(BF16), cache[:, 1].to(BF16)), slots.int(), "HND", False, False)
    assert (cfg.vec, cfg.cache_dtype, cfg.kv_form, cfg.slot_dtype) == (16, "bf16", "pair", "int32")


def test_configs_validate_and_fp8_variants_skip_sm80():
    with pytest.raises(ValueError, match="rot_dim"):
        QuantizeQueryConfig(head_dim=64, vec=16, rot_dim=48)  # rot/2 = 24 not a multiple of 16
    with pytest.raises(ValueError, match="rot_dim > 0"):
        QuantizeQueryConfig(head_dim=64, vec=16, rot_dim=32)  # two 16-element chunks per thread
    with pytest.raises(ValueError, match="multiple of vec"):
        WriteKVCacheConfig(head_dim=72, vec=16)
    assert "sm_80" not in QuantizeQueryConfig().targets and "sm_89" in QuantizeQueryConfig().targets
    assert "sm_86" not in WriteKVCacheConfig(cache_dtype="fp8_e4m3").targets
    assert "sm_80" in WriteKVCacheConfig(cache_dtype="bf16", vec=8).targets


# ----------------------------------------------------------------------------------------------
# reference RoPE semantics (what the kernel is held to)
# ----------------------------------------------------------------------------------------------


def test_reference_rope_neox_formula():
    g = torch.Generator().manual_seed(9)
    T, Hq, D, rot, max_pos = 7, 4, 64, 48, 30
    q = torch.randn(T, Hq, D, generator=g).to(BF16)
    theta = torch.arange(max_pos, dtype=torch.float64).view(-1, 1) * 10000 ** (-torch.arange(rot // 2) / (rot // 2))
    cache = torch.cat([theta.cos(), theta.sin()], dim=1).float()
    pos = torch.randint(0, max_pos, (T,), generator=g)
    y = reference.rope_neox(q, cache, pos)
    x = q.double()
    c, s = cache.double()[pos][:, None, :rot // 2], cache.double()[pos][:, None, rot // 2:]
    x1, x2 = x[..., :rot // 2], x[..., rot // 2:rot]
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]], dim=-1)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(y[..., rot:], q[..., rot:].float())  # pass-through dims untouched
    # each product and the sum rounded separately in fp32 (no fused multiply-add)
    xf = q.float()
    cf, sf = cache[pos][:, None, :rot // 2], cache[pos][:, None, rot // 2:]
    assert torch.equal(y[..., :rot // 2], (xf[..., :rot // 2] * cf) - (xf[..., rot // 2:rot] * sf))
    # the quantized query is the quantization of the fp32 rotation (never rounded to bf16 first)
    assert torch.equal(codes(reference.quantize_query(q, 0.1, rope=(cache, pos))),
                       codes(reference.quantize_fp8(y, 0.1)))


def test_reference_rope_invalid_positions_give_nan_in_rotated_dims_only():
    q = torch.randn(3, 2, 32).to(BF16)
    cache = torch.randn(10, 16)
    y = reference.rope_neox(q, cache, torch.tensor([-1, 10, 4]))
    assert y[:2, :, :16].isnan().all() and not y[:2, :, 16:].isnan().any()
    assert not y[2].isnan().any()
    out = reference.quantize_query(q, 1.0, rope=(cache, torch.tensor([-1, 10, 4])))
    assert out[:2, :, :16].float().isnan().all()
