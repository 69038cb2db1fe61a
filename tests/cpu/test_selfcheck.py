"""CPU tests of the runtime self-check (``cute_kernels.ops._selfcheck``) with fake kernels, and of
its records as dispatch and ``cute-kernels plan`` read them."""

from __future__ import annotations

import logging

import pytest
import torch

from cute_kernels.ops import _selfcheck as sc
from cute_kernels.plans import selfcheck_records as records


@pytest.fixture(autouse=True)
def _isolated_records(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    records.forget()
    yield
    records.forget()


def _cases(kernel, n=3, calls=None):
    """Small problems: softmax(x) @ v; the fake kernel computes it with ``kernel``."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(n):
        x = torch.randn(4, 8, generator=g)
        v = torch.randn(8, 5, generator=g)

        def run(x=x, v=v, i=i):
            if calls is not None:
                calls.append(i)
            return kernel(x, v)

        out.append(sc.Case(f"p{i}", run, lambda x=x, v=v: torch.softmax(x, -1) @ v, rtol=1e-5, atol=1e-6))
    return out


def good(x, v):
    return torch.softmax(x.double(), -1).float() @ v


def test_passing_family_runs_once_per_process():
    calls = []
    assert sc.ensure("fake.good", "cpu", lambda: _cases(good, calls=calls))
    assert calls == [0, 1, 2]
    assert sc.ensure("fake.good", "cpu", lambda: _cases(good, calls=calls))  # cached: no new calls
    assert calls == [0, 1, 2]
    rec = records.lookup("fake.good", "cpu")
    assert rec.ok and rec.reason == "" and rec.seconds >= 0
    assert "passed its self-check" in records.describe("fake.good")


@pytest.mark.parametrize("broken, expect", [
    (lambda x, v: good(x, v) * 1.01, "beyond tolerance"),
    (lambda x, v: good(x, v) + float("nan"), "NaN"),
    (lambda x, v: good(x, v)[:, :4], "shape"),
    (lambda x, v: 1 / 0, "ZeroDivisionError"),
])
def test_failing_family_falls_back_with_a_warning(broken, expect, caplog):
    calls = []
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        result = sc.guarded("fake.broken", "cpu", lambda: _cases(broken, calls=calls),
                            kernel=lambda: "kernel", reference=lambda: "reference")
    assert result == "reference"
    assert calls == [0]  # the first failing case ends the check
    assert any("fake.broken failed its self-check" in r.getMessage() for r in caplog.records)
    rec = records.lookup("fake.broken")
    assert not rec.ok and expect in rec.reason and rec.reason.startswith("case p0")
    assert "FAILED its self-check" in records.describe("fake.broken")
    # later calls of the process reuse the outcome: no new kernel call, still the reference
    assert sc.guarded("fake.broken", "cpu", lambda: _cases(broken, calls=calls), kernel=lambda: "kernel",
                      reference=lambda: "reference") == "reference"
    assert calls == [0]


def test_records_persist_for_other_processes(tmp_path):
    sc.ensure("fake.broken2", "cpu", lambda: _cases(lambda x, v: good(x, v) * 2))
    records.forget()  # a new process: only the file remains
    assert records.in_process("fake.broken2", "cpu") is None
    rec = records.lookup("fake.broken2")
    assert rec is not None and not rec.ok
    assert (tmp_path / "selfcheck.json").exists()
    assert "has not run its self-check" in records.describe("fake.never")


def test_compare_rules():
    inf = float("inf")
    a = torch.tensor([1.0, -inf, 2.0])
    assert sc.compare(a, a.clone(), 0, 0) == ""
    assert "infinities" in sc.compare(torch.tensor([1.0, 0.0, 2.0]), a, 1, 1)
    assert "NaN" in sc.compare(torch.tensor([float("nan"), -inf, 2.0]), a, 1, 1)
    assert sc.compare((a, a), (a,), 0, 0).startswith("2 outputs")
    assert sc.compare(torch.tensor([1.1]), torch.tensor([1.0]), rtol=0.2, atol=0) == ""
    assert "beyond tolerance" in sc.compare(torch.tensor([1.1]), torch.tensor([1.0]), rtol=0.05, atol=0)


def test_disk_cache_off_keeps_the_process_record(monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_DISK_CACHE", "0")
    assert not sc.ensure("fake.nodisk", "cpu", lambda: _cases(lambda x, v: good(x, v) * 3))
    assert records.records_path() is None
    assert records.lookup("fake.nodisk") is not None


def test_a_failed_family_makes_the_plan_fall_back():
    """A compile-verified kernel whose MMA family failed its self-check on this machine is refused
    by the planner (the reason says which check failed; the portable kernel serves the request);
    its other families are still planned, and the plan of a checked family says it passed."""
    from dispatch import plan

    shape = dict(arch="sm100", phase="decode", model_dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8,
                 page_size=16)
    assert plan(kv_cache_dtype="fp8", **shape).kernel == "sm100.decode"
    records.store(records.CheckRecord("sm100.decode/f8", "B200 (cuda:0)", False, "case x: NaN", 0.01, 0.0))
    p = plan(kv_cache_dtype="fp8", **shape)
    assert p.kernel == "sm80.decode" and not p.applies_q_scale  # the portable kernel, a bf16 query
    assert "sm100.decode/f8 failed its runtime self-check on this machine (case x: NaN)" in p.reason
    records.store(records.CheckRecord("sm100.decode/f16", "B200 (cuda:0)", True, "", 0.01, 0.0))
    p = plan(kv_cache_dtype="bf16", **shape)
    assert p.kernel == "sm100.decode" and "passed its runtime self-check on B200 (cuda:0)" in p.reason


def test_cli_plan_reports_the_self_check(capsys):
    from cute_kernels.cli import main

    records.store(records.CheckRecord("sm100.decode/f16", "B200 (cuda:0)", False, "case y: wrong", 0.01, 0.0))
    assert main(["plan", "--arch", "sm100", "--phase", "decode", "--kv-cache-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "kernel           sm80.decode" in out and "failed its runtime self-check" in out and "case y: wrong" in out
