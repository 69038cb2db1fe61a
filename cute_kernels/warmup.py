"""``cute_kernels.warmup``: precompile the kernel variants a deployment will hit.

Cold variants compile in a few seconds each; a serving engine should not pay that on its first
request (nor inside CUDA-graph capture, where compiling is impossible). This enumerates the
decode variants for a model's shapes and compiles the missing ones in parallel processes into
the on-disk cache, with a progress bar, then loads them into memory.
"""

from __future__ import annotations

import dataclasses
from itertools import product

from .common.merge import MergeStatesConfig
from .jit.compiler import KernelConfig, normalize_target
from .jit.parallel import precompile
from .plans import sm80
from .sm90.decode import CLUSTER_MIN_SIZING, DEFAULT_CLUSTER, cluster_fits, make_decode_config


def decode_variants(
    *,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    kv_dtypes=("fp8_e4m3",),
    q_dtype: str = "bf16",
    q_lens=(1,),
    scale_tensors=(False, True),
    kv_layouts=("HND",),
    kv_forms=("single",),
    **override,
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
        fields = dict(q_dtype=q_dtype, kv_dtype=kv, head_dim=head_dim, group=group, q_len=q_len,
                      page_size=page_size, split=split, k_scale_tensor=st, v_scale_tensor=st, kv_form=form,
                      kv_layout=layout)
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


def portable_decode_variants(*, target: str, head_dim: int, num_q_heads: int, num_kv_heads: int, page_size: int,
                             kv_dtypes=("fp8_e4m3",), q_dtype: str = "bf16", q_lens=(1,), scale_tensors=(False, True),
                             kv_layouts=("HND",), kv_forms=("single",), **override) -> list[KernelConfig]:
    """The ``sm80.decode`` configs (split and not, with the split's merge) a model shape reaches on
    ``target`` (any arch but SM90, whose own decode kernel serves it)."""
    group = num_q_heads // num_kv_heads
    out: list[KernelConfig] = []
    for kv, q_len, split, st, layout, form in product(kv_dtypes, q_lens, (False, True), scale_tensors,
                                                      kv_layouts, kv_forms):
        kv = {"fp8": "fp8_e4m3", "bf16": "bf16", "fp16": "fp16"}.get(kv, kv)
        out.append(sm80.make_decode_config(target=target, q_dtype=q_dtype, kv_dtype=kv, head_dim=head_dim,
                                           group=group, q_len=q_len, page_size=page_size, split=split,
                                           k_scale_tensor=st, v_scale_tensor=st, kv_form=form, kv_layout=layout,
                                           **override))
    out.append(MergeStatesConfig(out_dtype=q_dtype, head_dim=head_dim, vec=4, pdl=target in sm80.PDL_TARGETS))
    return out


def warmup(*, arch="sm_90a", workers: int | None = None, progress: bool = True, **shape) -> list[KernelConfig]:
    """Compile (in parallel, into the disk cache) and load every decode variant for ``shape``.

    ``shape`` takes the keyword arguments of :func:`decode_variants`: SM90's own decode kernel on
    SM90, the portable ``sm80.decode`` elsewhere. Returns the configs.
    """
    target = normalize_target(arch)
    configs = decode_variants(**shape) if target == "sm_90a" else portable_decode_variants(target=target, **shape)
    precompile(configs, target, workers=workers, progress=progress)
    return configs
