"""``paged_prefill`` on SM100 / SM103 without a GPU: the routing to the compile-verified tcgen05
kernel ``sm100.prefill`` (CPU tensors on the CUDA path, the arch and the compiled function
stubbed), its runtime self-check and the fallback when it fails, the kv_cap length rule of the
contract the SM100 kernels follow (keys at or past the block table's capacity are never visible),
and the self-check problems of both SM100 kernels (lengths past the table included).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from cute_kernels import reference
from cute_kernels.ops import _paged_decode_sm100 as decode_sm100
from cute_kernels.ops import _paged_prefill_sm100 as sm100
from cute_kernels.ops import _selfcheck
from cute_kernels.ops import paged_prefill as op
from cute_kernels.plans import selfcheck_records as records
from cute_kernels.plans.sm100 import Sm100DecodeConfig, Sm100PrefillConfig, prefill_variants

from .test_prefill_host import _args, _kw, _problem, ffi_checks
from .test_prefill_selfcheck import reference_kernel
from .test_selfcheck import _isolated_records  # noqa: F401 (autouse: records in a temporary folder)

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


@pytest.fixture(params=["sm_100a", "sm_103a"])
def blackwell(request, monkeypatch):
    """CPU tensors take the CUDA path on an SM100 / SM103 target; every compiled function (the
    op's and the self-check's) is the reference behind TVM-FFI's checks (``state["damage"]``
    breaks sm100.prefill only); ``state["compiled"]`` lists the lookups."""
    target = request.param
    state = dict(target=target, damage=None, compiled=[])

    def get_kernel(config, tgt):
        assert tgt == target
        state["compiled"].append(config)
        damage = state["damage"] if config.kernel_id == sm100.KERNEL_ID else None
        if config.kernel_id == "sm80.prefill":
            signature = config.signature()

            def fn(*args):  # the portable kernel: its own signature, checked
                ffi_checks(signature, args)
            return fn
        return reference_kernel(config, damage=damage)

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for mod in (op, sm100):
        monkeypatch.setattr(mod, "compile_target", lambda device: target)
        monkeypatch.setattr(mod, "get_kernel", get_kernel)
    op._launcher.entries.clear()
    yield state
    op._launcher.entries.clear()


def _fp8_problem(key, **kw):
    return _problem(key, kv_dtype=FP8, q_dtype=FP8, **kw)


# ----------------------------------------------------------------------------------------------
# routing
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qd,kv,layout,container,causal,lse", [
    (BF16, BF16, "HND", "single", True, True),
    (FP16, FP16, "NHD", "tuple", False, False),
    (FP8, FP8, "HND", "single", True, True),
])
def test_sm100_prefill_serves_its_dtypes_after_its_check(blackwell, qd, kv, layout, container, causal, lse):
    p = _problem(("route", str(qd), layout, blackwell["target"]), kv_dtype=kv, q_dtype=qd, layout=layout,
                 container=container)
    want = reference.paged_prefill(*_args(p), causal=causal, return_lse=lse, **_kw(p))
    got = op.paged_prefill(*_args(p), causal=causal, return_lse=lse, **_kw(p))
    configs = [c.kernel_id for c in blackwell["compiled"]]
    # the self-check compiles the same variant, then the call launches it: one kernel id only
    assert set(configs) == {"sm100.prefill"}
    config = blackwell["compiled"][-1]
    assert isinstance(config, Sm100PrefillConfig) and blackwell["target"] in config.targets
    assert config.causal == causal and config.write_lse == lse and config.kv_layout == layout
    assert config.kv_form == ("pair" if container == "tuple" else "single")
    for g, w in zip(got if lse else (got,), want if lse else (want,)):
        assert torch.equal(g, w)
    fam = f"sm100.prefill/{'f8' if qd == FP8 else 'f16'}"
    rec = records.lookup(fam)
    assert rec is not None and rec.ok
    n = len(blackwell["compiled"])
    op.paged_prefill(*_args(p), causal=causal, return_lse=lse, **_kw(p))  # cached: no check, no compile
    assert len(blackwell["compiled"]) == n


def test_fp8_query_forms(blackwell):
    """A float q_scale and a 1-element tensor pick the two q_scale variants; ``out`` fp16 the fp16
    output variant; a per-KV-head q_scale (no variant) runs the reference without a compile."""
    p = _fp8_problem(("fp8", blackwell["target"]))
    op.paged_prefill(*_args(p), **_kw(p))
    assert not blackwell["compiled"][-1].q_scale_tensor and blackwell["compiled"][-1].out_dtype == "bf16"
    out16 = torch.full(p["q"].shape, float("nan"), dtype=FP16)
    op.paged_prefill(*_args(p), **_kw(p, q_scale=torch.tensor([p["q_scale"]])), out=out16)
    cfg = blackwell["compiled"][-1]
    assert cfg.q_scale_tensor and cfg.out_dtype == "fp16"
    assert torch.equal(out16, reference.paged_prefill(*_args(p), **_kw(p), out_dtype=FP16))
    ph = _fp8_problem(("fp8 per head", blackwell["target"]), per_head_q_scale=True)
    n = len(blackwell["compiled"])
    assert torch.equal(op.paged_prefill(*_args(ph), **_kw(ph)), reference.paged_prefill(*_args(ph), **_kw(ph)))
    assert len(blackwell["compiled"]) == n


def test_window_and_sinks_run_in_the_kernel(blackwell):
    p = _problem(("features", blackwell["target"]))
    sinks = torch.randn(p["q"].shape[1], generator=torch.Generator().manual_seed(7))
    want = reference.paged_prefill(*_args(p), **_kw(p), window_left=9, sinks=sinks)
    got = op.paged_prefill(*_args(p), **_kw(p), window_left=9, sinks=sinks)
    assert blackwell["compiled"][-1].kernel_id == "sm100.prefill" and blackwell["compiled"][-1].sinks
    assert torch.equal(got, want)


def test_a_16bit_query_on_an_fp8_cache_runs_the_portable_kernel(blackwell):
    """QK in FP8 needs the caller's q_scale (the layer quantizes): the op itself widens exactly in
    the portable kernel; with a window (which that kernel lacks) the reference serves it."""
    p = _problem(("widen", blackwell["target"]), kv_dtype=FP8)
    op.paged_prefill(*_args(p), **_kw(p))
    assert [c.kernel_id for c in blackwell["compiled"]] == ["sm80.prefill"]
    assert blackwell["compiled"][0].target == blackwell["target"]
    want = reference.paged_prefill(*_args(p), **_kw(p), window_left=4)
    assert torch.equal(op.paged_prefill(*_args(p), **_kw(p), window_left=4), want)
    assert len(blackwell["compiled"]) == 1


def test_tuning_overrides(blackwell):
    p = _problem(("tuning", blackwell["target"]))
    with op.tuning_override(backend="sm80"):
        op.paged_prefill(*_args(p), **_kw(p))
    assert [c.kernel_id for c in blackwell["compiled"]] == ["sm80.prefill"]
    with op.tuning_override(tile_n=64), pytest.raises(ValueError, match="sm100.prefill has no tuning fields"):
        op.paged_prefill(*_args(p), **_kw(p))


# ----------------------------------------------------------------------------------------------
# the self-check and its fallback
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage,why", [
    (lambda out: out.mul_(1.5), "beyond tolerance"),
    (lambda out: out.view(-1)[3::97].fill_(float("nan")), "NaN"),
])
def test_a_failing_family_falls_back_and_says_so(blackwell, damage, why, caplog):
    blackwell["damage"] = damage
    p = _problem(("broken", blackwell["target"]))
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        op.paged_prefill(*_args(p), **_kw(p))
    assert [c.kernel_id for c in blackwell["compiled"]] == ["sm100.prefill", "sm80.prefill"]
    rec = records.lookup("sm100.prefill/f16")
    assert rec is not None and not rec.ok and why in rec.reason
    assert any("sm100.prefill/f16 failed its self-check" in r.getMessage() for r in caplog.records)
    # an FP8 query of the same broken kernel: its own family fails; no other kernel takes it
    f = _fp8_problem(("broken fp8", blackwell["target"]))
    assert torch.equal(op.paged_prefill(*_args(f), **_kw(f)), reference.paged_prefill(*_args(f), **_kw(f)))
    assert not records.lookup("sm100.prefill/f8").ok
    # windows and sinks of the failed 16-bit family: the reference
    n = len(blackwell["compiled"])
    want = reference.paged_prefill(*_args(p), **_kw(p), window_left=3)
    assert torch.equal(op.paged_prefill(*_args(p), **_kw(p), window_left=3), want)
    assert len(blackwell["compiled"]) == n


def test_dispatch_plan_reads_the_record(blackwell):
    from dispatch import plan as dispatch_plan

    shape = dict(arch=blackwell["target"], phase="prefill", kv_cache_dtype="bf16", model_dtype="bf16", head_dim=64,
                 num_q_heads=4, num_kv_heads=2, page_size=16)
    assert dispatch_plan(**shape).kernel == "sm100.prefill"
    blackwell["damage"] = lambda out: out.mul_(2)
    p = _problem(("plan", blackwell["target"]))
    op.paged_prefill(*_args(p), **_kw(p))
    after = dispatch_plan(**shape)
    assert after.kernel == "sm80.prefill" and "sm100.prefill/f16 failed its runtime self-check" in after.reason


@pytest.mark.parametrize("config", prefill_variants(), ids=[c.label() for c in prefill_variants()])
def test_problems_fit_every_variant_and_pass_with_the_reference(blackwell, config):
    cases = sm100.self_check_cases(config, "cpu")
    assert [c.name.split(" (")[0] for c in cases] == ["varlen", "window", "past the table"]
    for case in cases:
        got, want = case.run(), case.expect()
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        assert len(got) == len(want) == (2 if config.write_lse else 1)
        assert got[0].dtype == {"bf16": BF16, "fp16": FP16}[config.out_dtype]
        assert not torch.isnan(want[0]).any()
        if case.name.startswith("past the table") and config.write_lse:  # every row sees the table's keys
            assert torch.isfinite(want[1]).all()
        assert _selfcheck.compare(got, want, 0, 0) == ""
    assert sm100.self_check_passes(config, "cpu")


def _ignores_the_capacity(config, t, max_query_len):
    """A kernel that attends past the block table (as the SM100 kernels did before the rule): the
    table is widened with valid pages, so positions past the capacity are read."""
    bt = t["block_table"]
    wide = torch.cat([bt, bt.flip(0), bt], dim=1)
    out, *lse = reference.paged_prefill(
        t["q"], (t["k"], t["v"]) if config.kv_form == "pair" else t["k"], wide, t["seq_lens"], t["query_start_loc"],
        max_query_len=max_query_len, kv_layout=config.kv_layout, causal=config.causal, q_scale=t["q_scale"],
        k_scale=t["k_scale"], v_scale=t["v_scale"], return_lse=True, out_dtype=out_dtype(config),
        window_left=t["window_left"], sinks=t["sinks"])
    return (out, lse[0]) if config.write_lse else out


def out_dtype(config):
    return {"bf16": BF16, "fp16": FP16}[config.out_dtype]


@pytest.mark.parametrize("config", prefill_variants()[:2], ids=lambda c: c.label())
def test_the_check_catches_a_kernel_that_reads_past_the_table(config):
    rec = _selfcheck.run_check("test.sm100.prefill/capacity", "cpu",
                               sm100.self_check_cases(config, "cpu", runner=_ignores_the_capacity))
    assert not rec.ok and rec.reason.startswith("case past the table")


def test_decode_check_has_a_past_the_table_case_that_catches_the_old_rule():
    config = Sm100DecodeConfig(q_dtype="bf16", kv_dtype="bf16", head_dim=64, group=4, page_size=16, sinks=True)

    def good(q, cache, bt, sl, **kw):
        kw.pop("num_splits")
        return reference.paged_decode(q, cache, bt, sl, **kw)

    def wide_table(q, cache, bt, sl, **kw):
        kw.pop("num_splits")
        return reference.paged_decode(q, cache, torch.cat([bt, bt.flip(0)], dim=1), sl, **kw)

    cases = decode_sm100.self_check_cases(config, "cpu", runner=good)
    assert [c.name for c in cases][-1] == "splits=2,window=-1,past the table"
    assert _selfcheck.run_check("test.sm100.decode/good", "cpu", cases).ok
    rec = _selfcheck.run_check("test.sm100.decode/wide", "cpu",
                               decode_sm100.self_check_cases(config, "cpu", runner=wide_table))
    assert not rec.ok and "past the table" in rec.reason


# ----------------------------------------------------------------------------------------------
# the contract the SM100 kernels follow: kv_cap with windows and sinks, against float64 loops
# ----------------------------------------------------------------------------------------------


def _loop(q, k, v, visible, sm_scale, sink):
    """One row of attention in float64 over the keys ``visible`` says, with an optional sink logit."""
    logits = [float(q @ k[t]) * sm_scale for t in visible]
    extra = [sink] if sink is not None else []
    if not logits:
        return torch.zeros(v.shape[1], dtype=torch.float64)
    m = max(logits + extra)
    w = [math.exp(x - m) for x in logits]
    den = sum(w) + sum(math.exp(s - m) for s in extra)
    return sum(wi * v[t] for wi, t in zip(w, visible)) / den


@pytest.mark.parametrize("seed", range(4))
def test_reference_prefill_kv_cap_with_window_and_sinks(seed):
    g = torch.Generator().manual_seed(seed)
    print("seed", seed)
    page, D, Hq, Hkv, W = 16, 32, 2, 1, 3
    P = 8
    kv = torch.randn(P, 2, Hkv, page, D, generator=g, dtype=torch.float64).to(BF16)
    table = torch.randperm(P, generator=g)[:2 * W].view(2, W).to(torch.int32)
    q_lens = [5, 3]
    seq_lens = torch.tensor([W * page + 7, 2 ** 31 - 1 if seed % 2 else W * page + 2], dtype=torch.int32)
    q = torch.randn(sum(q_lens), Hq, D, generator=g).to(BF16)
    qsl = torch.tensor([0, 5, 8], dtype=torch.int32)
    sinks = torch.randn(Hq, generator=g)
    window = int(torch.randint(3, 2 * W * page, (1,), generator=g))
    got = reference.paged_prefill(q, kv, table, seq_lens, qsl, window_left=window, sinks=sinks, causal=True)
    cap = W * page
    for b in range(2):
        keys = torch.cat([kv[int(table[b, i]), 0, 0] for i in range(W)]).double()
        vals = torch.cat([kv[int(table[b, i]), 1, 0] for i in range(W)]).double()
        for j in range(q_lens[b]):
            pos = int(seq_lens[b]) - q_lens[b] + j
            visible = [t for t in range(cap) if t <= pos and t >= pos - window]
            for h in range(Hq):
                want = _loop(q[qsl[b] + j, h].double(), keys, vals, visible, D ** -0.5, float(sinks[h]))
                assert torch.allclose(got[qsl[b] + j, h].double(), want, atol=1e-2, rtol=1e-2), (seed, b, j, h)


# ----------------------------------------------------------------------------------------------
# the layer's warm-up lists the variant the op builds for the layer's prefill call
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache,q_scale", [(BF16, None), (FP8, 0.5), (FP8, torch.tensor([0.5])),
                                           (FP8, torch.tensor([0.5, 0.25]))])
def test_layer_warmup_lists_the_ops_variant(blackwell, cache, q_scale):
    from dispatch import AttentionLayer
    from dispatch.warmup import layer_variants

    arch = blackwell["target"].replace("_", "").rstrip("a")
    layer = AttentionLayer(4, 2, 64, kv_cache_dtype=cache, page_size=16, arch=arch, q_scale=q_scale)
    listed = [c for c in layer_variants(layer, 4, 256) if c.kernel_id == "sm100.prefill"]
    p = _problem(("layer", str(cache), blackwell["target"]), kv_dtype=cache, q_dtype=cache)
    kw = _kw(p, q_scale=q_scale) if cache == FP8 else _kw(p)
    out = torch.empty(p["q"].shape, dtype=BF16)
    op.paged_prefill(*_args(p), **kw, out=out)  # as AttentionLayer calls it: causal, out=, no LSE
    built = [c for c in blackwell["compiled"] if c.kernel_id == "sm100.prefill"]
    if isinstance(q_scale, torch.Tensor) and q_scale.numel() > 1:  # per KV head: the reference, nothing listed
        assert listed == [] and built == []
    else:
        assert len(listed) == 1 and set(built) == set(listed)
