"""``cute_kernels.warmup``: precompile the kernel variants a deployment will hit.

Cold variants compile in a few seconds each; a serving engine should not pay that on its first
request (nor inside CUDA-graph capture, where compiling is impossible). This enumerates the
decode variants for a model's shapes and compiles the missing ones in parallel processes into
the on-disk cache, with a progress bar, then loads them into memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import product
from typing import Any

from .jit.compiler import KernelConfig, normalize_target
from .jit.parallel import precompile
from .sm90.decode import CLUSTER_MIN_SIZING, DEFAULT_CLUSTER, cluster_fits, make_decode_config


def decode_variants(
    *,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    kv_dtypes: Sequence[str] = ("fp8_e4m3",),
    q_dtype: str = "bf16",
    q_lens: Sequence[int] = (1,),
    scale_tensors: Sequence[bool] = (False, True),
    kv_layouts: Sequence[str] = ("HND",),
    kv_forms: Sequence[str] = ("single",),
    **override: Any,
) -> list[KernelConfig]:
    """Every SM90 decode config (split and not) that a model shape can reach.

    ``kv_forms``: ``"single"`` for one ``[P, 2, ...]`` cache tensor, ``"pair"`` for a (K, V) tuple.
    The op sizes a kernel for the CTAs per SM a call produces (1 up to the variant's maximum,
    depending on batch and context), so each of those occupancies is a variant too; a split
    config sized for at least CLUSTER_MIN_SIZING CTAs per SM comes with its cluster-merge form as
    well (splits of at most MAX_CLUSTER CTAs).
    """
    group = num_q_heads // num_kv_heads
    want_cluster = override.pop("cluster", DEFAULT_CLUSTER)
    out: list[KernelConfig] = []
    for kv, q_len, split, st, layout, form in product(kv_dtypes, q_lens, (False, True), scale_tensors,
                                                      kv_layouts, kv_forms):
        kv = {"fp8": "fp8_e4m3", "bf16": "bf16", "fp16": "fp16"}.get(kv, kv)
        fields: dict[str, Any] = dict(q_dtype=q_dtype, kv_dtype=kv, head_dim=head_dim, group=group, q_len=q_len,
                                      page_size=page_size, split=split, k_scale_tensor=st, v_scale_tensor=st,
                                      kv_form=form, kv_layout=layout)
        base = make_decode_config(**fields, **override)
        configs = [base]
        if "occupancy" not in override:
            configs += [make_decode_config(**fields, **override, occupancy=occ) for occ in range(1, base.occupancy)]
        for cfg in configs:
            out.append(cfg)
            # the op sizes a cluster-merged launch for at least CLUSTER_MIN_SIZING CTAs per SM
            if (want_cluster and cfg.split and not cfg.dynamic and cfg.occupancy >= CLUSTER_MIN_SIZING
                    and cluster_fits(cfg)):
                out.append(dataclasses.replace(cfg, cluster=True))
    return out


def warmup(*, arch: str | int | tuple[int, int] = "sm_90a", workers: int | None = None, progress: bool = True,
           **shape: Any) -> list[KernelConfig]:
    """Compile (in parallel, into the disk cache) and load every decode variant for ``shape``.

    ``shape`` takes the keyword arguments of :func:`decode_variants`. Returns the configs.
    """
    configs = decode_variants(**shape)
    precompile(configs, normalize_target(arch), workers=workers, progress=progress)
    return configs
