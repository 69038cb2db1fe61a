"""``cute_kernels.warmup``: precompile the kernel variants a deployment will hit.

Cold variants compile in a few seconds each; a serving engine should not pay that on its first
request (nor inside CUDA-graph capture, where compiling is impossible). This enumerates the
decode variants for a model's shapes (:func:`cute_kernels.plans.sm90_decode.decode_variants`) and
compiles the missing ones in parallel processes into the on-disk cache, with a progress bar, then
loads them into memory.
"""

from __future__ import annotations

from typing import Any

from .jit.parallel import precompile
from .jit.spec import KernelConfig, normalize_target
from .plans.sm90_decode import decode_variants
from .registry import KERNELS, arch_of_target

__all__ = ["decode_variants", "warmup"]


def warmup(*, arch: str | int | tuple[int, int] = "sm_90a", workers: int | None = None, progress: bool = True,
           **shape: Any) -> list[KernelConfig]:
    """Compile (in parallel, into the disk cache) and load every decode variant for ``shape``.

    ``shape`` takes the keyword arguments of :func:`~cute_kernels.plans.sm90_decode.decode_variants`.
    Returns the configs.
    """
    target = normalize_target(arch)
    info = KERNELS["sm90.decode"]  # the registry says where the kernel runs
    if arch_of_target(target) not in info.archs:
        raise ValueError(f"{info.id} runs on {'/'.join(info.archs)}: nothing to warm up for {target}")
    configs: list[KernelConfig] = list(decode_variants(**shape))
    precompile(configs, target, workers=workers, progress=progress)
    return configs
