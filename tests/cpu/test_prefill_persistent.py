"""The SM90 prefill's persistent schedule on the host: the order in which a fixed grid of CTAs walks
the (query block, request, head) tiles, emulated CTA by CTA exactly as the kernel does it
(``plan.cta_walk`` over ``prefill_blocks.persistent_tile``), for random varlen batches: every live
tile exactly once, the longest causal blocks first, the heads of one KV group together; the config
field, its signature, its registry entry (available: verified by the GPU suite on the H200) and
the op's launch values. Design: docs/design/sm90-prefill.md#scheduling."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_kernels.plans import sm90_prefill as plan
from cute_kernels.roles import prefill_blocks as blocks

from .conftest import SM90_FAMILIES

TILE_M = plan.TILE_M


def live_tiles(q_lens, num_q_heads):
    return {(m, b, h) for b, q in enumerate(q_lens) for m in range(-(-max(q, 0) // TILE_M))
            for h in range(num_q_heads)}


def walks(num_ctas, num_q_heads, q_lens, max_query_len):
    grid = plan.persistent_grid(num_ctas, num_q_heads, len(q_lens), max_query_len)
    return grid, [plan.cta_walk(c, num_ctas, num_q_heads, q_lens, max_query_len) for c in range(grid)]


batches = st.lists(st.one_of(st.just(0), st.integers(1, 1200), st.sampled_from([127, 128, 129, 256, 257])),
                   min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(q_lens=batches, num_kv_heads=st.integers(1, 4), group=st.sampled_from([1, 2, 6, 8]),
       num_ctas=st.one_of(st.integers(1, 7), st.sampled_from([66, 132, 264])))
def test_every_tile_exactly_once_longest_first(q_lens, num_kv_heads, group, num_ctas):
    Hq = num_kv_heads * group
    max_q = max(q_lens)
    grid, per_cta = walks(num_ctas, Hq, q_lens, max_q)
    assert 1 <= grid <= max(num_ctas, 1)
    seen = Counter(t for w in per_cta for t in w)
    assert set(seen) == live_tiles(q_lens, Hq), "a live tile missed, or a dead one visited"
    assert all(n == 1 for n in seen.values()), "a tile visited twice"
    for w in per_cta:
        # each CTA's query blocks never grow: its first tiles are its longest
        assert [m for m, _, _ in w] == sorted((m for m, _, _ in w), reverse=True)
    # the global order (tile index): query block descending, then request, then head
    order = [blocks.persistent_tile(t, Hq, len(q_lens), -(-max_q // TILE_M)) for t in range(
        Hq * len(q_lens) * -(-max_q // TILE_M))]
    assert order == sorted(order, key=lambda x: (-x[0], x[1], x[2]))
    assert len(set(order)) == len(order)


@settings(max_examples=200, deadline=None)
@given(q_lens=batches, Hq=st.integers(1, 16), num_ctas=st.integers(1, 200))
def test_causal_work_never_grows_along_the_order(q_lens, Hq, num_ctas):
    """Without a cached prefix, the causal work of a tile (KV tiles walked) is its block's index + 1,
    so the walk in tile order is longest-processing-time first across all requests; the first wave
    holds the longest tiles of the batch."""
    max_q = max(q_lens)
    tile_n = 128
    work = []
    m_blocks = max(-(-max_q // TILE_M), 1)
    for t in range(Hq * len(q_lens) * m_blocks):
        m, b, h = blocks.persistent_tile(t, Hq, len(q_lens), m_blocks)
        q = q_lens[b]
        n_max, _ = blocks.n_block_range(m, TILE_M, tile_n, q, q, q, True)
        if m * TILE_M < q:
            work.append(n_max)
    assert work == sorted(work, reverse=True)
    grid, per_cta = walks(num_ctas, Hq, q_lens, max_q)
    firsts = [w[0] for w in per_cta if w]
    if firsts:
        longest = max(blocks.n_block_range(m, TILE_M, tile_n, q_lens[b], q_lens[b], q_lens[b], True)[0]
                      for m, b, _ in firsts)
        assert longest == max(work)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_heads_of_a_kv_group_are_neighbours(group):
    """Consecutive tiles of one (block, request) are consecutive query heads, so the heads sharing
    a KV head run in neighbouring CTAs of a wave (their K/V tiles come from L2)."""
    Hq, B, m_blocks = 4 * group, 3, 5
    for t in range(Hq * B * m_blocks - 1):
        m, b, h = blocks.persistent_tile(t, Hq, B, m_blocks)
        m2, b2, h2 = blocks.persistent_tile(t + 1, Hq, B, m_blocks)
        if (m, b) == (m2, b2):
            assert h2 == h + 1 and (h // group == h2 // group or h2 % group == 0)


def test_lying_max_query_len_leaves_later_blocks_to_nobody():
    """``max_query_len`` sizes the order as it sizes the default grid: blocks past it are never walked."""
    _, per_cta = walks(5, 2, [300, 10], 100)
    assert {t for w in per_cta for t in w} == {(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)}


def test_grid_is_bounded_by_tiles_and_at_least_one():
    assert plan.persistent_grid(132, 8, 2, 300) == 8 * 2 * 3
    assert plan.persistent_grid(132, 32, 16, 4096) == 132
    assert plan.persistent_grid(132, 8, 1, 0) == 8  # max_query_len 0: one (empty) block per head
    assert plan.persistent_ctas(132) == 132 * plan.CTAS_PER_SM
    with pytest.raises(ValueError, match="num_sms"):
        plan.persistent_ctas(0)


def test_one_cta_per_sm_by_registers():
    """384 threads at REGS_PER_THREAD registers fill the register file: a second CTA never fits."""
    assert plan.CTAS_PER_SM == 1
    assert 2 * plan.NUM_THREADS * plan.REGS_PER_THREAD > plan.hw.REGISTERS_PER_SM


def test_persistent_field_signature_and_label():
    kw = dict(q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=8, page_size=16)
    default = plan.make_prefill_config(**kw)
    on = plan.make_prefill_config(**kw, persistent=True)
    assert not default.persistent and "persistent" not in default.label()  # default labels unchanged
    assert on.label().endswith(",persistent=True]")
    names = [a.name for a in on.signature()]
    assert names[-1] == "num_ctas" and "num_ctas" not in [a.name for a in default.signature()]
    assert plan.check_registry_id(on) == plan.PERSISTENT_ID
    assert plan.config_family(on) == SM90_FAMILIES[plan.PERSISTENT_ID]("bf16", "bf16", 128) == \
        "sm90.prefill/16/d128/persistent"
    # a window or sinks keep the default grid (the persistent variants are compiled without them)
    assert not plan.make_prefill_config(**kw, persistent=True, window=True).persistent
    with pytest.raises(ValueError, match="persistent"):
        plan.Sm90PrefillConfig(persistent=True, sinks=True)


def test_registry_lists_the_persistent_variants_available():
    from cute_kernels.registry import KERNELS

    info = KERNELS[plan.PERSISTENT_ID]
    assert info.status == "available" and info.call_site is None and info.op == "paged_prefill"
    assert info.family is None and not info.verified  # run on its own hardware: no self-check family, no note
    assert all(plan.check_registry_id(v) == info.id for v in info.variants())
    variants = info.variants()
    assert variants and all(v.persistent for v in variants)
    assert {v.kind for v in variants} == {"16", "widen", "fp8"}
    assert {v.head_dim for v in variants} == {64, 128, 256}
    # each at the default tiling of its kind and head dim
    for v in variants:
        base = plan.make_prefill_config(q_dtype=v.q_dtype, kv_dtype=v.kv_dtype, head_dim=v.head_dim, group=v.group,
                                        page_size=v.page_size)
        assert (v.tile_n, v.stages, v.staging, v.producer_regs, v.consumer_regs) == (
            base.tile_n, base.stages, base.staging, base.producer_regs, base.consumer_regs)
