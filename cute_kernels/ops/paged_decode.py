"""``cute_kernels.paged_decode``: paged decode attention on SM90 (CuTe-DSL kernel).

The host side only looks at shapes, dtypes, strides and pointers: it never reads tensor data
and never synchronizes, so a call captures in a CUDA graph (after a warm-up call has compiled
the variant). Split-KV workspaces are allocated once per device and reused.

Host overhead: the first call with a new combination of shapes/strides/dtypes validates
everything and builds a :class:`_Launch` (kernel, argument order, workspace views, bound once as
TVM-FFI tensors so that they are not converted again at every call); later calls with the same
combination look it up by a tuple of the attributes that select the kernel and go straight to the
TVM-FFI call, which checks dtype, rank, static and shared extents, devices and alignment of every
argument itself. When it refuses one, the call is validated in full for a clear error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from .. import reference
from .._nvtx import ENABLED as _NVTX
from .._nvtx import op_range
from .._types import KVCache, Scale
from ..jit.compiler import get_kernel
from ..sm90.decode import CLUSTER_MIN_SIZING, DEFAULT_CLUSTER, MAX_CLUSTER, cluster_fits, make_decode_config
from ._launch import LaunchCache, TuningOverride
from ._torch import DeviceBuffer, check_tensor, compile_target, device_sm_count, dtype_name, ffi_tensor

FP8 = torch.float8_e4m3fn
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32, 64, 128)
MAX_ROWS = 64  # group * q_len: the WGMMA N of one CTA
MAX_SPLITS = 64


# CTAs per SM to aim for with an FP8 cache, by head dim (measured, profiling/NOTES.md "v4", "v5"):
# D=64 runs 128-token tiles (see FP8_D64_TILE) and does best unsplit at up to 3 CTAs/SM; large
# tiles want deeper pipelines (D=256: 2 CTAs with 3 stages beat 3 with 2).
_FP8_CTAS_PER_SM = {64: 3, 128: 3, 256: 2}
# ... and the fewest CTAs per SM the kernel is sized for: D=64 (128-token tiles) lands on 2 CTAs/SM
# for B=32 x 8 heads, yet the kernel sized for 3 (4 stages) beats the one sized for 2 (7 stages):
# 69.3 vs 73.0 us (profiling/NOTES.md "decode v5"); D=256 likewise (B=32 x 8 heads, unsplit):
# sized for 3 (2 stages) 242-249 us against 251-258 sized for 2 (3 stages), four runs of the
# seventh session (NOTES "decode v7")
_FP8_MIN_SIZING = {64: 3, 256: 3}
# deterministic=False: dynamic split scheduling when each split has at least this many tiles (with
# a tile or two per split, as B=1, the chunk counter's round trips cost more than balancing gains)
DYNAMIC_MIN_TILES = 8


def choose_schedule(items: int, max_context: int, num_sms: int, max_occupancy: int, tile: int = 64,
                    target_per_sm: int | None = None) -> tuple[int, int]:
    """``(num_splits, CTAs per SM)`` from shapes only (the block-table width bounds the context).

    ``items`` = requests x KV heads. When they cannot fill the GPU, split each request's context
    so that about ``target_per_sm`` CTAs land on every SM in a single wave (a second, partial
    wave runs alone: measured 63 % of roofline for Qwen3 B=8 with 416 CTAs on 396 slots); then
    size the kernel for the CTAs per SM that actually result, which frees shared memory for more
    pipeline stages when fewer CTAs share an SM.
    """
    target = min(target_per_sm or max_occupancy, max_occupancy)
    max_tiles = max(1, math.ceil(max_context / tile))
    splits = 1
    if items < num_sms * target:
        splits = max(1, min(MAX_SPLITS, max_tiles, (num_sms * target) // max(items, 1)))
    per_sm = max(1, min(max_occupancy, math.ceil(items * splits / num_sms)))
    return splits, per_sm


def use_cluster_merge(items: int, num_splits: int, num_sms: int) -> bool:
    """Whether a split launch merges in thread-block clusters (DSMEM) rather than through global
    memory: at most MAX_CLUSTER splits and at most one CTA per SM in all. The cluster saves the
    merge's global round trips, which matter in latency-bound launches (Llama B1: 5.4 -> 4.5 us);
    a grid that fills the GPU with several CTAs per SM lost to the clusters' co-scheduling
    (Qwen3 B8 FP8, 12-CTA clusters at 3 per SM: 70.4 -> 89.6 us). Measured: profiling/NOTES.md
    "tenth session"."""
    return 2 <= num_splits <= MAX_CLUSTER and items * num_splits <= num_sms


def plan_launch(items: int, max_context: int, num_sms: int, max_occupancy: int, tile: int, head_dim: int,
                fp8: bool, num_splits: int | None, deterministic: bool, force_cluster: bool | None,
                force_dynamic: bool = False) -> tuple[int, dict, bool]:
    """``(num_splits, tuning fields, cluster merge)`` of a launch, from shapes only. The split
    count and sizing come from :func:`launch_schedule`; a non-deterministic call with enough tiles
    per split schedules them dynamically; the cluster merge (``force_cluster`` None: the rule
    :func:`use_cluster_merge`, for a kernel that can be sized for CLUSTER_MIN_SIZING CTAs per SM;
    True: whenever the split count allows; False: never; never with a dynamic split) is decided
    before the sizing, which it raises to CLUSTER_MIN_SIZING."""
    num_splits, per_sm = launch_schedule(items, max_context, num_sms, max_occupancy, tile, head_dim, fp8, num_splits)
    split = num_splits > 1
    auto_dynamic = not deterministic and split and math.ceil(max_context / tile) >= DYNAMIC_MIN_TILES * num_splits
    dynamic = auto_dynamic or (split and force_dynamic)
    if force_cluster is None:
        # the clusters won only sized for CLUSTER_MIN_SIZING CTAs per SM (sized for one, 16-CTA
        # clusters waited for a second wave): a kernel that cannot be sized so keeps the global merge
        cluster = (DEFAULT_CLUSTER and not dynamic and max_occupancy >= CLUSTER_MIN_SIZING
                   and use_cluster_merge(items, num_splits, num_sms))
    else:
        cluster = bool(force_cluster) and not dynamic and 2 <= num_splits <= MAX_CLUSTER
    if cluster:
        per_sm = max(per_sm, CLUSTER_MIN_SIZING)
    tuning = {} if per_sm >= max_occupancy else dict(occupancy=per_sm)
    if auto_dynamic:
        tuning["dynamic"] = True
    return num_splits, tuning, cluster


def plan_config(config_for: Callable[..., Any], items: int, max_context: int, num_sms: int,
                num_splits: int | None, deterministic: bool, force_cluster: bool | None,
                force_dynamic: bool = False) -> tuple[int, Any]:
    """``(num_splits, config)`` of a launch: :func:`plan_launch` on the variant ``config_for(split,
    **tuning)`` builds, then the config it asks for. When the plan wants a cluster merge but the
    partials do not fit that config's K stages (:func:`cluster_fits`), the launch is planned
    again without the cluster, so it does not keep the sizing raised for one."""
    probe = config_for(False)
    fp8 = probe.kv_dtype == "fp8_e4m3"
    args = (items, max_context, num_sms, probe.occupancy, probe.tile, probe.head_dim, fp8, num_splits, deterministic)
    splits, tuning, cluster = plan_launch(*args, force_cluster, force_dynamic)
    config = config_for(splits > 1, **tuning)
    if cluster:
        if cluster_fits(config):
            return splits, dataclasses.replace(config, cluster=True)
        splits, tuning, _ = plan_launch(*args, False, force_dynamic)
        config = config_for(splits > 1, **tuning)
    return splits, config


def launch_schedule(items: int, max_context: int, num_sms: int, max_occupancy: int, tile: int, head_dim: int,
                    fp8: bool, num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, CTAs per SM the kernel is sized for)`` of a launch, from shapes only:
    :func:`choose_schedule` with the FP8 per-head-dim targets, a caller's ``num_splits`` kept (then
    sized for the kernel's maximum), and FP8 sizing never below ``_FP8_MIN_SIZING``."""
    splits, per_sm = choose_schedule(items, max_context, num_sms, max_occupancy, tile,
                                     _FP8_CTAS_PER_SM.get(head_dim) if fp8 else None)
    if num_splits is not None:
        splits, per_sm = num_splits, max_occupancy
    if fp8:
        per_sm = max(per_sm, _FP8_MIN_SIZING.get(head_dim, 1))
    return splits, per_sm


# split partials / unused LSE targets, and the fused merge's arrival counters (zero between
# launches: the last CTA of each (request, KV head) resets its counter)
_workspace = DeviceBuffer("paged_decode", torch.float32)
_counters = DeviceBuffer("paged_decode", torch.int32, zero=True, min_numel=4096)


_CALL_ARGS = ("q", "k", "v", "block_table", "seq_lens", "out", "lse", "k_scale", "v_scale")
_SOURCE = {"q": "q", "kv_cache": "k", "k_cache": "k", "v_cache": "v", "block_table": "block_table",
           "seq_lens": "seq_lens", "out": "out", "lse": "lse", "k_scale": "k_scale", "v_scale": "v_scale"}


def _make_caller(fn, order, constants: dict):
    """A function of the per-call tensors that calls ``fn`` with its arguments in ``order`` (the
    config's signature), the per-key constants (workspace views, sm_scale) bound in: no dict or
    list is built per call."""
    args = ", ".join(_SOURCE.get(name, name) for name in order)
    env = {"fn": fn, **constants}
    exec(f"def call({', '.join(_CALL_ARGS)}):\n    fn({args})\n", env)  # noqa: S102 - fixed template
    return env["call"]


@dataclass
class _Launch:
    """Everything a call needs that depends only on its key (shapes, strides, dtypes...)."""

    fn: object  # caller of the compiled kernel with the workspace views bound (see _make_caller)
    scratch_lse: object  # LSE target (a TVM-FFI tensor) when the caller did not ask for it
    out_shape: tuple
    reference: bool = False


_cache = LaunchCache()


def tuning_override(**fields: object) -> TuningOverride:
    """``with tuning_override(widen="bits", tile=128): ...`` forces kernel tuning fields (for
    benchmarks comparing variants). The override is part of the launch-cache key. ``cluster``
    is a launch choice: ``False`` never merges in clusters, ``True`` does whenever the split
    count allows (at most MAX_CLUSTER), absent leaves it to :func:`use_cluster_merge`."""
    return _cache.tuning_override(**fields)


def _key(q, k, v, pair, block_table, kv_layout, q_len, sm_scale, k_scale, v_scale, out, return_lse, num_splits,
         deterministic):
    """What selects the kernel, its schedule and its workspace: the query and cache geometry,
    the block-table width, the options. Left out is what the compiled function checks on every
    call (TVM-FFI): the dtypes of the other tensors, shapes tied to the query's or the cache's by
    a shared extent (seq_lens, out, V), every device against the query's, pointer and stride
    alignment. A call that fails one of those checks is validated in full by :func:`_prepare`,
    whose error names the argument (see :func:`paged_decode`)."""
    # type(), not isinstance(): torch.Tensor's metaclass makes isinstance cost ~0.15 us here
    return (q.shape, q.stride(), q.dtype, q.device, pair, k.shape, k.stride(), k.dtype, block_table.shape,
            kv_layout, q_len, sm_scale, type(k_scale), type(v_scale), out is None, return_lse, num_splits,
            deterministic, _cache.override_key)


def _check_scale(name: str, value, device):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32:
            raise ValueError(f"{name} must be a float or a 1-element float32 tensor, got {value.dtype} {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} must be on {device}, got {value.device}")
        return True
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float or a 1-element float32 tensor, got {value!r}")
    return False


def _prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, k_scale, v_scale, out, return_lse,
             num_splits, deterministic) -> _Launch:
    """Full validation (clear errors naming the argument) and kernel selection for one key."""
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float16), ndim=3)
    T, Hq, D = q.shape
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    if pair:
        check_tensor("k_cache", k, ndim=4)
        check_tensor("v_cache", v, ndim=4)
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(f"k_cache and v_cache must match, got {tuple(k.shape)} {k.dtype} / {tuple(v.shape)} {v.dtype}")
        k4 = k
    else:
        check_tensor("kv_cache", k, ndim=5)
        if k.shape[1] != 2:
            raise ValueError(f"kv_cache must be [P, 2, ...] (K and V), got shape {tuple(k.shape)}")
        k4 = k[:, 0]
    P, Hkv, page, Dk = k4.shape if kv_layout == "HND" else (k4.shape[0], k4.shape[2], k4.shape[1], k4.shape[3])
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has {D}, kv_cache has {Dk}")
    if not isinstance(q_len, int) or q_len < 1:
        raise ValueError(f"q_len_per_req must be a positive int, got {q_len!r}")
    ks_t = _check_scale("k_scale", k_scale, q.device)
    vs_t = _check_scale("v_scale", v_scale, q.device)
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale}")
    if not q.is_cuda:
        return _Launch(None, None, (T, Hq, D), reference=True)
    device = q.device
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {D}")
    if page not in PAGE_SIZES:
        raise ValueError(f"page size must be one of {PAGE_SIZES}, got {page}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"num q heads ({Hq}) must be a multiple of num kv heads ({Hkv})")
    group = Hq // Hkv
    if group * q_len > MAX_ROWS:
        raise ValueError(f"Hq/Hkv x q_len_per_req must be <= {MAX_ROWS}, got {group} x {q_len}")
    if q.stride(-2) != D and Hq > 1:
        raise ValueError(f"q must have contiguous heads (stride(-2) == head_dim {D}), got strides {q.stride()}")
    check_tensor("q", q, device=device, align_bytes=16)
    if k.dtype not in (FP8, q.dtype):
        raise TypeError(f"kv_cache dtype must be float8_e4m3fn or the query's dtype {q.dtype}, got {k.dtype}")
    for name, t in ((("k_cache", k), ("v_cache", v)) if pair else (("kv_cache", k),)):
        check_tensor(name, t, device=device, align_bytes=16)  # TMA: 16-byte aligned base and strides
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
    B = block_table.shape[0]
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(B,), device=device)
    if T != B * q_len:
        raise ValueError(f"q has {T} rows; expected batch {B} x q_len_per_req {q_len}")
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=(T, Hq, D), device=device)

    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {deterministic!r}")

    override = dict(_cache.override)
    # cluster: None = the rule (use_cluster_merge), True = whenever the split count allows, False = never
    force_cluster = override.pop("cluster", None)

    def config_for(split, **tuning):
        return make_decode_config(
            q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype), head_dim=D, group=group, q_len=q_len,
            page_size=page, split=split, k_scale_tensor=ks_t, v_scale_tensor=vs_t,
            kv_form="pair" if pair else "single", kv_layout=kv_layout, **{**tuning, **override},
        )

    num_splits, config = plan_config(config_for, B * Hkv, block_table.shape[1] * page,
                                     device_sm_count(device.index or 0), num_splits, deterministic, force_cluster,
                                     bool(override.get("dynamic", False)))
    split = num_splits > 1
    target = compile_target(device)
    fn = get_kernel(config, target)
    part_o = part_lse = scratch = counters = None
    lse_numel = T * Hq
    global_merge = split and not config.cluster  # a cluster merges in shared memory: no workspace
    part_numel = num_splits * T * Hq * D if global_merge else 0
    plse_numel = num_splits * lse_numel if global_merge else 0
    ws = _workspace.get(device, part_numel + plse_numel + (0 if return_lse else lse_numel))
    if global_merge:
        part_o = ws[:part_numel].view(num_splits, T, Hq, D)
        part_lse = ws[part_numel:part_numel + plse_numel].view(num_splits, T, Hq)
        # arrival counters, then (dynamic split) the tile-chunk counters
        counters = _counters.get(device, 2 * B * Hkv if config.dynamic else B * Hkv)
    if not return_lse:
        base = part_numel + plse_numel
        scratch = ffi_tensor(ws[base:base + lse_numel].view(T, Hq))
    order = tuple(a.name for a in config.signature())
    caller = _make_caller(fn, order, dict(part_out=ffi_tensor(part_o), part_lse=ffi_tensor(part_lse),
                                          counters=ffi_tensor(counters), sm_scale=scale, num_splits=num_splits))
    return _Launch(caller, scratch, (T, Hq, D))


@overload
def paged_decode(q: torch.Tensor, kv_cache: KVCache, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                 kv_layout: str = ..., q_len_per_req: int = ..., sm_scale: float | None = ..., k_scale: Scale = ...,
                 v_scale: Scale = ..., out: torch.Tensor | None = ..., return_lse: Literal[False] = ...,
                 num_splits: int | None = ..., deterministic: bool = ...) -> torch.Tensor: ...
@overload
def paged_decode(q: torch.Tensor, kv_cache: KVCache, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                 kv_layout: str = ..., q_len_per_req: int = ..., sm_scale: float | None = ..., k_scale: Scale = ...,
                 v_scale: Scale = ..., out: torch.Tensor | None = ..., return_lse: Literal[True],
                 num_splits: int | None = ..., deterministic: bool = ...) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def paged_decode(q: torch.Tensor, kv_cache: KVCache, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                 kv_layout: str = ..., q_len_per_req: int = ..., sm_scale: float | None = ..., k_scale: Scale = ...,
                 v_scale: Scale = ..., out: torch.Tensor | None = ..., return_lse: bool,
                 num_splits: int | None = ..., deterministic: bool = ...
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def paged_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_layout: str = "HND",
    q_len_per_req: int = 1,
    sm_scale: float | None = None,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    deterministic: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged decode attention with a BF16/FP16 query and an FP8/BF16/FP16 KV cache.

    Semantics are those of :func:`cute_kernels.reference.paged_decode` (read its docstring):
    ``q`` ``[B * q_len_per_req, Hq, D]`` with ``stride(-1) == 1`` and ``stride(-2) == D`` (any
    token stride, so a slice of a fused QKV tensor works); ``kv_cache`` one HND/NHD tensor or a
    ``(k, v)`` tuple; ``block_table`` int32 ``[B, max_pages]``; ``seq_lens`` int32 ``[B]`` (total
    KV length including the new tokens); k/v scales as floats or 1-element fp32 device tensors
    (read on the device, so they may change between CUDA-graph replays).

    Supported here: SM90, head_dim 64/128/256, page size 16/32/64/128, Hq / Hkv x q_len <= 64,
    a 16-bit cache of the query's dtype or an FP8 e4m3 cache. ``num_splits`` (split-KV count)
    defaults to a shape-based heuristic. ``deterministic=False`` lets the split CTAs of a request
    take tile chunks dynamically from a counter (better balanced: Qwen3 B=8 ctx 32000 FP8 83 ->
    86 % of roofline), at the price of results that differ in the last bits from run to run (the
    tiles' accumulation order changes); the default keeps fixed ranges, so repeated calls and
    CUDA-graph replays are bitwise identical. Returns ``out`` (the query's dtype) and, with
    ``return_lse``, the base-2 LSE ``[B * q_len, Hq]`` fp32. CPU tensors run the reference.
    """
    pair = isinstance(kv_cache, (tuple, list))
    if pair and len(kv_cache) != 2:
        raise ValueError("kv_cache tuple must be (k_cache, v_cache)")
    k = kv_cache[0] if pair else kv_cache
    v = kv_cache[1] if pair else kv_cache
    try:
        key = _key(q, k, v, pair, block_table, kv_layout, q_len_per_req, sm_scale, k_scale, v_scale, out,
                   return_lse, num_splits, deterministic)
        launch = _cache.entries.get(key)
    except (AttributeError, TypeError):  # not tensors: let the validation say what is wrong
        key, launch = None, None
    if launch is None:
        launch = _prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale,
                          v_scale, out, return_lse, num_splits, deterministic)
        if key is not None:
            _cache.put(key, launch)
    else:  # float scales are call arguments, not part of the key: check their values here
        # (a float in range passes the first test; a tensor's shape, dtype and device are checked
        # by the compiled function; _check_scale accepts positive ints and raises for the rest)
        if not (type(k_scale) is float and 0.0 < k_scale < math.inf) and type(k_scale) is not torch.Tensor:
            _check_scale("k_scale", k_scale, q.device)
        if not (type(v_scale) is float and 0.0 < v_scale < math.inf) and type(v_scale) is not torch.Tensor:
            _check_scale("v_scale", v_scale, q.device)
    if launch.reference:  # no compiled function checks the arguments here: validate every call
        _prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale, v_scale, out,
                 return_lse, num_splits, deterministic)
        return reference.paged_decode(q, kv_cache, block_table, seq_lens, kv_layout=kv_layout,
                                      q_len_per_req=q_len_per_req, sm_scale=sm_scale, k_scale=k_scale,
                                      v_scale=v_scale, return_lse=return_lse)
    if out is None:
        out = torch.empty(launch.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(launch.out_shape[:2], dtype=torch.float32, device=q.device) if return_lse else launch.scratch_lse
    if launch.out_shape[0]:
        try:
            if _NVTX:
                with op_range("paged_decode", q=q, kv_cache=k, block_table=block_table):
                    launch.fn(q, k, v, block_table, seq_lens, out, lse, k_scale, v_scale)
            else:
                launch.fn(q, k, v, block_table, seq_lens, out, lse, k_scale, v_scale)
        except Exception:
            # The compiled function refused an argument the launch key leaves to it (see _key):
            # validate in full so that the error names the argument and what was expected.
            _prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, k_scale, v_scale,
                     out, return_lse, num_splits, deterministic)
            raise
    return (out, lse) if return_lse else out

