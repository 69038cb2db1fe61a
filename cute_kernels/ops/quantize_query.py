"""``cute_kernels.quantize_query``: bf16/fp16 query -> FP8 e4m3 (CuTe-DSL kernel on CUDA), with
optional fused NeoX RoPE.

The host side looks at shapes, dtypes, strides and pointers only (no data read, no sync), so a
call captures in a CUDA graph once its variant is compiled. The first call with a new
combination of those attributes validates everything and caches the kernel and argument order;
later calls look that up by a tuple of cheap tensor attributes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .. import reference
from .._nvtx import op_range
from .._types import Rope, Scale
from ..common.quantize import ROPE_MAX_VEC, VECTOR_WIDTHS, QuantizeQueryConfig
from ..jit.compiler import get_kernel
from ._launch import LaunchCache, TuningOverride
from ._torch import check_tensor, compile_target, dtype_name, widest_vector

FP8 = torch.float8_e4m3fn
_IN_DTYPES = (torch.bfloat16, torch.float16)


def check_scale(name: str, value: Scale, device: torch.device, *, num_q_heads: int | None = None) -> bool:
    """Validate a dequantization scale; True if it is a device tensor.

    A scale is a positive finite float or a 1-element fp32 tensor on ``device``; with
    ``num_q_heads``, also an fp32 ``[Hkv]`` tensor with ``num_q_heads % Hkv == 0`` (per KV head).
    Tensor values are never read here (that would synchronize).
    """
    if isinstance(value, torch.Tensor):
        per_head = num_q_heads is not None and value.numel() > 1
        if value.dtype != torch.float32:
            raise TypeError(f"{name} must be a float or a float32 tensor, got dtype {str(value.dtype).replace('torch.', '')}")
        if per_head:
            if value.dim() != 1 or num_q_heads % value.numel():
                raise ValueError(
                    f"{name} must be a float, a 1-element tensor or a per-KV-head [Hkv] tensor with "
                    f"num_q_heads ({num_q_heads}) % Hkv == 0, got shape {tuple(value.shape)}"
                )
            if value.stride(0) != 1:
                raise ValueError(f"{name} must be contiguous, got stride {value.stride()}")
        elif value.numel() != 1:
            kinds = "a 1-element tensor or an [Hkv] tensor" if num_q_heads is not None else "a 1-element tensor"
            raise ValueError(f"{name} must be a float or {kinds}, got shape {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} must be on {device}, got {value.device}")
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float or a float32 tensor, got {value!r}")
    return False


def vector_width(head_dim: int, tensors: Iterable[torch.Tensor], *, multiple_of: int = 0, widest: int = 16) -> int:
    """Widest elements-per-thread the kernel can use: it divides ``head_dim`` (and ``multiple_of``)
    and every tensor's pointer and strides allow ``min(16, vec * element size)``-byte accesses."""
    for vec in VECTOR_WIDTHS:
        if vec > widest or head_dim % vec or (multiple_of and multiple_of % vec):
            continue
        if all(widest_vector([t]) >= min(16, vec * t.element_size()) for t in tensors):
            return vec
    return 1


def _check_rope(rope, q: torch.Tensor):
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise TypeError("rope must be a (cos_sin_cache, positions) tuple")
    cos_sin, positions = rope
    T, _, D = q.shape
    check_tensor("cos_sin_cache", cos_sin, dtype=(torch.float32, q.dtype), ndim=2, device=q.device)
    rot = cos_sin.shape[1]
    if rot < 2 or rot % 2 or rot > D:
        raise ValueError(f"cos_sin_cache rows hold [cos | sin] of rot_dim values: rot_dim must be even and "
                         f"in [2, head_dim {D}], got {rot}")
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(T,), device=q.device)
    return cos_sin, positions


# head rows per thread: profiling/NOTES.md "layer glue v2"
DEFAULT_ITEMS = 2
# RoPE: 2 rows per thread when 2 divides Hq (a thread's rows share one token's cos/sin), measured
# on SM90 only; other targets keep 1 (on sm_100a the 2-row RoPE kernel spills a register)
DEFAULT_ITEMS_ROPE = {"sm_90a": 2}
DEFAULT_PDL = True  # programmatic dependent launch: the launch overlaps the previous kernel's tail


def make_config(q: torch.Tensor, scale_tensor: bool, out: torch.Tensor | None = None, rope: Rope | None = None,
                target: str = "sm_90a") -> QuantizeQueryConfig:
    """The kernel variant for validated arguments (host-only: dtypes, shapes, strides, pointers)."""
    D = q.shape[2]
    tensors = [q] + ([out] if out is not None else []) + ([rope[0]] if rope is not None else [])
    rot = rope[0].shape[1] if rope is not None else 0
    # an allocated out is always aligned enough; with RoPE a thread owns two chunks (a rotation
    # pair), and 2 x 16 elements would spill registers
    vec = vector_width(D, tensors, multiple_of=rot // 2, widest=ROPE_MAX_VEC if rope is not None else 16)
    fields = dict(q_dtype=dtype_name(q.dtype), head_dim=D, vec=vec, scale_tensor=scale_tensor)
    if rope is not None:
        fields.update(rot_dim=rot, cos_sin_dtype=dtype_name(rope[0].dtype), pos_dtype=dtype_name(rope[1].dtype))
    fields = {**fields, "items": DEFAULT_ITEMS_ROPE.get(target, 1) if rope is not None else DEFAULT_ITEMS,
              "pdl": DEFAULT_PDL, **_cache.override}
    if rope is not None and q.shape[1] % fields["items"]:
        fields["items"] = 1  # a thread's RoPE rows must be heads of one token
    return QuantizeQueryConfig(**fields)


def _key(q, q_scale, out, rope):
    s = (q_scale.shape, q_scale.dtype, q_scale.device, q_scale.stride()) if isinstance(q_scale, torch.Tensor) else None
    o = None if out is None else (out.shape, out.stride(), out.dtype, out.device, out.data_ptr() % 16)
    r = None
    if rope is not None:
        cs, pos = rope
        r = (cs.shape, cs.stride(), cs.dtype, cs.device, cs.data_ptr() % 16, pos.shape, pos.stride(), pos.dtype,
             pos.device)
    return (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16, s, o, r, _cache.override_key)


class _Launch:
    __slots__ = ("fn", "order", "reference", "scale_tensor")

    def __init__(self, fn, order, reference, scale_tensor):
        self.fn, self.order, self.reference, self.scale_tensor = fn, order, reference, scale_tensor


_cache = LaunchCache()


def tuning_override(**fields: object) -> TuningOverride:
    """``with tuning_override(items=2): ...`` forces kernel config fields (benchmarks comparing
    variants); the override is part of the launch-cache key."""
    return _cache.tuning_override(**fields)


def _prepare(q, q_scale, out, rope) -> _Launch:
    """Full validation (errors name the argument) and kernel selection for one key."""
    check_tensor("q", q, dtype=_IN_DTYPES, ndim=3)
    T, Hq, D = q.shape
    scale_tensor = check_scale("q_scale", q_scale, q.device, num_q_heads=Hq)
    if out is not None:
        check_tensor("out", out, dtype=FP8, shape=(T, Hq, D), device=q.device)
    if rope is not None:
        rope = _check_rope(rope, q)
    if not q.is_cuda:
        return _Launch(None, (), True, scale_tensor)
    target = compile_target(q.device)
    config = make_config(q, scale_tensor, out, rope, target)
    if target not in config.targets:  # SM80/86 have no FP8 conversion instructions: torch path
        return _Launch(None, (), True, scale_tensor)
    fn = get_kernel(config, target)
    return _Launch(fn, tuple(a.name for a in config.signature()), False, scale_tensor)


def quantize_query(
    q: torch.Tensor,
    q_scale: Scale,
    *,
    out: torch.Tensor | None = None,
    rope: Rope | None = None,
) -> torch.Tensor:
    """Quantize a query to float8_e4m3fn: ``saturate(RNE(rope(q) / q_scale))``.

    Semantics are those of :func:`cute_kernels.reference.quantize_query` (bit-exact codes).

    Args:
        q: bf16/fp16 ``[T, Hq, D]`` with a contiguous last dim; token and head strides are free
            (a slice of a fused QKV projection works without a copy).
        q_scale: a positive float or a 1-element fp32 device tensor (per tensor), or an fp32
            ``[Hkv]`` device tensor (per KV head: query head h uses ``q_scale[h // (Hq // Hkv)]``).
            Tensors are read by the kernel, so CUDA-graph replays see their current values.
        out: optional float8_e4m3fn ``[T, Hq, D]`` output (last dim contiguous), written in place.
        rope: optional ``(cos_sin_cache, positions)`` for fused NeoX rotary embedding:
            ``cos_sin_cache`` ``[max_pos, rot_dim]`` (fp32 or q's dtype) holds cos in its first
            ``rot_dim / 2`` columns and sin in the rest (vLLM's layout); ``positions`` int32/int64
            ``[T]``. Dims ``>= rot_dim`` pass through unrotated.

    Returns:
        ``out``. CPU tensors run the reference, and so do SM80/86 GPUs (no FP8 conversion
        instructions; the dispatch layer never quantizes a query there).
    """
    try:
        key = _key(q, q_scale, out, rope)
        launch = _cache.get(key)
    except (AttributeError, TypeError, ValueError):  # not tensors: let the validation say what is wrong
        key, launch = None, None
    if launch is None:
        launch = _prepare(q, q_scale, out, rope)
        if key is not None:
            _cache.put(key, launch)
    elif not launch.scale_tensor:  # a float scale is an argument, not part of the key: check it
        check_scale("q_scale", q_scale, q.device)
    if out is None:
        out = torch.empty(q.shape, dtype=FP8, device=q.device)
    with op_range("quantize_query", q=q, out=out):
        if launch.reference:
            out.copy_(reference.quantize_query(q, q_scale, rope=rope))
        elif q.shape[0] and q.shape[1]:
            if launch.scale_tensor:
                scale = q_scale if q_scale.dim() == 1 else q_scale.view(1)
            else:
                scale = float(q_scale)
            values = {"q": q, "out": out, "q_scale": scale}
            if rope is not None:
                values["cos_sin_cache"], values["positions"] = rope
            launch.fn(*[values[name] for name in launch.order])
    return out
