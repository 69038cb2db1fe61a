"""The lab area (profiling/): every script imports without a GPU, the runner handles every tier it
lists and runs only scripts that exist, the README lists every script, and the clock probe's
summary of nvidia-smi rows, and the prefill tuning sweep's configs."""

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
    for module in set(re.findall(r"-m profiling\.([a-z0-9_]+)", run)):
        assert module in SCRIPTS, module
    for what in set(re.findall(r"bench ([a-z]+) ", run)):
        from cute_kernels.bench import BENCHMARKS

        assert what in BENCHMARKS, what
    for script in ("run.sh", "env.sh", "sanitize_cases.sh", "offline/make_wheelhouse.sh", "offline/install.sh"):
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


def test_tune_prefill_sweep_is_valid():
    """The prefill tuning sweep without a GPU: each (kind, D) holds its default first, the three consumer
    schedules, and other tilings; every config passes the config's checks and differs from the default
    in tuning fields only, or is recorded refused with the reason the checks give; the default sweep
    stays small enough to compile in minutes, and the wide one contains it."""
    from dataclasses import fields
    from itertools import product

    from cute_kernels.plans.sm90_prefill import Sm90PrefillConfig
    from profiling.tune_prefill import DIMS, KINDS, TUNING, main, problem_config, sweep

    entries = sweep()
    configs = [e.config for e in entries if e.config is not None]
    assert 30 <= len(configs) <= 75 and len(set(configs)) == len(configs)
    for kind, D in product(KINDS, DIMS):
        group = [e for e in entries if (e.kind, e.head_dim) == (kind, D)]
        assert group[0].default and not any(e.default for e in group[1:])
        assert group[0].config == problem_config(kind, D)
        ok = [e.config for e in group if e.config is not None]
        assert {(c.overlap, c.pingpong) for c in ok} == {(True, True), (True, False), (False, False)}, (kind, D)
        assert len({(c.tile_n, c.stages, c.staging) for c in ok}) >= 3, (kind, D)
        # the persistent schedule: one row, at the default tiling
        assert [c for c in ok if c.persistent] == [problem_config(kind, D, persistent=True)], (kind, D)
        # the shared-memory epilogue: one row, at the default tiling
        assert [c for c in ok if c.epilogue == "smem"] == [problem_config(kind, D, epilogue="smem")], (kind, D)
    for e in entries:
        base = problem_config(e.kind, e.head_dim)
        if e.config is None:
            assert e.refused and not e.default
            with pytest.raises(ValueError, match=re.escape(e.refused)):
                problem_config(e.kind, e.head_dim, **e.tuning)
            continue
        assert Sm90PrefillConfig(**{f.name: getattr(e.config, f.name) for f in fields(e.config)}) == e.config
        changed = {f.name for f in fields(base) if getattr(base, f.name) != getattr(e.config, f.name)}
        assert changed <= set(TUNING) and (changed or e.default), (e.tag, changed)
    wide = {e.config for e in sweep(wide=True)}
    assert set(configs) < wide
    assert main(["--list", "--kinds", "fp8", "--dims", "256"]) == 0
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0


@pytest.mark.compile
@pytest.mark.parametrize("kind,D,tag", [("16", 128, "n176 s2 pingpong"), ("fp8", 64, "n192 s4 g2 overlap")])
def test_tune_prefill_sweep_configs_compile(kind, D, tag):
    """Two non-default configs of the tuning sweep (its largest tiles) compile for sm_90a with the
    kernel's evidence and no register spills."""
    from cute_kernels.jit.evidence import compile_with_evidence
    from profiling.tune_prefill import sweep

    (entry,) = [e for e in sweep((kind,), (D,)) if e.tag == tag]
    _, ev = compile_with_evidence(entry.config, "sm_90a")
    assert not ev.missing and ev.ptx_target == "sm_90a", ev.summary()
    assert "STL" not in ev.sass and "LDL" not in ev.sass, f"register spills: {ev.sass}"
