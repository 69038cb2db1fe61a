"""Which QSA kernels serve a launch, and every variant a deployment's shapes can reach.

Host-only. A call runs either the prefill row-tile path (the widening pre-pass for an FP8 cache
whose copy is small enough, the union pre-pass, the row-tile kernel) or the per-row kernel with
the split count of the config table, followed by the fused merge when it split
(docs/design/qsa.md#the-design-as-it-stands). The op (:mod:`cute_kernels.ops.qsa_sparse_attention`) applies
this to tensors; the warm-up and the compile matrix enumerate it here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..jit.spec import KernelConfig
from . import hw
from .args import check_choices, check_layer_shape
from .sm90_qsa import PRODUCTION_TOPK, make_qsa_config, split_table
from .sm90_qsa_merge import QsaMergeConfig, merge_shape
from .sm90_qsa_tile import TILE_MIN_ROWS, make_qsa_tile_config, row_tile_plan
from .sm90_qsa_union import QsaUnionConfig
from .sm90_qsa_widen import QsaWidenConfig

_KV = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "bf16": "bf16", "fp16": "fp16", "auto": None}


def qsa_variants(*, head_dim: int, num_q_heads: int, num_kv_heads: int, page_size: int, kv_cache_dtype: str = "bf16",
                 q_dtype: str = "bf16", topk: int = PRODUCTION_TOPK, gates: Sequence[bool] = (True, False),
                 num_sms: int = hw.H200_SMS, block_table_width: int | None = None,
                 scale_tensors: Sequence[bool] = (False,), **override: Any) -> list[KernelConfig]:
    """Every SM90 QSA kernel and merge config the table reaches for one layer shape.

    The split count is a runtime value (the grid), so the compiled variants are: per tile of the
    table, the direct-output kernel (with and without the output gate) and, if any entry splits,
    the split-K kernel plus the fused merge (with and without the gate) of every (group, lanes)
    shape the split counts reach; with the block table's width, the prefill row-tile kernel (both
    gate modes) and its union pre-pass, and for an FP8 cache the widening pre-pass and the 16-bit
    row-tile kernel that runs on its copy.

    ``kv_cache_dtype``: ``"bf16"``/``"fp16"``/``"fp8"`` (``"auto"`` = ``q_dtype``); ``topk``: the
    packed width minus one (2051 in production); ``gates``: which output-gate modes to cover;
    ``block_table_width``: the block table's columns (pages per request), which size the
    prefill row-tile path's union pre-pass: given, that path's kernels are included.
    ``scale_tensors``: which k/v scale forms to cover (False: floats, True: 1-element device
    tensors, read by the kernels, as a deployment that updates its scales in a graph has). ``override``
    replaces tuning fields of the per-row kernel (benchmark variants, as ``tuning_override``).
    """
    check_layer_shape(head_dim=head_dim, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                      topk=topk, num_sms=num_sms, **({} if block_table_width is None else
                                                     {"block_table_width": block_table_width}))
    if kv_cache_dtype not in _KV:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(_KV)}, got {kv_cache_dtype!r}")
    gates = check_choices("gates", gates, (False, True))
    scale_tensors = check_choices("scale_tensors", scale_tensors, (False, True))
    kv = _KV[kv_cache_dtype] or q_dtype
    group = num_q_heads // num_kv_heads
    reach: set[tuple[int, bool]] = set()
    merges: set[tuple[int, int]] = set()
    for prefill in (False, True):
        for _, tile, splits in split_table(kv, head_dim, group, prefill, topk, num_sms):
            reach.add((tile, splits > 1))
            if splits > 1:
                merges.add(merge_shape(splits))
    out: list[KernelConfig] = []
    scales = [dict(k_scale_tensor=t, v_scale_tensor=t) for t in scale_tensors]
    for tile, split in sorted(reach):
        for gate in ((False,) if split else gates):
            for sc in scales:
                out.append(make_qsa_config(q_dtype=q_dtype, kv_dtype=kv, head_dim=head_dim, group=group,
                                           page_size=page_size, split=split, gate=gate,
                                           **{"tile": tile, **sc, **override}))
    # one merge per (group, lanes) the split counts reach, whatever tile split them
    out += [QsaMergeConfig(out_dtype=q_dtype, head_dim=head_dim, vec=4, gate=g, pdl=True, group=m, lanes=lanes)
            for m, lanes in sorted(merges) for g in gates]
    plan = None if block_table_width is None else row_tile_plan(
        TILE_MIN_ROWS, True, kv, group, page_size, block_table_width, topk)
    if plan is not None:
        out += [make_qsa_tile_config(q_dtype=q_dtype, kv_dtype=kv, head_dim=head_dim, group=group, page_size=page_size,
                                     gate=g, rows_per_cta=plan.rows_per_cta, **sc) for g in gates for sc in scales]
        out.append(QsaUnionConfig(rows_per_tile=plan.rows_per_cta, page_size=page_size, max_tokens=plan.max_tokens,
                                  union_cap=plan.union_cap))
        if kv == "fp8_e4m3":  # a batch whose widened copy is small enough runs the 16-bit kernel on it
            out += [make_qsa_tile_config(q_dtype=q_dtype, kv_dtype=q_dtype, head_dim=head_dim, group=group,
                                         page_size=page_size, gate=g, rows_per_cta=plan.rows_per_cta, **sc)
                    for g in gates for sc in scales]
            out.append(QsaWidenConfig(out_dtype=q_dtype, head_dim=head_dim, page_size=page_size))
    return list(dict.fromkeys(out))


def compile_variants() -> list[KernelConfig]:
    """The compile matrix: the Qwen3.8 layer (D 256, GQA 12 and 6, page 1568/784) in BF16 and FP8,
    direct (gated) and split-K, plus the fused merges; D 64/128 and GQA 16/1 once each; k/v scales as
    device tensors (per-row split and direct, row tiles); the
    prefill's row-tile kernel (both cache dtypes x both groups, gated, at the rows per CTA the op
    uses) and its union pre-pass (5 rows, 16K-token bitmap; 8 rows, the largest bitmap); the FP8
    prefill's widening pre-pass (bf16 and fp16 copies)."""
    out: list[KernelConfig] = []
    for kv in ("bf16", "fp8_e4m3"):
        for group, page in ((12, 1568), (6, 784)):
            for split in (False, True):
                out.append(make_qsa_config(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=group, page_size=page,
                                           split=split, gate=not split))
    out.append(make_qsa_config(q_dtype="fp16", kv_dtype="fp16", head_dim=128, group=16, page_size=800, split=True,
                               gate=False))
    out.append(make_qsa_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=64, group=1, page_size=16,
                               split=False, gate=False))
    # scales as device tensors (read by the kernel): the per-row kernel split and direct, the row tiles
    out += [make_qsa_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=256, group=12, page_size=1568, split=split,
                            gate=not split, k_scale_tensor=True, v_scale_tensor=True) for split in (False, True)]
    # the merge shapes of the decode table's split counts: N 4 (11), N 16 (4), S 2, N 1 (33: lanes)
    out += [QsaMergeConfig(out_dtype="bf16", head_dim=256, vec=4, gate=g, pdl=True, group=m, lanes=lanes)
            for g, splits in ((True, 11), (False, 11), (True, 4), (False, 2), (True, 33))
            for m, lanes in (merge_shape(splits),)]
    out += [make_qsa_tile_config(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=group, page_size=page, gate=True)
            for kv in ("bf16", "fp8_e4m3") for group, page in ((12, 1568), (6, 784))]
    out.append(make_qsa_tile_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=256, group=12, page_size=1568,
                                    gate=True, k_scale_tensor=True, v_scale_tensor=True))
    out += [QsaUnionConfig(rows_per_tile=5, page_size=1568, max_tokens=16384, union_cap=4160),
            QsaUnionConfig(rows_per_tile=8, page_size=784, max_tokens=524288, union_cap=4160)]
    out += [QsaWidenConfig(out_dtype="bf16", head_dim=256, page_size=1568),
            QsaWidenConfig(out_dtype="fp16", head_dim=128, page_size=800)]
    return out
