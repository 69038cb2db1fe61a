"""The balanced split schedule of the SM90 decode on the CPU (docs/design/sm90-decode.md#balanced-schedule-opt-in).

1. The partition (``plans/sm90_decode_balance.balanced_partition``, the specification) against
   brute force over random ragged batches: every tile of every request attended exactly once, an
   empty request's output written by exactly one chunk, chunk sizes within one unit, no request
   over ``MAX_PARTS`` partials, a request inside one chunk unsplit, at most one request cut per
   boundary, every partial slot written once, merge order = chunk order.
2. The device's form (``roles/balanced_chunks``): its integer steps run with Python ints, the warp
   around them emulated lane by lane (block sums, the shuffle scan, the lane that finds the
   chunk's first request, the per-segment walk and merge slots), equal to the specification for
   every chunk of every batch.
3. The dataflow in float64: per-chunk partials (fp32-free, exact softmax states) merged in slot
   order equal the reference's attention, and the same partition gives the same bits twice.
4. Host plumbing: config flag and label, signature, launch plan, workspace size from shapes only,
   registry entry (available: verified by the GPU suite on the H200, so the op runs no check),
   the self-check cases and the fallback to the default schedule while the registry lists the
   schedule compile-verified (``sm90_compile_verified`` lists it so again).
"""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch

import cute_kernels
from cute_kernels import reference, registry
from cute_kernels.ops import _decode_features as features
from cute_kernels.ops import paged_decode as op
from cute_kernels.plans import selfcheck_records as records
from cute_kernels.plans import sm90_decode as plan
from cute_kernels.plans import sm90_decode_balance as balance
from cute_kernels.roles import balanced_chunks as dev

BASE = dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1, page_size=16)


def ragged_batch(rng: random.Random, tile: int = 64):
    """A random batch: lengths in [0, max] with empty, one-token, tile-edge and past-capacity
    requests mixed in; the capacity; a grid chunk count."""
    B = rng.choice([1, 2, 3, 7, 31, 32, 33, 64, 97, 128])
    cap = rng.choice([tile, 5 * tile, 2048, 32768])
    top = rng.choice([1, tile, 4000, 32000, 40000])
    lens = [rng.randint(0, top) for _ in range(B)]
    for _ in range(rng.randint(0, 3)):
        lens[rng.randrange(B)] = rng.choice([0, 1, tile, tile + 1, cap, cap + 7, -5, 2**31 - 1])
    return lens, cap, rng.choice([1, 2, 5, 33, 99, 132, 396])


def seeds(n: int):
    return [pytest.param(s, id=f"seed{s}") for s in range(n)]


# ---------------------------------------------------------------------------------------------
# 1. the specification against brute force
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", seeds(300))
def test_partition_against_brute_force(seed):
    rng = random.Random(seed)
    tile = rng.choice([64, 128])
    lens, cap, chunks = ragged_batch(rng, tile)
    p = balance.balanced_partition(lens, cap, tile, chunks)
    print(f"seed {seed}: B={len(lens)} cap={cap} chunks={chunks} active={p.active}")
    tiles = [math.ceil(min(max(x, 0), cap) / tile) for x in lens]
    assert list(p.units) == [max(t, 1) for t in tiles]
    total = sum(p.units)
    # the active chunks: contiguous, near-equal, at least q_min long when there are several
    assert 1 <= p.active <= chunks
    sizes = [e - s for s, e in p.ranges[:p.active]]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    assert all(s == e for s, e in p.ranges[p.active:])
    q_min = max(balance.MIN_CHUNK_TILES, math.ceil(max(p.units) / (balance.MAX_PARTS - 1)))
    if p.active > 1:
        assert min(sizes) >= q_min
    assert p.active == chunks or total // q_min <= p.active
    # brute force: each unit's chunk from the ranges
    owner = {}
    for c, (s, e) in enumerate(p.ranges):
        for u in range(s, e):
            assert u not in owner
            owner[u] = c
    assert sorted(owner) == list(range(total))
    first = [sum(p.units[:b]) for b in range(len(lens))]
    covered = [[0] * t for t in tiles]
    written = [0] * len(lens)
    slots = set()
    for c, segs in enumerate(p.segments):
        for seg in segs:
            b = seg.request
            for t in range(seg.lo, seg.hi):
                covered[b][t] += 1
            assert all(owner[first[b] + t] == c for t in range(seg.lo, seg.hi))
            if seg.slot is None:
                written[b] += 1
            else:
                assert seg.slot not in slots and 0 <= seg.slot < 2 * chunks
                slots.add(seg.slot)
    assert all(n == 1 for row in covered for n in row), "every tile of every request exactly once"
    cut = 0
    for b, u in enumerate(p.units):
        spanned = sorted({owner[first[b] + k] for k in range(u)})
        assert spanned == list(range(spanned[0], spanned[-1] + 1))
        if len(spanned) == 1:  # inside one chunk: written directly, never merged
            assert written[b] == 1 and p.parts[b] == ()
        else:
            cut += 1
            assert written[b] == 0 and len(p.parts[b]) == len(spanned) <= balance.MAX_PARTS
            c0 = spanned[0]
            opens = first[b] == p.ranges[c0][0]
            assert p.parts[b] == (c0 if opens else chunks + c0, *range(c0 + 1, spanned[-1] + 1))
    assert cut <= p.active - 1, "one request cut per boundary at most"


def test_partition_examples():
    # four requests of 3, 1 (empty), 6 and 2 units over 3 chunks of 4 units
    p = balance.balanced_partition([130, 0, 321, 100], capacity=4096, tile=64, chunks=3, min_chunk=1)
    assert p.units == (3, 1, 6, 2) and p.active == 3
    assert p.ranges == ((0, 4), (4, 8), (8, 12))
    S = balance.Segment
    assert p.segments == ((S(0, 0, 3, None), S(1, 0, 0, None)), (S(2, 0, 4, 0 + 1),), (S(2, 4, 6, 2), S(3, 0, 2, None)))
    assert p.parts == ((), (), (1, 2), ())
    # a request opening a chunk mid-batch uses slot c; one ending it from inside, chunks + c
    p = balance.balanced_partition([64 * 3, 64 * 3], capacity=4096, tile=64, chunks=2, min_chunk=1)
    assert p.ranges == ((0, 3), (3, 6)) and p.parts == ((), ())
    p = balance.balanced_partition([64 * 2, 64 * 4], capacity=4096, tile=64, chunks=2, min_chunk=1)
    assert p.segments[0] == (S(0, 0, 2, None), S(1, 0, 1, 2 + 0)) and p.parts == ((), (2, 1))


def test_short_batches_use_fewer_chunks_and_long_requests_are_bounded():
    # 10 tiles in all: at most 10 // MIN_CHUNK_TILES chunks take work
    assert balance.balanced_partition([640], 4096, 64, 396).active == 10 // balance.MIN_CHUNK_TILES
    # one request of 500 tiles on a grid of 396 chunks: chunks of >= 500 / 63 tiles, <= 64 partials
    p = balance.balanced_partition([32000], 32768, 64, 396)
    assert p.active == 500 // 8 and len(p.parts[0]) <= balance.MAX_PARTS
    assert balance.balanced_partition([0, 0, 0], 4096, 64, 8).active == 1  # three empty requests: one chunk
    assert balance.chunks_per_head(132, 3, 4) == 99 and balance.chunks_per_head(132, 3, 1) == 396
    assert balance.fits_int32(128, 32768, 64) and not balance.fits_int32(2**20, 2**20 * 64, 64)


# ---------------------------------------------------------------------------------------------
# 2. the device's form: its integer steps with Python ints, the warp emulated lane by lane
# ---------------------------------------------------------------------------------------------


def emulate_locate(lens, cap, tile, chunk, chunks):
    """``BalancedChunks.locate`` lane by lane: block sums, the shuffle-up scan (a lane adds the
    value ``off`` lanes below once ``lane >= off``), the butterfly max, the broadcast from lane 31,
    the one lane whose block holds the chunk's first unit, the butterfly sums."""
    B = len(lens)
    per_lane = (B + 31) // 32
    lo = [min(lane * per_lane, B) for lane in range(32)]
    hi = [min(lo[lane] + per_lane, B) for lane in range(32)]
    units = [dev.units_of(x, cap, tile)[0] for x in lens]
    total = [sum(units[lo[i]:hi[i]]) for i in range(32)]
    longest = [max(units[lo[i]:hi[i]], default=0) for i in range(32)]
    upto = list(total)
    for off in (1, 2, 4, 8, 16):
        below = [upto[i - off] if i >= off else upto[i] for i in range(32)]  # shfl.up keeps its own below off
        upto = [upto[i] + below[i] if i >= off else upto[i] for i in range(32)]
        longest = [max(longest[i], longest[i ^ off]) for i in range(32)]
    all_units = upto[31]
    assert all_units == sum(units) and len(set(longest)) == 1
    active, q, r = dev.active_chunks(all_units, longest[0], chunks, balance.MIN_CHUNK_TILES, balance.MAX_PARTS)
    start = end = all_units
    if chunk < active:
        start, end = dev.chunk_start(chunk, q, r), dev.chunk_start(chunk + 1, q, r)
    found = []
    for lane in range(32):
        block_first = upto[lane] - total[lane]
        if block_first <= start < upto[lane]:
            p = block_first
            for b in range(lo[lane], hi[lane]):
                u = dev.units_of(lens[b], cap, tile)[0]
                if p <= start < p + u:
                    found.append((b, p))
                p += u
    assert len(found) <= 1 and (found or start == end)
    request, first = found[0] if found else (0, 0)
    return start, end, request, first, q, r, active


def emulate_chunk(lens, cap, tile, chunk, chunks):
    """The segments a chunk's producer and consumers walk (``Sm90PagedDecode.run_chunk``) and,
    for each cut request, the slots its merge reads (``SplitMerge.merge_row_chunk``'s "slots")."""
    start, end, request, first, q, r, active = emulate_locate(lens, cap, tile, chunk, chunks)
    segments, merges = [], {}
    while max(first, start) < end:
        units, tiles = dev.units_of(lens[request], cap, tile)
        lo, hi, whole, slot, parts, slot0, c0 = dev.segment_of(chunk, chunks, start, end, first, units, q, r)
        segments.append(balance.Segment(request, lo, min(hi, tiles), None if whole else slot))
        if not whole:
            merges[request] = tuple(dev.merge_slot(s, slot0, c0) for s in range(parts))
        first += units
        request += 1
    return (start, end), tuple(segments), merges, active


@pytest.mark.parametrize("seed", seeds(200))
def test_device_form_equals_the_specification(seed):
    rng = random.Random(1000 + seed)
    tile = rng.choice([64, 128])
    lens, cap, chunks = ragged_batch(rng, tile)
    p = balance.balanced_partition(lens, cap, tile, chunks)
    print(f"seed {1000 + seed}: B={len(lens)} cap={cap} chunks={chunks}")
    merges = {}
    for c in range(chunks):
        rng_c, segs, m, active = emulate_chunk(lens, cap, tile, c, chunks)
        assert active == p.active
        assert rng_c == p.ranges[c] and segs == p.segments[c], f"chunk {c}"
        for b, slots in m.items():
            assert merges.setdefault(b, slots) == slots  # every chunk of a request agrees on its merge
    assert {b: s for b, s in enumerate(p.parts) if s} == merges


def test_chunk_of_is_the_inverse_of_chunk_start():
    for total in range(1, 200):
        for active in range(1, min(total, 40) + 1):
            q, r = divmod(total, active)
            starts = [dev.chunk_start(c, q, r) for c in range(active + 1)]
            assert starts == [balance.chunk_start(c, total, active) for c in range(active + 1)]
            for u in range(total):
                c = dev.chunk_of(u, q, r)
                assert starts[c] <= u < starts[c + 1]


# ---------------------------------------------------------------------------------------------
# 3. the dataflow in float64: partials per chunk segment, merged in slot order
# ---------------------------------------------------------------------------------------------


def _segment_state(q, k, v, lo, hi, tile, limit, scale):
    """Unnormalized softmax state of one query row over tiles [lo, hi): (max, sum, O)."""
    keys = torch.arange(lo * tile, min(hi * tile, limit), dtype=torch.long)
    if keys.numel() == 0:
        return -math.inf, 0.0, torch.zeros_like(q)
    s = (k[keys] @ q) * scale
    m = float(s.max())
    p = torch.exp(s - m)
    return m, float(p.sum()), p @ v[keys]


@pytest.mark.parametrize("seed", seeds(6))
def test_dataflow_merged_in_slot_order_equals_the_reference(seed):
    """Per (request, query row): each chunk's segment leaves (O normalized, LSE) or writes the
    output; the cut requests' partials, placed in the slot workspace and merged in the order the
    device reads them, give the reference's attention; and twice the same bits."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    tile, D, q_len = 64, 16, rng.choice([1, 2, 4])
    lens = [rng.choice([0, 1, q_len, 63, 64, 65, rng.randint(1, 900)]) for _ in range(rng.randint(1, 9))]
    cap, chunks = 1024, rng.choice([1, 3, 7, 12])
    K = [torch.randn(max(x, 1), D, dtype=torch.float64, generator=g) for x in lens]
    V = [torch.randn(max(x, 1), D, dtype=torch.float64, generator=g) for x in lens]
    Q = torch.randn(len(lens), q_len, D, dtype=torch.float64, generator=g)

    def run():
        out = torch.full((len(lens), q_len, D), math.nan, dtype=torch.float64)
        slots = {}
        p = balance.balanced_partition(lens, cap, tile, chunks)
        for c in range(chunks):
            for seg in emulate_chunk(lens, cap, tile, c, chunks)[1]:
                b = seg.request
                for j in range(q_len):
                    limit = min(lens[b] - q_len + j + 1, cap)
                    m, s, o = _segment_state(Q[b, j], K[b], V[b], seg.lo, seg.hi, tile, limit, D ** -0.5)
                    o = o / s if s > 0 else o
                    lse = m + math.log(s) if s > 0 else -math.inf
                    if seg.slot is None:
                        out[b, j] = o
                    else:
                        slots[seg.slot, j] = (o, lse)
        for b, parts in enumerate(p.parts):
            for j in range(q_len):
                if parts:
                    states = [slots[s, j] for s in parts]  # the merge's fixed order
                    top = max(lse for _, lse in states)
                    w = [math.exp(lse - top) if lse > -math.inf else 0.0 for _, lse in states]
                    out[b, j] = sum(wi * o for wi, (o, _) in zip(w, states)) / sum(w) if sum(w) > 0 else 0
        return out

    got = run()
    for b, L in enumerate(lens):
        for j in range(q_len):
            limit = min(L - q_len + j + 1, cap)
            if limit <= 0:
                assert torch.equal(got[b, j], torch.zeros(D, dtype=torch.float64))
                continue
            w = torch.softmax((K[b][:limit] @ Q[b, j]) * D ** -0.5, 0)
            torch.testing.assert_close(got[b, j], w @ V[b][:limit], rtol=1e-12, atol=1e-12)
    assert torch.equal(run(), got)


# ---------------------------------------------------------------------------------------------
# 4. host plumbing
# ---------------------------------------------------------------------------------------------


def test_flag_leaves_the_default_labels_and_validates():
    cfg = plan.make_decode_config(**BASE, split=True)
    assert "balanced" not in cfg.label() and not cfg.balanced
    bal = plan.make_decode_config(**BASE, split=True, balanced=True)
    assert bal.label().endswith(",sinks=False,balanced=True]")
    assert bal.balanced and not bal.strided and not bal.dynamic and not bal.smem_merge and bal.merge == "global"
    assert not plan.make_decode_config(**BASE, split=False, balanced=True).balanced  # a split variant only
    assert not plan.make_decode_config(**BASE, split=True, window=True, balanced=True).balanced
    for bad in (dict(strided=True), dict(dynamic=True), dict(cluster=True), dict(smem_merge=True), dict(sinks=True)):
        with pytest.raises(ValueError, match="balanced"):
            plan.Sm90DecodeConfig(**{**BASE, "split": True, "smem_merge": False, "balanced": True, **bad})
    with pytest.raises(ValueError, match="balanced"):
        plan.Sm90DecodeConfig(**BASE, split=False, smem_merge=False, balanced=True)


def test_signature_takes_slot_partials():
    bal = plan.make_decode_config(**{**BASE, "q_len": 3}, split=True, balanced=True)
    sig = {a.name: a for a in bal.signature()}
    assert sig["part_out"].shape == ("S", 3, "Hq", 128) and sig["part_lse"].shape == ("S", 3, "Hq")
    assert bal.arg_names() == plan.make_decode_config(**{**BASE, "q_len": 3}, split=True).arg_names()
    assert bal.partial_tokens(96) == 3 and plan.make_decode_config(**BASE, split=True).partial_tokens(96) == 96


def _launch(override, num_kv_heads=4, batch=8, **kw):
    fields = dict(BASE, k_scale_tensor=False, v_scale_tensor=False, kv_form="single", kv_layout="HND")
    fields.update(kw.pop("fields", {}))
    return plan.launch_config(**fields, items=batch * max(num_kv_heads, 1), max_context=32768, num_sms=132,
                              override=override, num_kv_heads=num_kv_heads, **kw)


def test_launch_plan_from_shapes_only():
    slots, cfg = _launch({"balanced": True})
    assert cfg.balanced and cfg.occupancy == 3 and slots == 2 * 99  # FP8 D128: 3 CTAs/SM over 4 KV heads
    slots, cfg = _launch({"balanced": True}, num_kv_heads=1, batch=64)
    assert slots == 2 * 396
    assert _launch({"balanced": True}, num_splits=7)[0] == 14  # num_splits: chunks per KV head
    bf16 = _launch({"balanced": True}, fields=dict(kv_dtype="bf16"))[1]
    assert bf16.balanced and bf16.occupancy == plan.make_decode_config(**{**BASE, "kv_dtype": "bf16"}, split=False).occupancy
    # without the flag, with a window or sinks, or without the head count: the default schedule
    assert _launch({}) == _launch({"balanced": False})
    assert not _launch({"balanced": True}, window=True)[1].balanced
    assert not _launch({"balanced": True}, sinks=True)[1].balanced
    assert not _launch({"balanced": True}, num_kv_heads=0, batch=8)[1].balanced


def test_workspace_from_shapes_only():
    slots, cfg = _launch({"balanced": True})
    T, Hq, D = 8, 32, 128
    numel, counters = op.workspace_numel(cfg, slots, 8, 4, T, Hq, D, return_lse=False)
    assert numel == slots * 1 * Hq * (D + 1) + T * Hq and counters == 8 * 4
    static_splits, static_cfg = _launch({})
    assert op.workspace_numel(static_cfg, static_splits, 8, 4, T, Hq, D, True)[0] == static_splits * T * Hq * (D + 1)


def test_registry_marks_the_balanced_variants_available():
    info = registry.KERNELS["sm90.decode_balanced"]
    assert info.status == "available" and info.call_site is None and info.op == "paged_decode"
    assert info.family is None and not info.verified  # run on its own hardware: no self-check family, no note
    variants = info.variants()
    assert variants == plan.balanced_variants() and all(v.balanced for v in variants)
    assert not any(v.balanced for v in plan.compile_variants() + plan.feature_variants())
    assert {plan.balanced_family(v).rsplit("/", 1)[1] for v in variants} == {"fp8-cvt", "fp8-bits", "16bit"}
    assert {v.head_dim for v in variants} == {64, 128, 256} and {v.q_len for v in variants} >= {1, 2, 4}
    assert {(v.kv_form, v.kv_layout) for v in variants} >= {("single", "HND"), ("pair", "NHD")}
    assert all(v in registry.variants_for("sm_90a") for v in variants)
    assert all(plan.check_registry_id(v) == info.id for v in variants)
    assert plan.balanced_family(plan.make_decode_config(**BASE, split=True)) is None
    # the warm-up's enumeration never pairs a balanced config with a cluster
    assert all(not (c.balanced and c.cluster) for c in plan.decode_variants(
        head_dim=128, num_q_heads=32, num_kv_heads=4, page_size=16, balanced=True))


def test_the_available_schedule_runs_no_check():
    """No check before a balanced launch: a runner that would fail one is never called, no record
    is written, and the call plan keeps the balanced schedule."""
    cfg = plan.make_decode_config(**BASE, split=True, balanced=True)
    assert features.self_check_passes(cfg, "cpu", lambda o, **kw: 1 / 0)
    assert records.lookup(plan.balanced_family(cfg)) is None
    call = dict(BASE, k_scale_tensor=False, v_scale_tensor=False, kv_form="single", kv_layout="HND", items=32,
                max_context=32768, num_sms=132, num_kv_heads=4, num_splits=None, deterministic=True, window=False,
                sinks=False)
    with op.tuning_override(balanced=True):
        splits, config = op.guarded_plan(call, "cpu")
    assert config.balanced and (splits, config) == plan.launch_config(**call, override={"balanced": True})


def test_cpu_tensors_run_the_reference_under_the_option():
    g = torch.Generator().manual_seed(5)
    cfg = plan.make_decode_config(**BASE, split=True, balanced=True)
    q, cache, bt, sl = features.decode_problem(cfg, g, lens=[0, 40, 700], width=64)
    with op.tuning_override(balanced=True):
        out, lse = cute_kernels.paged_decode(q, cache, bt, sl, return_lse=True)
    ref, ref_lse = reference.paged_decode(q, cache, bt, sl, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_self_check_cases_follow_the_variant_and_pass_a_correct_kernel(sm90_compile_verified):
    cfg = plan.make_decode_config(**{**BASE, "q_len": 2}, split=True, balanced=True, k_scale_tensor=True,
                                  v_scale_tensor=True)
    seen = []

    def runner(override, **kw):
        seen.append((dict(override), kw["num_splits"]))
        assert kw["q_len_per_req"] == 2 and isinstance(kw["k_scale"], torch.Tensor)
        assert kw["block_table"].shape[1] > max(kw["seq_lens"].tolist()) // 16
        return cute_kernels.paged_decode(**kw)

    assert features.self_check_passes(cfg, "cpu", runner)
    assert seen == [({"balanced": True, "widen": cfg.widen}, c) for c in (7, 1, None, 7, 7)]
    assert records.lookup(plan.balanced_family(cfg), "cpu").ok


@pytest.mark.parametrize("broken, expect", [
    (lambda o, **kw: tuple(x * 1.5 for x in cute_kernels.paged_decode(**kw)), "beyond tolerance"),
    (lambda o, **kw: tuple(x * float("nan") for x in cute_kernels.paged_decode(**kw)), "NaN"),
])
def test_a_failing_balanced_family_leaves_calls_to_the_default_schedule(sm90_compile_verified, broken, expect,
                                                                        caplog):
    cfg = plan.make_decode_config(**BASE, split=True, balanced=True)
    fam = plan.balanced_family(cfg)
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        assert not features.self_check_passes(cfg, "cpu", broken)
    assert any(f"{fam} failed its self-check" in r.getMessage() and "the default schedule runs instead"
               in r.getMessage() for r in caplog.records)
    assert expect in records.lookup(fam, "cpu").reason
    fields = dict(BASE, k_scale_tensor=False, v_scale_tensor=False, kv_form="single", kv_layout="HND")
    call = dict(fields, items=32, max_context=32768, num_sms=132, num_kv_heads=4, num_splits=None,
                deterministic=True, window=False, sinks=False)
    with op.tuning_override(balanced=True):
        splits, config = op.guarded_plan(call, "cpu")
    assert not config.balanced and (splits, config) == plan.launch_config(**call)


def test_the_bitwise_repeat_case_catches_a_nondeterministic_kernel(sm90_compile_verified):
    cfg = plan.make_decode_config(**BASE, split=True, balanced=True)
    calls = []

    def jitter(override, **kw):
        calls.append(1)
        out, lse = cute_kernels.paged_decode(**kw)
        return out, lse + (len(calls) == 5) * 1e-6  # the fifth call (the repeat) differs in the last bits

    assert not features.self_check_passes(cfg, "cpu", jitter)
    assert "repeat" in records.lookup(plan.balanced_family(cfg), "cpu").reason
