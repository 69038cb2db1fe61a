"""Control flow of the SM90 decode kernel's two fixes, emulated in Python on the CPU.

1. **The cluster variants' producer tail** (docs/design/sm90-decode.md#cluster-merge-exit): an
   mbarrier model (phase parity, arrival counts, ``try_wait.parity`` semantics) runs the producer
   and the consumers of the K (or V) pipeline as the kernel does for any tile count and stage
   count: the tail never blocks once the consumers have released every tile they consumed, and
   after it no completed phase of an empty barrier is left unwaited (without it, the last uses'
   releases are).
2. **Lengths past the block table** (docs/design/inputs.md#lengths): the kernel's tile count, its
   per-tile ``masked`` test and per-row limits, evaluated as the kernel evaluates them for every
   length, capacity, tile size and q_len, attend exactly the positions the reference attends.
"""

from __future__ import annotations

import itertools

import pytest


class MBarrier:
    """An mbarrier: ``count`` arrivals complete the current phase (its parity flips); a wait on
    parity ``p`` passes once the phase of parity ``p`` has completed, i.e. at once when the current
    phase's parity differs from ``p``."""

    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, count, 0
        self.completed = []  # completed phase numbers
        self.waited = set()  # completed phase numbers some thread has waited for

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed.append(self.phase)
            self.phase += 1
            self.pending = self.count

    def try_wait(self, parity: int) -> bool:
        if self.phase % 2 != parity:  # the phase of this parity is the last one, completed
            if self.phase > 0:
                self.waited.add(self.phase - 1)
            return True
        return False


class State:
    """The DSL's PipelineState: producers start at phase 1, consumers at 0."""

    def __init__(self, stages: int, phase: int):
        self.stages, self.index, self.phase = stages, 0, phase

    def advance(self):
        self.index += 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1


def run_pipeline(tiles: int, stages: int, tail: bool, consumer_warps: int = 4):
    """One pipeline (K or V) of a CTA: the producer fills ``tiles`` stages in order, the consumers
    wait for each, then release it (one arrive per warp); returns the empty barriers after the
    producer's optional tail, and whether the tail could finish."""
    full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(consumer_warps) for _ in range(stages)]
    prod, cons = State(stages, 1), State(stages, 0)
    produced = consumed = 0
    # interleave: the producer runs ahead while a stage is free, the consumer takes what is full
    while consumed < tiles:
        if produced < tiles and empty[prod.index].try_wait(prod.phase):
            full[prod.index].arrive()  # arrive.expect_tx, then the TMA bytes complete it
            prod.advance()
            produced += 1
            continue
        assert full[cons.index].try_wait(cons.phase), "consumer waits on a stage never filled"
        for _ in range(consumer_warps):
            empty[cons.index].arrive()  # consumer_release: lane 0 of each warp
        cons.advance()
        consumed += 1
    finished = True
    if tail:  # PipelineTmaAsync.producer_tail: wait on `stages` consecutive (index, phase)
        for _ in range(stages):
            if not empty[prod.index].try_wait(prod.phase):
                finished = False
                break
            prod.advance()
    return empty, finished


@pytest.mark.parametrize("stages", [2, 3, 4, 6, 8])
def test_producer_tail_never_blocks_and_leaves_no_release_unwaited(stages):
    for tiles in range(0, 3 * stages + 2):
        empty, finished = run_pipeline(tiles, stages, tail=True)
        assert finished, f"tail blocked: {tiles} tiles, {stages} stages"
        for b in empty:
            assert set(b.completed) <= b.waited, f"{tiles} tiles, {stages} stages: a release is never waited"


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_without_the_tail_the_last_releases_are_never_waited(stages):
    """What the cluster variants did before: with one tile or more, the consumers' releases of
    each stage's last use complete a phase no thread waits for."""
    for tiles in range(0, 3 * stages):
        empty, _ = run_pipeline(tiles, stages, tail=False)
        dangling = sum(len(set(b.completed) - b.waited) for b in empty)
        assert dangling == min(tiles, stages)


def kernel_visible(L: int, cap: int, tile: int, q_len: int, j: int, clamp: bool = True) -> set[int]:
    """The positions row j attends, as the kernel decides them: tiles < ceil(min(L, cap) / tile)
    (C division: none for a length <= 0); in a tile with (tile + 1) * T > min(L - q_len + 1, cap)
    ("masked"), position p is dropped when p >= min(L - q_len + j + 1, cap); an unmasked tile
    attends every position. ``clamp=False``: the kernel before the fix (no ``min`` with cap)."""
    end = min(L, cap) if clamp else L
    num_tiles = (end + tile - 1) // tile if end > 0 else 0
    limit = min(L - q_len + j + 1, cap) if clamp else L - q_len + j + 1
    first = min(L - q_len + 1, cap) if clamp else L - q_len + 1
    seen = set()
    for t in range(num_tiles):
        masked = (t + 1) * tile > first
        for p in range(t * tile, (t + 1) * tile):
            if masked and p >= limit:
                continue
            seen.add(p)
    return seen


def reference_visible(L: int, cap: int, q_len: int, j: int) -> set[int]:
    """The contract: positions < L - q_len + j + 1 and < the table's capacity."""
    return set(range(max(0, min(L - q_len + j + 1, cap))))


def test_kernel_attends_exactly_the_reference_positions():
    pages = (16, 32)
    for page, tile, q_len in itertools.product(pages, (64, 128), (1, 2, 4)):
        for W in range(0, 7):
            cap = W * page
            lengths = set(range(0, cap + 2 * tile + 3)) | {2**31 - 1, cap + 10**6}
            for L in lengths:
                for j in range(q_len):
                    assert kernel_visible(L, cap, tile, q_len, j) == reference_visible(L, cap, q_len, j), \
                        (page, tile, q_len, W, L, j)


def test_without_the_clamp_positions_past_the_table_were_attended():
    """Before: tiles up to ceil(L / tile) and limits from L alone, so a length past the table
    attended its zero-filled positions (the pages past the table read as zeros)."""
    cap, tile = 48, 64
    for L in (49, 100, 1000):
        old = kernel_visible(L, cap, tile, 1, 0, clamp=False)
        assert old - reference_visible(L, cap, 1, 0) == set(range(cap, L))
        assert kernel_visible(L, cap, tile, 1, 0) == reference_visible(L, cap, 1, 0)
