"""Files that several processes share (host-only: neither torch nor the DSL): the compiled-kernel
cache and the self-check records. Serving engines start one process per GPU, and each warms up
the same variants at the same time (docs/design/multi-gpu.md#the-disk-cache).

- :func:`write_atomic`: a reader sees the old file or the new one whole, never a part (a temporary
  file in the same folder, renamed over the target; removed when writing fails).
- :func:`locked`: an exclusive advisory lock (``flock``) on ``<path>.lock``, for a
  read-modify-write (the records) or to compile a variant once while the other processes wait and
  load it. The kernel releases it when its process dies. Where ``fcntl`` is missing it is a no-op:
  the writes stay whole, a concurrent update may then be lost.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


def write_atomic(path: Path, write: Callable[[str], object]) -> None:
    """``write(tmp)`` writes the content to the temporary path ``tmp``; it then replaces ``path``
    in one rename. Raises what ``write`` raised (after removing the temporary file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # a fresh name in the target's folder (a rename within one file system is atomic), created with
    # the umask's permissions, as the final file would be (tempfile.mkstemp makes it 0600)
    tmp = str(path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: Path, timeout: float) -> Iterator[bool]:
    """Hold the exclusive lock of ``path`` (the file ``<path>.lock``) while the block runs; yields
    whether it holds it. After ``timeout`` seconds of waiting (a holder stopped in a debugger, a
    file system without locks) the block runs without it: writes stay whole, only the exclusion
    is lost."""
    fd = None
    if fcntl is not None:
        try:
            lock = path.with_name(path.name + ".lock")
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            fd = None
    held = False
    try:
        deadline = time.monotonic() + timeout
        while fd is not None and not held:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except OSError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        yield held
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock
