"""The balanced split schedule of the SM90 paged decode, on the device (role): which requests, which
of their tiles and which partial slots a CTA's chunk takes, from the lengths in ``seq_lens``.

The specification is the host plan (:mod:`cute_kernels.plans.sm90_decode_balance`); this is the
same partition in the device's form. Every warp of a CTA computes it (no shared memory, no
barrier): each lane sums the units of a contiguous block of requests, a warp scan gives the
batch's total and each block's first unit, and the lane whose block holds the chunk's first
unit finds the request there. The integer steps are plain functions taking ``imin`` / ``imax``,
traced with DSL integers by the kernel and run with Python ints by the CPU tests (which emulate
the warp around them). Design: docs/design/sm90-decode.md#balanced-schedule-opt-in.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# ---------------------------------------------------------------------------------------------
# integer steps (DSL integers in the kernel, Python ints in the CPU tests)
# ---------------------------------------------------------------------------------------------


def units_of(seq_len, kv_cap, tile: int, imin=min, imax=max):
    """``(units, tiles)`` of a request: the tiles of its keys below the table's capacity, and at
    least one unit (an empty request's chunk writes its 0 / -inf output)."""
    tiles = (imin(imax(seq_len, 0), kv_cap) + tile - 1) // tile
    return imax(tiles, 1), tiles


def active_chunks(total, longest, chunks, min_chunk: int, max_parts: int, imin=min, imax=max):
    """``(active, q, r)``: the chunks that take work and the quotient and remainder of the
    batch's units over them (chunk ``c`` has ``q + 1`` units if ``c < r``, else ``q``)."""
    q_min = imax(longest + max_parts - 2, 0) // (max_parts - 1)
    active = imin(imax(total // imax(q_min, min_chunk), 1), chunks)
    q = total // active
    return active, q, total - q * active


def chunk_start(c, q, r, imin=min):
    """First unit of chunk ``c``."""
    return c * q + imin(c, r)


def chunk_of(unit, q, r, imin=min, imax=max):
    """The chunk holding ``unit``, without a branch: the first ``r`` chunks are ``q + 1`` long."""
    long_end = r * (q + 1)
    in_long = imin(imax(long_end - unit, 0), 1)  # 1 when the unit lies in the longer chunks
    return in_long * (unit // (q + 1)) + (1 - in_long) * (r + imax(unit - long_end, 0) // q)


def segment_of(c, chunks, start, end, first, units, q, r, imin=min, imax=max):
    """What chunk ``c`` (units ``[start, end)`` of a grid of ``chunks`` per KV head) does with the
    request whose units are ``[first, first + units)``: ``(lo, hi, whole, slot, parts, slot0,
    c0)``: its units ``[lo, hi)`` relative to the request; ``whole`` 1 when the request lies in
    this chunk (its output written directly), else its partial goes to ``slot`` (``c`` when the
    segment opens the chunk, else ``chunks + c``); the request's ``parts`` partials are slots
    ``slot0, c0 + 1, ..., c0 + parts - 1`` in merge order."""
    lo = imax(start, first) - first
    hi = imin(first + units, end) - first
    whole = imin(imax(first - start + 1, 0), 1) * imin(imax(end - first - units + 1, 0), 1)
    opens = imin(imax(start - first + 1, 0), 1)
    slot = c + chunks * (1 - opens)
    c0 = chunk_of(first, q, r, imin, imax)
    parts = chunk_of(first + units - 1, q, r, imin, imax) - c0 + 1
    slot0 = c0 + chunks * imin(first - chunk_start(c0, q, r, imin), 1)
    return lo, hi, whole, slot, parts, slot0, c0


def merge_slot(s, slot0, c0, imax=max):
    """Slot of a request's ``s``-th partial in merge order."""
    return c0 + s + (slot0 - c0) * imax(1 - s, 0)


# ---------------------------------------------------------------------------------------------
# the warp's part
# ---------------------------------------------------------------------------------------------


class BalancedChunks:
    """A CTA's chunk of a balanced launch: ``tile`` tokens per unit; ``min_chunk`` and
    ``max_parts`` from the plan (the shortest chunk, the most partials of one request)."""

    def __init__(self, *, tile: int, min_chunk: int, max_parts: int):
        self.tile, self.min_chunk, self.max_parts = tile, min_chunk, max_parts

    @cute.jit
    def units(self, seq_len, kv_cap):
        return units_of(seq_len, kv_cap, self.tile, cutlass.min, cutlass.max)

    @cute.jit
    def locate(self, mSeqLens, kv_cap, chunk, chunks, lane):
        """``(start, end, request, first, q, r)`` of chunk ``chunk``: its units ``[start, end)``
        (empty for an idle chunk), the request holding unit ``start`` and that request's first
        unit, and the partition's ``q``, ``r`` (:func:`active_chunks`). Every lane gets the same
        values."""
        batch = mSeqLens.shape[0]
        per_lane = (batch + 31) // 32
        lo = cutlass.min(lane * per_lane, batch)
        hi = cutlass.min(lo + per_lane, batch)
        total = Int32(0)
        longest = Int32(0)
        for b in cutlass.range(lo, hi, unroll=4):
            u, _ = self.units(mSeqLens[b], kv_cap)
            total = total + u
            longest = cutlass.max(longest, u)
        upto = total  # inclusive scan of the lanes' block sums
        for off in (1, 2, 4, 8, 16):
            below = cute.arch.shuffle_sync_up(upto, off)
            if lane >= off:
                upto = upto + below
            longest = cutlass.max(longest, cute.arch.shuffle_sync_bfly(longest, off))
        all_units = cute.arch.shuffle_sync(upto, 31)
        active, q, r = active_chunks(all_units, longest, chunks, self.min_chunk, self.max_parts, cutlass.min,
                                     cutlass.max)
        start = all_units
        end = all_units
        if chunk < active:
            start = chunk_start(chunk, q, r, cutlass.min)
            end = chunk_start(chunk + 1, q, r, cutlass.min)
        # the lane whose block holds unit `start` walks it (its values are in L1 from the sums)
        request = Int32(0)
        first = Int32(0)
        block_first = upto - total
        if block_first <= start and start < upto:
            p = block_first
            for b in cutlass.range(lo, hi, unroll=1):
                u, _ = self.units(mSeqLens[b], kv_cap)
                if p <= start and start < p + u:
                    request = b
                    first = p
                p = p + u
        for off in (1, 2, 4, 8, 16):  # one lane holds them, the others 0
            request = request + cute.arch.shuffle_sync_bfly(request, off)
            first = first + cute.arch.shuffle_sync_bfly(first, off)
        return start, end, request, first, q, r

    @cute.jit
    def segment(self, seq_len, kv_cap, c, chunks, start, end, first, q, r):
        """``(units, tiles, lo, hi, whole, slot, parts, slot0, c0)`` of the request at ``first``
        (:func:`segment_of`), ``hi`` clamped to its tiles."""
        units, tiles = self.units(seq_len, kv_cap)
        lo, hi, whole, slot, parts, slot0, c0 = segment_of(c, chunks, start, end, first, units, q, r, cutlass.min,
                                                           cutlass.max)
        return units, tiles, lo, cutlass.min(hi, tiles), whole, slot, parts, slot0, c0
