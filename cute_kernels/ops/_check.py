"""Checked mode's data rules: what the kernels cannot refuse without reading the data.

``CUTE_KERNELS_CHECK=1`` (or :func:`cute_kernels.ops._launch.set_checked`) makes every op run its
data checks before each launch: lengths within the block table's capacity, block-table entries of
the pages a request uses inside the pool, QSA valid counts within TOPK and selected pages inside
the pool, cache-write slots inside the cache, ``query_start_loc`` a partition of the rows, tensor
scales positive and finite, merge LSEs neither NaN nor +inf, RoPE positions inside the cache. A
violation raises ``ValueError`` naming the argument and its first bad index (row-major).

Each check reads the data on the host, so it synchronizes with the device: checked mode is a
debugging tool, off by default; without it every such input has the defined result listed in
docs/design/inputs.md.
"""

from __future__ import annotations

import torch


def _first(mask: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first True element of ``mask`` (row-major), or None."""
    idx = mask.nonzero()
    if idx.numel() == 0:
        return None
    return tuple(int(i) for i in idx[0].tolist())


def _at(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(str(i) for i in index)}]"


def lengths(name: str, seq_lens: torch.Tensor, capacity: int, *, q_len: int | None = None,
            q_lens: torch.Tensor | None = None) -> None:
    """Every ``seq_lens[b]`` lies in ``[q_len, capacity]`` (the block table's ``W * page``), or is 0
    (an empty request, as a padded CUDA-graph batch has) when only ``q_len`` is given; with
    ``q_lens`` (per request, prefill), in ``[q_lens[b], capacity]``."""
    lens = seq_lens.long()
    low = q_lens.long() if q_lens is not None else torch.full_like(lens, q_len or 0)
    bad = (lens > capacity) | (lens < low)
    if q_lens is None:
        bad &= lens != 0
    at = _first(bad)
    if at is not None:
        b = at[0]
        raise ValueError(f"{_at(name, at)} = {int(lens[b])} must lie in [query length {int(low[b])}, block-table "
                         f"capacity {capacity}]{' or be 0 (an empty request)' if q_lens is None else ''}")


def pages(name: str, block_table: torch.Tensor, seq_lens: torch.Tensor, page: int, num_pages: int) -> None:
    """The block-table entries of the pages each request's length uses lie in ``[0, num_pages)``."""
    B, W = block_table.shape
    if B == 0 or W == 0:
        return
    used_pages = (seq_lens.long().clamp(0, W * page) + page - 1) // page
    used = torch.arange(W, device=block_table.device).view(1, W) < used_pages.view(B, 1)
    ids = block_table.long()
    at = _first(used & ((ids < 0) | (ids >= num_pages)))
    if at is not None:
        b, c = at
        raise ValueError(f"{_at(name, at)} = {int(ids[b, c])} is outside [0, {num_pages}) (the pool), and "
                         f"seq_lens[{b}] = {int(seq_lens[b])} uses that page")


def query_start_loc(name: str, qsl: torch.Tensor, num_tokens: int, max_query_len: int | None = None) -> torch.Tensor:
    """``qsl`` starts at 0, never decreases, ends at ``num_tokens``, and no request is longer than
    ``max_query_len``; returns the query lengths."""
    starts = qsl.long()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {starts[:1].tolist()}")
    q_lens = starts.diff()
    at = _first(q_lens < 0)
    if at is not None:
        i = at[0] + 1
        raise ValueError(f"{name} must be non-decreasing: {name}[{i}] = {int(starts[i])} is below "
                         f"{name}[{i - 1}] = {int(starts[i - 1])}")
    if int(starts[-1]) != num_tokens:
        raise ValueError(f"{name}[{starts.numel() - 1}] = {int(starts[-1])} must equal the number of rows {num_tokens}")
    if max_query_len is not None:
        at = _first(q_lens > max_query_len)
        if at is not None:
            raise ValueError(f"max_query_len ({max_query_len}) is below request {at[0]}'s query length "
                             f"{int(q_lens[at[0]])}")
    return q_lens


def slots(name: str, slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot is -1 (padding) or lies in ``[0, num_slots)``."""
    s = slot_mapping.long()
    at = _first((s != -1) & ((s < 0) | (s >= num_slots)))
    if at is not None:
        raise ValueError(f"{_at(name, at)} = {int(s[at])} is outside [0, {num_slots}) (the cache's slots) and is "
                         "not -1 (padding)")


def qsa_selection(packed_indices: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor, page: int,
                  num_blocks: int) -> None:
    """QSA: valid counts in ``[0, TOPK]``, requests in range, and every counted entry -1 or a token
    on a page inside the block table whose physical page lies in the pool."""
    rows, width = packed_indices.shape
    topk = width - 1
    num_reqs, W = block_table.shape
    counts = packed_indices[:, topk].long()
    at = _first((counts < 0) | (counts > topk))
    if at is not None:
        raise ValueError(f"packed_indices[{at[0]}, {topk}] (the valid count) = {int(counts[at[0]])} must lie in "
                         f"[0, TOPK = {topk}]")
    req = token_to_req.long()
    at = _first((req < 0) | (req >= num_reqs))
    if at is not None:
        raise ValueError(f"{_at('token_to_req', at)} = {int(req[at[0]])} is outside [0, {num_reqs}) (the block "
                         "table's requests)")
    if rows == 0 or topk == 0:
        return
    tok = packed_indices[:, :topk].long()
    visited = torch.arange(topk, device=tok.device).view(1, topk) < counts.view(rows, 1)
    at = _first(visited & ((tok < -1) | (tok >= W * page)))
    if at is not None:
        raise ValueError(f"{_at('packed_indices', at)} = {int(tok[at])} is neither -1 nor a token of the block "
                         f"table's {W} x {page} positions")
    live = visited & (tok >= 0)
    if W == 0 or num_reqs == 0:
        return
    phys = block_table[req.clamp(0, num_reqs - 1).view(rows, 1), (tok.clamp(0, W * page - 1) // page)].long()
    at = _first(live & ((phys < 0) | (phys >= num_blocks)))
    if at is not None:
        r, c = at
        t = int(tok[r, c])
        raise ValueError(f"{_at('packed_indices', at)} = {t} lies on page block_table[{int(req[r])}, {t // page}] = "
                         f"{int(phys[r, c])}, outside [0, {num_blocks}) (the cache's blocks)")


def scales(**named) -> None:
    """Tensor scales hold positive finite values (floats were checked when the call was keyed)."""
    for name, value in named.items():
        if isinstance(value, torch.Tensor):
            v = value.detach().float().reshape(-1)
            at = _first(~(torch.isfinite(v) & (v > 0)))
            if at is not None:
                where = name if value.numel() == 1 else _at(name, at)
                raise ValueError(f"{where} = {float(v[at[0]])} must be positive and finite")


def lse(name: str, values: torch.Tensor) -> None:
    """LSEs are finite or -inf (an empty split): never NaN or +inf."""
    at = _first(torch.isnan(values) | (values == float("inf")))
    if at is not None:
        raise ValueError(f"{_at(name, at)} = {float(values[at])} must be finite or -inf (an empty split)")


def positions(name: str, pos: torch.Tensor, max_pos: int) -> None:
    """RoPE positions lie in ``[0, max_pos)`` (the cos/sin cache's rows)."""
    p = pos.long()
    at = _first((p < 0) | (p >= max_pos))
    if at is not None:
        raise ValueError(f"{_at(name, at)} = {int(p[at])} is outside [0, {max_pos}) (the cos_sin_cache's rows)")
