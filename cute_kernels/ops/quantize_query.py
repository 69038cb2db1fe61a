"""``cute_kernels.quantize_query``: bf16/fp16 query -> FP8 e4m3 (CuTe-DSL kernel on CUDA), with
optional fused NeoX RoPE.

The host side looks at shapes, dtypes, strides and pointers only (no data read, no sync), so a
call captures in a CUDA graph once its variant is compiled. It runs on the shared launcher
(:mod:`cute_kernels.ops._launch`): the first call with a new combination of those attributes
validates everything and prepares the kernel's caller; later calls look it up by a tuple of cheap
tensor attributes. Registered as ``torch.ops.cute_kernels.quantize_query`` and
``quantize_query_out`` (:mod:`cute_kernels.ops._library`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Optional, overload

import torch
from torch import Tensor

from .. import reference
from .._types import Rope, Scale
from ..jit.compiler import get_kernel
from ..jit.spec import check_override
from ..plans.quantize_query import ROPE_MAX_VEC, VECTOR_WIDTHS, QuantizeQueryConfig, make_quantize_config
from . import _check
from ._device import current_device, on_device, served_device
from ._launch import Launcher, TuningOverride, check_scale
from ._library import compiling, custom_op, scale_of, scale_parts
from ._quantize_residual import self_check_passes
from ._torch import check_tensor, compile_target, dtype_name, overlap, widest_vector

FP8 = torch.float8_e4m3fn
_FIXED = ("q_dtype", "head_dim", "scale_tensor", "rot_dim", "cos_sin_dtype", "pos_dtype", "residual")
_IN_DTYPES = (torch.bfloat16, torch.float16)


def vector_width(head_dim: int, tensors: Iterable[Tensor], *, multiple_of: int = 0, widest: int = 16) -> int:
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


def check_tuning_override(override: dict) -> None:
    """The tuning override's fields: ``vec``, ``items`` and ``pdl`` of the field's type; the
    others are the call's (:func:`cute_kernels.jit.spec.check_override`)."""
    check_override(QuantizeQueryConfig, override, fixed=_FIXED)


def make_config(q: Tensor, scale_tensor: bool, out: Tensor | None = None, rope: Rope | None = None,
                target: str = "sm_90a", residual: bool = False, residual_out: Tensor | None = None
                ) -> QuantizeQueryConfig:
    """The kernel variant for validated arguments (host-only: dtypes, shapes, strides, pointers);
    ``residual``: the variant that writes the two-term query's residual too."""
    D = q.shape[2]
    tensors = [q] + [t for t in (out, residual_out) if t is not None] + ([rope[0]] if rope is not None else [])
    rot = rope[0].shape[1] if rope is not None else 0
    # an allocated out is always aligned enough; with RoPE a thread owns two chunks (a rotation
    # pair), and 2 x 16 elements would spill registers
    vec = vector_width(D, tensors, multiple_of=rot // 2, widest=ROPE_MAX_VEC if rope is not None else 16)
    rope_fields = None if rope is None else (rot, dtype_name(rope[0].dtype), dtype_name(rope[1].dtype))
    # the call decides what is quantized and how the scale arrives; vec, items and pdl are tuning
    check_tuning_override(_launcher.override)
    return make_quantize_config(q_dtype=dtype_name(q.dtype), head_dim=D, vec=vec, scale_tensor=scale_tensor,
                                num_q_heads=q.shape[1], target=target, rope=rope_fields, override=_launcher.override,
                                residual=residual)


def _key(q, q_scale, out, rope):
    s = (q_scale.shape, q_scale.dtype, q_scale.device, q_scale.stride()) if isinstance(q_scale, torch.Tensor) else None
    o = None if out is None else (out.shape, out.stride(), out.dtype, out.device, out.data_ptr() % 16)
    r = None
    if rope is not None:
        cs, pos = rope
        r = (cs.shape, cs.stride(), cs.dtype, cs.device, cs.data_ptr() % 16, pos.shape, pos.stride(), pos.dtype,
             pos.device)
    return (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16, s, o, r, _launcher.override_key,
            current_device() if q.is_cuda else -1)


class _Launch:
    __slots__ = ("call", "reference")

    def __init__(self, call, reference):
        self.call, self.reference = call, reference


def tuning_override(**fields: object) -> TuningOverride:
    """``with tuning_override(items=2): ...`` forces kernel config fields (benchmarks comparing
    variants); the override is part of the launch-cache key."""
    return _launcher.tuning_override(**fields)


def _validate(q, q_scale, out, rope):
    """Full validation (errors name the argument): ``(scale_tensor, rope)``."""
    check_tensor("q", q, dtype=_IN_DTYPES, ndim=3)
    served_device("q", q)
    T, Hq, D = q.shape
    scale_tensor = check_scale("q_scale", q_scale, device=q.device, num_q_heads=Hq)
    if out is not None:
        check_tensor("out", out, dtype=FP8, shape=(T, Hq, D), device=q.device, output=True)
    if rope is not None:
        rope = _check_rope(rope, q)
    return scale_tensor, rope


def _prepare(q, q_scale, out, rope) -> _Launch:
    """Full validation (errors name the argument) and kernel selection for one key."""
    scale_tensor, rope = _validate(q, q_scale, out, rope)
    if not q.is_cuda:
        make_config(q, scale_tensor, out, rope)  # the kernel's own limits, checked for CPU tensors too
        return _REFERENCE
    if q.numel() == 0:  # nothing to quantize: no launch, no compiled variant
        return _EMPTY
    target = compile_target(q.device)
    config = make_config(q, scale_tensor, out, rope, target)
    if target not in config.targets:  # SM80/86 have no FP8 conversion instructions: torch path
        return _REFERENCE
    # a tensor scale other than 1-D (a 1-element tensor of any rank) goes as a [1] view
    sources = {"q_scale": "q_scale.view(1)"} if scale_tensor and q_scale.dim() != 1 else None
    return _Launch(on_device(_launcher.bind(_CALL_PARAMS, (get_kernel(config, target), config.signature(), sources, None)),
                             q.device), False)


# forward-only, as the kernels: no autograd history, an out= that requires grad written in place
# (docs/design/inputs.md#the-classes)
@torch.no_grad()
def _reference(q, q_scale, out, rope):
    res = reference.quantize_query(q, q_scale, rope=rope)
    if out is None:
        return res
    out.copy_(res)
    return out


def _check_data(q, q_scale, out, rope) -> None:
    """Checked mode (``CUTE_KERNELS_CHECK=1``): scales positive and finite, RoPE positions inside
    the cos/sin cache."""
    _check.scales(q_scale=q_scale)
    if rope is not None:
        _check.positions("positions", rope[1], rope[0].shape[0])


_CALL_PARAMS = ("q", "out", "q_scale", "cos_sin_cache", "positions")
_REFERENCE = _Launch(None, True)
_EMPTY = _Launch(None, False)
_launcher = Launcher(_prepare, _reference, check_data=_check_data, op="quantize_query")


@overload
def quantize_query(q: Tensor, q_scale: Scale, *, out: Tensor | None = ..., rope: Rope | None = ...,
                   residual: Literal[False] = ..., residual_out: None = ...) -> Tensor: ...
@overload
def quantize_query(q: Tensor, q_scale: Scale, *, out: Tensor | None = ..., rope: Rope | None = ...,
                   residual: Literal[True], residual_out: Tensor | None = ...) -> tuple[Tensor, Tensor]: ...
def quantize_query(
    q: Tensor,
    q_scale: Scale,
    *,
    out: Tensor | None = None,
    rope: Rope | None = None,
    residual: bool = False,
    residual_out: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
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
        residual: also return the two-term query's second term ``lo = saturate(RNE(x - hi))``
            of ``x = rope(q) / q_scale`` (``paged_prefill(..., q_residual=lo)``), bit-exact with
            :func:`cute_kernels.reference.query_residual`. On a GPU one kernel writes both terms
            (one read of q); it is compile-verified, so the first call of each variant family in
            a process runs a self-check that synchronizes (make it outside CUDA-graph capture, or
            run :func:`dispatch.warm_up`); a family that fails it, CPU tensors and torch.compile
            take the torch-ops path (the one-term kernel, then torch ops for ``lo``).
        residual_out: optional float8_e4m3fn ``[T, Hq, D]`` for ``lo`` (with ``residual=True``).

    Returns:
        ``out``, or ``(out, lo)`` with ``residual``. CPU tensors run the reference, and so do
        SM80/86 GPUs (no FP8 conversion instructions; the dispatch layer never quantizes a
        query there).
    """
    if residual is not False or residual_out is not None:
        return _two_terms(q, q_scale, out, rope, residual, residual_out)
    if compiling():  # torch.compile traces the registered op (the eager path never pays for it)
        return _traced(q, q_scale, out, rope)
    try:
        key = _key(q, q_scale, out, rope)
    except (AttributeError, TypeError, ValueError):  # not tensors: the validation says what is wrong
        key = None
    launch = _launcher.entries.get(key)
    if launch is None or launch.reference:  # the argument tuple is built off the hot path only
        args = (q, q_scale, out, rope)
        launch = launch or _launcher.lookup(key, args)
        if launch.reference:
            return _launcher.run_reference(args)
    if out is None:
        out = torch.empty(q.shape, dtype=FP8, device=q.device)
    if launch.call is not None:
        cos_sin, positions = rope if rope is not None else (None, None)
        try:
            launch.call(q, out, q_scale, cos_sin, positions)
        except Exception:
            _launcher.refused((q, q_scale, out, rope))  # raises the error that names the argument
            raise
    return out


def _two_terms(q, q_scale, out, rope, residual, residual_out) -> tuple[Tensor, Tensor]:
    """``quantize_query(..., residual=True)``: on a GPU with FP8 conversions, one kernel writes
    both terms (the residual variant, self-checked before its first launch while compile-verified);
    elsewhere, and for a family that failed its check, :func:`_torch_ops`. The hot path is the
    one-term op's: one key, one dict lookup, the bound caller."""
    if residual is not True:
        raise ValueError(f"residual must be True or False, got {residual!r}"
                         + (" (residual_out needs residual=True)" if residual is False else ""))
    if out is not None and residual_out is not None and overlap(out, residual_out):
        # the kernel stores both terms of a chunk from one thread: an alias would keep whichever came last
        raise ValueError("residual_out must not overlap out (the codes and their residual are two outputs)")
    if compiling():  # torch.compile traces the registered one-term op and the torch ops
        return _torch_ops(q, q_scale, out, rope, residual_out)
    try:
        key = _key(q, q_scale, out, rope) + _out_key(residual_out)
    except (AttributeError, TypeError, ValueError):  # not tensors: the validation says what is wrong
        key = None
    launch = _two_launcher.entries.get(key)
    if launch is None or launch.call is None:
        args = (q, q_scale, out, rope, residual_out)
        launch = launch or _two_launcher.lookup(key, args)
        if launch.reference:
            return _two_launcher.run_reference(args)
        if launch.call is None:
            return _torch_ops(*args)
    if out is None:
        out = torch.empty(q.shape, dtype=FP8, device=q.device)
    if residual_out is None:
        residual_out = torch.empty(q.shape, dtype=FP8, device=q.device)
    cos_sin, positions = rope if rope is not None else (None, None)
    try:
        launch.call(q, out, q_scale, cos_sin, positions, residual_out)
    except Exception:
        _two_launcher.refused((q, q_scale, out, rope, residual_out))  # raises the error that names the argument
        raise
    return out, residual_out


def _out_key(residual_out) -> tuple:
    if residual_out is None:
        return (None,)
    return ((residual_out.shape, residual_out.stride(), residual_out.dtype, residual_out.device,
             residual_out.data_ptr() % 16),)


def _torch_ops(q, q_scale, out, rope, residual_out) -> tuple[Tensor, Tensor]:
    """The codes from the one-term op (kernel or reference), the residual from
    :func:`cute_kernels.reference.query_residual` (torch ops on q's device, no host sync)."""
    hi = quantize_query(q, q_scale, out=out, rope=rope)  # validates q, q_scale, out and rope
    if residual_out is not None:
        check_tensor("residual_out", residual_out, dtype=FP8, shape=tuple(q.shape), device=q.device,
                     output=True)
    lo = reference.query_residual(q, q_scale, hi, rope=rope)
    if residual_out is None:
        return hi, lo
    residual_out.copy_(lo)
    return hi, residual_out


def _prepare_two(q, q_scale, out, rope, residual_out) -> _Launch:
    """Validation and the choice for one key of the two-term call: CPU tensors run the reference
    (:func:`_torch_ops`, validated at every call); a GPU without FP8 conversions, an empty query or
    a residual family that failed its self-check, :func:`_torch_ops` (``call`` None); else the
    fused residual variant."""
    scale_tensor, rope = _validate(q, q_scale, out, rope)
    if residual_out is not None:
        check_tensor("residual_out", residual_out, dtype=FP8, shape=tuple(q.shape), device=q.device,
                     output=True)
    if not q.is_cuda:
        make_config(q, scale_tensor, out, rope, residual=True, residual_out=residual_out)  # limits on CPU too
        return _REFERENCE
    if q.numel() == 0:
        return _TORCH_OPS
    target = compile_target(q.device)
    config = make_config(q, scale_tensor, out, rope, target, residual=True, residual_out=residual_out)
    if target not in config.targets or not self_check_passes(config, q.device):
        return _TORCH_OPS
    sources = {"q_scale": "q_scale.view(1)"} if scale_tensor and q_scale.dim() != 1 else None
    call = _two_launcher.bind(_TWO_PARAMS, (get_kernel(config, target), config.signature(), sources, None))
    return _Launch(on_device(call, q.device), False)


@torch.no_grad()
def _reference_two(q, q_scale, out, rope, residual_out):
    return _torch_ops(q, q_scale, out, rope, residual_out)


def _check_two(q, q_scale, out, rope, residual_out) -> None:
    _check_data(q, q_scale, out, rope)


_TWO_PARAMS = _CALL_PARAMS + ("residual_out",)
_TORCH_OPS = _Launch(None, False)  # the two-term call by the one-term op and torch ops
# the two-term call's launches (docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2);
# tuning overrides are the one-term launcher's (its override key is part of both keys)
_two_launcher = Launcher(_prepare_two, _reference_two, check_data=_check_two, op="quantize_query")


# ---------------------------------------------------------------------------------------------
# torch.library: torch.ops.cute_kernels.quantize_query / quantize_query_out
# ---------------------------------------------------------------------------------------------


def _rope_of(cos_sin_cache: Optional[Tensor], positions: Optional[Tensor]) -> Rope | None:
    if cos_sin_cache is None or positions is None:
        return None
    return cos_sin_cache, positions


@custom_op("quantize_query_out", mutates=("out",))
def _quantize_query_out_op(q: Tensor, q_scale: float, q_scale_tensor: Optional[Tensor],
                           cos_sin_cache: Optional[Tensor], positions: Optional[Tensor], out: Tensor) -> None:
    quantize_query(q, scale_of(q_scale, q_scale_tensor), out=out, rope=_rope_of(cos_sin_cache, positions))


@_quantize_query_out_op.register_fake
def _(q, q_scale, q_scale_tensor, cos_sin_cache, positions, out):
    return None


@custom_op("quantize_query")
def _quantize_query_op(q: Tensor, q_scale: float, q_scale_tensor: Optional[Tensor], cos_sin_cache: Optional[Tensor],
                       positions: Optional[Tensor]) -> Tensor:
    out = torch.empty(q.shape, dtype=FP8, device=q.device)
    quantize_query(q, scale_of(q_scale, q_scale_tensor), out=out, rope=_rope_of(cos_sin_cache, positions))
    return out


@_quantize_query_op.register_fake
def _(q, q_scale, q_scale_tensor, cos_sin_cache, positions):
    return torch.empty(q.shape, dtype=FP8, device=q.device)


def _traced(q, q_scale, out, rope):
    """:func:`quantize_query` as torch.compile sees it (``rope`` as two optional tensors)."""
    if rope is not None and (not isinstance(rope, (tuple, list)) or len(rope) != 2):
        raise TypeError("rope must be a (cos_sin_cache, positions) tuple")
    cos_sin, positions = rope if rope is not None else (None, None)
    if out is None:
        return _quantize_query_op(q, *scale_parts(q_scale), cos_sin, positions)
    _quantize_query_out_op(q, *scale_parts(q_scale), cos_sin, positions, out)
    return out
