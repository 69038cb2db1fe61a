"""CPU tests of the SM90 decode's window / sink variants on the host side: their configs,
signatures and self-check families (plans/sm90_decode.py), the registry entry that marks them
available (verified by the GPU suite on the H200: the op runs them without a check), the split
planning of a window, and the runtime self-check that guards them while the registry lists them
compile-verified (ops/_decode_features.py; ``sm90_compile_verified`` lists them so again) run with
fake kernels: a correct one passes, broken ones fail and leave the reference serving, with a
warning. The kernels themselves: the compile matrix (CPU) and tests/gpu/test_trtllm_gpu.py (H200)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import cute_kernels
from cute_kernels import registry
from cute_kernels.jit.spec import ScalarArg, TensorArg
from cute_kernels.ops import _decode_features as features
from cute_kernels.ops import _selfcheck as sc
from cute_kernels.ops.paged_decode import _launcher
from cute_kernels.plans import selfcheck_records as records
from cute_kernels.plans.sm90_decode import (
    Sm90DecodeConfig,
    check_registry_id,
    compile_variants,
    feature_family,
    feature_variants,
    make_decode_config,
    window_context,
)

BASE = dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1, page_size=16)


def test_families_name_the_features_and_the_mma_path():
    assert feature_family(make_decode_config(**BASE, split=False)) is None
    assert feature_family(make_decode_config(**BASE, split=True, window=True, sinks=True)) == \
        "sm90.decode/window+sinks/fp8-cvt"
    assert feature_family(make_decode_config(**BASE, split=False, sinks=True, widen="bits")) == \
        "sm90.decode/sinks/fp8-bits"
    assert feature_family(make_decode_config(**{**BASE, "kv_dtype": "bf16"}, split=False, window=True)) == \
        "sm90.decode/window/16bit"


def test_feature_signature_adds_sinks_and_window_left_only_where_asked():
    plain = make_decode_config(**BASE, split=True)
    both = make_decode_config(**BASE, split=True, window=True, sinks=True)
    assert "sinks" not in plain.arg_names() and "window_left" not in plain.arg_names()
    assert both.arg_names() == (*plain.arg_names(), "sinks", "window_left")
    sig = {a.name: a for a in both.signature()}
    assert sig["sinks"] == TensorArg("sinks", "fp32", ("Hq",), align=4)  # Hq: tied to q's heads by TVM-FFI
    assert sig["window_left"] == ScalarArg("window_left", "int32")


def test_bound_caller_passes_sinks_and_window_left_in_signature_order():
    from cute_kernels.ops._launch import bind
    from cute_kernels.ops.paged_decode import _CALL_PARAMS

    cfg = make_decode_config(**BASE, split=True, window=True, sinks=True)
    seen = []
    caller = bind(_CALL_PARAMS, (lambda *a: seen.append(a), cfg.signature(), {"kv_cache": "k"},
                                 dict(part_out="PO", part_lse="PL", counters="C", sm_scale=0.5)))
    caller("Q", "K", "V", "BT", "SL", "O", "L", 1.5, 2.5, "SI", 77)
    assert seen == [("Q", "K", "BT", "SL", "O", "L", "PO", "PL", "C", 1.5, 2.5, 0.5, "SI", 77)]


def test_window_variants_keep_the_static_split_schedule():
    with pytest.raises(ValueError, match="static split schedule"):
        Sm90DecodeConfig(**BASE, split=True, dynamic=True, window=True)
    cfg = make_decode_config(**BASE, split=True, window=True, dynamic=True)  # a request for dynamic: dropped
    assert cfg.window and not cfg.dynamic and cfg.strided
    assert make_decode_config(**BASE, split=True, sinks=True, dynamic=True).dynamic  # sinks alone may


def test_window_bounds_the_planned_context():
    assert window_context(32768, -1, 1) == 32768
    assert window_context(32768, 4095, 1) == 4095 + 1 + 128
    assert window_context(1024, 4095, 1) == 1024
    assert window_context(32768, 0, 4) == 4 + 128


def test_registry_marks_the_feature_variants_available():
    info = registry.KERNELS["sm90.decode_window_sinks"]
    assert info.status == "available" and info.call_site is None and info.op == "paged_decode"
    assert info.archs == ("sm90",) and info.phases == ("decode",)
    variants = info.variants()
    assert variants == feature_variants()
    assert all(v.kernel_id == "sm90.decode" and (v.window or v.sinks) for v in variants)
    assert not any(v.window or v.sinks for v in compile_variants())  # the available kernel's are unchanged
    families = {feature_family(v) for v in variants}
    # every MMA path and every feature combination is compiled
    assert {f.rsplit("/", 1)[1] for f in families} == {"fp8-cvt", "fp8-bits", "16bit"}
    assert {f.split("/")[1] for f in families} == {"window", "sinks", "window+sinks"}
    assert any(v.q_len > 1 and v.window for v in variants)  # the speculative draft
    assert any(v.cluster for v in variants) and any(v.split and not v.cluster for v in variants)
    assert {v.head_dim for v in variants} == {64, 128, 256}
    assert {(v.kv_form, v.kv_layout) for v in variants} >= {("single", "HND"), ("pair", "NHD")}
    assert all(v in registry.variants_for("sm_90a") for v in variants)
    assert all(check_registry_id(v) == info.id for v in variants)


def test_the_available_variants_run_no_check():
    cfg = make_decode_config(**BASE, split=True, window=True, sinks=True)
    assert features.self_check_passes(cfg, "cpu", lambda o, **kw: 1 / 0)  # a check would fail: none runs
    assert records.lookup(feature_family(cfg)) is None


# ---------------------------------------------------------------------------------------------
# the runtime self-check with fake kernels (CPU tensors: the op's reference stands in for a kernel)
# ---------------------------------------------------------------------------------------------


def _good(override, **kw):
    return cute_kernels.paged_decode(**kw)


@pytest.mark.parametrize("cfg", [
    make_decode_config(**BASE, split=True, window=True, sinks=True),
    make_decode_config(**{**BASE, "kv_dtype": "bf16", "q_len": 4, "group": 4}, split=False, window=True,
                       kv_form="pair", kv_layout="NHD"),
    make_decode_config(**{**BASE, "q_dtype": "fp16", "kv_dtype": "fp16", "head_dim": 64}, split=True, sinks=True,
                       k_scale_tensor=True, v_scale_tensor=True),
], ids=feature_family)
def test_cases_follow_the_variant_and_pass_a_correct_kernel(sm90_compile_verified, cfg):
    seen = []

    def runner(override, **kw):
        seen.append((dict(override), kw["window_left"], kw["num_splits"], kw["sinks"] is not None))
        assert kw["q"].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.q_dtype]
        assert kw["q"].shape[1:] == (cfg.group * 2, cfg.head_dim) and kw["q_len_per_req"] == cfg.q_len
        assert isinstance(kw["kv_cache"], tuple) == (cfg.kv_form == "pair")
        assert isinstance(kw["k_scale"], torch.Tensor) == cfg.k_scale_tensor
        return _good(override, **kw)

    assert features.self_check_passes(cfg, "cpu", runner)
    windows = [w for _, w, _, _ in seen]
    assert windows == ([90, 90, 5] if cfg.window else [-1, -1, -1])
    assert [s for _, _, s, _ in seen] == [1, 3, 3]
    assert all(has == cfg.sinks for *_, has in seen)
    clusters = [o.get("cluster") for o, *_ in seen]
    assert clusters == [None, True, False]  # the cluster merge, then the global one
    if cfg.kv_dtype == "fp8_e4m3":
        assert all(o["widen"] == cfg.widen for o, *_ in seen)
    rec = records.lookup(feature_family(cfg), "cpu")
    assert rec is not None and rec.ok


@pytest.mark.parametrize("broken, expect", [
    (lambda o, **kw: _good(o, **{**kw, "sinks": None}), "beyond tolerance"),  # a kernel that drops the sink
    (lambda o, **kw: _good(o, **{**kw, "window_left": -1}), "beyond tolerance"),  # ... that ignores the window
    (lambda o, **kw: tuple(x * float("nan") for x in _good(o, **kw)), "NaN"),
    (lambda o, **kw: 1 / 0, "ZeroDivisionError"),
])
def test_a_broken_kernel_fails_its_family_and_the_reference_serves(sm90_compile_verified, broken, expect, caplog):
    cfg = make_decode_config(**BASE, split=True, window=True, sinks=True)
    fam = feature_family(cfg)
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        assert not features.self_check_passes(cfg, "cpu", broken)
    assert any(f"{fam} failed its self-check" in r.getMessage() for r in caplog.records)
    rec = records.lookup(fam, "cpu")
    assert not rec.ok and expect in rec.reason
    calls = []
    assert not features.self_check_passes(cfg, "cpu", lambda o, **kw: calls.append(1))  # recorded: no rerun
    assert calls == []


def test_the_checks_own_calls_pass_the_guard_and_leave_no_launch_cached(sm90_compile_verified):
    cfg = make_decode_config(**BASE, split=True, window=True)
    before = set(_launcher.entries)

    def runner(override, **kw):
        with features.unguarded(_launcher):
            # inside the check the guard lets the op through (no recursion into the same family)
            assert features.self_check_passes(cfg, "cpu", lambda *a, **k: 1 / 0)
            _launcher.entries[("fake-key", len(_launcher.entries))] = object()
            return _good(override, **kw)

    assert features.self_check_passes(cfg, "cpu", runner)
    assert set(_launcher.entries) == before  # the fake entries and the op's own are gone
    assert not features._checking


def test_case_failure_messages_name_the_case():
    cfg = make_decode_config(**{**BASE, "kv_dtype": "bf16"}, split=True, window=True)
    cases = features.self_check_cases(cfg, "cpu", lambda o, **kw: _good(o, **{**kw, "window_left": 5}))
    assert [c.name for c in cases] == ["splits=1,single,window=90", "splits=3,cluster,window=90",
                                       "splits=3,global,window=5"]
    rec = sc.run_check("test.family", "cpu", cases)
    assert not rec.ok and rec.reason.startswith("case splits=1,single,window=90")


def test_config_fields_are_the_compile_key():
    a = make_decode_config(**BASE, split=False, window=True)
    b = dataclasses.replace(a, sinks=True)
    assert a != b and a.label() != b.label() and a.label().endswith("window=True,sinks=False]")
