"""``dispatch.plan_qsa`` on every arch: SM90 gets ``sm90.qsa`` when its limits accept the layer,
everything else the labelled reference fallback, with a reason; QSA stays out of ``plan()``'s
paged prefill/decode lists."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from dispatch import (
    KERNELS,
    SUPPORTED_ARCHS,
    UnsupportedConfig,
    capability_table,
    plan_qsa,
    qsa_capability_table,
)
from dispatch.kernels import QSA_FALLBACK, QSA_KERNELS

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
        assert "sm90.qsa accepts" in p.reason


@pytest.mark.parametrize("change,needle", [
    (dict(head_dim=96), "head_dim 64/128/256, got 96"),
    (dict(num_q_heads=64, num_kv_heads=2), r"GQA ratio .* up to 16, got 32"),
    (dict(kv="fp16", model="bf16"), "equal to model_dtype bf16, got fp16"),
])
def test_sm90_falls_back_with_the_reason(change, needle):
    p = _plan(**change)
    assert p.kernel == QSA_FALLBACK
    assert re.search(needle, p.reason), p.reason


def test_planned_kernel_falls_back(monkeypatch):
    monkeypatch.setitem(QSA_KERNELS, "sm90.qsa", dataclasses.replace(QSA_KERNELS["sm90.qsa"], status="planned",
                                                                     planned_in="issue 4"))
    p = _plan()
    assert p.kernel == QSA_FALLBACK and "sm90.qsa is planned (issue 4)" in p.reason


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
    for row in capability_table():  # plan()'s per-phase lists never name a QSA kernel
        assert not any(k["id"] in QSA_KERNELS for k in row["kernels"] + row["opt_in"])
    assert not set(QSA_KERNELS) & set(KERNELS)
    assert QSA_KERNELS[QSA_FALLBACK].status == "fallback"
    assert QSA_KERNELS["sm90.qsa"].archs == ("sm90",)


def test_plan_serialises():
    d = _plan().to_dict()
    assert d["kernel"] == "sm90.qsa" and d["is_fallback"] is False and d["num_q_heads"] == 24
