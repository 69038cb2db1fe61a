"""The QSA row-tile union pre-pass: its reference (``reference_qsa_union.qsa_union_reference``) on
hand-built known answers and against a plain-Python formula, a plain-Python model of the SM90
kernel's algorithm (iteration split, sinks, scan, duplicate count) against the reference, and
the kernel's compile for sm_90a (shared-memory atomics and popcounts in the PTX, no local memory,
the occupancy it asks for, config validation).

The kernel itself runs on the H200 in tests/gpu/test_qsa_union_gpu.py.
"""

from __future__ import annotations

import re
import zlib

import pytest
import torch

from cute_kernels.plans.sm90_qsa_union import QsaUnionConfig
from cute_kernels.reference_qsa_union import qsa_union_reference


def _packed(rows: list[list[int]], width: int, counts: list[int] | None = None) -> torch.Tensor:
    """``[T, width]`` int32: each row's tokens, -1 padding, then its count (default: its length)."""
    out = torch.full((len(rows), width), -1, dtype=torch.int32)
    for r, toks in enumerate(rows):
        out[r, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
        out[r, width - 1] = len(toks) if counts is None else counts[r]
    return out


def _bits(ranks: list[int], words: int) -> list[int]:
    """Member words (as int32) with the given bits set."""
    out = [0] * words
    for k in ranks:
        out[k // 32] |= 1 << (k % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in out]


def _union(packed, req=None, *, bw=100, page=16, R=3, cap=64, max_tokens=1024):
    req = torch.zeros(packed.shape[0], dtype=torch.int32) if req is None else torch.tensor(req, dtype=torch.int32)
    return qsa_union_reference(packed, req, bw, page, R, cap, max_tokens)


# ----------------------------------------------------------------------------------------------
# known answers
# ----------------------------------------------------------------------------------------------


def test_overlapping_rows():
    union, member, length = _union(_packed([[5, 1, 9], [9, 2], [1, 5]], 6))
    assert length.tolist() == [4]
    assert union[0].tolist() == [1, 2, 5, 9] + [-1] * 60
    # ranks: 1 -> 0, 2 -> 1, 5 -> 2, 9 -> 3
    assert member[0].tolist() == [_bits([0, 2, 3], 2), _bits([1, 3], 2), _bits([0, 2], 2)]


def test_minus_one_inside_the_counted_prefix_is_skipped():
    union, member, length = _union(_packed([[3, -1, 7, -1], [-1, 3]], 6), R=2)
    assert length.tolist() == [2]
    assert union[0, :2].tolist() == [3, 7]
    assert member[0].tolist() == [_bits([0, 1], 2), _bits([0], 2)]


def test_garbage_counts_are_clamped_and_the_count_is_never_a_token():
    # W = 5: four token columns then the count
    packed = torch.tensor([
        [1, 2, 3, 4, -7],  # negative count: nothing
        [10, 11, 12, 13, 99],  # count past TOPK: the four columns, not the count (99)
        [20, 21, 22, 23, 2],  # count 2: columns 2, 3 are not visited
    ], dtype=torch.int32)
    union, member, length = _union(packed, max_tokens=1024)
    assert length.tolist() == [6]
    assert union[0, :6].tolist() == [10, 11, 12, 13, 20, 21]
    assert member[0].tolist() == [_bits([], 2), _bits([0, 1, 2, 3], 2), _bits([4, 5], 2)]


def test_tokens_outside_the_block_table_or_the_bitmap_are_not_candidates():
    # page 4, BW 3: tokens >= 12 lie past the table; BW 100 x page 16 > max_tokens 1024: the
    # bitmap bound applies too
    union, _, length = _union(_packed([[0, 11, 12, 400]], 5), bw=3, page=4, R=1)
    assert length.tolist() == [2] and union[0, :2].tolist() == [0, 11]
    union, _, length = _union(_packed([[1023, 1024, 5000]], 4), bw=100, page=16, R=1, max_tokens=1024)
    assert length.tolist() == [1] and union[0, :1].tolist() == [1023]


def test_duplicate_candidate_in_a_row_falls_back():
    _, _, length = _union(_packed([[4, 8], [8, 4, 8]], 4), R=2)
    assert length.tolist() == [-1]


def test_shared_tokens_and_non_candidate_repeats_do_not_fall_back():
    # rows share 4 and 8; row 0 repeats -1, a token past the table and a column past its count
    packed = _packed([[4, -1, -1, 900, 900, 4], [8, 4]], 7, counts=[5, 2])
    union, member, length = _union(packed, R=2, bw=50, page=16)  # 900 // 16 = 56 >= 50
    assert length.tolist() == [2]
    assert union[0, :2].tolist() == [4, 8]
    assert member[0].tolist() == [_bits([0], 2), _bits([0, 1], 2)]


def test_mixed_requests_fall_back_per_tile():
    packed = _packed([[1], [2], [3], [4], [5]], 3)
    # tiles: rows {0, 1}, {2, 3}, {4}
    _, _, length = _union(packed, [0, 1, 1, 1, 1], R=2)
    assert length.tolist() == [-1, 2, 1]
    _, _, length = _union(packed, [0, 0, 0, 1, 1], R=2)
    assert length.tolist() == [2, -1, 1]


def test_union_larger_than_the_cap_falls_back_exact_cap_does_not():
    full = list(range(0, 128, 2))  # 64 tokens
    union, member, length = _union(_packed([full[:40], full[30:]], 70), R=2, cap=64)
    assert length.tolist() == [64]
    assert union[0].tolist() == full  # no -1 padding: U is a multiple of 64
    assert member[0].tolist() == [_bits(list(range(40)), 2), _bits(list(range(30, 64)), 2)]
    _, _, length = _union(_packed([full[:40], full[30:] + [999]], 70), R=2, cap=64)
    assert length.tolist() == [-1]


def test_partial_last_tile_and_padding():
    packed = _packed([[7], [3, 7], [1], [2], [9, 8, 7], [6], [5]], 4)
    union, member, length = _union(packed, R=3, cap=128)
    assert length.tolist() == [3, 5, 1]
    assert union[0].tolist() == [1, 3, 7] + [-1] * 125
    assert union[1, :5].tolist() == [2, 6, 7, 8, 9]
    assert union[2, :1].tolist() == [5]
    assert member[2].tolist() == [_bits([0], 4), [0] * 4, [0] * 4]  # rows 1, 2 lie past T


def test_count_zero_rows_give_an_empty_union():
    packed = _packed([[1, 2], [3, 4]], 3, counts=[0, 0])
    union, member, length = _union(packed, R=2)
    assert length.tolist() == [0]
    assert (union == -1).all() and (member == 0).all()


def test_bit_31_of_a_member_word_is_the_sign_bit():
    union, member, length = _union(_packed([list(range(40)), [31]], 41), R=2)
    assert length.tolist() == [40]
    assert member[0, 1].tolist() == [-(1 << 31), 0]
    assert member[0, 0].tolist() == [-1, 0xFF]


def test_empty_inputs():
    union, member, length = qsa_union_reference(torch.zeros((0, 9), dtype=torch.int32),
                                                torch.zeros(0, dtype=torch.int32), 4, 16, 5, 64, 1024)
    assert union.shape == (0, 64) and member.shape == (0, 5, 2) and length.shape == (0,)
    # W = 1: the count column only, no tokens
    union, member, length = _union(torch.tensor([[3], [5]], dtype=torch.int32), R=2)
    assert length.tolist() == [0]


# ----------------------------------------------------------------------------------------------
# against a plain-Python formula on random cases
# ----------------------------------------------------------------------------------------------


def _formula(packed, req, bw, page, R, cap, max_tokens):
    """Sets and loops, entry by entry."""
    T, W = packed.shape
    rows = packed.tolist()
    reqs = req.tolist()
    out = []
    for r0 in range(0, T, R):
        tile = range(r0, min(T, r0 + R))
        cands = []
        for r in tile:
            n = min(max(rows[r][W - 1], 0), W - 1)
            cands.append([t for t in rows[r][:n] if 0 <= t < max_tokens and t // page < bw])
        u = sorted({t for c in cands for t in c})
        if any(reqs[r] != reqs[r0] for r in tile) or any(len(set(c)) != len(c) for c in cands) or len(u) > cap:
            out.append((-1, None, None))
            continue
        rank = {t: i for i, t in enumerate(u)}
        out.append((len(u), u, [sorted(rank[t] for t in c) for c in cands]))
    return out


def _random_case(seed: int, T: int, W: int):
    """Neighbour rows overlap (tokens near 4 x row, as causal prefill rows do), with -1 holes,
    garbage counts, tokens past the table (>= 320) or negative, requests changing every 24 rows
    and repeated tokens in rows 3, 20, 37, ..."""
    g = torch.Generator().manual_seed(seed)
    base = 4 * torch.arange(T).view(T, 1) + 120 * (torch.arange(T).view(T, 1) > T - 6)
    packed = (base + torch.randint(-16, 16, (T, W), generator=g)).int()
    packed[torch.rand(T, W, generator=g) < 0.1] = -1
    packed[:, W - 1] = torch.randint(-3, W + 3, (T,), generator=g).int()
    for r in range(T):
        if r % 17 != 3:  # keep the first occurrence of each token
            seen = set()
            for c in range(W - 1):
                v = int(packed[r, c])
                if v in seen:
                    packed[r, c] = -1
                seen.add(v)
    req = torch.div(torch.arange(T), 24, rounding_mode="floor").int()
    return packed, req


@pytest.mark.parametrize("R", [1, 4, 5, 8])
@pytest.mark.parametrize("cap", [64, 256])
def test_matches_python_formula(R, cap):
    T, W, bw, page, max_tokens = 53, 24, 20, 16, 512
    packed, req = _random_case(zlib.crc32(repr((R, cap)).encode()), T, W)
    union, member, length = qsa_union_reference(packed, req, bw, page, R, cap, max_tokens)
    expected = _formula(packed, req, bw, page, R, cap, max_tokens)
    assert len(expected) == length.numel()
    kinds = set()
    for t, (n, u, ranks) in enumerate(expected):
        assert int(length[t]) == n, t
        if n < 0:
            kinds.add("fallback")
            continue
        kinds.add("union")
        assert union[t, :n].tolist() == u
        assert (union[t, n:] == -1).all()
        for r in range(R):
            want = _bits(ranks[r], cap // 32) if r < len(ranks) else [0] * (cap // 32)
            assert member[t, r].tolist() == want, (t, r)
    assert kinds == {"fallback", "union"}  # both paths exercised


# ----------------------------------------------------------------------------------------------
# a plain-Python model of the kernel's algorithm (its iteration split, sinks, scan and duplicate
# check) against the reference
# ----------------------------------------------------------------------------------------------


def _popc(x: int) -> int:
    return bin(x & 0xFFFFFFFF).count("1")


def _kernel_model(packed, req, bw, page, R, cap, max_tokens, stores=None):
    """What ``Sm90QsaUnion`` computes, step by step as the kernel does it: the per-warp column
    iterations (unpredicated ones first, then one block at a time), the sink words of
    non-candidates, the thread / warp scan and the member-bit count. It also checks that every
    load is a counted column of a row below T and that each counted column is read exactly once
    per pass. Returns ``(union, member, length)`` like the reference (-1 / 0 where undefined).
    ``stores``: a list that receives, per tile that reaches pass 2, ``(num_union, [(address,
    value, candidate), ...])`` of its shared union stores and ``[(row, word, candidate), ...]`` of
    its member-word ORs (racecheck's write-write hazards are between these stores)."""
    from cute_kernels.sm90.qsa_union import NUM_THREADS, NUM_WARPS, SINK, Sm90QsaUnion

    k = Sm90QsaUnion(QsaUnionConfig(rows_per_tile=R, page_size=page, max_tokens=max_tokens, union_cap=cap))
    CB, words, SW, MS, MW = k.col_blocks, k.words, k.scan_words, k.member_stride, k.member_words
    T, W = packed.shape
    topk = W - 1
    rows = packed.tolist()
    reqs = req.tolist()
    num_tiles = -(-T // R)
    union = torch.full((num_tiles, cap), -1, dtype=torch.int32)
    member = torch.zeros((num_tiles, R, MW), dtype=torch.int32)
    length = torch.zeros(num_tiles, dtype=torch.int32)
    limit = max_tokens if bw >= k.full_width else bw * page
    step = CB * NUM_THREADS

    def entries(counts, warp, lane):
        """(row, column) of every load of one thread, in the kernel's order."""
        cmax, cmin = max(counts), min(counts)
        wcol = 32 * warp
        num = cmin - (CB - 1) * NUM_THREADS - wcol - 32
        full_end = (num // step + 1) * step if num >= 0 else 0
        for c0 in range(0, full_end, step):
            for r in range(R):
                for b in range(CB):
                    col = c0 + b * NUM_THREADS + wcol + lane
                    assert col < counts[r], "an unpredicated load past a row's count"
                    yield r, col
        for c0 in range(full_end, cmax - wcol, NUM_THREADS):
            for r in range(R):
                if c0 + wcol + lane < counts[r]:
                    yield r, c0 + wcol + lane

    for t in range(num_tiles):
        row0 = t * R
        counts = [min(max(rows[row0 + r][topk], 0), topk) if row0 + r < T and topk > 0 else 0
                  for r in range(R)]
        if any(reqs[row] != reqs[row0] for row in range(row0, min(T, row0 + R))):
            length[t] = -1
            continue
        threads = [(w, ln) for w in range(NUM_WARPS) for ln in range(32)]
        visited = [(r, col) for w, ln in threads for r, col in entries(counts, w, ln)]
        assert sorted(visited) == [(r, c) for r in range(R) for c in range(counts[r])]
        assert all(row0 + r < T for r, _ in visited)
        bitmap = [0] * (words + 4 + SINK)
        found = 0
        for w, ln in threads:  # pass 1
            for r, col in entries(counts, w, ln):
                tok = rows[row0 + r][col]
                ok = 0 <= tok < limit
                bitmap[(tok >> 5) if ok else words + 4 + ln] |= 1 << (tok & 31)
                found += ok
        # scan: thread totals over SW words, warp inclusive scans, warp totals
        totals = [sum(_popc(bitmap[i * SW + j]) for j in range(SW)) if i * SW < words else 0
                  for i in range(NUM_THREADS)]
        warp_sums = [sum(totals[32 * w:32 * w + 32]) for w in range(NUM_WARPS)]
        num_union = sum(warp_sums)
        if num_union > cap:
            length[t] = -1
            continue
        prefix = [0] * (words + 4)
        prefix[words] = cap
        for i in range(NUM_THREADS):
            w, ln = divmod(i, 32)
            base = sum(warp_sums[:w]) + sum(totals[32 * w:32 * w + ln + 1]) - totals[i]
            for j in range(SW if i * SW < words else 0):
                prefix[i * SW + j] = base
                base += _popc(bitmap[i * SW + j])
        assert bitmap[words] == 0
        sunion = [None] * (cap + 4)
        smember = [0] * (-(-R * MS // 4) * 4)
        union_stores, member_ors = [], []
        for w, ln in threads:  # pass 2
            for r, col in entries(counts, w, ln):
                tok = rows[row0 + r][col]
                ok = 0 <= tok < limit
                word = (tok >> 5) if ok else words
                rank = prefix[word] + _popc(bitmap[word] & ~(-1 << (tok & 31)))
                sunion[rank] = tok
                smember[r * MS + (rank >> 5)] |= 1 << (rank & 31)
                union_stores.append((rank, tok, ok))
                member_ors.append((r, rank >> 5, ok))
        if stores is not None:
            stores.append((num_union, union_stores, member_ors))
        assert None not in sunion[:num_union]
        seen = sum(_popc(smember[r * MS + c]) for r in range(R) for c in range(MW))
        length[t] = num_union if seen == found else -1
        if seen == found:
            union[t, :num_union] = torch.tensor(sunion[:num_union], dtype=torch.int32)
            words32 = [[v - (1 << 32) if v >= 1 << 31 else v for v in smember[r * MS:r * MS + MW]]
                       for r in range(R)]
            member[t] = torch.tensor(words32, dtype=torch.int32)
    return union, member, length


def _production_case(seed: int, T: int, R: int):
    """Prefill rows of one request at positions past 2048 and near the start: TOPK 2051, row p
    counting min(p + 1, 2048 + (p + 1) % 4) tokens of 4-token blocks (shared by the rows, a
    few swapped), with a -1 hole, a token past the table and, in one row, a repeated token."""
    g = torch.Generator().manual_seed(seed)
    W = 2052
    packed = torch.full((T, W), -1, dtype=torch.int32)
    start = 2040 if seed % 2 else 0
    shared = torch.randperm(1500, generator=g)[:520]
    for j in range(T):
        p = start + j
        n = min(p + 1, 2048 + (p + 1) % 4)
        if p + 1 <= 2048:
            toks = torch.randperm(p + 1, generator=g)
        else:
            blocks = shared.clone()
            blocks[torch.randint(0, 520, (3,), generator=g)] = torch.randint(1500, 1600, (3,), generator=g)
            toks = torch.unique((blocks.view(-1, 1) * 4 + torch.arange(4)).flatten())
            toks = toks[torch.randperm(toks.numel(), generator=g)][:n]
        packed[j, :toks.numel()] = toks.int()
        packed[j, W - 1] = min(n, toks.numel())
    packed[1, 7] = -1
    packed[2, 9] = 5000  # past the table (BW 3 x page 1568)
    packed[R + 2, 1] = packed[R + 2, 0]  # a duplicate in the second tile
    return packed, torch.zeros(T, dtype=torch.int32)


@pytest.mark.parametrize("R", [1, 3, 5, 8])
@pytest.mark.parametrize("cap", [64, 256])
@pytest.mark.parametrize("bw", [20, 100])
def test_kernel_model_matches_reference(R, cap, bw):
    # BW 20 x page 16 = 320 tokens: the block table bounds the candidates; BW 100: max_tokens
    T, W, page, max_tokens = 53, 24, 16, 1024
    packed, req = _random_case(zlib.crc32(repr(("model", R, cap)).encode()), T, W)
    got = _kernel_model(packed, req, bw, page, R, cap, max_tokens)
    want = qsa_union_reference(packed, req, bw, page, R, cap, max_tokens)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_model_matches_reference_at_production_counts(seed):
    R, T = 5, 13
    packed, req = _production_case(seed, T, R)
    got = _kernel_model(packed, req, 3, 1568, R, 6208, 32768)
    want = qsa_union_reference(packed, req, 3, 1568, R, 6208, 32768)
    assert want[2].tolist()[1] == -1 and min(want[2].tolist()[::2]) > 0  # the duplicate's tile falls back
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_union_store_hazards_are_benign(seed):
    """racecheck reports write-write hazards between the pass-2 union stores of different threads
    (docs/design/qsa.md#racecheck-of-the-union-pre-pass). Each is benign: every store to an address
    below the union's length U comes from a candidate and writes that address's token (the rank is
    a bijection between the distinct candidates and [0, U), so rows sharing a token store the same
    value); every other store is a non-candidate's, at the sink slot ``cap`` that no one reads (the
    copy reads [0, U) only, U <= cap); a non-candidate's member OR lands on its row's sink word
    ``cap / 32`` (the copy reads words [0, cap / 32))."""
    R, cap, bw, page, max_tokens = 5, 256, 20, 16, 1024
    packed, req = _random_case(zlib.crc32(repr(("hazards", seed)).encode()), 41, 24)
    packed[3, :5] = torch.tensor([-1, -9, bw * page, 1 << 20, 7], dtype=torch.int32)  # non-candidates
    packed[3, -1] = 5
    stores: list = []
    got = _kernel_model(packed, req, bw, page, R, cap, max_tokens, stores)
    assert all(torch.equal(a, b) for a, b in zip(got, qsa_union_reference(packed, req, bw, page, R, cap, max_tokens)))
    assert stores and any(not ok for _, us, _ in stores for *_, ok in us)  # both kinds of store occur
    for num_union, union_stores, member_ors in stores:
        assert num_union <= cap
        by_address: dict = {}
        for address, value, candidate in union_stores:
            if candidate:
                assert address < num_union
                by_address.setdefault(address, set()).add(value)
            else:
                assert address == cap  # the sink slot, past everything the copy reads
        assert all(len(v) == 1 for v in by_address.values())  # one value per address
        assert sorted(v for vs in by_address.values() for v in vs) == sorted({v for a, v, c in union_stores if c})
        for _, word, candidate in member_ors:
            assert (word < cap // 32) if candidate else (word == cap // 32)


# ----------------------------------------------------------------------------------------------
# the kernel: config validation and the sm_90a compile
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,match", [
    (dict(rows_per_tile=0), "rows_per_tile"),
    (dict(rows_per_tile=9), "rows_per_tile"),
    (dict(page_size=0), "page_size"),
    (dict(max_tokens=512), "max_tokens"),
    (dict(max_tokens=3000), "max_tokens"),
    (dict(max_tokens=1 << 20), "max_tokens"),
    (dict(union_cap=0), "union_cap"),
    (dict(union_cap=100), "union_cap"),
])
def test_config_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        QsaUnionConfig(**fields)


def test_signature_names_and_shapes():
    cfg = QsaUnionConfig(rows_per_tile=4, union_cap=128)
    sig = cfg.signature()
    assert [a.name for a in sig] == ["packed_indices", "block_table", "token_to_req", "union", "member", "length"]
    assert all(a.dtype == "int32" and a.align == 4 for a in sig)
    assert sig[3].shape == ("NT", 128) and sig[4].shape == ("NT", 4, 4) and sig[5].shape == ("NT",)


COMPILE_CONFIGS = [
    QsaUnionConfig(),
    QsaUnionConfig(rows_per_tile=5, page_size=1568, max_tokens=32768, union_cap=6208),  # production
    QsaUnionConfig(rows_per_tile=8, page_size=784, max_tokens=524288, union_cap=4160),
    QsaUnionConfig(rows_per_tile=1, page_size=1, max_tokens=1024, union_cap=64),
]


@pytest.mark.compile
@pytest.mark.parametrize("config", COMPILE_CONFIGS, ids=[c.label() for c in COMPILE_CONFIGS])
def test_kernel_compiles_for_sm90a_with_evidence(config):
    from cute_kernels.jit.compiler import compile_config

    compiled = compile_config(config, "sm_90a", artifacts=True)
    ptx = compiled.ptx
    assert re.search(r"^\.target\s+sm_90a", ptx, re.M)
    for _, pattern in config.evidence["sm_90a"]:
        assert re.search(pattern, ptx), pattern
    # one thread block of 256 threads per tile; index loads are plain global loads, the only
    # atomics are on shared memory
    assert re.search(r"\.reqntid 256, 1, 1", ptx)
    assert not re.search(r"(atom|red)(\.\w+)*\.global", ptx)
    assert "shfl.sync.up.b32" in ptx
    if compiled.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", compiled.sass), "local memory (spills)"


@pytest.mark.compile
def test_production_config_asks_for_six_ctas_per_sm():
    """At the production shape (R 5, max_tokens 32768, cap 6208) shared memory fits six tiles per
    SM, and the kernel asks ptxas for registers that allow six (at most 40 a thread)."""
    from cute_kernels.jit.compiler import compile_config

    config = QsaUnionConfig(rows_per_tile=5, page_size=1568, max_tokens=32768, union_cap=6208)
    ptx = compile_config(config, "sm_90a", artifacts=True).ptx
    assert re.search(r"\.minnctapersm 6\b", ptx)


@pytest.mark.compile
def test_kernel_refuses_too_much_shared_memory():
    from cute_kernels.jit.compiler import compile_config

    # 64 KB bitmap + 64 KB prefix + a 400 KB union copy + 8 rows x 102400 bits of member words
    config = QsaUnionConfig(rows_per_tile=8, max_tokens=524288, union_cap=102400)
    with pytest.raises(ValueError, match=re.escape(config.label())):
        compile_config(config, "sm_90a")
