"""``dispatch.plan_qsa`` on every arch: SM90 gets ``sm90.qsa`` when its limits accept the layer,
everything else the labelled reference fallback, with a reason; QSA stays out of ``plan()``'s
paged prefill/decode lists."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from cute_kernels.registry import QSA_FALLBACK, kernels_on
from dispatch import (
    KERNELS,
    SUPPORTED_ARCHS,
    UnsupportedConfig,
    capability_table,
    plan_qsa,
    qsa_capability_table,
)

QWEN = dict(head_dim=256, num_q_heads=24, num_kv_heads=2)


def _plan(arch="sm90", kv="fp8", model="bf16", **kw):
    shape = {**QWEN, **{k: kw.pop(k) for k in list(kw) if k in QWEN}}
    return plan_qsa(arch, kv, shape["head_dim"], shape["num_q_heads"], shape["num_kv_heads"], model_dtype=model, **kw)


@pytest.mark.parametrize("arch,kv,model", list(itertools.product(SUPPORTED_ARCHS, ("bf16", "fp16", "fp8"),
                                                                 ("bf16", "fp16"))))
def test_every_arch_has_a_plan(arch, kv, model):
    p = _plan(arch, kv, model)
    assert p.arch == arch and p.q_dtype == model and p.model_dtype == model
    served = arch == "sm90" and kv in ("fp8", model)
    assert p.kernel == ("sm90.qsa" if served else QSA_FALLBACK)
    assert p.is_fallback == (not served)
    assert p.reason.endswith(".") and ("fallback" in p.reason) == (not served)
    if not served and arch != "sm90":
        assert f"no CuTe QSA kernel targets {arch}" in p.reason


@pytest.mark.parametrize("tp", [(24, 2), (12, 1), (6, 1)])
def test_qwen38_tp_layouts_on_sm90(tp):
    hq, hkv = tp
    for kv in ("fp8", "bf16", "auto"):
        p = _plan(num_q_heads=hq, num_kv_heads=hkv, kv=kv)
        assert p.kernel == "sm90.qsa" and p.gqa_ratio == hq // hkv
        assert p.reason == "sm90.qsa accepts this layer."


@pytest.mark.parametrize("change,needle", [
    (dict(head_dim=96), r"head_dim 64/128/256 \(got 96\)"),
    (dict(num_q_heads=64, num_kv_heads=2), r"GQA ratio .* up to 16 \(got 32\)"),
    (dict(kv="fp16", model="bf16"), r"an FP8 cache or one of the model dtype bf16 \(got fp16\)"),
])
def test_sm90_falls_back_with_the_reason(change, needle):
    p = _plan(**change)
    assert p.kernel == QSA_FALLBACK
    assert re.search(needle, p.reason), p.reason


def test_planned_kernel_falls_back(monkeypatch):
    monkeypatch.setitem(KERNELS, "sm90.qsa", dataclasses.replace(KERNELS["sm90.qsa"], status="planned"))
    p = _plan()
    assert p.kernel == QSA_FALLBACK and p.reason == "reference fallback: sm90.qsa is not built yet."


def test_explicit_backends():
    assert _plan("sm80", backend="reference").kernel == QSA_FALLBACK
    assert _plan(backend="sm90.qsa").backend == "sm90.qsa"
    with pytest.raises(UnsupportedConfig, match="runs on sm90, not sm100"):
        _plan("sm100", backend="sm90.qsa")
    with pytest.raises(UnsupportedConfig, match="head_dim"):
        _plan(backend="sm90.qsa", head_dim=80)
    with pytest.raises(UnsupportedConfig, match="not a QSA kernel id"):
        _plan(backend="sm90.decode")


@pytest.mark.parametrize("kw,needle", [
    (dict(arch="sm_70"), "not supported"),
    (dict(kv="uint8"), "view the cache as float8_e4m3fn"),
    (dict(model="fp8"), "model_dtype"),
    (dict(num_q_heads=25), r"num_q_heads \(25\) must be a multiple"),
    (dict(head_dim=0), "head_dim must be a positive int"),
    (dict(backend=3), "backend must be a kernel id"),
])
def test_bad_arguments(kw, needle):
    with pytest.raises(UnsupportedConfig, match=needle):
        _plan(**kw)


def test_capability_listing_is_separate_from_paged_attention():
    rows = qsa_capability_table()
    assert [r["arch"] for r in rows] == list(SUPPORTED_ARCHS)
    for r in rows:
        ids = [k["id"] for k in r["kernels"]]
        assert ids[-1] == QSA_FALLBACK
        assert ids == (["sm90.qsa", QSA_FALLBACK] if r["arch"] == "sm90" else [QSA_FALLBACK])
    qsa = kernels_on("qsa")
    assert set(qsa) == {"sm90.qsa", QSA_FALLBACK}
    for row in capability_table():  # plan()'s per-phase lists never name a QSA kernel
        assert not any(k["id"] in qsa for k in row["kernels"] + row["opt_in"])
    assert not set(qsa) & set(kernels_on("attention"))
    assert KERNELS[QSA_FALLBACK].status == "fallback"
    assert KERNELS["sm90.qsa"].archs == ("sm90",)


def test_plan_serialises():
    d = _plan().to_dict()
    assert d["kernel"] == "sm90.qsa" and d["is_fallback"] is False and d["num_q_heads"] == 24


# ----------------------------------------------------------------------------------------------
# the op's config table and warm-up enumeration (host side, no GPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("group", [12, 6])
@pytest.mark.parametrize("prefill", [False, True])
def test_split_table_shape(kv, group, prefill):
    from cute_kernels.plans.sm90_qsa import PRODUCTION_TOPK, select_config, split_table

    table = split_table(kv, 256, group, prefill)
    tiles = -(-PRODUCTION_TOPK // 64)
    assert table[-1][0] == 0 and table[-1][2] == 1  # unbounded last entry, no split
    bounds = [b for b, _, _ in table[:-1]]
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
    splits = [s for _, _, s in table]
    assert splits == sorted(splits, reverse=True) and 1 <= min(splits) and max(splits) <= tiles
    assert select_config(1, 2, prefill, kv, 256, group) == (64, tiles)  # decode N=1: one tile per split
    assert select_config(16384, 2, prefill, kv, 256, group) == (64, 1)
    assert select_config(1, 1, prefill, kv, 256, group, topk=100)[1] <= 2  # never more splits than tiles


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_split_table_matches_the_measured_optima(kv):
    """The H200 sweep of forced split counts (docs/design/qsa.md#split-table, Hq 24 / Hkv 2 / D 256):
    the fastest split counts were N = 4 rows: 11, N = 16: 4, N = 64: 1, for BF16 and FP8 alike
    (FP8's two CTAs per SM share one SM's gather rate; counting them as twice the rate split FP8
    3x too finely: N = 4 at 33 splits took 16.1 us against 10.4 at 11). Split launches are
    programmatic dependents, unsplit ones not (measured: PDL helped N 4/16, cost FP8 N 64 3 us)."""
    from cute_kernels.plans.sm90_qsa import make_qsa_config, select_config

    assert [select_config(n, 2, False, kv, 256, 12)[1] for n in (1, 4, 16, 64, 256)] == [33, 11, 4, 1, 1]
    for split in (False, True):
        c = make_qsa_config(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=12, page_size=1568, split=split,
                            gate=True)
        assert c.pdl == split and c.gate == (not split)


def test_warmup_covers_every_table_entry():
    from cute_kernels.plans.sm90_qsa import Sm90QsaConfig, split_table
    from cute_kernels.plans.sm90_qsa_merge import QsaMergeConfig
    from cute_kernels.qsa_warmup import qsa_variants

    configs = qsa_variants(head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568, kv_cache_dtype="fp8")
    kernels = [c for c in configs if isinstance(c, Sm90QsaConfig)]
    merges = [c for c in configs if isinstance(c, QsaMergeConfig)]
    assert {(c.split, c.gate) for c in kernels} == {(False, True), (False, False), (True, False)}
    assert all(c.kv_dtype == "fp8_e4m3" and c.page_size == 1568 and c.group == 12 for c in kernels)
    assert {m.gate for m in merges} == {True, False}
    reach = {(t, s > 1) for p in (False, True) for _, t, s in split_table("fp8_e4m3", 256, 12, p)}
    assert reach <= {(c.tile, c.split) for c in kernels}
    assert len(configs) == len(set(configs))
    # the merge's load group is chosen from the split count: every reachable one is compiled
    from cute_kernels.plans.sm90_qsa_merge import merge_shape
    shapes = {merge_shape(s) for p in (False, True) for _, _, s in split_table("fp8_e4m3", 256, 12, p) if s > 1}
    assert {(m.group, m.lanes, m.gate) for m in merges} == {(*m, gate) for m in shapes for gate in (True, False)}


def test_row_tile_plan():
    """Prefill batches of >= 64 rows take the row-tile path, sized from the block table; decode
    batches, small batches and block tables beyond the pre-pass bitmap do not."""
    from cute_kernels.plans.sm90_qsa_tile import MAX_BITMAP_TOKENS, TILE_MIN_ROWS, row_tile_plan, tile_rows

    p = row_tile_plan(16384, True, "bf16", 12, 1568, 11, 2051)
    assert (p.rows_per_cta, p.max_tokens, p.union_cap, p.num_tiles) == (5, 32768, 6208, 3277)
    assert p.union_cap % 64 == 0 and p.union_cap >= 3 * 2051
    assert row_tile_plan(16384, True, "fp8_e4m3", 6, 784, 3, 2051).rows_per_cta == 8  # 8 x 6 columns
    assert row_tile_plan(100, True, "bf16", 12, 1568, 1, 20).union_cap == 64  # min(R, 3) * TOPK, rounded up
    assert row_tile_plan(16384, False, "bf16", 12, 1568, 11, 2051) is None  # decode profile
    assert row_tile_plan(TILE_MIN_ROWS - 1, True, "bf16", 12, 1568, 11, 2051) is None
    assert row_tile_plan(4096, True, "bf16", 12, 1568, MAX_BITMAP_TOKENS // 1568 + 1, 2051) is None
    assert row_tile_plan(4096, True, "bf16", 12, 1568, 11, 2051, rows_per_cta=1) is None  # forced per-row
    assert [tile_rows("bf16", g) for g in (1, 6, 12, 16)] == [8, 8, 5, 4]


def test_widened_cache_selection():
    """FP8 prefill row tiles run on a widened 16-bit copy when the copy (16-bit K and V of every
    page the block table addresses) is within the byte cap and the per-row allowance: the
    benchmark's 1 x 16384 (11 pages of 1568) and 1 x 1024 yes; a 4096-row batch whose table is a
    serving engine's full width (168 pages of 1568 per request, 539 MB) no; 16-bit caches never."""
    from cute_kernels.plans.hw import MAX_GRID_Y
    from cute_kernels.plans.sm90_qsa_widen import (
        WIDEN_BYTES_PER_ROW,
        WIDEN_MAX_BYTES,
        use_widened_cache,
        widen_grid_rows,
        widened_bytes,
    )

    shape = dict(page_size=1568, num_kv_heads=2, head_dim=256)
    assert widened_bytes(1, 11, **shape) == 11 * 1568 * 2 * 256 * 4  # 35.3 MB
    assert use_widened_cache("fp8_e4m3", 16384, 1, 11, **shape)
    assert use_widened_cache("fp8_e4m3", 1024, 1, 1, **shape)
    assert not use_widened_cache("fp8_e4m3", 4096, 1, 168, **shape)
    assert not use_widened_cache("bf16", 16384, 1, 11, **shape)
    # the per-row allowance and the cap, at their edges
    rows = widened_bytes(1, 11, **shape) // WIDEN_BYTES_PER_ROW
    assert use_widened_cache("fp8_e4m3", rows + 1, 1, 11, **shape)
    assert not use_widened_cache("fp8_e4m3", rows - 1, 1, 11, **shape)
    reqs = WIDEN_MAX_BYTES // widened_bytes(1, 11, **shape)
    assert use_widened_cache("fp8_e4m3", 10**7, reqs, 11, **shape)
    assert not use_widened_cache("fp8_e4m3", 10**7, reqs + 1, 11, **shape)
    # forced (tests, benchmarks): whatever the size, never for 16-bit caches or oversized grids
    assert use_widened_cache("fp8_e4m3", 64, 100, 168, **shape, force=True)
    assert not use_widened_cache("fp8_e4m3", 16384, 1, 11, **shape, force=False)
    assert not use_widened_cache("bf16", 16384, 1, 11, **shape, force=True)
    assert not use_widened_cache("fp8_e4m3", 4096, 1, 0, **shape, force=True)  # an empty table: nothing to widen
    assert not use_widened_cache("fp8_e4m3", 4096, 0, 11, **shape, force=True)
    assert widen_grid_rows(1568, 2, 256) == 196  # 16 rows of 256 per CTA
    huge = dict(page_size=MAX_GRID_Y * 16, num_kv_heads=2, head_dim=256)
    assert not use_widened_cache("fp8_e4m3", 64, 1, 1, **huge, force=True)


def test_widen_config_and_warmup():
    """The widening pre-pass compiles for each q dtype; an FP8 deployment's warm-up covers it and
    the 16-bit row-tile kernel it feeds; a 16-bit one does not."""
    from cute_kernels.plans.sm90_qsa_widen import QsaWidenConfig
    from cute_kernels.qsa_warmup import qsa_variants

    with pytest.raises(ValueError, match="output dtype"):
        QsaWidenConfig(out_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="head_dim"):
        QsaWidenConfig(head_dim=96)
    shape = dict(head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568, block_table_width=11)
    fp8 = qsa_variants(**shape, kv_cache_dtype="fp8")
    assert QsaWidenConfig(out_dtype="bf16", head_dim=256, page_size=1568) in fp8
    tiles = {(c.kv_dtype, c.gate) for c in fp8 if c.kernel_id == "sm90.qsa_tile"}
    assert tiles == {(kv, g) for kv in ("fp8_e4m3", "bf16") for g in (True, False)}
    assert not any(c.kernel_id == "sm90.qsa_widen" for c in qsa_variants(**shape, kv_cache_dtype="bf16"))


def test_row_tile_config_validation():
    from cute_kernels.plans.sm90_qsa_tile import Sm90QsaTileConfig, make_qsa_tile_config

    c = make_qsa_tile_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=256, group=12, page_size=1568, gate=True)
    assert (c.rows_per_cta, c.n_pad, c.stages, c.occupancy, c.split) == (5, 64, 3, 1, False)
    # FP8: one consumer warpgroup, two groups of 4 gather warps (two widened tiles in flight)
    assert (c.consumers, c.producers, c.gather_groups) == (1, 8, 2)
    assert any("cvt" in p for _, p in c.evidence["sm_90a"])  # FP8: widened by the gather warps
    b = make_qsa_tile_config(q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=12, page_size=1568, gate=True)
    assert (b.consumers, b.producers, b.gather_groups) == (2, 4, 1)  # two consumer warpgroups
    assert any("cp\\.async" in p for _, p in b.evidence["sm_90a"])
    # 384 threads: setmaxnreg within the launch's 168 registers per thread (above it hangs)
    for cfg in (b, c):
        threads = (4 * cfg.consumers + cfg.producers) * 32
        assert threads == 384 and cfg.producers * 32 * cfg.producer_regs + cfg.consumers * 128 * cfg.consumer_regs <= 384 * 168
    one = make_qsa_tile_config(q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=12, page_size=1568, gate=True,
                               consumers=1)
    assert (one.producer_regs, one.consumer_regs) == (0, 0)  # 256 threads: no rebalancing
    with pytest.raises(ValueError, match="registers"):
        Sm90QsaTileConfig(consumers=2, producers=4, producer_regs=48, consumer_regs=232)  # 48 + 2 x 232 > 3 x 168
    with pytest.raises(ValueError, match="single consumer"):
        Sm90QsaTileConfig(consumers=2, producers=4, gather_groups=2, producer_regs=56, consumer_regs=224)
    with pytest.raises(ValueError, match="12"):
        Sm90QsaTileConfig(consumers=2, producers=8)  # 512 threads
    with pytest.raises(ValueError, match="gather_groups"):
        Sm90QsaTileConfig(producers=4, gather_groups=3)
    with pytest.raises(ValueError, match="rows_per_cta"):
        Sm90QsaTileConfig(group=12, rows_per_cta=6)  # 72 columns
    with pytest.raises(ValueError, match="does not split"):
        Sm90QsaTileConfig(split=True)
    # a gate is read in 4-byte pairs (the op passes gate_vec=1 for a 2-byte aligned gate), and
    # the signature promises (and TVM-FFI checks) the matching alignment
    assert (b.gate_vec, make_qsa_tile_config(q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=12,
                                             page_size=1568, gate=False).gate_vec) == (2, 1)
    assert {a.name: a.align for a in b.signature() if hasattr(a, "align")}["gate"] == 4
    assert {a.name: a.align for a in dataclasses.replace(b, gate_vec=1).signature()
            if hasattr(a, "align")}["gate"] == 2
    with pytest.raises(ValueError, match="gate_vec"):
        Sm90QsaTileConfig(gate=False, gate_vec=2)
    with pytest.raises(ValueError, match="producers"):
        Sm90QsaTileConfig(producers=3)


def test_warmup_covers_the_row_tile_path():
    from cute_kernels.plans.sm90_qsa_tile import Sm90QsaTileConfig
    from cute_kernels.plans.sm90_qsa_union import QsaUnionConfig
    from cute_kernels.qsa_warmup import qsa_variants

    shape = dict(head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568, kv_cache_dtype="bf16")
    assert not any(isinstance(c, (Sm90QsaTileConfig, QsaUnionConfig)) for c in qsa_variants(**shape))
    configs = qsa_variants(**shape, block_table_width=11)
    tiles = [c for c in configs if isinstance(c, Sm90QsaTileConfig)]
    unions = [c for c in configs if isinstance(c, QsaUnionConfig)]
    assert {c.gate for c in tiles} == {True, False} and {c.rows_per_cta for c in tiles} == {5}
    assert unions == [QsaUnionConfig(rows_per_tile=5, page_size=1568, max_tokens=32768, union_cap=6208)]


def test_op_on_cpu_runs_the_reference_and_validates():
    torch = pytest.importorskip("torch")
    import cute_kernels
    from tests.cpu.test_qsa_reference import make_qsa_case

    c = make_qsa_case(rows=4, num_q_heads=12, num_kv_heads=2, head_dim=64, page=10, ctx=40, gate=True)
    args = {k: v for k, v in c.items() if k != "meta"}
    out = cute_kernels.qsa_sparse_attention(**args, prefill=True)
    assert torch.equal(out, cute_kernels.reference.qsa_sparse_attention(**args))
    # the kernels' limits hold on the CPU too: a head dim they refuse is refused here
    c32 = make_qsa_case(rows=4, num_q_heads=12, num_kv_heads=2, head_dim=32, page=10, ctx=40, gate=True)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        cute_kernels.qsa_sparse_attention(**{k: v for k, v in c32.items() if k != "meta"}, prefill=True)
    with pytest.raises(TypeError, match="packed_indices must have dtype int32"):
        cute_kernels.qsa_sparse_attention(**dict(args, packed_indices=args["packed_indices"].long()), prefill=True)
    with pytest.raises(ValueError, match="token_to_req must have shape"):
        cute_kernels.qsa_sparse_attention(**dict(args, token_to_req=args["token_to_req"][:2]), prefill=True)
    with pytest.raises(TypeError, match="prefill must be a bool"):
        cute_kernels.qsa_sparse_attention(**args, prefill="yes")
    with pytest.raises(ValueError, match="v_scale"):
        cute_kernels.qsa_sparse_attention(**dict(args, v_scale=float("nan")), prefill=True)
    with pytest.raises(ValueError, match="k_cache and v_cache must match"):
        cute_kernels.qsa_sparse_attention(**dict(args, v_cache=args["v_cache"][:1]), prefill=True)
