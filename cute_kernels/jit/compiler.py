"""Compile kernel configs for a chosen arch, with an in-memory and an on-disk cache.

Works on a machine with no GPU: the arch is always named explicitly (``--gpu-arch`` and
``CUTE_DSL_ARCH``; without both, a GPU-less DSL silently targets sm_100a) and every argument is a
fake tensor built from the config's signature. Compiled functions use TVM-FFI with the
environment stream, so a call takes torch tensors directly and launches on the current torch
stream (which is what CUDA-graph capture needs).

Disk cache: each compiled variant is exported as an object file under
``$CUTE_KERNELS_CACHE_DIR`` (default ``~/.cache/cute_kernels``), in a folder named by a
fingerprint of this package's sources and the DSL / TVM-FFI / Python versions, so an edit to any
kernel invalidates it. ``CUTE_KERNELS_DISK_CACHE=0`` turns it off. Processes share it (one per GPU
warming up at once): a file is written whole (a temporary file renamed over it), and a variant
missing from it is compiled by one process while the others wait for its file (:mod:`.files`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import files
from .fake import fake_arguments
from .naming import kernel_symbol, named_kernels
from .spec import KernelConfig, normalize_target

_lock = threading.RLock()
_memory: dict[tuple, Any] = {}
# what get_kernel did beyond its in-memory cache: loads from the disk cache and compiles (a warmed-up
# process does neither during a step; tests read these)
stats = {"loaded": 0, "compiled": 0}
_forbidden = 0
# how long a process waits for another one compiling the same variant before compiling it too
COMPILE_LOCK_SECONDS = 900.0


class forbid_compiles:
    """Context manager: any ``get_kernel`` that misses the in-memory cache raises instead of
    loading or compiling (proves that a warmed-up step compiles nothing)."""

    def __enter__(self):
        global _forbidden
        _forbidden += 1
        return self

    def __exit__(self, *exc):
        global _forbidden
        _forbidden -= 1
        return False


@dataclass
class CompiledKernel:
    """A compiled variant with what the compile matrix reports about it."""

    config: KernelConfig
    arch: str
    fn: Any
    seconds: float
    ptx: str | None = None
    sass: str | None = None
    cubin: bytes | None = None  # (with artifacts) for the resource usage the ELF records


def _options(arch: str, dump_dir: str | None) -> str:
    opts = ["--enable-tvm-ffi", f"--gpu-arch {arch}"]
    if dump_dir is not None:
        opts += ["--keep-ptx", "--keep-cubin", f"--dump-dir {dump_dir}"]
    return " ".join(opts)


@lru_cache(maxsize=1)
def nvdisasm_path() -> str | None:
    """SASS needs an nvdisasm at least as new as the DSL's CUDA (the nvidia-cuda-nvdisasm wheel)."""
    try:
        from cutlass.base_dsl.env_manager import _find_nvdisasm_binary

        return str(_find_nvdisasm_binary())
    except Exception:
        return None


def _disassemble(cubin, workdir: str) -> str | None:
    """SASS of a cubin (bytes or a path), or None without a usable nvdisasm."""
    tool = nvdisasm_path()
    if tool is None or not cubin:
        return None
    if isinstance(cubin, bytes):
        path = os.path.join(workdir, "kernel.cubin")
        Path(path).write_bytes(cubin)
    elif isinstance(cubin, str) and os.path.isfile(cubin):
        path = cubin
    else:
        return None
    import subprocess

    res = subprocess.run([tool, "-c", path], capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else None


def compile_config(config: KernelConfig, arch: str, *, artifacts: bool = False) -> CompiledKernel:
    """Compile ``config`` for ``arch`` (no cache). With ``artifacts``, keep PTX (and SASS)."""
    import cutlass.cute as cute

    arch = normalize_target(arch)
    if arch not in config.targets:
        raise ValueError(f"{config.kernel_id} does not compile for {arch}; targets: {config.targets}")
    with _lock:
        os.environ.setdefault("CUTE_DSL_ARCH", arch)
        previous = os.environ["CUTE_DSL_ARCH"]
        os.environ["CUTE_DSL_ARCH"] = arch
        dump = tempfile.mkdtemp(prefix="cute_kernels_") if artifacts else None
        try:
            args = fake_arguments(config.signature())
            stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
            kernel = config.build()
            t0 = time.perf_counter()
            with named_kernels(kernel, kernel_symbol(config)):  # readable names in profiles
                fn = cute.compile(kernel, *args, stream, options=_options(arch, dump))
            seconds = time.perf_counter() - t0
            if "TVMFFI" not in type(fn).__name__:
                raise RuntimeError(f"expected a TVM-FFI function, got {type(fn).__name__}")
            ptx = sass = cubin = None
            if artifacts:
                ptx = _read_artifact(fn.__ptx__)
                cubin = _read_binary(fn.__cubin__)
                sass = _disassemble(cubin, dump)
        finally:
            os.environ["CUTE_DSL_ARCH"] = previous
            if dump is not None:
                shutil.rmtree(dump, ignore_errors=True)
    return CompiledKernel(config, arch, fn, seconds, ptx, sass, cubin)


def _read_binary(value) -> bytes | None:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and os.path.isfile(value):
        return Path(value).read_bytes()
    return None


def _read_artifact(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and os.path.isfile(value):
        return Path(value).read_text()
    return value if isinstance(value, str) else None


# --------------------------------------------------------------------------------------------
# cached entry point used by the ops
# --------------------------------------------------------------------------------------------


def get_kernel(config: KernelConfig, arch: str):
    """The compiled function for ``config`` on ``arch``: memory, then disk, then compile."""
    key = (config, arch)
    fn = _memory.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _memory.get(key)
        if fn is not None:
            return fn
        if _forbidden:
            raise RuntimeError(f"{config.label()} for {arch} is not loaded, and compiles are forbidden here "
                               "(a warm-up should have compiled it)")
        path = _disk_path(config, arch)
        fn = _load_cached(path)
        if fn is None:
            # one process compiles a variant, the others (a tensor-parallel group warming up at once)
            # wait for its file and load it (docs/design/multi-gpu.md#the-disk-cache)
            with files.locked(path, COMPILE_LOCK_SECONDS) if path is not None else contextlib.nullcontext():
                fn = _load_cached(path)
                if fn is None:
                    compiled = compile_config(config, arch)
                    stats["compiled"] += 1
                    if path is not None:
                        _store_object(compiled.fn, path)
                    fn = _bare_function(compiled.fn)
        _memory[key] = fn
        return fn


def _load_cached(path: Path | None):
    """The function of the object file at ``path``, or None (no file, or one that does not load)."""
    if path is None or not path.exists():
        return None
    try:
        fn = _load_object(path)
    except Exception:
        return None
    stats["loaded"] += 1
    return fn


def _bare_function(fn):
    """The ``tvm_ffi.Function`` inside a freshly compiled DSL function.

    ``cute.compile`` returns a Python wrapper whose ``__call__`` routes positional arguments
    through a generated keyword-argument adapter before the TVM-FFI call: host time on every
    launch that the ops, which pass positional arguments in signature order, do not need. A
    function loaded from the disk cache is already bare, so both paths now call the same thing.
    The wrapper owns the JIT engine that holds the code: it is kept alive with the modules.
    """
    bare = getattr(fn, "__tvm_ffi_object__", None)
    bare = bare() if callable(bare) else None
    if bare is None:
        return fn
    _loaded_modules.append(fn)
    return bare


def is_cached(config: KernelConfig, arch: str) -> bool:
    if (config, arch) in _memory:
        return True
    path = _disk_path(config, arch)
    return path is not None and path.exists()


def clear_memory_cache() -> None:
    _memory.clear()


def cache_dir() -> Path | None:
    if os.environ.get("CUTE_KERNELS_DISK_CACHE", "1") == "0":
        return None
    root = os.environ.get("CUTE_KERNELS_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "cute_kernels"
    )
    return Path(root) / _fingerprint()


@lru_cache(maxsize=1)
def _fingerprint() -> str:
    import cutlass

    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parents[1]
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode())
        h.update(f.read_bytes())
    try:
        import tvm_ffi

        tvm_version = getattr(tvm_ffi, "__version__", "?")
    except Exception:
        tvm_version = "none"
    h.update(f"{getattr(cutlass, '__version__', '?')}|{tvm_version}|{sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def _disk_path(config: KernelConfig, arch: str) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    digest = hashlib.sha256(repr((config, arch)).encode()).hexdigest()[:24]
    return root / f"{config.kernel_id}-{arch}-{digest}.o"


_FUNCTION_NAME = "cute_kernels_entry"
_runtime_loaded = False
_loaded_modules: list = []  # loaded modules and compiled wrappers: they own the code of the functions in use


def _load_object(path: Path):
    global _runtime_loaded
    import cutlass.cute as cute

    if not _runtime_loaded:
        # Exported objects reference the DSL runtime; make its symbols global before the first
        # load, or a process that has not compiled anything yet fails to resolve them.
        for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True):
            if os.path.exists(lib):
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        _runtime_loaded = True
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    _loaded_modules.append(module)  # the function's code lives as long as its module
    return getattr(module, _FUNCTION_NAME)


def _store_object(fn, path: Path) -> None:
    try:  # atomic: concurrent writers and readers see one whole file, never a part of one
        files.write_atomic(path, lambda tmp: fn.export_to_c(tmp, function_name=_FUNCTION_NAME))
    except Exception:
        pass  # the disk cache is an optimisation; the in-memory function is already usable
