"""``cute_kernels.qsa_warmup``: precompile every QSA variant a deployment's shapes can reach.

The variants come from the QSA plans (:func:`cute_kernels.plans.sm90_qsa_launch.qsa_variants`:
the per-row kernel per tile of the split table, the merges, the row-tile prefill path); this
compiles the missing ones in parallel processes into the disk cache with a progress bar, and loads
them.
"""

from __future__ import annotations

from typing import Any

from ._facade import make_callable
from .jit.parallel import precompile
from .jit.spec import KernelConfig, normalize_target
from .plans.sm90_qsa_launch import qsa_variants
from .registry import KERNELS, arch_of_target

__all__ = ["qsa_variants", "qsa_warmup"]


def qsa_warmup(*, arch: str | int | tuple[int, int] = "sm_90a", workers: int | None = None, progress: bool = True,
               **shape: Any) -> list[KernelConfig]:
    """Compile (in parallel, into the disk cache) and load every QSA variant for ``shape``.

    ``shape`` takes the keyword arguments of :func:`~cute_kernels.plans.sm90_qsa_launch.qsa_variants`, e.g.
    ``qsa_warmup(head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568, kv_cache_dtype="fp8")``.
    Returns the configs.
    """
    target = normalize_target(arch)
    info = KERNELS["sm90.qsa"]  # the registry says where the kernel runs
    if arch_of_target(target) not in info.archs:
        raise ValueError(f"{info.id} runs on {'/'.join(info.archs)}: nothing to warm up for {target}")
    configs = qsa_variants(**shape)
    precompile(configs, target, workers=workers, progress=progress)
    return configs


make_callable(__name__, qsa_warmup)  # `cute_kernels.qsa_warmup(...)` even after `import cute_kernels.qsa_warmup`
