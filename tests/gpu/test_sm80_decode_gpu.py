"""``sm80.decode`` (warp MMA + cp.async, the portable kernel) against the reference, forced with
``tuning_override(backend="sm80")`` so that it runs on the H200 too: every cache dtype and both
FP8 widenings, layouts, containers, page sizes, head dims, GQA ratios, draft lengths, split-KV,
an fp16 cache with a bf16 query, a ring sized for 99 KB of shared memory (SM86/89/120/121),
CUDA-graph replay, the cases from head dim 128 on again without ``ldsm_xor``, every case again with the
opt-in lean softmax, the split cases again with the opt-in fused merge, the fused merge over many
splits and empty ones, the first cases again with the opt-in ``kv_first`` and
with ``page_prefetch``. Outputs are poisoned with NaN;
the seed is in every failure message."""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops.paged_decode import tuning_override
from cute_kernels.testing import (
    check_attention,
    check_graph_replay,
    make_paged_decode_case,
    ragged_seq_lens,
    rel_err,
)

pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 0), reason="needs SM80 or newer")
FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
TOL = 5e-3

# (kv, q, D, Hq, Hkv, page, q_len, layout, container, splits, override)
CASES = [
    (BF16, BF16, 128, 32, 8, 16, 1, "HND", "single", 1, {}),
    (BF16, BF16, 128, 32, 8, 16, 1, "NHD", "tuple", 4, {}),
    (BF16, BF16, 64, 8, 8, 32, 1, "HND", "tuple", 1, {}),
    (BF16, BF16, 256, 16, 8, 64, 2, "HND", "single", 2, {}),
    (BF16, BF16, 128, 16, 1, 128, 4, "NHD", "single", 1, {}),
    (FP16, FP16, 128, 32, 8, 16, 1, "HND", "single", 3, {}),
    (FP16, FP16, 256, 8, 1, 32, 1, "NHD", "tuple", 1, {}),
    (FP16, BF16, 128, 32, 4, 16, 1, "HND", "single", 1, {}),  # fp16 cache, bf16 query: fp16 MMA
    (FP16, BF16, 64, 16, 2, 64, 3, "NHD", "single", 2, {}),
    (FP8, BF16, 128, 32, 8, 16, 1, "HND", "single", 1, {}),
    (FP8, BF16, 128, 32, 8, 16, 1, "HND", "single", 5, dict(widen="bits")),
    (FP8, BF16, 128, 32, 4, 16, 1, "NHD", "single", 1, dict(widen="bits")),
    (FP8, BF16, 64, 8, 8, 32, 1, "HND", "tuple", 1, {}),
    (FP8, BF16, 64, 8, 8, 32, 1, "HND", "tuple", 2, dict(widen="bits")),
    (FP8, BF16, 256, 16, 8, 64, 1, "HND", "single", 3, {}),
    (FP8, BF16, 256, 16, 8, 64, 1, "HND", "single", 1, dict(widen="bits")),
    (FP8, BF16, 128, 12, 1, 16, 1, "HND", "single", 2, {}),
    (FP8, BF16, 128, 16, 1, 32, 4, "HND", "single", 1, {}),
    (FP8, BF16, 256, 64, 4, 16, 4, "HND", "single", 2, dict(widen="bits")),
    (FP8, FP16, 128, 32, 8, 16, 1, "HND", "single", 1, {}),
    (FP8, FP16, 64, 8, 2, 32, 3, "NHD", "tuple", 2, dict(widen="bits")),
    # rings sized for 99 KB of shared memory per block (SM86/89/120/121), run here
    (BF16, BF16, 128, 32, 8, 16, 1, "HND", "single", 2, dict(smem_target="sm_86")),
    (FP8, BF16, 256, 32, 8, 16, 1, "HND", "single", 1, dict(smem_target="sm_120a", widen="bits")),
    (BF16, BF16, 256, 16, 2, 32, 2, "NHD", "tuple", 1, dict(smem_target="sm_89")),
]
# one ldmatrix base per operand is the default from head dim 128 on; the per-address form that
# ldsm_xor=False selects, on the same cases (docs/design/sm80.md#defaults)
CASES += [(*c[:-1], dict(c[-1], ldsm_xor=False)) for c in CASES if c[2] >= 128]
# the opt-in lean softmax (docs/design/sm80.md#the-lean-softmax-opt-in) on every case above
CASES += [(*c[:-1], dict(c[-1], lean_softmax=True)) for c in list(CASES)]
# split launches merge in a second launch by default; the opt-in merge in their last CTA
# (fused_merge=True) on the split cases of the first list (docs/design/sm80.md#the-fused-merge)
CASES += [(*c[:-1], dict(c[-1], fused_merge=True)) for c in CASES[:24] if c[9] > 1]
# the opt-in kv_first (the ring's first copies issued before Q is staged,
# docs/design/sm80.md#kv-copies-before-the-query) on the cases of the first list
CASES += [(*c[:-1], dict(c[-1], kv_first=True)) for c in CASES[:24]]
# page ids read a tile ahead (docs/design/sm80.md#page-ids-a-tile-ahead) on the cases of the first list
CASES += [(*c[:-1], dict(c[-1], page_prefetch=True)) for c in CASES[:24]]


def _ids(c):
    kv, q, D, Hq, Hkv, page, ql, lay, cont, s, ov = c
    extra = "-".join(f"{k}{v}" for k, v in ov.items())
    return f"{str(kv)[6:]}-{str(q)[6:]}-d{D}-h{Hq}/{Hkv}-p{page}-q{ql}-{lay}-{cont}-s{s}" + (f"-{extra}" if extra else "")


def _run(case, splits, **override):
    out = torch.full_like(case.q, float("nan"))
    with tuning_override(backend="sm80", **override):
        out, lse = cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                             return_lse=True, num_splits=splits, **case.kwargs())
    return out, lse


def _check(case, out, lse, seed):
    ref, ref_lse = reference.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                          return_lse=True, **case.kwargs())
    check_attention(out, lse, ref, ref_lse, seed, TOL)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_sm80_decode_matches_reference(case, gen):
    kv, q, D, Hq, Hkv, page, q_len, layout, container, splits, override = case
    seed = gen.initial_seed()
    B = 6
    c = make_paged_decode_case(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                               seq_lens=ragged_seq_lens(gen, B, page), kv_dtype=kv, q_dtype=q, q_len=q_len,
                               kv_layout=layout, container=container, generator=gen)
    out, lse = _run(c, splits, **override)
    _check(c, out, lse, seed)
    assert (out[:q_len] == 0).all() and torch.isneginf(lse[:q_len]).all(), f"seed {seed}: empty request"


@pytest.mark.parametrize("widen", ["bits", "cvt"])
def test_every_fp8_code_widens_exactly(widen, gen):
    """K and V pages holding every e4m3 code (NaN codes excluded: the bit trick maps them to ±480,
    see docs/design/sm80.md) with a one-hot query: each output row is one V row exactly (fp32 compare
    against torch's conversion), and the LSE shows each logit exactly."""
    D, page = 128, 16
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 254 finite codes
    L = 256
    vals = codes.repeat((L * D + len(codes) - 1) // len(codes))[: L * D].view(L, D)
    kv = torch.zeros(L // page, 2, 1, page, D, dtype=torch.uint8, device="cuda")
    kv[:, 0, 0] = vals.view(L // page, page, D).cuda()
    kv[:, 1, 0] = vals.roll(1, 0).view(L // page, page, D).cuda()
    kv = kv.view(FP8)
    table = torch.arange(L // page, dtype=torch.int32, device="cuda").view(1, -1)
    q = torch.zeros(1, 1, D, dtype=torch.float16, device="cuda")
    q[0, 0, 5] = 1.0
    with tuning_override(backend="sm80", widen=widen):
        out, lse = cute_kernels.paged_decode(q, kv, table, torch.tensor([L], dtype=torch.int32, device="cuda"),
                                             return_lse=True, sm_scale=1.0, k_scale=1 / 448)
    ref, ref_lse = reference.paged_decode(q, kv, table, torch.tensor([L], dtype=torch.int32, device="cuda"),
                                          return_lse=True, sm_scale=1.0, k_scale=1 / 448, float64=True)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-5, rtol=1e-6)
    assert rel_err(out, ref) < 1e-3


def test_graph_replay_equals_eager_and_sees_new_scales(gen):
    seed = gen.initial_seed()
    c = make_paged_decode_case(batch=8, num_q_heads=32, num_kv_heads=4, head_dim=128, page_size=16,
                               seq_lens=torch.randint(100, 4000, (8,), generator=gen, device="cuda").tolist(),
                               generator=gen)
    c.k_scale, c.v_scale = torch.tensor([0.05], device="cuda"), torch.tensor([0.02], device="cuda")

    def call(out, splits):
        with tuning_override(backend="sm80"):
            cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, num_splits=splits,
                                      **c.kwargs())

    for splits in (1, 4):
        check_graph_replay(c, lambda out, s=splits: call(out, s), lambda s=splits: _run(c, s),
                           lambda out, lse: _check(c, out, lse, seed), seed)


def test_sm90_sends_what_its_kernel_refuses_to_the_portable_one(gen):
    """Without an override: on SM90 an fp16 cache with a bf16 query (which sm90.decode refuses)
    runs sm80.decode; on every other arch every decode does."""
    from cute_kernels.ops._torch import compile_target
    from cute_kernels.ops.paged_decode import decode_kernel

    seed = gen.initial_seed()
    assert decode_kernel(compile_target(torch.device("cuda")), "bf16", "fp16").id == "sm80.decode"
    c = make_paged_decode_case(batch=4, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                               seq_lens=ragged_seq_lens(gen, 4, 16), kv_dtype=FP16, q_dtype=BF16, generator=gen)
    out = torch.full_like(c.q, float("nan"))
    out, lse = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, return_lse=True,
                                         **c.kwargs())
    _check(c, out, lse, seed)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_lengths_past_the_block_table_are_not_attended(splits, prefetch, gen):
    """A stale or corrupted length beyond the table's capacity W x page (2^31 - 1 too): each row's
    causal limit is clamped to the capacity, as in the reference (docs/design/inputs.md#lengths)."""
    seed = gen.initial_seed()
    c = make_paged_decode_case(batch=3, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                               seq_lens=[200, 40, 90], q_len=2, generator=gen,
                               poison_tail=False)  # the longer lengths make every page's tail visible
    W = c.block_table.shape[1]
    c.seq_lens.copy_(torch.tensor([W * 16 + 3, 2**31 - 1, 90], dtype=torch.int32, device="cuda"))
    out, lse = _run(c, splits, page_prefetch=prefetch)
    _check(c, out, lse, seed)


@pytest.mark.parametrize("kv", [BF16, FP8])
@pytest.mark.parametrize("splits", [17, 64])
def test_fused_merge_over_many_and_empty_splits(kv, splits, gen):
    """The opt-in fused merge (the last split CTA of each (request, KV head) merges): more splits
    than one merge group (16), requests shorter than one split's first tile (empty splits, LSE -inf
    partials) and an empty request beside long ones. The arrival counters are zero again after
    every launch, a second call gives the same bits (the merge order is the split order, not the
    arrival order), and the default merge (a second launch) agrees with the reference too."""
    from cute_kernels.ops import paged_decode as op

    seed = gen.initial_seed()
    lens = [0, 1, 7, 3000, 40, 1500]
    c = make_paged_decode_case(batch=len(lens), num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                               seq_lens=lens, kv_dtype=kv, q_len=1, generator=gen)
    out, lse = _run(c, splits, fused_merge=True)
    _check(c, out, lse, seed)
    assert all(bool((b == 0).all()) for b in op._counters.buffers.values()), f"seed {seed}: counters left set"
    again, lse2 = _run(c, splits, fused_merge=True)
    assert torch.equal(again, out) and torch.equal(lse2, lse), f"seed {seed}: not deterministic"
    out3, lse3 = _run(c, splits)
    _check(c, out3, lse3, seed)
