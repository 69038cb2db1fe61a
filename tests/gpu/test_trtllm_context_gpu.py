"""``cute_kernels.trtllm.batch_context_with_kv_cache`` on the H200: the SM90 prefill (its window /
sink variants) against the reference; windows across pages, inside a request's new tokens and
after a cached prefix; sinks; pages outside every window never read; an FP8 query; every window /
sink family's self-check cases on real kernels; FlashInfer's own
trtllm context call where it runs (trtllm-gen: SM100 only, skipped here with its reason).

Tolerance: ‖out − ref‖/‖ref‖ ≤ 1e-2 (16-bit and FP8-widened: one rounding of P and of O; the FP8
query rounds P to e4m3: 5e-2) against the fp32 reference; outputs poisoned with NaN before the call.
"""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference, trtllm
from cute_kernels.ops import _selfcheck
from cute_kernels.ops import paged_prefill as prefill_op
from cute_kernels.plans import selfcheck_records as records
from cute_kernels.plans.sm90_prefill import config_family, feature_variants
from cute_kernels.testing import check_attention, make_paged_prefill_case, rel_err

from .conftest import sm90_only

pytestmark = sm90_only()
FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
REQS = [(0, 300), (1000, 77), (0, 0), (333, 129), (5, 1)]


def _case(gen, kv=BF16, q=BF16, D=128, Hq=16, Hkv=4, page=16, reqs=REQS, layout="HND", container="single"):
    return make_paged_prefill_case(reqs=reqs, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                                   kv_dtype=kv, q_dtype=q, kv_layout=layout, container=container,
                                   k_scale=0.5 if kv == FP8 else 1.0, v_scale=0.25 if kv == FP8 else 1.0,
                                   generator=gen)


def _call(case, *, q=None, window_left=-1, sinks=None, q_scale=1.0, out_dtype=None, kv_cache=None, table=None,
          causal=True):
    q = case.q if q is None else q
    bmm1 = case.meta["head_dim"] ** -0.5 * case.k_scale * q_scale
    B = case.block_table.shape[0]
    kv_starts = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    kv_starts[1:] = case.seq_lens.cumsum(0)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype or (BF16 if q.dtype == FP8 else q.dtype), device="cuda")
    return trtllm.batch_context_with_kv_cache(
        q, case.kv_cache if kv_cache is None else kv_cache, torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"),
        case.block_table if table is None else table, case.seq_lens.to(torch.uint32), case.max_query_len,
        int(case.seq_lens.max()), bmm1, case.v_scale, B, case.query_start_loc, kv_starts, window_left=window_left,
        out=out, out_dtype=out.dtype, sinks=sinks, kv_layout=case.kv_layout, causal=causal, return_lse=True)


def _reference(case, *, q=None, q_scale=None, window_left=-1, sinks=None, causal=True):
    return reference.paged_prefill(case.q if q is None else q, case.kv_cache, case.block_table, case.seq_lens,
                                   case.query_start_loc, kv_layout=case.kv_layout, causal=causal, q_scale=q_scale,
                                   k_scale=case.k_scale, v_scale=case.v_scale, window_left=window_left, sinks=sinks,
                                   return_lse=True)


def _check(got, want, tol, lse_rtol=1e-4):
    check_attention(*got, *want, tol=tol, lse_atol=5e-3 if tol > 1e-2 else 2e-3, lse_rtol=lse_rtol)


# (kv, q, D, Hq, Hkv, page, layout, container, window_left, sinks)
CASES = [
    (BF16, BF16, 128, 16, 4, 16, "HND", "single", -1, True),
    (BF16, BF16, 128, 16, 4, 16, "HND", "single", 100, False),
    (BF16, BF16, 128, 16, 4, 16, "HND", "single", 100, True),
    (BF16, BF16, 64, 8, 8, 32, "NHD", "tuple", 0, True),
    (FP16, FP16, 256, 8, 2, 64, "HND", "single", 1000, True),
    (FP8, BF16, 128, 32, 8, 16, "HND", "single", 37, True),
    (FP8, BF16, 256, 16, 4, 128, "NHD", "single", 511, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_context_matches_reference(case, gen):
    kv, q, D, Hq, Hkv, page, layout, container, window, with_sinks = case
    c = _case(gen, kv=kv, q=q, D=D, Hq=Hq, Hkv=Hkv, page=page, layout=layout, container=container)
    sinks = torch.randn(Hq, device="cuda", generator=gen) * 2 if with_sinks else None
    _check(_call(c, window_left=window, sinks=sinks), _reference(c, window_left=window, sinks=sinks), 1e-2)


def test_fp8_query(gen):
    c = _case(gen, kv=FP8)
    q8 = cute_kernels.quantize_query(c.q, 0.05)
    sinks = torch.randn(16, device="cuda", generator=gen)
    for dt in (BF16, FP16):
        got = _call(c, q=q8, q_scale=0.05, window_left=200, sinks=sinks, out_dtype=dt)
        assert got[0].dtype == dt
        # SM90's FP8 MMA accumulates QK in fewer bits than fp32: the LSE error grows with the logits
        _check(got, _reference(c, q=q8, q_scale=0.05, window_left=200, sinks=sinks), 5e-2, lse_rtol=4e-3)


def test_pages_outside_every_window_are_never_read(gen):
    """Pages wholly before each request's first row's window start are NaN or freed (invalid ids):
    the kernel walks only the tiles and boxes of the window."""
    page, w = 16, 60
    c = _case(gen, kv=BF16, page=page)
    clean = c.kv_cache.clone()
    kv, table = c.kv_cache, c.block_table.clone()
    for b, ((_prefix, n), L) in enumerate(zip(REQS, c.seq_lens.tolist())):
        for p in range(max(0, L - n - w) // page):
            kv[int(c.block_table[b, p])].fill_(float("nan"))
            if p % 3 == 0:
                table[b, p] = -1 if p % 2 else 1 << 30
    sinks = torch.randn(16, device="cuda", generator=gen)
    want = reference.paged_prefill(c.q, clean, c.block_table, c.seq_lens, c.query_start_loc, k_scale=c.k_scale,
                                   v_scale=c.v_scale, window_left=w, sinks=sinks, return_lse=True)
    _check(_call(c, window_left=w, sinks=sinks, table=table), want, 1e-2)


@pytest.mark.parametrize("cfg", feature_variants(), ids=config_family)
def test_every_feature_family_passes_its_self_check(cfg, tmp_path, monkeypatch):
    """The runtime self-check's cases of each window / sink family, run now on real kernels (the op
    no longer runs them: the variants are available)."""
    monkeypatch.setattr(records, "records_path", lambda: tmp_path / "selfcheck.json")
    cases = prefill_op.self_check_cases(cfg, "cuda")
    assert len(cases) == 2
    rec = _selfcheck.run_check(config_family(cfg), "cuda", cases)
    assert rec.ok, rec.reason


def test_against_flashinfer_trtllm_context(gen):
    """FlashInfer's trtllm context call runs trtllm-gen cubins (SM100/SM103): on this SM90 GPU there
    is nothing to compare with (the decode test compares with XQA)."""
    fi = pytest.importorskip("flashinfer.prefill")
    if torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("FlashInfer's trtllm_batch_context_with_kv_cache needs SM100/SM103 (trtllm-gen)")
    c = _case(gen)
    sinks = torch.randn(16, device="cuda", generator=gen)
    ours = _call(c, window_left=127, sinks=sinks)
    bmm1 = c.meta["head_dim"] ** -0.5
    B = c.block_table.shape[0]
    kv_starts = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    kv_starts[1:] = c.seq_lens.cumsum(0)
    theirs = fi.trtllm_batch_context_with_kv_cache(
        c.q, c.kv_cache, torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), c.block_table, c.seq_lens,
        c.max_query_len, int(c.seq_lens.max()), bmm1, 1.0, B, c.query_start_loc, kv_starts, window_left=127,
        sinks=sinks)
    ref = _reference(c, window_left=127, sinks=sinks)[0]
    print(f"\nours {rel_err(ours[0], ref):.2e}, FlashInfer trtllm context {rel_err(theirs, ref):.2e}")
    assert rel_err(ours[0], ref) <= 1e-2
