"""The decode/merge sanitizer driver's named cases without a GPU (profiling/sanitize_decode.py,
profiling/sanitize_cases.sh; docs/design/testing.md#sanitizer): the table imports without loading
an op module, ``--list`` prints every name once, a case draws the same inputs alone or after
another, every case runs on CPU tensors through the float64 reference, and the per-case script
reports one line per case."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from profiling import sanitize_decode as sd

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _table_keys() -> list[str]:
    """The keys as written in the CASES literal (a repeated key would silently replace the first)."""
    tree = ast.parse((ROOT / "profiling" / "sanitize_decode.py").read_text())
    (table,) = [n.value for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "CASES"]
    assert isinstance(table, ast.Dict)
    return [k.value for k in table.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def test_list_prints_every_case_once():
    res = subprocess.run([sys.executable, "-m", "profiling.sanitize_decode", "--list"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    names = res.stdout.split()
    keys = _table_keys()
    assert names == list(sd.CASES) == keys and len(set(keys)) == len(keys)
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", n) for n in names)  # safe in file names and -k
    # the earlier driver's first call and its variants, and the launch the cluster-merge concern was about
    assert {"driver-first", "driver-first-no-override", "driver-first-late-import", "driver-first-no-preamble",
            "driver-first-fresh-draws", "fp8-b1-ctx1000-schedule"} <= set(names)
    assert names[0] == "driver-first"  # a full run begins as the earlier driver did
    assert len({sd.seed_of(n) for n in names}) == len(names)


def test_table_imports_without_an_op_module():
    # the late-import variant is only one if importing the driver loads no op (nor the DSL)
    code = ("import sys, profiling.sanitize_decode as m; assert m.CASES; "
            "print(sorted(x for x in sys.modules if x.startswith(('cute_kernels.ops', 'cutlass'))))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_unknown_case_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        sd.main(["--case", "fp8-global3,no-such-case"])
    assert e.value.code == 2 and "no-such-case" in capsys.readouterr().err


def _recorded(monkeypatch, order: list[str]) -> dict[str, list[float]]:
    """Each case's inputs (a sum per tensor argument) with the ops replaced by a recorder."""
    seen: dict[str, list[float]] = {}
    current: list[str] = []

    def record(*args, **kw):
        ts = [a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)]
        ts += [t for a in args if isinstance(a, tuple) for t in a if isinstance(t, torch.Tensor)]
        seen.setdefault(current[-1], []).extend(float(t.double().nan_to_num().sum()) for t in ts)

    for op in ("paged_decode", "paged_prefill", "merge_states"):
        monkeypatch.setattr(sd.cute_kernels, op, record, raising=False)
    for name in order:
        current.append(name)
        sd.run_case(name, "cpu")
    return seen


def test_a_case_draws_the_same_inputs_alone_or_after_others(monkeypatch, capsys):
    names = ["fp8-global3", "balanced-bf16-q2", "merge-states"]
    forward = _recorded(monkeypatch, names)
    backward = _recorded(monkeypatch, names[::-1])
    assert forward == backward and all(forward[n] for n in names)
    assert _recorded(monkeypatch, ["fp8-nhd-split3"]) != _recorded(monkeypatch, ["fp8-global3"])


def test_driver_first_variants_draw_what_they_say(monkeypatch, capsys):
    """The variants without the override, the early import or the preamble draw the first call's
    inputs exactly; the fresh-draws one draws those of a generator seeded 1 with no draw before."""
    variants = ["driver-first", "driver-first-no-override", "driver-first-late-import", "driver-first-no-preamble",
                "driver-first-fresh-draws"]
    seen = _recorded(monkeypatch, variants)
    assert all(seen[v] == seen["driver-first"] for v in variants[1:4])
    g = torch.Generator().manual_seed(1)
    c = sd._four_requests(sd.Ctx("stand-alone", "cpu", g), g, sd.FP8, "HND")
    # the recorder's sums of the call's leading tensor arguments (the cache is one tensor here)
    sums = [float(t.double().nan_to_num().sum()) for t in (c.q, c.kv_cache, c.block_table, c.seq_lens)]
    assert seen["driver-first-fresh-draws"][:4] == sums != seen["driver-first"][:4]


def test_every_case_runs_through_the_reference(capsys):
    assert sd.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in sd.CASES:
        lines = [ln for ln in out.splitlines() if ln.startswith(f"case {name}: ")]
        assert lines[0].startswith(f"case {name}: start (inputs seed {sd.seed_of(name)})"), name
        assert lines[-1] == f"case {name}: ok", name
        assert any(re.match(rf"case {name}: (paged_decode|paged_prefill|merge_states) ", ln) for ln in lines), name
    assert "case driver-first: pageable host-to-device copy of randperm(50)" in out
    assert "randperm" not in "".join(ln for ln in out.splitlines() if ln.startswith("case driver-first-no-preamble:"))
    assert out.rstrip().endswith("sanitize run finished")


def _stub(tmp_path: Path) -> Path:
    """A stand-in for compute-sanitizer: drops its options, runs the program, prints a clean
    summary, exits with the program's status."""
    stub = tmp_path / "stub-sanitizer"
    stub.write_text('#!/usr/bin/env bash\nwhile [ "$1" != "$STUB_PY" ]; do shift; done\n'
                    '"$@"\nrc=$?\necho "========= ERROR SUMMARY: 0 errors"\nexit $rc\n')
    stub.chmod(0o755)
    return stub


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_per_case_script(tmp_path, device):
    """On CPU tensors every case passes; on CUDA tensors (no GPU here) each fails on its own line."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("the failing run needs a machine without CUDA")
    env = dict(ENV, COMPUTE_SANITIZER=str(_stub(tmp_path)), STUB_PY=sys.executable, PYTHON=sys.executable,
               OUT=str(tmp_path / "out"), CUTE_KERNELS_CACHE_DIR=str(tmp_path / "cache"),
               DRIVER_ARGS=f"--device {device}")
    cases = ["fp8-global3", "merge-states"] if device == "cpu" else ["merge-states"]
    res = subprocess.run(["bash", str(ROOT / "profiling" / "sanitize_cases.sh"), "synccheck",
                          "profiling.sanitize_decode", *cases], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    plain, *lines = res.stdout.splitlines()
    assert [ln.split()[1] for ln in lines] == cases, res.stdout + res.stderr
    assert (tmp_path / "out" / "plain_sanitize_decode.log").exists()
    for name, ln in zip(cases, lines):
        assert (tmp_path / "out" / f"synccheck_sanitize_decode_{name}.log").exists()
        if device == "cpu":
            assert ln == f"case {name} rc 0 errors 0 last: case {name}: ok"
        else:
            assert re.fullmatch(rf"case {name} rc [1-9]\d* errors 0 last: case {name}: .*", ln), ln
            assert not ln.endswith(": ok")
    if device == "cpu":
        assert plain == "plain run rc 0 last: case merge-states: ok" and res.returncode == 0
    else:
        assert re.match(r"plain run rc [1-9]", plain) and res.returncode == 1
