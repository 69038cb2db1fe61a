"""``cute_kernels.warmup``: precompile the kernel variants a deployment will hit.

Cold variants compile in a few seconds each; a serving engine should not pay that on its first
request (nor inside CUDA-graph capture, where compiling is impossible). This enumerates the
decode variants for a model's shapes on the arch's decode kernel (the registry's choice, as
``paged_decode`` makes it: :func:`cute_kernels.plans.sm90_decode.decode_variants` on SM90,
:func:`cute_kernels.plans.sm80.decode_variants` where the portable kernel runs; ``sm100.decode``
has none, its first call compiles)
and compiles the missing ones in parallel processes into the on-disk cache, with a progress bar,
then loads them into memory.
"""

from __future__ import annotations

from .jit.parallel import precompile
from .jit.spec import KernelConfig, normalize_target
from .plans import sm80
from .plans.sm90_decode import decode_variants
from .registry import op_kernel

__all__ = ["decode_variants", "warmup"]

_KV_NAMES = {"fp8": "fp8_e4m3"}


def warmup(*, arch="sm_90a", workers: int | None = None, progress: bool = True, kv_dtypes=("fp8_e4m3",),
           q_dtype: str = "bf16", **shape) -> list[KernelConfig]:
    """Compile (in parallel, into the disk cache) and load every decode variant for ``shape``.

    ``shape`` takes the other keyword arguments of
    :func:`~cute_kernels.plans.sm90_decode.decode_variants`. Returns the configs.
    """
    target = normalize_target(arch)
    configs: list[KernelConfig] = []
    for kv in (_KV_NAMES.get(kv, kv) for kv in kv_dtypes):
        kernel = op_kernel("paged_decode", "decode", target, q_dtype, kv).id  # raises where none runs
        if kernel == "sm90.decode":
            configs += decode_variants(kv_dtypes=(kv,), q_dtype=q_dtype, **shape)
        elif kernel == "sm80.decode":
            configs += [c for c in sm80.decode_variants(target=target, kv_dtypes=(kv,), q_dtype=q_dtype, **shape)
                        if c not in configs]
        else:
            raise ValueError(f"{kernel} has no warm-up list: nothing to warm up for {target}")
    precompile(configs, target, workers=workers, progress=progress)
    return configs
