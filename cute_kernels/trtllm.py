"""FlashInfer's TRT-LLM attention calls, argument for argument, on this package's kernels.

``cute_kernels.trtllm.batch_decode_with_kv_cache`` and ``batch_context_with_kv_cache`` take the
arguments of FlashInfer's ``trtllm_batch_decode_with_kv_cache`` and
``trtllm_batch_context_with_kv_cache`` (the subsets listed below) with their semantics, so an
engine switches by changing an import: SM90 runs ``sm90.decode`` (XQA in FlashInfer) and
``sm90.prefill``, SM100 / SM103 the tcgen05 ``sm100.decode`` (trtllm-gen in FlashInfer), CPU
tensors and archs without a kernel the reference.

Units (docs/design/trtllm.md#units):

- ``logits = (q . k) * bmm1_scale`` in natural-log units, ``bmm1_scale = sm_scale * q_scale *
  k_scale``; ``out = softmax(logits) . v * bmm2_scale`` (``bmm2_scale = v_scale``). Each scale is
  a positive float or a 1-element (0-d included) fp32 tensor on the query's device, read on the
  device (it may change between CUDA-graph replays). They reach the kernels as the ops'
  ``k_scale = bmm1_scale``, ``v_scale = bmm2_scale``, ``sm_scale = 1`` (and ``q_scale = 1`` for
  an FP8 query): the same products.
- ``sinks``: fp32 ``[Hq]``, one logit per query head in the units of the scaled logits: it joins
  the denominator as ``exp(sinks[h])`` and adds no value; the LSE includes it.
- ``window_left = w >= 0``: the query at position ``p`` sees keys ``p - w ... p``; -1: none.
- The LSE (``return_lse``) is base 2, ``log2(sum exp(logits))`` ``[tokens, Hq]`` fp32: FlashInfer's
  convention for its TRT-LLM kernels (its trtllm-gen launchers pass ``lse_scale = 1`` on a
  base-2 softmax, and its decode docstring calls the TRT-LLM backend contract "FP32 base-2"), and
  this package's: it is returned as the kernels write it.
- ``workspace_buffer``: the caller's memory (any dtype, contiguous, 16-byte aligned, allocated
  zeroed once as FlashInfer asks and kept for every call): the split partials, the unused LSE
  target and the merge counters live in it; there is no hidden workspace on this path
  (docs/design/trtllm.md#workspace).
"""

from __future__ import annotations

import logging
import re

import torch

from . import reference
from .ops._caller_workspace import check_workspace
from .ops._device import served_device
from .ops._torch import compile_target
from .ops.paged_decode import paged_decode
from .ops.paged_prefill import paged_prefill
from .plans.args import FP32_MAX, fp32_note, positive_fp32
from .plans.sm100 import TARGETS as FP8_QK_TARGETS
from .registry import KERNELS, arch_of_target

FP8 = torch.float8_e4m3fn
log = logging.getLogger("cute_kernels")
_SERVED: dict = {}  # (op, phase, device) -> whether a kernel of this build serves it there

# the ops' argument names as this API spells them, for the errors raised below it
_RENAMES = ((r"\bq\b", "query"), (r"\bblock_table\b", "block_tables"), (r"\bk_scale\b", "bmm1_scale"),
            (r"\bv_scale\b", "bmm2_scale"), (r"\bworkspace\b", "workspace_buffer"),
            (r"\bquery_start_loc\b", "cum_seq_lens_q"), (r"\bmax_query_len\b", "max_q_len"))


def _renamed(exc: Exception) -> Exception:
    msg = str(exc)
    for pattern, name in _RENAMES:
        msg = re.sub(pattern, name, msg)
    return type(exc)(msg)


def _check_scale(name: str, value, device) -> None:
    """A positive finite float, or a 1-element fp32 tensor (any rank) on the query's device."""
    if type(value) is float and 0.0 < value <= FP32_MAX:
        return
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            raise TypeError(f"{name} must be a float or a float32 tensor, got dtype {value.dtype}")
        if value.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor, got shape {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} must be on {device} (the query's device), got {value.device}")
        return
    if not positive_fp32(value):  # finite as the kernels' fp32 scalar too
        raise ValueError(f"{name} must be a positive finite float or a 1-element float32 tensor, got {value!r}"
                         f"{fp32_note(value)}")


def _int_arg(name: str, value, lowest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
    return value


def _lengths(name: str, t, device):
    """int32 (or uint32, viewed as int32: the same bits for lengths below 2^31) ``[B]`` lengths."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.uint32:
        t = t.view(torch.int32)
    elif t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype int32 or uint32, got {str(t.dtype).replace('torch.', '')}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the query's device), got {t.device}")
    return t


def _kv_cache(kv_cache):
    """FlashInfer's cache forms as the ops take them: a ``(k, v)`` pair, a ``[P, 2, ...]`` tensor,
    or a ``[P, 1, ...]`` tensor (K and V are the same data: passed as the pair ``(kv, kv)``)."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError(f"kv_cache must be a (k_cache, v_cache) pair, got {len(kv_cache)} tensors")
        return tuple(kv_cache)
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor or a (k_cache, v_cache) pair, got {type(kv_cache).__name__}")
    if kv_cache.dim() == 5 and kv_cache.shape[1] == 1:
        return kv_cache[:, 0], kv_cache[:, 0]
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_pages, 1 or 2, ...] (5-D), got shape {tuple(kv_cache.shape)}")
    return kv_cache


def _out_dtype(query, out, out_dtype) -> torch.dtype:
    """FlashInfer's rule (``out_dtype``, else ``out``'s, else the query's), checked against what the
    kernels write: the query's dtype, bf16 for an FP8 query; no kernel writes FP8 (e4m3) output."""
    dt = out_dtype if out_dtype is not None else (out.dtype if isinstance(out, torch.Tensor) else query.dtype)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {dt!r}")
    written = torch.bfloat16 if query.dtype == FP8 else query.dtype
    if dt == FP8:
        raise ValueError("out_dtype float8_e4m3fn is not supported: no kernel of this package writes an FP8 output "
                         f"(pass out_dtype={written} and quantize the output)")
    if dt != written:
        raise ValueError(f"out_dtype must be {written} for a {query.dtype} query (the dtype the kernels write), got {dt}")
    if out is not None and isinstance(out, torch.Tensor) and out.dtype != dt:
        raise ValueError(f"out has dtype {out.dtype} but out_dtype is {dt}")
    return dt


def served(op: str, phase: str, device) -> bool:
    """Whether a kernel of this build serves ``op`` for ``phase`` on ``device`` (the registry's
    entries of that op, arch and phase that are available or compile-verified); CPU tensors run
    the reference. Otherwise the reference serves the call, with one warning per device."""
    key = (op, phase, device)
    ok = _SERVED.get(key)
    if ok is None:
        target = compile_target(device)
        arch = arch_of_target(target)
        ok = any(k.op == op and phase in k.phases and arch in k.archs and k.status in ("available", "compile-verified")
                 for k in KERNELS.values())
        if not ok:
            log.warning("cute_kernels.trtllm: no %s kernel of this build runs on %s (%s); the reference serves it",
                        phase, target, device)
        _SERVED[key] = ok
    return ok


def _check_fp8_query(query) -> None:
    """An FP8 query needs a kernel that runs QK in FP8 (SM100 / SM103); SM90's decode widens an FP8
    cache to the 16-bit query's type, so it takes none: a clear error instead of a silent cast."""
    if query.dtype == FP8 and query.is_cuda and compile_target(query.device) not in FP8_QK_TARGETS:
        raise ValueError(f"query is float8_e4m3fn, but no decode kernel for {compile_target(query.device)} runs QK "
                         f"in FP8 (only {', '.join(FP8_QK_TARGETS)}); pass a bf16/fp16 query")


def batch_decode_with_kv_cache(
    query: torch.Tensor,
    kv_cache,
    workspace_buffer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    bmm1_scale=1.0,
    bmm2_scale=1.0,
    window_left: int = -1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    sinks: torch.Tensor | None = None,
    kv_layout: str = "HND",
    q_len_per_req: int = 1,
    return_lse: bool = False,
):
    """Paged decode with FlashInfer's ``trtllm_batch_decode_with_kv_cache`` arguments and semantics.

    Args:
        query: ``[B * q_len_per_req, Hq, D]`` bf16/fp16, or float8_e4m3fn already quantized by the
            caller (its scale folded into ``bmm1_scale``; only where a kernel runs QK in FP8:
            SM100 / SM103, else a ``ValueError``).
        kv_cache: ``[num_pages, 1 or 2, Hkv, page, D]`` (HND) / ``[num_pages, 1 or 2, page, Hkv, D]``
            (NHD), or a ``(k_cache, v_cache)`` pair of 4-D halves; bf16/fp16 (the query's dtype)
            or float8_e4m3fn.
        workspace_buffer: the caller's CUDA buffer for split partials and counters (see the module
            docstring); unused for CPU tensors.
        block_tables: int32 ``[B, max_pages]``.
        seq_lens: int32 or uint32 ``[B]``: each request's KV length including its new tokens.
        max_seq_len: an int >= 0, FlashInfer's grid bound; these kernels read ``seq_lens`` on the
            device and need none (its value is not checked against them, which would synchronize).
        bmm1_scale, bmm2_scale: see the module docstring.
        window_left: sliding window (-1: none); tiles and pages outside it are skipped.
        out: optional ``[B * q_len_per_req, Hq, D]`` output, written in place.
        out_dtype: the output dtype (FlashInfer's default: ``out``'s, else the query's); it must be
            the dtype the kernels write (the query's; bf16 for an FP8 query).
        sinks: optional fp32 ``[Hq]`` sink logits.
        kv_layout: ``"HND"`` or ``"NHD"``.
        q_len_per_req: draft tokens per request (speculative decoding); causal among them.
        return_lse: also return the base-2 LSE ``[B * q_len_per_req, Hq]`` fp32.

    Returns:
        ``out``, and ``(out, lse)`` with ``return_lse``.
    """
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    device = served_device("query", query)
    _int_arg("max_seq_len", max_seq_len, 0)
    _check_scale("bmm1_scale", bmm1_scale, device)
    _check_scale("bmm2_scale", bmm2_scale, device)
    _out_dtype(query, out, out_dtype)
    _check_fp8_query(query)
    lens = _lengths("seq_lens", seq_lens, device)
    decode = paged_decode if not query.is_cuda or served("paged_decode", "decode", device) else _reference_decode
    try:
        return decode(query, _kv_cache(kv_cache), block_tables, lens, kv_layout=kv_layout,
                            q_len_per_req=q_len_per_req, sm_scale=1.0, k_scale=bmm1_scale, v_scale=bmm2_scale,
                            q_scale=1.0 if query.dtype == FP8 else None, out=out, return_lse=return_lse,
                            window_left=window_left, sinks=sinks, workspace=workspace_buffer)
    except (TypeError, ValueError) as exc:
        raise _renamed(exc) from None


def _reference_decode(query, kv_cache, block_tables, seq_lens, *, kv_layout, q_len_per_req, sm_scale, k_scale,
                      v_scale, q_scale, out, return_lse, window_left, sinks, workspace):
    """An arch no decode kernel serves: the reference, written into ``out`` when given."""
    res = reference.paged_decode(query, kv_cache, block_tables, seq_lens, kv_layout=kv_layout,
                                 q_len_per_req=q_len_per_req, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
                                 q_scale=q_scale, return_lse=return_lse, window_left=window_left, sinks=sinks)
    o, lse = res if return_lse else (res, None)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o


def _batch(name: str, t, batch_size: int, device):
    """A ``[batch_size + 1]`` int32 (or uint32) cumulative-length tensor on the query's device."""
    t = _lengths(name, t, device)
    if t.dim() != 1 or t.shape[0] != batch_size + 1:
        raise ValueError(f"{name} must be [batch_size + 1] = [{batch_size + 1}], got shape {tuple(t.shape)}")
    return t


def batch_context_with_kv_cache(
    query: torch.Tensor,
    kv_cache,
    workspace_buffer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    bmm1_scale,
    bmm2_scale,
    batch_size: int,
    cum_seq_lens_q: torch.Tensor,
    cum_seq_lens_kv: torch.Tensor,
    window_left: int = -1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    sinks: torch.Tensor | None = None,
    kv_layout: str = "HND",
    causal: bool = True,
    return_lse: bool = False,
):
    """Paged prefill with FlashInfer's ``trtllm_batch_context_with_kv_cache`` arguments and semantics.

    Args:
        query: ``[T, Hq, D]``, the new tokens of ``batch_size`` requests packed by
            ``cum_seq_lens_q``; bf16/fp16, or float8_e4m3fn quantized by the caller (its scale in
            ``bmm1_scale``; QK then runs in FP8: ``sm90.prefill_fp8q``).
        kv_cache, workspace_buffer, bmm1_scale, bmm2_scale, sinks, kv_layout, return_lse: as
            :func:`batch_decode_with_kv_cache` (the prefill kernels need no scratch: the buffer is
            validated, not used).
        block_tables: int32 ``[batch_size, max_pages]``; seq_lens: int32 or uint32
            ``[batch_size]``, each request's KV length including its new tokens.
        max_q_len: an int >= 0, the longest request's query length (it sizes the grid; a value
            below a request's length leaves that request's rows beyond it unspecified, as FlashInfer).
        max_kv_len: an int >= 0, FlashInfer's grid bound; not needed here (not compared with
            ``seq_lens``, which would synchronize).
        batch_size: the number of requests: ``block_tables``, ``seq_lens``, ``cum_seq_lens_q`` and
            ``cum_seq_lens_kv`` must agree with it.
        cum_seq_lens_q: int32 ``[batch_size + 1]`` query offsets (0 ... T).
        cum_seq_lens_kv: ``[batch_size + 1]`` int32: FlashInfer's per-request KV offsets, which its
            paged kernels do not read (vLLM passes cumulative page counts): checked for its shape
            and dtype only.
        window_left: sliding window (-1: none), causal only (as FlashInfer); row j of request b at
            ``p = seq_lens[b] - q_len_b + j`` sees keys ``p - window_left ... p``.
        out, out_dtype: FlashInfer's rule, then the kernels' dtype: the query's for a 16-bit query;
            bf16 or fp16 for an FP8 query (FP8 output: ``ValueError``).
        causal: causal within each request's new tokens, or every key of the request.

    Returns:
        ``out``, and ``(out, lse)`` (base 2, ``[T, Hq]`` fp32) with ``return_lse``.
    """
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    device = served_device("query", query)
    for name, value in (("max_q_len", max_q_len), ("max_kv_len", max_kv_len), ("batch_size", batch_size)):
        _int_arg(name, value, 0)
    _check_scale("bmm1_scale", bmm1_scale, device)
    _check_scale("bmm2_scale", bmm2_scale, device)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not causal and window_left != -1:
        raise NotImplementedError("a sliding window needs causal=True (FlashInfer's trtllm context call takes no "
                                  "non-causal window either); pass window_left=-1")
    dt = _context_out_dtype(query, out, out_dtype)
    lens = _lengths("seq_lens", seq_lens, device)
    if lens.dim() != 1 or lens.shape[0] != batch_size:
        raise ValueError(f"seq_lens must be [batch_size] = [{batch_size}], got shape {tuple(lens.shape)}")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.shape[0] != batch_size:
        raise ValueError(f"block_tables must be [batch_size = {batch_size}, max_pages], got "
                         f"{tuple(block_tables.shape) if isinstance(block_tables, torch.Tensor) else block_tables!r}")
    starts = _batch("cum_seq_lens_q", cum_seq_lens_q, batch_size, device)
    _batch("cum_seq_lens_kv", cum_seq_lens_kv, batch_size, device)
    check_workspace(workspace_buffer, device)
    fp8 = query.dtype == FP8
    kw = dict(max_query_len=max_q_len, kv_layout=kv_layout, causal=causal, sm_scale=1.0, q_scale=1.0 if fp8 else None,
              k_scale=bmm1_scale, v_scale=bmm2_scale, return_lse=return_lse, window_left=window_left, sinks=sinks)
    try:
        if query.is_cuda and not served("paged_prefill", "prefill", device):
            res = reference.paged_prefill(query, _kv_cache(kv_cache), block_tables, lens, starts, out_dtype=dt, **kw)
            if out is None:
                return res
            out.copy_(res[0] if return_lse else res)
            return (out, res[1]) if return_lse else out
        if out is None and fp8 and dt != torch.bfloat16:  # the op writes bf16 for an FP8 query unless given out
            out = torch.empty(query.shape, dtype=dt, device=device)
        return paged_prefill(query, _kv_cache(kv_cache), block_tables, lens, starts, out=out, **kw)
    except (TypeError, ValueError) as exc:
        raise _renamed(exc) from None


def _context_out_dtype(query, out, out_dtype) -> torch.dtype:
    """FlashInfer's rule, then what the prefill kernels write: the query's dtype for a 16-bit
    query, bf16 or fp16 for an FP8 one."""
    if query.dtype != FP8:
        return _out_dtype(query, out, out_dtype)
    dt = out_dtype if out_dtype is not None else (out.dtype if isinstance(out, torch.Tensor) else query.dtype)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {dt!r}")
    if dt == FP8:
        raise ValueError("out_dtype float8_e4m3fn is not supported: no kernel of this package writes an FP8 output "
                         "(pass out_dtype=torch.bfloat16 or torch.float16)")
    if dt not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be bfloat16 or float16 for an FP8 query, got {dt}")
    if isinstance(out, torch.Tensor) and out.dtype != dt:
        raise ValueError(f"out has dtype {out.dtype} but out_dtype is {dt}")
    return dt
