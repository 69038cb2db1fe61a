"""Dispatch planning on the CPU: the arch matrix and the vLLM dispatch bugs it must rule out.

The matrix is small on purpose (8 archs x 2 phases x 3 cache dtypes x 2 model dtypes = 96 plans,
all pure Python): it is every cell the CLI prints, and every cell must have a plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cute_kernels.plans import sm80, sm90_decode, sm90_prefill
from cute_kernels.registry import kernels_on
from dispatch import (
    KERNELS,
    SUPPORTED_ARCHS,
    Arch,
    Plan,
    UnsupportedConfig,
    capability_table,
    parse_arch,
    plan,
)
from dispatch.capabilities import kernels_for

PHASES = ("prefill", "decode")
KV_DTYPES = ("bf16", "fp16", "fp8")
MODEL_DTYPES = ("bf16", "fp16")
NO_FP8_QUERY_ARCHS = ("sm80", "sm86", "sm89", "sm120", "sm121")

# A shape every planned real kernel accepts (head_dim 128, GQA 4, page 16, HND).
SHAPE = dict(head_dim=128, num_q_heads=32, num_kv_heads=8, page_size=16)


def _plan(arch="sm90", phase="decode", kv="fp8", model="bf16", **kw) -> Plan:
    return plan(arch=arch, phase=phase, kv_cache_dtype=kv, model_dtype=model, **{**SHAPE, **kw})


def _raises(match: str, **kw):
    with pytest.raises(UnsupportedConfig, match=match):
        _plan(**kw)


def _set_status(monkeypatch, status, *kernel_ids):
    """Set registry entries' status for one test, so tests hold before and after a kernel lands."""
    for kid in kernel_ids:
        monkeypatch.setitem(KERNELS, kid, dataclasses.replace(KERNELS[kid], status=status))


def _make_available(monkeypatch, *kernel_ids):
    _set_status(monkeypatch, "available", *kernel_ids)


REAL_KERNELS = ("sm90.decode", "sm90.decode_fp8q", "sm90.prefill", "sm90.prefill_fp8q", "sm100.decode",
                "sm100.prefill", "sm80.decode", "sm80.prefill")


@pytest.fixture
def sm90_decode_available(monkeypatch):
    """The registry with ``sm90.decode`` built."""
    _make_available(monkeypatch, "sm90.decode")


@pytest.fixture
def all_planned(monkeypatch):
    """Every real kernel planned, as before any lands (for the "not built yet" paths)."""
    _set_status(monkeypatch, "planned", *REAL_KERNELS)


def _check_invariants(p: Plan, model: str):
    k = KERNELS[p.kernel]  # every plan names a registered kernel
    if p.kernel.startswith("reference."):
        assert k.status == "fallback"
        assert "fallback" in p.reason and "reference" in p.reason
    else:
        assert k.status in ("available", "compile-verified"), p
        if k.status == "compile-verified":  # the reason says so, and what the self-check found
            assert "compile-verified only" in p.reason and "self-check" in p.reason
        else:  # verified on the GPU: the reason does not call it compile-verified
            assert "compile-verified" not in p.reason, p
    if p.quantize_query:
        assert p.q_dtype == "fp8_e4m3" and p.applies_q_scale
    if p.q_dtype != "fp8_e4m3":
        assert p.q_dtype == model and not p.applies_q_scale and not p.quantize_query
    assert p.reason.endswith(".") and p.reason.count("\n") == 0


# ----------------------------------------------------------------------------------------------
# the arch matrix
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("registry", ["as_registered", "none_built", "sm90_decode_built", "all_built"])
def test_arch_matrix(registry, monkeypatch):
    if registry == "none_built":
        _set_status(monkeypatch, "planned", *REAL_KERNELS)
    elif registry == "sm90_decode_built":
        _make_available(monkeypatch, "sm90.decode")
    elif registry == "all_built":
        _make_available(monkeypatch, *REAL_KERNELS)
    sm90_built = KERNELS["sm90.decode"].status == "available"
    cells = 0
    kernel_cells = 0
    for arch, phase, kv, model in itertools.product(SUPPORTED_ARCHS, PHASES, KV_DTYPES, MODEL_DTYPES):
        p = _plan(arch, phase, kv, model)
        _check_invariants(p, model)
        assert (p.arch, p.phase, p.model_dtype) == (arch, phase, model)
        if arch in NO_FP8_QUERY_ARCHS or kv != "fp8":
            assert p.q_dtype == model, p  # no FP8 tensor-core attention kernel, or a 16-bit cache
        # the portable kernels serve every cache but a bf16 one under an fp16 model
        portable = KERNELS[f"sm80.{phase}"].status == "available" and (kv, model) != ("bf16", "fp16")
        fallback = f"reference.paged_{phase}"
        if arch == "sm90" and phase == "decode":
            assert p.q_dtype == model and not p.applies_q_scale  # FP8 KV is converted on chip
            served = sm90_built and kv in ("fp8", model)  # a 16-bit cache must match the model
            assert p.kernel == ("sm90.decode" if served else "sm80.decode" if portable else fallback)
        if arch in NO_FP8_QUERY_ARCHS:
            assert p.kernel == (f"sm80.{phase}" if portable else fallback), p
        if arch == "sm90" and phase == "prefill":  # the SM90 kernels where they take it, else sm80.prefill
            own = KERNELS["sm90.prefill"].status in ("available", "compile-verified") and kv in ("fp8", model)
            assert p.kernel in (("sm90.prefill", "sm90.prefill_fp8q") if own else
                                (f"sm80.{phase}",) if portable else (fallback,)), p
        if registry == "as_registered" and arch in ("sm100", "sm103"):  # their own (compile-verified) where
            own = KERNELS[f"sm100.{phase}"].op is not None and kv in ("fp8", model)  # it has an op, else sm80
            assert p.kernel == (f"sm100.{phase}" if own else f"sm80.{phase}" if portable else fallback), p
        if registry == "all_built" and arch in ("sm100", "sm103") and kv == "fp8":
            assert p.kernel == f"sm100.{phase}" and p.q_dtype == "fp8_e4m3" and p.quantize_query
        cells += 1
        kernel_cells += not p.is_fallback
    assert cells == 96
    if registry == "as_registered":  # only an fp16 model with a bf16 cache has no exact kernel
        assert kernel_cells == 96 - len(SUPPORTED_ARCHS) * len(PHASES)


def test_every_arch_phase_list_ends_with_the_reference_fallback():
    rows = capability_table()
    assert {(r["arch"], r["phase"]) for r in rows} == set(itertools.product(SUPPORTED_ARCHS, PHASES))
    for r in rows:
        ids = [k["id"] for k in r["kernels"]]
        assert ids == list(kernels_for(r["arch"], r["phase"]))
        assert ids[-1] == f"reference.paged_{r['phase']}" and KERNELS[ids[-1]].status == "fallback"
        assert all(r["arch"] in KERNELS[i].archs and r["phase"] in KERNELS[i].phases for i in ids)
        assert "sm90.decode_fp8q" not in ids  # opt-in only
        assert r["summary"]
    sm90 = next(r for r in rows if (r["arch"], r["phase"]) == ("sm90", "decode"))
    assert [k["id"] for k in sm90["kernels"]] == ["sm90.decode", "sm80.decode", "reference.paged_decode"]
    assert [k["id"] for k in sm90["opt_in"]] == ["sm90.decode_fp8q"]
    for arch in NO_FP8_QUERY_ARCHS:
        for phase in PHASES:
            assert kernels_for(arch, phase) == (f"sm80.{phase}", f"reference.paged_{phase}")
    for arch in ("sm100", "sm103"):
        for phase in PHASES:
            assert kernels_for(arch, phase) == (f"sm100.{phase}", f"sm80.{phase}", f"reference.paged_{phase}")


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_matrix_names_a_kernel_in_every_cell(arch):
    """``cute-kernels matrix`` (bf16 model): every (arch, phase, KV dtype) cell is served by a
    kernel, none by the reference, and the reference stays reachable with backend="reference".
    A kernel not run on the arch's hardware says so in the reason."""
    for phase, kv in itertools.product(PHASES, KV_DTYPES):
        p = _plan(arch, phase, kv, "bf16")
        assert not p.is_fallback and KERNELS[p.kernel].status in ("available", "compile-verified"), p
        # only a kernel that computes QK in FP8 for an FP8 cache (sm100.*) gets an FP8 query
        assert p.q_dtype == ("fp8_e4m3" if KERNELS[p.kernel].computes_qk_in_fp8(p.kv_cache_dtype) else "bf16")
        if p.kernel.startswith("sm80."):
            assert (arch == "sm90") != p.reason.endswith(
                f"(verified as SM80 code on SM90 hardware, not on {arch}).")
        assert _plan(arch, phase, kv, "bf16", backend="reference").is_fallback


def test_registry_ids_and_statuses():
    assert set(kernels_on("attention")) == {"sm90.decode", "sm90.decode_fp8q", "sm90.prefill", "sm90.prefill_fp8q",
                                            "sm90.prefill_fp8x2",
                                            "sm100.decode", "sm100.prefill", "sm80.decode", "sm80.prefill",
                                            "reference.paged_decode", "reference.paged_prefill"}
    for kid in ("sm80.decode", "sm80.prefill"):
        k = KERNELS[kid]
        assert k.status == "available" and k.archs == SUPPORTED_ARCHS and k.qk_dtype == "model"
        assert not k.supports_quant_query_input and k.mixed_16bit == (("bf16", "fp16"),)
        assert k.verified == "SM80 code on SM90 hardware" and k.hardware_runs == ("sm90",)
        assert (k.head_dims, k.page_sizes, k.kv_layouts, k.kv_dtypes) == (
            sm80.HEAD_DIMS, sm80.PAGE_SIZES, sm80.KV_LAYOUTS, sm80.KV_DTYPES)
    # exactly what the decode kernel accepts: any GQA ratio x q_len up to its 64 rows per CTA
    assert (KERNELS["sm80.decode"].max_gqa_ratio, KERNELS["sm80.decode"].max_q_len) == (None, None)
    assert KERNELS["sm80.decode"].max_rows == sm80.MAX_DECODE_ROWS == 64
    assert KERNELS["sm80.prefill"].max_rows is None  # rows are tiled: any group, any length
    sm90 = KERNELS["sm90.decode"]
    assert sm90.status in ("planned", "available")
    assert sm90.qk_dtype == "model" and not sm90.supports_quant_query_input
    # exactly what the kernel accepts: its plan's limits (group x q_len is one CTA's WGMMA N)
    assert (sm90.head_dims, sm90.max_gqa_ratio, sm90.page_sizes, sm90.max_q_len, sm90.max_rows) == (
        sm90_decode.HEAD_DIMS, None, sm90_decode.PAGE_SIZES, None, sm90_decode.MAX_ROWS) == (
        (64, 128, 256), None, (16, 32, 64, 128), None, 64)
    assert KERNELS["sm90.decode_fp8q"].kv_dtypes == ("fp8_e4m3",)
    assert KERNELS["sm90.decode_fp8q"].qk_dtype == "fp8_e4m3"
    for kid in ("sm100.decode", "sm100.prefill"):
        k = KERNELS[kid]
        assert k.archs == ("sm100", "sm103") and k.supports_quant_query_input
        assert k.computes_qk_in_fp8("fp8_e4m3") and not k.computes_qk_in_fp8("bf16")
    for kid in ("reference.paged_decode", "reference.paged_prefill"):
        k = KERNELS[kid]
        assert k.status == "fallback" and k.archs == SUPPORTED_ARCHS and k.qk_dtype == "model"
        assert "reference" in k.description and "fallback" in k.description


def test_registry_entry_validation():
    with pytest.raises(ValueError, match="status"):
        dataclasses.replace(KERNELS["sm90.decode"], status="done")
    with pytest.raises(ValueError, match="pre-quantized"):
        dataclasses.replace(KERNELS["sm90.decode_fp8q"], supports_quant_query_input=False)
    with pytest.raises(ValueError, match="reference"):
        dataclasses.replace(KERNELS["sm90.decode"], status="fallback")


# ----------------------------------------------------------------------------------------------
# the vLLM bugs: query dtype per group, per arch, per kernel
# ----------------------------------------------------------------------------------------------


def test_sm90_decode_fp8_cache_keeps_a_bf16_query(sm90_decode_available):
    p = _plan("sm90", "decode", "fp8", "bf16")
    assert p.kernel == "sm90.decode"
    assert (p.q_dtype, p.quantize_query, p.applies_q_scale) == ("bf16", False, False)
    assert p.reason == "sm90.decode accepts this request."  # one sentence: the fields say the query


@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm103"])
def test_skip_layer_bf16_group_never_gets_fp8_query(arch, monkeypatch):
    # Make every real kernel "built", so a wrong FP8 decision could actually surface.
    _make_available(monkeypatch, "sm90.decode", "sm100.decode", "sm100.prefill")
    for phase in PHASES:
        fp8_group = _plan(arch, phase, "fp8")
        bf16_group = _plan(arch, phase, "auto")  # the skip layer, planned right after
        assert bf16_group.kv_cache_dtype == "bf16"
        assert bf16_group.q_dtype == "bf16" and not bf16_group.applies_q_scale
        if arch == "sm90":  # sm90.decode and sm90.prefill convert FP8 K/V on chip (the default choice)
            assert fp8_group.q_dtype == "bf16" and not fp8_group.applies_q_scale
        else:  # the tcgen05 kernels compute QK in FP8, but for an FP8 cache only
            assert fp8_group.kernel == bf16_group.kernel == f"sm100.{phase}"
            assert fp8_group.q_dtype == "fp8_e4m3" and fp8_group.quantize_query and fp8_group.applies_q_scale


def test_planning_is_stateless():
    """The same request plans the same way whatever was planned before (no global state)."""
    first = _plan("sm100", "decode", "bf16")
    for kv in KV_DTYPES:
        _plan("sm100", "decode", kv)
    assert _plan("sm100", "decode", "bf16") == first


def test_explicit_fp8q_backend_is_refused_while_planned_and_never_automatic(all_planned, monkeypatch):
    _make_available(monkeypatch, "sm90.decode")
    assert _plan("sm90", "decode", "fp8").kernel == "sm90.decode"
    _raises(r"sm90\.decode_fp8q is not built yet", backend="sm90.decode_fp8q")


def test_explicit_fp8q_backend_quantizes_query_once_built(all_planned, monkeypatch):
    kid = "sm90.decode_fp8q"
    _make_available(monkeypatch, kid)
    p = _plan("sm90", "decode", "fp8", backend=kid)
    assert (p.kernel, p.q_dtype, p.quantize_query, p.applies_q_scale) == (kid, "fp8_e4m3", True, True)
    assert p.backend == kid
    _raises(r"needs kv_cache_dtype fp8_e4m3 \(got bf16\)", kv="bf16", backend=kid)
    assert _plan("sm90", "decode", "fp8").kernel == "reference.paged_decode"  # never automatic (all planned)
    _make_available(monkeypatch, "sm90.decode")
    assert _plan("sm90", "decode", "fp8").kernel == "sm90.decode"  # the automatic choice is the BF16-QK one


# ----------------------------------------------------------------------------------------------
# automatic choice once sm90.decode is built
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv,model", [("bf16", "bf16"), ("fp16", "fp16"), ("fp8", "bf16"), ("fp8", "fp16")])
def test_sm90_decode_chosen_when_available(sm90_decode_available, kv, model):
    p = _plan("sm90", "decode", kv, model)
    assert p.kernel == "sm90.decode" and p.q_dtype == model and not p.applies_q_scale
    assert p.reason == "sm90.decode accepts this request."


@pytest.mark.parametrize("change,needle", [
    (dict(head_dim=96), r"head_dim 64/128/256 \(got 96\)"),
    (dict(page_size=8), r"page_size 16/32/64/128 \(got 8\)"),
    (dict(num_q_heads=64, num_kv_heads=2, q_len=4), r"GQA ratio x q_len up to 64 \(got 32 x 4\)"),
    (dict(q_len=17), r"GQA ratio x q_len up to 64 \(got 4 x 17\)"),
    (dict(kv="fp16", model="bf16"), r"an FP8 cache or one of the model dtype bf16 \(got fp16\)"),
])
def test_sm90_decode_falls_back_with_reason(sm90_decode_available, change, needle, monkeypatch):
    _set_status(monkeypatch, "planned", "sm80.decode")  # out of the way: the reference plans these
    p = _plan("sm90", "decode", **{"kv": "fp8", **change})
    assert p.kernel == "reference.paged_decode"
    assert "fallback" in p.reason
    assert re.search(needle, p.reason), p.reason


@pytest.mark.parametrize("shape", [dict(num_q_heads=64, num_kv_heads=2), dict(num_q_heads=64, num_kv_heads=8, q_len=8),
                                   dict(num_q_heads=64, num_kv_heads=1)])
def test_sm90_decode_serves_every_group_times_q_len_up_to_64(sm90_decode_available, shape):
    """GQA 32, q_len 8 x GQA 8 and GQA 64: the kernel takes any group x q_len <= 64, so none of
    them goes to the reference."""
    assert _plan("sm90", "decode", "fp8", **shape).kernel == "sm90.decode"


def test_sm90_prefill_refusals_go_to_the_portable_kernel():
    """What the SM90 prefill kernels refuse and sm80.prefill accepts (an fp16 cache with a bf16
    query, a GQA group beyond theirs) runs there; on SM90 hardware the reason has no caveat."""
    p = _plan("sm90", "prefill", "fp16", "bf16")
    assert p.kernel == "sm80.prefill" and p.q_dtype == "bf16" and not p.applies_q_scale
    assert p.reason.endswith("; sm80.prefill accepts this request.") and "sm90.prefill" in p.reason
    p = _plan("sm90", "prefill", "bf16", num_q_heads=256, num_kv_heads=1)
    assert p.kernel == "sm80.prefill" and "GQA ratio (num_q_heads / num_kv_heads) up to 128 (got 256)" in p.reason


def test_sm90_decode_refusals_go_to_the_portable_kernel(sm90_decode_available):
    """What sm90.decode refuses and sm80.decode accepts (an fp16 cache with a bf16 query) runs
    there, with both reasons; what both refuse falls back to the reference, naming both."""
    p = _plan("sm90", "decode", "fp16", "bf16")
    assert p.kernel == "sm80.decode" and p.q_dtype == "bf16"
    assert p.reason == ("sm90.decode needs an FP8 cache or one of the model dtype bf16 (got fp16); "
                        "sm80.decode accepts this request.")
    p = _plan("sm90", "decode", "fp8", head_dim=96)
    assert p.kernel == "reference.paged_decode"
    assert p.reason == "reference fallback: sm90.decode and sm80.decode need head_dim 64/128/256 (got 96)."


@pytest.mark.parametrize("shape", [dict(num_q_heads=64, num_kv_heads=1), dict(num_q_heads=64, num_kv_heads=4, q_len=4),
                                   dict(num_q_heads=16, num_kv_heads=1, q_len=4)])
def test_sm80_decode_serves_every_group_times_q_len_up_to_64(shape):
    """GQA 64, GQA 16 x q_len 4 and q_len 4 x GQA 16 on an arch without its own decode kernel: the
    portable kernel takes any group x q_len <= 64 (four 16-row warp rows)."""
    assert _plan("sm86", "decode", "fp8", **shape).kernel == "sm80.decode"
    p = _plan("sm86", "decode", "fp8", num_q_heads=128, num_kv_heads=1)
    assert p.kernel == "reference.paged_decode" and r"GQA ratio x q_len up to 64 (got 128 x 1)" in p.reason

def test_fallback_reason_names_the_planned_kernel(all_planned):
    p = _plan("sm90", "decode", "fp8")
    assert p.kernel == "reference.paged_decode"
    assert p.reason == "reference fallback: sm90.decode and sm80.decode are not built yet."


# ----------------------------------------------------------------------------------------------
# explicit backends
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,needle", [
    (dict(backend="flashinfer"), "not an attention kernel id"),
    (dict(arch="sm89", backend="sm90.decode"), "sm90.decode runs on sm90, not sm89"),
    (dict(arch="sm120", backend="sm100.decode"), "runs on sm100/sm103, not sm120"),
    (dict(phase="prefill", backend="sm90.decode"), "is a decode kernel, not prefill"),
    (dict(phase="prefill", backend="reference.paged_decode"), "is a decode kernel, not prefill"),
    (dict(backend="sm90.decode"), r"sm90\.decode is not built yet"),
])
def test_explicit_backend_refused(all_planned, kw, needle):
    _raises(needle, **kw)


@pytest.mark.parametrize("kw,needle", [
    (dict(head_dim=96), r"head_dim 64/128/256 \(got 96\)"),
    (dict(page_size=8), r"page_size 16/32/64/128 \(got 8\)"),
    (dict(num_q_heads=128, num_kv_heads=1), r"GQA ratio x q_len up to 64 \(got 128 x 1\)"),
    (dict(q_len=32), r"GQA ratio x q_len up to 64 \(got 4 x 32\)"),
    (dict(model="fp16", kv="bf16"), r"an FP8 cache or one of the model dtype fp16 \(got bf16\)"),
])
def test_explicit_backend_refused_by_limits(sm90_decode_available, kw, needle):
    _raises(needle, backend="sm90.decode", **kw)


def test_explicit_backend_lists_every_violation(all_planned):
    with pytest.raises(UnsupportedConfig) as e:
        _plan(backend="sm90.decode", head_dim=96, page_size=8)
    msg = str(e.value)
    assert "backend='sm90.decode'" in msg and "not built yet" in msg and "head_dim" in msg and "page_size" in msg
    assert msg.count("sm90.decode") == 2  # the backend and one clause naming the kernel, not one per limit


def test_explicit_layout_refused(sm90_decode_available, monkeypatch):
    _make_available(monkeypatch, "sm100.decode")
    monkeypatch.setitem(KERNELS, "sm100.decode", dataclasses.replace(KERNELS["sm100.decode"], kv_layouts=("HND",)))
    _raises(r"sm100.decode needs kv_layout HND \(got NHD\)", arch="sm100", kv_layout="NHD",
            backend="sm100.decode")
    assert _plan(kv_layout="nhd", backend="sm90.decode").kv_layout == "NHD"


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_reference_backend_always_works(arch, phase):
    p = _plan(arch, phase, "fp8", head_dim=96, page_size=8, num_q_heads=64, num_kv_heads=1, q_len=9,
              backend="reference")
    assert p.kernel == f"reference.paged_{phase}" and p.q_dtype == "bf16" and not p.applies_q_scale
    assert p.backend == "reference" and "fallback" in p.reason


def test_auto_backend_is_automatic():
    assert _plan(backend="auto") == _plan()


# ----------------------------------------------------------------------------------------------
# query_dtype="fp8": an FP8-QK kernel, opt-in ones included, or a refusal
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("registry", ["as_registered", "all_built"])
def test_fp8_query_matrix(registry, monkeypatch):
    """Every (arch, phase, cache): ``query_dtype="fp8"`` plans a kernel that computes QK in FP8 on a
    quantized query, or is refused with UnsupportedConfig; never a model-dtype-query kernel, never
    the reference. SM90 prefill takes the opt-in ``sm90.prefill_fp8q``, the automatic plan keeps
    ``sm90.prefill``."""
    if registry == "all_built":
        _make_available(monkeypatch, *[k for k in REAL_KERNELS if k != "sm90.decode_fp8q"])
    served = set()
    for arch, phase, kv, model in itertools.product(SUPPORTED_ARCHS, PHASES, KV_DTYPES, MODEL_DTYPES):
        try:
            p = _plan(arch, phase, kv, model, query_dtype="fp8")
        except UnsupportedConfig as e:
            if kv != "fp8":
                assert "needs an FP8 KV cache" in str(e), e
            else:
                assert f"cannot be served on {parse_arch(arch).name} {phase}" in str(e), e
            continue
        _check_invariants(p, model)
        assert kv == "fp8" and not p.is_fallback, p
        assert KERNELS[p.kernel].computes_qk_in_fp8("fp8_e4m3"), p
        assert (p.q_dtype, p.quantize_query, p.applies_q_scale) == ("fp8_e4m3", True, True), p
        assert "query_dtype='fp8'" in p.reason, p.reason
        served.add((p.arch, p.phase, p.kernel))
    assert ("sm90", "prefill", "sm90.prefill_fp8q") in served
    assert not {a for a, *_ in served} & set(NO_FP8_QUERY_ARCHS)
    assert not any(ph == "decode" and a == "sm90" for a, ph, _ in served)  # sm90.decode_fp8q is not built
    assert _plan("sm90", "prefill", "fp8").kernel == "sm90.prefill"  # the automatic plan is unchanged
    assert _plan("sm90", "prefill", "fp8", query_dtype="auto") == _plan("sm90", "prefill", "fp8")


def test_fp8_query_refusals_name_the_kernel_and_the_limit():
    _raises(r"query_dtype='fp8' cannot be served on sm90 prefill: sm90\.prefill_fp8q needs head_dim "
            r"64/128/256 \(got 96\)", phase="prefill", head_dim=96, query_dtype="fp8")
    _raises(r"cannot be served on sm90 decode: sm90\.decode_fp8q is not built yet", query_dtype="fp8")
    _raises(r"no prefill kernel computes QK in FP8 on sm89", arch="sm89", phase="prefill", query_dtype="fp8")
    _raises(r"needs an FP8 KV cache .* got kv_cache_dtype bf16", phase="prefill", kv="bf16", query_dtype="fp8")
    for bad in ("bf16", "int8", 3):
        _raises("query_dtype=.* is not supported; expected 'auto' or 'fp8'|must be a torch dtype or a dtype name",
                phase="prefill", query_dtype=bad)


def test_fp8_query_with_an_explicit_backend():
    p = _plan("sm90", "prefill", "fp8", query_dtype="float8_e4m3fn", backend="sm90.prefill_fp8q")
    assert (p.kernel, p.q_dtype, p.backend) == ("sm90.prefill_fp8q", "fp8_e4m3", "sm90.prefill_fp8q")
    assert _plan("sm90", "prefill", "fp8", query_dtype="fp8", backend="auto").kernel == "sm90.prefill_fp8q"
    _raises(r"backend='sm90\.prefill' takes a bf16 query", phase="prefill", query_dtype="fp8",
            backend="sm90.prefill")
    _raises(r"backend='reference' takes a bf16 query", phase="prefill", query_dtype="fp8", backend="reference")
    _raises("backend must be a kernel id string", phase="prefill", query_dtype="fp8", backend=7)


def test_fp8_query_skips_a_kernel_whose_self_check_failed(monkeypatch):
    """A compile-verified FP8-QK kernel whose family failed its self-check here is refused with the
    recorded reason: the request is refused, not served by a model-dtype-query kernel."""
    from cute_kernels.plans import selfcheck_records

    kid = "sm90.prefill_fp8q"
    monkeypatch.setitem(KERNELS, kid, dataclasses.replace(KERNELS[kid], status="compile-verified",
                                                          family=sm90_prefill.family))
    rec = selfcheck_records.CheckRecord(f"{kid}/fp8/d128", "H200", False, "mismatch 0.5", 0.1, 0.0)
    monkeypatch.setattr(selfcheck_records, "lookup", lambda family: rec if family == rec.family else None)
    _raises(r"sm90 prefill: sm90\.prefill_fp8q/fp8/d128 failed its runtime self-check on this machine \(mismatch 0\.5\)", phase="prefill",
            query_dtype="fp8")


# ----------------------------------------------------------------------------------------------
# argument parsing
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["sm_90", "sm90", "sm_90a", "SM90A", 90, (9, 0), "9.0", "90",
                                      Arch(9, 0)])
def test_parse_arch_spellings(spelling):
    a = parse_arch(spelling)
    assert a == Arch(9, 0) and a.name == "sm90" and str(a) == "sm90"


@pytest.mark.parametrize("spelling,name", [
    ("sm_80", "sm80"), (86, "sm86"), ("8.9", "sm89"), ("sm_100a", "sm100"), ("sm100f", "sm100"),
    ((10, 3), "sm103"), ("12.0", "sm120"), (121, "sm121"), ("sm_121a", "sm121"),
])
def test_parse_arch_all_supported(spelling, name):
    assert parse_arch(spelling).name == name
    assert name in SUPPORTED_ARCHS


@pytest.mark.parametrize("bad", ["sm_70", 75, (11, 0), "foo", "", True, None, "9.0.1"])
def test_parse_arch_rejects(bad):
    with pytest.raises(UnsupportedConfig, match=r"arch=.*sm80, sm86, sm89, sm90, sm100, sm103, sm120, sm121"):
        parse_arch(bad)
    with pytest.raises(ValueError):  # UnsupportedConfig is a ValueError
        _plan(arch=bad)


@pytest.mark.parametrize("spelling,name", [
    ("auto", "bf16"), ("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16"), ("float16", "fp16"),
    ("half", "fp16"), ("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("FP8", "fp8_e4m3"),
])
def test_kv_dtype_spellings(spelling, name):
    assert _plan(kv=spelling, model="bf16", backend="reference").kv_cache_dtype == name


def test_torch_dtypes():
    torch = pytest.importorskip("torch")
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float8_e4m3fn, "fp8_e4m3")):
        assert _plan(kv=dt, model=torch.float16).kv_cache_dtype == name
    p = _plan(kv=torch.float8_e4m3fn, model=torch.bfloat16)
    assert p.model_dtype == "bf16" and p.torch_q_dtype() is torch.bfloat16
    assert _plan(kv="auto", model=torch.float16).torch_q_dtype() is torch.float16
    with pytest.raises(UnsupportedConfig, match=r"uint8.*view the cache as float8_e4m3fn"):
        _plan(kv=torch.uint8)
    with pytest.raises(UnsupportedConfig, match="kv_cache_dtype"):
        _plan(kv=torch.float8_e5m2)
    with pytest.raises(UnsupportedConfig, match="model_dtype"):
        _plan(model=torch.float32)


def test_fp8_torch_q_dtype(monkeypatch):
    torch = pytest.importorskip("torch")
    _make_available(monkeypatch, "sm100.decode")
    assert _plan("sm100", kv=torch.float8_e4m3fn).torch_q_dtype() is torch.float8_e4m3fn


@pytest.mark.parametrize("kw,needle", [
    (dict(kv="uint8"), "view the cache as float8_e4m3fn"),
    (dict(kv="int8"), "kv_cache_dtype='int8'"),
    (dict(model="fp8"), "model_dtype='fp8'"),
    (dict(num_q_heads=30, num_kv_heads=8), r"num_q_heads \(30\) must be a multiple of num_kv_heads \(8\)"),
    (dict(phase="train"), "phase must be 'prefill' or 'decode', got 'train'"),
    (dict(q_len=0), "q_len must be a positive int"),
    (dict(head_dim=0), "head_dim must be a positive int"),
    (dict(head_dim=128.0), "head_dim must be a positive int"),
    (dict(page_size=-16), "page_size must be a positive int"),
    (dict(num_kv_heads=0), "num_kv_heads must be a positive int"),
    (dict(kv_layout="NDH"), "kv_layout must be 'HND' or 'NHD'"),
    (dict(backend=3), "backend must be a kernel id"),
])
def test_bad_arguments_name_the_argument(kw, needle):
    _raises(needle, **kw)


def test_plan_is_frozen_and_serialisable():
    p = _plan("sm89", backend="reference")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.kernel = "sm90.decode"
    d = p.to_dict()
    assert d["kernel"] == p.kernel and d["is_fallback"] is True and d["num_q_heads"] == 32
    assert _plan("sm89").to_dict()["is_fallback"] is False
    assert p.gqa_ratio == 4


def test_dispatch_import_does_not_load_torch_or_cutlass():
    code = ("import sys, dispatch; dispatch.plan(arch='sm90', phase='decode', kv_cache_dtype='fp8', "
            "model_dtype='bf16', head_dim=128, num_q_heads=32, num_kv_heads=8, page_size=16); "
            "assert 'torch' not in sys.modules and 'cutlass' not in sys.modules, sorted(sys.modules)")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("registry", ["as_registered", "all_built"])
def test_reasons_are_one_short_sentence(registry, monkeypatch):
    """What ``cute-kernels matrix`` and ``plan`` print: one sentence per plan (the refusals of the
    kernels tried before the chosen one, those refused alike named together), each kernel named
    once, no clause repeated within a refusal, nothing about how or when the project was built."""
    if registry == "all_built":
        _make_available(monkeypatch, *REAL_KERNELS)
    shapes = [{}, dict(head_dim=96, page_size=8), dict(num_q_heads=64, num_kv_heads=1, q_len=2)]
    for arch, phase, kv, shape in itertools.product(SUPPORTED_ARCHS, PHASES, KV_DTYPES, shapes):
        r = _plan(arch, phase, kv, **shape).reason
        assert r.endswith(".") and r.count(". ") == 0 and len(r) <= 300, r
        for part in r.rstrip(".").split("; "):  # one kernel's (or kernels') refusal: no clause twice
            clauses = part.split(" and ")
            assert len(clauses) == len(set(clauses)), r
        for kid in KERNELS:
            assert r.count(kid + " ") + r.count(kid + ".") <= 1, r
        assert not re.search(r"\b(issue|session|NOTES)\b", r), r
