"""``cute_kernels.qsa_sparse_attention``: QSA sparse GQA attention on SM90 (CuTe-DSL kernels).

Semantics: :func:`cute_kernels.reference.qsa_sparse_attention` (read its docstring). The host
side only looks at shapes, dtypes, strides and pointers: it never reads tensor data (the valid
counts live in ``packed_indices`` on the device) and never synchronizes, so a call captures in a
CUDA graph once a warm-up call (or :func:`cute_kernels.qsa_warmup`) has compiled its variants and
sized the split-K workspace.

Launch: prefill batches (``prefill=True``, >= 64 rows, block tables of <= 2^19 tokens) take the
row-tile path: the union pre-pass (``sm90/qsa_union.py``) and the kernel that serves R rows per
CTA from their union (``sm90/qsa_tile.py``, ``row_tile_plan``). An FP8 cache first has the
pages its block table addresses widened into a 16-bit copy (``sm90/qsa_widen.py``), when that
copy is small next to the batch (``use_widened_cache``), so that the row tiles run the 16-bit
kernel (two consumer warpgroups); otherwise they widen each gathered row. Otherwise the split-K kernel
(``sm90/qsa.py``) with the split count of the config table (``select_config``: rows x Hkv and
``prefill``), then, when it split, the fused merge + gate (``sm90/qsa_merge.py``) as a
programmatic dependent launch. Host side: the shared launcher
(:mod:`cute_kernels.ops._launch`): the first call with a new combination of
shapes/strides/dtypes/alignment validates everything and prepares a :class:`_Launch` (its
workspace views bound as TVM-FFI tensors, one generated caller running its kernels in order); later
calls look it up by a tuple of the attributes that select the kernels (:func:`_key`) and go
straight to the TVM-FFI calls, which check dtypes, ranks, shared extents, devices and alignment
themselves; a call they refuse is validated in full for a clear error. Which kernels serve a shape
is the plans' decision (:mod:`cute_kernels.plans.sm90_qsa_launch`). Registered as
``torch.ops.cute_kernels.qsa_sparse_attention`` and ``qsa_sparse_attention_out``
(:mod:`cute_kernels.ops._library`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .. import reference
from .._types import Scale
from ..jit.compiler import get_kernel
from ..jit.spec import check_override
from ..plans.sm90_qsa import HEAD_DIMS, MAX_GROUP, Sm90QsaConfig, make_qsa_config, select_config
from ..plans.sm90_qsa_merge import QsaMergeConfig, merge_shape
from ..plans.sm90_qsa_tile import Sm90QsaTileConfig, make_qsa_tile_config, row_tile_plan
from ..plans.sm90_qsa_union import QsaUnionConfig
from ..plans.sm90_qsa_widen import QsaWidenConfig, use_widened_cache
from . import _check
from ._device import current_device, on_device, served_device
from ._launch import Launcher, TuningOverride, check_scale
from ._library import compiling, custom_op, scale_of, scale_parts
from ._torch import (
    NAME_TO_TORCH,
    DeviceBuffer,
    check_page_size,
    check_tensor,
    compile_target,
    device_sm_count,
    dtype_name,
    ffi_tensor,
    stream_id,
    widest_vector,
)

FP8 = torch.float8_e4m3fn


_workspace = DeviceBuffer("qsa_sparse_attention", torch.float32)  # split-K partials, unused LSE
_tile_workspace = DeviceBuffer("qsa_sparse_attention row tiles", torch.int32)  # unions, members, lengths, table
_wide_workspace = DeviceBuffer("qsa_sparse_attention widened cache", torch.int16)  # 16-bit K and V pages


@dataclass
class _Launch:
    """Everything a call needs that depends only on its key. ``call(*_CALL_PARAMS)`` runs the
    launches with the workspace views bound as TVM-FFI tensors (converted once, not at every call);
    the torch views stay here for inspection."""

    call: object
    fn: object
    merge_fn: object
    part_o: torch.Tensor | None
    part_lse: torch.Tensor | None
    lse: torch.Tensor | None
    splits: int
    gate: bool
    reference: bool = False
    empty: bool = False  # no rows: nothing to launch
    union_fn: object = None  # row-tile prefill: the union pre-pass, then ``fn`` over the tiles
    union: torch.Tensor | None = None
    member: torch.Tensor | None = None
    length: torch.Tensor | None = None
    widen_fn: object = None  # FP8 row tiles on a widened copy: the widening pre-pass, first
    wide_k: torch.Tensor | None = None
    table: torch.Tensor | None = None


def tuning_override(**fields: object) -> TuningOverride:
    """``with tuning_override(splits=8, stages=2): ...`` forces the split count and/or kernel
    tuning fields (benchmarks and tests comparing variants); part of the launch-cache key.
    ``tile_rows=R`` forces the prefill row-tile kernel's rows per CTA (1 = the per-row kernel),
    ``consumers=1|2`` its consumer warpgroups, ``widen=0|1`` whether an FP8 cache's row tiles run
    on a widened 16-bit copy (1: whenever possible, whatever the copy's size)."""
    return _launcher.tuning_override(**fields)


def _key(q, k, v, idx, bt, t2r, prefill, k_scale, v_scale, out, gate):
    """What selects the kernels, their configs and workspaces: the query and cache geometry, V's
    strides (``kv_same_strides``), the selection and block-table shapes, the options, and the
    pointer/stride alignment of ``out`` and ``output_gate`` (vector widths) with the gate's shape
    (no extent ties it to the query's). Left out is what the compiled functions check on every
    call (TVM-FFI): the other dtypes, extents shared with the query's or the cache's (V,
    token_to_req, out), devices against the query's, alignment of the other pointers. When they
    refuse an argument the call is validated in full (see :func:`qsa_sparse_attention`)."""
    # a non-bool ``prefill`` (1 == True) must not hit a cached launch: it is refused by _prepare;
    # a scale's type selects the kernel's scale form (a tensor's rank is left to the caller)
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, v.stride(), idx.shape, bt.shape,
            prefill if type(prefill) is bool else None,
            None if out is None else (out.stride(), out.data_ptr() % 16),
            None if gate is None else (gate.shape, gate.stride(), gate.data_ptr() % 16), type(k_scale), type(v_scale),
            stream_id(q), _launcher.override_key, current_device() if q.is_cuda else -1)


_LAUNCH_FIELDS = ("splits", "tile_rows", "widen", "merge_group", "merge_lanes")  # read where the launch is chosen, not kernel fields
# fields only the row-tile kernel's config has (warp roles, register split), kept from the per-row one
_TILE_ONLY_FIELDS = ({f.name for f in dataclasses.fields(Sm90QsaTileConfig)}
                     - {f.name for f in dataclasses.fields(Sm90QsaConfig)})


# what the call decides (dtypes, shapes, the gate, the scales' kinds; the split and the rows per CTA come from
# `splits` and `tile_rows`): every other field of the two kernels' configs is tuning
_FIXED = ("q_dtype", "kv_dtype", "head_dim", "group", "page_size", "split", "gate", "k_scale_tensor", "v_scale_tensor",
          "rows_per_cta")


def check_tuning_override(override: dict) -> None:
    """The tuning override's fields: the launch's (``splits``, ``tile_rows``, ``widen``,
    ``merge_group``, ``merge_lanes``) and the per-row and row-tile kernels' tuning fields (the
    row-tile config holds the per-row one's), of the field's type; the others are the call's
    (:func:`cute_kernels.jit.spec.check_override`). Checked for CPU tensors too."""
    check_override(Sm90QsaTileConfig, override, fixed=_FIXED, extra=_LAUNCH_FIELDS,
                   kernel=f"{Sm90QsaConfig.kernel_id} / {Sm90QsaTileConfig.kernel_id}")


def _kernel_tuning(row_tiles: bool = False) -> dict:
    """The active override's fields for the kernel config being built (per-row or row-tile)."""
    return {f: v for f, v in _launcher.override.items()
            if f not in _LAUNCH_FIELDS and (row_tiles or f not in _TILE_ONLY_FIELDS)}


def _prepare(q, k, v, idx, bt, t2r, prefill, k_scale, v_scale, out, gate) -> _Launch:
    """Full validation (errors name the argument) and kernel selection for one key."""
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float16), ndim=3)
    served_device("q", q)
    rows, Hq, D = q.shape
    check_tensor("k_cache", k, ndim=4, device=q.device)
    check_tensor("v_cache", v, ndim=4, device=q.device)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k_cache and v_cache must match, got {tuple(k.shape)} {k.dtype} / {tuple(v.shape)} {v.dtype}")
    NB, page, Hkv, Dk = k.shape
    check_page_size("k_cache", k, page)  # the kernels and the reference divide token ids by it
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has {D}, k_cache has {Dk}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"num q heads ({Hq}) must be a multiple of num kv heads ({Hkv})")
    check_tensor("packed_indices", idx, dtype=torch.int32, ndim=2, device=q.device)
    if idx.shape[0] != rows or idx.shape[1] < 2:
        raise ValueError(f"packed_indices must be [rows={rows}, TOPK + 1 >= 2], got {list(idx.shape)}")
    check_tensor("block_table", bt, dtype=torch.int32, ndim=2, device=q.device)
    check_tensor("token_to_req", t2r, dtype=torch.int32, shape=(rows,), device=q.device)
    if not isinstance(prefill, bool):
        raise TypeError(f"prefill must be a bool, got {type(prefill).__name__}")
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=(rows, Hq, D), device=q.device, output=True)
    if gate is not None:
        check_tensor("output_gate", gate, dtype=q.dtype, shape=(rows, Hq, D), device=q.device)
    scale_tensors = dict(k_scale_tensor=check_scale("k_scale", k_scale, device=q.device),
                         v_scale_tensor=check_scale("v_scale", v_scale, device=q.device))
    # the kernels' limits, checked for CPU tensors too: code that passes on the CPU passes on the GPU
    if k.dtype not in (FP8, q.dtype):
        raise TypeError(f"k_cache dtype must be float8_e4m3fn or the query's dtype {q.dtype}, got {k.dtype}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {D}")
    group = Hq // Hkv
    if group > MAX_GROUP:
        raise ValueError(f"num_q_heads / num_kv_heads must be <= {MAX_GROUP}, got {group}")
    # 16-byte vector loads of Q rows and 16-byte cp.async of K/V rows
    check_tensor("q", q, align_bytes=16)
    check_tensor("k_cache", k, align_bytes=16)
    check_tensor("v_cache", v, align_bytes=16)
    if NB == 0:  # nothing to gather from: refused before any launch
        raise ValueError("k_cache has no blocks (num_blocks = 0): an empty KV pool cannot be attended; allocate at "
                         "least one block (docs/design/inputs.md#kv-pool)")
    check_tuning_override(_launcher.override)  # a typo would be dropped or fail inside a config
    if not q.is_cuda:
        return _Launch(None, None, None, None, None, None, 1, gate is not None, reference=True)
    if rows == 0 or Hq == 0:  # nothing to compute (no rows x heads): no variant is compiled
        return _Launch(None, None, None, None, None, None, 1, gate is not None, empty=True)

    device = q.device
    stream = stream_id(q)
    topk = idx.shape[1] - 1
    kv_name, q_name = dtype_name(k.dtype), dtype_name(q.dtype)
    target = compile_target(device)
    same_strides = k.stride() == v.stride()  # V row addresses derived from K's (the gather)
    plan = row_tile_plan(rows, prefill, kv_name, group, page, bt.shape[1], topk,
                         _launcher.override.get("tile_rows"))
    if plan is not None:
        wide = None
        if use_widened_cache(kv_name, rows, bt.shape[0], bt.shape[1], page, Hkv, D, _launcher.override.get("widen")):
            wide = (bt.shape[0], bt.shape[1], Hkv)
        return _prepare_row_tiles(plan, q_name, kv_name, D, group, page, rows, Hq, gate, same_strides, device,
                                  target, stream, scale_tensors, wide)
    tile, splits = select_config(rows, Hkv, prefill, kv_name, D, group, topk, device_sm_count(device.index or 0))
    splits = _launcher.override.get("splits", splits)
    tuning = {**scale_tensors, **_kernel_tuning()}
    split = splits > 1
    tuning.setdefault("kv_same_strides", same_strides)
    config = make_qsa_config(q_dtype=q_name, kv_dtype=kv_name, head_dim=D, group=group, page_size=page,
                             split=split, gate=gate is not None, tile=tuning.pop("tile", tile), **tuning)
    fn = get_kernel(config, target)
    merge_fn = part_o = part_lse = lse = None
    if split:
        # the merge's vector width: 16-byte partial loads, out/gate at 4 elements when aligned
        vec = 4
        for t in (out, gate):
            if t is not None:
                while vec > 1 and widest_vector([t]) < vec * t.element_size():
                    vec //= 2
        group, lanes = merge_shape(splits)
        group = _launcher.override.get("merge_group", group)
        lanes = _launcher.override.get("merge_lanes", lanes)
        merge_cfg = QsaMergeConfig(out_dtype=q_name, head_dim=D, vec=vec, gate=gate is not None, pdl=True,
                                   group=group, lanes=lanes)
        merge_fn = get_kernel(merge_cfg, target)
        n_o, n_l = splits * rows * Hq * D, splits * rows * Hq
        ws = _workspace.get(device, n_o + n_l, stream)
        part_o = ws[:n_o].view(splits, rows, Hq, D)
        part_lse = ws[n_o:n_o + n_l].view(splits, rows, Hq)
    else:
        lse = _workspace.get(device, rows * Hq, stream)[:rows * Hq].view(rows, Hq)
    # an absent gate: the kernels take a placeholder they never read; a tensor scale of another
    # rank than 1 (0-d included) goes to the kernel as a [1] view
    gate_src = {"gate": "gate" if gate is not None else "q", **_scale_sources(scale_tensors)}
    if split:
        parts = dict(out=ffi_tensor(part_o), lse=ffi_tensor(part_lse))
        merge_gate = {"gate": "gate" if gate is not None else "out"}
        call = _launcher.bind(_CALL_PARAMS, (fn, config.signature(), gate_src, parts),
                    (merge_fn, merge_cfg.signature(), merge_gate,
                     dict(partial_out=parts["out"], partial_lse=parts["lse"])))
    else:
        call = _launcher.bind(_CALL_PARAMS, (fn, config.signature(), gate_src, dict(lse=ffi_tensor(lse))))
    return _Launch(on_device(call, device), fn, merge_fn, part_o, part_lse, lse, splits, gate is not None)


def _scale_sources(scale_tensors: dict) -> dict:
    return {name: f"{name}.view(1)?" for name in ("k_scale", "v_scale") if scale_tensors[f"{name}_tensor"]}


def _prepare_row_tiles(plan, q_name, kv_name, D, group, page, rows, Hq, gate, same_strides, device,
                       target, stream, scale_tensors, wide=None) -> _Launch:
    """The prefill row-tile path: the union pre-pass and the row-tile kernel, with their int32
    workspace (union lists, membership bits, lengths) carved from one reused buffer. ``wide``
    (``(NR, W, Hkv)`` of an FP8 cache's block table): the widening pre-pass first, into a 16-bit
    copy of the table's pages and a table addressing it, which the union pre-pass and the 16-bit
    row-tile kernel then read instead of the cache and the caller's table."""
    tuning = {**scale_tensors, **_kernel_tuning(row_tiles=True)}
    if wide is not None:
        kv_name, same_strides = q_name, True  # the copy: q's dtype, K and V halves of one buffer
    if gate is not None and widest_vector([gate]) < 4:
        tuning.setdefault("gate_vec", 1)  # a 2-byte aligned gate: loaded one element at a time
    tuning.setdefault("kv_same_strides", same_strides)
    R = plan.rows_per_cta
    tile_cfg = make_qsa_tile_config(q_dtype=q_name, kv_dtype=kv_name, head_dim=D, group=group, page_size=page,
                                    gate=gate is not None, rows_per_cta=R, **tuning)
    union_cfg = QsaUnionConfig(rows_per_tile=R, page_size=page, max_tokens=plan.max_tokens, union_cap=plan.union_cap)
    fn, union_fn = get_kernel(tile_cfg, target), get_kernel(union_cfg, target)
    nt, cap = plan.num_tiles, plan.union_cap
    n_u, n_m = nt * cap, nt * R * (cap // 32)
    n_t = 0 if wide is None else wide[0] * wide[1]
    ws = _tile_workspace.get(device, n_u + n_m + nt + n_t, stream)
    union = ws[:n_u].view(nt, cap)
    member = ws[n_u:n_u + n_m].view(nt, R, cap // 32)
    length = ws[n_u + n_m:n_u + n_m + nt]
    lse = _workspace.get(device, rows * Hq, stream)[:rows * Hq].view(rows, Hq)
    bound = dict(union=ffi_tensor(union), member=ffi_tensor(member), length=ffi_tensor(length), lse=ffi_tensor(lse))
    gate_src = {"gate": "gate" if gate is not None else "q", **_scale_sources(scale_tensors)}
    if wide is None:
        call = _launcher.bind(_CALL_PARAMS, (union_fn, union_cfg.signature(), None, bound),
                    (fn, tile_cfg.signature(), gate_src, bound))
        return _Launch(on_device(call, device), fn, None, None, None, lse, 1, gate is not None, union_fn=union_fn,
                       union=union, member=member, length=length)

    NR, W, Hkv = wide
    NP = NR * W
    table = ws[n_u + n_m + nt:n_u + n_m + nt + n_t].view(NR, W)
    # slot p = r * W + j holds page block_table[r, j]: [NP, page, Hkv, 2 D] as the production
    # layout (a token's K and V rows adjacent, tokens of a head contiguous)
    buf = _wide_workspace.get(device, NP * page * Hkv * 2 * D, stream)[:NP * page * Hkv * 2 * D]
    kv = buf.view(NAME_TO_TORCH[q_name]).view(NP, Hkv, page, 2 * D).transpose(1, 2)
    wide_k, wide_v = kv[..., :D], kv[..., D:]
    widen_cfg = QsaWidenConfig(out_dtype=q_name, head_dim=D, page_size=page)
    widen_fn = get_kernel(widen_cfg, target)
    # the copy and its table replace the cache and the caller's table for the union and the tiles
    copy = dict(k_wide=ffi_tensor(wide_k), v_wide=ffi_tensor(wide_v), table=ffi_tensor(table))
    on_copy = {**bound, "k_cache": copy["k_wide"], "v_cache": copy["v_wide"], "block_table": copy["table"]}
    call = _launcher.bind(_CALL_PARAMS, (widen_fn, widen_cfg.signature(), None, copy),
                (union_fn, union_cfg.signature(), None, on_copy), (fn, tile_cfg.signature(), gate_src, on_copy))
    return _Launch(on_device(call, device), fn, None, None, None, lse, 1, gate is not None, union_fn=union_fn,
                   union=union, member=member, length=length, widen_fn=widen_fn, wide_k=wide_k, table=table)


# forward-only, as the kernels: no autograd history, an out= that requires grad written in place
# (docs/design/inputs.md#the-classes)
@torch.no_grad()
def _reference(q, k, v, idx, bt, t2r, prefill, k_scale, v_scale, out, gate):
    return reference.qsa_sparse_attention(q, k, v, idx, bt, t2r, prefill=prefill, k_scale=k_scale, v_scale=v_scale,
                                          out=out, output_gate=gate)


def _check_data(q, k, v, idx, bt, t2r, prefill, k_scale, v_scale, out, gate) -> None:
    """Checked mode (``CUTE_KERNELS_CHECK=1``): the data rules (docs/design/inputs.md#checked-mode)."""
    _check.qsa_selection(idx, bt, t2r, k.shape[1], k.shape[0])
    _check.scales(k_scale=k_scale, v_scale=v_scale)


# the caller's parameters: the kernels' argument names (a kernel's other arguments are bound)
_CALL_PARAMS = ("q", "k_cache", "v_cache", "packed_indices", "block_table", "token_to_req", "out", "gate", "k_scale",
                "v_scale")
_launcher = Launcher(_prepare, _reference, check_data=_check_data, op="qsa_sparse_attention")


def qsa_sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    packed_indices: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    *,
    prefill: bool,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    out: torch.Tensor | None = None,
    output_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """QSA sparse GQA attention: each query row attends to the KV tokens its indexer selected.

    Semantics: :func:`cute_kernels.reference.qsa_sparse_attention` (its docstring is the
    contract: packed ``[rows, TOPK + 1]`` int32 indices whose last column is the valid count,
    ``-1`` padding anywhere, invalid entries contribute nothing and are never read, rows without a
    valid entry give 0).

    Supported here (SM90): q bf16/fp16 ``[rows, Hq, D]`` with 16-byte aligned rows;
    ``k_cache``/``v_cache`` ``[num_blocks, PAGE, Hkv, D]`` views with any 16-byte aligned strides
    (e.g. the two halves of one ``[num_blocks, Hkv, PAGE, 2 D]`` buffer), FP8 e4m3 or q's dtype;
    any PAGE; D 64/128/256; Hq / Hkv <= 16. ``prefill``: True when the batch's max query length
    exceeds 1 + the number of speculative tokens (selects the tuning profile only).
    ``k_scale``/``v_scale``: dequantization scales, floats or 1-element fp32 device tensors of any
    rank, 0-d included (read by the kernels: a replayed CUDA graph sees their current values).
    A cache of no blocks is refused (ValueError). ``output_gate``: optional, q's shape:
    ``out = round(attn) * sigmoid(gate)``. ``out``: optional output (q's shape and dtype).
    CPU tensors run the reference.
    """
    if compiling():  # torch.compile traces the registered op (the eager path never pays for it)
        traced = (q, k_cache, v_cache, packed_indices, block_table, token_to_req, prefill, *scale_parts(k_scale),
                  *scale_parts(v_scale), output_gate)
        if out is None:
            return _qsa_op(*traced)
        _qsa_out_op(*traced, out)
        return out
    try:
        key = _key(q, k_cache, v_cache, packed_indices, block_table, token_to_req, prefill, k_scale, v_scale, out,
                   output_gate)
    except (AttributeError, TypeError):  # not tensors: the validation says what is wrong
        key = None
    launch = _launcher.entries.get(key)
    if launch is None or launch.reference:  # the argument tuple is built off the hot path only
        args = (q, k_cache, v_cache, packed_indices, block_table, token_to_req, prefill, k_scale, v_scale, out,
                output_gate)
        launch = launch or _launcher.lookup(key, args)
        if launch.reference:
            return _launcher.run_reference(args)
    if out is None:
        out = torch.empty_like(q)
    if launch.empty:
        return out
    try:
        launch.call(q, k_cache, v_cache, packed_indices, block_table, token_to_req, out, output_gate, k_scale,
                    v_scale)
    except Exception:  # raises the error that names the argument
        _launcher.refused((q, k_cache, v_cache, packed_indices, block_table, token_to_req, prefill, k_scale, v_scale,
                           out, output_gate))
        raise
    return out


# ---------------------------------------------------------------------------------------------
# torch.library: torch.ops.cute_kernels.qsa_sparse_attention / qsa_sparse_attention_out
# ---------------------------------------------------------------------------------------------


@custom_op("qsa_sparse_attention_out", mutates=("out",))
def _qsa_out_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, packed_indices: Tensor, block_table: Tensor,
                token_to_req: Tensor, prefill: bool, k_scale: float, k_scale_tensor: Optional[Tensor], v_scale: float,
                v_scale_tensor: Optional[Tensor], output_gate: Optional[Tensor], out: Tensor) -> None:
    qsa_sparse_attention(q, k_cache, v_cache, packed_indices, block_table, token_to_req, prefill=prefill,
                         k_scale=scale_of(k_scale, k_scale_tensor), v_scale=scale_of(v_scale, v_scale_tensor), out=out,
                         output_gate=output_gate)


@_qsa_out_op.register_fake
def _(q, k_cache, v_cache, packed_indices, block_table, token_to_req, prefill, k_scale, k_scale_tensor, v_scale,
      v_scale_tensor, output_gate, out):
    return None


@custom_op("qsa_sparse_attention")
def _qsa_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, packed_indices: Tensor, block_table: Tensor,
            token_to_req: Tensor, prefill: bool, k_scale: float, k_scale_tensor: Optional[Tensor], v_scale: float,
            v_scale_tensor: Optional[Tensor], output_gate: Optional[Tensor]) -> Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return qsa_sparse_attention(q, k_cache, v_cache, packed_indices, block_table, token_to_req, prefill=prefill,
                                k_scale=scale_of(k_scale, k_scale_tensor), v_scale=scale_of(v_scale, v_scale_tensor),
                                out=out, output_gate=output_gate)


@_qsa_op.register_fake
def _(q, k_cache, v_cache, packed_indices, block_table, token_to_req, prefill, k_scale, k_scale_tensor, v_scale,
      v_scale_tensor, output_gate):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
