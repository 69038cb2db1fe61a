"""SM90 QSA sparse attention against the reference, on the H200.

Inputs come from ``make_qsa_case`` (tests/cpu/test_qsa_reference.py): the production cache layout
(transposed halves of one ``[blocks, Hkv, PAGE, 2 D]`` buffer), randomly permuted block tables,
QSA's 4-token block selection with TOPK = 2051, every third request short, NaN-poisoned unused
pages and slots past each request's end, fresh random inputs per test (seeded by the test id),
and NaN-filled ``out`` buffers so that any element the kernel fails to write fails the test.

Tolerance: ``assert_close(rtol=2e-2, atol=2e-2)`` on the bf16 outputs against the fp32 reference
on the same (dequantized) cache values, the contract's bound (the kernel's own error is ~1e-3: fp32
accumulation, bf16/fp16 P and one bf16 output rounding).

Grid (the contract's test table, §5): head layouts 24/2, 12/1, 6/1 at D 256, rows 1 to 2048,
pages 784/800/1568/1600, both ``prefill`` profiles, BF16 and FP8 caches (k_scale 0.5/64, v_scale
2.0/64, so a k/v mix-up fails); plus forced split counts (merge with and without the gate), invalid
entries of every kind, count-column edge cases, D 64/128, GQA 16 and 1, fp16, CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops.qsa_sparse_attention import tuning_override
from tests.cpu.test_qsa_reference import make_qsa_case

from .conftest import sm90_only

pytestmark = sm90_only()
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
TOL = dict(rtol=2e-2, atol=2e-2)
WIDTH = 2052  # TOPK 2051 + the count column
BUDGET = 512  # compressed blocks per row

# (rows, Hq, Hkv, page, prefill, reqs, kv)
CASES = [
    (1, 24, 2, 1600, True, 2, BF16),
    (16, 12, 1, 1600, True, 3, BF16),
    (32, 6, 1, 800, True, 5, BF16),
    (128, 24, 2, 1568, True, 7, BF16),
    (257, 6, 1, 800, True, 13, BF16),
    (513, 6, 1, 784, True, 17, BF16),
    (700, 6, 1, 800, True, 23, BF16),
    (1024, 24, 2, 1600, True, 33, BF16),
    (2048, 24, 2, 1600, True, 63, BF16),
    (2048, 24, 2, 1600, False, 63, BF16),
    (1, 24, 2, 1568, False, 1, BF16),
    (4, 24, 2, 1568, False, 4, BF16),
    (16, 12, 1, 1600, False, 16, BF16),
    (64, 6, 1, 784, False, 64, BF16),
    (1, 24, 2, 1600, False, 1, FP8),
    (1, 24, 2, 1600, True, 2, FP8),
    (128, 24, 2, 1568, True, 7, FP8),
    (128, 24, 2, 1568, False, 128, FP8),
    (2048, 24, 2, 1600, True, 63, FP8),
    (2048, 24, 2, 1600, False, 63, FP8),
    (33, 12, 1, 800, False, 33, FP8),
    (96, 6, 1, 784, True, 9, FP8),
]

# FP8 codes are drawn as randn * 64 (see make_qsa_case); these scales make the dequantized K and V
# O(1) (N(0, 0.5) and N(0, 2)), as calibrated serving scales do, so that the 2e-2 absolute
# tolerance means something, while k_scale != v_scale still catches a swap.
K_SCALE = 0.5 / 64
V_SCALE = 2.0 / 64


def _ids(c):
    rows, hq, hkv, page, prefill, reqs, kv = c
    return f"r{rows}-h{hq}/{hkv}-p{page}-{'prefill' if prefill else 'decode'}-q{reqs}-{str(kv)[6:]}"


def _case(gen, rows, hq, hkv, page, reqs, kv, *, D=256, q_dtype=BF16, gate=True, ctx=None, **kw):
    g = torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=gen, device="cuda")))
    fp8 = kv == FP8
    return make_qsa_case(rows=rows, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, page=page, kv_dtype=kv,
                         q_dtype=q_dtype, num_reqs=reqs, ctx=ctx or 4 * page + 321, block_budget=BUDGET, width=WIDTH,
                         short_every=3, gate=gate, k_scale=K_SCALE if fp8 else 1.0, v_scale=V_SCALE if fp8 else 1.0,
                         generator=g, device="cuda", **kw)


def _run(case, prefill, **kw):
    args = {k: v for k, v in case.items() if k != "meta"}
    args.update(kw)
    out = torch.full_like(case["q"], float("nan"))  # poisoned: every element must be written
    res = cute_kernels.qsa_sparse_attention(**args, prefill=prefill, out=out)
    assert res is out
    ref = reference.qsa_sparse_attention(**args)
    return out, ref


def _check(out, ref):
    assert not torch.isnan(out).any(), "unwritten or NaN outputs"
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Every variant the module will hit, compiled in parallel processes first."""
    from cute_kernels.jit.parallel import precompile
    from cute_kernels.plans.sm90_qsa_tile import make_qsa_tile_config
    from cute_kernels.qsa_warmup import qsa_variants

    shapes = {(hq, hkv, page, "fp8" if kv == FP8 else "bf16", 256, "bf16") for _, hq, hkv, page, _, _, kv in CASES}
    shapes |= {(16, 1, 96, "bf16", 128, "bf16"), (8, 8, 64, "fp8", 64, "bf16"), (12, 1, 800, "fp16", 256, "fp16"),
               (24, 2, 1568, "bf16", 256, "bf16"), (12, 1, 800, "bf16", 256, "bf16")}
    configs = []
    for hq, hkv, page, kv, D, qd in shapes:
        for width in (4, 6):  # the cases' block tables (row-tile pre-pass bitmaps)
            configs += qsa_variants(head_dim=D, num_q_heads=hq, num_kv_heads=hkv, page_size=page, kv_cache_dtype=kv,
                                    q_dtype=qd, block_table_width=width)
    # the row-tile kernel's variants (the tests force each)
    configs += [make_qsa_tile_config(q_dtype=c.q_dtype, kv_dtype=c.kv_dtype, head_dim=c.head_dim, group=c.group,
                                     page_size=c.page_size, gate=c.gate, rows_per_cta=c.rows_per_cta, **v)
                for c in configs if c.kernel_id == "sm90.qsa_tile" for v in ROW_TILE_VARIANTS]
    configs = list(dict.fromkeys(configs))
    precompile(configs, "sm_90a")


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_against_reference(gen, case):
    rows, hq, hkv, page, prefill, reqs, kv = case
    c = _case(gen, rows, hq, hkv, page, reqs, kv)
    out, ref = _run(c, prefill)
    _check(out, ref)
    counts = c["packed_indices"][:, -1]
    assert (counts >= 2048).any() or rows < 3  # full budgets are exercised, not only short rows


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("splits", [1, 2, 5, 33])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "nogate"])
def test_forced_splits(gen, kv, splits, gate):
    """Direct output (1) and split-K + merge with and without the gate; 33 = one tile per split,
    so short rows leave most splits empty (0 and -inf partials)."""
    c = _case(gen, 24, 24, 2, 1568, 6, kv, gate=gate)
    with tuning_override(splits=splits):
        out, ref = _run(c, False)
    _check(out, ref)


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("splits", [1, 5])
def test_gather_without_l2_policy(gen, kv, splits):
    """The per-row kernel's plain gather (``evict_first=False``; the default copies carry the L2
    evict-first policy and run in every other per-row test)."""
    c = _case(gen, 24, 24, 2, 1568, 6, kv)
    with tuning_override(splits=splits, evict_first=False):
        out, ref = _run(c, False)
    _check(out, ref)


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("splits", [1, 5])
def test_gather_barriers_against_the_rule(gen, kv, splits):
    """The per-row kernel with the other K/V release than its default: a split launch with K and
    V of a slot released together, an unsplit one with K released before V (``kv_barriers``; the
    defaults run in every other per-row test)."""
    c = _case(gen, 24, 24, 2, 1568, 6, kv)
    with tuning_override(splits=splits, kv_barriers=splits == 1):
        out, ref = _run(c, True)
    _check(out, ref)


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("splits,lanes,group", [(20, 2, 16), (20, 8, 4), (33, 4, 16), (40, 8, 8), (6, 2, 4)])
def test_merge_lanes(gen, kv, splits, lanes, group):
    """The QSA merge with several threads per chunk of a row, each merging a strided share of
    the splits (short rows leave many splits empty: an empty share must combine as weight 0)."""
    c = _case(gen, 24, 24, 2, 1568, 6, kv)
    with tuning_override(splits=splits, merge_lanes=lanes, merge_group=group):
        out, ref = _run(c, False)
    _check(out, ref)


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("splits", [1, 3])
def test_tile_128(gen, kv, splits):
    """The two-M-block tile (not chosen by the table today; benchmarks compare it)."""
    c = _case(gen, 24, 24, 2, 1568, 6, kv)
    with tuning_override(splits=splits, tile=128):
        out, ref = _run(c, True)
    _check(out, ref)


@pytest.mark.parametrize("kind", ["negative_token", "page_beyond_table", "phys_negative", "phys_too_large",
                                  "req_too_large", "req_negative", "count_zero", "count_over_topk",
                                  "count_negative", "holes"])
@pytest.mark.parametrize("splits", [1, 4])
def test_invalid_entries(gen, kind, splits):
    """Each kind of invalid entry contributes nothing and is never dereferenced (the pages it
    would hit are NaN-poisoned or outside the cache)."""
    c = _case(gen, 12, 12, 1, 800, 3, BF16, holes=0.2 if kind == "holes" else 0.0)
    packed, table, t2r = c["packed_indices"], c["block_table"], c["token_to_req"]
    NB, page = c["k_cache"].shape[:2]
    W = table.shape[1]
    r = 1
    req = int(t2r[r])
    cnt = int(packed[r, -1])
    if kind == "negative_token":
        packed[r, : cnt : 3] = -5
    elif kind == "page_beyond_table":
        packed[r, 1:cnt:4] = W * page + 7
    elif kind in ("phys_negative", "phys_too_large"):
        table[req, 0] = -2 if kind == "phys_negative" else NB + 100  # every token of page 0
    elif kind == "req_too_large":
        t2r[r] = table.shape[0] + 5
    elif kind == "req_negative":
        t2r[r] = -1
    elif kind == "count_zero":
        packed[r, -1] = 0
    elif kind == "count_over_topk":
        packed[r, -1] = 10**6  # clamped to TOPK; columns past the old count are -1
    elif kind == "count_negative":
        packed[r, -1] = -7
    with tuning_override(splits=splits):
        out, ref = _run(c, False)
    _check(out, ref)
    if kind in ("req_too_large", "req_negative", "count_zero", "count_negative"):
        assert torch.equal(out[r], torch.zeros_like(out[r]))


@pytest.mark.parametrize("D,hq,hkv,page,kv,qd", [
    (128, 16, 1, 96, BF16, BF16),
    (64, 8, 8, 64, FP8, BF16),
    (256, 12, 1, 800, FP16, FP16),
])
def test_other_shapes(gen, D, hq, hkv, page, kv, qd):
    c = _case(gen, 40, hq, hkv, page, 5, kv, D=D, q_dtype=qd)
    for prefill in (False, True):
        out, ref = _run(c, prefill)
        _check(out, ref)


def test_contiguous_separate_caches(gen):
    """K and V as two separate contiguous [NB, PAGE, Hkv, D] tensors (not halves of one buffer)."""
    c = _case(gen, 20, 24, 2, 1568, 4, BF16)
    c = dict(c, k_cache=c["k_cache"].contiguous(), v_cache=c["v_cache"].contiguous())
    out, ref = _run(c, False)
    _check(out, ref)


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("path", ["decode-s1", "decode-s4", "row-tiles"])
def test_k_and_v_with_different_strides(gen, kv, path):
    """K a half of the fused production buffer, V a separate contiguous tensor: different strides,
    so V's row addresses cannot be derived from K's (the gather computes both)."""
    rows = 140 if path == "row-tiles" else 20
    c = _case(gen, rows, 24, 2, 1568, 1 if path == "row-tiles" else 4, kv)
    c = dict(c, v_cache=c["v_cache"].contiguous())
    assert c["k_cache"].stride() != c["v_cache"].stride()
    with tuning_override(**({"splits": int(path[-1])} if path.startswith("decode") else {})):
        out, ref = _run(c, path == "row-tiles")
    _check(out, ref)


def test_dense_causal_prefill(gen):
    """1 x 300 prefill from position 0: the selection is dense causal (counts 1..300)."""
    c = _case(gen, 300, 24, 2, 1568, 1, BF16, positions="all", ctx=300)
    assert c["packed_indices"][:, -1].tolist() == list(range(1, 301))
    out, ref = _run(c, True)
    _check(out, ref)


def test_empty_batch(gen):
    c = _case(gen, 4, 24, 2, 1568, 2, BF16)
    args = {k: (v[:0] if k in ("q", "packed_indices", "token_to_req", "output_gate") else v)
            for k, v in c.items() if k != "meta"}
    out = cute_kernels.qsa_sparse_attention(**args, prefill=False)
    assert out.shape == (0, 24, 256)


@pytest.mark.parametrize("rows", [4, 64])
def test_cuda_graph_replay(gen, rows):
    """Captured once, replayed with new indices, counts and queries: the host never reads data."""
    c = _case(gen, rows, 24, 2, 1568, rows, FP8)
    args = {k: v for k, v in c.items() if k != "meta"}
    out = torch.empty_like(c["q"])
    cute_kernels.qsa_sparse_attention(**args, prefill=False, out=out)  # compile + size the workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_kernels.qsa_sparse_attention(**args, prefill=False, out=out)
    c2 = _case(gen, rows, 24, 2, 1568, rows, FP8)
    for name in ("q", "packed_indices", "output_gate"):
        c[name].copy_(c2[name])
    c["packed_indices"][0, -1] = 5  # a short row
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.qsa_sparse_attention(**{k: v for k, v in c.items() if k != "meta"})
    _check(out, ref)


def test_cpu_tensors_run_the_reference():
    c = make_qsa_case(rows=3, num_q_heads=12, num_kv_heads=1, head_dim=64, page=20, ctx=50, gate=True)
    args = {k: v for k, v in c.items() if k != "meta"}
    assert torch.equal(cute_kernels.qsa_sparse_attention(**args, prefill=False),
                       reference.qsa_sparse_attention(**args))


def test_argument_errors(gen):
    c = _case(gen, 4, 24, 2, 1568, 2, BF16)
    args = {k: v for k, v in c.items() if k != "meta"}
    with pytest.raises(TypeError, match="packed_indices"):
        cute_kernels.qsa_sparse_attention(**dict(args, packed_indices=args["packed_indices"].long()), prefill=False)
    with pytest.raises(ValueError, match="k_scale"):
        cute_kernels.qsa_sparse_attention(**dict(args, k_scale=-1.0), prefill=False)
    with pytest.raises(ValueError, match="num_q_heads / num_kv_heads"):
        q = torch.zeros(4, 48, 256, dtype=BF16, device="cuda")
        cute_kernels.qsa_sparse_attention(**dict(args, q=q, output_gate=None), prefill=False)
    with pytest.raises(TypeError, match="prefill"):
        cute_kernels.qsa_sparse_attention(**args, prefill=1)


@pytest.mark.parametrize("path", ["split", "unsplit", "row-tiles"])
def test_argument_errors_after_a_cached_call(gen, path):
    """The launch key leaves to the compiled functions what they check themselves (dtypes of the
    index tensors and outputs, extents shared with the query or the cache, devices, alignment):
    after a good call on each launch path, each such bad input still raises the op's error naming
    the argument, and the cached launch still computes correctly afterwards."""
    rows = 80 if path == "row-tiles" else 4
    c = _case(gen, rows, 24, 2, 1568, 2, BF16)
    args = {k: v for k, v in c.items() if k != "meta"}
    prefill = path == "row-tiles"
    run = cute_kernels.qsa_sparse_attention
    with tuning_override(**({"splits": 3} if path == "split" else {"splits": 1} if path == "unsplit" else {})):
        run(**args, prefill=prefill)
        bad = [
            (TypeError, "packed_indices must have dtype int32", dict(packed_indices=args["packed_indices"].long())),
            (TypeError, "block_table must have dtype int32", dict(block_table=args["block_table"].long())),
            (ValueError, "token_to_req must have shape", dict(token_to_req=args["token_to_req"][:2])),
            (ValueError, "token_to_req must be on", dict(token_to_req=args["token_to_req"].cpu())),
            (TypeError, "output_gate must have dtype", dict(output_gate=args["output_gate"].half())),
            (ValueError, "v_cache must be on", dict(v_cache=args["v_cache"].cpu())),
            (ValueError, "k_scale must be a positive finite float", dict(k_scale=True)),
        ]
        for exc, msg, change in bad:
            with pytest.raises(exc, match=msg):
                run(**dict(args, **change), prefill=prefill)
        with pytest.raises(TypeError, match="out must have dtype"):
            run(**args, prefill=prefill, out=torch.empty_like(args["q"], dtype=torch.float16))
        out, ref = _run(c, prefill)
    _check(out, ref)


# ---- the prefill row-tile path (union pre-pass + R rows per CTA) ----

def _prefill_case(gen, rows, hq, hkv, page, kv, first, selection, **kw):
    """1 x ``rows`` prefill rows at positions ``first ..`` of one request, with the benchmark's
    selection model (``correlated``: neighbours share ~90 % of their blocks)."""
    from cute_kernels.bench.qsa_selection import qsa_indices

    ctx = first + rows
    c = _case(gen, rows, hq, hkv, page, 1, kv, ctx=ctx, positions="all", **kw)
    pos = torch.arange(first, first + rows, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(2**31, (1,), generator=gen, device="cuda")))
    c["packed_indices"] = qsa_indices(pos, topk=WIDTH - 1, budget=BUDGET, selection=selection, generator=g)
    c["token_to_req"].zero_()
    return c


# kernel variants of the row-tile path the tests force (the default is one of them)
# (the overlapped consumer: QK of a tile issued with PV of the previous one, two P buffers)
ROW_TILE_VARIANTS = [dict(consumers=1, producers=4, gather_groups=1, overlap=False),
                     dict(consumers=2, producers=4, gather_groups=1),
                     dict(consumers=1, producers=8, gather_groups=2, overlap=False),
                     dict(consumers=1, producers=4, gather_groups=1, overlap=True),
                     dict(consumers=1, producers=8, gather_groups=2, overlap=True)]
ROW_TILE_IDS = ["c1", "c2", "p8g2", "c1-overlap", "p8g2-overlap"]


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("hq,hkv,page", [(24, 2, 1568), (6, 1, 784)])
@pytest.mark.parametrize("selection", ["correlated", "independent"])
@pytest.mark.parametrize("variant", ROW_TILE_VARIANTS, ids=ROW_TILE_IDS)
def test_row_tiles(gen, kv, hq, hkv, page, selection, variant):
    """Rows at positions 2900.. (full budgets; 301 rows: a partial last tile): correlated
    selections take the union path, independent ones mostly exceed the union cap and walk the
    rows' own lists; both against the reference and close to the per-row kernel; with one and
    with two consumer warpgroups (alternate tiles, combined at the end), and with two groups of
    4 gather warps (alternate tiles in flight)."""
    c = _prefill_case(gen, 301, hq, hkv, page, kv, 2900, selection)
    with tuning_override(**variant):
        out, ref = _run(c, True)
    _check(out, ref)
    with tuning_override(tile_rows=1):
        per_row, _ = _run(c, True)
    torch.testing.assert_close(out.float(), per_row.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("variant", ROW_TILE_VARIANTS, ids=ROW_TILE_IDS)
def test_row_tiles_short_rows(gen, kv, variant):
    """The first rows of a prefill (positions 0..): tiles with a single union tile (the second
    consumer warpgroup or gather group has none), rows of one token, partial tiles."""
    c = _prefill_case(gen, 133, 24, 2, 1568, kv, 0, "correlated")
    with tuning_override(**variant):
        out, ref = _run(c, True)
    _check(out, ref)


def _launch_of(c, out):
    """The op's cached launch of case ``c`` (under the active tuning override)."""
    from cute_kernels.ops import qsa_sparse_attention as op

    return op._launcher.get(op._key(c["q"], c["k_cache"], c["v_cache"], c["packed_indices"], c["block_table"],
                                 c["token_to_req"], True, c.get("k_scale", 1.0), c.get("v_scale", 1.0), out,
                                 c["output_gate"]))


def _check_widened(c, launch):
    """The widening pre-pass's table (slot r * W + j for a valid page id, -1 otherwise) and
    copy (each valid page's K rows, exactly; the cases' stale bytes past a request's end are
    NaN codes, which stay NaN)."""
    bt, nb = c["block_table"], c["k_cache"].shape[0]
    NR, W = bt.shape
    slots = torch.arange(NR * W, device="cuda", dtype=torch.int32).view(NR, W)
    valid = (bt >= 0) & (bt < nb)
    assert torch.equal(launch.table, torch.where(valid, slots, torch.full_like(slots, -1)))
    for r, j in valid.nonzero().tolist()[:4]:
        torch.testing.assert_close(launch.wide_k[r * W + j], c["k_cache"][int(bt[r, j])].to(launch.wide_k.dtype),
                                   rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("hq,hkv,page", [(24, 2, 1568), (6, 1, 784)])
def test_row_tiles_fp8_widened(gen, hq, hkv, page):
    """FP8 row tiles on the widened 16-bit copy (forced): correlated and independent full
    budgets and the first rows of a prefill, against the reference and close to the row tiles
    that widen each gathered row; the copy and its table checked exactly."""
    cases = [_prefill_case(gen, 301, hq, hkv, page, FP8, 2900, sel) for sel in ("correlated", "independent")]
    cases.append(_prefill_case(gen, 133, hq, hkv, page, FP8, 0, "correlated"))
    for c in cases:
        with tuning_override(widen=1):
            out, ref = _run(c, True)
            launch = _launch_of(c, out)
        assert launch is not None and launch.widen_fn is not None
        _check(out, ref)
        _check_widened(c, launch)
        with tuning_override(widen=0):
            direct, _ = _run(c, True)
            assert _launch_of(c, direct).widen_fn is None
        torch.testing.assert_close(out.float(), direct.float(), rtol=1e-2, atol=1e-2)


def test_row_tiles_fp8_widened_mixed_requests_and_invalid(gen):
    """The widened copy with several requests, holes, an invalid request, a page beyond the
    table, and invalid page ids in the block table (negative, >= num_blocks): never read by the
    widening, -1 in its table, contributing nothing."""
    c = _case(gen, 390, 24, 2, 1568, 3, FP8, holes=0.1)
    packed, t2r, bt = c["packed_indices"], c["token_to_req"], c["block_table"]
    W = bt.shape[1]
    packed[10, 1:40:3] = W * 1568 + 9
    t2r[150] = 99
    bt[1, 1] = -3
    bt[2, 0] = c["k_cache"].shape[0] + 7
    with tuning_override(widen=1):
        out, ref = _run(c, True)
        launch = _launch_of(c, out)
    assert launch.widen_fn is not None
    _check(out, ref)
    _check_widened(c, launch)


def test_row_tiles_path_taken(gen):
    """The union pre-pass really builds unions for correlated rows (length >= 0 on most tiles)
    and falls back for a tile holding a duplicate token (the reference counts it twice); outputs
    still match the reference."""
    c = _prefill_case(gen, 200, 24, 2, 1568, BF16, 3000, "correlated")
    c["packed_indices"][7, 3] = c["packed_indices"][7, 0]  # row 7 lists one token twice
    args = {k: v for k, v in c.items() if k != "meta"}
    out = torch.full_like(c["q"], float("nan"))
    cute_kernels.qsa_sparse_attention(**args, prefill=True, out=out)
    launch = _launch_of(c, out)
    assert launch is not None and launch.union_fn is not None
    R = launch.member.shape[1]
    length = launch.length.cpu()
    assert length.numel() == -(-200 // R)
    assert int(length[7 // R]) == -1
    assert (length >= 0).float().mean() > 0.8
    _check(out, reference.qsa_sparse_attention(**args))


@pytest.mark.parametrize("variant", ROW_TILE_VARIANTS, ids=ROW_TILE_IDS)
def test_row_tiles_mixed_requests_and_invalid(gen, variant):
    """Several requests (tiles straddling two requests fall back), holes, an invalid request and
    a page beyond the table inside union tiles."""
    c = _case(gen, 390, 24, 2, 1568, 3, BF16, holes=0.1)
    packed, t2r = c["packed_indices"], c["token_to_req"]
    W = c["block_table"].shape[1]
    packed[10, 1:40:3] = W * 1568 + 9
    t2r[150] = 99
    with tuning_override(**variant):
        out, ref = _run(c, True)
    _check(out, ref)


@pytest.mark.parametrize("offset", [0, 1], ids=["fused-aligned", "odd-offset"])
def test_row_tiles_gate_views(gen, offset):
    """The gate as a view: the second half of a fused ``[rows, Hq, 2 D]`` projection (4-byte
    aligned: loaded in pairs) and shifted by one element (2-byte aligned: loaded one by one)."""
    c = _prefill_case(gen, 140, 24, 2, 1568, BF16, 2600, "correlated")
    rows, hq, D = c["q"].shape
    fused = torch.randn(rows, hq, 2 * D + 2, device="cuda", dtype=c["q"].dtype) * 2
    c["output_gate"] = fused[:, :, D + offset:2 * D + offset]
    assert (c["output_gate"].data_ptr() % 4 == 0) == (offset == 0)
    out, ref = _run(c, True)
    _check(out, ref)


@pytest.mark.parametrize("widen", [0, 1], ids=["direct", "widened"])
def test_row_tiles_graph_replay(gen, widen):
    """The row-tile path captured in a CUDA graph and replayed with new indices and queries (and
    new FP8 K values: the widened copy is remade by the replay)."""
    c = _prefill_case(gen, 128, 24, 2, 1568, FP8, 2500, "correlated")
    args = {k: v for k, v in c.items() if k != "meta"}
    out = torch.empty_like(c["q"])
    with tuning_override(widen=widen):
        cute_kernels.qsa_sparse_attention(**args, prefill=True, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cute_kernels.qsa_sparse_attention(**args, prefill=True, out=out)
    c["k_cache"].copy_((torch.randn(c["k_cache"].shape, device="cuda") * 64).clamp(-448, 448).to(FP8))
    c2 = _prefill_case(gen, 128, 24, 2, 1568, FP8, 2500, "correlated")
    for name in ("q", "packed_indices", "output_gate"):
        c[name].copy_(c2[name])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, reference.qsa_sparse_attention(**{k: v for k, v in c.items() if k != "meta"}))
