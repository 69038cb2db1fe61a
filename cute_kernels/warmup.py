"""``cute_kernels.warmup``: precompile the kernel variants a deployment will hit.

Cold variants compile in a few seconds each; a serving engine should not pay that on its first
request (nor inside CUDA-graph capture, where compiling is impossible). This enumerates the
decode variants for a model's shapes (:func:`cute_kernels.plans.sm90_decode.decode_variants`) and
the prefill variants ``AttentionLayer`` can launch for them
(:func:`cute_kernels.plans.sm90_prefill.prefill_variants`), compiles the missing ones in parallel
processes into the on-disk cache, with a progress bar, then loads them into memory. On a GPU of
the target arch it also runs the prefill kernel's one-time runtime self-check of each variant
family (it synchronizes, so it must not first happen inside CUDA-graph capture).
"""

from __future__ import annotations

from typing import Any

from .jit.parallel import precompile
from .jit.spec import KernelConfig, normalize_target
from .plans.sm90_decode import decode_variants
from .plans.sm90_prefill import Sm90PrefillConfig, prefill_variants
from .registry import KERNELS, arch_of_target

__all__ = ["decode_variants", "prefill_variants", "warmup"]

# keyword arguments of prefill_variants that decode_variants does not take, and those both take
_PREFILL_ONLY = ("fp8_query", "q_scale_kinds", "causal", "return_lse")
_SHARED = ("head_dim", "num_q_heads", "num_kv_heads", "page_size", "kv_dtypes", "q_dtype", "scale_tensors",
           "kv_layouts", "kv_forms")


def warmup(*, arch: str | int | tuple[int, int] = "sm_90a", workers: int | None = None, progress: bool = True,
           prefill: bool = True, **shape: Any) -> list[KernelConfig]:
    """Compile (in parallel, into the disk cache) and load every decode variant for ``shape`` and,
    with ``prefill``, every prefill variant the layer can launch for it; on a GPU of ``arch``, run
    the prefill variants' self-checks.

    ``shape`` takes the keyword arguments of :func:`~cute_kernels.plans.sm90_decode.decode_variants`
    and the prefill-only ones of :func:`~cute_kernels.plans.sm90_prefill.prefill_variants`
    (``fp8_query=True`` when the prefill plan computes QK in FP8: ``backend="sm90.prefill_fp8q"``;
    ``q_scale_kinds``, ``causal``, ``return_lse``). Returns the configs.
    """
    target = normalize_target(arch)
    info = KERNELS["sm90.decode"]  # the registry says where the kernels run
    if arch_of_target(target) not in info.archs:
        raise ValueError(f"{info.id} runs on {'/'.join(info.archs)}: nothing to warm up for {target}")
    prefill_only = {k: shape.pop(k) for k in _PREFILL_ONLY if k in shape}
    configs: list[KernelConfig] = list(decode_variants(**shape))
    prefill_configs: list[Sm90PrefillConfig] = []
    if prefill and arch_of_target(target) in KERNELS["sm90.prefill"].archs:
        prefill_configs = prefill_variants(**{k: v for k, v in shape.items() if k in _SHARED}, **prefill_only)
    precompile([*configs, *prefill_configs], target, workers=workers, progress=progress)
    _self_check(prefill_configs, target)
    return [*configs, *prefill_configs]


def _self_check(configs: list[Sm90PrefillConfig], target: str) -> None:
    """The prefill kernel's runtime self-check of each family, on the current GPU when it is one of
    ``target`` (a CPU-only machine only compiles)."""
    if not configs:
        return
    import torch

    from .ops._torch import compile_target
    from .ops.paged_prefill import self_check_passes

    if not torch.cuda.is_available():
        return
    device = torch.device("cuda", torch.cuda.current_device())
    if compile_target(device) != target:
        return
    for config in configs:  # one check per family: later ones find its record
        self_check_passes(config, device)
