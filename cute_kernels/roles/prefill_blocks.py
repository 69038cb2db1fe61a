"""Index math of the paged prefill: which query rows a CTA owns, which KV tiles it visits, which
of them need masking, where each page box comes from.

Pure integer arithmetic without branches and without imports, written once for two callers: the
kernel traces it with DSL integers (passing ``cutlass.min`` / ``cutlass.max``), the host plan and
the CPU tests call it with Python ints and check it against brute force. Design:
docs/design/sm90-prefill.md#index-math.
"""

from __future__ import annotations


def request_rows(qsl_lo, qsl_hi, total_rows, imin=min, imax=max):
    """``(q_start, q_len)`` of a request from its two ``query_start_loc`` entries, clamped into
    ``[0, total_rows]`` so that a corrupted table can never address a row outside q / out (a
    decreasing pair gives ``q_len = 0``)."""
    start = imin(imax(qsl_lo, 0), total_rows)
    end = imin(imax(qsl_hi, start), total_rows)
    return start, end - start


def kv_cap(seq_len, table_width, page_size, imin=min, imax=max):
    """KV positions that can be attended at all: ``seq_len`` clamped into ``[0, W * page]`` (the
    block table's capacity; positions past it are never read, as if masked)."""
    return imax(imin(seq_len, table_width * page_size), 0)


def row_limit(j, q_len, seq_len, cap, causal: bool, imin=min, imax=max):
    """Query row ``j`` (0-based in its request) sees KV positions ``< row_limit``: all of
    ``min(seq_len, cap)``, or causally ``seq_len - q_len + j + 1`` of them; never negative."""
    if causal:
        return imax(imin(seq_len - q_len + j + 1, cap), 0)
    return imax(imin(seq_len, cap), 0)


def n_block_range(m_block, tile_m: int, tile_n: int, q_len, seq_len, cap, causal: bool, imin=min, imax=max):
    """``(n_max, n_unmasked)`` for query block ``m_block`` of a request: the CTA visits KV tiles
    ``[0, n_max)``; tiles ``[0, n_unmasked)`` are visible to every real row of the block and need
    no mask, tiles ``[n_unmasked, n_max)`` are masked per row (the causal diagonal and the tail).
    ``n_max = 0`` for an empty block (rows past ``q_len``) or rows that see nothing."""
    first = m_block * tile_m
    last = imax(imin(first + tile_m, q_len) - 1, first)  # the last real row (first if none)
    hi = row_limit(last, q_len, seq_len, cap, causal, imin, imax)
    lo = row_limit(first, q_len, seq_len, cap, causal, imin, imax)
    live = imin(imax(q_len - first, 0), 1)  # 0 when the block holds no real row
    n_max = (hi + tile_n - 1) // tile_n * live
    return n_max, imin(lo // tile_n, n_max)


def window_tiles(m_block, tile_m: int, tile_n: int, q_len, seq_len, window_left, n_max, imin=min, imax=max):
    """``(n_min, lo_first, lo_last)`` of query block ``m_block`` under a sliding window
    (``window_left = w``; row j at ``p = seq_len - q_len + j`` sees keys ``>= p - w``): the block
    visits KV tiles ``[n_min, n_max)`` only, the first of them holding ``lo_first``, its first
    row's window start (the boxes wholly before it are never read); tiles that start before
    ``lo_last``, its last real row's window start, are masked per row from below. ``w = -1`` (no
    window): ``(0, 0, 0)``."""
    on = imin(imax(window_left + 1, 0), 1)  # 1 with a window, 0 without
    first = m_block * tile_m
    last = imax(imin(first + tile_m, q_len) - 1, first)
    lo_first = imax(seq_len - q_len + first - window_left, 0) * on
    lo_last = imax(seq_len - q_len + last - window_left, 0) * on
    return imin(lo_first // tile_n, n_max), lo_first, lo_last


def m_block_of(grid_y, num_m_blocks):
    """The query block a CTA row ``grid_y`` takes: the last block first, since causal blocks grow
    with their index (longest-processing-time order)."""
    return num_m_blocks - 1 - grid_y


def persistent_tile(t, num_q_heads, batch, m_blocks):
    """``(m_block, request, head)`` of work tile ``t`` of the persistent order: query blocks from
    the last (the longest causal work) down, outermost; then the request; then the query head,
    innermost, so the heads of one KV group are neighbours and share each K/V tile in L2
    (docs/design/sm90-prefill.md#scheduling)."""
    rest = t // num_q_heads
    return m_blocks - 1 - rest // batch, rest % batch, t - rest * num_q_heads


def box_source(tile, box_index, tile_n: int, box: int, page_size: int):
    """``(token, logical_page, box_in_page)`` of box ``box_index`` of KV tile ``tile``: its first
    KV position, the block-table column that holds it and which ``box``-token piece of that page
    it is (``box = min(page_size, tile_n)``)."""
    token = tile * tile_n + box_index * box
    return token, token // page_size, (token % page_size) // box
