"""CPU tests of the synthetic QSA selections of :mod:`cute_kernels.bench.qsa_selection` (used by
``cute-kernels bench qsa`` and the GPU tests).

- Both selection models keep the packed row layout of the contract (§1): valid_count
  ``min(p + 1, 2048 + (p + 1) % 4)`` at TOPK 2051 / budget 512, distinct tokens in ``[0, p]``,
  whole visible 4-token blocks, then the open tail group, then -1.
- ``correlated``: adjacent rows' complete-block sets have a Jaccard near 0.90 (vllm RFC #55394:
  0.87-0.94 on real dumps), rows further apart share less, and R-row tiles have small unions.
  ``independent`` is far below that.
- ``selection_stats`` gives the known answers of hand-built rows, with and without chunking.
"""

from __future__ import annotations

import math

import pytest
import torch

from cute_kernels.bench import qsa_selection as qs
from cute_kernels.bench.qsa_selection import BUDGET, TOPK, R, qsa_indices, selection_stats

MODES = ("independent", "correlated")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _block_sets(packed: torch.Tensor) -> list[set[int]]:
    """Each row's complete blocks, read independently of ``selection_stats``."""
    out = []
    for row in packed.tolist():
        complete = row[TOPK] // R
        out.append({t // R for t in row[0 : complete * R : R]})
    return out


# ----------------------------------------------------------------------------------------------
# row layout
# ----------------------------------------------------------------------------------------------

LAYOUT_POSITIONS = torch.tensor(
    list(range(0, 12)) + [30, 511, 2045, 2046, 2047, 2048, 2049, 2050, 2051, 2052, 2053, 2054]
    + list(range(4000, 4013)) + [7777, 9998, 12345, 16383])


@pytest.mark.parametrize("selection", MODES)
def test_row_layout(selection):
    packed = qsa_indices(LAYOUT_POSITIONS, selection=selection, generator=_gen(1))
    assert packed.dtype == torch.int32 and packed.shape == (LAYOUT_POSITIONS.numel(), TOPK + 1)
    unsorted_rows = 0
    for p, row in zip(LAYOUT_POSITIONS.tolist(), packed.tolist()):
        count = row[TOPK]
        assert count == min(p + 1, 2048 + (p + 1) % 4), p
        complete, tail = min((p + 1) // R, BUDGET), (p + 1) % R
        assert count == complete * R + tail
        toks = row[:count]
        assert all(0 <= t <= p for t in toks), p
        assert len(set(toks)) == count, p  # distinct
        assert row[count:TOPK] == [-1] * (TOPK - count), p  # padding
        blocks = toks[0 : complete * R : R]
        for i, b0 in enumerate(blocks):  # whole visible blocks, 4 consecutive tokens each
            assert b0 % R == 0 and b0 // R < (p + 1) // R, p
            assert toks[i * R : (i + 1) * R] == list(range(b0, b0 + R)), p
        start = (p + 1) // R * R  # the open tail group, query token included
        assert toks[complete * R :] == list(range(start, start + tail)), p
        if p + 1 <= TOPK:  # dense causal
            assert sorted(toks) == list(range(p + 1)), p
        unsorted_rows += len(blocks) >= 8 and blocks != sorted(blocks)
    many = sum(min((p + 1) // R, BUDGET) >= 8 for p in LAYOUT_POSITIONS.tolist())
    assert unsorted_rows == many  # blocks in random order


@pytest.mark.parametrize("selection", MODES)
def test_deterministic_and_inert_rows(selection):
    pos = torch.tensor([-1, 0, 3, 5000, 5001, -1])
    a = qsa_indices(pos, selection=selection, generator=_gen(7))
    b = qsa_indices(pos, selection=selection, generator=_gen(7))
    assert torch.equal(a, b)
    for r in (0, 5):  # padded rows (position -1): all -1, count 0
        assert a[r, TOPK] == 0 and (a[r, :TOPK] == -1).all()


def test_unknown_selection():
    with pytest.raises(ValueError, match="selection"):
        qsa_indices(torch.arange(4), selection="sorted")


def test_correlated_chunking_does_not_change_rows(monkeypatch):
    pos = torch.arange(3000, 3300)
    whole = qsa_indices(pos, selection="correlated", generator=_gen(3))
    monkeypatch.setattr(qs, "_CHUNK_ELEMS", 1000 * 37)  # 49 rows per chunk at 751 blocks
    assert torch.equal(qsa_indices(pos, selection="correlated", generator=_gen(3)), whole)


# ----------------------------------------------------------------------------------------------
# correlation
# ----------------------------------------------------------------------------------------------

POSITIONS = torch.arange(4000, 4601)  # 1000-1150 visible blocks, 512 selected


@pytest.fixture(scope="module")
def correlated():
    return qsa_indices(POSITIONS, selection="correlated", generator=_gen(11))


def _mean_jaccard(sets: list[set[int]], d: int) -> float:
    js = [len(a & b) / len(a | b) for a, b in zip(sets, sets[d:])]
    return sum(js) / len(js)


def test_correlated_adjacent_jaccard(correlated):
    jac, union4 = selection_stats(correlated, 4)
    assert 0.85 <= jac <= 0.95, jac
    sets = _block_sets(correlated)
    assert all(len(s) == BUDGET for s in sets)
    assert jac == pytest.approx(_mean_jaccard(sets, 1), abs=1e-9)
    # rows further apart share less; far apart they still share the common base scores
    j4, j32 = _mean_jaccard(sets, 4), _mean_jaccard(sets, 32)
    assert jac > j4 + 0.1 and j4 > j32 + 0.1 and j32 > 0.3, (jac, j4, j32)
    # a 4-row tile's union is little more than one row's selection
    assert 1.05 < union4 < 1.3, union4
    union8 = selection_stats(correlated, 8)[1]
    assert union4 < union8 < 1.6, union8


def test_independent_is_uncorrelated():
    packed = qsa_indices(POSITIONS, selection="independent", generator=_gen(11))
    jac, union4 = selection_stats(packed, 4)
    # 512 of ~1075 blocks drawn independently: Jaccard ~ 512 / (2 * 1075 - 512) ~ 0.31
    assert 0.25 < jac < 0.4, jac
    assert union4 > 1.8, union4


# ----------------------------------------------------------------------------------------------
# selection_stats on hand-built rows
# ----------------------------------------------------------------------------------------------


def _packed(rows: list[list[int]], tails: list[int] | None = None, topk: int = TOPK) -> torch.Tensor:
    """Packed rows from block lists (-1: a hole inside the counted prefix), each followed by a
    tail of ``tails[i]`` tokens after its last block."""
    out = torch.full((len(rows), topk + 1), -1, dtype=torch.int32)
    for i, blocks in enumerate(rows):
        toks = [b * R + j if b >= 0 else -1 for b in blocks for j in range(R)]
        tail = tails[i] if tails else 0
        toks += [(max(blocks) + 1) * R + j for j in range(tail)]
        out[i, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
        out[i, topk] = len(toks)
    return out


def _shuffled(blocks: range, seed: int) -> list[int]:
    return [blocks[i] for i in torch.randperm(len(blocks), generator=_gen(seed)).tolist()]


@pytest.mark.parametrize("stats_elems", [None, 1])  # 1: one tile of rows per chunk
def test_selection_stats_known_answer(monkeypatch, stats_elems):
    if stats_elems:
        monkeypatch.setattr(qs, "_STATS_ELEMS", stats_elems)
    rows = [_shuffled(range(0, 512), 0), _shuffled(range(1, 513), 1), _shuffled(range(2, 514), 2),
            _shuffled(range(0, 512), 3), list(range(10)), _shuffled(range(100, 612), 4)]
    packed = _packed(rows, tails=[3, 0, 1, 2, 1, 0])
    # counted pairs (0, 1), (1, 2), (2, 3); row 4 has 10 complete blocks and breaks (3, 4), (4, 5)
    jac, _ = selection_stats(packed, 2)
    assert jac == pytest.approx((511 / 513 + 511 / 513 + 510 / 514) / 3, rel=1e-12)
    # tiles of 2: {0, 1} union 513, {2, 3} union 514, {4, 5} not counted
    assert selection_stats(packed, 2)[1] == pytest.approx(513.5 / 512, rel=1e-12)
    # tiles of 3: {0, 1, 2} union 514; {3, 4, 5} has row 4
    assert selection_stats(packed, 3)[1] == pytest.approx(514 / 512, rel=1e-12)
    # tiles of 4: {0..3} union 514; the partial tile {4, 5} is dropped
    assert selection_stats(packed, 4)[1] == pytest.approx(514 / 512, rel=1e-12)
    # every row counts with min_complete 10
    jac10, union10 = selection_stats(packed, 2, min_complete=10)
    pairs = [511 / 513, 511 / 513, 510 / 514, 10 / 512, 0.0]
    assert jac10 == pytest.approx(sum(pairs) / 5, rel=1e-12)
    assert union10 == pytest.approx((513 + 514 + 522) / 3 / ((512 * 5 + 10) / 6), rel=1e-12)


def test_selection_stats_small_sets_and_holes():
    # row 1 has a -1 block inside its counted prefix: its set is {1, 2, 3}
    packed = _packed([[0, 1, 2], [1, 2, -1, 3]], topk=23)
    jac, union = selection_stats(packed, 2, min_complete=3)
    assert jac == pytest.approx(2 / 4)
    assert union == pytest.approx(4 / 3)
    assert all(math.isnan(x) for x in selection_stats(packed, 2))  # no row has 512 blocks
    assert all(math.isnan(x) for x in selection_stats(packed[:0], 2))
    disjoint = _packed([[0, 1], [2, 3], [4, 5], [6, 7]], topk=23)
    assert selection_stats(disjoint, 4, min_complete=2) == (0.0, 4.0)
