"""``cute_kernels.paged_prefill``: varlen paged prefill attention (CuTe-DSL kernels: ``sm90.prefill``
on SM90, ``sm100.prefill`` on SM100 / SM103 (:mod:`._paged_prefill_sm100`), the portable
``sm80.prefill`` on every other arch and for what those refuse).

The host never reads tensor data and never synchronizes: the grid comes from shapes (query
heads, ``max_query_len`` or T, the batch), the kernel reads ``query_start_loc`` and ``seq_lens``
on the device, so a prefill step captures in a CUDA graph once its variant is compiled and has
passed its self-check. Nothing is allocated per call beyond ``out`` and the LSE when the caller
passes none; without ``return_lse`` the kernel is compiled without an LSE argument.

The op runs on the shared launcher (:mod:`cute_kernels.ops._launch`): the first call with a new
combination of shapes, strides and dtypes validates everything (the same checks for CPU and CUDA
tensors, so code that passes on the CPU passes on the GPU) and prepares a :class:`_Launch` (config
from :mod:`cute_kernels.plans.sm90_prefill`, one generated positional caller); later calls look it
up by a tuple of cheap tensor attributes and go straight to the TVM-FFI call, which checks dtypes,
ranks, shared extents, devices and alignment itself; when it refuses one, the call is validated in
full for an error that names the argument. CPU tensors run :func:`cute_kernels.reference.paged_prefill`.

Which kernel runs comes from the registry (:func:`prefill_kernel`): the first prefill kernel of
the device's arch that takes the dtypes and the GQA group (an FP8 query: the SM90 or SM100 kernel,
the reference elsewhere; a 16-bit query on an FP8 cache on SM100: the portable kernel, the op never
quantizes a query itself; a window or sinks: the SM90 kernel's variants or the SM100 kernel, the
reference where only the portable kernel would take the call);
``tuning_override(backend="sm80")`` forces the portable one (its plan: :mod:`cute_kernels.plans.sm80`).
CPU tensors are validated as on an SM90 GPU.

The SM90 kernels (both query paths, the window / sink variants, the opt-in persistent schedule
and shared-memory epilogue) are available: verified by the GPU suite on the H200
(docs/design/sm90-prefill.md#status). The SM100 kernel is compile-verified
(registry status): before the first launch of a variant family in a process, :mod:`._selfcheck`
runs that variant on a few small problems against the reference; a family that fails is served by
``sm80.prefill`` from then on (the reference for an FP8 query, a window or sinks), with a logged
warning. The SM90 kernels keep their check (:func:`self_check_cases`), which runs whenever the
registry lists one as compile-verified.

Checked mode (``CUTE_KERNELS_CHECK=1``, :mod:`cute_kernels.ops._check`) also validates the data
(``query_start_loc``, ``max_query_len``, ``seq_lens`` within the block table, block-table entries
in range, tensor scales) before each launch; it synchronizes, so it is off by default. Registered
as ``torch.ops.cute_kernels.paged_prefill`` and ``paged_prefill_out`` (:mod:`cute_kernels.ops._library`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal, Optional, overload

import torch
from torch import Tensor

from .. import reference
from .._types import KVCache, Scale
from ..jit.compiler import get_kernel
from ..jit.spec import check_override
from ..plans import sm80
from ..plans import sm90_prefill as plan
from ..plans.args import INT32_MAX, check_window_left, fp32_note, positive_fp32
from ..registry import KERNELS, KernelInfo, op_kernel
from . import _check
from . import _library as library
from . import _paged_prefill_sm100 as sm100
from ._device import check_devices, current_device, on_device, served_device
from ._launch import Launcher, TuningOverride, check_scale
from ._library import cache_of, cache_parts, compiling, custom_op, no_lse, scale_of, scale_parts
from ._selfcheck import Case, ensure, launch_prefill_now, prefill_expected, prefill_problem, to_device
from ._torch import check_kv_cache, check_tensor, compile_target, device_sm_count, dtype_name

FP8 = torch.float8_e4m3fn

# the caller's per-call parameters (ops._launch.bind), and where each signature name comes from
_CALL_PARAMS = ("q", "k", "v", "block_table", "seq_lens", "query_start_loc", "out", "lse", "k_scale", "v_scale",
                "q_scale", "max_query_len", "sinks", "window_left", "q_residual")
_SOURCES = {"kv_cache": "k", "k_cache": "k", "v_cache": "v"}


@dataclass
class _Launch:
    """Everything a call needs that depends only on its key."""

    fn: Any  # the compiled kernel's caller (ops._launch.bind); None for the reference
    out_shape: tuple
    out_dtype: torch.dtype
    reference: bool = False
    empty: bool = False  # T == 0 or B == 0: nothing to launch
    tall: Optional[_RowsFirst] = None  # sm80.prefill with heads_first: the grid a longer max_query_len takes


class _RowsFirst:
    """The portable prefill's grid with the row tiles first, for a ``max_query_len`` whose row
    tiles the ``heads_first`` grid cannot hold (above ``max_q``); compiled on first use."""

    def __init__(self, max_q: int, make) -> None:
        self.max_q, self._make, self._fn = max_q, make, None

    def fn(self):
        if self._fn is None:
            self._fn = self._make()
        return self._fn


def tuning_override(**fields: object) -> TuningOverride:
    """``with tuning_override(tile_n=64, pingpong=False): ...`` forces kernel tuning fields (for
    benchmarks and tests comparing variants); the override is part of the launch-cache key.
    ``backend="sm80"`` runs the portable ``sm80.prefill`` on any arch (its fields then: ``widen``,
    ``stages``, ``tw``..., ``smem_target`` for a ring sized for another target's shared memory)."""
    return _launcher.tuning_override(**fields)


BACKENDS = {"sm80": "sm80.prefill"}  # tuning_override(backend=...) -> the kernel it forces
_PORTABLE = BACKENDS["sm80"]
_CPU_TARGET = "sm_90a"  # CPU tensors are validated for the kernel an SM90 GPU would run
_SM90_FIXED = ("out_dtype", "q_scale", "window", "sinks", "q_terms")  # the call decides them (q_terms: q_residual)


# the config fields a call decides from its arguments (an override may not set them)
_CALL_FIELDS = ("q_dtype", "kv_dtype", "head_dim", "group", "page_size", "kv_form", "kv_layout", "causal", "write_lse",
                "k_scale_tensor", "v_scale_tensor")


def check_tuning_override(kernel_id: str, override: dict) -> None:
    """The tuning override (its ``backend`` aside) against the kernel ``kernel_id`` a call selects:
    each field one of its config's tuning fields (or ``smem_target`` for the portable kernel), of
    the field's type (:func:`cute_kernels.jit.spec.check_override`); the SM100 kernel's are its
    plan's (checked where its config is made). The values' ranges are the configs' own checks."""
    backend = override.get("backend")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"tuning_override: backend must be one of {tuple(BACKENDS)} (or absent), got {backend!r}")
    fields = {k: v for k, v in override.items() if k != "backend"}
    if kernel_id == _PORTABLE:
        check_override(sm80.Sm80PrefillConfig, fields, fixed=("target", *_CALL_FIELDS), extra=("smem_target",))
    elif kernel_id != sm100.KERNEL_ID:
        check_override(plan.Sm90PrefillConfig, fields, fixed=(*_CALL_FIELDS, *_SM90_FIXED))


def prefill_kernel(target: str, q_dtype: str, kv_dtype: str, group: int, backend: str | None = None) -> KernelInfo:
    """The kernel a prefill runs (:func:`cute_kernels.registry.op_kernel`, with the GQA group; an
    FP8 query: ``sm100.prefill`` on SM100 / SM103, else the SM90 FP8-query kernel; a 16-bit query
    on an FP8 cache on SM100 / SM103: the portable kernel, see :mod:`._paged_prefill_sm100`), or
    the one ``backend`` forces."""
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {tuple(BACKENDS)} (or absent), got {backend!r}")
        if q_dtype == "fp8_e4m3":
            raise ValueError(f"backend={backend!r} takes no FP8 query")
        return KERNELS[BACKENDS[backend]]
    if q_dtype == "fp8_e4m3":
        return KERNELS[sm100.KERNEL_ID if sm100.runs_on(target) else "sm90.prefill_fp8q"]
    info = op_kernel("paged_prefill", "prefill", target, q_dtype, kv_dtype, group)
    if info.id == sm100.KERNEL_ID and kv_dtype == "fp8_e4m3":  # QK in FP8 needs the caller's q_scale
        return KERNELS[_PORTABLE]
    return info


def _key(q, k, pair, block_table, query_start_loc, kv_layout, causal, sm_scale, q_scale, k_scale, v_scale, out,
         return_lse, window_left=-1, sinks=None, q_residual=None):
    """What selects the kernel: the query and cache geometry, the batch, the options (with their
    types: ``causal=1`` must reach the validation), the types of the k/v scales (a 1-element
    tensor of any rank goes to the kernel as a ``[1]`` view) and the shape of a tensor ``q_scale``
    (one element or per KV head: another variant). Left to the compiled function's own checks:
    the other tensors' dtypes, extents tied by name to the query's or the cache's (V, seq_lens,
    out...), devices, alignment. ``out``'s strides are in it: a view whose elements share memory
    (stride 0) is refused by the validation, which a compiled function would not do. ``query_start_loc``'s extent is tied to nothing, so its shape is
    in the key, and the current device (a launch off it runs in a device guard: :mod:`._device`)."""
    # type(), not isinstance(): torch.Tensor's metaclass makes isinstance slow
    qs = q_scale.shape if type(q_scale) is torch.Tensor else type(q_scale)
    return (q.shape, q.stride(), q.dtype, q.device, pair, k.shape, k.stride(), k.dtype, block_table.shape,
            query_start_loc.shape, kv_layout, causal, type(causal), sm_scale, qs, type(k_scale), type(v_scale),
            None if out is None else (out.dtype, out.stride()), return_lse, type(return_lse), _launcher.override_key,
            window_left == -1, type(window_left), sinks is None, q_residual is None,
            current_device() if q.is_cuda else -1)


def _q_scale_kind(q, Hkv, q_scale) -> str:
    """Validate ``q_scale`` against the query (values never read); the config's ``q_scale`` kind."""
    if q.dtype != FP8:
        if q_scale is not None:
            raise ValueError("q_scale applies only to an FP8 query; a bf16/fp16 query is never rescaled")
        return "none"
    if q_scale is None:
        raise ValueError("an FP8 query needs q_scale (the scale it was quantized with)")
    if not check_scale("q_scale", q_scale, device=q.device, num_q_heads=q.shape[1], num_kv_heads=Hkv):
        return "scalar"
    return "tensor" if q_scale.numel() == 1 else "per_head"


def _prepare(q, k, v, pair, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale,
             q_scale, k_scale, v_scale, out, return_lse, window_left=-1, sinks=None, q_residual=None) -> _Launch:
    """Full validation (clear errors naming the argument, the same for CPU and CUDA tensors) and
    kernel selection for one key."""
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float16, FP8), ndim=3)
    T, Hq, D = q.shape
    device = served_device("q", q)
    P, Hkv, page = check_kv_cache(k, v, pair, kv_layout, D)
    check_devices(device, **({"k_cache": k, "v_cache": v} if pair else {"kv_cache": k}))
    if P == 0:  # a TMA descriptor needs a non-empty tensor: refused before any launch
        raise ValueError(f"{'k_cache' if pair else 'kv_cache'} has no pages (P = 0): an empty KV pool cannot be "
                         "attended; allocate at least one page (docs/design/inputs.md#kv-pool)")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"num q heads ({Hq}) must be a multiple of num kv heads ({Hkv})")
    if q.dtype == FP8:
        if k.dtype != FP8:
            raise TypeError(f"an FP8 query needs a float8_e4m3fn kv_cache, got {k.dtype}")
    elif k.dtype not in (FP8, q.dtype, torch.float16):
        raise TypeError(f"kv_cache dtype must be float8_e4m3fn or the query's dtype {q.dtype} (or float16 for a "
                        f"bfloat16 query), got {k.dtype}")
    override = dict(_launcher.override)
    backend = override.pop("backend", None)
    target = compile_target(device) if q.is_cuda else _CPU_TARGET
    info = prefill_kernel(target, dtype_name(q.dtype), dtype_name(k.dtype), Hq // Hkv, backend)
    if info.head_dims is not None and D not in info.head_dims:
        raise ValueError(f"head_dim must be one of {info.head_dims}, got {D}")
    if info.page_sizes is not None and page not in info.page_sizes:
        raise ValueError(f"page size must be one of {info.page_sizes}, got {page}")
    if info.max_gqa_ratio is not None and Hq // Hkv > info.max_gqa_ratio:
        raise ValueError(f"Hq / Hkv must be <= {info.max_gqa_ratio}, got {Hq // Hkv}")
    ks_t = check_scale("k_scale", k_scale, device=device)
    vs_t = check_scale("v_scale", v_scale, device=device)
    q_scale_kind = _q_scale_kind(q, Hkv, q_scale)
    reference.check_q_residual(q, q_residual, q_scale)
    if q_residual is not None:
        check_tensor("q_residual", q_residual, dtype=FP8, shape=(T, Hq, D), device=device)
    two_term = q_residual is not None and info.id == "sm90.prefill_fp8q"  # no other kernel takes a second term
    terms: dict[str, Any] = {"q_terms": 2} if two_term else {}
    scale = D ** -0.5 if sm_scale is None else sm_scale
    if not positive_fp32(scale):  # finite as the kernels' fp32 scalar too
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}{fp32_note(scale)}")
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
        check_tensor("out", out, dtype=out_dtypes, shape=(T, Hq, D), device=device, output=True)
    out_dtype = out_dtypes[0] if out is None else out.dtype
    _check_window_sinks(window_left, sinks, Hq, device)
    features = window_left != -1 or sinks is not None  # the portable kernel has neither
    if features and info.id == _PORTABLE and backend is not None:
        raise ValueError(f"backend={backend!r} takes no window or sinks")
    fields = dict(zip(_CALL_FIELDS, (dtype_name(q.dtype), dtype_name(k.dtype), D, Hq // Hkv, page,
                                     "pair" if pair else "single", kv_layout, causal, return_lse, ks_t, vs_t)))
    config: sm80.Sm80PrefillConfig | plan.Sm90PrefillConfig | sm100.Sm100PrefillConfig
    check_tuning_override(info.id, override)
    if info.id == _PORTABLE:
        config = sm80.make_prefill_config(target=target, **fields, **override)
    elif q_residual is not None and not two_term:
        return _Launch(None, (T, Hq, D), out_dtype, reference=True)  # e.g. SM100: no two-term variant
    elif info.id == sm100.KERNEL_ID and not sm100.takes(q.dtype, k.dtype, q_scale_kind):
        return _Launch(None, (T, Hq, D), out_dtype, reference=True)  # a per-KV-head q_scale: no variant takes it
    elif info.id == sm100.KERNEL_ID:
        config = sm100.make_config(out_dtype=dtype_name(out_dtype), q_scale=q_scale_kind, sinks=sinks is not None,
                                   override=override, **fields)
    else:
        config = plan.make_prefill_config(out_dtype=dtype_name(out_dtype), q_scale=q_scale_kind, window=window_left != -1,
                                          sinks=sinks is not None, **fields, **override, **terms)
    # pointer and stride alignment, from the signature the kernel is compiled with (TMA wants 16 bytes)
    tensors = dict(q=q, kv_cache=k, k_cache=k, v_cache=v, block_table=block_table, seq_lens=seq_lens,
                   query_start_loc=query_start_loc, out=out, q_residual=q_residual)
    for arg in config.signature():
        t = tensors.get(arg.name)
        if t is not None and getattr(arg, "align", 0) > t.element_size():
            check_tensor(arg.name, t, align_bytes=arg.align)
    shape = (T, Hq, D)
    if not q.is_cuda:
        return _Launch(None, shape, out_dtype, reference=True)
    if T == 0 or B == 0:
        return _Launch(None, shape, out_dtype, empty=True)
    if info.id == _PORTABLE and features:  # no kernel here takes a window or sinks with these dtypes / group
        return _Launch(None, shape, out_dtype, reference=True)
    if q.dtype == FP8 and target not in config.targets:  # an FP8 query off SM90: no kernel takes it
        return _Launch(None, shape, out_dtype, reference=True)
    if target not in config.targets:
        raise ValueError(f"{config.kernel_id} runs on {'/'.join(config.targets)}, this GPU is {target}: "
                         "use cute_kernels.reference.paged_prefill (dispatch.plan picks it)")
    if isinstance(config, plan.Sm90PrefillConfig) and config.persistent and not _self_check_passes(config, device):
        config = replace(config, persistent=False)  # a persistent family that failed it keeps the default grid
    if isinstance(config, plan.Sm90PrefillConfig) and config.epilogue != "registers" and \
            (features or not _self_check_passes(config, device)):
        # with a window or sinks the shared-memory epilogue has not run on a GPU (compiled only), and a
        # family that failed its check keeps the register epilogue: docs/design/sm90-prefill.md#epilogue-through-shared-memory-opt-in-epiloguesmem
        config = replace(config, epilogue="registers")
    if info.id != _PORTABLE and not _self_check_passes(config, device):  # a family that failed it
        if q.dtype == FP8 or features:  # no other kernel takes them: the reference serves it
            return _Launch(None, shape, out_dtype, reference=True)
        config = sm80.make_prefill_config(target=target, **fields)  # the portable kernel serves it
    fn = get_kernel(config, target)
    sources = dict(_SOURCES)
    for name, is_tensor in (("k_scale", ks_t), ("v_scale", vs_t)):
        if is_tensor:  # the key holds the type only: a 1-element tensor of any rank is viewed as [1]
            sources[name] = f"{name}.view(1)?"
    if q_scale_kind == "tensor" and q_scale.dim() != 1:  # the key holds the shape
        sources["q_scale"] = "q_scale.view(1)"
    constants: dict[str, Any] = dict(sm_scale=float(scale))
    if getattr(config, "persistent", False):  # one wave of resident CTAs on this device (no sync: a property)
        constants["num_ctas"] = plan.persistent_ctas(device_sm_count(device.index or 0))
    call = _launcher.bind(_CALL_PARAMS, (fn, config.signature(), sources, constants))
    tall = None
    if isinstance(config, sm80.Sm80PrefillConfig) and config.heads_first:
        rows_first = replace(config, heads_first=False)
        tall = _RowsFirst(sm80.prefill_heads_first_max_q(config.group, config.rows), lambda: on_device(
            _launcher.bind(_CALL_PARAMS, (get_kernel(rows_first, target), rows_first.signature(), sources, constants)),
            device))
    return _Launch(on_device(call, device), shape, out_dtype, tall=tall)


def _check_window_sinks(window_left, sinks, Hq: int, device) -> None:
    """``window_left``: an int in ``[-1, INT32_MAX]`` (-1: no window); ``sinks``: None or fp32 ``[Hq]`` on q's
    device."""
    check_window_left(window_left)
    if sinks is not None:
        check_tensor("sinks", sinks, dtype=torch.float32, shape=(Hq,), device=device)


def _check_max_query_len(max_query_len, T: int, B: int) -> None:
    """``max_query_len``: None or an int; T rows in B requests need one of at least ceil(T / B)."""
    if max_query_len is None:
        return
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be None or a non-negative int, got {max_query_len!r}")
    if max_query_len * B < T:
        raise ValueError(f"max_query_len ({max_query_len}) is below every split of T={T} rows into {B} requests")


def _check_data(q, k, v, pair, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale,
                q_scale, k_scale, v_scale, out, return_lse, window_left=-1, sinks=None, q_residual=None) -> None:
    """Checked mode (``CUTE_KERNELS_CHECK=1``): the data rules the kernel cannot refuse without
    synchronizing (docs/design/inputs.md#checked-mode)."""
    P, _, page = check_kv_cache(k, v, pair, kv_layout, q.shape[2])
    q_lens = _check.query_start_loc("query_start_loc", query_start_loc, q.shape[0], max_query_len)
    _check.lengths("seq_lens", seq_lens, block_table.shape[1] * page, q_lens=q_lens)
    _check.pages("block_table", block_table, seq_lens, page, P)
    _check.scales(k_scale=k_scale, v_scale=v_scale, q_scale=q_scale)


# forward-only, as the kernels: no autograd history, an out= that requires grad written in place
# (docs/design/inputs.md#the-classes)
@torch.no_grad()
def _reference(q, k, v, pair, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale,
               q_scale, k_scale, v_scale, out, return_lse, window_left=-1, sinks=None, q_residual=None):
    out_dtype = (out.dtype if out is not None else torch.bfloat16) if q.dtype == FP8 else q.dtype
    res = reference.paged_prefill(q, (k, v) if pair else k, block_table, seq_lens, query_start_loc,
                                  max_query_len=max_query_len, kv_layout=kv_layout, causal=causal, sm_scale=sm_scale,
                                  q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                                  out_dtype=out_dtype, window_left=window_left, sinks=sinks, q_residual=q_residual)
    res, lse = res if return_lse else (res, None)
    if out is not None:
        out.copy_(res)
        res = out
    return (res, lse) if return_lse else res


_launcher = Launcher(_prepare, _reference, check_data=_check_data, op="paged_prefill")
_cache = _launcher  # the launch cache under the name the lab's host-cost probe reads (profiling/host_costs.py)


@overload
def paged_prefill(q: Tensor, kv_cache: KVCache, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, *,
                  max_query_len: int | None = ..., kv_layout: str = ..., causal: bool = ..., sm_scale: float | None = ...,
                  q_scale: Scale | None = ..., k_scale: Scale = ..., v_scale: Scale = ..., out: Tensor | None = ...,
                  return_lse: Literal[False] = ..., window_left: int = ..., sinks: Tensor | None = ...,
                  q_residual: Tensor | None = ...) -> Tensor: ...
@overload
def paged_prefill(q: Tensor, kv_cache: KVCache, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, *,
                  max_query_len: int | None = ..., kv_layout: str = ..., causal: bool = ..., sm_scale: float | None = ...,
                  q_scale: Scale | None = ..., k_scale: Scale = ..., v_scale: Scale = ..., out: Tensor | None = ...,
                  return_lse: Literal[True], window_left: int = ...,
                  sinks: Tensor | None = ..., q_residual: Tensor | None = ...) -> tuple[Tensor, Tensor]: ...
@overload
def paged_prefill(q: Tensor, kv_cache: KVCache, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, *,
                  max_query_len: int | None = ..., kv_layout: str = ..., causal: bool = ..., sm_scale: float | None = ...,
                  q_scale: Scale | None = ..., k_scale: Scale = ..., v_scale: Scale = ..., out: Tensor | None = ...,
                  return_lse: bool, window_left: int = ...,
                  sinks: Tensor | None = ..., q_residual: Tensor | None = ...) -> Tensor | tuple[Tensor, Tensor]: ...
def paged_prefill(
    q: Tensor,
    kv_cache: KVCache,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    *,
    max_query_len: int | None = None,
    kv_layout: str = "HND",
    causal: bool = True,
    sm_scale: float | None = None,
    q_scale: Scale | None = None,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    out: Tensor | None = None,
    return_lse: bool = False,
    window_left: int = -1,
    sinks: Tensor | None = None,
    q_residual: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
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

    Supported here: SM90 (verified by the GPU suite on the H200) and SM100 / SM103
    (compile-verified only, no SM100 GPU has run it: a one-time runtime self-check per variant
    family guards the first launch, the portable kernel or the reference serves a family that
    fails it), head_dim 64/128/256,
    page size 16/32/64/128, Hq / Hkv up to ``plans.sm90_prefill.MAX_GROUP``. Returns ``out`` and,
    with ``return_lse``, the base-2 LSE ``[T, Hq]`` fp32.

    ``window_left`` (row j of a request at ``p = seq_len - q_len + j`` sees keys ``>= p -
    window_left``; -1: none; KV tiles and pages outside every row's window are never read) and
    ``sinks`` (fp32 ``[Hq]`` natural-log sink logits in each row's denominator) select the
    kernel's window / sink variants (available, verified on the H200 like the rest):
    docs/design/sm90-prefill.md#sliding-window-and-sinks.

    ``q_residual`` (opt-in): the second term of a two-term FP8 query, float8_e4m3fn shaped like
    ``q`` (``quantize_query(..., residual=True)``); the query is ``(q + q_residual) · q_scale``.
    SM90 runs it on ``sm90.prefill_fp8x2`` (compile-verified: self-checked before its first
    launch), other archs on the reference: docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2.
    """
    if compiling():  # torch.compile traces the registered op (the eager path never pays for it)
        return _traced(q, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal,
                       sm_scale, q_scale, k_scale, v_scale, out, return_lse, window_left, sinks, q_residual)
    k, v_part = cache_parts(kv_cache)
    pair, v = v_part is not None, k if v_part is None else v_part
    try:
        key = _key(q, k, pair, block_table, query_start_loc, kv_layout, causal, sm_scale, q_scale, k_scale, v_scale,
                   out, return_lse, window_left, sinks, q_residual)
    except (AttributeError, TypeError):  # not tensors: the validation says what is wrong
        key = None
    launch = _launcher.entries.get(key)
    if launch is None or launch.reference:  # the argument tuple is built off the hot path only
        args = (q, k, v, pair, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale,
                q_scale, k_scale, v_scale, out, return_lse, window_left, sinks, q_residual)
        launch = launch or _launcher.lookup(key, args)
        if launch.reference:
            return _launcher.run_reference(args)
    else:  # values the key leaves out
        if max_query_len is not None:
            _check_max_query_len(max_query_len, q.shape[0], block_table.shape[0])
        if type(window_left) is not int or not -1 <= window_left <= INT32_MAX:  # the key holds -1 or not
            _check_window_sinks(window_left, sinks, q.shape[1], q.device)
    if out is None:
        out = torch.empty(launch.out_shape, dtype=launch.out_dtype, device=q.device)
    lse = torch.empty(launch.out_shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    if launch.empty:  # no rows, or no requests (then no rows either): nothing to launch
        return out if lse is None else (out, lse)
    max_q = q.shape[0] if max_query_len is None else min(max_query_len, q.shape[0])
    fn = launch.fn if launch.tall is None or max_q <= launch.tall.max_q else launch.tall.fn()
    try:
        fn(q, k, v, block_table, seq_lens, query_start_loc, out, lse, k_scale, v_scale, q_scale, max_q, sinks,
           window_left, q_residual)
    except Exception:  # raises the error that names the argument
        _launcher.refused((q, k, v, pair, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal,
                           sm_scale, q_scale, k_scale, v_scale, out, return_lse, window_left, sinks, q_residual))
        raise
    return out if lse is None else (out, lse)  # lse is None unless return_lse


# ---------------------------------------------------------------------------------------------
# torch.library: torch.ops.cute_kernels.paged_prefill / paged_prefill_out
# ---------------------------------------------------------------------------------------------


def _run(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale,
         q_scale, q_scale_tensor, k_scale, k_scale_tensor, v_scale, v_scale_tensor, return_lse, window_left, sinks,
         q_residual, out) -> Tensor:
    res = paged_prefill(q, cache_of(k_cache, v_cache), block_table, seq_lens, query_start_loc,
                        max_query_len=max_query_len, kv_layout=kv_layout, causal=causal, sm_scale=sm_scale,
                        q_scale=q_scale_tensor if q_scale_tensor is not None else q_scale,
                        k_scale=scale_of(k_scale, k_scale_tensor), v_scale=scale_of(v_scale, v_scale_tensor), out=out,
                        return_lse=return_lse, window_left=window_left, sinks=sinks, q_residual=q_residual)
    return res[1] if return_lse else no_lse(q)


@custom_op("paged_prefill")
def _paged_prefill_op(q: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], block_table: Tensor, seq_lens: Tensor,
                      query_start_loc: Tensor, max_query_len: Optional[int], kv_layout: str, causal: bool,
                      sm_scale: Optional[float], q_scale: Optional[float], q_scale_tensor: Optional[Tensor],
                      k_scale: float, k_scale_tensor: Optional[Tensor], v_scale: float, v_scale_tensor: Optional[Tensor],
                      return_lse: bool, window_left: int, sinks: Optional[Tensor],
                      q_residual: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    out = library.attention_out(q)
    lse = _run(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale,
               q_scale, q_scale_tensor, k_scale, k_scale_tensor, v_scale, v_scale_tensor, return_lse, window_left,
               sinks, q_residual, out)
    return out, lse


@_paged_prefill_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale, q_scale,
      q_scale_tensor, k_scale, k_scale_tensor, v_scale, v_scale_tensor, return_lse, window_left, sinks, q_residual):
    return library.attention_out(q), library.attention_lse(q, return_lse)


@custom_op("paged_prefill_out", mutates=("out",))
def _paged_prefill_out_op(q: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], block_table: Tensor,
                          seq_lens: Tensor, query_start_loc: Tensor, max_query_len: Optional[int], kv_layout: str,
                          causal: bool, sm_scale: Optional[float], q_scale: Optional[float],
                          q_scale_tensor: Optional[Tensor], k_scale: float, k_scale_tensor: Optional[Tensor],
                          v_scale: float, v_scale_tensor: Optional[Tensor], return_lse: bool, window_left: int,
                          sinks: Optional[Tensor], q_residual: Optional[Tensor], out: Tensor) -> Tensor:
    return _run(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal,
                sm_scale, q_scale, q_scale_tensor, k_scale, k_scale_tensor, v_scale, v_scale_tensor, return_lse,
                window_left, sinks, q_residual, out)


@_paged_prefill_out_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale, q_scale,
      q_scale_tensor, k_scale, k_scale_tensor, v_scale, v_scale_tensor, return_lse, window_left, sinks, q_residual,
      out):
    return library.attention_lse(q, return_lse)


def _traced(q, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal, sm_scale, q_scale,
            k_scale, v_scale, out, return_lse, window_left, sinks, q_residual=None):
    """:func:`paged_prefill` as torch.compile sees it (as :func:`..paged_decode._traced`)."""
    q_scales = (None, None) if q_scale is None else scale_parts(q_scale)
    args = (q, *cache_parts(kv_cache), block_table, seq_lens, query_start_loc, max_query_len, kv_layout, causal,
            sm_scale, *q_scales, *scale_parts(k_scale), *scale_parts(v_scale), return_lse, window_left, sinks,
            q_residual)
    if out is None:
        out, lse = _paged_prefill_op(*args)
    else:
        lse = _paged_prefill_out_op(*args, out)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# the runtime self-check (it runs while the registry lists the kernel as compile-verified)
# ---------------------------------------------------------------------------------------------

# (rtol, atol) per kind: outputs of V ~ N(0, 1); P rounded to 16 bits, or to e4m3 for an FP8 query.
# The check catches broken kernels (garbage rows, NaN, wrong masks), not the last bits.
SELF_CHECK_TOL = {"16": (2e-2, 2e-2), "widen": (2e-2, 2e-2), "fp8": (1e-1, 1e-1)}
SELF_CHECK_SEED = 2029


def _self_check_passes(config, device) -> bool:
    """The self-check of ``config``'s kernel (SM90's here, SM100's in :mod:`._paged_prefill_sm100`)."""
    if config.kernel_id == sm100.KERNEL_ID:
        return sm100.self_check_passes(config, device)
    return self_check_passes(config, device)


def self_check_passes(config: plan.Sm90PrefillConfig, device) -> bool:
    """The one-time runtime check of ``config``'s family (:func:`plans.sm90_prefill.family`) on
    ``device``: the variant itself (same compile key, so no extra compile) on small varlen,
    chunked problems against the reference. True at once when the registry no longer lists its
    kernel as compile-verified (verified on the GPU: ``available``)."""
    if KERNELS[plan.check_registry_id(config)].status != "compile-verified":
        return True
    fam = plan.config_family(config)
    return ensure(fam, device, lambda: self_check_cases(config, device))


def self_check_cases(config: plan.Sm90PrefillConfig, device) -> list[Case]:
    """Two problems in the variant's own dtypes, layout, container and scale forms, on two KV heads:
    four requests (128+ rows over two query blocks without a prefix, an empty one, a chunk after a
    cached prefix ending mid-page, one row after a long prefix) with NaN-poisoned page tails, and
    one full-prefill request of two query blocks with ``max_query_len``. Inputs are built on the
    CPU from a fixed seed; the reference runs on the CPU copies."""
    rtol, atol = SELF_CHECK_TOL[config.kind]
    page = config.page_size
    problems = (([(0, 130), (40, 0), (3 * page + 5, 20), (300, 1)], None), ([(0, 256)], 256))
    # the persistent schedule: one wave of CTAs, and 3 CTAs that each walk many tiles (the pipeline's
    # stages and the query buffer carried from tile to tile)
    grids = (plan.persistent_ctas(device_sm_count(torch.device(device).index or 0)), 3) if config.persistent \
        else (None,)
    g = torch.Generator(device="cpu").manual_seed(SELF_CHECK_SEED)
    cases = []
    for i, (reqs, max_q) in enumerate(problems):
        # the window / sink variants: a window shorter than the prompts (tiles skipped, pages
        # zero-filled at its start)
        host = prefill_problem(config, reqs, g, q_scale=config.q_scale, window=75 if config.window else -1)
        for ctas in grids:
            dev = to_device(host, device)
            if ctas is not None:
                dev["num_ctas"] = ctas
            name = f"problem {i} (seed {SELF_CHECK_SEED})" + ("" if ctas is None else f", {ctas} CTAs")
            cases.append(Case(name, partial(_launch_now, config, dev, max_q),
                              partial(prefill_expected, config, host, max_q), rtol, atol))
    return cases


def _launch_now(config, t: dict, max_query_len):
    """The self-check's own call of ``config`` (compiled for the tensors' device)."""
    return launch_prefill_now(get_kernel(config, compile_target(t["q"].device)), config, t, max_query_len)
