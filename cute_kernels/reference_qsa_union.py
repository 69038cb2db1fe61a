"""Reference of the QSA row-tile union pre-pass (``sm90/qsa_union.py``): part of the contract of
:mod:`cute_kernels.reference`, kept in its own module to keep each source file small."""

from __future__ import annotations

import torch
from torch import Tensor


def qsa_union_reference(packed_indices: Tensor, token_to_req: Tensor, block_table_width: int, page_size: int,
                        rows_per_tile: int, union_cap: int, max_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """The row-tile union pre-pass of QSA sparse prefill (``sm90/qsa_union.py``).

    Rows are grouped in tiles of ``R = rows_per_tile`` consecutive rows (tile ``t`` covers rows
    ``t R .. min(T, (t + 1) R) - 1``; ``NT = ceil(T / R)``). Entry ``(r, c)`` is a *candidate*
    iff ``c < clamp(packed_indices[r, -1], 0, TOPK)`` and its token ``tok`` satisfies
    ``tok >= 0``, ``tok // page_size < block_table_width`` and ``tok < max_tokens``.

    A tile *falls back* (``length = -1``) iff its rows do not all have the request of its first
    row, or a row has the same candidate twice (the attention counts it twice, a union cannot),
    or it has more than ``union_cap`` distinct candidates ``U``. Otherwise ``length = U``,
    ``union[t, :U]`` holds the distinct candidates in ascending order and ``member[t, r, w]`` has
    bit ``b`` set iff ``union[t, 32 w + b]`` is a candidate of the tile's row ``r``.

    Returns ``(union int32 [NT, union_cap], member int32 [NT, R, union_cap // 32], length int32
    [NT])``. Where the kernel leaves entries undefined (past ``roundup(U, 64)`` in ``union``, all
    of a falling-back tile) this returns -1 in ``union`` and 0 in ``member``; ``union`` between
    ``U`` and ``roundup(U, 64)`` is -1 by contract.
    """
    T, width = packed_indices.shape
    R = rows_per_tile
    topk = max(width - 1, 0)
    num_tiles = -(-T // R)
    dev = packed_indices.device
    union = torch.full((num_tiles, union_cap), -1, dtype=torch.int32, device=dev)
    member = torch.zeros((num_tiles, R, union_cap // 32), dtype=torch.int32, device=dev)
    length = torch.zeros((num_tiles,), dtype=torch.int32, device=dev)
    if num_tiles == 0:
        return union, member, length
    tok = packed_indices[:, :topk].long()
    count = packed_indices[:, width - 1].long().clamp(0, topk) if width else tok.new_zeros(T)
    counted = torch.arange(tok.shape[1], device=dev).view(1, -1) < count.view(-1, 1)
    page = torch.div(tok.clamp_min(0), page_size, rounding_mode="floor")
    cand = counted & (tok >= 0) & (page < block_table_width) & (tok < max_tokens)
    reqs = token_to_req.long()
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.long, device=dev)
    for t in range(num_tiles):
        r0, r1 = t * R, min(T, (t + 1) * R)
        if bool((reqs[r0:r1] != reqs[r0]).any()):
            length[t] = -1
            continue
        rows = [tok[r, cand[r]] for r in range(r0, r1)]
        if any(x.unique().numel() != x.numel() for x in rows):
            length[t] = -1
            continue
        u = torch.unique(torch.cat(rows))  # sorted
        if u.numel() > union_cap:
            length[t] = -1
            continue
        length[t] = u.numel()
        union[t, :u.numel()] = u.to(torch.int32)
        bits = torch.zeros((R, union_cap), dtype=torch.long, device=dev)
        for i, x in enumerate(rows):
            bits[i, torch.searchsorted(u, x)] = 1
        words = (bits.view(R, union_cap // 32, 32) * weights).sum(-1)  # [0, 2^32): wrap to int32
        member[t] = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return union, member, length
