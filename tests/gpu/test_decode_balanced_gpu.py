"""The balanced split schedule of the SM90 paged decode (``tuning_override(balanced=True)``) on the
H200: ragged batches against the reference, poisoned outputs, LSEs, bitwise reproducibility
across runs and graph replays (new lengths in a replayed graph too), forced chunk counts, and
every balanced family's runtime self-check cases. The float64 reference on the same (dequantized)
cache, ‖out − ref‖/‖ref‖ ≤ 5e-3 (the bound of tests/gpu/test_decode_gpu.py). The schedule is
available (no check before its launch); every balanced call still asserts that the op keeps the
balanced schedule (were the registry to list it compile-verified again, a failed family would be
served by the default schedule, and the test would then verify the wrong kernel).
Design: docs/design/sm90-decode.md#balanced-schedule-opt-in.
"""

from __future__ import annotations

import random

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops import _decode_features as features
from cute_kernels.ops import _selfcheck
from cute_kernels.ops import paged_decode as op
from cute_kernels.plans import selfcheck_records as records
from cute_kernels.plans import sm90_decode as plan
from cute_kernels.testing import check_attention, make_paged_decode_case

from .conftest import sm90_only

pytestmark = sm90_only()
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
TOL = 5e-3
TABLE = 32768  # a serving engine's block table: its max model length

# (B, max context, Hq, Hkv, kv, q_len)
CASES = [
    *[(b, m, 32, 4, FP8, 1) for b in (8, 32, 128) for m in (4000, 32000)],  # Qwen3-30B-A3B
    *[(b, m, 8, 1, FP8, 1) for b in (8, 32, 128) for m in (4000, 32000)],  # a 70B model under 8-way TP
    (8, 32000, 32, 4, BF16, 1), (32, 4000, 8, 1, BF16, 1), (128, 4000, 32, 4, BF16, 1),
    (8, 4000, 32, 4, FP8, 2), (32, 32000, 8, 1, FP8, 3), (32, 4000, 32, 4, FP8, 4), (128, 4000, 8, 1, FP8, 4),
    (8, 32000, 8, 1, BF16, 4), (32, 4000, 32, 4, BF16, 2),
]


def _ids(c):
    b, m, hq, hkv, kv, ql = c
    return f"B{b}-max{m}-h{hq}/{hkv}-{'fp8' if kv == FP8 else 'bf16'}-q{ql}"


def _lens(gen_seed: int, batch: int, top: int, q_len: int) -> list[int]:
    rng = random.Random(gen_seed)
    lens = [rng.randint(1, top) for _ in range(batch)]
    lens[0] = 0  # empty: zeros and -inf
    lens[-1] = top  # the longest
    if batch > 2:
        lens[1] = q_len  # only the draft
    return lens


def _case(gen, batch, top, Hq, Hkv, kv, q_len, lens=None, poison_tail=True):
    lens = lens or _lens(int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device="cuda")), batch, top, q_len)
    case = make_paged_decode_case(batch=batch, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=128, page_size=16,
                                  seq_lens=lens, kv_dtype=kv, q_len=q_len, table_tokens=TABLE, poison_tail=poison_tail,
                                  generator=gen)
    case.meta["seed"] = gen.initial_seed()  # (named in every failure message)
    return case


def _run(case, chunks=None):
    """The balanced call of ``case``: its output poisoned with NaN, and its LSE (the op's own
    allocation) most likely too: a NaN block of that size freed just before the call is the one the
    caching allocator hands back."""
    out = torch.full_like(case.q, float("nan"))
    poison = torch.full(case.q.shape[:2], float("nan"), dtype=torch.float32, device=case.q.device)
    del poison
    with op.tuning_override(balanced=True):
        got = cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                        return_lse=True, num_splits=chunks, **case.kwargs())
    _assert_balanced_ran(case)
    return got


def _assert_balanced_ran(case):
    """The op kept the balanced schedule: its entry needs no check (available), or its family passed
    the check (the call just made ran it; this finds its record)."""
    cfg = _balanced_config(case)
    fam = features.family_of(cfg)
    assert cfg.balanced and features.self_check_passes(cfg, case.q.device, op._check_call), \
        f"{fam} failed its self-check (the default schedule ran): {records.describe(fam)}"


def _check(case, out, lse):
    ref, ref_lse = reference.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, return_lse=True,
                                          float64=True, **case.kwargs())
    check_attention(out, lse, ref, ref_lse, case.meta["seed"], TOL)


def _balanced_config(case):
    """The config the balanced call of ``case`` launches (the plan's, not the default schedule's)."""
    names = {FP8: "fp8_e4m3", BF16: "bf16"}
    Hq, Hkv = case.q.shape[1], case.meta["num_kv_heads"]
    return plan.launch_config(q_dtype="bf16", kv_dtype=names[case.kv_cache.dtype], head_dim=128, group=Hq // Hkv,
                              q_len=case.q_len, page_size=16, k_scale_tensor=False, v_scale_tensor=False,
                              kv_form="single", kv_layout="HND", items=case.block_table.shape[0] * Hkv,
                              max_context=TABLE, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                              override={"balanced": True}, num_kv_heads=Hkv)[1]


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    from cute_kernels.jit.parallel import precompile

    precompile(plan.balanced_variants(), "sm_90a", progress=False)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_ragged_batches_match_the_reference(case, gen):
    c = _case(gen, *case)
    assert _balanced_config(c).balanced
    out, lse = _run(c)
    _check(c, out, lse)
    q_len = case[-1]
    assert (out[:q_len] == 0).all() and torch.isneginf(lse[:q_len]).all()  # request 0 is empty


@pytest.mark.parametrize("chunks", [1, 2, 7, 64, 1000])
def test_forced_chunk_counts(chunks, gen):
    """One chunk per KV head walking every request; few chunks cutting long requests into many
    partials (the merge's rounds of 16); more chunks than tiles (idle chunks)."""
    c = _case(gen, 32, 32000, 8, 1, FP8, 2)
    _check(c, *_run(c, chunks))


def test_lengths_past_the_table_and_empty_requests(gen):
    lens = [0, 2**31 - 1, 5, TABLE + 1000, 1, 0, 17000, TABLE]
    c = _case(gen, len(lens), 0, 32, 4, FP8, 1, lens=[min(n, TABLE) for n in lens])  # the table's pages
    c.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32, device="cuda"))
    _check(c, *_run(c, 7))


@pytest.mark.parametrize("shape", [(8, 32000, 32, 4, FP8, 1), (128, 4000, 8, 1, FP8, 4), (32, 32000, 32, 4, BF16, 1)],
                         ids=_ids)
def test_bitwise_across_runs_and_graph_replays_with_new_lengths(shape, gen):
    """Eager runs are bitwise equal; a captured graph replays them bitwise; and with new lengths
    written into ``seq_lens`` (the same shapes) the replayed graph computes the new batch, its
    partition found on the device, bitwise equal to an eager call on it."""
    c = _case(gen, *shape, poison_tail=False)  # the new lengths below make stale page tails visible
    first, first_lse = _run(c)
    again, again_lse = _run(c)
    assert torch.equal(first, again) and torch.equal(first_lse, again_lse)
    out = torch.empty_like(c.q)

    def call():
        with op.tuning_override(balanced=True):
            cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, **c.kwargs())

    call()  # compiled (and self-checked, were it compile-verified) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first), "graph replay differs from eager"
    B, top, q_len = shape[0], shape[1], shape[-1]
    new = _lens(12345, B, top, q_len)[::-1]
    c.seq_lens.copy_(torch.tensor(new, dtype=torch.int32, device="cuda"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager, eager_lse = _run(c)
    assert torch.equal(out, eager), "replay with new lengths differs from eager"
    _check(c, eager, eager_lse)


@pytest.mark.parametrize("cfg", plan.balanced_variants(), ids=lambda c: f"{plan.balanced_family(c)}-d{c.head_dim}"
                         f"-g{c.group}-q{c.q_len}-{c.kv_form}")
def test_every_balanced_family_passes_its_self_check(cfg, tmp_path, monkeypatch):
    """The runtime self-check's cases of each compiled balanced variant's family, run now on real
    kernels (the op no longer runs them: the schedule is available, but the check still guards it
    whenever the registry lists it compile-verified)."""
    monkeypatch.setattr(records, "records_path", lambda: tmp_path / "selfcheck.json")
    cases = features.balanced_cases(cfg, "cuda", op._check_call)
    assert len(cases) == 4
    rec = _selfcheck.run_check(plan.balanced_family(cfg), "cuda", cases, fallback="the default schedule")
    assert rec.ok, rec.reason


def test_the_portable_kernel_ignores_the_balanced_override(gen):
    """``balanced`` is the SM90 kernel's schedule: a call forced onto the portable kernel under it
    runs the portable kernel's own schedule (the override does not reach its config)."""
    c = _case(gen, 8, 4000, 32, 4, FP8, 1)
    out = torch.full_like(c.q, float("nan"))
    with op.tuning_override(balanced=True, backend="sm80"):
        got, lse = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, return_lse=True,
                                             **c.kwargs())
    _check(c, got, lse)
