"""``cute_kernels.paged_decode``: paged decode attention (CuTe-DSL kernels: ``sm90.decode`` on SM90,
``sm100.decode`` on SM100 / SM103, the portable ``sm80.decode`` on every other arch and for what
those refuse).

The host side only looks at shapes, dtypes, strides and pointers: it never reads tensor data
and never synchronizes, so a call captures in a CUDA graph (after a warm-up call has compiled
the variant). Split-KV workspaces are allocated once per (device, stream) and reused
(docs/design/inputs.md#workspaces).

The op runs on the shared launcher (:mod:`cute_kernels.ops._launch`): the first call with a new
combination of shapes/strides/dtypes validates everything and prepares a :class:`_Launch` (kernel,
split schedule and sizing from the plan :mod:`cute_kernels.plans.sm90_decode`, workspace views
bound once as TVM-FFI tensors, one generated positional caller); later calls look it up by a tuple
of the attributes that select the kernel and go straight to the TVM-FFI call, which checks dtype,
rank, static and shared extents, devices and alignment of every argument itself. When it refuses
one, the call is validated in full for a clear error.

Which kernel runs comes from the registry (:func:`decode_kernel`): the first decode kernel of the
device's arch, available or compile-verified, that takes the dtypes; the portable one also serves
an SM100 / SM103 family that failed its runtime self-check (not windows or sinks, which it does not
take: those run on the SM90 and SM100 kernels, else the reference), and
``tuning_override(backend="sm80")`` forces it (its plan: :mod:`cute_kernels.plans.sm80`; a split
launch there is followed by ``common.merge_states``). Registered as
``torch.ops.cute_kernels.paged_decode`` and ``paged_decode_out`` (:mod:`cute_kernels.ops._library`),
whichever kernel serves the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, overload

import torch
from torch import Tensor

from .. import _nvtx, reference
from .._types import KVCache, Scale
from ..jit.compiler import get_kernel
from ..jit.spec import check_override
from ..plans import hw, sm80
from ..plans.args import fp32_note, positive_fp32
from ..plans.sm90_decode import Sm90DecodeConfig, launch_config, window_context
from ..registry import KERNELS, KernelInfo, arch_of_target, op_kernel
from . import _caller_workspace as caller_ws
from . import _check
from . import _decode_features as features
from . import _library as library
from . import _paged_decode_sm100 as sm100
from ._device import check_devices, current_device, on_device, served_device
from ._launch import Launcher, TuningOverride, check_scale
from ._library import cache_of, cache_parts, compiling, custom_op, no_lse, scale_of, scale_parts
from ._torch import (
    DeviceBuffer,
    check_kv_cache,
    check_paged_tensors,
    check_tensor,
    compile_target,
    device_sm_count,
    device_stream_id,
    dtype_name,
    ffi_tensor,
    stream_id,
)

FP8 = torch.float8_e4m3fn


# split partials / unused LSE targets, and the fused merge's arrival counters (zero between
# launches: the last CTA of each (request, KV head) resets its counter)
_workspace = DeviceBuffer("paged_decode", torch.float32)
_counters = DeviceBuffer("paged_decode", torch.int32, zero=True, min_numel=4096)


@dataclass
class _Launch:
    """Everything a call needs that depends only on its key (shapes, strides, dtypes...)."""

    fn: Any  # the compiled kernel's caller, workspace views bound (ops._launch.bind)
    scratch_lse: Any  # LSE target (a TVM-FFI tensor) when the caller did not ask for it
    out_shape: Any  # (T, Hq, D); None for the reference
    reference: bool = False
    sm100: Any = None  # SM100 / SM103: the tcgen05 launch (an FP8 query, sinks and a window too)
    empty: bool = False  # nothing to attend (no rows, or no block-table columns): 0 and LSE -inf


def tuning_override(**fields: object) -> TuningOverride:
    """``with tuning_override(widen="bits", tile=128): ...`` forces kernel tuning fields (for
    benchmarks comparing variants). The override is part of the launch-cache key. ``cluster``
    is a launch choice: ``False`` never merges in clusters, ``True`` does whenever the split
    count allows (at most MAX_CLUSTER), absent leaves it to the plan's rule
    (:func:`cute_kernels.plans.sm90_decode.use_cluster_merge`). ``balanced=True`` selects the
    balanced split schedule of the SM90 kernel for ragged batches (opt-in, available: verified by
    the GPU suite on the H200; ``num_splits`` then counts chunks per KV head; calls with a window or sinks, and other kernels, keep their schedule):
    docs/design/sm90-decode.md#balanced-schedule-opt-in. ``backend="sm80"`` runs the portable
    ``sm80.decode`` on any arch (its fields then: ``widen``, ``stages``, ``tw``..., ``smem_target``
    for a ring sized for another target's shared memory). A call checks the fields against the
    kernel it selects (:func:`check_tuning_override`) before any variant is compiled."""
    return _launcher.tuning_override(**fields)


BACKENDS = {"sm80": "sm80.decode"}  # tuning_override(backend=...) -> the kernel it forces
_CPU_TARGET = "sm_90a"  # CPU tensors are validated for the kernel an SM90 GPU would run
# what a call's arguments decide, not the override: dtypes, shapes, scale kinds, the cache's form and
# layout, window / sinks, the split (num_splits, else the plan)
_SM80_FIXED = ("target", "q_dtype", "kv_dtype", "head_dim", "group", "q_len", "page_size", "split", "kv_form",
               "kv_layout", "k_scale_tensor", "v_scale_tensor")
_SM90_FIXED = (*_SM80_FIXED[1:], "window", "sinks")
# keys the portable plan reads itself (smem_target) or the op drops for it (balanced: the SM90 schedule)
_SM80_EXTRA = ("smem_target", "balanced")


def decode_kernel(target: str, q_dtype: str, kv_dtype: str, backend: str | None = None) -> KernelInfo:
    """The kernel a decode runs (:func:`cute_kernels.registry.op_kernel`), or the one ``backend``
    forces."""
    if backend is None:
        return op_kernel("paged_decode", "decode", target, q_dtype, kv_dtype)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)} (or absent), got {backend!r}")
    return KERNELS[BACKENDS[backend]]


def check_tuning_override(kernel_id: str, override: dict) -> None:
    """The tuning override (its ``backend`` aside) against the kernel ``kernel_id`` a call selects:
    each field one of its config's tuning fields or a key its plan reads, of the field's type
    (:func:`cute_kernels.jit.spec.check_override`); ``sm100.decode`` takes none. The values' ranges
    are the configs' own checks (docs/design/inputs.md)."""
    backend = override.get("backend")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"tuning_override: backend must be one of {tuple(BACKENDS)} (or absent), got {backend!r}")
    fields = {k: v for k, v in override.items() if k != "backend"}
    if kernel_id == BACKENDS["sm80"]:
        check_override(sm80.Sm80DecodeConfig, fields, fixed=_SM80_FIXED, extra=_SM80_EXTRA)
    elif kernel_id == Sm90DecodeConfig.kernel_id:
        check_override(Sm90DecodeConfig, fields, fixed=_SM90_FIXED)
    elif fields:
        raise ValueError(f"tuning_override: {next(iter(fields))!r} is not a tuning field of {kernel_id}, which has "
                         "none (backend='sm80' forces the portable kernel)")


def _key(q, k, v, pair, block_table, kv_layout, q_len, sm_scale, k_scale, v_scale, out, return_lse, num_splits,
         deterministic, q_scale=None, window_left=-1, sinks=None, workspace=None):
    """What selects the kernel, its schedule and its workspace: the query and cache geometry,
    the block-table width, the options, the stream (workspaces are per stream). Left out is what
    the compiled function checks on every call (TVM-FFI): the dtypes of the other tensors, shapes
    tied to the query's or the cache's by a shared extent (seq_lens, out, V), every device against
    the query's, pointer and stride alignment. A call that fails one of those checks is validated
    in full by :func:`_prepare`, whose error names the argument (see :func:`paged_decode`);
    ``out``'s strides are in the key (a self-overlapping view is refused there, not by TVM-FFI). The
    current device decides whether the launch runs in a device guard (:mod:`._device`)."""
    # type(), not isinstance(): torch.Tensor's metaclass makes isinstance slow. A float scale's
    # value is checked per call by the caller; a tensor scale's rank too (a 1-element tensor of
    # another rank, 0-d included, goes to the kernel as a [1] view)
    return (q.shape, q.stride(), q.dtype, q.device, pair, k.shape, k.stride(), k.dtype, block_table.shape,
            kv_layout, q_len, sm_scale, type(k_scale), type(v_scale), None if out is None else out.stride(), return_lse,
            num_splits, deterministic, _launcher.override_key, type(q_scale), window_left, sinks is None, stream_id(q),
            caller_ws.workspace_key(workspace), current_device() if q.is_cuda else -1)


def _validate(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, k_scale, v_scale, out, num_splits,
              deterministic, q_scale, window_left, sinks, workspace=None):
    """Every check of the arguments, the same for CPU and CUDA tensors (code that passes on the CPU
    passes on the GPU: the limits of the kernel that serves the call hold, whatever the device; CPU
    tensors as on an SM90 GPU); returns ``(scale, P, Hkv, page, k_scale is a tensor, v_scale is a
    tensor, the kernel)`` (the kernel: None for an FP8 query, and for windows or sinks where only
    the portable kernel would take the dtypes: sm100.decode's where it runs, else the reference)."""
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float16, FP8), ndim=3)
    served_device("q", q)
    T, Hq, D = q.shape
    P, Hkv, page = check_kv_cache(k, v, pair, kv_layout, D)
    if not isinstance(q_len, int) or isinstance(q_len, bool) or q_len < 1:
        raise ValueError(f"q_len_per_req must be a positive int, got {q_len!r}")
    ks_t = check_scale("k_scale", k_scale, device=q.device)
    vs_t = check_scale("v_scale", v_scale, device=q.device)
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))):
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    if not positive_fp32(scale):  # finite as the kernels' fp32 scalar too
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale}{fp32_note(scale)}")
    sm100.check_features(q, k, q_scale, sinks, window_left)
    # every tensor on the query's device, whichever path serves the call (the reference too)
    check_devices(q.device, **{"k_cache" if pair else "kv_cache": k}, **({"v_cache": v} if pair else {}),
                  block_table=block_table, seq_lens=seq_lens, out=out)
    if q_scale is not None:
        check_scale("q_scale", q_scale, device=q.device)
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {deterministic!r}")
    if workspace is not None:
        caller_ws.check_workspace(workspace, q.device)
    if P == 0:  # a TMA descriptor needs a non-empty tensor: refused before any launch
        raise ValueError(f"{'k_cache' if pair else 'kv_cache'} has no pages (P = 0): an empty KV pool cannot be "
                         "attended; allocate at least one page (docs/design/inputs.md#kv-pool)")
    backend = _launcher.override.get("backend")
    target = compile_target(q.device) if q.is_cuda else _CPU_TARGET
    info = None
    if _sm90_serves(q, window_left, sinks):
        if k.dtype not in (FP8, q.dtype, torch.float16):
            raise TypeError(f"kv_cache dtype must be float8_e4m3fn or the query's dtype {q.dtype} (or float16 for "
                            f"a bfloat16 query), got {k.dtype}")
        info = decode_kernel(target, dtype_name(q.dtype), dtype_name(k.dtype), backend)
        check_tuning_override(info.id, _launcher.override)
        if info.id == BACKENDS["sm80"] and (window_left != -1 or sinks is not None):
            if backend is not None:
                raise ValueError(f"backend={backend!r} takes no window or sinks")
            return scale, P, Hkv, page, ks_t, vs_t, None  # the portable kernel has neither
        if info.head_dims is not None and D not in info.head_dims:
            raise ValueError(f"head_dim must be one of {info.head_dims}, got {D}")
        if info.page_sizes is not None and page not in info.page_sizes:
            raise ValueError(f"page size must be one of {info.page_sizes}, got {page}")
        if Hkv < 1 or Hq % Hkv:
            raise ValueError(f"num q heads ({Hq}) must be a multiple of num kv heads ({Hkv})")
        if info.max_rows is not None and (Hq // Hkv) * q_len > info.max_rows:
            raise ValueError(f"Hq/Hkv x q_len_per_req must be <= {info.max_rows}, got {Hq // Hkv} x {q_len}")
        if q.stride(-2) != D and Hq > 1:
            raise ValueError(f"q must have contiguous heads (stride(-2) == head_dim {D}), got strides {q.stride()}")
        check_paged_tensors(q, k, v, pair, block_table, seq_lens, q_len, cache_dtypes=(FP8, q.dtype, k.dtype))
        if out is not None:
            check_tensor("out", out, dtype=q.dtype, shape=(T, Hq, D), device=q.device, output=True)
    elif backend is not None:
        raise ValueError(f"backend={backend!r} takes no FP8 query")
    else:  # sm100.decode, else the reference: checked as the target's 16-bit call (a typo fails alike)
        check_tuning_override(decode_kernel(target, "bf16", "bf16").id, _launcher.override)
        sm100.check_call(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, out)  # its tensors, on every path
    return scale, P, Hkv, page, ks_t, vs_t, info


def _sm90_serves(q, window_left, sinks) -> bool:
    """The calls the SM90 kernel takes: a 16-bit query (windows and sinks through its window / sink
    variants; an FP8 query runs the reference on SM90)."""
    return q.dtype != FP8


def _prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, k_scale, v_scale, out, return_lse,
             num_splits, deterministic, q_scale=None, window_left=-1, sinks=None, workspace=None) -> _Launch:
    """Full validation (clear errors naming the argument) and kernel selection for one key."""
    scale, P, Hkv, page, ks_t, vs_t, info = _validate(q, k, v, pair, block_table, seq_lens, kv_layout, q_len,
                                                      sm_scale, k_scale, v_scale, out, num_splits, deterministic,
                                                      q_scale, window_left, sinks, workspace)
    if not isinstance(return_lse, bool):  # as paged_prefill: a flag of another type is refused, never read as truthy
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    T, Hq, D = q.shape
    override = dict(_launcher.override)
    override.pop("backend", None)  # (its kernel: info)
    if not q.is_cuda:
        # the configs an SM90 GPU (an H200's SMs) would plan for the call: their own checks of the
        # override's values hold for CPU tensors too, and a caller's workspace must hold their partials
        if info is not None and T and block_table.shape[1]:
            items, table_tokens = block_table.shape[0] * Hkv, block_table.shape[1] * page
            cpu_plan: tuple[int, sm80.Sm80DecodeConfig | Sm90DecodeConfig]
            if info.id == BACKENDS["sm80"]:
                cpu_plan = sm80.plan_decode(
                    _sm80_config_for(q, k, pair, kv_layout, q_len, Hq // Hkv, page, ks_t, vs_t, _CPU_TARGET,
                                     features.without_balanced(override)),
                    items, table_tokens, hw.H200_SMS, num_splits)
            else:
                cpu_plan = launch_config(**_sm90_plan(q, k, pair, block_table, kv_layout, q_len, Hkv, page, ks_t,
                                                      vs_t, num_splits, deterministic, window_left, sinks,
                                                      hw.H200_SMS), override=override)
            if workspace is not None:
                caller_ws.check_size(workspace, q.device, *workspace_numel(
                    cpu_plan[1], cpu_plan[0], block_table.shape[0], Hkv, T, Hq, D, return_lse))
        return _REFERENCE
    device = q.device
    if T == 0:  # nothing to compute: no launch, no compiled variant
        return _Launch(None, None, (T, Hq, D), empty=True)
    target = compile_target(device)
    if info is None or info.id == "sm100.decode":  # an FP8 query: sm100.decode only
        launch = None
        if arch_of_target(target) in KERNELS["sm100.decode"].archs:
            launch = sm100.prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, q_scale,
                                   k_scale, v_scale, out, num_splits, sinks, workspace)
        if launch is not None:
            return _Launch(None, None, (T, Hq, D), sm100=launch)
        if info is None or window_left != -1 or sinks is not None:  # no other kernel here takes the call
            return _REFERENCE
        info = KERNELS[BACKENDS["sm80"]]  # its MMA family failed the runtime self-check: the portable kernel
    if block_table.shape[1] == 0:
        # a block table of no pages (capacity 0: no position is attended): 0 and LSE -inf without
        # a launch or a compiled variant (docs/design/inputs.md#lengths)
        return _Launch(None, None, (T, Hq, D), empty=True)
    B = block_table.shape[0]
    sources = {"kv_cache": "k", "k_cache": "k", "v_cache": "v"}
    for name, is_tensor in (("k_scale", ks_t), ("v_scale", vs_t)):
        if is_tensor:  # the key holds the type only: a 1-element tensor of any rank is viewed as [1]
            sources[name] = f"{name}.view(1)?"
    if info.id == BACKENDS["sm80"]:
        # (the balanced schedule is the SM90 kernel's: the portable kernel keeps its own)
        return _prepare_sm80(q, k, pair, block_table, kv_layout, q_len, Hq // Hkv, page, scale, ks_t, vs_t,
                             return_lse, num_splits, target, features.without_balanced(override), sources,
                             workspace)
    # cluster (override): None = the rule (use_cluster_merge), True = whenever the split count allows, False = never
    plan = _sm90_plan(q, k, pair, block_table, kv_layout, q_len, Hkv, page, ks_t, vs_t, num_splits, deterministic,
                      window_left, sinks, device_sm_count(device.index or 0))
    planned = guarded_plan(plan, device, override)
    if planned is None:
        return _REFERENCE  # this window / sink family failed its one-time runtime check here (logged)
    num_splits, config = planned
    split = num_splits > 1
    fn = get_kernel(config, target)
    stream = stream_id(q)
    part_o = part_lse = scratch = counters = None
    lse_numel = T * Hq
    global_merge = split and not config.cluster  # a cluster merges in shared memory: no workspace
    part_tokens = config.partial_tokens(T)  # a balanced launch's partial slot holds one request's tokens
    part_numel = num_splits * part_tokens * Hq * D if global_merge else 0
    plse_numel = num_splits * part_tokens * Hq if global_merge else 0
    numel, counters_numel = workspace_numel(config, num_splits, B, Hkv, T, Hq, D, return_lse)
    if workspace is not None:  # the caller's memory (the trtllm API's workspace_buffer): nothing of ours
        ws, counters = caller_ws.carve(workspace, device, numel, counters_numel)
    else:
        ws = _workspace.get(device, numel, stream)
        if global_merge:  # arrival counters, then (dynamic split) the tile-chunk counters
            counters = _counters.get(device, counters_numel, stream)
    if global_merge:
        part_o = ws[:part_numel].view(num_splits, part_tokens, Hq, D)
        part_lse = ws[part_numel:part_numel + plse_numel].view(num_splits, part_tokens, Hq)
    if not return_lse:
        base = part_numel + plse_numel
        scratch = ffi_tensor(ws[base:base + lse_numel].view(T, Hq))
    constants = dict(part_out=ffi_tensor(part_o), part_lse=ffi_tensor(part_lse), counters=ffi_tensor(counters),
                     sm_scale=scale, num_splits=num_splits)
    return _Launch(on_device(_launcher.bind(_CALL_PARAMS, (fn, config.signature(), sources, constants)), device), scratch,
                   (T, Hq, D))


def _sm90_plan(q, k, pair, block_table, kv_layout, q_len, Hkv, page, ks_t, vs_t, num_splits, deterministic,
               window_left, sinks, num_sms) -> dict:
    """:func:`launch_config`'s arguments for a call on a GPU of ``num_sms`` SMs."""
    T, Hq, D = q.shape
    return dict(
        q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype), head_dim=D, group=Hq // Hkv, q_len=q_len,
        page_size=page, k_scale_tensor=ks_t, v_scale_tensor=vs_t, kv_form="pair" if pair else "single",
        kv_layout=kv_layout, items=block_table.shape[0] * Hkv, num_kv_heads=Hkv,
        # a window bounds the keys a request reads: the split count is planned for those
        max_context=window_context(block_table.shape[1] * page, window_left, q_len),
        num_sms=num_sms, num_splits=num_splits, deterministic=deterministic, window=window_left != -1,
        sinks=sinks is not None)


def _sm80_config_for(q, k, pair, kv_layout, q_len, group, page, ks_t, vs_t, target, override):
    """``config_for(split)`` of the portable kernel's plan (:func:`cute_kernels.plans.sm80.plan_decode`)."""
    D = q.shape[2]

    def config_for(split):
        return sm80.make_decode_config(
            target=target, q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype), head_dim=D, group=group,
            q_len=q_len, page_size=page, split=split, kv_form="pair" if pair else "single", kv_layout=kv_layout,
            k_scale_tensor=ks_t, v_scale_tensor=vs_t, **override)
    return config_for


def _prepare_sm80(q, k, pair, block_table, kv_layout, q_len, group, page, scale, ks_t, vs_t, return_lse,
                  num_splits, target, override, sources, workspace) -> _Launch:
    """The portable kernel's launch: the split count from shapes only
    (:func:`cute_kernels.plans.sm80.plan_decode`), and for a split launch the fp32 partials in this
    stream's workspace (or the caller's), merged by ``common.merge_states`` as a second step of the
    caller, or by the kernel's last split CTAs (the opt-in ``fused_merge``: with the arrival
    counters)."""
    T, Hq, D = q.shape
    B = block_table.shape[0]
    config_for = _sm80_config_for(q, k, pair, kv_layout, q_len, group, page, ks_t, vs_t, target, override)
    splits, config = sm80.plan_decode(config_for, B * (Hq // group), block_table.shape[1] * page,
                                      device_sm_count(q.device.index or 0), num_splits)
    numel, counters_numel = workspace_numel(config, splits, B, Hq // group, T, Hq, D, return_lse)
    counters = None
    if workspace is not None:  # the caller's memory: nothing of ours
        ws, counters = caller_ws.carve(workspace, q.device, numel, counters_numel)
    else:
        ws = _workspace.get(q.device, numel, stream_id(q))
        if counters_numel:
            counters = _counters.get(q.device, counters_numel, stream_id(q))
    lse_numel = T * Hq
    part_numel = splits * T * Hq * D if config.split else 0
    base = part_numel + (splits * lse_numel if config.split else 0)
    scratch = None if return_lse else ffi_tensor(ws[base:base + lse_numel].view(T, Hq))
    fn = get_kernel(config, target)
    if not config.split:
        call = _launcher.bind(_CALL_PARAMS, (fn, config.signature(), sources, dict(sm_scale=scale)))
        return _Launch(on_device(call, q.device), scratch, (T, Hq, D))
    part_o = ffi_tensor(ws[:part_numel].view(splits, T, Hq, D))
    part_lse = ffi_tensor(ws[part_numel:base].view(splits, T, Hq))
    if config.fused_merge:
        constants = dict(part_out=part_o, part_lse=part_lse, counters=ffi_tensor(counters), sm_scale=scale)
        call = _launcher.bind(_CALL_PARAMS, (fn, config.signature(), sources, constants))
        return _Launch(on_device(call, q.device), scratch, (T, Hq, D))
    merge = config.merge_config()
    steps = ((fn, config.signature(), sources, dict(part_out=part_o, part_lse=part_lse, sm_scale=scale)),
             (get_kernel(merge, target), merge.signature(), None, dict(partial_out=part_o, partial_lse=part_lse)))
    # both launches (the kernel, then the merge of its partials) in the op's NVTX range
    return _Launch(on_device(_launcher.bind(_CALL_PARAMS, *steps), q.device), scratch, (T, Hq, D))


def guarded_plan(plan: dict, device, override: dict | None = None):
    """``(num_splits, config)`` of a call's ``plan`` (:func:`launch_config`'s arguments) under the
    tuning ``override`` (default: the active one, without its ``backend``), past the one-time
    self-check of a compile-verified variant's family: None when
    a window / sink family failed it (the reference serves the call); a balanced family that failed
    it leaves the call to the default schedule (both logged)."""
    if override is None:
        override = {k: v for k, v in _launcher.override.items() if k != "backend"}
    num_splits, config = launch_config(**plan, override=override)
    if features.family_of(config) is not None and not features.self_check_passes(config, device, _check_call):
        if not config.balanced:
            return None
        num_splits, config = launch_config(**plan, override=features.without_balanced(override))
    return num_splits, config


def workspace_numel(config, num_splits: int, B: int, Hkv: int, T: int, Hq: int, D: int,
                    return_lse: bool) -> tuple[int, int]:
    """(fp32 elements, int32 counters) of a launch's workspaces: a global merge's partials and
    LSEs (a balanced launch: ``num_splits`` slots of one request's rows), the LSE target when the
    caller asks for none; the arrival (and, SM90's dynamic split, chunk) counters of a merge fused
    into the kernel (the portable kernel's opt-in ``fused_merge``; without it a second launch merges:
    none).
    Shapes only: a balanced launch's size does not depend on the lengths."""
    global_merge = num_splits > 1 and not getattr(config, "cluster", False)
    sm90 = config.kernel_id == "sm90.decode"
    tokens = config.partial_tokens(T) if sm90 else T
    numel = (num_splits * tokens * Hq * (D + 1) if global_merge else 0) + (0 if return_lse else T * Hq)
    # its last CTA merges: arrival counters
    fused = global_merge and (sm90 or getattr(config, "fused_merge", False))
    counters = (2 * B * Hkv if sm90 and config.dynamic else B * Hkv) if fused else 0
    return numel, counters


def reserve(device, numel: int, counters: int = 0) -> None:
    """Size this stream's workspaces for ``numel`` fp32 elements and ``counters`` int32 counters
    (:func:`workspace_numel`) now, so that no call or graph capture of those shapes allocates."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = device_stream_id(device)
    _workspace.get(device, numel, stream)
    if counters:
        _counters.get(device, counters, stream)


def _check_data(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, k_scale, v_scale, out, return_lse,
                num_splits, deterministic, q_scale=None, window_left=-1, sinks=None, workspace=None) -> None:
    """Checked mode (``CUTE_KERNELS_CHECK=1``): the data rules (docs/design/inputs.md#checked-mode)."""
    P, _, page = check_kv_cache(k, v, pair, kv_layout, q.shape[2])
    _check.lengths("seq_lens", seq_lens, block_table.shape[1] * page, q_len=q_len)
    _check.pages("block_table", block_table, seq_lens, page, P)
    _check.scales(k_scale=k_scale, v_scale=v_scale, q_scale=q_scale)


# forward-only, as the kernels: no autograd history, an out= that requires grad written in place
# (docs/design/inputs.md#the-classes)
@torch.no_grad()
def _reference(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, k_scale, v_scale, out, return_lse,
               num_splits, deterministic, q_scale=None, window_left=-1, sinks=None, workspace=None):
    res = reference.paged_decode(q, (k, v) if pair else k, block_table, seq_lens, kv_layout=kv_layout,
                                 q_len_per_req=q_len, sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale,
                                 v_scale=v_scale, return_lse=return_lse, window_left=window_left, sinks=sinks)
    if out is None:
        return res
    out.copy_(res[0] if return_lse else res)
    return (out, res[1]) if return_lse else out


def _check_call(override: dict, **kwargs):
    """A self-check's kernel call (:mod:`._decode_features`): this op past its guard and its launch
    cache, with ``override`` as the tuning override."""
    with features.unguarded(_launcher), _launcher.tuning_override(**override):
        return paged_decode(**kwargs)


_CALL_PARAMS = ("q", "k", "v", "block_table", "seq_lens", "out", "lse", "k_scale", "v_scale", "sinks", "window_left")
_REFERENCE = _Launch(None, None, None, reference=True)
_launcher = Launcher(_prepare, _reference, check_data=_check_data, op="paged_decode")
_cache = _launcher  # the launch cache under the name the lab's host-cost probe reads (profiling/host_costs.py)


@overload
def paged_decode(q: Tensor, kv_cache: KVCache, block_table: Tensor, seq_lens: Tensor, *, kv_layout: str = ...,
                 q_len_per_req: int = ..., sm_scale: float | None = ..., k_scale: Scale = ..., v_scale: Scale = ...,
                 out: Tensor | None = ..., return_lse: Literal[False] = ..., num_splits: int | None = ...,
                 deterministic: bool = ..., q_scale: Scale | None = ..., window_left: int = ...,
                 sinks: Tensor | None = ..., workspace: Tensor | None = ...) -> Tensor: ...
@overload
def paged_decode(q: Tensor, kv_cache: KVCache, block_table: Tensor, seq_lens: Tensor, *, kv_layout: str = ...,
                 q_len_per_req: int = ..., sm_scale: float | None = ..., k_scale: Scale = ..., v_scale: Scale = ...,
                 out: Tensor | None = ..., return_lse: Literal[True], num_splits: int | None = ...,
                 deterministic: bool = ..., q_scale: Scale | None = ..., window_left: int = ...,
                 sinks: Tensor | None = ..., workspace: Tensor | None = ...) -> tuple[Tensor, Tensor]: ...
@overload
def paged_decode(q: Tensor, kv_cache: KVCache, block_table: Tensor, seq_lens: Tensor, *, kv_layout: str = ...,
                 q_len_per_req: int = ..., sm_scale: float | None = ..., k_scale: Scale = ..., v_scale: Scale = ...,
                 out: Tensor | None = ..., return_lse: bool, num_splits: int | None = ...,
                 deterministic: bool = ..., q_scale: Scale | None = ..., window_left: int = ...,
                 sinks: Tensor | None = ..., workspace: Tensor | None = ...) -> Tensor | tuple[Tensor, Tensor]: ...
def paged_decode(
    q: Tensor,
    kv_cache: KVCache,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    kv_layout: str = "HND",
    q_len_per_req: int = 1,
    sm_scale: float | None = None,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    out: Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    deterministic: bool = True,
    q_scale: Scale | None = None,
    window_left: int = -1,
    sinks: Tensor | None = None,
    workspace: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Paged decode attention with a BF16/FP16 query and an FP8/BF16/FP16 KV cache.

    Semantics are those of :func:`cute_kernels.reference.paged_decode` (read its docstring):
    ``q`` ``[B * q_len_per_req, Hq, D]`` with ``stride(-1) == 1`` and ``stride(-2) == D`` (any
    token stride, so a slice of a fused QKV tensor works); ``kv_cache`` one HND/NHD tensor or a
    ``(k, v)`` tuple; ``block_table`` int32 ``[B, max_pages]``; ``seq_lens`` int32 ``[B]`` (total
    KV length including the new tokens); k/v scales as floats or 1-element fp32 device tensors of
    any rank, 0-d included (read on the device, so they may change between CUDA-graph replays).

    Supported here (the limits of :mod:`cute_kernels.plans.sm90_decode`, :mod:`cute_kernels.plans.sm100`
    and :mod:`cute_kernels.plans.sm80`): every arch from SM80 on (``sm90.decode`` on SM90,
    ``sm100.decode`` on SM100/103, the portable ``sm80.decode`` elsewhere and for what those refuse,
    e.g. an fp16 cache with a bf16 query), head_dim 64/128/256, page size 16/32/64/128, Hq / Hkv x
    q_len <= 64, a 16-bit cache of the query's dtype, an fp16 cache with a bf16 query, or an FP8 e4m3
    cache. ``num_splits`` (split-KV count)
    defaults to a shape-based heuristic. ``deterministic=False`` lets the split CTAs of a request
    take tile chunks dynamically from a counter (better balanced: docs/design/sm90-decode.md#dynamic-split-scheduling-opt-in),
    at the price of results that differ in the last bits from run to run (the tiles'
    accumulation order changes); the default keeps fixed ranges, so repeated calls and
    CUDA-graph replays are bitwise identical. Returns ``out`` (the query's dtype) and, with
    ``return_lse``, the base-2 LSE ``[B * q_len, Hq]`` fp32. CPU tensors run the reference, after
    the same validation (the SM90 kernel's limits included). Positions at or past the block table's
    capacity are not attended; a cache of no pages is refused (docs/design/inputs.md).

    On SM100 / SM103 the tcgen05 kernel ``sm100.decode`` serves the call. It is compile-verified
    only: each MMA family passes a one-time runtime self-check per process before its first launch
    (:mod:`cute_kernels.ops._selfcheck`), else ``sm80.decode`` serves it (logged; the reference for
    an FP8 query, a window or sinks). It also takes an
    FP8 query (``q_scale`` then required, float or 1-element fp32 tensor; the output is bf16),
    ``window_left`` (a query at position p sees keys p - window_left ... p; -1: no window) and
    ``sinks`` (fp32 ``[Hq]`` sink logits): see :func:`cute_kernels.reference.paged_decode`; on
    other archs but SM90 those three run the reference. On SM90, ``window_left`` and ``sinks``
    select the kernel's window / sink variants (available: verified by the GPU suite on the
    H200); an FP8 query runs the reference there.

    ``workspace``: optional caller-owned CUDA buffer (any dtype, contiguous, 16-byte aligned) that
    holds the split partials, the unused LSE target and the merge counters instead of the op's
    own per-stream buffers (the trtllm API's ``workspace_buffer``; docs/design/trtllm.md#workspace).
    """
    if compiling():  # torch.compile traces the registered op (the eager path never pays for it)
        return _traced(q, kv_cache, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale, v_scale,
                       out, return_lse, num_splits, deterministic, q_scale, window_left, sinks, workspace)
    k, v_part = cache_parts(kv_cache)
    pair, v = v_part is not None, k if v_part is None else v_part
    try:
        key = _key(q, k, v, pair, block_table, kv_layout, q_len_per_req, sm_scale, k_scale, v_scale, out,
                   return_lse, num_splits, deterministic, q_scale, window_left, sinks, workspace)
    except (AttributeError, TypeError):  # not tensors: the validation says what is wrong
        key = None
    launch = _launcher.entries.get(key)
    if launch is None or launch.reference:  # the argument tuple is built off the hot path only
        args = (q, k, v, pair, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale, v_scale, out,
                return_lse, num_splits, deterministic, q_scale, window_left, sinks, workspace)
        launch = launch or _launcher.lookup(key, args)
        if launch.reference:
            return _launcher.run_reference(args)
    if launch.sm100 is not None:  # the kernel, then the merge of its partials: both in the op's range
        if not _nvtx.ENABLED:
            return sm100.run(launch.sm100, q, k, v, block_table, seq_lens, out, return_lse, k_scale, v_scale,
                             q_scale, sinks, window_left)
        with _launcher.range(q=q, kv_cache=k, block_table=block_table):
            return sm100.run(launch.sm100, q, k, v, block_table, seq_lens, out, return_lse, k_scale, v_scale,
                             q_scale, sinks, window_left)
    if launch.empty:
        return _empty_result(q, out, launch.out_shape, return_lse)
    if out is None:
        out = torch.empty(launch.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(launch.out_shape[:2], dtype=torch.float32, device=q.device) if return_lse else launch.scratch_lse
    try:
        launch.fn(q, k, v, block_table, seq_lens, out, lse, k_scale, v_scale, sinks, window_left)
    except Exception:  # raises the error that names the argument
        _launcher.refused((q, k, v, pair, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale,
                           v_scale, out, return_lse, num_splits, deterministic, q_scale, window_left, sinks,
                           workspace))
        raise
    return (out, lse) if return_lse else out


def _empty_result(q, out, shape, return_lse):
    """The defined result of a call with nothing to attend (no rows, or a block table of no pages):
    0 and LSE -inf, without a launch (an FP8 query's output is bf16, as the kernels write it)."""
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16 if q.dtype == FP8 else q.dtype, device=q.device)
    if out.numel():
        out.zero_()
    lse = torch.full(shape[:2], -math.inf, dtype=torch.float32, device=q.device) if return_lse else None
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# torch.library: torch.ops.cute_kernels.paged_decode / paged_decode_out
# ---------------------------------------------------------------------------------------------


def _run(q, k_cache, v_cache, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale, k_scale_tensor,
         v_scale, v_scale_tensor, return_lse, num_splits, deterministic, q_scale, q_scale_tensor, window_left, sinks,
         workspace, out) -> Tensor:
    q_scale_arg = q_scale_tensor if q_scale_tensor is not None else q_scale
    res = paged_decode(q, cache_of(k_cache, v_cache), block_table, seq_lens, kv_layout=kv_layout,
                       q_len_per_req=q_len_per_req, sm_scale=sm_scale, k_scale=scale_of(k_scale, k_scale_tensor),
                       v_scale=scale_of(v_scale, v_scale_tensor), out=out, return_lse=return_lse,
                       num_splits=num_splits, deterministic=deterministic, q_scale=q_scale_arg,
                       window_left=window_left, sinks=sinks, workspace=workspace)
    return res[1] if return_lse else no_lse(q)


@custom_op("paged_decode", mutates=("workspace",))
def _paged_decode_op(q: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], block_table: Tensor, seq_lens: Tensor,
                     kv_layout: str, q_len_per_req: int, sm_scale: Optional[float], k_scale: float,
                     k_scale_tensor: Optional[Tensor], v_scale: float, v_scale_tensor: Optional[Tensor],
                     return_lse: bool, num_splits: Optional[int], deterministic: bool, q_scale: Optional[float],
                     q_scale_tensor: Optional[Tensor], window_left: int, sinks: Optional[Tensor],
                     workspace: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    out = library.attention_out(q)
    lse = _run(q, k_cache, v_cache, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale,
               k_scale_tensor, v_scale, v_scale_tensor, return_lse, num_splits, deterministic, q_scale,
               q_scale_tensor, window_left, sinks, workspace, out)
    return out, lse


@_paged_decode_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale, k_scale_tensor,
      v_scale, v_scale_tensor, return_lse, num_splits, deterministic, q_scale, q_scale_tensor, window_left, sinks,
      workspace):
    return library.attention_out(q), library.attention_lse(q, return_lse)


@custom_op("paged_decode_out", mutates=("workspace", "out"))
def _paged_decode_out_op(q: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], block_table: Tensor,
                         seq_lens: Tensor, kv_layout: str, q_len_per_req: int, sm_scale: Optional[float],
                         k_scale: float, k_scale_tensor: Optional[Tensor], v_scale: float,
                         v_scale_tensor: Optional[Tensor], return_lse: bool, num_splits: Optional[int],
                         deterministic: bool, q_scale: Optional[float], q_scale_tensor: Optional[Tensor],
                         window_left: int, sinks: Optional[Tensor], workspace: Optional[Tensor],
                         out: Tensor) -> Tensor:
    return _run(q, k_cache, v_cache, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale,
                k_scale_tensor, v_scale, v_scale_tensor, return_lse, num_splits, deterministic, q_scale,
                q_scale_tensor, window_left, sinks, workspace, out)


@_paged_decode_out_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale, k_scale_tensor,
      v_scale, v_scale_tensor, return_lse, num_splits, deterministic, q_scale, q_scale_tensor, window_left, sinks,
      workspace, out):
    return library.attention_lse(q, return_lse)


def _traced(q, kv_cache, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale, v_scale, out,
            return_lse, num_splits, deterministic, q_scale, window_left, sinks, workspace):
    """:func:`paged_decode` as torch.compile sees it: the op returns ``(out, lse)`` (an empty lse
    unless asked for), or only the lse when it writes the caller's ``out``; ``q_scale`` (None, a
    float or a tensor) goes as an optional float and an optional tensor."""
    q_scales = (None, None) if q_scale is None else scale_parts(q_scale)
    args = (q, *cache_parts(kv_cache), block_table, seq_lens, kv_layout, q_len_per_req, sm_scale,
            *scale_parts(k_scale), *scale_parts(v_scale), return_lse, num_splits, deterministic, *q_scales,
            window_left, sinks, workspace)
    if out is None:
        out, lse = _paged_decode_op(*args)
    else:
        lse = _paged_decode_out_op(*args, out)
    return (out, lse) if return_lse else out
