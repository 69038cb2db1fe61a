"""The ``cute-kernels`` CLI: ``matrix`` and ``plan`` output, exit codes, and no DSL import."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cute_kernels.cli import COMMANDS, format_table, main
from dispatch import KERNELS, SUPPORTED_ARCHS

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture
def sm90_decode_planned(monkeypatch):
    """Pin ``sm90.decode`` to "planned" so these checks hold before and after it lands."""
    monkeypatch.setitem(KERNELS, "sm90.decode", dataclasses.replace(KERNELS["sm90.decode"], status="planned"))


def _rows(text: str) -> list[list[str]]:
    """Split the matrix text table into cells (columns are separated by 2+ spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("arch "))
    body = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        body.append(re.split(r" {2,}", line, maxsplit=6))
    return body


def test_matrix_text(capsys, sm90_decode_planned):
    assert main(["matrix"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert len(rows) == 8 * 2 * 3
    assert {r[0] for r in rows} == set(SUPPORTED_ARCHS)
    for r in rows:
        assert len(r) == 7 and r[5] in ("yes", "no")
    sm90_fp8 = next(r for r in rows if r[:3] == ["sm90", "decode", "fp8_e4m3"])
    assert sm90_fp8[3] == "sm80.decode" and sm90_fp8[4] == "bf16" and sm90_fp8[5] == "no"
    assert sm90_fp8[6] == "sm90.decode is not built yet; sm80.decode accepts this request."
    for r in rows:  # every cell names a kernel, none the reference
        assert not r[3].startswith("reference."), r
        if r[0] in ("sm80", "sm86", "sm89", "sm120", "sm121"):
            assert r[3] == f"sm80.{r[1]}" and r[4] == "bf16" and r[5] == "no"
            assert r[6].endswith(f"(verified as SM80 code on SM90 hardware, not on {r[0]}).")
    for arch in SUPPORTED_ARCHS:  # per-arch notes follow the table
        assert f"\n  {arch} " in out


def test_matrix_json(capsys):
    assert main(["matrix", "--json", "--model-dtype", "fp16", "--head-dim", "64"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    assert len(rows) == 48 and {r["arch"] for r in rows} == set(SUPPORTED_ARCHS)
    assert data["inputs"]["head_dim"] == 64 and all(r["head_dim"] == 64 for r in rows)
    cell = ("sm90", "decode", "fp8_e4m3")
    sm90 = next(r for r in rows if (r["arch"], r["phase"], r["kv_cache_dtype"]) == cell)
    assert sm90["q_dtype"] == "fp16" and sm90["applies_q_scale"] is False and sm90["quantize_query"] is False
    assert {c["arch"] for c in data["capabilities"]} == set(SUPPORTED_ARCHS)


def test_matrix_bad_shape_exits_2(capsys):
    assert main(["matrix", "--num-q-heads", "30"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --num-q-heads (30) must be a multiple of --num-kv-heads (8)")


def test_plan_text(capsys, sm90_decode_planned):
    assert main(["plan", "--arch", "sm_90a", "--phase", "decode", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "kernel           sm80.decode\n" in out
    assert "query dtype      bf16" in out and "q_scale applied  no" in out
    assert "sm90.decode is not built yet" in out
    assert main(["plan", "--arch", "sm_90a", "--phase", "decode", "--kv-cache-dtype", "fp8", "--backend",
                 "reference"]) == 0
    assert "kernel           reference.paged_decode (reference fallback)" in capsys.readouterr().out


def test_plan_json_reference_backend(capsys):
    argv = ["plan", "--arch", "sm120", "--phase", "prefill", "--kv-cache-dtype", "fp8",
            "--backend", "reference", "--q-len", "128", "--kv-layout", "NHD", "--json"]
    assert main(argv) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["kernel"] == "reference.paged_prefill" and p["q_dtype"] == "bf16" and p["q_len"] == 128
    assert p["kv_layout"] == "NHD" and p["backend"] == "reference" and p["is_fallback"] is True


def test_plan_unsupported_backend_exits_2(capsys):
    argv = ["plan", "--arch", "sm89", "--phase", "decode", "--kv-cache-dtype", "fp8",
            "--backend", "sm90.decode"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: --backend='sm90.decode' cannot serve this request")
    assert "runs on sm90, not sm89" in captured.err


def test_plan_fp8_query(capsys):
    base = ["plan", "--arch", "sm90", "--phase", "prefill", "--kv-cache-dtype", "fp8", "--query-dtype"]
    assert main(base + ["fp8"]) == 0
    out = capsys.readouterr().out
    assert "kernel           sm90.prefill_fp8q\n" in out and "quantize query   yes" in out
    assert main(base + ["auto"]) == 0
    assert "kernel           sm90.prefill\n" in capsys.readouterr().out
    assert main(["plan", "--arch", "sm89", "--phase", "prefill", "--kv-cache-dtype", "fp8", "--query-dtype", "fp8"]) == 2
    assert "no prefill kernel computes QK in FP8 on sm89" in capsys.readouterr().err


def test_plan_uint8_cache_exits_2(capsys):
    assert main(["plan", "--arch", "sm90", "--phase", "decode", "--kv-cache-dtype", "uint8"]) == 2
    assert "float8_e4m3fn" in capsys.readouterr().err


def test_commands_registered():
    assert {"matrix", "plan"} <= set(COMMANDS)


def test_format_table_aligns_columns():
    text = format_table(["a", "bb", "c"], [["xxx", "y", "long last cell"]])
    lines = text.splitlines()
    assert lines[0] == "a    bb  c" and lines[2] == "xxx  y   long last cell"


def test_python_m_matrix_runs():
    r = subprocess.run([sys.executable, "-m", "cute_kernels", "matrix"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, check=True)
    assert "sm121" in r.stdout and "sm80.decode" in r.stdout


def test_matrix_does_not_import_cutlass_or_torch():
    code = ("import sys; from cute_kernels.cli import main; assert main(['matrix', '--json']) == 0; "
            "bad = [m for m in ('cutlass', 'torch') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
