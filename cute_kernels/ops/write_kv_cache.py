"""``cute_kernels.write_kv_cache``: write new K/V into the paged cache (CuTe-DSL kernel on CUDA).

Runs once per attention layer per step, so the host path is short: the first call with a new
combination of shapes/strides/dtypes/alignments validates everything and caches the kernel and
its argument order; later calls look that up by a tuple of cheap tensor attributes. Nothing here
reads tensor data or synchronizes, so a call captures in a CUDA graph once compiled.
"""

from __future__ import annotations

import torch

from .. import reference
from .._nvtx import op_range
from .._types import KVCache, Scale
from ..common.kv_write import WriteKVCacheConfig
from ..jit.compiler import get_kernel
from ._launch import LaunchCache, TuningOverride
from ._torch import check_tensor, compile_target, dtype_name
from .quantize_query import check_scale, vector_width

FP8 = torch.float8_e4m3fn
_IN_DTYPES = (torch.bfloat16, torch.float16)
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
            check_tensor(name, t, ndim=4, device=device)
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(f"k_cache and v_cache must match, got {tuple(k.shape)} {k.dtype} / "
                             f"{tuple(v.shape)} {v.dtype}")
        shape4, tensors = tuple(k.shape), [k, v]
    else:
        _check_cache_dtype("kv_cache", kv_cache)
        check_tensor("kv_cache", kv_cache, ndim=5, device=device)
        if kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [P, 2, ...] (K and V), got shape {tuple(kv_cache.shape)}")
        s = kv_cache.shape
        shape4, tensors = (s[0], s[2], s[3], s[4]), [kv_cache]
    P, a, b, D = shape4
    Hkv, page = (a, b) if kv_layout == "HND" else (b, a)
    return pair, (P, Hkv, page, D), tensors


# (token, head) rows per thread: profiling/NOTES.md "layer glue v2"
DEFAULT_ITEMS = 1
DEFAULT_PDL = True  # programmatic dependent launch: the launch overlaps the previous kernel's tail


def make_config(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor,
                kv_layout: str, k_scale_tensor: bool, v_scale_tensor: bool) -> WriteKVCacheConfig:
    """The kernel variant for validated arguments (host-only: dtypes, shapes, strides, pointers)."""
    pair, (_, _, page, D), caches = _cache_geometry(kv_cache, kv_layout, key.device)
    return WriteKVCacheConfig(
        in_dtype=dtype_name(key.dtype), cache_dtype=dtype_name(caches[0].dtype), head_dim=D, page_size=page,
        vec=vector_width(D, [key, value, *caches]), slot_dtype=dtype_name(slot_mapping.dtype),
        kv_form="pair" if pair else "single", kv_layout=kv_layout, k_scale_tensor=k_scale_tensor,
        v_scale_tensor=v_scale_tensor, **{"items": DEFAULT_ITEMS, "pdl": DEFAULT_PDL, **_cache.override},
    )


def _key(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale):
    def t(x):
        return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16)

    def s(x):
        return (x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else None

    cache = tuple(t(c) for c in kv_cache) + ("pair",) if isinstance(kv_cache, (tuple, list)) else t(kv_cache)
    return (t(key), t(value), cache, slot_mapping.shape, slot_mapping.stride(), slot_mapping.dtype,
            slot_mapping.device, kv_layout, s(k_scale), s(v_scale), _cache.override_key)


class _Launch:
    __slots__ = ("fn", "order", "reference", "pair", "k_tensor", "v_tensor")

    def __init__(self, fn, order, reference, pair, k_tensor, v_tensor):
        self.fn, self.order, self.reference = fn, order, reference
        self.pair, self.k_tensor, self.v_tensor = pair, k_tensor, v_tensor


_cache = LaunchCache()


def tuning_override(**fields: object) -> TuningOverride:
    """``with tuning_override(items=2): ...`` forces kernel config fields (benchmarks comparing
    variants); the override is part of the launch-cache key."""
    return _cache.tuning_override(**fields)


def _prepare(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale) -> _Launch:
    """Full validation (errors name the argument) and kernel selection for one key."""
    check_tensor("key", key, dtype=_IN_DTYPES, ndim=3)
    T, Hkv, D = key.shape
    check_tensor("value", value, dtype=key.dtype, shape=(T, Hkv, D), device=key.device)
    device = key.device
    pair, (P, cHkv, page, cD), caches = _cache_geometry(kv_cache, kv_layout, device)
    if cD != D:
        raise ValueError(f"head dim mismatch: key has {D}, kv_cache has {cD}")
    if cHkv != Hkv:
        raise ValueError(f"num kv heads mismatch: key has {Hkv}, kv_cache ({kv_layout}) has {cHkv}")
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(T,), device=device)
    k_tensor = check_scale("k_scale", k_scale, device)
    v_tensor = check_scale("v_scale", v_scale, device)
    if not key.is_cuda:
        return _Launch(None, (), True, pair, k_tensor, v_tensor)
    config = make_config(key, value, kv_cache, slot_mapping, kv_layout, k_tensor, v_tensor)
    target = compile_target(device)
    if target not in config.targets:  # SM80/86 have no FP8 conversion instructions: torch path
        return _Launch(None, (), True, pair, k_tensor, v_tensor)
    fn = get_kernel(config, target)
    return _Launch(fn, tuple(a.name for a in config.signature()), False, pair, k_tensor, v_tensor)


def _scale_arg(scale, is_tensor: bool):
    if is_tensor:
        return scale if scale.dim() == 1 else scale.view(1)
    return float(scale)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
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
            ``[0, P * page)`` is skipped: nothing is ever written out of bounds.
        kv_layout: ``"HND"`` or ``"NHD"``.
        k_scale, v_scale: positive floats or 1-element fp32 device tensors (read by the kernel,
            CUDA-graph safe). The cache stores ``x / scale``: saturated RNE for FP8, an RNE cast
            for bf16/fp16.

    CPU tensors run the reference, and so does an FP8 cache on SM80/86 (no FP8 conversion
    instructions there; that torch path reads the slots on the host, so it is not graph-capturable).
    """
    try:
        launch_key = _key(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale)
        launch = _cache.get(launch_key)
    except (AttributeError, TypeError, ValueError):  # not tensors: let the validation say what is wrong
        launch_key, launch = None, None
    if launch is None:
        launch = _prepare(key, value, kv_cache, slot_mapping, kv_layout, k_scale, v_scale)
        if launch_key is not None:
            _cache.put(launch_key, launch)
    else:  # float scales are arguments, not part of the key: check their values
        if not launch.k_tensor:
            check_scale("k_scale", k_scale, key.device)
        if not launch.v_tensor:
            check_scale("v_scale", v_scale, key.device)
    with op_range("write_kv_cache", key=key, kv_cache=kv_cache[0] if launch.pair else kv_cache):
        if launch.reference:
            reference.write_kv_cache(key, value, kv_cache, slot_mapping, kv_layout=kv_layout, k_scale=k_scale,
                                     v_scale=v_scale)
            return
        if key.shape[0] == 0 or key.shape[1] == 0:
            return
        k_cache, v_cache = (kv_cache[0], kv_cache[1]) if launch.pair else (kv_cache, kv_cache)
        values = {
            "key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping,
            "k_scale": _scale_arg(k_scale, launch.k_tensor),
            "v_scale": _scale_arg(v_scale, launch.v_tensor),
        }
        launch.fn(*[values[name] for name in launch.order])
