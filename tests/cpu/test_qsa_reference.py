"""CPU tests of ``cute_kernels.reference.qsa_sparse_attention``, the QSA contract every kernel is
tested against (docs: ../shared/docs/qsa-contract.md §1-§2, pitfalls §7).

Checked against known answers (dense causal attention, removed entries, zero rows, scale
relations) and against a deliberately different float64 formula written here: explicit loops
over rows, heads and packed columns, each token looked up in ``block_table`` one by one, softmax by
hand. ``make_qsa_case`` builds realistic inputs (QSA's 4-token block selection, production cache
layout, permuted block tables, short requests, poisoned unused cache slots) and is shared with the
GPU tests.

Tolerances: the reference accumulates in fp32 and rounds once to q's dtype; against the float64
formula that final rounding may flip, so outputs match within one ulp of the output dtype
(bf16 2^-7, fp16 2^-10 relative) plus 1e-5 x max|v| absolute for sums that cancel to near zero;
LSE within 1e-5.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from cute_kernels import reference as ref

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
OUT_TOL = {BF16: dict(rtol=2.0**-7, atol=1e-5), FP16: dict(rtol=2.0**-10, atol=1e-5)}
LSE_TOL = dict(rtol=1e-5, atol=1e-5)
R = 4  # tokens per compressed block (QSA indexer_compress_ratio)


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# ----------------------------------------------------------------------------------------------
# case builder (shared with tests/gpu/test_qsa_gpu.py)
# ----------------------------------------------------------------------------------------------


def qsa_row_indices(pos: int, ctx: int, block_budget: int, width: int, g: torch.Generator,
                    *, holes: float = 0.0) -> list[int]:
    """The packed row of a query at request position ``pos`` (QSA expansion, contract §1):
    ``min(visible, budget)`` distinct random complete 4-token blocks below ``pos + 1``, in random
    order, then the open tail group, then -1; the last element is valid_count. ``holes``: share of
    selected blocks replaced by -1 inside the counted prefix."""
    topk = width - 1
    visible = min((pos + 1) // R, ctx // R)
    complete = min(visible, block_budget)
    blocks = torch.randperm(visible, generator=g)[:complete].tolist() if visible else []
    toks: list[int] = []
    for b in blocks:
        hole = holes > 0 and torch.rand((), generator=g).item() < holes
        toks += [-1] * R if hole else [b * R + i for i in range(R)]
    tail = (pos + 1) % R
    start = ((pos + 1) // R) * R
    toks += [start + i for i in range(tail)]
    count = complete * R + tail
    assert count <= topk, (count, topk)
    return toks + [-1] * (topk - len(toks)) + [count]


def make_qsa_case(*, rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page: int,
                  kv_dtype=BF16, q_dtype=BF16, num_reqs: int = 1, ctx: int | list[int] = 64,
                  block_budget: int = 8, width: int | None = None, positions: str = "tail",
                  short_every: int = 0, holes: float = 0.0, gate: bool = False, k_scale: float = 1.0,
                  v_scale: float = 1.0, poison: bool = True, spare_blocks: int = 3,
                  generator: torch.Generator | None = None, device: str = "cpu") -> dict:
    """A random QSA problem as keyword arguments of ``qsa_sparse_attention`` (plus ``meta``).

    The cache is production-shaped: one ``[num_blocks, Hkv, page, 2 D]`` buffer whose transposed
    halves are ``k_cache``/``v_cache``. Pages are randomly permuted; rows are split evenly over
    requests (``positions="tail"``: the last positions of each request, as in decode and chunked
    prefill; ``"all"``: positions 0.. of one request, as a 1 x N prefill). Every ``short_every``-th
    request is short (ctx = its row count + 3). ``poison``: unused pages and each request's slots
    past its context hold NaN (FP8: NaN codes), so a kernel that reads them fails.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    D, Hkv = head_dim, num_kv_heads
    width = width if width is not None else R * block_budget + R - 1 + 1
    per_req = [rows // num_reqs + (1 if i < rows % num_reqs else 0) for i in range(num_reqs)]
    ctxs = [ctx] * num_reqs if isinstance(ctx, int) else list(ctx)
    for i in range(num_reqs):
        if short_every and i % short_every == short_every - 1:
            ctxs[i] = per_req[i] + 3
        ctxs[i] = max(ctxs[i], per_req[i])
    pages = [math.ceil(c / page) for c in ctxs]
    NB = sum(pages) + spare_blocks
    W = max(pages) + 1  # one junk column
    perm = torch.randperm(NB, generator=g)
    table = torch.randint(0, NB, (num_reqs, W), generator=g, dtype=torch.int32)
    ofs = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[ofs:ofs + n].int()
        ofs += n
    if device == "cpu":
        raw = torch.randn(NB, Hkv, page, 2 * D, generator=g)
    else:  # large caches: draw on the device, from a device generator seeded by ``g``
        gd = torch.Generator(device=device).manual_seed(int(torch.randint(2**31, (1,), generator=g)))
        raw = torch.randn(NB, Hkv, page, 2 * D, generator=gd, device=device)
    if kv_dtype == FP8:
        raw = (raw * 64).clamp(-448, 448).to(FP8)
    else:
        raw = raw.to(kv_dtype)
    if poison:
        used = set(perm[:ofs].tolist())
        fp8 = kv_dtype == FP8
        bytes_ = raw.view(torch.uint8)  # FP8: 0x7F is a NaN code
        for b in range(NB):
            if b not in used:
                bytes_[b].fill_(0x7F) if fp8 else raw[b].fill_(float("nan"))
        for i, c in enumerate(ctxs):
            if c % page:
                b = int(table[i, c // page])
                bytes_[b, :, c % page:].fill_(0x7F) if fp8 else raw[b, :, c % page:].fill_(float("nan"))
    kv = raw.transpose(1, 2)  # [NB, page, Hkv, 2D]
    k_cache, v_cache = kv[..., :D], kv[..., D:]
    token_to_req, packed = [], []
    for i, n in enumerate(per_req):
        first = 0 if positions == "all" else ctxs[i] - n
        for j in range(n):
            token_to_req.append(i)
            packed.append(qsa_row_indices(first + j, ctxs[i], block_budget, width, g, holes=holes))
    q = torch.randn(rows, num_q_heads, D, generator=g).to(q_dtype)
    case = dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        packed_indices=torch.tensor(packed, dtype=torch.int32).view(rows, width),
        block_table=table, token_to_req=torch.tensor(token_to_req, dtype=torch.int32),
        k_scale=k_scale, v_scale=v_scale,
        output_gate=(torch.randn(rows, num_q_heads, D, generator=g) * 2).to(q_dtype) if gate else None,
    )
    if device != "cpu":
        for name in ("q", "packed_indices", "block_table", "token_to_req", "output_gate"):
            if case[name] is not None:
                case[name] = case[name].to(device)
    case["meta"] = dict(ctxs=ctxs, per_req=per_req, raw=raw)
    return case


def call(case, fn=None, **kw):
    fn = fn or ref.qsa_sparse_attention
    args = {k: v for k, v in case.items() if k != "meta"}
    args["prefill"] = False
    args.update(kw)
    return fn(**args)


# ----------------------------------------------------------------------------------------------
# an independent float64 formula
# ----------------------------------------------------------------------------------------------


def formula(case):
    """Loops: row -> head -> visited column; every lookup by hand; softmax in float64."""
    q, k, v = case["q"], case["k_cache"], case["v_cache"]
    packed, table, t2r = case["packed_indices"], case["block_table"], case["token_to_req"]
    ks, vs = float(case["k_scale"]), float(case["v_scale"])
    rows, Hq, D = q.shape
    NB, page, Hkv, _ = k.shape
    G = Hq // Hkv
    topk = packed.shape[1] - 1
    out = torch.zeros(rows, Hq, D, dtype=torch.float64)
    lse = torch.full((rows, Hq), float("-inf"), dtype=torch.float64)
    for r in range(rows):
        count = max(0, min(int(packed[r, topk]), topk))
        req = int(t2r[r])
        slots = []
        for j in range(count):
            t = int(packed[r, j])
            if t < 0 or not 0 <= req < table.shape[0] or t // page >= table.shape[1]:
                continue
            phys = int(table[req, t // page])
            if 0 <= phys < NB:
                slots.append((phys, t % page))
        if not slots:
            continue
        for h in range(Hq):
            kh = h // G
            qv = q[r, h].double()
            logits = [float((qv * k[p, o, kh].double()).sum()) * ks * D ** -0.5 for p, o in slots]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            s = sum(w)
            acc = torch.zeros(D, dtype=torch.float64)
            for wi, (p, o) in zip(w, slots):
                acc += wi * v[p, o, kh].double() * vs
            out[r, h] = acc / s
            lse[r, h] = (m + math.log(s)) / math.log(2.0)
    res = out.to(q.dtype)
    if case.get("output_gate") is not None:
        res = (res.float() * torch.sigmoid(case["output_gate"].float())).to(q.dtype)
    return res, lse


def _close_to_formula(case):
    out, lse = call(case, return_lse=True)
    want, want_lse = formula(case)
    assert not torch.isnan(out).any()
    tol = dict(OUT_TOL[case["q"].dtype])
    # fp32 sums cancel to near zero: the absolute term scales with the largest |v|
    vmax = float(case["v_cache"].float().nan_to_num(0.0).abs().max()) * float(case["v_scale"])
    tol["atol"] *= max(1.0, vmax)
    torch.testing.assert_close(out.double(), want.double(), **tol)
    torch.testing.assert_close(lse.double(), want_lse, **LSE_TOL)
    return out, lse


# ----------------------------------------------------------------------------------------------
# against the formula
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv,qd,Hq,Hkv,page,gate,ks,vs", [
    (BF16, BF16, 24, 2, 16, False, 1.0, 1.0),
    (BF16, BF16, 12, 1, 20, True, 1.0, 1.0),  # non-power-of-two page, gate
    (FP8, BF16, 6, 1, 28, True, 0.5, 2.0),  # k_scale != v_scale
    (FP8, FP16, 24, 2, 12, False, 0.25, 3.0),
    (FP16, FP16, 16, 4, 16, True, 1.0, 1.0),
])
def test_matches_float64_formula(kv, qd, Hq, Hkv, page, gate, ks, vs):
    g = _gen(str(kv), str(qd), Hq, Hkv, page, gate)
    case = make_qsa_case(rows=9, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=32, page=page, kv_dtype=kv,
                         q_dtype=qd, num_reqs=3, ctx=[70, 45, 90], block_budget=6, short_every=3, holes=0.15,
                         gate=gate, k_scale=ks, v_scale=vs, generator=g)
    _close_to_formula(case)


def test_production_page_sizes_and_width():
    """PAGE 784 (TP4 without MTP) and the production width 2052 (TOPK 2051)."""
    g = _gen("prod")
    case = make_qsa_case(rows=3, num_q_heads=6, num_kv_heads=1, head_dim=16, page=784, num_reqs=1, ctx=2400,
                         block_budget=512, width=2052, generator=g)
    counts = case["packed_indices"][:, -1].tolist()
    assert counts == [2048 + (p + 1) % 4 for p in range(2397, 2400)]
    _close_to_formula(case)


# ----------------------------------------------------------------------------------------------
# known answers
# ----------------------------------------------------------------------------------------------


def _case(**kw):
    base = dict(rows=6, num_q_heads=12, num_kv_heads=2, head_dim=32, page=12, num_reqs=2, ctx=60,
                block_budget=5, generator=_gen(sorted(kw.items())))
    base.update(kw)
    return make_qsa_case(**base)


def _with_row(case, r, entries):
    """A copy of ``case`` whose row ``r`` is replaced by ``entries`` (count = len)."""
    c = dict(case)
    packed = case["packed_indices"].clone()
    topk = packed.shape[1] - 1
    packed[r] = -1
    packed[r, :len(entries)] = torch.tensor(entries, dtype=torch.int32)
    packed[r, topk] = len(entries)
    c["packed_indices"] = packed
    return c


def test_minus_one_inside_the_counted_prefix_is_skipped():
    case = _case()
    toks = [5, 17, 3, 40, 41]
    holed = _with_row(case, 2, [5, -1, 17, -1, -1, 3, 40, 41])
    assert torch.equal(call(holed)[2], call(_with_row(case, 2, toks))[2])
    _close_to_formula(holed)


def test_valid_count_zero_rows_are_zero_not_nan():
    case = _case(gate=True)
    packed = case["packed_indices"]
    packed[1, -1] = 0  # inert row: entries present but not counted
    packed[4, :] = -1
    packed[4, -1] = 0
    out, lse = call(case, return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[4], torch.zeros_like(out[4]))
    assert torch.isneginf(lse[1]).all() and torch.isneginf(lse[4]).all()
    assert not torch.isnan(out).any() and out[0].abs().sum() > 0


def test_valid_count_is_a_count_not_an_index():
    """Entries past valid_count are ignored even when they are valid tokens; a count above TOPK
    is clamped to TOPK and a negative one means 0 (it is never used as a token)."""
    case = _case()
    short = _with_row(case, 0, [7, 9, 30])  # shorter than any kernel tile
    base = call(short)
    packed = short["packed_indices"]
    packed[0, 3:-1] = torch.arange(10, 10 + packed.shape[1] - 4, dtype=torch.int32) % 50
    assert torch.equal(call(short)[0], base[0])
    _close_to_formula(short)
    over = _with_row(case, 1, list(range(case["packed_indices"].shape[1] - 1)))
    full = call(over)[1]
    over["packed_indices"][1, -1] = 10**6
    assert torch.equal(call(over)[1], full)
    over["packed_indices"][1, -1] = -1
    assert torch.equal(call(over)[1], torch.zeros_like(full))


@pytest.mark.parametrize("kind", ["negative_token", "page_beyond_table", "phys_negative", "phys_too_large",
                                  "req_too_large", "req_negative"])
def test_invalid_entries_contribute_nothing(kind):
    case = _case(kv_dtype=BF16)
    NB, page = case["k_cache"].shape[:2]
    W = case["block_table"].shape[1]
    good = [3, 4, 5, 6, 20, 21]
    row = 0
    c = _with_row(case, row, good)
    want = call(c)[row]
    table = c["block_table"].clone()
    c["block_table"] = table
    req = int(c["token_to_req"][row])
    if kind == "negative_token":
        bad = _with_row(c, row, good[:3] + [-7, -1] + good[3:])
    elif kind == "page_beyond_table":
        bad = _with_row(c, row, good + [W * page + 1, (W + 5) * page])
    elif kind in ("phys_negative", "phys_too_large"):
        # a page id that only the bad token uses: put it in the junk column of the table
        table[req, W - 1] = -3 if kind == "phys_negative" else NB + 11
        bad = _with_row(c, row, good + [(W - 1) * page + 2])
    else:
        t2r = c["token_to_req"].clone()
        t2r[row] = case["block_table"].shape[0] + 2 if kind == "req_too_large" else -1
        bad = dict(c, token_to_req=t2r)
        out = call(bad)
        assert torch.equal(out[row], torch.zeros_like(out[row]))  # every entry of the row is invalid
        return
    out = call(bad)
    assert torch.equal(out[row], want)
    _close_to_formula(bad)


def test_never_reads_poisoned_slots():
    """Every unused page and every slot past a request's end is NaN; outputs stay finite."""
    case = _case(kv_dtype=BF16, poison=True, holes=0.2)
    assert torch.isnan(case["meta"]["raw"].float()).any()
    out = call(case)
    assert torch.isfinite(out.float()).all()


def test_equals_dense_causal_attention():
    """For positions < TOPK the QSA selection is dense causal: rows 0..T-1 of one request with
    indices 0..p equal causal attention over the request (``reference.paged_decode`` with
    q_len_per_req = T), whatever the order of the indices."""
    g = _gen("dense")
    T, page, D, Hq, Hkv = 37, 10, 32, 12, 2
    case = make_qsa_case(rows=T, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page=page, num_reqs=1, ctx=T,
                         block_budget=16, positions="all", generator=g)
    packed = case["packed_indices"]
    assert packed[:, -1].tolist() == list(range(1, T + 1))
    for p in range(T):  # shuffle each row's counted prefix: order must not matter (beyond fp32 sums)
        perm = torch.randperm(p + 1, generator=g)
        packed[p, :p + 1] = packed[p, :p + 1][perm]
    out = call(case)
    dense = ref.paged_decode(case["q"], (case["k_cache"], case["v_cache"]), case["block_table"],
                             torch.tensor([T], dtype=torch.int32), kv_layout="NHD", q_len_per_req=T)
    torch.testing.assert_close(out.double(), dense.double(), **OUT_TOL[BF16])


def test_scales_known_answer():
    """FP8 cache with (k_scale, v_scale) = a 16-bit cache holding the dequantized values with
    scales 1; swapping the scales changes the answer (a k/v mix-up cannot pass)."""
    case = _case(kv_dtype=FP8, k_scale=0.5, v_scale=2.0, num_q_heads=6, num_kv_heads=1)
    out = call(case)
    deq = dict(case, k_cache=(case["k_cache"].float() * 0.5), v_cache=(case["v_cache"].float() * 2.0),
               k_scale=1.0, v_scale=1.0)
    torch.testing.assert_close(out.double(), call(deq).double(), rtol=0, atol=0)
    swapped = call(dict(case, k_scale=2.0, v_scale=0.5))
    assert not torch.allclose(out.float(), swapped.float(), rtol=0.05, atol=0.05)


def test_v_scale_scales_output_and_not_lse():
    case = _case(kv_dtype=FP8, k_scale=0.5, v_scale=1.0)
    o1, l1 = call(case, return_lse=True)
    o4, l4 = call(dict(case, v_scale=4.0), return_lse=True)
    torch.testing.assert_close(o4.double(), (o1.double() * 4), rtol=2.0**-7, atol=0)
    assert torch.equal(l1, l4)


def test_gate_rounds_attention_first():
    case = _case(gate=True)
    plain = call(dict(case, output_gate=None))
    gated = call(case)
    want = (plain.float() * torch.sigmoid(case["output_gate"].float())).to(BF16)
    assert torch.equal(gated, want)


def test_duplicate_entries_count_twice():
    case = _case()
    c = _with_row(case, 3, [10, 10, 11])
    _close_to_formula(c)
    assert not torch.equal(call(c)[3], call(_with_row(case, 3, [10, 11]))[3])


def test_out_is_written_in_place():
    case = _case()
    out = torch.full_like(case["q"], float("nan"))
    res = call(case, out=out)
    assert res is out and torch.equal(out, call(case))


def test_argument_errors():
    case = _case()
    with pytest.raises(ValueError, match="packed_indices"):
        call(dict(case, packed_indices=case["packed_indices"][:, :1]))
    with pytest.raises(ValueError, match="token_to_req"):
        call(dict(case, token_to_req=case["token_to_req"][:2]))
    with pytest.raises(ValueError, match="output_gate"):
        call(dict(case, output_gate=case["q"][:, :2]))
