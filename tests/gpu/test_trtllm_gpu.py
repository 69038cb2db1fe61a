"""``cute_kernels.trtllm`` on the H200: the API against the reference and against FlashInfer's own
``trtllm_batch_decode_with_kv_cache`` (XQA on SM90) on the same inputs; sliding windows across
page boundaries, inside a split and inside the speculative draft; sinks; pages outside the window
never read; the caller's workspace the only scratch; CUDA-graph replays; the window / sink
families' runtime self-check cases; a 4096-token window at least 6x faster than a 32768-token context.

Tolerance: ‖out − ref‖/‖ref‖ ≤ 5e-3 against the fp32 reference on the same cache values (the
decode op's contract, output rounding included); LSE within 2e-3. Every output is poisoned with
NaN before the call; the seed of each test is its node id (conftest ``gen``): a failure replays.
"""

from __future__ import annotations

import math

import pytest
import torch

import cute_kernels
from cute_kernels import reference, trtllm
from cute_kernels.bench.timing import time_graph
from cute_kernels.ops import _caller_workspace as caller_ws
from cute_kernels.ops import _decode_features as features
from cute_kernels.ops import _selfcheck
from cute_kernels.ops import paged_decode as decode_op
from cute_kernels.plans import selfcheck_records as records
from cute_kernels.plans.sm90_decode import feature_family, feature_variants
from cute_kernels.testing import check_attention, make_paged_decode_case, rel_err

from .conftest import sm90_only

pytestmark = sm90_only()
FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
TOL = 5e-3
WS_BYTES = 64 << 20


def _workspace():
    return torch.zeros(WS_BYTES, dtype=torch.uint8, device="cuda")


def _case(gen, *, kv=BF16, q=BF16, D=128, Hq=32, Hkv=8, page=16, q_len=1, lens=(700, 33, 1500, 16, 5),
          layout="HND", container="single", poison_tail=True):
    return make_paged_decode_case(batch=len(lens), num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                                  seq_lens=list(lens), kv_dtype=kv, q_dtype=q, q_len=q_len, kv_layout=layout,
                                  container=container, k_scale=0.5 if kv == FP8 else 1.0,
                                  v_scale=0.25 if kv == FP8 else 1.0, poison_tail=poison_tail, generator=gen)


def _scales(case):
    """FlashInfer's fused scales of a case: bmm1 = sm_scale x k_scale (x q_scale), bmm2 = v_scale."""
    return case.meta["head_dim"] ** -0.5 * case.k_scale, case.v_scale


def _reference(case, *, window_left=-1, sinks=None, kv_cache=None):
    bmm1, bmm2 = _scales(case)
    return reference.paged_decode(case.q, case.kv_cache if kv_cache is None else kv_cache, case.block_table,
                                  case.seq_lens, kv_layout=case.kv_layout, q_len_per_req=case.q_len, sm_scale=bmm1,
                                  v_scale=bmm2, window_left=window_left, sinks=sinks, return_lse=True)


def _api(case, ws, *, window_left=-1, sinks=None, seq_lens=None, kv_cache=None, **kw):
    bmm1, bmm2 = _scales(case)
    out = torch.full_like(case.q, float("nan"))
    return trtllm.batch_decode_with_kv_cache(
        case.q, case.kv_cache if kv_cache is None else kv_cache, ws, case.block_table,
        case.seq_lens if seq_lens is None else seq_lens, int(case.seq_lens.max()), bmm1_scale=bmm1,
        bmm2_scale=bmm2, window_left=window_left, out=out, sinks=sinks, kv_layout=case.kv_layout,
        q_len_per_req=case.q_len, return_lse=True, **kw)


def _check(out, lse, ref, ref_lse):
    check_attention(out, lse, ref, ref_lse, tol=TOL)


# (kv, q, D, Hq, Hkv, page, q_len, layout, container, window_left, sinks)
CASES = [
    (BF16, BF16, 128, 32, 8, 16, 1, "HND", "single", -1, True),
    (BF16, BF16, 128, 32, 8, 16, 1, "HND", "single", 100, False),
    (BF16, BF16, 128, 32, 8, 16, 1, "HND", "single", 100, True),
    (FP8, BF16, 128, 32, 8, 16, 1, "HND", "single", 37, True),
    (FP8, BF16, 128, 32, 4, 32, 1, "NHD", "tuple", 511, True),
    (FP8, BF16, 64, 8, 2, 64, 4, "HND", "single", 2, True),  # a window inside the draft
    (FP8, BF16, 256, 16, 4, 16, 2, "HND", "single", 64, False),
    (FP8, FP16, 128, 16, 2, 16, 3, "NHD", "single", 0, True),
    (FP16, FP16, 128, 32, 8, 16, 1, "HND", "single", 16, True),  # a window of exactly one page
    (BF16, BF16, 64, 32, 8, 128, 4, "HND", "tuple", 200, True),
]


def _ids(c):
    kv, q, D, Hq, Hkv, page, ql, lay, cont, w, s = c
    return f"{str(kv)[6:]}-{str(q)[6:]}-d{D}-h{Hq}/{Hkv}-p{page}-q{ql}-{lay}-{cont}-w{w}-{'sinks' if s else 'nosinks'}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_api_matches_reference(case, gen):
    kv, q, D, Hq, Hkv, page, q_len, layout, container, window, with_sinks = case
    c = _case(gen, kv=kv, q=q, D=D, Hq=Hq, Hkv=Hkv, page=page, q_len=q_len, layout=layout, container=container)
    sinks = torch.randn(Hq, device="cuda", generator=gen) * 2 if with_sinks else None
    ws = _workspace()
    out, lse = _api(c, ws, window_left=window, sinks=sinks, seq_lens=c.seq_lens.to(torch.uint32))
    _check(out, lse, *_reference(c, window_left=window, sinks=sinks))


@pytest.mark.parametrize("splits", [2, 3, 7, 11, 20])
@pytest.mark.parametrize("window", [-1, 90, 700])
def test_window_and_sinks_inside_a_split(splits, window, gen):
    """Splits that start inside the window, splits left with no tile (the window is shorter than
    the context), the sink in split 0 only; cluster (<= 16 splits) and global merges."""
    c = _case(gen, kv=FP8, lens=(3000, 700, 64, 1))
    sinks = torch.randn(32, device="cuda", generator=gen)
    bmm1, bmm2 = _scales(c)
    for cluster in (True, False):
        with decode_op.tuning_override(cluster=cluster):
            out = torch.full_like(c.q, float("nan"))
            out, lse = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, sm_scale=bmm1,
                                                 v_scale=bmm2, window_left=window, sinks=sinks, num_splits=splits,
                                                 return_lse=True, workspace=_workspace())
        _check(out, lse, *_reference(c, window_left=window, sinks=sinks))


def test_pages_outside_the_window_are_never_read(gen):
    """Every page wholly before the oldest draft row's window start is NaN (K and V) or has an
    invalid id in the block table, as a serving engine that freed it leaves it: a kernel that
    loaded and masked them would turn 0 x NaN into NaN. The reference reads the clean cache."""
    page, q_len, w = 16, 2, 45
    c = _case(gen, kv=BF16, page=page, q_len=q_len, lens=(1000, 333, 47, 200))
    clean = c.kv_cache.clone()
    poisoned, table = c.kv_cache, c.block_table.clone()
    for b, L in enumerate(c.seq_lens.tolist()):
        key_lo = max(0, L - q_len - w)
        for p in range(key_lo // page):  # (p + 1) * page <= key_lo: wholly before the window
            poisoned[int(c.block_table[b, p])].fill_(float("nan"))
            if p % 3 == 0:
                table[b, p] = -7 if p % 2 else 1 << 30  # freed: an invalid id
    sinks = torch.randn(32, device="cuda", generator=gen)
    ws = _workspace()
    for splits in (None, 3):
        bmm1, bmm2 = _scales(c)
        out = torch.full_like(c.q, float("nan"))
        out, lse = cute_kernels.paged_decode(c.q, poisoned, table, c.seq_lens, out=out, q_len_per_req=q_len,
                                             sm_scale=bmm1, v_scale=bmm2, window_left=w, sinks=sinks,
                                             num_splits=splits, return_lse=True, workspace=ws)
        _check(out, lse, *_reference(c, window_left=w, sinks=sinks, kv_cache=clean))


def test_caller_workspace_is_the_only_scratch(gen):
    """Split partials, LSE scratch and counters live in the caller's buffer: the op's own buffers
    neither appear nor grow, nothing past the bytes a call needs is written, and the counters are
    zero again after every call (as FlashInfer asks of its workspace)."""
    def own_buffers():
        return {name: {k: (v.data_ptr(), v.numel()) for k, v in buf.buffers.items()}
                for name, buf in (("fp32", decode_op._workspace), ("counters", decode_op._counters))}

    c = _case(gen, kv=FP8, lens=(4000, 2000))
    before = own_buffers()
    ws = torch.full((WS_BYTES,), 0x5A, dtype=torch.uint8, device="cuda")
    T, Hq, D = c.q.shape
    splits = 11  # > 16 would not fit a cluster; 11 with cluster off: the global merge and its counters
    with decode_op.tuning_override(cluster=False):
        bmm1, bmm2 = _scales(c)
        for _ in range(3):
            out = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, sm_scale=bmm1, v_scale=bmm2,
                                            num_splits=splits, workspace=ws)
    counters = 2 * 8  # one arrival counter per (request, KV head)
    need = caller_ws.required_bytes(splits * T * Hq * (D + 1) + T * Hq, counters)
    assert torch.all(ws[need:] == 0x5A), "bytes past the call's workspace were written"
    assert torch.all(ws[: 4 * counters].view(torch.int32) == 0), "merge counters not reset"
    assert own_buffers() == before
    ref, _ = _reference(c)
    assert rel_err(out, ref) <= TOL
    with pytest.raises(ValueError, match="workspace_buffer holds 1024 bytes"):
        trtllm.batch_decode_with_kv_cache(c.q, c.kv_cache, torch.zeros(1024, dtype=torch.uint8, device="cuda"),
                                          c.block_table, c.seq_lens, 4000, bmm1_scale=bmm1)


def test_graph_replay_reads_tensor_scales_and_lengths(gen):
    """A captured API call replays with new bmm scales and lengths (both read on the device)."""
    c = _case(gen, kv=FP8, lens=(1200, 1200, 600))  # the replay's lengths stay within these (tails poisoned)
    sinks = torch.randn(32, device="cuda", generator=gen)
    ws = _workspace()
    bmm1 = torch.tensor(_scales(c)[0], device="cuda")
    bmm2 = torch.tensor(_scales(c)[1], device="cuda").view(())
    out = torch.empty_like(c.q)
    lens = c.seq_lens.clone()

    def call():
        return trtllm.batch_decode_with_kv_cache(c.q, c.kv_cache, ws, c.block_table, lens, 2000, bmm1_scale=bmm1,
                                                 bmm2_scale=bmm2, window_left=128, out=out, sinks=sinks)

    call()  # compiles and self-checks outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    bmm1.mul_(0.5)
    bmm2.mul_(2.0)
    lens.copy_(torch.tensor([1000, 7, 512], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = reference.paged_decode(c.q, c.kv_cache, c.block_table, lens, sm_scale=float(bmm1), v_scale=float(bmm2),
                                    window_left=128, sinks=sinks, return_lse=True)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL


@pytest.mark.parametrize("cfg", feature_variants(), ids=lambda c: f"{feature_family(c)}-{c.head_dim}-s{c.split}")
def test_every_feature_family_passes_its_self_check(cfg, tmp_path, monkeypatch):
    """The runtime self-check's cases of each compiled window / sink family, run now on real kernels
    (the op no longer runs them: the variants are available, but the check still guards them
    whenever the registry lists them compile-verified)."""
    monkeypatch.setattr(records, "records_path", lambda: tmp_path / "selfcheck.json")
    cases = features.self_check_cases(cfg, "cuda", decode_op._check_call)
    assert len(cases) == 3
    rec = _selfcheck.run_check(feature_family(cfg), "cuda", cases)
    assert rec.ok, rec.reason


# ---------------------------------------------------------------------------------------------
# against FlashInfer's own trtllm call (XQA on SM90)
# ---------------------------------------------------------------------------------------------

FI_CASES = [(BF16, -1, False), (BF16, 127, True), (FP8, -1, True), (FP8, 1000, False), (FP8, 4096, True)]


@pytest.mark.parametrize("kv, window, with_sinks", FI_CASES)
def test_against_flashinfer_trtllm(kv, window, with_sinks, gen):
    """The same call through FlashInfer (XQA on SM90) and through this package, both against the
    fp32 reference: ours within the tolerance, and no worse than XQA's error (which quantizes the
    query for an FP8 cache). Both errors are printed. The page tails past each length are finite
    here: with NaN bytes there (the other tests' poison) XQA's output on an FP8 cache was NaN on the
    H200 while ours was not; the contract only promises that positions past a length are ignored."""
    fi_decode = pytest.importorskip("flashinfer.decode")
    c = _case(gen, kv=kv, lens=(5000, 300, 64, 2049, 17), poison_tail=False)
    sinks = torch.randn(32, device="cuda", generator=gen) * 2 if with_sinks else None
    ref, _ = _reference(c, window_left=window, sinks=sinks)
    ours, _ = _api(c, _workspace(), window_left=window, sinks=sinks)
    bmm1, bmm2 = _scales(c)
    theirs = torch.full_like(c.q, float("nan"))
    fi_decode.trtllm_batch_decode_with_kv_cache(
        c.q, c.kv_cache, torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), c.block_table, c.seq_lens,
        int(c.seq_lens.max()), bmm1_scale=bmm1, bmm2_scale=bmm2, window_left=window, out=theirs, sinks=sinks,
        kv_layout=c.kv_layout)
    err_ours, err_fi = rel_err(ours, ref), rel_err(theirs, ref)
    print(f"\nkv {kv} window {window} sinks {with_sinks}: ours {err_ours:.2e}, FlashInfer trtllm (XQA) {err_fi:.2e}")
    assert torch.isfinite(ours).all() and err_ours <= TOL
    assert err_ours <= max(err_fi, 1e-3) * 1.5, "ours is less accurate than FlashInfer's trtllm call"


# ---------------------------------------------------------------------------------------------
# a window costs no more than the tokens it reads
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", [BF16, FP8])
def test_window_4096_is_6x_faster_than_32768_context(kv):
    """Llama-shaped decode (B 64, Hq 32 / Hkv 8, D 128, ctx 32768) with sinks: a 4096-token window
    reads an eighth of the keys and must run at least 6x faster than the full context."""
    g = torch.Generator(device="cuda").manual_seed(4096)
    c = make_paged_decode_case(batch=64, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=32768, kv_dtype=kv, generator=g, poison_tail=False)
    sinks = torch.randn(32, device="cuda", generator=g)
    ws, out = _workspace(), torch.empty_like(c.q)
    bmm1, bmm2 = _scales(c)

    def run(window):
        return lambda: trtllm.batch_decode_with_kv_cache(c.q, c.kv_cache, ws, c.block_table, c.seq_lens, 32768,
                                                         bmm1_scale=bmm1, bmm2_scale=bmm2, window_left=window,
                                                         out=out, sinks=sinks)

    full, windowed = time_graph(run(-1)) * 1e6, time_graph(run(4095)) * 1e6
    print(f"\n{kv}: full context {full:.1f} us, window 4096 {windowed:.1f} us: x{full / windowed:.2f}")
    assert full / windowed >= 6.0
    ref, _ = _reference(c, window_left=4095, sinks=sinks)
    run(4095)()
    assert rel_err(out, ref) <= TOL and math.isfinite(full)
