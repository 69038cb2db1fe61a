"""``cute_kernels.warmup``: precompile the kernel variants a deployment will hit.

Cold variants compile in a few seconds each; a serving engine should not pay that on its first
request (nor inside CUDA-graph capture, where compiling is impossible). This enumerates, per cache
dtype, the decode variants for a model's shapes on the kernel ``paged_decode`` runs there (the
registry's choice: :func:`cute_kernels.plans.sm90_decode.decode_variants` on SM90,
:func:`cute_kernels.plans.sm80.decode_variants` where the portable kernel runs; ``sm100.decode``
has no list, its first call compiles) and the prefill variants ``AttentionLayer`` can launch for
them (:func:`cute_kernels.plans.sm90_prefill.prefill_variants`,
:func:`cute_kernels.plans.sm80_matrix.prefill_variants`), compiles the missing ones in parallel processes
into the on-disk cache, with a progress bar, then loads them into memory. On a GPU of the target
arch it also runs the SM90 prefill kernel's one-time runtime self-check of each variant family
while the registry lists that kernel as compile-verified (it synchronizes, so it must not first
happen inside CUDA-graph capture; an available kernel needs none).
"""

from __future__ import annotations

from typing import Any

from ._facade import make_callable
from .jit.parallel import precompile
from .jit.spec import KernelConfig, normalize_target
from .plans import sm80, sm80_matrix
from .plans.args import (
    check_choices,
    check_flags,
    check_layer_shape,
    check_positive_ints,
    check_sequence,
    check_workers,
)
from .plans.sm90_attention import KV_FORMS, KV_LAYOUTS
from .plans.sm90_decode import decode_variants
from .plans.sm90_prefill import Q_SCALE_KINDS, Sm90PrefillConfig, prefill_variants
from .registry import op_kernel

__all__ = ["decode_variants", "prefill_variants", "warmup"]

# keyword arguments of prefill_variants that decode_variants does not take, and those both take
_PREFILL_ONLY = ("fp8_query", "q_scale_kinds", "causal", "return_lse")
_SHARED = ("head_dim", "num_q_heads", "num_kv_heads", "page_size", "q_dtype", "scale_tensors", "kv_layouts",
           "kv_forms")
_KV_NAMES = {"fp8": "fp8_e4m3"}


def warmup(*, arch: str | int | tuple[int, int] = "sm_90a", workers: int | None = None,
           progress: bool = True, prefill: bool = True, kv_dtypes: tuple[str, ...] = ("fp8_e4m3",),
           **shape: Any) -> list[KernelConfig]:
    """Compile (in parallel, into the disk cache) and load every decode variant for ``shape`` and,
    with ``prefill``, every prefill variant the layer can launch for it; on a GPU of ``arch``, run
    the SM90 prefill variants' self-checks (those the registry still lists as compile-verified).

    ``shape`` takes the keyword arguments of :func:`~cute_kernels.plans.sm90_decode.decode_variants`
    and the prefill-only ones of :func:`~cute_kernels.plans.sm90_prefill.prefill_variants`
    (``fp8_query=True`` when the prefill plan computes QK in FP8: ``backend="sm90.prefill_fp8q"``;
    ``q_scale_kinds``, ``causal``, ``return_lse``). Returns the configs.
    """
    target = normalize_target(arch)
    kv_dtypes = check_choices("kv_dtypes", kv_dtypes, ("fp8", "fp8_e4m3", "bf16", "fp16"))
    check_layer_shape(**{k: shape.get(k) for k in ("head_dim", "num_q_heads", "num_kv_heads", "page_size")})
    _check_options(shape, prefill=prefill, progress=progress, workers=workers)
    prefill_only = {k: shape.pop(k) for k in _PREFILL_ONLY if k in shape}
    q_dtype = shape.get("q_dtype", "bf16")
    configs: list[KernelConfig] = []
    sm90_prefill_kvs: list[str] = []
    sm80_prefill_kvs: list[str] = []
    for kv in (_KV_NAMES.get(kv, kv) for kv in kv_dtypes):
        kernel = op_kernel("paged_decode", "decode", target, q_dtype, kv).id  # raises where none runs
        if kernel == "sm90.decode":
            configs += decode_variants(kv_dtypes=(kv,), **shape)
        elif kernel == "sm80.decode":
            configs += [c for c in sm80.decode_variants(target=target, kv_dtypes=(kv,), **shape) if c not in configs]
        else:
            raise ValueError(f"{kernel} has no warm-up list: nothing to warm up for {target}")
        if prefill:
            kernel = op_kernel("paged_prefill", "prefill", target, q_dtype, kv).id
            if kernel not in ("sm80.prefill", "sm90.prefill", "sm90.prefill_fp8q"):
                raise ValueError(f"{kernel} has no warm-up list: nothing to warm up for {target}")
            (sm80_prefill_kvs if kernel == "sm80.prefill" else sm90_prefill_kvs).append(kv)
    shared = {k: v for k, v in shape.items() if k in _SHARED}
    prefill_configs: list[Sm90PrefillConfig] = []
    if sm90_prefill_kvs:
        prefill_configs = prefill_variants(kv_dtypes=tuple(sm90_prefill_kvs), **shared, **prefill_only)
    portable = {k: v for k, v in prefill_only.items() if k in ("causal", "return_lse")}
    if sm80_prefill_kvs:
        configs += sm80_matrix.prefill_variants(target=target, kv_dtypes=tuple(sm80_prefill_kvs), **shared, **portable)
    precompile([*configs, *prefill_configs], target, workers=workers, progress=progress)
    _self_check(prefill_configs, target)
    return [*configs, *prefill_configs]


# the option lists the variant enumerations take, and their members
_CHOICES = {"scale_tensors": (False, True), "kv_layouts": KV_LAYOUTS, "kv_forms": KV_FORMS, "causal": (False, True),
            "return_lse": (False, True), "q_scale_kinds": Q_SCALE_KINDS}


def _check_options(shape: dict, *, prefill: Any, progress: Any, workers: Any) -> None:
    """The flags and option lists of a warm-up call, named before any variant is built (a bare
    string would be enumerated letter by letter, a truthy non-bool would compile a variant keyed
    on it); the lists are replaced by tuples in ``shape``."""
    check_flags(prefill=prefill, progress=progress, fp8_query=shape.get("fp8_query", False))
    check_workers(workers)
    for name, allowed in _CHOICES.items():
        if name in shape:
            shape[name] = check_choices(name, shape[name], allowed)
    if "q_lens" in shape:
        q_lens = check_sequence("q_lens", shape["q_lens"], "positive ints")
        if not q_lens:
            raise ValueError("q_lens must hold one or more positive ints, got ()")
        check_positive_ints(**{f"q_lens[{i}]": n for i, n in enumerate(q_lens)})
        shape["q_lens"] = q_lens


def _self_check(configs: list[Sm90PrefillConfig], target: str) -> None:
    """The SM90 prefill kernel's runtime self-check of each family (none while the registry lists
    it as available), on the current GPU when it is one of ``target`` (a CPU-only machine only
    compiles)."""
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


make_callable(__name__, warmup)  # `cute_kernels.warmup(...)` even after `import cute_kernels.warmup`
