"""The runtime self-check of the SM90 prefill kernel, on the CPU with the device and the compiled
function stubbed. The kernel is available (verified by the GPU suite on the H200), so its op runs
no check; the check stays for a kernel the registry lists as compile-verified, and these tests
list it so again (``sm90_compile_verified``) to run the machinery:

- the self-check's problems fit every registered variant (dtypes, layouts, containers, scale forms,
  LSE or not: the arguments pass TVM-FFI's checks) and pass when the "kernel" is the reference;
- a kernel that passes is launched after its check, which runs once per process and family;
- a broken kernel (wrong values, NaN, an error) fails its check: the op serves the portable
  ``sm80.prefill`` (the reference for an FP8 query), a warning names the family, the record
  persists for the dispatcher, whose plan then takes the portable kernel and says why
  (``cute-kernels plan`` too);
- the opt-in persistent schedule and shared-memory epilogue (available too) launch without a
  check; listed compile-verified, a family of theirs that fails its check leaves the call to the
  default grid / the register epilogue.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from cute_kernels import reference
from cute_kernels.cli import main as cli_main
from cute_kernels.ops import paged_prefill as op
from cute_kernels.plans import selfcheck_records as records
from cute_kernels.plans import sm90_prefill as plan
from cute_kernels.registry import KERNELS
from dispatch import plan as dispatch_plan

from .test_prefill_host import _args, _kw, _problem, ffi_checks

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
VARIANTS = [c for kid in ("sm90.prefill", "sm90.prefill_fp8q") for c in KERNELS[kid].variants()]


def reference_kernel(config, *, damage=None, drop=None):
    """A stand-in for the compiled variant: TVM-FFI's argument checks, then the reference written
    into ``out`` (and ``lse``); ``damage(out)`` breaks it, ``drop`` ("sinks" or "window") ignores
    one of a window / sink variant's inputs."""
    signature = config.signature()
    names = [a.name for a in signature]

    def fn(*args):
        ffi_checks(signature, args)
        a = dict(zip(names, args))
        cache = a["kv_cache"] if "kv_cache" in a else (a["k_cache"], a["v_cache"])
        out, lse = reference.paged_prefill(
            a["q"], cache, a["block_table"], a["seq_lens"], a["query_start_loc"], max_query_len=a["max_query_len"],
            kv_layout=config.kv_layout, causal=config.causal, sm_scale=a["sm_scale"], q_scale=a.get("q_scale"),
            k_scale=a["k_scale"], v_scale=a["v_scale"], return_lse=True, out_dtype=a["out"].dtype,
            sinks=None if drop == "sinks" else a.get("sinks"),
            window_left=-1 if drop == "window" else a.get("window_left", -1))
        a["out"].copy_(out)
        if "lse" in a:
            a["lse"].copy_(lse)
        if damage is not None:
            damage(a["out"])

    return fn


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors take the CUDA path on an sm_90a target of 132 SMs; ``get_kernel`` returns the
    reference kernel (``damage`` / ``drop`` break the variants ``broken`` selects, by default the
    SM90 kernels'); ``compiled`` lists the lookups."""
    state = dict(damage=None, drop=None, compiled=[], broken=lambda config: config.kernel_id.startswith("sm90."))

    def get_kernel(config, target):
        state["compiled"].append(config)
        bad = state["broken"](config)
        return reference_kernel(config, damage=state["damage"] if bad else None, drop=state["drop"] if bad else None)

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(op, "compile_target", lambda device: "sm_90a")
    monkeypatch.setattr(op, "device_sm_count", lambda index: 132)
    monkeypatch.setattr(op, "get_kernel", get_kernel)
    op._launcher.entries.clear()
    yield state
    op._launcher.entries.clear()


@pytest.fixture
def checked_gpu(fake_gpu, sm90_compile_verified):
    """``fake_gpu`` with the SM90 prefill kernels listed as compile-verified: the op checks first."""
    return fake_gpu


@pytest.mark.parametrize("config", VARIANTS, ids=[c.label() for c in VARIANTS])
def test_problems_fit_every_variant_and_pass_with_the_reference(checked_gpu, config):
    cases = op.self_check_cases(config, "cpu")
    assert len(cases) == 2
    for case in cases:
        got, want = case.run(), case.expect()
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        assert len(got) == len(want) == (2 if config.write_lse else 1)
        assert got[0].dtype == want[0].dtype == {"bf16": BF16, "fp16": torch.float16}[config.out_dtype]
        assert not torch.isnan(want[0]).any()  # the poisoned tails never reach the reference's output
    fam = plan.family(config.q_dtype, config.kv_dtype, config.head_dim)
    assert op.self_check_passes(config, "cpu")
    rec = records.lookup(fam, "cpu")
    assert rec.ok and rec.family == fam and fam.startswith(("sm90.prefill/", "sm90.prefill_fp8q/"))


def test_a_passing_family_is_checked_once_then_launched(checked_gpu):
    fake_gpu = checked_gpu
    p = _problem("pass", kv_dtype=FP8)
    want = reference.paged_prefill(*_args(p), **_kw(p))
    got = op.paged_prefill(*_args(p), **_kw(p))
    assert torch.equal(got, want)
    checks = len(fake_gpu["compiled"])
    assert checks == 3  # the two problems of the check, then the launch itself
    assert records.lookup("sm90.prefill/widen/d64").ok
    # another variant of the same family (non-causal): no new check; another family: its own check
    op.paged_prefill(*_args(p), **_kw(p), causal=False)
    assert len(fake_gpu["compiled"]) == checks + 1
    p16 = _problem("pass16")
    op.paged_prefill(*_args(p16), **_kw(p16))
    assert len(fake_gpu["compiled"]) == checks + 1 + 3 and records.lookup("sm90.prefill/16/d64").ok


@pytest.mark.parametrize("damage,why", [
    (lambda out: out.mul_(1.5), "beyond tolerance"),
    (lambda out: out[-1].fill_(float("nan")), "NaN"),
    (lambda out: 1 / 0, "ZeroDivisionError"),
])
def test_a_failing_family_serves_the_portable_kernel_and_dispatch_says_so(checked_gpu, damage, why, caplog, capsys):
    fake_gpu = checked_gpu
    fake_gpu["damage"] = damage
    p = _problem("fail", kv_dtype=FP8)
    want = reference.paged_prefill(*_args(p), **_kw(p))
    out = torch.full(want.shape, float("nan"), dtype=BF16)
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        got = op.paged_prefill(*_args(p), **_kw(p), out=out)
    assert got is out and torch.equal(out, want)  # the portable kernel's (here: the reference's) result
    assert any("sm90.prefill/widen/d64 failed its self-check" in r.getMessage() for r in caplog.records)
    rec = records.lookup("sm90.prefill/widen/d64")
    assert not rec.ok and why in rec.reason
    assert torch.equal(op.paged_prefill(*_args(p), **_kw(p)), want)  # later calls: no new check
    # the first problem of the check failed; the portable kernel serves the family from then on
    first, *rest = fake_gpu["compiled"]
    assert first.kernel_id.startswith("sm90.") and rest and all(c.kernel_id == "sm80.prefill" for c in rest)
    # the dispatcher refuses the family on this machine, with the recorded reason; others stay
    shape = dict(arch="sm90", phase="prefill", model_dtype="bf16", head_dim=64, num_q_heads=4, num_kv_heads=2,
                 page_size=16)
    pl = dispatch_plan(kv_cache_dtype="fp8", **shape)
    assert pl.kernel == "sm80.prefill" and "sm90.prefill/widen/d64 failed its runtime self-check" in pl.reason
    assert dispatch_plan(kv_cache_dtype="bf16", **shape).kernel == "sm90.prefill"
    assert cli_main(["plan", "--arch", "sm90", "--phase", "prefill", "--kv-cache-dtype", "fp8", "--head-dim", "64",
                     "--num-q-heads", "4", "--num-kv-heads", "2", "--page-size", "16", "--json"]) == 0
    assert "failed its runtime self-check" in json.loads(capsys.readouterr().out)["reason"]


def test_a_failing_fp8_query_family_serves_the_reference(checked_gpu):
    """No other kernel takes an FP8 query: a family of the FP8-query kernel that fails its check is
    served by the reference."""
    fake_gpu = checked_gpu
    fake_gpu["damage"] = lambda out: out.mul_(1.5)
    p = _problem("fail8", kv_dtype=FP8, q_dtype=FP8)
    want = reference.paged_prefill(*_args(p), **_kw(p))
    assert torch.equal(op.paged_prefill(*_args(p), **_kw(p)), want)
    assert fake_gpu["compiled"] and not any(c.kernel_id == "sm80.prefill" for c in fake_gpu["compiled"])


def test_plan_reports_the_check_before_and_after(checked_gpu):
    shape = dict(arch="sm90", phase="prefill", kv_cache_dtype="fp8", model_dtype="bf16", head_dim=64, num_q_heads=4,
                 num_kv_heads=2, page_size=16)
    before = dispatch_plan(**shape)
    assert before.kernel == "sm90.prefill" and "compile-verified only" in before.reason
    assert "compile-verified only, its runtime self-check runs on first use" in before.reason
    p = _problem("report", kv_dtype=FP8)
    op.paged_prefill(*_args(p), **_kw(p))
    after = dispatch_plan(**shape)
    assert after.kernel == "sm90.prefill" and "it passed its runtime self-check on cpu" in after.reason


@pytest.mark.parametrize("q_dtype", [BF16, FP8], ids=["sm90.prefill", "sm90.prefill_fp8q"])
def test_the_available_kernel_runs_no_check(fake_gpu, q_dtype):
    """The GPU suite verified both query paths: the registry lists them ``available`` and the op
    launches without the self-check (a broken kernel's output comes back as it is)."""
    assert KERNELS["sm90.prefill"].status == KERNELS["sm90.prefill_fp8q"].status == "available"
    fake_gpu["damage"] = lambda out: out.mul_(2)  # a check would fail: none runs
    p = _problem("available", kv_dtype=FP8, q_dtype=q_dtype)
    want = reference.paged_prefill(*_args(p), **_kw(p))
    got = op.paged_prefill(*_args(p), **_kw(p))
    assert len(fake_gpu["compiled"]) == 1 and fake_gpu["compiled"][0].kernel_id.startswith("sm90.")
    assert torch.equal(got, want * 2)  # the (damaged) kernel's own output: no check, no fallback
    fam = plan.family("fp8_e4m3" if q_dtype == FP8 else "bf16", "fp8_e4m3", 64)
    assert records.lookup(fam) is None


# the opt-in schedule and epilogue: (tuning override, whether a config has it, what a failed family keeps)
OPT_INS = {
    plan.PERSISTENT_ID: (dict(persistent=True), lambda c: c.persistent, dict(persistent=False)),
    plan.EPILOGUE_ID: (dict(epilogue="smem"), lambda c: c.epilogue == "smem", dict(epilogue="registers")),
}


@pytest.mark.parametrize("kid", list(OPT_INS))
def test_the_available_opt_ins_run_no_check(fake_gpu, kid):
    """The GPU suite verified the persistent schedule and the shared-memory epilogue: the registry
    lists them ``available`` and the op launches them at once (a broken variant's output comes back
    as it is)."""
    override, has, _ = OPT_INS[kid]
    assert KERNELS[kid].status == "available"
    fake_gpu["broken"] = has
    fake_gpu["damage"] = lambda out: out.mul_(2)  # a check would fail: none runs
    p = _problem(("available", kid), kv_dtype=FP8)
    want = reference.paged_prefill(*_args(p), **_kw(p))
    with op.tuning_override(**override):
        got = op.paged_prefill(*_args(p), **_kw(p))
    assert len(fake_gpu["compiled"]) == 1 and has(fake_gpu["compiled"][0])
    assert torch.equal(got, want * 2)  # the (damaged) variant's own output: no check, no fallback
    assert records.lookup(plan.config_family(fake_gpu["compiled"][0])) is None


@pytest.mark.parametrize("features", [dict(window_left=20), dict(sinks="per-head"), dict(window_left=7, sinks="per-head")])
def test_the_smem_epilogue_with_a_window_or_sinks_uses_the_register_epilogue(fake_gpu, features):
    """The shared-memory epilogue ran on the H200 without a window or sinks only: with either, the op
    launches the register epilogue (a config that never ran on a GPU is not launched unchecked)."""
    p = _problem(("epilogue", tuple(features)), kv_dtype=FP8)
    kw = dict(features)
    if kw.get("sinks") == "per-head":
        kw["sinks"] = torch.linspace(-1.0, 2.0, p["q"].shape[1])
    want = reference.paged_prefill(*_args(p), **_kw(p, **kw))
    with op.tuning_override(epilogue="smem"):
        got = op.paged_prefill(*_args(p), **_kw(p, **kw))
    assert torch.equal(got, want)
    (config,) = fake_gpu["compiled"]
    assert config.epilogue == "registers" and (config.window or config.sinks)
    fake_gpu["compiled"].clear()
    with op.tuning_override(epilogue="smem"):  # without them the override holds
        op.paged_prefill(*_args(p), **_kw(p))
    assert [c.epilogue for c in fake_gpu["compiled"]] == ["smem"]


@pytest.mark.parametrize("kid", list(OPT_INS))
def test_a_failing_opt_in_family_keeps_the_default(checked_gpu, kid, caplog):
    """Listed compile-verified again, the opt-in's family runs its check first (the persistent one
    on a full wave and on 3 CTAs); one that fails it leaves the call to the default grid or the
    register epilogue, which serves it."""
    override, has, default = OPT_INS[kid]
    fake_gpu = checked_gpu
    fake_gpu["broken"] = has
    fake_gpu["damage"] = lambda out: out.mul_(1.5)
    p = _problem(("opt-in", kid), kv_dtype=FP8)
    want = reference.paged_prefill(*_args(p), **_kw(p))
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        with op.tuning_override(**override):
            got = op.paged_prefill(*_args(p), **_kw(p))
    assert torch.equal(got, want)  # the default's (here: the reference's) result
    first, *rest = fake_gpu["compiled"]
    fam = plan.config_family(first)
    assert has(first) and fam.endswith(("/persistent", "/smem_epilogue"))
    assert any(f"{fam} failed its self-check" in r.getMessage() for r in caplog.records)
    rec = records.lookup(fam)
    assert not rec.ok and "beyond tolerance" in rec.reason
    # the default's family passed its own check, then the same config without the opt-in launched
    assert rest and not any(has(c) for c in rest) and rest[-1] == dataclasses.replace(first, **default)
    assert records.lookup(plan.config_family(rest[-1])).ok
