"""``sm80.prefill`` (warp MMA + cp.async) against the reference on varlen batches: chunked
requests against cached prefixes, empty requests (q_len 0), causal and not, every cache dtype and
both FP8 widenings, layouts, containers, page sizes, head dims, GQA ratios, a ring sized for 99 KB
of shared memory, and CUDA-graph replay; the plan's tilings (128-row CTAs up to D 128 for lean variants, else
64-row ones; 32-token stages with one ldmatrix base at D 256) and the others, with and without the LSE, and
the 64-token 128-row overrides at D 128 (with the row statistics in shared memory too), each with the opt-in
lean softmax too, the opt-in ``kv_first`` on the base and lean default cases, and both grid orders
(``heads_first`` or not) on the same cases, the eight-warp ping-pong form (the lean BF16 D 128 default on
sm_90a and sm_80) as an override on the D 128 cases, its 128-row form of 16-row warps (the 99 KB targets'
default) likewise, with many requests under a grid sized far past them and a
``max_query_len`` past the heads-first grid's height, and the opt-in output per warp (``warp_store``) on
the base and ping-pong cases. Runs on any SM80+ GPU (the H200 included): the op runs the
portable kernel when ``tuning_override(backend="sm80")`` forces it, whatever the arch. Outputs are
poisoned with NaN; the seed is in every failure message."""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops.paged_prefill import tuning_override
from cute_kernels.plans.sm80 import (
    PREFILL_D128_PINGPONG16,
    PREFILL_D128_TW64,
    PREFILL_D128_TW64S,
    PREFILL_D256_TW32X,
    PREFILL_D256_W8,
)
from cute_kernels.testing import capture_graph, check_attention, make_paged_prefill_case, rel_err

pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 0), reason="needs SM80 or newer")
FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
TOL = 5e-3

# (kv, q, D, Hq, Hkv, page, layout, container, causal, override)
CASES = [
    (BF16, BF16, 128, 32, 8, 16, "HND", "single", True, {}),
    (BF16, BF16, 128, 32, 8, 16, "NHD", "tuple", False, {}),
    (BF16, BF16, 64, 8, 8, 32, "HND", "single", True, {}),
    (BF16, BF16, 256, 16, 2, 64, "HND", "tuple", True, {}),
    (BF16, BF16, 128, 16, 1, 128, "NHD", "single", True, {}),
    (FP16, FP16, 128, 24, 4, 16, "HND", "single", True, {}),
    (FP16, FP16, 256, 8, 8, 32, "NHD", "tuple", False, {}),
    (FP16, BF16, 128, 32, 4, 16, "HND", "single", True, {}),
    (FP8, BF16, 128, 32, 8, 16, "HND", "single", True, {}),
    (FP8, BF16, 128, 32, 8, 16, "HND", "single", True, dict(widen="bits")),
    (FP8, BF16, 64, 12, 2, 64, "NHD", "tuple", False, {}),
    (FP8, BF16, 256, 16, 4, 16, "HND", "single", True, dict(widen="bits")),
    (FP8, FP16, 128, 16, 16, 32, "HND", "single", True, {}),
    (FP8, BF16, 128, 64, 4, 16, "HND", "single", True, {}),
    (BF16, BF16, 128, 32, 8, 16, "HND", "single", True, dict(smem_target="sm_86")),
    (FP8, BF16, 256, 32, 8, 16, "NHD", "single", True, dict(smem_target="sm_120a", widen="bits")),
]
# the 128-row tiling on the same cases up to D 128: with the LSE (and under smem_target="sm_120a")
BASE = list(CASES)
# an override with 16-token stages at D 128, not a default (docs/design/sm80.md#defaults)
M1, M2 = dict(m_tiles=1), dict(m_tiles=2)
CASES += [(*c[:-1], {**c[-1], **M2}) for c in CASES if c[2] <= 128]
CASES.append((FP8, BF16, 128, 32, 8, 16, "HND", "single", True, dict(smem_target="sm_120a", **M2)))
# head dim 256: the default is PREFILL_D256_TW32X (32-token stages, one ldmatrix base) but for a
# 16-bit cache at page 32 (the FP16 case, where the override reaches it); the 16-token form before
# on the same cases: (K, V) pairs, both layouts, a non-causal mask, FP8 with the bit widening, a
# ring sized for 99 KB (docs/design/sm80.md#prefill-tilings-measured)
D256X, D256_TW16 = PREFILL_D256_TW32X, dict(m_tiles=1, tw=16)
# and the eight-warp form (PREFILL_D256_W8, sm_80's lean 16-bit default) with the ring sized for
# sm_80, on every 16-bit D 256 case (an override for the others: pairs, the LSE, no mask)
D256W8 = dict(PREFILL_D256_W8, smem_target="sm_80")
CASES += [(*c[:-1], {**c[-1], **ov}) for c in CASES if c[2] == 256 and "m_tiles" not in c[-1]
          for ov in ((D256X, D256_TW16) if c[5] == 32 else (D256_TW16,)) + ((D256W8,) if c[0] != FP8 else ())]
# the head-dim-128 override (128-row CTAs, 64-token stages; unmeasured) on the D 128 cases: every
# cache dtype, both widenings, (K, V) pairs, both layouts, a non-causal mask, GQA 1-16, pages
# 16-128, a ring sized for 99 KB (docs/design/sm80.md#64-token-stages-at-head-dim-128)
D128X = PREFILL_D128_TW64
D128_BASE = [c for c in CASES if c[2] == 128 and set(c[-1]) <= {"smem_target", "widen"}]
CASES += [(*c[:-1], {**c[-1], **D128X}) for c in D128_BASE]
# the same tile with each row's softmax max and sum in shared memory between tiles and the one-base
# page gather (PREFILL_D128_TW64S; unmeasured) on the same D 128 cases: varlen, chunked, an empty
# request, every cache dtype and widening, pairs, both layouts, a non-causal mask with the LSE, GQA
# 1-16, pages 16-128, a 99 KB ring
D128S = PREFILL_D128_TW64S
CASES += [(*c[:-1], {**c[-1], **D128S}) for c in D128_BASE]
# the lean softmax (max over the raw scores, one FFMA per score, O's rescale skipped when no row
# max moved; opt-in, docs/design/sm80.md#the-lean-softmax-opt-in) on every case above
CASES += [(*c[:-1], {**c[-1], "lean_softmax": True}) for c in list(CASES)]
# lean variants (causal, one cache tensor, no LSE, no scale tensors) of the cases above and at
# D 256: the defaults, 128-row CTAs with 32-token stages up to D 128 and PREFILL_D256_TW32X at D 256
# (and at page 32 with a BF16 cache, where it is not the default); then the old 64-row forms of the
# same shapes, and at D 256 with 16-bit caches the eight-warp form sized for sm_80 (its default there)
LEAN = [c for c in CASES if c[7] == "single" and c[8] and set(c[-1]) <= {"smem_target"}]
LEAN_SOFTMAX = [(*c[:-1], {**c[-1], "lean_softmax": True}) for c in LEAN]
LEAN_D128X = [(*c[:-1], {**c[-1], **ov}) for c in LEAN if c[2] == 128 for ov in (D128X, D128S)]
LEAN += [(BF16, BF16, 256, 16, 8, 16, "HND", "single", True, {}), (FP16, FP16, 256, 8, 1, 128, "NHD", "single", True, {}),
         (BF16, BF16, 256, 8, 4, 32, "HND", "single", True, {})]
LEAN_D256 = [c for c in LEAN if c[2] == 256]
LEAN += [(*c[:-1], {**c[-1], **M1, "tw": 16 if c[2] == 256 else 32}) for c in LEAN]
LEAN += [(*c[:-1], {**c[-1], **D256X}) for c in LEAN_D256 if c[5] == 32]
LEAN += [(*c[:-1], {**c[-1], **D256W8}) for c in LEAN_D256 if c[0] != FP8]
LEAN += LEAN_D128X + LEAN_SOFTMAX
# the opt-in kv_first (the ring's first copies issued before Q is staged,
# docs/design/sm80.md#kv-copies-before-the-query) on the base cases and the lean defaults
CASES += [(*c[:-1], {**c[-1], "kv_first": True}) for c in BASE]
LEAN += [(*c[:-1], {**c[-1], "kv_first": True}) for c in LEAN if set(c[-1]) <= {"smem_target"}]
# every case above runs the grid the plan chooses (the KV heads fastest up to D 128); the grid
# with the row tiles fastest on the base cases and the lean defaults (docs/design/sm80.md#the-grid-order)
CASES += [(*c[:-1], {**c[-1], "heads_first": False}) for c in BASE]
LEAN += [(*c[:-1], {**c[-1], "heads_first": False}) for c in LEAN if set(c[-1]) <= {"smem_target"}]

# eight-warp CTAs whose halves take turns at the tensor pipe (pingpong, an override,
# docs/design/sm80.md#ping-pong-warps), on the 64-token D 128 tiling: every cache dtype and widening,
# pairs, both layouts, a non-causal mask with the LSE, GQA 1-16, pages 16-128, the lean defaults (its
# 64 KB of Q beside the ring needs more than the 99 KB targets have). On sm_90a the lean BF16
# defaults up to page 64 are this form with the lean softmax (PREFILL_D128_PINGPONG)
PINGPONG = dict(D128S, warps_m=8, pingpong=True)
CASES += [(*c[:-1], {**c[-1], **PINGPONG}) for c in D128_BASE if "smem_target" not in c[-1]]
LEAN += [(*c[:-1], {**c[-1], **PINGPONG}) for c in LEAN if c[2] == 128 and not c[-1]]
# the same turns in 128 rows, eight warps of one 16-row tile (PREFILL_D128_PINGPONG16: 98 KB, the lean
# BF16 default up to page 64 on the 99 KB targets, and so of the lean case above with a ring sized for
# sm_86), as an override on the same D 128 cases, the 99 KB ring included
PINGPONG16 = dict(D128S, **PREFILL_D128_PINGPONG16)
CASES += [(*c[:-1], {**c[-1], **PINGPONG16}) for c in D128_BASE]
LEAN += [(*c[:-1], {**c[-1], **PINGPONG16}) for c in LEAN if c[2] == 128 and not c[-1]]
# both ping-pong forms with the stages released at the turn (ring_release: per-stage mbarriers, no
# CTA barrier per tile, two stages; docs/design/sm80.md#ping-pong-warps) on the same cases, kv_first on the
# lean ones
RELEASED = dict(ring_release=True, stages=2)
CASES += [(*c[:-1], {**c[-1], **form, **RELEASED}) for form in (PINGPONG, PINGPONG16) for c in D128_BASE
          if form is PINGPONG16 or "smem_target" not in c[-1]]
LEAN += [(*c[:-1], {**c[-1], **form, **RELEASED, "kv_first": kvf}) for form in (PINGPONG, PINGPONG16)
         for kvf in (False, True) for c in LEAN if c[2] == 128 and not c[-1]]

# the query staged one load round trip per item, the form before the default q_loads_first
# (docs/design/sm80.md#the-query-loads-at-once), on the base cases (the 64-row, 128-row and D 256 forms,
# padding rows of a varlen batch) and both ping-pong forms
QLF = dict(q_loads_first=False)
CASES += [(*c[:-1], {**c[-1], **QLF}) for c in BASE]
LEAN += [(*c[:-1], {**c[-1], **form, **RELEASED, **QLF}) for form in (PINGPONG, PINGPONG16) for c in LEAN
         if c[2] == 128 and not c[-1]]

# each warp's rows out through its own staged query rows (the opt-in warp_store,
# docs/design/sm80.md#the-output-per-warp) on the base cases (64-row, 128-row and D 256 forms, every cache
# dtype and widening, the LSE, padding rows of a varlen batch) and both ping-pong forms
WS = dict(warp_store=True)
CASES += [(*c[:-1], {**c[-1], **WS}) for c in BASE]
CASES += [(*c[:-1], {**c[-1], **form, **RELEASED, **WS}) for form in (PINGPONG, PINGPONG16) for c in D128_BASE
          if form is PINGPONG16 or "smem_target" not in c[-1]]
LEAN += [(*c[:-1], {**c[-1], **form, **RELEASED, **WS}) for form in (PINGPONG, PINGPONG16) for c in LEAN
         if c[2] == 128 and not c[-1]]

# the launch bounded to one CTA per SM (one_cta_bound, the default of FP8 at D 64 on sm_103a / sm_120a /
# sm_121a; docs/design/sm80.md#the-one-cta-bound) on the base cases of every head dim
BOUND = dict(one_cta_bound=True)
CASES += [(*c[:-1], {**c[-1], **BOUND}) for c in BASE if "smem_target" not in c[-1]]


def _ids(c):
    kv, q, D, Hq, Hkv, page, lay, cont, causal, ov = c
    extra = "-".join(f"{k}{v}" for k, v in ov.items())
    return (f"{str(kv)[6:]}-{str(q)[6:]}-d{D}-h{Hq}/{Hkv}-p{page}-{lay}-{cont}-{'causal' if causal else 'full'}"
            + (f"-{extra}" if extra else ""))


def _case(gen, *, q_lens, prefixes, kv, q, D, Hq, Hkv, page, layout, container, poison_tail=True):
    """A varlen problem (request b: ``q_lens[b]`` new tokens after a cached ``prefixes[b]``), with
    non-trivial k/v scales, and its ``query_start_loc``."""
    c = make_paged_prefill_case(reqs=list(zip(prefixes, q_lens)), num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                page_size=page, kv_dtype=kv, q_dtype=q, kv_layout=layout, container=container,
                                k_scale=0.0625, v_scale=0.03125, poison_tail=poison_tail, generator=gen)
    return c, c.query_start_loc


def _check(c, qsl, causal, out, lse, seed):
    ref, ref_lse = reference.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, kv_layout=c.kv_layout,
                                           causal=causal, k_scale=c.k_scale, v_scale=c.v_scale, return_lse=True)
    check_attention(out, lse, ref, ref_lse, seed, TOL)


def _call(c, qsl, out, max_query_len, causal=True, return_lse=True, **override):
    with tuning_override(backend="sm80", **override):
        return cute_kernels.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, max_query_len=max_query_len,
                                          kv_layout=c.kv_layout, causal=causal, k_scale=c.k_scale, v_scale=c.v_scale,
                                          out=out, return_lse=return_lse)


def _run(c, qsl, causal, return_lse=True, **override):
    out = torch.full_like(c.q, float("nan"))
    return _call(c, qsl, out, int((qsl[1:] - qsl[:-1]).max()), causal, return_lse, **override)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_sm80_prefill_matches_reference(case, gen):
    kv, q, D, Hq, Hkv, page, layout, container, causal, override = case
    seed = gen.initial_seed()
    # fresh prompts, chunks against cached prefixes, an empty request, one short and one long
    q_lens = [37, 0, 1, 130, 64, 300]
    prefixes = [0, 50, 700, 33, 0, 1000]
    c, qsl = _case(gen, q_lens=q_lens, prefixes=prefixes, kv=kv, q=q, D=D, Hq=Hq, Hkv=Hkv, page=page,
                               layout=layout, container=container)
    out, lse = _run(c, qsl, causal, **override)
    _check(c, qsl, causal, out, lse, seed)


@pytest.mark.parametrize("case", LEAN, ids=[_ids(c) for c in LEAN])
def test_sm80_prefill_lean_variants_match_reference(case, gen):
    """Without the LSE (the variants whose default stages are longest): the output alone."""
    kv, q, D, Hq, Hkv, page, layout, container, causal, override = case
    seed = gen.initial_seed()
    c, qsl = _case(gen, q_lens=[37, 0, 1, 130, 64, 300], prefixes=[0, 50, 700, 33, 0, 1000], kv=kv, q=q, D=D, Hq=Hq,
                   Hkv=Hkv, page=page, layout=layout, container=container)
    out = _run(c, qsl, causal, False, **override)
    ref = reference.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, kv_layout=c.kv_layout,
                                  causal=causal, k_scale=c.k_scale, v_scale=c.v_scale)
    assert torch.isfinite(out).all(), f"seed {seed}: NaN/inf in output (unwritten or poisoned values leaked)"
    assert rel_err(out, ref) <= TOL, f"seed {seed}: relative error {rel_err(out, ref):.2e} > {TOL}"


# with the LSE the default is the 64-row CTA, without it (lean) the 128-row one on the H200
@pytest.mark.parametrize("return_lse,override", [(True, {}), (True, M2), (False, {}), (False, M1), (True, D128X),
                                                 (False, D128X), (True, D128S), (False, D128S)],
                         ids=["lse-default", "lse-rows128", "lean-default", "lean-rows64", "lse-tw64", "lean-tw64",
                              "lse-tw64s", "lean-tw64s"])
def test_sm80_prefill_long_prompt_and_graph_replay(return_lse, override, gen):
    seed = gen.initial_seed()
    c, qsl = _case(gen, q_lens=[2048, 513], prefixes=[0, 4000], kv=BF16, q=BF16, D=128, Hq=32, Hkv=8,
                               page=16, layout="HND", container="single")
    res = _run(c, qsl, True, return_lse, **override)
    eager = res[0] if return_lse else res
    if return_lse:
        _check(c, qsl, True, eager, res[1], seed)
    else:
        ref = reference.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, kv_layout=c.kv_layout,
                                      k_scale=c.k_scale, v_scale=c.v_scale)
        assert torch.isfinite(eager).all() and rel_err(eager, ref) <= TOL, f"seed {seed}"
    out = torch.empty_like(c.q)
    graph = capture_graph(lambda: _call(c, qsl, out, 2048, True, return_lse, **override))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), f"seed {seed}: replay differs from eager"


def test_sm90_sends_what_its_kernel_refuses_to_the_portable_one(gen):
    """Without an override: an fp16 cache with a bf16 query (which the SM90 prefill kernel refuses)
    runs sm80.prefill on SM90; on every other arch every 16-bit-query prefill does."""
    from cute_kernels.ops._torch import compile_target
    from cute_kernels.ops.paged_prefill import prefill_kernel

    seed = gen.initial_seed()
    assert prefill_kernel(compile_target(torch.device("cuda")), "bf16", "fp16", 4).id == "sm80.prefill"
    c, qsl = _case(gen, q_lens=[37, 0, 130], prefixes=[0, 50, 33], kv=FP16, q=BF16, D=128, Hq=16, Hkv=4,
                               page=16, layout="HND", container="single")
    out = torch.full_like(c.q, float("nan"))
    out, lse = cute_kernels.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, k_scale=c.k_scale,
                                          v_scale=c.v_scale, out=out, return_lse=True)
    _check(c, qsl, True, out, lse, seed)


@pytest.mark.parametrize("override", [{}, M2, D128X, D128S], ids=["default", "rows128", "tw64", "tw64s"])
@pytest.mark.parametrize("causal", [True, False])
def test_sm80_prefill_lengths_past_the_block_table(causal, override, gen):
    """Lengths beyond the table's capacity (2^31 - 1 too): positions at or past it are not attended,
    as in the reference (docs/design/inputs.md#lengths)."""
    seed = gen.initial_seed()
    c, qsl = _case(gen, q_lens=[37, 5, 20], prefixes=[0, 50, 100], kv=BF16, q=BF16, D=128, Hq=16, Hkv=4, page=16,
                   layout="HND", container="single", poison_tail=False)  # longer lengths: every tail visible
    W = c.block_table.shape[1]
    c.seq_lens.copy_(torch.tensor([W * 16 + 7, 2**31 - 1, 120], dtype=torch.int32, device="cuda"))
    out, lse = _run(c, qsl, causal, **override)
    _check(c, qsl, causal, out, lse, seed)


@pytest.mark.parametrize("override", [{}, {"heads_first": False}, M1], ids=["default", "rows-first", "rows64"])
def test_sm80_prefill_many_requests_in_an_oversized_grid(override, gen):
    """33 requests of random lengths (empty ones too) over three KV heads with ``max_query_len``
    far past every q_len: each CTA maps to one (row tile, KV head, request), and the row tiles past
    a request's rows write nothing (docs/design/sm80.md#the-grid-order)."""
    seed = gen.initial_seed()
    q_lens = torch.randint(0, 90, (33,), generator=gen, device=gen.device).tolist()
    q_lens[5] = q_lens[17] = 0
    prefixes = torch.randint(0, 300, (33,), generator=gen, device=gen.device).tolist()
    c, qsl = _case(gen, q_lens=q_lens, prefixes=prefixes, kv=BF16, q=BF16, D=128, Hq=24, Hkv=3, page=16,
                   layout="HND", container="single")
    out = torch.full_like(c.q, float("nan"))
    out, lse = _call(c, qsl, out, 4 * sum(q_lens), True, True, **override)
    _check(c, qsl, True, out, lse, seed)


def test_sm80_prefill_max_query_len_past_the_heads_first_grid(gen):
    """A ``max_query_len`` whose row tiles exceed the heads-first grid's y extent (65535): the op
    launches the grid with the row tiles first instead. 1100 requests of 238-240 tokens, GQA 16,
    64-row CTAs, ``max_query_len`` left to T (over 262,140 rows: over 65,535 row tiles); checked
    against the reference on a sample of the requests (each request is independent)."""
    from cute_kernels.plans.sm80 import prefill_heads_first_max_q

    seed = gen.initial_seed()
    B = 1100
    q_lens = (240 - torch.randint(0, 3, (B,), generator=gen, device=gen.device)).tolist()
    assert sum(q_lens) > prefill_heads_first_max_q(16, 64)
    c, qsl = _case(gen, q_lens=q_lens, prefixes=[0] * B, kv=BF16, q=BF16, D=64, Hq=16, Hkv=1, page=16,
                   layout="HND", container="single", poison_tail=False)
    out = torch.full_like(c.q, float("nan"))
    with tuning_override(backend="sm80", m_tiles=1, heads_first=True):
        out = cute_kernels.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, kv_layout=c.kv_layout,
                                         k_scale=c.k_scale, v_scale=c.v_scale, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"seed {seed}: rows left unwritten"
    for b in (0, 1, 547, B - 2, B - 1):
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        sub_qsl = torch.tensor([0, hi - lo], dtype=torch.int32, device="cuda")
        ref = reference.paged_prefill(c.q[lo:hi], c.kv_cache, c.block_table[b:b + 1], c.seq_lens[b:b + 1], sub_qsl,
                                      kv_layout=c.kv_layout, k_scale=c.k_scale, v_scale=c.v_scale)
        assert rel_err(out[lo:hi], ref) <= TOL, f"seed {seed}: request {b}: {rel_err(out[lo:hi], ref):.2e}"
