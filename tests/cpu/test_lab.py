"""The lab area (profiling/): every script imports without a GPU, the runner handles every tier it
lists and runs only scripts that exist, the README lists every script, and the clock probe's
summary of nvidia-smi rows."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "profiling"
SCRIPTS = sorted(p.stem for p in LAB.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("script", SCRIPTS)
def test_lab_script_imports(script):
    importlib.import_module(f"profiling.{script}")


def test_readme_lists_every_script():
    readme = (LAB / "README.md").read_text()
    for script in SCRIPTS:
        assert f"`{script}.py`" in readme, script


def test_runner_tiers_and_modules():
    run = (LAB / "run.sh").read_text()
    header = run.split("set -o pipefail")[0]
    listed = re.findall(r"^#   ([a-z][a-z-]*)  +", header, flags=re.M)
    handled = re.findall(r"^    ([a-z][a-z-]*)\)", run, flags=re.M)
    assert listed and listed == handled
    readme = (LAB / "README.md").read_text()
    for tier in listed:
        assert f"| `{tier}` |" in readme, tier
    for module in set(re.findall(r"-m profiling\.([a-z_]+)", run)):
        assert module in SCRIPTS, module
    for what in set(re.findall(r"bench ([a-z]+) ", run)):
        from cute_kernels.bench import BENCHMARKS

        assert what in BENCHMARKS, what
    for script in ("run.sh", "offline/make_wheelhouse.sh", "offline/install.sh"):
        assert subprocess.run(["bash", "-n", str(LAB / script)]).returncode == 0, script


def test_probe_clocks_summary():
    # nvidia-smi rows "clocks.sm, power.draw, temperature.gpu, clock-event mask"; a truncated row
    # (the sampler killed mid-line) is skipped, not parsed
    from profiling.probe_clocks import summarize

    rows = [["1980", "200.5", "40", "0x0"], ["1770", "695.0", "60", "0x4"], ["1830", "690.0", "58", "0x4"],
            ["1845"]]
    s = summarize(rows)
    assert s == dict(samples=3, sm_mhz=1830.0, sm_mhz_min=1770.0, power_w=690.0, reasons=["0x0", "0x4"])
    assert summarize([]) == dict(samples=0, sm_mhz=None, sm_mhz_min=None, power_w=None, reasons=[])
