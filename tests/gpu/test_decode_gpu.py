"""SM90 paged decode against the reference, on the H200.

The case list covers every value of each axis at least once (KV dtype x layout x container x
page size x head dim x GQA ratio x q_len x split) without the full cartesian product: each case
is a compiled variant, and the variants are compiled in parallel before the tests run.
Tolerance: ‖out − ref‖/‖ref‖ ≤ 5e-3 against the fp32 reference on the same (dequantized) cache
values — the op's accuracy contract, BF16 output rounding included.
"""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.testing import check_graph_replay, make_paged_decode_case, ragged_seq_lens, rel_err

from .conftest import sm90_only

pytestmark = sm90_only()
FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
TOL = 5e-3

# (kv, q, D, Hq, Hkv, page, q_len, layout, container, splits)
CASES = [
    (FP8, BF16, 128, 32, 8, 16, 1, "HND", "single", 1),
    (FP8, BF16, 128, 32, 8, 16, 1, "HND", "single", 4),
    (FP8, BF16, 128, 32, 4, 16, 1, "NHD", "single", 1),
    (FP8, BF16, 64, 8, 8, 32, 1, "HND", "tuple", 1),
    (FP8, BF16, 256, 16, 8, 64, 1, "HND", "single", 3),
    (FP8, BF16, 128, 24, 4, 128, 1, "NHD", "tuple", 1),
    (FP8, BF16, 128, 12, 1, 16, 1, "HND", "single", 2),
    (FP8, BF16, 128, 16, 1, 32, 4, "HND", "single", 1),
    (FP8, BF16, 128, 32, 8, 16, 2, "HND", "single", 2),
    (FP8, BF16, 64, 32, 2, 64, 4, "NHD", "single", 1),
    (FP8, BF16, 256, 64, 4, 16, 4, "HND", "single", 2),
    (FP8, BF16, 128, 6, 1, 16, 1, "HND", "single", 1),
    (FP8, FP16, 128, 32, 8, 16, 1, "HND", "single", 1),
    (FP8, FP16, 64, 8, 2, 32, 3, "NHD", "tuple", 2),
    (BF16, BF16, 128, 32, 8, 16, 1, "HND", "single", 1),
    (BF16, BF16, 128, 32, 8, 16, 1, "NHD", "single", 4),
    (BF16, BF16, 64, 8, 8, 32, 1, "HND", "tuple", 1),
    (BF16, BF16, 256, 16, 8, 64, 2, "HND", "single", 2),
    (BF16, BF16, 128, 24, 4, 128, 1, "NHD", "single", 1),
    (BF16, BF16, 128, 16, 1, 16, 4, "HND", "single", 1),
    (FP16, FP16, 128, 32, 8, 16, 1, "HND", "single", 2),
    (FP16, FP16, 256, 8, 1, 32, 1, "NHD", "tuple", 1),
    # the fused merge reads 16 splits per round: 11 is one partial round, 20 a full and a partial, and
    # with ~24 tiles per request many splits are empty (0, -inf)
    (FP8, BF16, 128, 32, 8, 16, 1, "HND", "single", 11),
    (BF16, BF16, 128, 32, 4, 16, 1, "HND", "single", 20),
]


# the non-default tunings stay correct too (benchmarks compare them)
VARIANT_CASES = [
    (FP8, BF16, 128, 32, 8, 16, 1, "HND", "single", 2),
    (FP8, BF16, 64, 32, 2, 64, 4, "NHD", "single", 1),
    (FP8, FP16, 128, 16, 4, 32, 2, "HND", "tuple", 1),
    (BF16, BF16, 128, 32, 8, 16, 1, "HND", "single", 3),
]
VARIANTS = [dict(widen="bits"), dict(tile=128), dict(widen="bits", tile=128), dict(pdl=False), dict(dynamic=True),
            dict(strided=True), dict(strided=False), dict(cluster=False), dict(cluster=False, strided=False),
            dict(smem_merge=False), dict(evict_first=False, prefetch_desc=False)]


def _ids(c):
    kv, q, D, Hq, Hkv, page, ql, lay, cont, s = c
    return f"{str(kv)[6:]}-{str(q)[6:]}-d{D}-h{Hq}/{Hkv}-p{page}-q{ql}-{lay}-{cont}-s{s}"


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every variant the module will hit, in parallel processes, before timing out."""
    from cute_kernels.jit.parallel import precompile
    from cute_kernels.warmup import decode_variants

    names = {FP8: "fp8_e4m3", BF16: "bf16", FP16: "fp16"}
    configs = decode_variants(head_dim=128, num_q_heads=32, num_kv_heads=8, page_size=16, scale_tensors=(True,))
    configs += decode_variants(head_dim=128, num_q_heads=32, num_kv_heads=4, page_size=16, scale_tensors=(True,))
    configs += decode_variants(head_dim=128, num_q_heads=8, num_kv_heads=1, page_size=16, scale_tensors=(False,))
    for kv, q, D, Hq, Hkv, page, ql, layout, container, _ in CASES:
        configs += decode_variants(head_dim=D, num_q_heads=Hq, num_kv_heads=Hkv, page_size=page,
                                   kv_dtypes=(names[kv],), q_dtype=names[q], q_lens=(ql,), scale_tensors=(False,),
                                   kv_layouts=(layout,), kv_forms=("pair" if container == "tuple" else "single",))
    for kv, q, D, Hq, Hkv, page, ql, layout, container, _ in VARIANT_CASES:
        for override in VARIANTS:
            configs += decode_variants(head_dim=D, num_q_heads=Hq, num_kv_heads=Hkv, page_size=page,
                                       kv_dtypes=(names[kv],), q_dtype=names[q], q_lens=(ql,), scale_tensors=(False,),
                                       kv_layouts=(layout,), kv_forms=("pair" if container == "tuple" else "single",),
                                       **override)
    precompile(configs, "sm_90a", progress=False)


def _run(case, splits, **extra):
    out = torch.full_like(case.q, float("nan"))
    out, lse = cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                         return_lse=True, num_splits=splits, **case.kwargs(), **extra)
    return out, lse


def _check(case, out, lse):
    ref, ref_lse = reference.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                          return_lse=True, **case.kwargs())
    assert torch.isfinite(out).all(), "NaN/inf in output (unwritten or poisoned values leaked)"
    err = rel_err(out, ref)
    assert err <= TOL, f"relative error {err:.2e} > {TOL}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=2e-3, rtol=1e-4)
    return err


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_decode_matches_reference(case, gen):
    kv, q, D, Hq, Hkv, page, q_len, layout, container, splits = case
    B = 6
    c = make_paged_decode_case(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                               seq_lens=ragged_seq_lens(gen, B, page), kv_dtype=kv, q_dtype=q, q_len=q_len,
                               kv_layout=layout, container=container, generator=gen)
    out, lse = _run(c, splits)
    _check(c, out, lse)
    # request 0 is empty: exact zeros and -inf
    assert (out[:q_len] == 0).all() and torch.isneginf(lse[:q_len]).all()


@pytest.mark.parametrize("override", VARIANTS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("case", VARIANT_CASES, ids=[_ids(c) for c in VARIANT_CASES])
def test_decode_tuning_variants(case, override, gen):
    from cute_kernels.ops.paged_decode import tuning_override

    kv, q, D, Hq, Hkv, page, q_len, layout, container, splits = case
    c = make_paged_decode_case(batch=5, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                               seq_lens=ragged_seq_lens(gen, 5, page), kv_dtype=kv, q_dtype=q, q_len=q_len,
                               kv_layout=layout, container=container, generator=gen)
    with tuning_override(**override):
        out, lse = _run(c, splits)
    _check(c, out, lse)


@pytest.mark.parametrize("magnitude", [3e4, 1e-4])
def test_extreme_query_magnitudes(magnitude, gen):
    """A BF16 query far outside fp16's comfortable range: the fp16 MMA path rescales it."""
    c = make_paged_decode_case(batch=3, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=[500, 64, 1000], generator=gen)
    c.q = (c.q.float() * magnitude / 128).to(BF16)  # logits ~ magnitude-sized: a peaked softmax
    out, lse = _run(c, 1)
    _check(c, out, lse)


def test_fused_qkv_view_and_scale_tensors(gen):
    c = make_paged_decode_case(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=ragged_seq_lens(gen, 4, 16), fused_qkv=True, generator=gen)
    assert not c.q.is_contiguous()
    c.k_scale = torch.tensor([0.05], device="cuda")
    c.v_scale = torch.tensor([0.02], device="cuda")
    out, lse = _run(c, 1)
    _check(c, out, lse)


def test_k_scale_and_v_scale_are_not_interchangeable(gen):
    c = make_paged_decode_case(batch=3, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                               seq_lens=[300, 40, 777], k_scale=0.1, v_scale=0.01, generator=gen)
    out, lse = _run(c, 1)
    _check(c, out, lse)
    c.k_scale, c.v_scale = c.v_scale, c.k_scale
    out2, _ = _run(c, 1)
    assert rel_err(out2, out) > 0.1


def test_graph_capture_replay_bitwise_and_live_scales(gen):
    c = make_paged_decode_case(batch=8, num_q_heads=32, num_kv_heads=4, head_dim=128, page_size=16,
                               seq_lens=torch.randint(100, 4000, (8,), generator=gen, device="cuda").tolist(),
                               generator=gen)
    c.k_scale, c.v_scale = torch.tensor([0.05], device="cuda"), torch.tensor([0.02], device="cuda")
    for splits in (1, 4):
        check_graph_replay(c, lambda out, s=splits: cute_kernels.paged_decode(
            c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, num_splits=s, **c.kwargs()),
            lambda s=splits: _run(c, s), lambda out, lse: _check(c, out, lse), gen.initial_seed())


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "global"])
@pytest.mark.parametrize("strided", [True, False], ids=["strided", "contiguous"])
def test_split_schedules(gen, strided, cluster):
    """Strided split tiles (split s takes tiles s, s + S, ...) and contiguous ranges, merged in a
    cluster (DSMEM) or through global memory: contexts of more than one 32-box page lookup per
    split, shorter than the split count (empty splits), page-aligned, of 7 tokens and empty;
    against the reference, and graph replay equal to eager bit for bit (static schedules). 16
    splits: the largest cluster, two rounds of the cluster merge's groups of 8."""
    from cute_kernels.ops.paged_decode import tuning_override

    c = make_paged_decode_case(batch=6, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=[0, 3 * 16, 7, 1000, 9001, 64 * 5], generator=gen)
    with tuning_override(strided=strided, cluster=cluster):
        for splits in (3, 9, 16):
            eager, lse = _run(c, splits)
            _check(c, eager, lse)
            out = torch.empty_like(c.q)
            cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, num_splits=splits,
                                      **c.kwargs())
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, num_splits=splits,
                                          **c.kwargs())
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)


@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
def test_fused_merge_staging(gen, kv):
    """The global fused merge with every split's partial staged in shared memory (as many splits
    as the stages hold), one split more than they hold (merged from L2 in rounds) and with the
    staging turned off, against the reference; q_len 2 so that a partial's rows span two tokens."""
    from cute_kernels.ops.paged_decode import tuning_override
    from cute_kernels.plans.sm90_decode import make_decode_config, plan_config

    c = make_paged_decode_case(batch=3, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                               seq_lens=[6000, 0, 777], kv_dtype=kv, q_len=2, generator=gen)
    kv_name = "fp8_e4m3" if kv == torch.float8_e4m3fn else "bf16"

    def config_for(split, **tuning):
        return make_decode_config(q_dtype="bf16", kv_dtype=kv_name, head_dim=128, group=4, q_len=2, page_size=16,
                                  split=split, **tuning)

    slots = plan_config(config_for, 12, 6000, 132, 8, True, False)[1].merge_slots()
    assert slots >= 2
    for splits, staged in ((slots, True), (slots + 1, True), (slots, False)):
        with tuning_override(cluster=False, smem_merge=staged):
            out, lse = _run(c, splits)
        _check(c, out, lse)


def test_nondeterministic_dynamic_split_matches_reference(gen):
    """deterministic=False on a long-context split shape (dynamic tile chunks): correct, with the
    tile-to-CTA assignment left to the hardware."""
    c = make_paged_decode_case(batch=3, num_q_heads=32, num_kv_heads=4, head_dim=128, page_size=16,
                               seq_lens=[20000, 5, 9001], generator=gen)
    for splits in (None, 7):
        out = torch.full_like(c.q, float("nan"))
        out, lse = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, return_lse=True,
                                             num_splits=splits, deterministic=False, **c.kwargs())
        _check(c, out, lse)


def test_long_context_and_large_batch(gen):
    c = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64,
                               seq_lens=[131072 - 5], generator=gen)
    out, lse = _run(c, None)
    _check(c, out, lse)
    c = make_paged_decode_case(batch=1024, num_q_heads=8, num_kv_heads=1, head_dim=128, page_size=16,
                               seq_lens=torch.randint(0, 200, (1024,), generator=gen, device="cuda").tolist(),
                               generator=gen)
    out, lse = _run(c, None)
    _check(c, out, lse)


def test_bad_inputs_raise(gen):
    c = make_paged_decode_case(batch=2, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                               seq_lens=[20, 30], generator=gen)
    run = cute_kernels.paged_decode
    with pytest.raises(TypeError, match="q must have dtype"):
        run(c.q.float(), c.kv_cache, c.block_table, c.seq_lens)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        run(c.q[..., :96], c.kv_cache[..., :96], c.block_table, c.seq_lens)
    with pytest.raises(TypeError, match="block_table must have dtype int32"):
        run(c.q, c.kv_cache, c.block_table.long(), c.seq_lens)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        run(c.q, c.kv_cache, c.block_table, c.seq_lens[:1])
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        run(c.q[:, :7], c.kv_cache, c.block_table, c.seq_lens)
    with pytest.raises(ValueError, match="k_scale must be a float or a 1-element tensor"):
        run(c.q, c.kv_cache, c.block_table, c.seq_lens, k_scale=torch.ones(2, device="cuda"))
    with pytest.raises(ValueError, match="q must have contiguous heads"):
        run(c.q.transpose(0, 1).contiguous().transpose(0, 1), c.kv_cache, c.block_table, c.seq_lens)
    with pytest.raises(ValueError, match="page size must be one of"):
        kv = torch.zeros(4, 2, 2, 8, 128, device="cuda").to(FP8)
        run(c.q, kv, c.block_table, c.seq_lens)
    with pytest.raises(TypeError, match="kv_cache dtype must be float8_e4m3fn or the query's dtype"):
        run(c.q, c.kv_cache.view(torch.uint8), c.block_table, c.seq_lens)
    with pytest.raises(ValueError, match="q has 2 rows; expected batch 2 x q_len_per_req 2"):
        run(c.q, c.kv_cache, c.block_table, c.seq_lens, q_len_per_req=2)


def test_bad_inputs_raise_after_a_cached_call(gen):
    """The launch key leaves to the compiled function what it checks itself (dtypes of the
    integer and output tensors, extents shared with the query or the cache, devices, alignment):
    after a good call, each such bad input must still raise the op's error naming the argument,
    and must not disturb the cached launch."""
    c = make_paged_decode_case(batch=2, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                               seq_lens=[20, 30], generator=gen)
    run = cute_kernels.paged_decode
    out = torch.empty_like(c.q)
    good = dict(out=out, num_splits=2, **c.kwargs())
    run(c.q, c.kv_cache, c.block_table, c.seq_lens, **good)
    with pytest.raises(TypeError, match="block_table must have dtype int32"):
        run(c.q, c.kv_cache, c.block_table.long(), c.seq_lens, **good)
    with pytest.raises(TypeError, match="seq_lens must have dtype int32"):
        run(c.q, c.kv_cache, c.block_table, c.seq_lens.long(), **good)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        run(c.q, c.kv_cache, c.block_table, c.seq_lens[:1], **good)
    with pytest.raises(TypeError, match="seq_lens must be a torch.Tensor"):
        run(c.q, c.kv_cache, c.block_table, [20, 30], **good)
    with pytest.raises(ValueError, match="block_table must be on"):
        run(c.q, c.kv_cache, c.block_table.cpu(), c.seq_lens, **good)
    with pytest.raises(TypeError, match="out must have dtype"):
        run(c.q, c.kv_cache, c.block_table, c.seq_lens, **{**good, "out": out.float()})
    with pytest.raises(ValueError, match="out must have shape"):
        run(c.q, c.kv_cache, c.block_table, c.seq_lens, **{**good, "out": out[:1]})
    with pytest.raises(ValueError, match="k_scale must be a float or a 1-element tensor"):
        run(c.q, c.kv_cache, c.block_table, c.seq_lens, **{**good, "k_scale": torch.ones(2, device="cuda")})
    ks = torch.ones(1, device="cuda")
    run(c.q, c.kv_cache, c.block_table, c.seq_lens, **{**good, "k_scale": ks})  # caches the tensor-scale variant
    with pytest.raises(ValueError, match="k_scale must be on"):
        run(c.q, c.kv_cache, c.block_table, c.seq_lens, **{**good, "k_scale": ks.cpu()})
    # a query at a 2-byte offset inside a larger buffer: same shape and strides, misaligned pointer
    buf = torch.empty(c.q.numel() + 1, dtype=c.q.dtype, device="cuda")
    q_off = buf[1:].view(c.q.shape)
    q_off.copy_(c.q)
    with pytest.raises(ValueError, match="q data pointer must be 16-byte aligned"):
        run(q_off, c.kv_cache, c.block_table, c.seq_lens, **good)
    out.fill_(float("nan"))
    run(c.q, c.kv_cache, c.block_table, c.seq_lens, **good)
    ref = reference.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **c.kwargs())
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL
    # 0-d scale tensors: the launcher passes them to the kernel's [1] arguments as views
    out.fill_(float("nan"))
    zero_d = dict(k_scale=torch.tensor(float(c.k_scale), device="cuda"),
                  v_scale=torch.tensor(float(c.v_scale), device="cuda"))
    run(c.q, c.kv_cache, c.block_table, c.seq_lens, **{**good, **zero_d})
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL
