"""The SM90 prefill's host plan and index math, against brute force (no GPU, no DSL needed for the
math): request rows, causal / tail block ranges, page boxes; the config's limits and signature."""

from __future__ import annotations

import random

import pytest

from cute_kernels.plans import sm90_prefill as plan
from cute_kernels.roles import prefill_blocks as blocks


def brute_visible(j, q_len, seq_len, cap, causal):
    """KV positions query row j sees, by definition."""
    return {p for p in range(max(seq_len, 0)) if p < cap and (not causal or p < seq_len - q_len + j + 1)}


@pytest.mark.parametrize("seed", range(40))
def test_block_ranges_match_brute_force(seed):
    rng = random.Random(seed)
    print("seed", seed)
    tile_m = rng.choice([64, 128])
    tile_n = rng.choice([16, 64, 80, 128])
    causal = rng.random() < 0.7
    for _ in range(50):
        q_len = rng.choice([0, 1, 2, rng.randrange(1, 400)])
        seq_len = rng.choice([q_len, q_len + rng.randrange(0, 300), rng.randrange(-3, q_len + 1)])
        width, page = rng.randrange(0, 30), rng.choice([16, 32, 64, 128])
        cap = blocks.kv_cap(seq_len, width, page)
        assert cap == max(0, min(seq_len, width * page))
        for m in range(-(-max(q_len, 1) // tile_m) + 1):
            n_max, n_unmasked = blocks.n_block_range(m, tile_m, tile_n, q_len, seq_len, cap, causal)
            rows = range(m * tile_m, min((m + 1) * tile_m, q_len))
            vis = {j: brute_visible(j, q_len, seq_len, cap, causal) for j in rows}
            for j in rows:
                assert blocks.row_limit(j, q_len, seq_len, cap, causal) == len(vis[j])
                assert vis[j] == set(range(len(vis[j])))  # a prefix
            needed = max((max(v) // tile_n + 1 for v in vis.values() if v), default=0)
            assert n_max == needed, (m, q_len, seq_len, cap)
            assert 0 <= n_unmasked <= n_max
            for n in range(n_max):
                block = set(range(n * tile_n, (n + 1) * tile_n))
                full = all(block <= vis[j] for j in rows)
                # unmasked tiles are fully visible to every real row; the first masked one is not
                if n < n_unmasked:
                    assert full
                elif n == n_unmasked:
                    assert not full


def test_request_rows_clamp_a_corrupted_table():
    assert blocks.request_rows(3, 10, 100) == (3, 7)
    assert blocks.request_rows(10, 3, 100) == (10, 0)  # decreasing: empty
    assert blocks.request_rows(-5, 4, 100) == (0, 4)
    assert blocks.request_rows(90, 500, 100) == (90, 10)
    assert blocks.request_rows(500, 600, 100) == (100, 0)


def test_m_blocks_longest_first():
    assert [blocks.m_block_of(y, 4) for y in range(4)] == [3, 2, 1, 0]
    assert plan.grid(32, 3, 300) == (32, 3, 3)
    assert plan.grid(32, 3, 0) == (32, 0, 3)


@pytest.mark.parametrize("page,tile_n", [(16, 128), (32, 128), (64, 64), (128, 64), (128, 128), (16, 80)])
def test_boxes_tile_every_kv_position_once(page, tile_n):
    box = min(page, tile_n)
    seen = {}
    for tile in range(6):
        for b in range(tile_n // box):
            token, lp, sub = blocks.box_source(tile, b, tile_n, box, page)
            assert token == lp * page + sub * box
            assert 0 <= sub < page // box
            for t in range(token, token + box):
                assert t not in seen
                seen[t] = (lp, sub)
    assert sorted(seen) == list(range(6 * tile_n))


def test_default_configs_fit_and_sign():
    for q, kv in [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8_e4m3"), ("fp16", "fp8_e4m3"),
                  ("fp8_e4m3", "fp8_e4m3")]:
        for d in plan.HEAD_DIMS:
            for page in plan.PAGE_SIZES:
                cfg = plan.make_prefill_config(q_dtype=q, kv_dtype=kv, head_dim=d, group=8, page_size=page)
                assert plan.smem_bytes(cfg) <= plan.SMEM_BUDGET
                assert cfg.tile_n % page == 0 or page % cfg.tile_n == 0
    cfg = plan.make_prefill_config(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16,
                                   kv_form="pair", q_scale="per_head", write_lse=False, k_scale_tensor=True)
    names = [a.name for a in cfg.signature()]
    assert names == ["q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc", "out", "k_scale",
                     "v_scale", "q_scale", "sm_scale", "max_query_len"]
    assert cfg.out_dtype == "bf16"
    per_head = [a for a in cfg.signature() if a.name == "q_scale"][0]
    assert per_head.shape == ("Hkv",)
    cfg = plan.make_prefill_config(q_dtype="bf16", kv_dtype="bf16", head_dim=64, group=1, page_size=128)
    assert [a.name for a in cfg.signature()] == ["q", "kv_cache", "block_table", "seq_lens", "query_start_loc",
                                                 "out", "lse", "k_scale", "v_scale", "sm_scale", "max_query_len"]


# make_prefill_config's consumer schedule per (kind, head dim): (overlap, pingpong), the tuning sweep's
# winners (docs/design/sm90-prefill.md#tuning-sweep)
SCHEDULES = {("16", 64): (True, False), ("16", 128): (True, True), ("16", 256): (True, False),
             ("widen", 64): (False, False), ("widen", 128): (False, False), ("widen", 256): (False, False),
             ("fp8", 64): (True, False), ("fp8", 128): (True, True), ("fp8", 256): (False, False)}
KIND_DTYPES = {"16": [("bf16", "bf16"), ("fp16", "fp16")], "widen": [("bf16", "fp8_e4m3"), ("fp16", "fp8_e4m3")],
               "fp8": [("fp8_e4m3", "fp8_e4m3")]}


@pytest.mark.parametrize("kind,d", sorted(SCHEDULES))
def test_default_consumer_schedule(kind, d):
    """Every (query, cache) dtype pair of a kind at every page size gets the table's schedule, with
    each opt-in field too (the persistent grid, the shared-memory epilogue, a window and sinks, the
    FP8 query's second term and word-wise V^T): every combination is a valid config."""
    opt_ins = [{}, dict(persistent=True), dict(epilogue="smem"), dict(window=True, sinks=True), dict(causal=False)]
    if kind == "fp8":
        opt_ins += [dict(q_terms=2), dict(vt_transpose="words"), dict(q_terms=2, q_scale="per_head")]
    assert plan.default_schedule(kind, d) == plan.schedule_name(*SCHEDULES[(kind, d)])
    for (q, kv), page, on in [(dt, p, o) for dt in KIND_DTYPES[kind] for p in plan.PAGE_SIZES for o in opt_ins]:
        cfg = plan.make_prefill_config(q_dtype=q, kv_dtype=kv, head_dim=d, group=8, page_size=page, **on)
        assert cfg.kind == kind
        assert (cfg.overlap, cfg.pingpong) == SCHEDULES[(kind, d)], (q, kv, page, on)
        assert all(getattr(cfg, k) == v for k, v in on.items()), (q, kv, page, on)


@pytest.mark.parametrize("kind,d", sorted(SCHEDULES))
def test_schedule_overrides(kind, d):
    """An overridden schedule field wins; one given alone takes the other with it (pingpong needs
    overlap; no overlap, no pingpong); both given contradictorily are refused by the config."""
    q, kv = KIND_DTYPES[kind][0]

    def make(**override):
        cfg = plan.make_prefill_config(q_dtype=q, kv_dtype=kv, head_dim=d, group=4, page_size=16, **override)
        return cfg.overlap, cfg.pingpong

    overlap, pingpong = SCHEDULES[(kind, d)]
    for name, fields_ in plan.CONSUMER_SCHEDULES.items():
        assert make(**fields_) == (fields_["overlap"], fields_["pingpong"]), name
    assert make(pingpong=True) == (True, True)
    assert make(overlap=False) == (False, False)
    assert make(pingpong=False) == (overlap, False)
    assert make(overlap=True) == (True, pingpong)
    assert make(persistent=True, **plan.CONSUMER_SCHEDULES["serial"]) == (False, False)
    with pytest.raises(ValueError, match="pingpong"):
        make(overlap=False, pingpong=True)


@pytest.mark.parametrize("bad,match", [
    (dict(q_dtype="fp8_e4m3", kv_dtype="bf16"), "FP8 query needs an FP8 KV"),
    (dict(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", q_scale="none"), "needs q_scale"),
    (dict(q_scale="scalar"), "only to an FP8 query"),
    (dict(kv_dtype="fp16"), "query's dtype"),
    (dict(head_dim=96), "head_dim"),
    (dict(page_size=8), "page_size"),
    (dict(group=0), "group"),
    (dict(tile_n=96, page_size=64), "divide"),
    (dict(stages=2, staging=1), "staging"),
    (dict(stages=8), "shared memory"),
    (dict(producer_regs=32, consumer_regs=240), "exceed the launch"),
    (dict(overlap=False, pingpong=True), "pingpong"),  # setmaxnreg.inc would wait forever
])
def test_config_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        plan.Sm90PrefillConfig(**bad)


def test_plan_module_imports_neither_torch_nor_the_dsl():
    import subprocess
    import sys

    code = ("import sys; import cute_kernels.plans.sm90_prefill; "
            "print('torch' in sys.modules, 'cutlass' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
