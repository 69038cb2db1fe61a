"""Self-check records (host-only): the outcome of the one-time runtime check of a kernel family
that was only compile-verified for the machine's arch, kept in memory for the process and on disk
for ``cute-kernels plan`` on the same machine.

A record is keyed by the kernel family (e.g. ``"sm100.decode/f16"``) and the device name; the file
lives in the kernel cache folder (``$CUTE_KERNELS_CACHE_DIR`` or ``~/.cache/cute_kernels``) as
``selfcheck.json``. Imports neither torch nor the DSL: dispatch reads it to plan.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..jit import files


@dataclass(frozen=True)
class CheckRecord:
    family: str
    device: str
    ok: bool
    reason: str  # "" when ok; else what failed (case, error or the largest deviation)
    seconds: float
    when: float  # time.time() of the check


_memory: dict[tuple[str, str], CheckRecord] = {}
LOCK_SECONDS = 30.0  # the longest wait for another process's update of the file


def records_path() -> Path | None:
    if os.environ.get("CUTE_KERNELS_DISK_CACHE", "1") == "0":
        return None
    root = os.environ.get("CUTE_KERNELS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                     "cute_kernels")
    return Path(root) / "selfcheck.json"


def _load_file() -> dict[str, dict]:
    path = records_path()
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def lookup(family: str, device: str | None = None) -> CheckRecord | None:
    """This process's record of ``family`` on ``device`` (any device when None), else the last
    one written on this machine."""
    for (fam, dev), rec in _memory.items():
        if fam == family and (device is None or dev == device):
            return rec
    for value in _load_file().values():
        try:
            rec = CheckRecord(**value)
        except TypeError:
            continue
        if rec.family == family and (device is None or rec.device == device):
            return rec
    return None


def store(record: CheckRecord) -> None:
    """Keep ``record`` for this process and write it to the machine's file (best effort). The
    processes of a tensor-parallel group store their devices' records at once: the file's
    read-modify-write holds its lock, and the file is replaced whole (:mod:`cute_kernels.jit.files`)."""
    _memory[(record.family, record.device)] = record
    path = records_path()
    if path is None:
        return
    try:
        with files.locked(path, LOCK_SECONDS):
            data = _load_file()
            data[f"{record.family}@{record.device}"] = asdict(record)
            text = json.dumps(data, indent=1, sort_keys=True)
            files.write_atomic(path, lambda tmp: Path(tmp).write_text(text))
    except OSError:
        pass  # the in-process record still holds


def in_process(family: str, device: str) -> CheckRecord | None:
    return _memory.get((family, device))


def forget(family: str | None = None) -> None:
    """Drop in-process records (tests; a family re-checks on its next use)."""
    for key in [k for k in _memory if family is None or k[0] == family]:
        del _memory[key]


def describe(family: str) -> str:
    """One sentence for ``cute-kernels plan``: the family's self-check state on this machine."""
    rec = lookup(family)
    if rec is None:
        return f"{family} has not run its self-check on this machine yet (it runs on first use)"
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.when))
    if rec.ok:
        return f"{family} passed its self-check on {rec.device} ({stamp})"
    return f"{family} FAILED its self-check on {rec.device} ({stamp}): {rec.reason}; the reference runs instead"
