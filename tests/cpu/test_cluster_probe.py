"""The thread-block cluster probe (profiling/cluster_probe.py; docs/design/sm90-decode.md#cluster-merge-exit)
compiles for sm_90a on a GPU-less machine with the instructions each case is about, and its driver
lists its cases as profiling/sanitize_cases.sh takes them. Its launches run on the H200 only."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from cute_kernels.jit.evidence import compile_with_evidence  # noqa: E402
from profiling import cluster_probe as cp  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_cases_are_the_modes_at_8_and_16():
    assert list(cp.CASES) == [f"{m}-{n}" for n in (8, 16) for m in ("plain", "init-cta-sync", "init-cluster-sync")]
    assert all(cfg.cluster == int(name.rsplit("-", 1)[1]) and name.startswith(cfg.mode)
               for name, cfg in cp.CASES.items())


def test_list_and_unknown_case(capsys):
    res = subprocess.run([sys.executable, "-m", "profiling.cluster_probe", "--list"], cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == list(cp.CASES)
    with pytest.raises(SystemExit) as e:
        cp.main(["--case", "plain-16,plain-17"])
    assert e.value.code == 2 and "plain-17" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [{"cluster": 1}, {"cluster": 17}, {"mode": "cta"}])
def test_rejects_bad_configs(kwargs):
    with pytest.raises(ValueError):
        cp.ClusterProbeConfig(**kwargs)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["plain-16", "init-cta-sync-16", "init-cluster-sync-16", "init-cta-sync-8"])
def test_case_compiles_with_its_instructions(name):
    cfg = cp.CASES[name]
    compiled, ev = compile_with_evidence(cfg, "sm_90a")
    ptx = compiled.ptx or ""
    assert ev.ptx_target == "sm_90a" and not ev.missing, ev.summary()
    # the cluster merge's pattern: two cluster barriers around the DSMEM reads of the peer's buffer
    assert len(re.findall(r"barrier\.cluster\.arrive;", ptx)) == 2
    assert len(re.findall(r"barrier\.cluster\.wait;", ptx)) >= 2
    assert re.search(r"mapa\.shared::cluster", ptx) and re.search(r"ld\.shared::cluster\.f32", ptx)
    tma = (r"cp\.async\.bulk\.tensor", r"mbarrier\.init", r"fence\.mbarrier_init\.release\.cluster",
           r"mbarrier\.arrive\.expect_tx", r"mbarrier\.try_wait")
    relaxed = re.search(r"barrier\.cluster\.arrive\.relaxed", ptx)
    if cfg.mode == "plain":
        assert not any(re.search(p, ptx) for p in tma) and not relaxed
    else:
        assert all(re.search(p, ptx) for p in tma), name
        # the ordering after the initialization is the case: a CTA barrier or the cluster's
        assert bool(relaxed) == (cfg.mode == "init-cluster-sync")
        assert bool(re.search(r"bar\.sync\s+0", ptx)) == (cfg.mode == "init-cta-sync")
    if compiled.sass is not None:
        assert "STL" not in compiled.sass and "LDL" not in compiled.sass
        assert re.search(r"\bUCGABAR_ARV\b", compiled.sass) and re.search(r"\bUCGABAR_WAIT\b", compiled.sass)


def test_synccheck_tool_limit_is_the_mbarrier_cases_past_the_portable_cluster():
    # the sanitizer tier expects these to fail under synccheck (docs/design/sm90-decode.md#cluster-merge-exit)
    assert cp.SYNCCHECK_TOOL_LIMIT == {"init-cta-sync-16", "init-cluster-sync-16"}


def test_decode_synccheck_tool_limit_names_its_16_cta_cases():
    from profiling import sanitize_decode as sd

    assert sd.SYNCCHECK_TOOL_LIMIT <= set(sd.CASES)
    # the 4- and 8-CTA cluster cases stay in the synccheck verdict
    assert not {"fp8-cluster8", "past-table-cluster"} & sd.SYNCCHECK_TOOL_LIMIT
    assert {"fp8-cluster16", "fp8-b1-ctx1000-schedule"} <= sd.SYNCCHECK_TOOL_LIMIT
