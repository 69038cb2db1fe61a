"""SM90 paged prefill (``cute_kernels.paged_prefill``) against the reference, on the H200.

Two tiers, both on a handful of compiled variants (compiled in parallel before the tests):
- CASES: each value of every axis at least once (cache dtype x query path x head dim x GQA x page
  x layout x container x causal x scale kinds), each on a varlen batch with q_len 0, 1 and up to
  4096 on cached prefixes up to 32k, a permuted block table with -1 and out-of-range pages,
  poisoned cache tails and a NaN-poisoned output, LSE checked;
- RANDOM: ``CUTE_KERNELS_PREFILL_RANDOM`` (default 50) random batches per variant of VARIANTS
  (200 by default): lengths, prefixes at and around page boundaries, invalid pages, seq_lens past
  the block table, fused-QKV query views, scale values, max_query_len given or not.

Every case's seed is ``zlib.crc32`` of its id and is printed by the assertion that fails, so
``-k <id>`` replays it. Tolerances, against the fp32 reference on the same (dequantized) inputs:
16-bit query path ‖out − ref‖/‖ref‖ ≤ 1e-2 and elementwise ≤ 1e-2 abs + 1e-2 rel, LSE within
2e-3 (abs + rel); FP8-query path (e4m3 Q, K, V and P) ‖out − ref‖/‖ref‖ ≤ 3e-2, LSE within 5e-2.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.plans.sm90_prefill import make_prefill_config
from cute_kernels.testing import make_paged_prefill_case, rel_err

from .conftest import sm90_only

pytestmark = [sm90_only(), pytest.mark.usefixtures("prefill_kernel_only")]
FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
NAMES = {FP8: "fp8_e4m3", BF16: "bf16", FP16: "fp16"}
RANDOM_PER_VARIANT = int(os.environ.get("CUTE_KERNELS_PREFILL_RANDOM", "50"))
DEVICE = "cuda"


# kv, model (16-bit query, or the output of an FP8 query), FP8 query, D, Hq, Hkv, page, layout, container,
# causal, q_scale kind ("scalar" / "tensor" / "per_head" for an FP8 query)
CASES = [
    (BF16, BF16, False, 128, 32, 8, 16, "HND", "single", True, None),
    (BF16, BF16, False, 64, 16, 16, 32, "NHD", "tuple", False, None),
    (BF16, BF16, False, 256, 16, 4, 64, "HND", "single", True, None),
    (FP16, FP16, False, 128, 24, 4, 128, "NHD", "single", True, None),
    (FP16, FP16, False, 64, 16, 1, 16, "HND", "tuple", False, None),
    (FP8, BF16, False, 128, 32, 8, 16, "HND", "single", True, None),
    (FP8, BF16, False, 256, 16, 2, 32, "NHD", "tuple", True, None),
    (FP8, FP16, False, 64, 32, 2, 128, "HND", "single", False, None),
    (FP8, BF16, True, 128, 32, 8, 16, "HND", "single", True, "scalar"),
    (FP8, BF16, True, 64, 24, 4, 64, "NHD", "tuple", True, "per_head"),
    (FP8, FP16, True, 256, 8, 8, 16, "HND", "single", False, "tensor"),
]

# the random tier's variants: a few compiled configs, many batches each
VARIANTS = {
    "bf16-d128-g4-p16": (BF16, BF16, False, 128, 16, 4, 16, "HND", "single", True, None),
    "fp8-d128-g8-p32-nhd-tuple": (FP8, BF16, False, 128, 32, 4, 32, "NHD", "tuple", True, None),
    "fp8q-d128-g8-p16": (FP8, BF16, True, 128, 32, 4, 16, "HND", "single", True, "scalar"),
    "fp16-d64-g6-p64-noncausal": (FP16, FP16, False, 64, 12, 2, 64, "HND", "single", False, None),
}


def _case_id(c):
    kv, model, fp8q, D, Hq, Hkv, page, layout, cont, causal, qs = c
    path = f"fp8q-{qs}" if fp8q else "16q"
    return f"{NAMES[kv]}-{NAMES[model]}-{path}-d{D}-h{Hq}/{Hkv}-p{page}-{layout}-{cont}-{'causal' if causal else 'full'}"


def _seed(case_id: str) -> int:
    return zlib.crc32(case_id.encode())


def _configs(c, write_lse=(True,), scale_tensors=(False,)):
    kv, model, fp8q, D, Hq, Hkv, page, layout, cont, causal, qs = c
    return [make_prefill_config(q_dtype="fp8_e4m3" if fp8q else NAMES[model], kv_dtype=NAMES[kv],
                                out_dtype=NAMES[model], head_dim=D, group=Hq // Hkv, page_size=page,
                                kv_form="pair" if cont == "tuple" else "single", kv_layout=layout, causal=causal,
                                write_lse=w, k_scale_tensor=st, v_scale_tensor=st, q_scale=qs)
            for w in write_lse for st in scale_tensors]


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every variant the module hits, in parallel processes, before the tests run."""
    from cute_kernels.jit.parallel import precompile

    configs = [cfg for c in CASES for cfg in _configs(c)]
    configs += [cfg for c in VARIANTS.values() for cfg in _configs(c)]
    graph = VARIANTS["fp8-d128-g8-p32-nhd-tuple"]
    configs += _configs(graph, write_lse=(False,), scale_tensors=(True,))
    configs += _configs(CASES[0], write_lse=(False,))
    try:
        precompile(list(dict.fromkeys(configs)), "sm_90a", progress=False)
    except Exception as e:  # a variant that does not compile fails its own tests, not every test here
        print(f"precompile: {type(e).__name__}: {e}")


# ----------------------------------------------------------------------------------------------
# running and checking one problem
# ----------------------------------------------------------------------------------------------


def _make(c, reqs, g, **kw):
    kv, model, fp8q, D, Hq, Hkv, page, layout, cont, causal, qs = c
    scales = dict(k_scale=0.05, v_scale=0.03) if kv == FP8 else {}
    return make_paged_prefill_case(reqs=reqs, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                                   kv_dtype=kv, q_dtype=model, kv_layout=layout, container=cont, generator=g,
                                   device=DEVICE, **scales, **kw)


def _query(c, case, g):
    """``(q, q_scale)`` the op takes: the case's query, or its FP8 quantization."""
    kv, model, fp8q, D, Hq, Hkv, page, layout, cont, causal, qs = c
    if not fp8q:
        return case.q, None
    amax = case.q.float().abs().amax(dim=(0, 2)).view(Hkv, Hq // Hkv).amax(dim=1).clamp_min(1e-3) / 448
    q_scale = {"scalar": float(amax.max()), "tensor": amax.max().view(1), "per_head": amax.contiguous()}[qs]
    return cute_kernels.quantize_query(case.q, q_scale), q_scale


def _run_and_check(c, case, g, seed, *, max_query_len=None, return_lse=True):
    kv, model, fp8q, D, Hq, Hkv, page, layout, cont, causal, qs = c
    q, q_scale = _query(c, case, g)
    out = torch.full(case.q.shape, float("nan"), dtype=model, device=DEVICE)
    res = cute_kernels.paged_prefill(q, case.kv_cache, case.block_table, case.seq_lens, case.query_start_loc,
                                     max_query_len=max_query_len, causal=causal, q_scale=q_scale, out=out,
                                     return_lse=return_lse, **case.kwargs())
    out, lse = res if return_lse else (res, None)
    ref, ref_lse = reference.paged_prefill(q, case.kv_cache, case.block_table, case.seq_lens, case.query_start_loc,
                                           causal=causal, q_scale=q_scale, return_lse=True, out_dtype=model,
                                           **case.kwargs())
    info = f"seed {seed}, requests (prefix, q_len) {case.reqs}"
    assert torch.isfinite(out).all(), f"NaN/inf in the output (unwritten or poisoned values leaked); {info}"
    err = rel_err(out, ref)
    if fp8q:
        assert err <= 3e-2, f"relative error {err:.2e} > 3e-2; {info}"
    else:
        assert err <= 1e-2, f"relative error {err:.2e} > 1e-2; {info}"
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2, msg=lambda m: f"{m}\n{info}")
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all(), f"rows without KV are not 0; {info}"
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), empty), f"LSE -inf pattern differs; {info}"
        tol = 5e-2 if fp8q else 2e-3
        torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=tol, rtol=tol, msg=lambda m: f"{m}\n{info}")
    return out, lse, err


def _reqs(rng: random.Random, page: int, *, long: bool):
    """A varlen batch: q_len 0 and 1, a page-aligned prefix, a prefix ending one past a page, and
    (``long``) a 4096-token chunk on a 32k prefix and a 2048-token prompt."""
    reqs = [(0, rng.randint(2, 300)), (rng.randint(1, 40) * page, 1), (rng.randint(0, 500), 0),
            (page * rng.randint(1, 8) + 1, rng.randint(100, 700)), (rng.randint(0, 3000), rng.randint(1, 129))]
    if long:
        reqs += [(32768 - 4096, 4096), (0, 2048)]
    rng.shuffle(reqs)
    return reqs


# ----------------------------------------------------------------------------------------------
# the compact tier
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", CASES, ids=[_case_id(c) for c in CASES])
def test_prefill_matches_reference(c):
    cid = _case_id(c)
    seed = _seed(cid)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rng = random.Random(seed)
    long = c in (CASES[0], CASES[5], CASES[8])  # the 32k-context rows on the three main paths
    case = _make(c, _reqs(rng, c[6], long=long), g, invalid_pages=2)
    _run_and_check(c, case, g, seed)


def test_prefill_without_lse_and_with_max_query_len():
    """The variant compiled without an LSE argument writes the same output; a max_query_len that
    bounds the batch sizes the grid to it and changes nothing."""
    c = CASES[0]
    seed = _seed("no-lse")
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    case = _make(c, [(0, 300), (77, 5), (16, 0), (1000, 129)], g)
    out, _, _ = _run_and_check(c, case, g, seed, return_lse=False)
    out2, _, _ = _run_and_check(c, case, g, seed, max_query_len=case.max_query_len)
    assert torch.equal(out, out2)


def test_cuda_graph_replay_equals_eager_and_follows_live_scales():
    c = VARIANTS["fp8-d128-g8-p32-nhd-tuple"]
    seed = _seed("graph")
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    case = _make(c, [(0, 700), (33, 1), (5000, 300), (64, 0)], g)
    ks, vs = torch.tensor([0.05], device=DEVICE), torch.tensor(0.03, device=DEVICE)  # [1] and 0-d
    case.k_scale, case.v_scale = ks, vs
    args = (case.q, case.kv_cache, case.block_table, case.seq_lens, case.query_start_loc)
    kw = dict(causal=c[9], max_query_len=case.max_query_len, **case.kwargs())
    eager = cute_kernels.paged_prefill(*args, **kw)
    ref = reference.paged_prefill(*args, causal=c[9], **case.kwargs())
    assert rel_err(eager, ref) <= 1e-2, f"the eager call itself; seed {seed}"
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream (module load)
        cute_kernels.paged_prefill(*args, out=out, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_kernels.paged_prefill(*args, out=out, **kw)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), f"graph replay differs from the eager call; seed {seed}"
    ks.fill_(0.1)  # the scales live on the device: a replay reads the new values
    vs.fill_(0.01)
    case.q.copy_(torch.randn(case.q.shape, device=DEVICE, generator=g).to(case.q.dtype))
    graph.replay()
    ref = reference.paged_prefill(*args, causal=c[9], **case.kwargs())
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= 1e-2, f"replay with new scales and query; seed {seed}"


# ----------------------------------------------------------------------------------------------
# the random tier
# ----------------------------------------------------------------------------------------------


def _random_problem(name, i):
    c = VARIANTS[name]
    page = c[6]
    seed = _seed(f"{name}-{i}")
    rng = random.Random(seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    reqs = []
    for _ in range(rng.randint(1, 8)):
        prefix = rng.choice([0, 0, rng.randint(0, 4096), page * rng.randint(1, 64), page * rng.randint(1, 64) - 1,
                             page * rng.randint(1, 64) + 1])
        q_len = rng.choice([0, 1, 1, rng.randint(2, 64), rng.randint(64, 600), 128, 129, 127])
        reqs.append((max(prefix, 0), q_len))
    invalid, fused = rng.choice([0, 0, 1, 3]), rng.random() < 0.3
    past = rng.random() < 0.15  # a seq_len past the block table: masked past it, the stale tails visible
    case = _make(c, reqs, g, invalid_pages=invalid, fused_qkv=fused, poison_tail=not past)
    if past and case.seq_lens.numel():
        b = rng.randrange(case.seq_lens.numel())
        case.seq_lens[b] += case.block_table.shape[1] * page * rng.choice([1, 1000])
    if c[0] == FP8:
        case.k_scale, case.v_scale = rng.uniform(0.01, 0.1), rng.uniform(0.01, 0.1)
    mql = case.max_query_len if rng.random() < 0.5 else None
    return c, case, g, seed, mql


@pytest.mark.parametrize("i", range(RANDOM_PER_VARIANT))
@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_random(name, i):
    c, case, g, seed, mql = _random_problem(name, i)
    _run_and_check(c, case, g, seed, max_query_len=mql)


# ----------------------------------------------------------------------------------------------
# the runtime self-check's cases (they guard the kernel whenever the registry lists it compile-verified)
# ----------------------------------------------------------------------------------------------


def _registered_variants():
    from cute_kernels.plans import sm90_prefill as plan
    from cute_kernels.registry import KERNELS

    kids = ("sm90.prefill", "sm90.prefill_fp8q", plan.PERSISTENT_ID, plan.EPILOGUE_ID)
    # the shared-memory epilogue also takes a window and sinks (no compiled variant has them both)
    both = make_prefill_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=4, page_size=16,
                               epilogue="smem", window=True, sinks=True)
    return [c for kid in kids for c in KERNELS[kid].variants()] + [both]


@pytest.mark.parametrize("config", _registered_variants(), ids=lambda c: c.label())
def test_self_check_passes_for_every_registered_variant(config):
    """The op's own self-check problems, run now (not the process's cached outcome) on each
    registered variant, the persistent schedule's (a full wave and 3 CTAs) and the shared-memory
    epilogue's too: what guards the kernel on a machine must pass on the H200."""
    from cute_kernels.ops import _selfcheck
    from cute_kernels.ops import paged_prefill as op
    from cute_kernels.plans.sm90_prefill import config_family

    cases = op.self_check_cases(config, torch.device(DEVICE))
    assert len(cases) == (4 if config.persistent else 2)
    rec = _selfcheck.run_check(config_family(config), torch.device(DEVICE), cases)
    assert rec.ok, rec.reason
