"""CPU tests of the two-term FP8 query (docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2):
``quantize_query(..., residual=True)`` against float64, ``paged_prefill(..., q_residual=)`` against
the reference on the query ``(hi + lo) · q_scale``, its validation, the plan's config and evidence,
the registry entry, the planner's and the layer's ``"fp8x2"``, the torch.library schema and the
bench entry. The kernel itself runs in tests/gpu/test_prefill_two_term_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.bench import prefill as bench_prefill
from cute_kernels.plans import sm90_prefill as plan
from cute_kernels.registry import KERNELS
from cute_kernels.testing import make_paged_prefill_case, rel_err
from dispatch import AttentionLayer, AttentionMetadata, UnsupportedConfig
from dispatch import plan as dispatch_plan

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
SCALES = {"float": 0.02, "0-d": torch.tensor(0.02), "1-element": torch.tensor([0.02]),
          "per KV head": torch.tensor([0.02, 0.035])}


def _x64(q, q_scale, Hq):
    """rope-less ``q / q_scale`` as the kernel computes it (an fp32 division, correctly rounded)."""
    s = q_scale
    if isinstance(s, torch.Tensor):
        s = s.double().reshape(-1)
        s = s.repeat_interleave(Hq // s.numel()).view(1, Hq, 1) if s.numel() > 1 else s.reshape(())
    return (q.double() / s).float().double()


@pytest.mark.parametrize("form", list(SCALES))
@pytest.mark.parametrize("seed", [0, 1])
def test_residual_against_float64(form, seed):
    """hi = e4m3(x), lo = e4m3(x - hi) bit for bit, with x - hi exact in float64; the op on CPU
    tensors returns the reference's codes; the two terms carry x far closer than one."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(37, 4, 64, generator=g) * 2).to(BF16)
    q_scale = SCALES[form]
    x = _x64(q, q_scale, 4)
    hi, lo = reference.quantize_query(q, q_scale, residual=True)
    want_hi = x.clamp(-448, 448).to(FP8)
    want_lo = (x - want_hi.double()).clamp(-448, 448).to(FP8)
    assert torch.equal(hi.view(torch.uint8), want_hi.view(torch.uint8)), f"seed {seed}"
    assert torch.equal(lo.view(torch.uint8), want_lo.view(torch.uint8)), f"seed {seed}"
    assert torch.equal(reference.quantize_query(q, q_scale).view(torch.uint8), hi.view(torch.uint8))
    one, two = rel_err(hi.double(), x), rel_err(hi.double() + lo.double(), x)
    print(f"seed {seed} {form}: one term {one:.2e}, two terms {two:.2e}")
    assert 0 < two < one / 8, f"seed {seed}: two-term error {two:.2e} against one-term {one:.2e}"
    op_hi, op_lo = cute_kernels.quantize_query(q, q_scale, residual=True)
    assert torch.equal(op_hi.view(torch.uint8), hi.view(torch.uint8))
    assert torch.equal(op_lo.view(torch.uint8), lo.view(torch.uint8))


def test_residual_with_rope_and_out_buffers():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(9, 4, 64, generator=g).to(BF16)
    cos_sin = torch.randn(32, 32, generator=g)
    pos = torch.randint(0, 32, (9,), generator=g)
    x = reference.rope_neox(q, cos_sin, pos).double() / 0.01
    out = torch.full(q.shape, float("nan")).to(FP8)
    lo_out = torch.full(q.shape, float("nan")).to(FP8)
    hi, lo = cute_kernels.quantize_query(q, 0.01, rope=(cos_sin, pos), out=out, residual=True, residual_out=lo_out)
    assert hi is out and lo is lo_out
    assert not torch.isnan(hi.float()).any() and not torch.isnan(lo.float()).any()
    assert rel_err(hi.double() + lo.double(), x) < rel_err(hi.double(), x) / 8


@pytest.mark.parametrize("kw, err, text", [
    (dict(residual="yes"), ValueError, "residual must be True or False"),
    (dict(residual_out=torch.zeros(3, 4, 64).to(FP8)), ValueError, "residual_out needs residual=True"),
    (dict(residual=True, residual_out=torch.zeros(3, 4, 64)), TypeError, "residual_out"),
    (dict(residual=True, residual_out=torch.zeros(2, 4, 64).to(FP8)), ValueError, "residual_out"),
])
def test_residual_arguments_are_checked(kw, err, text):
    q = torch.randn(3, 4, 64).to(BF16)
    with pytest.raises(err, match=text):
        cute_kernels.quantize_query(q, 0.1, **kw)


# ----------------------------------------------------------------------------------------------
# paged_prefill(..., q_residual=)
# ----------------------------------------------------------------------------------------------


def _case(seed, *, D=64, reqs=((0, 70), (37, 50), (20, 0))):
    g = torch.Generator().manual_seed(seed)
    # the bench's inputs (FP8 codes of 64 N(0, 1) with k/v scales 1/16, 1/32: logits of sigma ~ 4)
    return make_paged_prefill_case(reqs=list(reqs), num_q_heads=8, num_kv_heads=2, head_dim=D, page_size=16,
                                   kv_dtype=FP8, k_scale=1 / 16, v_scale=1 / 32, generator=g, device="cpu")


@pytest.mark.parametrize("form", list(SCALES))
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_reads_the_two_term_query(form, causal):
    """The op (CPU tensors: the reference) on (hi, lo) equals float64 attention on the query
    (hi + lo) · q_scale, with the LSE; the error against the unquantized query drops below the
    target where the one-term query's does not (the emulation's claim with exact P)."""
    seed = 7
    c = _case(seed)
    q_scale = SCALES[form] * float(c.q.float().abs().amax()) / 448 / 0.02
    hi, lo = cute_kernels.quantize_query(c.q, q_scale, residual=True)
    qs = reference.query_scale(q_scale, 8)
    qs = qs.double().view(1, -1, 1) if isinstance(qs, torch.Tensor) and qs.dim() else float(qs)
    q64 = (hi.double() + lo.double()) * qs
    args = (c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc)
    want, want_lse = reference.paged_prefill(q64, *args, causal=causal, return_lse=True, float64=True, **c.kwargs())
    out = torch.full(c.q.shape, float("nan"), dtype=BF16)
    got, lse = cute_kernels.paged_prefill(hi, *args, causal=causal, q_scale=q_scale, q_residual=lo, out=out,
                                          return_lse=True, **c.kwargs())
    assert got is out and not torch.isnan(got).any()
    assert rel_err(got, want) < 2 ** -7, f"seed {seed}"
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (fin.sum() > 0)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin].double(), atol=1e-4, rtol=1e-5)
    exact = reference.paged_prefill(c.q, *args, causal=causal, float64=True, **c.kwargs())
    one = cute_kernels.paged_prefill(hi, *args, causal=causal, q_scale=q_scale, **c.kwargs())
    e1, e2 = rel_err(one, exact), rel_err(got, exact)
    print(f"seed {seed} {form} causal={causal}: one term {e1:.2e}, two terms {e2:.2e}")
    assert e2 < 1e-2 < 3e-2 < e1, f"seed {seed}: one term {e1:.2e}, two terms {e2:.2e}"


def test_q_residual_is_validated():
    c = _case(3)
    hi, lo = cute_kernels.quantize_query(c.q, 0.05, residual=True)
    args = (c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc)
    bad = [
        (dict(q=c.q, q_residual=lo), ValueError, "q_residual is the second term of an FP8 query"),
        (dict(q=hi, q_scale=0.05, q_residual=lo.float()), TypeError, "q_residual must be float8_e4m3fn"),
        (dict(q=hi, q_scale=0.05, q_residual=lo[1:]), ValueError, "q_residual must have q's shape"),
        (dict(q=hi, q_scale=0.05, q_residual=[lo]), TypeError, "q_residual must be a float8_e4m3fn tensor"),
        (dict(q=hi, q_residual=lo), ValueError, "q_scale"),
    ]
    for kw, err, text in bad:
        q = kw.pop("q")
        with pytest.raises(err, match=re.escape(text)):
            cute_kernels.paged_prefill(q, *args, **kw, **c.kwargs())
        with pytest.raises(err, match=re.escape(text)):
            reference.paged_prefill(q, *args, **kw, **c.kwargs())


def test_library_op_takes_q_residual():
    c = _case(5, reqs=((0, 20),))
    hi, lo = cute_kernels.quantize_query(c.q, 0.05, residual=True)
    op = torch.ops.cute_kernels.paged_prefill
    assert "q_residual" in str(op.default._schema)
    out, _ = op(hi, c.kv_cache, None, c.block_table, c.seq_lens, c.query_start_loc, None, "HND", True, None, 0.05,
                None, c.k_scale, None, c.v_scale, None, False, -1, None, lo)
    want = cute_kernels.paged_prefill(hi, c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc, q_scale=0.05,
                                      q_residual=lo, **c.kwargs())
    assert torch.equal(out, want)


# ----------------------------------------------------------------------------------------------
# plan, registry, dispatch, bench
# ----------------------------------------------------------------------------------------------


def test_config_and_registry():
    base = dict(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16)
    one = plan.make_prefill_config(**base)
    two = plan.make_prefill_config(**base, q_terms=2)
    assert "q_terms" not in one.label() and "q_terms=2" in two.label()
    names = [a.name for a in two.signature()]
    assert names[:2] == ["q", "q_residual"] and "q_residual" not in [a.name for a in one.signature()]
    assert plan.smem_bytes(two) - plan.smem_bytes(one) == plan.TILE_M * 128
    assert plan.check_registry_id(two) == plan.TWO_TERM_ID and plan.config_family(two).endswith("/two_term")
    with pytest.raises(ValueError, match="q_terms"):
        plan.make_prefill_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16, q_terms=2)
    with pytest.raises(ValueError, match="q_terms"):
        plan.make_prefill_config(**base, q_terms=3)
    info = KERNELS[plan.TWO_TERM_ID]
    assert info.opt_in and info.query_terms == 2 and info.status == "available"
    assert info.family("fp8_e4m3", "fp8_e4m3", 128) == plan.config_family(two)
    assert sorted((v.head_dim, v.vt_transpose) for v in info.variants()) == [
        (64, "ldsm"), (128, "ldsm"), (128, "words"), (256, "ldsm")]  # and the opt-out transpose once
    assert all(v.q_terms == 2 and plan.check_registry_id(v) == info.id for v in info.variants())


def test_two_term_evidence_needs_both_terms_in_one_group():
    cfg = plan.make_prefill_config(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=64, group=8, page_size=16,
                                   q_terms=2)
    pattern = dict(cfg.evidence["sm_90a"])["QK group of both query terms"]
    ss = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f1, %f2}, %rd7, %rd8, p, 1, 1;\nadd.s64 %rd7, 2;\n"
    rs = "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%f1, %f2}, {%r1, %r2}, %rd9, p, 1, 1;\n"
    commit = "wgmma.commit_group.sync.aligned;\n"
    assert len(re.findall(pattern, ss * 4 + commit)) == 1
    assert not re.findall(pattern, ss * 2 + commit + ss * 2 + commit)  # one term per group
    assert not re.findall(pattern, ss * 2 + rs + ss * 2 + commit)  # a PV WGMMA between


def _plan(**kw):
    return dispatch_plan(arch=kw.pop("arch", "sm90"), phase="prefill", model_dtype="bf16", head_dim=128,
                         num_q_heads=32, num_kv_heads=8, page_size=16, q_len=256,
                         kv_cache_dtype=kw.pop("kv_cache_dtype", "fp8"), **kw)


def test_planner_fp8x2():
    p = _plan(query_dtype="fp8x2")
    assert p.kernel == plan.TWO_TERM_ID and p.quantize_query and p.applies_q_scale and p.q_dtype == "fp8_e4m3"
    assert _plan(query_dtype="fp8").kernel == "sm90.prefill_fp8q"
    assert _plan().kernel == plan.FP8_CACHE_KERNEL
    with pytest.raises(UnsupportedConfig, match="two-term"):
        _plan(arch="sm100", query_dtype="fp8x2")
    with pytest.raises(UnsupportedConfig, match="FP8 KV cache"):
        _plan(kv_cache_dtype="bf16", query_dtype="fp8x2")
    with pytest.raises(UnsupportedConfig, match="term"):
        _plan(query_dtype="fp8x2", backend="sm90.prefill_fp8q")
    with pytest.raises(UnsupportedConfig, match="term"):
        _plan(query_dtype="fp8", backend=plan.TWO_TERM_ID)


def test_layer_fp8x2_on_cpu_tensors():
    """The layer quantizes the prefill rows with their residual and the step's output is the
    reference's on the two-term query (CPU tensors: the ops run the reference)."""
    g = torch.Generator().manual_seed(9)
    Hq, Hkv, D, page, q_scale = 8, 2, 64, 16, 0.01
    layer = AttentionLayer(Hq, Hkv, D, kv_cache_dtype="fp8", page_size=page, q_scale=q_scale, k_scale=1 / 16,
                           v_scale=1 / 32, arch="sm90", prefill_query_dtype="fp8x2")
    assert "fp8x2" in repr(layer)
    assert any(getattr(c, "q_terms", 1) == 2 for c in layer.warmup_variants(4, 256))
    T = 40
    q, k, v = (torch.randn(T, h, D, generator=g).to(BF16) for h in (Hq, Hkv, Hkv))
    cache = torch.zeros(8, 2, Hkv, page, D).to(FP8)
    md = AttentionMetadata(slot_mapping=torch.arange(T), query_start_loc=torch.tensor([0, T], dtype=torch.int32),
                           seq_lens=torch.tensor([T], dtype=torch.int32),
                           block_table=torch.arange(4, dtype=torch.int32).view(1, 4), max_query_len=T)
    out = layer(q, k, v, cache, md)
    hi, lo = reference.quantize_query(q, q_scale, residual=True)
    want = reference.paged_prefill(hi, cache, md.block_table, md.seq_lens, md.query_start_loc, q_scale=q_scale,
                                   q_residual=lo, k_scale=1 / 16, v_scale=1 / 32)
    assert torch.equal(out, want)
    with pytest.raises(UnsupportedConfig, match="fp8x2"):
        AttentionLayer(Hq, Hkv, D, kv_cache_dtype="bf16", page_size=page, q_scale=q_scale,
                       prefill_query_dtype="fp8x2")


def test_bench_entry():
    assert "ours_fp8x2" in bench_prefill.PEERS and "ours_fp8x2" in bench_prefill.ENTRIES
