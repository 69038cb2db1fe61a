"""SM90 QSA row-tile union pre-pass (``sm90/qsa_union.py``) against ``reference_qsa_union.qsa_union_reference``,
exactly, on the H200.

Inputs are prefill-like: rows are consecutive positions of requests of random lengths (so some
tiles straddle two requests and must fall back), each row selecting QSA 4-token blocks that its
request's rows mostly share (a common block set with a few blocks swapped per row: heavy overlap,
the case the union path is for), dense causal rows early in a request, plus -1 holes inside the
counted prefix, small and garbage counts, tokens past the block table and, in one tile, a token
listed twice. ``T`` is never a multiple of R. Outputs are poisoned with 0x7fffffff first; the
test compares every entry the contract defines (``length``; for a tile that does not fall back,
``union`` up to ``roundup(U, 64)`` and every member word) and checks that nothing past that was
written.
"""

from __future__ import annotations

import pytest
import torch

from cute_kernels.jit.compiler import get_kernel
from cute_kernels.jit.spec import call_arguments
from cute_kernels.plans.sm90_qsa_union import QsaUnionConfig
from cute_kernels.reference_qsa_union import qsa_union_reference

from .conftest import sm90_only

pytestmark = sm90_only()
POISON = 0x7FFFFFFF
WIDTH = 2052  # TOPK 2051 + the count column
BLOCKS = 512  # selected 4-token blocks per row past the dense prefix


def _request_rows(g, n: int, ctx: int, topk: int) -> list[list[int]]:
    """Token lists of the last ``n`` positions of a request of ``ctx`` tokens."""
    first_visible = (ctx - n + 1) // 4  # complete blocks every row of the request sees
    perm = torch.randperm(max(first_visible, 1), generator=g)
    shared, extra = perm[:BLOCKS], perm[BLOCKS:BLOCKS + 64]
    rows = []
    for j in range(n):
        pos = ctx - n + j
        if pos + 1 <= topk:  # dense causal prefix, in random order
            rows.append(torch.randperm(pos + 1, generator=g).tolist())
            continue
        blocks = shared.clone()
        swaps = min(int(torch.randint(0, 17, (1,), generator=g)), extra.numel())
        if swaps:  # distinct replacements: extra is disjoint from shared
            blocks[torch.randperm(blocks.numel(), generator=g)[:swaps]] = \
                extra[torch.randperm(extra.numel(), generator=g)[:swaps]]
        toks = (blocks.view(-1, 1) * 4 + torch.arange(4)).flatten().tolist()
        start = (pos + 1) // 4 * 4
        rows.append(toks + list(range(start, pos + 1)))  # the open tail group
    return rows


def _case(gen, *, R: int, T: int, page: int, bw: int, max_tokens: int, max_ctx: int):
    g = torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=gen, device=gen.device)))
    topk = WIDTH - 1
    limit = bw * page
    packed = torch.full((T, WIDTH), -1, dtype=torch.int32)
    req = torch.empty(T, dtype=torch.int32)
    r, q = 0, 0
    while r < T:
        n = min(T - r, int(torch.randint(1, 3 * R + 4, (1,), generator=g)))
        ctx = int(torch.randint(n + 1, max_ctx + 1, (1,), generator=g))
        for j, toks in enumerate(_request_rows(g, n, ctx, topk)):
            packed[r + j, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
            packed[r + j, topk] = len(toks)
        req[r:r + n] = q
        r, q = r + n, q + 1
    counts = packed[:, topk].clone()
    for row in range(T):
        kind = int(torch.randint(0, 12, (1,), generator=g))
        n = int(counts[row])
        if kind == 0 and n:  # -1 holes inside the counted prefix
            holes = torch.rand(n, generator=g) < 0.05
            packed[row, :n][holes] = -1
        elif kind == 1:  # a small count
            packed[row, topk] = int(torch.randint(0, 6, (1,), generator=g))
        elif kind == 2:  # garbage counts: negative, or past TOPK (clamped: the -1 padding counts)
            packed[row, topk] = -5 if row % 2 else 1 << 30
        elif kind == 3 and n:  # tokens past the block table / the bitmap, never candidates
            cols = torch.randint(0, n, (4,), generator=g)
            packed[row, cols] = torch.tensor([limit, limit + 17, max_tokens, (1 << 31) - 1], dtype=torch.int32)
    # one tile that would take the union path gets a row that lists a candidate twice
    dup_tile = (T // R) // 2
    for row in range(dup_tile * R, min(T, dup_tile * R + R)):
        n = min(max(int(packed[row, topk]), 0), topk)
        if n >= 2 and 0 <= int(packed[row, 0]) < min(limit, max_tokens):
            packed[row, 1] = packed[row, 0]
            break
    return packed, req


def _run(config: QsaUnionConfig, packed: torch.Tensor, req: torch.Tensor, bw: int):
    T = packed.shape[0]
    R, cap = config.rows_per_tile, config.union_cap
    NT = -(-T // R)
    dev = "cuda"
    union = torch.full((NT, cap), POISON, dtype=torch.int32, device=dev)
    member = torch.full((NT, R, cap // 32), POISON, dtype=torch.int32, device=dev)
    length = torch.full((NT,), POISON, dtype=torch.int32, device=dev)
    args = dict(packed_indices=packed.to(dev), block_table=torch.zeros((3, bw), dtype=torch.int32, device=dev),
                token_to_req=req.to(dev), union=union, member=member, length=length)
    get_kernel(config, "sm_90a")(*call_arguments(config.signature(), args))
    torch.cuda.synchronize()
    return union.cpu(), member.cpu(), length.cpu()


def _check(config, packed, req, bw, got):
    union, member, length = got
    ref_u, ref_m, ref_l = qsa_union_reference(packed, req, bw, config.page_size, config.rows_per_tile,
                                              config.union_cap, config.max_tokens)
    assert torch.equal(length, ref_l), (length != ref_l).nonzero().flatten().tolist()
    used = 0
    for t in range(length.numel()):
        n = int(ref_l[t])
        if n < 0:
            continue
        used += 1
        defined = min(config.union_cap, -(-n // 64) * 64)
        assert torch.equal(union[t, :defined], ref_u[t, :defined]), t
        assert (union[t, defined:] == POISON).all(), t  # no stray writes past the padding
        assert torch.equal(member[t], ref_m[t]), t
    return used


CASES = [
    # (R, T, page, bw, max_tokens, max_ctx, union_cap)
    (4, 4 * 37 + 3, 1568, 12, 32768, 12 * 1568, 4160),
    (5, 5 * 53 + 3, 1568, 12, 32768, 12 * 1568, 6208),  # the production key: cap 3 x TOPK rounded to 64
    (5, 5 * 41 + 2, 1568, 10, 16384, 10 * 1568, 4160),
    (5, 5 * 23 + 4, 784, 21, 16384, 16000, 2560),  # 784 x 21 > 16384: the bitmap bound applies
    (8, 8 * 19 + 5, 1600, 40, 65536, 40 * 1600, 4160),
    (8, 8 * 9 + 1, 784, 669, 524288, 524288, 4160),  # the largest bitmap, tokens near 2^19
]


@pytest.mark.parametrize("R,T,page,bw,max_tokens,max_ctx,cap", CASES,
                         ids=[f"R{c[0]}-T{c[1]}-p{c[2]}-mt{c[4]}-cap{c[6]}" for c in CASES])
def test_union_matches_reference(R, T, page, bw, max_tokens, max_ctx, cap, gen):
    config = QsaUnionConfig(rows_per_tile=R, page_size=page, max_tokens=max_tokens, union_cap=cap)
    packed, req = _case(gen, R=R, T=T, page=page, bw=bw, max_tokens=max_tokens, max_ctx=max_ctx)
    got = _run(config, packed, req, bw)
    used = _check(config, packed, req, bw, got)
    fallback = int((got[2] == -1).sum())
    assert used > 0 and fallback > 0, (used, fallback)  # both paths exercised


def test_union_over_the_cap_and_strided_rows(gen):
    """A union cap (2048) below most tiles' union, with ``packed_indices`` a column slice of a
    wider buffer (row stride > W, junk in the extra columns)."""
    config = QsaUnionConfig(rows_per_tile=5, page_size=1568, max_tokens=16384, union_cap=2048)
    packed, req = _case(gen, R=5, T=5 * 30 + 3, page=1568, bw=10, max_tokens=16384, max_ctx=10 * 1568)
    # both outcomes on every draw: tile 0 (rows 0..4) lists one token per row, far under the cap;
    # tile 1 (rows 5..9) lists 2048 random tokens per row, whose union is over it
    topk = WIDTH - 1
    req[:10] = req[0]  # one request per tile: a mixed tile falls back whatever its size
    packed[:5, topk] = 1
    g = torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=gen, device=gen.device)))
    for row in range(5, 10):
        packed[row, :2048] = torch.randperm(10 * 1568, generator=g)[:2048].to(torch.int32)
        packed[row, topk] = 2048
    wide = torch.full((packed.shape[0], WIDTH + 13), 12345, dtype=torch.int32)
    wide[:, :WIDTH] = packed
    view = wide.cuda()[:, :WIDTH]
    assert view.stride(0) == WIDTH + 13
    T, R = packed.shape[0], 5
    NT = -(-T // R)
    union = torch.full((NT, 2048), POISON, dtype=torch.int32, device="cuda")
    member = torch.full((NT, R, 64), POISON, dtype=torch.int32, device="cuda")
    length = torch.full((NT,), POISON, dtype=torch.int32, device="cuda")
    args = dict(packed_indices=view, block_table=torch.zeros((1, 10), dtype=torch.int32, device="cuda"),
                token_to_req=req.cuda(), union=union, member=member, length=length)
    get_kernel(config, "sm_90a")(*call_arguments(config.signature(), args))
    torch.cuda.synchronize()
    _check(config, packed, req, 10, (union.cpu(), member.cpu(), length.cpu()))
    ref_l = qsa_union_reference(packed, req, 10, 1568, R, 2048, 16384)[2]
    assert int(ref_l[0]) >= 0 and int(ref_l[1]) == -1, ref_l[:2]
    assert (length.cpu() == -1).any() and (length.cpu() >= 0).any()


def test_empty_and_count_zero_tiles():
    """Rows whose counts are all zero (or negative) give length 0, all member words 0 and no
    union entries; so does a tile past T (an output longer than ceil(T / R))."""
    config = QsaUnionConfig(rows_per_tile=4, page_size=16, max_tokens=1024, union_cap=64)
    T = 6
    packed = torch.arange(T * 9, dtype=torch.int32).view(T, 9) % 100
    packed[:, 8] = torch.tensor([0, -1, 0, -(1 << 31), 0, 0], dtype=torch.int32)
    req = torch.zeros(T, dtype=torch.int32)
    NT = 3  # one more than ceil(6 / 4)
    union = torch.full((NT, 64), POISON, dtype=torch.int32, device="cuda")
    member = torch.full((NT, 4, 2), POISON, dtype=torch.int32, device="cuda")
    length = torch.full((NT,), POISON, dtype=torch.int32, device="cuda")
    args = dict(packed_indices=packed.cuda(), block_table=torch.zeros((1, 64), dtype=torch.int32, device="cuda"),
                token_to_req=req.cuda(), union=union, member=member, length=length)
    get_kernel(config, "sm_90a")(*call_arguments(config.signature(), args))
    torch.cuda.synchronize()
    assert length.tolist()[:2] == [0, 0]
    assert (member[:2] == 0).all() and (union[:2] == POISON).all()
    assert int(length[2]) == 0 and (member[2] == 0).all()
