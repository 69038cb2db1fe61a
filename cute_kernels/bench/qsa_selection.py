"""Synthetic QSA selections (packed ``logical_indices`` rows, contract §1) for the benchmark and tests.

Imports only torch, so GPU tests and other benchmarks can build the same inputs as
``cute-kernels bench qsa`` without its CLI or the kernels.

Two selection models for the ``min(visible, 512)`` complete 4-token blocks of a row at request
position p (visible blocks: b < (p + 1) // 4):

- ``independent``: every row draws its own uniformly random blocks, no correlation between rows
  (the worst case for a kernel that shares a gather between neighbouring rows).
- ``correlated``: an indexer whose block scores drift slowly with the query position. Row p scores
  block b as ``cos(a) * base[b] + sin(a) * W(p, b)``: ``base`` is one N(0, 1) score per block shared
  by all rows, and ``W`` is a smooth unit-variance noise field in p, independently per block. W
  rotates between independent N(0, 1) knot vectors placed every ``corr_rows`` positions:
  ``W(p) = cos(t) K_j + sin(t) K_{j+1}`` with ``j = (p + s_b) // corr_rows`` and
  ``t = ((p + s_b) % corr_rows) / corr_rows * pi / 2``. The random per-block shift s_b in
  [0, corr_rows) keeps the statistics of a tile independent of where it starts. So W has unit
  variance at every p, adjacent rows' noise has correlation ``cos(pi / (2 corr_rows))`` (also
  across knots), and rows ``>= 2 corr_rows`` apart have independent noise: they share only
  ``base``. The row keeps its top-512 visible blocks.

  The mixing angle a is chosen per row from its visible count vis, so that the expected
  adjacent-row Jaccard of the complete-block sets is ``corr_jaccard`` at every context length.
  The swaps per step are m = 512 (1 - J) / (1 + J). A small step moves
  ``vis * phi(z) * sin(a) * delta / sqrt(2 pi)`` blocks into the top 512 (and as many out).
  Here z = Phi^-1(1 - 512 / vis) is the selection threshold and delta is the std of
  W(p + 1) - W(p). sin(a) is clamped to 1: just above 512 visible blocks few blocks are left
  out, so rows there are more alike.

  Measured on 1 x 16384 with the defaults (corr_rows 8, corr_jaccard 0.90):
  - adjacent-row Jaccard 0.90 for every visible count above ~700 (0.98 at 512-600), and 0.90
    on average;
  - 0.82 at 2 rows apart, 0.69 at 4, 0.53 at 8, ~0.45 at 16-256, then lower as new blocks
    become visible (0.40 at 1024, 0.29 at 4096);
  - a tile's union over its mean row set (``selection_stats``, rows with 512 complete blocks):
    1.15 for 4 rows, 1.20 for 5, 1.33 for 8; ``independent`` gives 2.6 / 3.0 / 3.6.
  For comparison, vllm RFC #55394 measured 0.87-0.94 between neighbouring prefill rows of real
  selection dumps.

Both models keep the rest of the row layout the same. The selected blocks come in random
(top-k output) order, each expanded to its 4 tokens. Then come the ``(p + 1) % 4`` tokens of the
open group starting at ``(p + 1) // 4 * 4``, then -1 padding. The last column holds
``valid_count = complete * 4 + tail``. A row with p + 1 <= 2051 is dense causal in both models;
only the order of its blocks is random.
"""

from __future__ import annotations

import math

import torch

TOPK, BUDGET, R = 2051, 512, 4
SELECTIONS = ("independent", "correlated")
CORR_ROWS = 8  # positions between the noise field's knots (quarter period of its rotation)
CORR_JACCARD = 0.90  # target mean Jaccard of adjacent rows' complete-block sets
_CHUNK_ELEMS = 1 << 22  # score elements per chunk of rows in the correlated model
_STATS_ELEMS = 1 << 26  # membership elements per chunk of rows in selection_stats


def qsa_indices(positions: torch.Tensor, *, topk: int = TOPK, budget: int = BUDGET,
                selection: str = "independent", generator: torch.Generator | None = None,
                corr_rows: int = CORR_ROWS, corr_jaccard: float = CORR_JACCARD) -> torch.Tensor:
    """Packed ``[rows, topk + 1]`` int32 indices of QSA rows at request ``positions`` (contract
    §1). Each row has ``min(visible, budget)`` distinct complete blocks in random order, expanded
    to 4 tokens each, then the open tail group; -1 padding; valid_count last. ``selection``
    picks how blocks are chosen (module docstring). ``generator`` must be on ``positions``'
    device."""
    pos = positions.long()
    vis = (pos + 1) // R
    complete = vis.clamp(max=budget)
    if selection == "independent":
        blocks = _independent_blocks(vis, budget, generator)
    elif selection == "correlated":
        blocks = _correlated_blocks(pos, vis, budget, generator, corr_rows, corr_jaccard)
    else:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    return _pack(pos, complete, blocks, topk)


def _independent_blocks(vis, budget, generator):
    """``[rows, k]`` uniformly random distinct visible blocks per row, valid ones first."""
    maxvis = max(int(vis.max()), 1)
    scores = torch.rand(vis.numel(), maxvis, device=vis.device, generator=generator)
    scores.masked_fill_(torch.arange(maxvis, device=vis.device)[None] >= vis[:, None], -1.0)
    return scores.topk(min(budget, maxvis), dim=1).indices  # random order; valid (score >= 0) first


def _correlated_blocks(pos, vis, budget, generator, corr_rows, corr_jaccard):
    """``[rows, k]`` top-``budget`` visible blocks under the drifting score model (module
    docstring), in random order with the valid ones first."""
    dev, rows = pos.device, pos.numel()
    maxvis = max(int(vis.max()), 1)
    k = min(budget, maxvis)
    base = torch.randn(maxvis, device=dev, generator=generator)
    # each block's knots sit at its own offset, so that the field's statistics do not depend on
    # where a tile of rows starts
    shift = torch.randint(0, corr_rows, (maxvis,), device=dev, generator=generator)
    j0 = int(pos.min()) // corr_rows
    knots = torch.randn((int(pos.max()) + corr_rows - 1) // corr_rows - j0 + 2, maxvis, device=dev,
                        generator=generator)
    angle = torch.arange(corr_rows, device=dev) * (math.pi / (2 * corr_rows))
    cos_t, sin_t = angle.cos(), angle.sin()
    # the per-row mixing weight sin(a) that makes ~m blocks swap per position step
    swaps = budget * (1 - corr_jaccard) / (1 + corr_jaccard)
    frac = (budget / vis.clamp(min=1).double()).clamp(max=1 - 1e-9)  # share of visible blocks kept
    z = math.sqrt(2) * torch.erfinv(1 - 2 * frac)  # score threshold of the top `frac`
    density = torch.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    step = math.sqrt(2 * (1 - math.cos(math.pi / (2 * corr_rows))))  # std of W(p + 1) - W(p)
    sin_a = (swaps * math.sqrt(2 * math.pi) / (vis.clamp(min=1) * density * step)).clamp(max=1).float()
    cos_a = (1 - sin_a * sin_a).sqrt()
    out = torch.empty(rows, k, dtype=torch.long, device=dev)
    chunk = max(1, _CHUNK_ELEMS // maxvis)
    for a in range(0, rows, chunk):
        p, v = pos[a : a + chunk], vis[a : a + chunk]
        nv = max(int(v.max()), 1)
        q = p[:, None] + shift[:nv]  # [chunk, nv] position on the block's own knot grid
        j, r = q // corr_rows - j0, q % corr_rows
        del q
        w = knots[:, :nv].gather(0, j) * cos_t[r]
        w += knots[:, :nv].gather(0, j + 1) * sin_t[r]
        del j, r
        scores = cos_a[a : a + chunk, None] * base[:nv] + sin_a[a : a + chunk, None] * w
        del w
        scores.masked_fill_(torch.arange(nv, device=dev)[None] >= v[:, None], -math.inf)
        kc = min(k, nv)
        out[a : a + chunk, :kc] = scores.topk(kc, dim=1, sorted=False).indices
        out[a : a + chunk, kc:] = maxvis  # no block: invalid in every row
    # random order of each row's selected blocks with the valid (visible) ones first: every row
    # has exactly `complete` of them, the top-k of its finite scores. Sorted first, so that the
    # result does not depend on topk's unsorted order (which depends on the chunking and device)
    out = out.sort(dim=1).values
    keys = torch.rand(rows, k, device=dev, generator=generator)
    keys.masked_fill_(out >= vis[:, None], 2.0)
    return out.gather(1, keys.argsort(dim=1))


def _pack(pos, complete, blocks, topk):
    """The packed rows: ``blocks[:, :complete]`` expanded to 4 tokens, the open tail group, -1
    padding, valid_count in column ``topk``."""
    dev, rows, k = pos.device, pos.numel(), blocks.shape[1]
    tail = (pos + 1) % R
    count = complete * R + tail
    toks = (blocks[:, :, None] * R + torch.arange(R, device=dev)).reshape(rows, k * R)
    rank = torch.arange(k * R, device=dev)[None]
    toks = torch.where(rank < complete[:, None] * R, toks, torch.full_like(toks, -1))
    packed = torch.full((rows, topk + 1), -1, dtype=torch.int64, device=dev)
    packed[:, : k * R] = toks
    for j in range(R - 1):  # the tail group: tokens start .. start + tail - 1
        col = complete * R + j
        val = (pos + 1) // R * R + j
        keep = j < tail
        packed[keep, col[keep]] = val[keep]
    packed[:, topk] = count
    return packed.int()


def selection_stats(packed: torch.Tensor, rows_per_tile: int, *, min_complete: int = BUDGET,
                    topk: int | None = None) -> tuple[float, float]:
    """``(jaccard, union_factor)`` of the complete-block sets of packed QSA rows. A row's set is
    the blocks ``t // 4`` of its counted entries ``t >= 0`` at columns ``4 i``, for
    ``i < valid_count // 4``. Only rows with at least ``min_complete`` complete blocks count
    (default 512, the sparse rows).

    - ``jaccard``: mean |A & B| / |A | B| over adjacent row pairs where both rows count.
    - ``union_factor``: mean size of the union of a tile, divided by the mean set size of the
      tiles' rows. Tiles are ``rows_per_tile`` consecutive rows aligned to row 0, and a tile is
      used only if all its rows count. 1 means every tile's rows select the same blocks;
      ``rows_per_tile`` means they share none.

    Either value is NaN when nothing counts. ``topk``: the count column, default the last."""
    topk = packed.shape[1] - 1 if topk is None else topk
    rows, dev = packed.shape[0], packed.device
    if rows == 0:
        return math.nan, math.nan
    ncomp = packed[:, topk].long() // R
    kmax = min(int(ncomp.max()), topk // R)
    starts = packed[:, 0 : kmax * R : R].long()  # first token of each complete block
    live = (torch.arange(kmax, device=dev)[None] < ncomp[:, None]) & (starts >= 0)
    nblk = int(starts.max()) // R + 1 if kmax else 0
    ok = ncomp >= min_complete
    inter_sum = 0.0
    pairs = 0
    tile_union = tile_rows = 0.0
    tiles = 0
    chunk = max(rows_per_tile, _STATS_ELEMS // max(nblk, 1) // rows_per_tile * rows_per_tile)
    prev = None  # membership row and ok flag of the row before this chunk
    for a in range(0, rows, chunk):
        b = min(a + chunk, rows)
        memb = torch.zeros(b - a, nblk + 1, dtype=torch.bool, device=dev)  # last column: dropped
        idx = torch.where(live[a:b], starts[a:b] // R, nblk)
        memb.scatter_(1, idx, True)
        memb = memb[:, :nblk]
        size = memb.sum(1).double()
        k_ok = ok[a:b]
        # adjacent pairs inside the chunk and across its start
        m_all = memb if prev is None else torch.cat([prev[0], memb])
        s_all = size if prev is None else torch.cat([prev[0].sum(1).double(), size])
        o_all = k_ok if prev is None else torch.cat([prev[1], k_ok])
        inter = (m_all[1:] & m_all[:-1]).sum(1).double()
        uni = s_all[1:] + s_all[:-1] - inter
        pair_ok = o_all[1:] & o_all[:-1]
        inter_sum += float((inter / uni.clamp(min=1))[pair_ok].sum())
        pairs += int(pair_ok.sum())
        prev = (memb[-1:], k_ok[-1:])
        # whole tiles (chunk starts are multiples of rows_per_tile)
        nt = (b - a) // rows_per_tile
        if nt:
            n = nt * rows_per_tile
            t_ok = k_ok[:n].view(nt, rows_per_tile).all(1)
            t_union = memb[:n].view(nt, rows_per_tile, nblk).any(1).sum(1).double()
            tile_union += float(t_union[t_ok].sum())
            tile_rows += float(size[:n].view(nt, rows_per_tile)[t_ok].sum())
            tiles += int(t_ok.sum())
    jaccard = inter_sum / pairs if pairs else math.nan
    union_factor = (tile_union / tiles) / (tile_rows / (tiles * rows_per_tile)) if tiles else math.nan
    return jaccard, union_factor
