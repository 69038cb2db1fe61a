"""``cute_kernels.paged_prefill``: varlen paged prefill attention on SM90 (CuTe-DSL kernel).

The host never reads tensor data and never synchronizes: the grid comes from shapes (query
heads, ``max_query_len`` or T, the batch), the kernel reads ``query_start_loc`` and ``seq_lens``
on the device, so a prefill step captures in a CUDA graph once its variant is compiled. Nothing
is allocated per call beyond ``out`` and the LSE when the caller passes none; without
``return_lse`` the kernel is compiled without an LSE argument (``write_lse=False``).

Host overhead follows :mod:`cute_kernels.ops.paged_decode`: the first call with a new combination
of shapes, strides and dtypes validates everything and builds a :class:`_Launch`; later calls
look it up by cheap tensor attributes and go straight to the TVM-FFI call, which checks dtypes,
ranks, shared extents, devices and alignment itself; when it refuses, the call is validated in
full for an error that names the argument. CPU tensors run :func:`cute_kernels.reference.paged_prefill`
after the same validation, so code that passes on the CPU passes on the GPU.

``CUTE_KERNELS_CHECK=1`` also validates the data (``query_start_loc``, ``max_query_len``,
``seq_lens`` within the block table, block-table entries in range) before each launch; it
synchronizes, so it is off by default.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .. import reference
from .._nvtx import ENABLED as _NVTX
from .._nvtx import op_range
from ..jit.compiler import get_kernel
from ..plans import sm90_prefill as plan
from ._launch import LaunchCache
from ._torch import check_kv_cache, check_tensor, compile_target, dtype_name
from .quantize_query import check_scale

FP8 = torch.float8_e4m3fn
CHECK_DATA = os.environ.get("CUTE_KERNELS_CHECK") == "1"

# per-call tensors of the generated caller, and where each signature name comes from
_CALL_ARGS = ("q", "k", "v", "block_table", "seq_lens", "query_start_loc", "out", "lse", "k_scale", "v_scale",
              "q_scale", "max_query_len")
_SOURCE = {"kv_cache": "k", "k_cache": "k", "v_cache": "v"}


def _make_caller(fn, order, sm_scale: float, views: dict):
    """A function of the per-call values that calls ``fn`` with its arguments in ``order`` (the
    config's signature); ``views`` maps a scale name to the expression that gives the compiled
    function its ``[1]`` tensor (a 0-d scale is viewed, which keeps it live for graph replays)."""
    args = ", ".join(views.get(n, _SOURCE.get(n, n)) for n in order)
    env = {"fn": fn, "sm_scale": sm_scale}
    exec(f"def call({', '.join(_CALL_ARGS)}):\n    fn({args})\n", env)  # noqa: S102 - fixed template
    return env["call"]


@dataclass
class _Launch:
    """Everything a call needs that depends only on its key."""

    fn: object  # caller of the compiled kernel (see _make_caller); None for the reference
    out_shape: tuple
    out_dtype: torch.dtype
    reference: bool = False
    empty: bool = False  # T == 0 or B == 0: nothing to launch


_cache = LaunchCache()


def tuning_override(**fields):
    """``with tuning_override(tile_n=64, pingpong=False): ...`` forces kernel tuning fields (for
    benchmarks and tests comparing variants); the override is part of the launch-cache key."""
    return _cache.tuning_override(**fields)


def _kind(x):
    """A scale's kind for the launch key: absent, a number, or a tensor of some shape."""
    return None if x is None else getattr(x, "shape", float)


def _key(q, k, pair, block_table, query_start_loc, kv_layout, causal, sm_scale, q_scale, k_scale, v_scale, out,
         return_lse):
    """What selects the kernel: the query and cache geometry, the batch, the options (with their
    types: ``causal=1`` must reach the validation) and the kinds of the scales. Left to the
    compiled function's own checks: the other tensors' dtypes, extents tied by name to the
    query's or the cache's (V, seq_lens, out...), devices, alignment. ``query_start_loc``'s extent
    is tied to nothing, so its shape is in the key."""
    return (q.shape, q.stride(), q.dtype, q.device, pair, k.shape, k.stride(), k.dtype, block_table.shape,
            query_start_loc.shape, kv_layout, causal, type(causal), sm_scale, _kind(q_scale), _kind(k_scale),
            _kind(v_scale), None if out is None else out.dtype, return_lse, type(return_lse), _cache.override_key)


def _check_scales(q, Hkv, q_scale, k_scale, v_scale) -> str:
    """Validate the scales (values never read); returns the config's ``q_scale`` kind."""
    check_scale("k_scale", k_scale, q.device)
    check_scale("v_scale", v_scale, q.device)
    if q.dtype != FP8:
        if q_scale is not None:
            raise ValueError("q_scale applies only to an FP8 query; a bf16/fp16 query is never rescaled")
        return "none"
    if q_scale is None:
        raise ValueError("an FP8 query needs q_scale (the scale it was quantized with)")
    if not check_scale("q_scale", q_scale, q.device, num_q_heads=q.shape[1]):
        return "scalar"
    if q_scale.numel() == 1:
        return "tensor"
    if q_scale.numel() != Hkv:
        raise ValueError(f"a per-KV-head q_scale must have Hkv={Hkv} elements, got shape {tuple(q_scale.shape)}")
    return "per_head"


def _prepare(q, k, v, pair, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale,
             q_scale, k_scale, v_scale, out, return_lse) -> _Launch:
    """Full validation (clear errors naming the argument, the same for CPU and CUDA tensors) and
    kernel selection for one key."""
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float16, FP8), ndim=3)
    T, Hq, D = q.shape
    device = q.device
    P, Hkv, page = check_kv_cache(k, v, pair, kv_layout, D)
    if P == 0:  # a TMA descriptor needs a non-empty tensor; refused before any launch
        raise ValueError("kv_cache has no pages (P = 0); allocate at least one page")
    if D not in plan.HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {plan.HEAD_DIMS}, got {D}")
    if page not in plan.PAGE_SIZES:
        raise ValueError(f"page size must be one of {plan.PAGE_SIZES}, got {page}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"num q heads ({Hq}) must be a multiple of num kv heads ({Hkv})")
    if Hq // Hkv > plan.MAX_GROUP:
        raise ValueError(f"Hq / Hkv must be <= {plan.MAX_GROUP}, got {Hq // Hkv}")
    if q.dtype == FP8:
        if k.dtype != FP8:
            raise TypeError(f"an FP8 query needs a float8_e4m3fn kv_cache, got {k.dtype}")
    elif k.dtype not in (FP8, q.dtype):
        raise TypeError(f"kv_cache dtype must be float8_e4m3fn or the query's dtype {q.dtype}, got {k.dtype}")
    q_scale_kind = _check_scales(q, Hkv, q_scale, k_scale, v_scale)
    scale = D ** -0.5 if sm_scale is None else sm_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
    B = block_table.shape[0]
    if B > plan.MAX_BATCH:
        raise ValueError(f"the batch must have at most {plan.MAX_BATCH} requests, got {B}")
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(B,), device=device)
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, shape=(B + 1,), device=device)
    if B == 0 and T:
        raise ValueError(f"q has {T} rows but the batch is empty (query_start_loc must end at T)")
    _check_max_query_len(max_query_len, T, B)
    out_dtypes = (torch.bfloat16, torch.float16) if q.dtype == FP8 else (q.dtype,)
    if out is not None:
        check_tensor("out", out, dtype=out_dtypes, shape=(T, Hq, D), device=device)
    out_dtype = out_dtypes[0] if out is None else out.dtype
    config = plan.make_prefill_config(
        q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype), out_dtype=dtype_name(out_dtype), head_dim=D,
        group=Hq // Hkv, page_size=page, kv_form="pair" if pair else "single", kv_layout=kv_layout, causal=causal,
        write_lse=return_lse, k_scale_tensor=isinstance(k_scale, torch.Tensor),
        v_scale_tensor=isinstance(v_scale, torch.Tensor), q_scale=q_scale_kind, **_cache.override)
    # pointer and stride alignment, from the signature the kernel is compiled with (TMA wants 16 bytes)
    tensors = dict(q=q, kv_cache=k, k_cache=k, v_cache=v, block_table=block_table, seq_lens=seq_lens,
                   query_start_loc=query_start_loc, out=out)
    for arg in config.signature():
        t = tensors.get(arg.name)
        if t is not None and getattr(arg, "align", 0) > t.element_size():
            check_tensor(arg.name, t, align_bytes=arg.align)
    shape = (T, Hq, D)
    if not q.is_cuda:
        return _Launch(None, shape, out_dtype, reference=True)
    if T == 0 or B == 0:
        return _Launch(None, shape, out_dtype, empty=True)
    target = compile_target(device)
    if target not in config.targets:
        raise ValueError(f"{config.kernel_id} runs on {'/'.join(config.targets)}, this GPU is {target}: "
                         "use cute_kernels.reference.paged_prefill (dispatch.plan picks it)")
    fn = get_kernel(config, target)
    order = tuple(a.name for a in config.signature())
    views = {name: f"{name}.view(1)" for name, s in (("k_scale", k_scale), ("v_scale", v_scale),
                                                      ("q_scale", q_scale))
             if isinstance(s, torch.Tensor) and s.dim() == 0}
    return _Launch(_make_caller(fn, order, float(scale), views), shape, out_dtype)


def _check_max_query_len(max_query_len, T: int, B: int) -> None:
    """``max_query_len``: None or an int; T rows in B requests need one of at least ceil(T / B)."""
    if max_query_len is None:
        return
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be None or a non-negative int, got {max_query_len!r}")
    if max_query_len * B < T:
        raise ValueError(f"max_query_len ({max_query_len}) is below every split of T={T} rows into {B} requests")


def _check_data(q, k, pair, kv_layout, block_table, seq_lens, query_start_loc, max_query_len) -> None:
    """``CUTE_KERNELS_CHECK=1``: the data rules the kernel cannot refuse without synchronizing."""
    T = q.shape[0]
    starts = reference.prefill_spans(query_start_loc, T, max_query_len)
    k4 = k if pair else k[:, 0]
    P, page = k4.shape[0], k4.shape[2 if kv_layout == "HND" else 1]
    B, W = block_table.shape
    lens = seq_lens.long()
    q_lens = torch.tensor(starts, device=lens.device).diff()
    bad = ((lens < q_lens) | (lens > W * page)).nonzero().flatten().tolist()
    if bad:
        b = bad[0]
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} must lie in [query length {int(q_lens[b])}, "
                         f"block-table capacity {W * page}]")
    used = torch.arange(W, device=lens.device).view(1, W) < ((lens + page - 1) // page).view(B, 1)
    ids = block_table.long()
    bad = (used & ((ids < 0) | (ids >= P))).nonzero().tolist()
    if bad:
        b, c = bad[0]
        raise ValueError(f"block_table[{b}, {c}] = {int(ids[b, c])} is outside [0, {P}) (a page seq_lens[{b}] uses)")


def paged_prefill(
    q: torch.Tensor,
    kv_cache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int | None = None,
    kv_layout: str = "HND",
    causal: bool = True,
    sm_scale: float | None = None,
    q_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Varlen paged prefill attention with a BF16/FP16 or FP8 query and a BF16/FP16/FP8 KV cache.

    Semantics are those of :func:`cute_kernels.reference.paged_prefill` (read its docstring for
    the defined results of every data case): ``q`` ``[T, Hq, D]`` packs the new tokens of B
    requests, request b owning rows ``query_start_loc[b] : query_start_loc[b + 1]`` (int32
    ``[B + 1]`` on the device), which are the last ``q_len_b`` of its ``seq_lens[b]`` tokens.
    ``kv_cache`` is one HND/NHD tensor or a ``(k, v)`` tuple, ``block_table`` int32 ``[B, W]``.

    ``q`` is bf16/fp16 (any 16-byte aligned strides, e.g. a view of a fused QKV tensor), or
    float8_e4m3fn from :func:`cute_kernels.quantize_query`, which needs an FP8 cache and
    ``q_scale``. Scales: positive floats, or 0-d / 1-element fp32 device tensors (read on the
    device, so they may change between CUDA-graph replays); ``q_scale`` also fp32 ``[Hkv]`` (per
    KV head). ``max_query_len``: optional bound on every ``q_len_b`` (a Python int; it sizes the
    grid, T otherwise; a bound below a request's length leaves that request's rows beyond it
    unspecified). ``out``: optional ``[T, Hq, D]`` of q's dtype (bf16 or fp16 for an FP8 query,
    bf16 by default), written in place, on the CPU too.

    Supported here: SM90, head_dim 64/128/256, page size 16/32/64/128, Hq / Hkv up to
    ``plans.sm90_prefill.MAX_GROUP``. Returns ``out`` and, with ``return_lse``, the base-2 LSE
    ``[T, Hq]`` fp32.
    """
    pair = isinstance(kv_cache, (tuple, list))
    if pair and len(kv_cache) != 2:
        raise ValueError("kv_cache tuple must be (k_cache, v_cache)")
    k = kv_cache[0] if pair else kv_cache
    v = kv_cache[1] if pair else kv_cache
    args = (q, k, v, pair, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale,
            q_scale, k_scale, v_scale, out, return_lse)
    try:
        key = _key(q, k, pair, block_table, query_start_loc, kv_layout, causal, sm_scale, q_scale, k_scale, v_scale,
                   out, return_lse)
        launch = _cache.entries.get(key)
    except (AttributeError, TypeError):  # not tensors: let the validation say what is wrong
        key, launch = None, None
    if launch is None:
        launch = _prepare(*args)
        if key is not None:
            _cache.put(key, launch)
    else:  # values the key leaves out: float scales and max_query_len (a tensor scale is checked by the call)
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale), ("q_scale", q_scale)):
            if s is not None and type(s) is not torch.Tensor and not (type(s) is float and 0.0 < s < math.inf):
                check_scale(name, s, q.device)
        if max_query_len is not None:
            _check_max_query_len(max_query_len, q.shape[0], block_table.shape[0])
    if launch.reference:  # no compiled function checks the arguments here: validate every call
        _prepare(*args)
        res = reference.paged_prefill(q, kv_cache, block_table, seq_lens, query_start_loc,
                                      max_query_len=max_query_len, kv_layout=kv_layout, causal=causal,
                                      sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                      return_lse=return_lse, out_dtype=launch.out_dtype)
        res, lse = res if return_lse else (res, None)
        if out is not None:
            out.copy_(res)
            res = out
        return (res, lse) if return_lse else res
    if CHECK_DATA:
        _check_data(q, k, pair, kv_layout, block_table, seq_lens, query_start_loc, max_query_len)
    if out is None:
        out = torch.empty(launch.out_shape, dtype=launch.out_dtype, device=q.device)
    lse = torch.empty(launch.out_shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    if launch.empty:  # no rows, or no requests (then no rows either): nothing to launch
        return (out, lse) if return_lse else out
    max_q = q.shape[0] if max_query_len is None else min(max_query_len, q.shape[0])
    try:
        if _NVTX:
            with op_range("paged_prefill", q=q, kv_cache=k, block_table=block_table):
                launch.fn(q, k, v, block_table, seq_lens, query_start_loc, out, lse, k_scale, v_scale, q_scale, max_q)
        else:
            launch.fn(q, k, v, block_table, seq_lens, query_start_loc, out, lse, k_scale, v_scale, q_scale, max_q)
    except Exception:
        # the compiled function refused an argument the key leaves to it: name it
        _prepare(*args)
        raise
    return (out, lse) if return_lse else out
