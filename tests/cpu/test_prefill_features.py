"""The prefill's window / sink variants on the host, on the CPU with the device and the compiled
function stubbed (``test_prefill_selfcheck``'s ``fake_gpu``: the reference with the variant's
inputs, or without one of them): their configs and signatures, the op picking them for
``window_left`` / ``sinks``, and the refusals. They are available (verified by the GPU suite on
the H200), so the op launches them without a check; their self-check families stay, and with the
registry listing them compile-verified again (``sm90_compile_verified``): problems that fit every
registered variant (a 75-key window and sinks) that a stub computing the reference passes, the op
checking their own family first, a stub that drops the sink or the window failing it (the
reference serves, with a warning). The kernels: the compile matrix and tests/gpu/test_trtllm_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch

from cute_kernels import reference
from cute_kernels.jit.spec import ScalarArg, TensorArg
from cute_kernels.ops import paged_prefill as op
from cute_kernels.plans import selfcheck_records as records
from cute_kernels.plans import sm90_prefill as plan
from cute_kernels.registry import KERNELS

from . import test_prefill_selfcheck as _stubs
from .test_prefill_host import _args, _kw, _problem

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
FEATURES = KERNELS[plan.FEATURES_ID].variants()
fake_gpu = _stubs.fake_gpu  # the fixture: CPU tensors on the CUDA path, the reference as the compiled kernel


def test_configs_signatures_and_families():
    cfg = plan.make_prefill_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16,
                                   window=True, sinks=True)
    plain = plan.make_prefill_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16)
    assert cfg.arg_names() == (*plain.arg_names(), "sinks", "window_left")
    sig = {a.name: a for a in cfg.signature()}
    assert sig["sinks"] == TensorArg("sinks", "fp32", ("Hq",), align=4)
    assert sig["window_left"] == ScalarArg("window_left", "int32")
    assert plan.config_family(plain) == "sm90.prefill/widen/d128"
    assert plan.config_family(cfg) == "sm90.prefill/widen/d128/window+sinks"
    assert plan.check_registry_id(cfg) == plan.FEATURES_ID and plan.check_registry_id(plain) == "sm90.prefill"
    info = KERNELS[plan.FEATURES_ID]
    assert info.status == "available" and info.call_site is None and info.op == "paged_prefill"
    assert all(v.window or v.sinks for v in FEATURES)
    assert {v.kind for v in FEATURES} == {"16", "widen", "fp8"} and {v.causal for v in FEATURES} == {True, False}
    assert not any(v.window or v.sinks for kid in ("sm90.prefill", "sm90.prefill_fp8q") for v in KERNELS[kid].variants())


@pytest.mark.parametrize("config", FEATURES, ids=[plan.config_family(c) for c in FEATURES])
def test_problems_fit_every_feature_variant_and_pass_with_the_reference(fake_gpu, sm90_compile_verified, config):
    cases = op.self_check_cases(config, "cpu")
    for case in cases:
        got, want = case.run(), case.expect()
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        assert len(got) == len(want) and not torch.isnan(want[0]).any()
    assert op.self_check_passes(config, "cpu")
    assert records.lookup(plan.config_family(config), "cpu").ok


def test_the_available_feature_variant_runs_without_a_check(fake_gpu):
    p = _problem("feat", kv_dtype=FP8, reqs=((0, 70), (200, 9), (0, 0), (130, 1)))
    sinks = torch.randn(4)
    want = reference.paged_prefill(*_args(p), **_kw(p), window_left=40, sinks=sinks)
    got = op.paged_prefill(*_args(p), **_kw(p), window_left=40, sinks=sinks)
    assert torch.equal(got, want)
    [config] = fake_gpu["compiled"]  # the launch alone
    assert config.window and config.sinks
    assert records.lookup("sm90.prefill/widen/d64/window+sinks") is None


def test_the_op_picks_the_feature_variant_with_its_own_check(fake_gpu, sm90_compile_verified):
    p = _problem("feat", kv_dtype=FP8, reqs=((0, 70), (200, 9), (0, 0), (130, 1)))
    sinks = torch.randn(4)
    want = reference.paged_prefill(*_args(p), **_kw(p), window_left=40, sinks=sinks)
    got = op.paged_prefill(*_args(p), **_kw(p), window_left=40, sinks=sinks)
    assert torch.equal(got, want)
    configs = fake_gpu["compiled"]
    assert configs[-1].window and configs[-1].sinks  # the launch; the check's problems before it
    assert records.lookup("sm90.prefill/widen/d64/window+sinks").ok
    assert records.lookup("sm90.prefill/widen/d64") is None  # the default family was not needed
    n = len(configs)
    plain = op.paged_prefill(*_args(p), **_kw(p))  # no window, no sinks: the default variant, its own check
    assert torch.equal(plain, reference.paged_prefill(*_args(p), **_kw(p)))
    assert not fake_gpu["compiled"][-1].window and len(fake_gpu["compiled"]) > n + 1
    # a window value the key leaves open is read per call
    again = op.paged_prefill(*_args(p), **_kw(p), window_left=7, sinks=sinks)
    assert torch.equal(again, reference.paged_prefill(*_args(p), **_kw(p), window_left=7, sinks=sinks))


@pytest.mark.parametrize("drop", ["sinks", "window"])
def test_a_kernel_that_drops_a_feature_fails_and_the_reference_serves(fake_gpu, sm90_compile_verified, drop, caplog):
    fake_gpu["drop"] = drop
    p = _problem("drop", reqs=((0, 90), (150, 20)))
    sinks = torch.randn(4) * 3
    want = reference.paged_prefill(*_args(p), **_kw(p), window_left=30, sinks=sinks)
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        got = op.paged_prefill(*_args(p), **_kw(p), window_left=30, sinks=sinks)
    assert torch.equal(got, want)
    fam = "sm90.prefill/16/d64/window+sinks"
    assert any(f"{fam} failed its self-check" in r.getMessage() for r in caplog.records)
    assert not records.lookup(fam).ok


@pytest.mark.parametrize("kw, err, match", [
    (dict(window_left=-2), ValueError, "window_left"),
    (dict(window_left=True), ValueError, "window_left"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.float16)), TypeError, "sinks"),
])
def test_bad_window_and_sinks_name_the_argument(kw, err, match):
    p = _problem("bad")
    with pytest.raises(err, match=match):
        op.paged_prefill(*_args(p), **_kw(p), **kw)
