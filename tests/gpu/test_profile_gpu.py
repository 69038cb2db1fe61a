"""``cute-kernels profile`` on the GPU with Nsight Compute (skipped where ncu is not installed):
the report holds the roofline copy and exactly the profiled call's kernels, by their readable
names, with every column filled."""

from __future__ import annotations

import json
import shutil

import pytest

from cute_kernels.cli import main as cli_main

from .conftest import sm90_only

pytestmark = pytest.mark.skipif(shutil.which("ncu") is None, reason="Nsight Compute (ncu) is not on PATH")


def _profile(tmp_path, what: str, shape: str, tuning: str = "") -> dict:
    stem = tmp_path / what
    assert cli_main(["profile", what, "--shape", shape, "--out", str(stem),
                     *(["--tuning", tuning] if tuning else [])]) == 0
    for ext in ("ncu-rep", "csv", "md"):
        assert (tmp_path / f"{what}.{ext}").stat().st_size > 0
    return json.loads((tmp_path / f"{what}.json").read_text())


def _check_columns(kernel: dict) -> None:
    for key in ("duration_us", "dram_bytes", "roofline_pct", "dram_throughput_pct", "sm_throughput_pct",
                "achieved_occupancy_pct", "registers_per_thread", "smem_per_cta_bytes", "local_memory_bytes"):
        assert kernel[key] is not None, key
    assert 0 < kernel["duration_us"] < 100_000 and kernel["registers_per_thread"] > 0  # µs, not seconds
    assert kernel["local_memory_bytes"] == 0  # no spills
    assert len(kernel["top_stalls"]) == 3


def test_profile_merge(tmp_path):
    report = _profile(tmp_path, "merge", "S=8,N=256,H=32,D=128")
    assert report["roofline"]["dram_gbps"] > 1000
    (kernel,) = report["kernels"]
    assert kernel["name"].startswith("cute_kernels_merge_states")
    _check_columns(kernel)


@sm90_only()
def test_profile_decode(tmp_path):
    report = _profile(tmp_path, "decode", "B=8,ctx=32000")
    names = [k["name"] for k in report["kernels"]]
    assert len(names) == 1 and names[0].startswith("cute_kernels_sm90_decode"), names
    _check_columns(report["kernels"][0])
    assert report["total"]["roofline_pct"] > 50


@sm90_only()
def test_profile_layer(tmp_path):
    report = _profile(tmp_path, "layer", "B=8,ctx=4096")
    names = [k["name"] for k in report["kernels"]]
    assert names[0].startswith("cute_kernels_write_kv_cache") and names[-1].startswith("cute_kernels_sm90_decode")


@sm90_only()
def test_profile_prefill(tmp_path):
    report = _profile(tmp_path, "prefill", "B=1,new=4096")
    names = [k["name"] for k in report["kernels"]]
    assert names and all(n.startswith("cute_kernels_sm90_prefill") for n in names), names
    _check_columns(report["kernels"][-1])


@sm90_only()
@pytest.mark.parametrize("what,shape", [("prefill", "B=1,new=2048"), ("decode", "B=8,ctx=8192")])
def test_profile_the_portable_kernel(tmp_path, what, shape):
    """``--tuning backend=sm80`` profiles the portable kernel on this GPU, and the report says so."""
    report = _profile(tmp_path, what, shape, tuning="backend=sm80,lean_softmax=true")
    assert report["tuning"] == {"backend": "sm80", "lean_softmax": True}
    names = [k["name"] for k in report["kernels"]]
    assert names and any(n.startswith(f"cute_kernels_sm80_{what}") for n in names), names
    assert "tuning_override: backend=sm80, lean_softmax=True" in (tmp_path / f"{what}.md").read_text()
