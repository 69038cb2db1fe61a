"""The fused residual of ``quantize_query(..., residual=True)`` (``common.quantize_query_residual``;
docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2), host side and compile evidence:

- the config field ``residual`` leaves every one-term variant's label, argument list and PTX
  digest as it was; the residual variants' labels, arguments, registry entry and family;
- each residual variant compiles for every FP8 target with two e4m3 conversions and two stores per
  chunk (twice the one-term variant's), the codes widened back, one uncontracted ``sub.rn.f32``
  per element, the division's FMAs only, and no spills;
- the op's routing on a GPU (``is_cuda`` and the compiler faked): the fused launch with the six
  arguments in signature order; the torch-ops path where the self-check fails, on SM80/86 and for
  an empty query; CPU tensors keep the reference;
- the self-check itself (run on CPU tensors with the kernel call replaced): a kernel that matches
  the torch-ops bytes passes, one that differs in one byte fails and is recorded, no check while
  the entry is available, and inside capture without a record a clear error.

The kernel itself runs in tests/gpu/test_quantize_residual_gpu.py.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.jit.compiler import compile_config
from cute_kernels.jit.ptx_digest import ptx_digest, read_digests
from cute_kernels.jit.spec import COMPILE_TARGETS
from cute_kernels.ops import _quantize_residual as check
from cute_kernels.ops import _selfcheck
from cute_kernels.ops import quantize_query as op
from cute_kernels.plans import quantize_query as plan
from cute_kernels.plans import selfcheck_records
from cute_kernels.plans.hw import PDL_TARGETS
from cute_kernels.registry import KERNELS, compile_matrix

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DIGESTS = "tests/cpu/ptx_digests.json"


# ---------------------------------------------------------------------------------------------
# config, label, registry
# ---------------------------------------------------------------------------------------------


def test_one_term_labels_and_arguments_are_unchanged():
    for config in plan.compile_variants():
        assert not config.residual and "residual" not in config.label()
        assert config.arg_names()[-1] != "residual_out"
    digests = read_digests(DIGESTS)
    one_term = [k for k in digests if "common.quantize_query[" in k]
    assert one_term and not any("residual" in k for k in one_term if not k.endswith("residual=True]"))


def test_residual_variants_label_arguments_and_evidence():
    for config in plan.residual_variants():
        one = replace(config, residual=False)
        assert config.label() == one.label()[:-1] + ",residual=True]"
        assert config.arg_names() == one.arg_names() + ("residual_out",)
        assert config.signature()[-1].dtype == "fp8_e4m3"
        names = {name for name, _ in config.evidence["sm_90a"]}
        assert {"sub.rn.f32 (x - hi)", "e4m3 -> f16x2 (hi back to float)"} <= names
        assert not {n for n, _ in one.evidence["sm_90a"]} & {"sub.rn.f32 (x - hi)"}
    cfg = plan.make_quantize_config(q_dtype="bf16", head_dim=128, vec=16, scale_tensor=False, num_q_heads=32,
                                    residual=True)
    assert cfg.residual and cfg == replace(plan.make_quantize_config(
        q_dtype="bf16", head_dim=128, vec=16, scale_tensor=False, num_q_heads=32), residual=True)


def test_registry_entry():
    info = KERNELS[plan.RESIDUAL_ID]
    assert info.status == "available" and info.call_site is None and info.op == "quantize_query"
    assert info.archs == KERNELS["common.quantize_query"].archs
    assert all(c.residual for c in info.variants()) and not any(c.residual for c in plan.compile_variants())
    assert info.family("bf16", "fp8_e4m3", 128) == plan.residual_family(plan.residual_variants()[0])
    rope = next(c for c in plan.residual_variants() if c.rot_dim)
    assert plan.residual_family(rope).endswith("/rope")
    matrix = compile_matrix()
    for target in COMPILE_TARGETS:
        assert {c for t, c in matrix if t == target and getattr(c, "residual", False)} == set(plan.residual_variants())


# ---------------------------------------------------------------------------------------------
# compile evidence
# ---------------------------------------------------------------------------------------------


def _count(pattern: str, ptx: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
def test_one_term_ptx_digests_unchanged(target):
    """The one-term variants compile to the PTX recorded before the residual field existed."""
    digests = read_digests(DIGESTS)
    for config in plan.compile_variants():
        compiled = compile_config(config, target, artifacts=True)
        assert ptx_digest(compiled.ptx) == digests[f"{target}:{config.label()}"], config.label()


def _evidence_case(config, target):
    fused = compile_config(config, target, artifacts=True)
    one = compile_config(replace(config, residual=False), target, artifacts=True)
    ptx, ptx1 = fused.ptx, one.ptx
    assert re.search(rf"^\.target\s+{target}\b", ptx, re.M)
    cvt = r"cvt\.rn\.satfinite\.e4m3x2\.f32"
    assert _count(cvt, ptx) == 2 * _count(cvt, ptx1) > 0  # the codes and the residual
    store = r"st\.global(\.\w+)*"
    assert _count(store, ptx) == 2 * _count(store, ptx1) > 0
    # x - float(hi): every element once, from the codes widened back exactly
    # a RoPE lane owns a pair of chunks; with a partial RoPE the pass-through lanes' code is there too
    chunks = 1 if not config.rot_dim else 2 + (config.rot_dim < config.head_dim)
    elements = config.vec * config.items * chunks
    assert _count(r"sub\.rn\.f32", ptx) == elements
    assert _count(r"cvt\.rn\.f16x2\.e4m3x2", ptx) == elements // 2
    assert _count(r"cvt\.f32\.f16", ptx) - _count(r"cvt\.f32\.f16", ptx1) == elements  # (fp16 q converts too)
    # nothing new to contract: the FMAs and multiplies are the division's and the rotation's
    for op_ in (r"fma\.rn\.f32", r"mul\.rn\.f32", r"div\.rn\.f32", r"add\.rn\.f32"):
        assert _count(op_, ptx) == _count(op_, ptx1), op_
    assert not re.search(r"\.ftz\.", ptx)
    if fused.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", fused.sass), "local memory (spills)"


@pytest.mark.compile
@pytest.mark.parametrize("config", plan.residual_variants(), ids=lambda c: c.label())
def test_residual_variant_evidence_sm90(config):
    _evidence_case(config, "sm_90a")


@pytest.mark.compile
@pytest.mark.parametrize("target", [t for t in plan.FP8_TARGETS if t != "sm_90a"])
def test_residual_default_compiles_for_every_fp8_target(target):
    """The op's choice there: the SM90 default's fields, PDL only where the target has it."""
    for config in (plan.residual_variants()[0], plan.residual_variants()[3]):  # plain; RoPE, two rows per thread
        made = plan.make_quantize_config(q_dtype=config.q_dtype, head_dim=config.head_dim, vec=config.vec,
                                         scale_tensor=config.scale_tensor, num_q_heads=32, target=target,
                                         rope=(config.rot_dim, config.cos_sin_dtype, config.pos_dtype)
                                         if config.rot_dim else None, residual=True)
        assert made.pdl == (target in PDL_TARGETS)
        _evidence_case(replace(config, pdl=made.pdl), target)


@pytest.mark.compile
def test_residual_is_refused_on_sm80():
    with pytest.raises(ValueError, match="does not compile for sm_80"):
        compile_config(plan.residual_variants()[0], "sm_80")


# ---------------------------------------------------------------------------------------------
# the op's routing (is_cuda and the compiler faked; the fake kernels compute with the reference)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors take the GPU path (target ``sm_90a`` unless changed in ``state``); ``get_kernel``
    records its configs and returns a kernel that writes the reference's terms; the residual
    self-check's outcome is ``state["check"]``."""
    state = dict(target="sm_90a", check=True, configs=[], calls=[])

    def get_kernel(config, target):
        state["configs"].append(config)

        def kernel(*args):
            a = dict(zip(config.arg_names(), args))
            state["calls"].append((config, a))
            rope = None if a.get("cos_sin_cache") is None else (a["cos_sin_cache"], a["positions"])
            hi, lo = reference.quantize_query(a["q"], a["q_scale"], rope=rope, residual=True)
            a["out"].copy_(hi)
            if config.residual:
                a["residual_out"].copy_(lo)
        return kernel

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(op, "compile_target", lambda device: state["target"])
    monkeypatch.setattr(op, "get_kernel", get_kernel)
    monkeypatch.setattr(op, "self_check_passes", lambda config, device: state["check"])
    for launcher in (op._launcher, op._two_launcher):
        launcher.launches.clear()
    yield state
    for launcher in (op._launcher, op._two_launcher):
        launcher.launches.clear()


def _inputs(seed=3, T=21, Hq=8, D=64):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, Hq, D, generator=g) * 4).to(BF16)
    cos_sin = torch.randn(40, D // 2, generator=g)
    return q, (cos_sin, torch.randint(0, 40, (T,), generator=g))


def _same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("q_scale", [0.02, torch.tensor(0.02), torch.tensor([0.02]), torch.tensor([0.02, 0.03])],
                         ids=["float", "0-d", "1-element", "per-kv-head"])
@pytest.mark.parametrize("with_rope", [False, True])
def test_fused_launch_on_a_gpu(fake_gpu, q_scale, with_rope):
    q, rope = _inputs()
    rope = rope if with_rope else None
    hi, lo = cute_kernels.quantize_query(q, q_scale, rope=rope, residual=True)
    want_hi, want_lo = reference.quantize_query(q, q_scale, rope=rope, residual=True)
    assert _same(hi, want_hi) and _same(lo, want_lo)
    [(config, args)] = fake_gpu["calls"]
    assert config.residual and config.rot_dim == (rope[0].shape[1] if with_rope else 0)
    assert config.scale_tensor == isinstance(q_scale, torch.Tensor)
    assert args["out"] is hi and args["residual_out"] is lo and args["q"] is q
    if isinstance(q_scale, torch.Tensor):
        assert args["q_scale"].dim() == 1  # a 0-d scale goes as a [1] view
    # the second call is the cached launch (no new config), into given buffers
    out, lo_out = torch.empty_like(hi), torch.empty_like(lo)
    res = cute_kernels.quantize_query(q, q_scale, rope=rope, out=out, residual=True, residual_out=lo_out)
    assert res[0] is out and res[1] is lo_out
    assert _same(out, want_hi) and _same(lo_out, want_lo)
    assert all(c.residual for c in fake_gpu["configs"]) and len(fake_gpu["calls"]) == 2


@pytest.mark.parametrize("why", ["self-check failed", "sm_86", "empty"])
def test_torch_ops_path_on_a_gpu(fake_gpu, why):
    q, _ = _inputs()
    if why == "self-check failed":
        fake_gpu["check"] = False
    elif why == "sm_86":
        fake_gpu["target"] = "sm_86"
    else:
        q = q[:0]
    for _ in range(2):  # the choice is cached with the launch
        hi, lo = cute_kernels.quantize_query(q, 0.02, residual=True)
        want_hi, want_lo = reference.quantize_query(q, 0.02, residual=True)
        assert _same(hi, want_hi) and _same(lo, want_lo)
    assert not any(c.residual for c in fake_gpu["configs"])
    assert len(fake_gpu["configs"]) == (1 if why == "self-check failed" else 0)  # the one-term kernel's


def test_cpu_tensors_keep_the_reference(monkeypatch):
    monkeypatch.setattr(op, "get_kernel", lambda *a: pytest.fail("compiled for CPU tensors"))
    monkeypatch.setattr(op, "self_check_passes", lambda *a: pytest.fail("self-check for CPU tensors"))
    q, rope = _inputs(5)
    hi, lo = cute_kernels.quantize_query(q, torch.tensor([0.03, 0.05]), rope=rope, residual=True)
    want = reference.quantize_query(q, torch.tensor([0.03, 0.05]), rope=rope, residual=True)
    assert _same(hi, want[0]) and _same(lo, want[1])


def test_fused_launch_refusal_names_the_argument(fake_gpu):
    q, _ = _inputs()
    cute_kernels.quantize_query(q, 0.02, residual=True)
    with pytest.raises(ValueError, match="residual_out"):
        cute_kernels.quantize_query(q, 0.02, residual=True, residual_out=torch.empty(2, 8, 64).to(FP8))


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu-path"])
@pytest.mark.parametrize("alias", ["same", "half", "view"])
def test_overlapping_outputs_are_refused(alias, gpu, request):
    """``out`` and ``residual_out`` sharing bytes would leave one term overwritten by the other:
    refused naming ``residual_out``, on the CPU and the GPU paths alike; disjoint halves of one
    buffer are fine."""
    if gpu:
        request.getfixturevalue("fake_gpu")
    q, _ = _inputs(T=6, Hq=4, D=64)
    buf = torch.empty(2 * q.numel() + 64, dtype=torch.uint8).view(FP8)
    out = buf[:q.numel()].view(q.shape)
    lo = {"same": out, "half": buf[q.numel() // 2:q.numel() // 2 + q.numel()].view(q.shape),
          "view": out.view(-1).view(q.shape)}[alias]
    with pytest.raises(ValueError, match="residual_out must not overlap out"):
        cute_kernels.quantize_query(q, 0.02, out=out, residual=True, residual_out=lo)
    hi, lo2 = cute_kernels.quantize_query(q, 0.02, out=out, residual=True,
                                          residual_out=buf[q.numel():2 * q.numel()].view(q.shape))
    want = reference.quantize_query(q, 0.02, residual=True)
    assert _same(hi, want[0]) and _same(lo2, want[1])


# ---------------------------------------------------------------------------------------------
# the self-check (CPU tensors, the kernel call replaced)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def records(tmp_path, monkeypatch):
    """Fresh self-check records, the residual entry listed as compile-verified again (its self-check
    is what these tests exercise; the GPU suite made it available)."""
    monkeypatch.setitem(KERNELS, plan.RESIDUAL_ID, replace(KERNELS[plan.RESIDUAL_ID], status="compile-verified"))
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    selfcheck_records.forget()
    yield selfcheck_records
    selfcheck_records.forget()


@pytest.mark.parametrize("config", plan.residual_variants(), ids=lambda c: c.label())
def test_self_check_passes_a_matching_kernel(records, monkeypatch, config):
    ran = []
    monkeypatch.setattr(check, "launch_now", lambda cfg, t: ran.append(cfg) or check.torch_ops(t))
    assert check.self_check_passes(config, "cpu")
    assert ran and all(c is config for c in ran)
    assert len(ran) == (2 if config.scale_tensor else 1)
    rec = records.in_process(plan.residual_family(config), "cpu")
    assert rec is not None and rec.ok
    ran.clear()
    assert check.self_check_passes(config, "cpu") and not ran  # once per process and family


def test_self_check_problem_covers_saturation_and_tiny_values():
    config = plan.residual_variants()[0]
    p = check.check_problem(config, torch.Generator().manual_seed(check.SELF_CHECK_SEED), "float")
    hi, lo = reference.quantize_query(p["q"], p["q_scale"], residual=True)
    assert (hi.float().abs() == 448).any() and (lo.float() != 0).any() and (hi.float() == 0).any()


def test_self_check_fails_a_kernel_one_byte_off(records, monkeypatch, caplog):
    def off_by_one(cfg, t):
        hi, lo = check.torch_ops(t)
        lo = lo.clone()
        lo.view(-1)[123] ^= 1
        return hi, lo

    monkeypatch.setattr(check, "launch_now", off_by_one)
    config = plan.residual_variants()[2]
    assert not check.self_check_passes(config, "cpu")
    rec = records.in_process(plan.residual_family(config), "cpu")
    assert rec is not None and not rec.ok and "output 1" in rec.reason
    assert "the torch-ops residual runs instead" in caplog.text
    assert not check.self_check_passes(config, "cpu")  # recorded: no second run


def test_no_self_check_once_available(records, monkeypatch):
    monkeypatch.setitem(KERNELS, plan.RESIDUAL_ID, replace(KERNELS[plan.RESIDUAL_ID], status="available"))
    monkeypatch.setattr(check, "launch_now", lambda *a: pytest.fail("self-check ran"))
    assert check.self_check_passes(plan.residual_variants()[0], "cpu")


def test_self_check_inside_capture_asks_for_a_first_call(records, monkeypatch):
    monkeypatch.setattr(_selfcheck, "capturing", lambda device: True)
    monkeypatch.setattr(check, "launch_now", lambda *a: pytest.fail("self-check ran inside capture"))
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        check.self_check_passes(plan.residual_variants()[0], "cpu")
