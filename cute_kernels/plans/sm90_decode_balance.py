"""The balanced split schedule of the SM90 paged decode (opt-in): a ragged batch's KV tiles cut
into equal chunks, one per CTA, from the lengths actually present.

Host-only. The kernel computes this partition on the device from ``seq_lens`` (every warp of a
CTA, :mod:`cute_kernels.roles.balanced_chunks`), so the grid stays fixed and a CUDA graph replays
any batch; this module is its specification (the CPU tests check the device's arithmetic against
it and it against brute force) and the launch's shapes-only numbers: chunks per KV head and the
partials' slots. Design: docs/design/sm90-decode.md#balanced-schedule-opt-in.

The partition, per KV head (every head of a request has the same tiles):

- request ``b`` takes ``units_b = max(1, ceil(min(seq_len_b, W x page) / tile))`` units in a
  sequence of all requests' units in batch order (an empty request keeps one unit, so that the
  chunk holding it writes its 0 / -inf output);
- of the grid's ``C`` chunks, ``n = min(C, max(1, total // q_min))`` are active, ``q_min`` keeping
  chunks long enough that no request spans more than ``MAX_PARTS`` of them and no chunk is
  shorter than ``MIN_CHUNK_TILES``; chunk ``c < n`` covers units ``[start(c), start(c + 1))``,
  ``start(c) = c (total // n) + min(c, total % n)``: sizes within one unit of each other;
- a chunk attends, request after request, the segments its range cuts out of them. A request
  lying inside one chunk is whole: that chunk writes its output directly. A request a chunk
  boundary cuts (at most one per boundary) leaves one partial per chunk it spans, in slot ``c``
  when its segment opens chunk ``c``, else in slot ``C + c`` (a segment that does not open its
  chunk ends it), so ``2 C`` slots serve any batch; the last of them to arrive merges them in chunk
  order, which fixes the arithmetic and makes the result bitwise reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

# the shortest chunk, in tiles: about the static schedule's split granularity on small batches
# (a B 8 batch of 2000-token contexts splits into 2-3 tiles per CTA there)
MIN_CHUNK_TILES = 2
# the most partials one request leaves: the static schedule's split limit (the last CTA merges
# them in rounds of 16 from L2)
MAX_PARTS = 64


def request_units(seq_len: int, capacity: int, tile: int) -> tuple[int, int]:
    """``(units, tiles)`` of a request: the tiles its keys take (positions at or past the table's
    ``capacity`` are not attended; a negative length is empty), and at least one unit."""
    tiles = -(-min(max(seq_len, 0), capacity) // tile)
    return max(tiles, 1), tiles


def active_chunks(total: int, longest: int, chunks: int, min_chunk: int = MIN_CHUNK_TILES,
                  max_parts: int = MAX_PARTS) -> int:
    """How many of the grid's ``chunks`` take work: as many as keep each at least ``min_chunk``
    units and at least ``longest / (max_parts - 1)`` (a request of ``longest`` units then spans at
    most ``max_parts`` chunks), and at least one."""
    q_min = max(min_chunk, -(-longest // (max_parts - 1)))
    return min(max(total // q_min, 1), chunks)


def chunk_start(c: int, total: int, active: int) -> int:
    """First unit of chunk ``c`` (``c <= active``): ``total`` split into ``active`` near-equal
    parts, the first ``total % active`` one unit longer."""
    q, r = divmod(total, active)
    return c * q + min(c, r)


@dataclass(frozen=True)
class Segment:
    """What one chunk attends of one request: tiles ``[lo, hi)`` (empty for a request with no
    keys), and where its result goes: ``slot`` None for a whole request (its output), else the
    partial's workspace slot."""

    request: int
    lo: int
    hi: int
    slot: int | None


@dataclass(frozen=True)
class Partition:
    """A batch's balanced partition over a grid of ``chunks`` chunks per KV head: the requests'
    units, the active chunk count, each grid chunk's unit range and segments (idle chunks: an
    empty range, no segment), and per request its partials' slots in merge order (empty when it is
    whole)."""

    units: tuple[int, ...]
    active: int
    ranges: tuple[tuple[int, int], ...]
    segments: tuple[tuple[Segment, ...], ...]
    parts: tuple[tuple[int, ...], ...]


def balanced_partition(seq_lens, capacity: int, tile: int, chunks: int, min_chunk: int = MIN_CHUNK_TILES,
                       max_parts: int = MAX_PARTS) -> Partition:
    """The partition of a batch (``seq_lens``, a block table of ``capacity`` tokens, ``tile``
    tokens per tile) over ``chunks`` chunks per KV head (module docstring)."""
    per = [request_units(int(x), capacity, tile) for x in seq_lens]
    units = [u for u, _ in per]
    total = sum(units)
    n = active_chunks(total, max(units), chunks, min_chunk, max_parts)
    starts = [chunk_start(c, total, n) for c in range(n + 1)]
    ranges = [(starts[c], starts[c + 1]) if c < n else (total, total) for c in range(chunks)]
    first = [0]
    for u in units:
        first.append(first[-1] + u)
    segments: list[list[Segment]] = [[] for _ in range(chunks)]
    parts: list[list[int]] = [[] for _ in units]
    for c, (lo, hi) in enumerate(ranges):
        for b, u in enumerate(units):
            a, e = max(lo, first[b]), min(hi, first[b] + u)
            if a >= e:
                continue
            whole = lo <= first[b] and first[b] + u <= hi
            slot = None if whole else (c if a == lo else chunks + c)
            tiles = per[b][1]
            segments[c].append(Segment(b, min(a - first[b], tiles), min(e - first[b], tiles), slot))
            if slot is not None:
                parts[b].append(slot)
    return Partition(tuple(units), n, tuple(ranges), tuple(tuple(s) for s in segments), tuple(tuple(p) for p in parts))


def chunks_per_head(num_sms: int, ctas_per_sm: int, num_kv_heads: int) -> int:
    """Chunks per KV head of a balanced launch, from shapes only: one wave of ``ctas_per_sm`` CTAs
    on every SM, shared by the KV heads (grid ``[chunks, Hkv]``)."""
    return max(1, num_sms * ctas_per_sm // max(num_kv_heads, 1))


def fits_int32(batch: int, capacity: int, tile: int) -> bool:
    """Whether every unit count of a batch fits the kernel's 32-bit arithmetic (``batch`` requests
    of up to ``capacity`` tokens: the device sums their units in Int32)."""
    return batch * (capacity // tile + 2) < 2**31
