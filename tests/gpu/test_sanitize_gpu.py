"""The sanitizer tier: compute-sanitizer's memcheck, racecheck, synccheck and initcheck over every
kernel family, on small shapes with every kind of invalid input (docs/design/testing.md#sanitizer).

Each driver under ``profiling/`` (decode and merge, QSA with its pre-passes and merge, the layer
glue, the SM90 prefill's smoke cases per kind) first runs plainly (so its variants compile into the
disk cache outside the sanitizer), then once under each tool; a run passes when it finishes and the
tool's summary reports no error. synccheck runs the decode driver one named case per process
(``--case NAME``, ``CUDA_LAUNCH_BLOCKING=1``), so a failing case leaves the others' verdicts
standing and its last ``case NAME: CALL`` line names the call. One exception, proven benign in
docs/design/qsa.md#racecheck-of-the-union-pre-pass: racecheck's write-write hazards on the QSA
union pre-pass's union stores (rows sharing a token store the same value; non-candidates store to
a sink slot nobody reads). Marked ``sanitize`` (minutes per driver and tool), so a plain GPU run
skips it: ``python -m pytest tests/gpu/test_sanitize_gpu.py -m sanitize`` runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from profiling.sanitize_decode import CASES as DECODE_CASES
from profiling.sanitizer_reports import benign_union_races, reported_errors

from .conftest import sm90_only

pytestmark = [sm90_only(), pytest.mark.sanitize]
ROOT = Path(__file__).resolve().parents[2]
# (driver module, its arguments, what it prints when it finished); the prefill smoke runs one kind each
DRIVERS = {
    "decode": ("sanitize_decode", [], "sanitize run finished"),
    "qsa": ("sanitize_qsa", [], "sanitize run finished"),
    "glue": ("sanitize_glue", [], "sanitize run finished"),
    "prefill-16": ("smoke_prefill", ["--only", "q_dtype=bf16,kv_dtype=bf16"], "smoke ok"),
    "prefill-widen": ("smoke_prefill", ["--only", "q_dtype=bf16,kv_dtype=fp8"], "smoke ok"),
    "prefill-fp8q": ("smoke_prefill", ["--only", "q_dtype=fp8"], "smoke ok"),
}
TOOLS = ["memcheck", "racecheck", "synccheck", "initcheck"]
PER_CASE = {("synccheck", "decode")}  # (tool, driver) run one named case per process
TIMEOUT = int(os.environ.get("CUTE_KERNELS_SANITIZE_TIMEOUT", "1800"))


def _sanitizer() -> str | None:
    for cand in (os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer"),
                 "/usr/local/cuda/bin/compute-sanitizer"):
        if cand and Path(cand).exists():
            return cand
    return None


def command(tool: str, driver: str, sanitizer: str = "compute-sanitizer", case: str | None = None) -> list[str]:
    """The command line of one run (docs/design/testing.md lists them); ``case``: only that case of
    the driver."""
    module, args, _ = DRIVERS[driver]
    extra = ["--racecheck-report", "hazard"] if tool == "racecheck" else []
    only = [] if case is None else ["--case", case]
    # the DSL probes driver entry points; those expected CUDA_ERROR_INVALID_VALUE returns are no errors
    return [sanitizer, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "9", "--print-limit", "100",
            *extra, sys.executable, "-m", f"profiling.{module}", *args, *only]


@pytest.fixture(scope="module")
def sanitizer():
    exe = _sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer not found (set COMPUTE_SANITIZER)")
    return exe


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    e["PYTHONPATH"] = f"{ROOT}{os.pathsep}{e.get('PYTHONPATH', '')}"
    e.setdefault("CUTE_KERNELS_CACHE_DIR", str(tmp_path_factory.mktemp("ck_cache")))
    return e


@pytest.fixture(scope="module")
def compiled(env):
    """Each driver once without a sanitizer: its variants compile into the disk cache."""
    done = {}
    for driver, (module, args, _) in DRIVERS.items():
        res = subprocess.run([sys.executable, "-m", f"profiling.{module}", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=TIMEOUT)
        done[driver] = (res.returncode, res.stdout[-2000:] + res.stderr[-4000:])
    return done


def _check(tool: str, driver: str, res: subprocess.CompletedProcess, what: str) -> None:
    out = res.stdout + res.stderr
    summary = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: .*", out)
    assert DRIVERS[driver][2] in out, f"{what} did not finish under {tool} (rc {res.returncode}):\n{out[-6000:]}"
    if res.returncode == 0 and reported_errors(out) == 0:
        return
    if tool == "racecheck" and driver == "qsa" and benign_union_races(out):
        return  # proven benign: docs/design/qsa.md#racecheck-of-the-union-pre-pass
    pytest.fail(f"{tool} on {what}: rc {res.returncode}, {summary}\n{out[-8000:]}")


@pytest.mark.parametrize(("driver", "tool"), [(d, t) for d in DRIVERS for t in TOOLS if (t, d) not in PER_CASE])
def test_sanitizer_is_clean(sanitizer, env, compiled, driver, tool):
    rc, log = compiled[driver]
    assert rc == 0, f"{driver} fails without a sanitizer:\n{log}"
    res = subprocess.run(command(tool, driver, sanitizer), cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    _check(tool, driver, res, driver)


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("tool", sorted(t for t, d in PER_CASE if d == "decode"))
def test_sanitizer_per_case(sanitizer, env, compiled, tool, case):
    """One case of the decode driver in its own process, each launch blocking, so the log's last
    ``case NAME: CALL`` line is the call that failed."""
    rc, log = compiled["decode"]
    assert rc == 0, f"decode fails without a sanitizer:\n{log}"
    res = subprocess.run(command(tool, "decode", sanitizer, case), cwd=ROOT, env=dict(env, CUDA_LAUNCH_BLOCKING="1"),
                         capture_output=True, text=True, timeout=TIMEOUT)
    _check(tool, "decode", res, f"decode --case {case}")
