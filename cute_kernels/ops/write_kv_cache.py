"""``cute_kernels.write_kv_cache``: write new K/V into the paged cache (CuTe-DSL kernel on CUDA).

Runs once per attention layer per step, so the host path is short: on the shared launcher
(:mod:`cute_kernels.ops._launch`) the first call with a new combination of
shapes/strides/dtypes/alignments validates everything and prepares the kernel's caller; later calls
look it up by a tuple of cheap tensor attributes. Nothing here reads tensor data or synchronizes,
so a call captures in a CUDA graph once compiled. Registered as
``torch.ops.cute_kernels.write_kv_cache``, which declares the caches it writes
(:mod:`cute_kernels.ops._library`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import reference
from .._types import KVCache, Scale
from ..jit.compiler import get_kernel
from ..jit.spec import check_override
from ..plans.write_kv_cache import WriteKVCacheConfig, make_write_config
from . import _check
from ._device import current_device, on_device, served_device
from ._launch import Launcher, TuningOverride, check_scale
from ._library import cache_of, cache_parts, compiling, custom_op, scale_of, scale_parts
from ._torch import check_page_size, check_tensor, compile_target, dtype_name, overlap
from .quantize_query import vector_width

FP8 = torch.float8_e4m3fn
_IN_DTYPES = (torch.bfloat16, torch.float16)
# what a call's arguments decide (the vector width: the widest its tensors allow); items and pdl are tuning
_FIXED = ("in_dtype", "cache_dtype", "head_dim", "page_size", "vec", "slot_dtype", "kv_form", "kv_layout",
          "k_scale_tensor", "v_scale_tensor")
_CACHE_DTYPES = (torch.bfloat16, torch.float16, FP8)
_UINT8_HINT = ("an FP8 cache stored as uint8 is ambiguous; view it as float8_e4m3fn "
               "(cache.view(torch.float8_e4m3fn))")


def _check_cache_dtype(name: str, t):
    if isinstance(t, torch.Tensor) and t.dtype == torch.uint8:
        raise TypeError(f"{name} has dtype uint8: {_UINT8_HINT}")
    check_tensor(name, t, dtype=_CACHE_DTYPES)


def _cache_geometry(kv_cache, kv_layout: str, device) -> tuple[bool, tuple, list]:
    """(pair, (P, Hkv, page, D), cache tensors) after validating the cache container."""
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    pair = isinstance(kv_cache, (tuple, list))
    if pair:
        if len(kv_cache) != 2:
            raise ValueError("kv_cache tuple must be (k_cache, v_cache)")
        k, v = kv_cache
        for name, t in (("k_cache", k), ("v_cache", v)):
            _check_cache_dtype(name, t)
            check_tensor(name, t, ndim=4, device=device, output=True)
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(f"k_cache and v_cache must match, got {tuple(k.shape)} {k.dtype} / "
                             f"{tuple(v.shape)} {v.dtype}")
        if overlap(k, v):  # one kernel writes both: which of K and V a shared slot kept would be a race
            raise ValueError("v_cache must not overlap k_cache (a K and a V row would share cache bytes)")
        shape4, tensors = tuple(k.shape), [k, v]
    else:
        _check_cache_dtype("kv_cache", kv_cache)
        check_tensor("kv_cache", kv_cache, ndim=5, device=device, output=True)
        if kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [P, 2, ...] (K and V), got shape {tuple(kv_cache.shape)}")
        s = kv_cache.shape
        shape4, tensors = (s[0], s[2], s[3], s[4]), [kv_cache]
    P, a, b, D = shape4
    Hkv, page = (a, b) if kv_layout == "HND" else (b, a)
    check_page_size("k_cache" if pair else "kv_cache", tensors[0], page, kv_layout)
    return pair, (P, Hkv, page, D), tensors


def check_tuning_override(override: dict) -> None:
    """The tuning override's fields: ``items`` and ``pdl`` of the field's type; the others are the
    call's (:func:`cute_kernels.jit.spec.check_override`). ``ValueError`` / ``TypeError`` naming
    the field, before any config is built."""
    check_override(WriteKVCacheConfig, override, fixed=_FIXED)


def make_config(key: Tensor, value: Tensor, kv_cache: KVCache, slot_mapping: Tensor, kv_layout: str,
                k_scale_tensor: bool, v_scale_tensor: bool) -> WriteKVCacheConfig:
    """The kernel variant for validated arguments (host-only: dtypes, shapes, strides, pointers)."""
    pair, (_, _, page, D), caches = _cache_geometry(kv_cache, kv_layout, key.device)
    check_tuning_override(_launcher.override)
    return make_write_config(
        in_dtype=dtype_name(key.dtype), cache_dtype=dtype_name(caches[0].dtype), head_dim=D, page_size=page,
        vec=vector_width(D, [key, value, *caches]), slot_dtype=dtype_name(slot_mapping.dtype),
        kv_form="pair" if pair else "single", kv_layout=kv_layout, k_scale_tensor=k_scale_tensor,
        v_scale_tensor=v_scale_tensor, override=_launcher.override)


def _key(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale):
    def t(x):
        return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16)

    def s(x):
        return (x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else None

    # a pair's key holds the planes' offset: an overlap of the two (one plane passed twice) is
    # refused by _prepare, which sees every offset once
    cache = ((t(kv_cache[0]), t(kv_cache[1]), "pair", kv_cache[1].data_ptr() - kv_cache[0].data_ptr())
             if isinstance(kv_cache, (tuple, list)) else t(kv_cache))
    return (t(key), t(value), cache, slot_mapping.shape, slot_mapping.stride(), slot_mapping.dtype,
            slot_mapping.device, kv_layout, s(k_scale), s(v_scale), _launcher.override_key,
            current_device() if key.is_cuda else -1)


class _Launch:
    __slots__ = ("call", "reference", "pair", "empty")

    def __init__(self, call, reference, pair, empty=False):
        self.call, self.reference, self.pair, self.empty = call, reference, pair, empty


def tuning_override(**fields: object) -> TuningOverride:
    """``with tuning_override(items=2): ...`` forces kernel config fields (benchmarks comparing
    variants); the override is part of the launch-cache key."""
    return _launcher.tuning_override(**fields)


def _prepare(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale) -> _Launch:
    """Full validation (errors name the argument) and kernel selection for one key."""
    check_tensor("key", key, dtype=_IN_DTYPES, ndim=3)
    device = served_device("key", key)
    T, Hkv, D = key.shape
    check_tensor("value", value, dtype=key.dtype, shape=(T, Hkv, D), device=device)
    pair, (P, cHkv, page, cD), caches = _cache_geometry(kv_cache, kv_layout, device)
    if cD != D:
        raise ValueError(f"head dim mismatch: key has {D}, kv_cache has {cD}")
    if cHkv != Hkv:
        raise ValueError(f"num kv heads mismatch: key has {Hkv}, kv_cache ({kv_layout}) has {cHkv}")
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(T,), device=device)
    k_tensor = check_scale("k_scale", k_scale, device=device)
    v_tensor = check_scale("v_scale", v_scale, device=device)
    # the kernel's own limits (vector width, head dim), checked for CPU tensors too
    config = make_config(key, value, kv_cache, slot_mapping, kv_layout, k_tensor, v_tensor)
    if not key.is_cuda:
        return _Launch(None, True, pair)
    if T == 0 or Hkv == 0 or D == 0 or P == 0:
        # nothing to write: no rows, heads or head dims, or a cache of no pages (every slot is outside it, and slots
        # outside the cache are skipped): no launch, no compiled variant (docs/design/inputs.md#kv-pool)
        return _Launch(None, False, pair, empty=True)
    target = compile_target(device)
    if target not in config.targets:  # SM80/86 have no FP8 conversion instructions: torch path
        return _Launch(None, True, pair)
    # a tensor scale other than 1-D (a 1-element tensor of any rank) goes as a [1] view
    sources = {name: f"{name}.view(1)" for name, t, is_t in (("k_scale", k_scale, k_tensor), ("v_scale", v_scale, v_tensor))
               if is_t and t.dim() != 1}
    return _Launch(on_device(_launcher.bind(_CALL_PARAMS, (get_kernel(config, target), config.signature(), sources, None)),
                             device), False, pair)


# forward-only, as the kernels: no autograd history, an out= that requires grad written in place
# (docs/design/inputs.md#the-classes)
@torch.no_grad()
def _reference(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale):
    reference.write_kv_cache(key, value, kv_cache, slot_mapping, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale)


def _check_data(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale) -> None:
    """Checked mode (``CUTE_KERNELS_CHECK=1``): slots inside the cache, scales positive and finite."""
    _, (P, _, page, _), _ = _cache_geometry(kv_cache, kv_layout, key.device)
    _check.slots("slot_mapping", slot_mapping, P * page)
    _check.scales(k_scale=k_scale, v_scale=v_scale)


_CALL_PARAMS = ("key", "value", "k_cache", "v_cache", "slot_mapping", "k_scale", "v_scale")
_launcher = Launcher(_prepare, _reference, check_data=_check_data, op="write_kv_cache")


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    kv_cache: KVCache,
    slot_mapping: Tensor,
    *,
    kv_layout: str = "HND",
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> None:
    """Write new keys/values into the paged KV cache, in place.

    Semantics are those of :func:`cute_kernels.reference.write_kv_cache` (identical codes).

    Args:
        key, value: bf16/fp16 ``[T, Hkv, D]``, last dim contiguous, other strides free (slices
            of a fused QKV projection work without a copy).
        kv_cache: one ``[P, 2, Hkv, page, D]`` (HND) / ``[P, 2, page, Hkv, D]`` (NHD) tensor or a
            ``(k_cache, v_cache)`` tuple of 4-D halves; bf16, fp16 or float8_e4m3fn; last dim
            contiguous, other strides free.
        slot_mapping: int32/int64 ``[T]``: token i goes to page ``s // page``, offset
            ``s % page`` of ``s = slot_mapping[i]``. ``-1`` (padding) and any slot outside
            ``[0, P * page)`` is skipped: nothing is ever written out of bounds (a cache of no
            pages is then written nothing, without a launch).
        kv_layout: ``"HND"`` or ``"NHD"``.
        k_scale, v_scale: positive floats or 1-element fp32 device tensors (read by the kernel,
            CUDA-graph safe). The cache stores ``x / scale``: saturated RNE for FP8, an RNE cast
            for bf16/fp16.

    CPU tensors run the reference, and so does an FP8 cache on SM80/86 (no FP8 conversion
    instructions there; that torch path reads the slots on the host, so it is not graph-capturable).
    """
    if compiling():  # torch.compile traces the registered op (the eager path never pays for it)
        _write_kv_cache_op(key, value, *cache_parts(kv_cache), slot_mapping, kv_layout, *scale_parts(k_scale),
                           *scale_parts(v_scale))
        return
    try:
        launch_key = _key(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale)
    except (AttributeError, TypeError, ValueError, IndexError):  # not tensors: the validation says what is wrong
        launch_key = None
    launch = _launcher.entries.get(launch_key)
    if launch is None or launch.reference:  # the argument tuple is built off the hot path only
        args = (key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale)
        launch = launch or _launcher.lookup(launch_key, args)
        if launch.reference:
            _launcher.run_reference(args)
            return
    if launch.empty:
        return
    k_cache, v_cache = (kv_cache[0], kv_cache[1]) if launch.pair else (kv_cache, kv_cache)
    try:
        launch.call(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    except Exception:
        _launcher.refused((key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale))  # raises the error that names the argument
        raise


# ---------------------------------------------------------------------------------------------
# torch.library: torch.ops.cute_kernels.write_kv_cache (it writes the caches)
# ---------------------------------------------------------------------------------------------


@custom_op("write_kv_cache", mutates=("k_cache", "v_cache"))
def _write_kv_cache_op(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], slot_mapping: Tensor,
                       kv_layout: str, k_scale: float, k_scale_tensor: Optional[Tensor], v_scale: float,
                       v_scale_tensor: Optional[Tensor]) -> None:
    write_kv_cache(key, value, cache_of(k_cache, v_cache), slot_mapping, kv_layout=kv_layout,
                   k_scale=scale_of(k_scale, k_scale_tensor), v_scale=scale_of(v_scale, v_scale_tensor))


@_write_kv_cache_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, kv_layout, k_scale, k_scale_tensor, v_scale, v_scale_tensor):
    return None
