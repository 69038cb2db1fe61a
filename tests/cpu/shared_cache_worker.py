"""One process of tests/cpu/test_shared_cache.py: several of these run at once against one cache
folder, each waiting for a common start time. Prints one JSON line (its counts) on stdout.

``python -m tests.cpu.shared_cache_worker MODE ...``:

- ``store PATH ID N START``: N times, the real store path (``compiler._store_object``) with a fake
  exported object whose export writes a checksummed payload in chunks, slowly (a writer in place
  would leave a part of it visible);
- ``naive PATH ID N START``: the same payloads written in place (the control: readers must see
  torn files);
- ``read PATH STOP``: reads the file again and again until the file STOP exists, counting whole
  and torn reads;
- ``records ID N START``: N self-check records stored through ``selfcheck_records.store``;
- ``fake-compile START``: ``get_kernel`` of one variant with the compile replaced by a slow fake
  (counts compiles and loads);
- ``compile START``: ``get_kernel`` of a real, cheap variant (``merge_states``) for sm_90a;
- ``load PATH``: loads an object file of the disk cache as a fresh process would.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import time
from pathlib import Path

MAGIC = b"CKP1"
CHUNKS, CHUNK_BYTES, CHUNK_SLEEP = 8, 1 << 17, 0.003


def payload(writer: int, iteration: int) -> bytes:
    body = hashlib.sha256(f"{writer}/{iteration}".encode()).digest() * (CHUNKS * CHUNK_BYTES // 32)
    head = MAGIC + struct.pack("<IIQ", writer, iteration, len(body))
    return head + body + hashlib.sha256(head + body).digest()


def whole(data: bytes) -> bool:
    """A complete payload of one writer (header, body of the stated length, checksum)."""
    if len(data) < 52 or data[:4] != MAGIC:
        return False
    _, _, n = struct.unpack("<IIQ", data[4:20])
    return len(data) == 20 + n + 32 and hashlib.sha256(data[:-32]).digest() == data[-32:]


def write_slowly(path: str, data: bytes) -> None:
    step = -(-len(data) // CHUNKS)
    with open(path, "wb") as f:
        for i in range(0, len(data), step):
            f.write(data[i:i + step])
            f.flush()
            time.sleep(CHUNK_SLEEP)


class FakeExported:
    """Stands for a compiled DSL function: ``export_to_c`` writes an object file, slowly."""

    def __init__(self, data: bytes):
        self.data = data

    def export_to_c(self, path, function_name=None):
        write_slowly(path, self.data)


def wait(start: float) -> None:
    time.sleep(max(0.0, start - time.time()))


def main(argv: list[str]) -> dict:
    mode = argv[0]
    if mode in ("store", "naive"):
        from cute_kernels.jit import compiler

        path, writer, n, start = Path(argv[1]), int(argv[2]), int(argv[3]), float(argv[4])
        wait(start)
        for it in range(n):
            data = payload(writer, it)
            if mode == "store":
                compiler._store_object(FakeExported(data), path)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_slowly(str(path), data)
        return {"writes": n}
    if mode == "read":
        path, stop = Path(argv[1]), Path(argv[2])
        reads = torn = 0
        while not stop.exists():
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            reads += 1
            torn += not whole(data)
        return {"reads": reads, "torn": torn}
    if mode == "records":
        from cute_kernels.plans import selfcheck_records as records

        writer, n, start = int(argv[1]), int(argv[2]), float(argv[3])
        wait(start)
        for i in range(n):
            records.store(records.CheckRecord(family=f"fam{i}", device=f"gpu{writer}", ok=True, reason="",
                                              seconds=0.0, when=time.time()))
        return {"stored": n}
    if mode == "fake-compile":
        from cute_kernels.jit import compiler
        from cute_kernels.plans.merge_states import MergeStatesConfig

        start = float(argv[1])

        def slow_compile(config, arch):
            time.sleep(1.0)
            return compiler.CompiledKernel(config, arch, FakeExported(payload(0, 0)), 1.0)

        compiler.compile_config = slow_compile
        compiler._load_object = lambda path: ("loaded", whole(path.read_bytes()))
        compiler._bare_function = lambda fn: ("compiled", True)
        wait(start)
        fn = compiler.get_kernel(MergeStatesConfig(out_dtype="fp32", head_dim=128, vec=4), "sm_90a")
        return {"how": fn[0], "whole": fn[1], **compiler.stats}
    if mode == "compile":
        from cute_kernels.jit import compiler
        from cute_kernels.plans.merge_states import MergeStatesConfig

        start = float(argv[1])
        wait(start)
        t0 = time.time()
        fn = compiler.get_kernel(MergeStatesConfig(out_dtype="fp32", head_dim=128, vec=4), "sm_90a")
        return {"callable": callable(fn), "seconds": round(time.time() - t0, 2), **compiler.stats}
    if mode == "load":
        from cute_kernels.jit import compiler

        fn = compiler._load_object(Path(argv[1]))
        return {"callable": callable(fn)}
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
