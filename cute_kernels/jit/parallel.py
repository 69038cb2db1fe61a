"""Compile many kernel variants in parallel processes, filling the on-disk cache.

``cute.compile`` is not thread-safe, so parallelism means processes. Workers are started with
``spawn`` (never fork a process that may hold a CUDA context) and never touch the GPU: they only
compile for the named target and export object files; the caller then loads them from disk.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from .compiler import cache_dir, get_kernel, is_cached
from .spec import KernelConfig


def _compile_one(args):
    config, arch = args
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    t0 = time.perf_counter()
    get_kernel(config, arch)
    return config, time.perf_counter() - t0


def precompile(configs: list[KernelConfig], arch: str, *, workers: int | None = None,
               progress: bool = True, load: bool = True) -> dict:
    """Compile every config missing from the cache; return ``{config: seconds}`` of those built.

    With ``load``, every config is then loaded into this process's memory cache.
    """
    todo = [c for c in dict.fromkeys(configs) if not is_cached(c, arch)]
    built: dict = {}
    if todo and cache_dir() is not None:
        workers = workers or max(1, min(len(todo), (os.cpu_count() or 2) - 1, 16))
        if workers > 1 and len(todo) > 1:
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
                for i, (config, secs) in enumerate(pool.map(_compile_one, [(c, arch) for c in todo]), 1):
                    built[config] = secs
                    _progress(progress, i, len(todo), config)
            todo = []
    for i, config in enumerate(todo, 1):  # no disk cache or a single variant: compile here
        _, secs = _compile_one((config, arch))
        built[config] = secs
        _progress(progress, i, len(todo), config)
    if load:
        for config in configs:
            get_kernel(config, arch)
    return built


def _progress(enabled: bool, i: int, n: int, config: KernelConfig) -> None:
    if not enabled:
        return
    width = 30
    done = int(width * i / n)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {config.kernel_id:<20}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()
