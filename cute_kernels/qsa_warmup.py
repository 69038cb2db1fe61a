"""``cute_kernels.qsa_warmup``: precompile every QSA variant a deployment's shapes can reach.

The op picks ``(tile, splits)`` from the config table (``sm90/qsa.py`` ``split_table``, keyed by
rows x Hkv and ``prefill``); the split count itself is a runtime value (the grid), so the
compiled variants a deployment needs are: per tile of the table, the direct-output kernel (with
and without the output gate) and, if any entry splits, the split-K kernel plus the fused merge
(with and without the gate); with the block table's width, the prefill row-tile kernel (both
gate modes) and its union pre-pass, and for an FP8 cache the widening pre-pass and the 16-bit
row-tile kernel that runs on its copy. This enumerates them from the table for both profiles, compiles the
missing ones in parallel processes into the disk cache with a progress bar, and loads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .jit.compiler import KernelConfig, normalize_target
from .jit.parallel import precompile
from .sm90.qsa import H200_SMS, PRODUCTION_TOPK, make_qsa_config, split_table
from .sm90.qsa_merge import QsaMergeConfig, merge_shape
from .sm90.qsa_tile import TILE_MIN_ROWS, make_qsa_tile_config, row_tile_plan
from .sm90.qsa_union import QsaUnionConfig
from .sm90.qsa_widen import QsaWidenConfig

_KV = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "bf16": "bf16", "fp16": "fp16", "auto": None}


def qsa_variants(
    *,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    kv_cache_dtype: str = "bf16",
    q_dtype: str = "bf16",
    topk: int = PRODUCTION_TOPK,
    gates: Sequence[bool] = (True, False),
    num_sms: int = H200_SMS,
    block_table_width: int | None = None,
    **override: Any,
) -> list[KernelConfig]:
    """Every SM90 QSA kernel and merge config the table reaches for one layer shape.

    ``kv_cache_dtype``: ``"bf16"``/``"fp16"``/``"fp8"`` (``"auto"`` = ``q_dtype``); ``topk``: the
    packed width minus one (2051 in production); ``gates``: which output-gate modes to cover;
    ``block_table_width``: the block table's columns (pages per request), which size the
    prefill row-tile path's union pre-pass: given, that path's kernels are included. ``override``
    replaces tuning fields of the per-row kernel (benchmark variants, as ``tuning_override``).
    """
    kv = _KV.get(kv_cache_dtype, kv_cache_dtype) or q_dtype
    group = num_q_heads // num_kv_heads
    reach: set[tuple[int, bool]] = set()
    merges: set[tuple[int, int]] = set()
    for prefill in (False, True):
        for _, tile, splits in split_table(kv, head_dim, group, prefill, topk, num_sms):
            reach.add((tile, splits > 1))
            if splits > 1:
                merges.add(merge_shape(splits))
    out: list[KernelConfig] = []
    for tile, split in sorted(reach):
        for gate in ((False,) if split else gates):
            out.append(make_qsa_config(q_dtype=q_dtype, kv_dtype=kv, head_dim=head_dim, group=group,
                                       page_size=page_size, split=split, gate=gate,
                                       **{"tile": tile, **override}))
    # one merge per (group, lanes) the split counts reach, whatever tile split them
    out += [QsaMergeConfig(out_dtype=q_dtype, head_dim=head_dim, vec=4, gate=g, pdl=True, group=m, lanes=lanes)
            for m, lanes in sorted(merges) for g in gates]
    plan = None if block_table_width is None else row_tile_plan(
        TILE_MIN_ROWS, True, kv, group, page_size, block_table_width, topk)
    if plan is not None:
        out += [make_qsa_tile_config(q_dtype=q_dtype, kv_dtype=kv, head_dim=head_dim, group=group, page_size=page_size,
                                     gate=g, rows_per_cta=plan.rows_per_cta) for g in gates]
        out.append(QsaUnionConfig(rows_per_tile=plan.rows_per_cta, page_size=page_size, max_tokens=plan.max_tokens,
                                  union_cap=plan.union_cap))
        if kv == "fp8_e4m3":  # a batch whose widened copy is small enough runs the 16-bit kernel on it
            out += [make_qsa_tile_config(q_dtype=q_dtype, kv_dtype=q_dtype, head_dim=head_dim, group=group,
                                         page_size=page_size, gate=g, rows_per_cta=plan.rows_per_cta) for g in gates]
            out.append(QsaWidenConfig(out_dtype=q_dtype, head_dim=head_dim, page_size=page_size))
    return list(dict.fromkeys(out))


def qsa_warmup(*, arch: str | int | tuple[int, int] = "sm_90a", workers: int | None = None, progress: bool = True,
               **shape: Any) -> list[KernelConfig]:
    """Compile (in parallel, into the disk cache) and load every QSA variant for ``shape``.

    ``shape`` takes the keyword arguments of :func:`qsa_variants`, e.g.
    ``qsa_warmup(head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568, kv_cache_dtype="fp8")``.
    Returns the configs.
    """
    configs = qsa_variants(**shape)
    precompile(configs, normalize_target(arch), workers=workers, progress=progress)
    return configs
