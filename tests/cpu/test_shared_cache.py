"""The disk cache and the self-check records shared by processes working at the same time (one per
GPU of a tensor-parallel group warming up at once: docs/design/multi-gpu.md#the-disk-cache).

Several processes (tests/cpu/shared_cache_worker.py) start together against one folder:

- writers replace one object file again and again through the compiler's store path while readers
  read it: every read is one writer's whole file, and no temporary file is left; the same writes
  done in place (the control) are seen torn, so the readers would notice;
- processes store self-check records at once: every record is in the file at the end;
- two processes miss the same variant at once: one compiles it, the other waits and loads its file
  (a fake compile here; the real one, marked ``compile``: two processes compile a cheap variant
  at once and a third loads the file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _spawn(cache: Path, *args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "CUTE_KERNELS_CACHE_DIR": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "tests.cpu.shared_cache_worker", *map(str, args)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _results(procs, timeout: float = 300) -> list[dict]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _race(tmp_path: Path, mode: str, writers: int = 3, writes: int = 6) -> tuple[list[dict], Path]:
    path, stop = tmp_path / "cache" / "variant.o", tmp_path / "stop"
    start = time.time() + 4.0  # every process imported and waiting
    procs = [_spawn(tmp_path, mode, path, w, writes, start) for w in range(writers)]
    readers = [_spawn(tmp_path, "read", path, stop) for _ in range(2)]
    try:
        _results(procs)
    finally:
        stop.touch()
    return _results(readers), path


def test_concurrent_stores_leave_whole_files(tmp_path):
    from tests.cpu.shared_cache_worker import whole

    reads, path = _race(tmp_path, "store")
    assert sum(r["reads"] for r in reads) > 0, "the readers never saw the file"
    assert sum(r["torn"] for r in reads) == 0, f"a reader saw a part of a file: {reads}"
    assert whole(path.read_bytes())
    assert [p.name for p in path.parent.iterdir() if p.name != path.name] == [], "a temporary file was left"


def test_in_place_writes_are_seen_torn(tmp_path):
    """The control: the readers above would see a file written in place."""
    reads, _ = _race(tmp_path, "naive")
    assert sum(r["torn"] for r in reads) > 0, f"the readers saw no torn file: {reads}"


def test_a_failed_export_leaves_no_temporary_file(tmp_path):
    from cute_kernels.jit import compiler

    class Broken:
        def export_to_c(self, path, function_name=None):
            Path(path).write_bytes(b"half")
            raise RuntimeError("export failed")

    path = tmp_path / "variant.o"
    compiler._store_object(Broken(), path)  # best effort: the error is swallowed
    assert list(tmp_path.iterdir()) == []


def test_concurrent_self_check_records_are_all_kept(tmp_path):
    from cute_kernels.plans.selfcheck_records import CheckRecord

    start = time.time() + 4.0
    writers, n = 4, 12
    _results([_spawn(tmp_path, "records", w, n, start) for w in range(writers)])
    data = json.loads((tmp_path / "selfcheck.json").read_text())
    assert sorted(data) == sorted(f"fam{i}@gpu{w}" for w in range(writers) for i in range(n))
    assert all(CheckRecord(**v).ok for v in data.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["selfcheck.json", "selfcheck.json.lock"]


def test_one_process_compiles_a_variant_the_others_load_it(tmp_path):
    start = time.time() + 4.0
    results = _results([_spawn(tmp_path, "fake-compile", start) for _ in range(2)])
    assert sorted(r["how"] for r in results) == ["compiled", "loaded"], results
    assert all(r["whole"] for r in results)
    assert sum(r["compiled"] for r in results) == 1 and sum(r["loaded"] for r in results) == 1


@pytest.mark.compile
def test_two_processes_compiling_one_variant_leave_a_loadable_file(tmp_path):
    start = time.time() + 6.0
    results = _results([_spawn(tmp_path, "compile", start) for _ in range(2)])
    assert all(r["callable"] for r in results)
    assert sorted((r["compiled"], r["loaded"]) for r in results) == [(0, 1), (1, 0)], results
    objects = list(tmp_path.rglob("*.o"))
    assert len(objects) == 1 and not list(tmp_path.rglob("*.tmp"))
    assert _results([_spawn(tmp_path, "load", objects[0])])[0]["callable"]
