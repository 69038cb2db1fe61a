"""Reference semantics: the contract every kernel of this package is tested against.

Pure torch, any device, math in float32 (``float64=True`` for float64). Slow on purpose: it
gathers each request's pages and runs plain softmax attention, so it is easy to audit.

Conventions shared by all ops
-----------------------------
- **KV cache.** One tensor ``[P, 2, Hkv, page, D]`` (``kv_layout="HND"``) or
  ``[P, 2, page, Hkv, D]`` (``"NHD"``), index 0 of dim 1 = K, 1 = V; or a ``(k_cache, v_cache)``
  tuple of the 4-D halves ``[P, Hkv, page, D]`` / ``[P, page, Hkv, D]``. Dtype bf16, fp16 or
  float8_e4m3fn; last dim contiguous, other strides free.
- **Pages.** ``block_table`` int32 ``[B, max_pages]``; request b's token t lives in physical page
  ``block_table[b, t // page]`` at offset ``t % page``. Only the first ``ceil(seq_len / page)``
  entries of a row are used. A page id outside ``[0, P)`` reads as a page of zeros (kernels
  never dereference it).
- **Lengths.** ``seq_lens`` int32 ``[B]`` = each request's total KV length *including* its
  ``q_len`` new tokens. Query token j (0-based within its request) sits at position
  ``p = seq_len - q_len + j`` and sees KV positions ``<= p`` (causal within the speculative draft or
  the prefill chunk; a non-causal prefill sees all ``seq_len``), and none at or past the block
  table's capacity ``max_pages * page``: a ``seq_len`` beyond it attends the positions the table
  can address (a row left with none gives 0 and LSE ``-inf``).
- **Sliding window.** ``window_left = w >= 0``: the query at position ``p`` sees only positions
  ``p - w ... p`` (``w + 1`` keys at most); ``-1``: no window (FlashInfer's convention). A key no
  query of its request sees is never read: its page may have been freed and hold anything.
- **Sinks.** ``sinks`` fp32 ``[Hq]``: one logit per query head, in the units of the scaled logits
  (natural log). It joins the softmax denominator as ``exp(sinks[h])`` and contributes no value:
  ``out = sum_j exp(l_j) v_j / (sum_j exp(l_j) + exp(sinks[h]))``; the LSE includes it
  (``lse = log2(sum_j exp(l_j) + exp(sinks[h]))``). A row that sees no key then has output 0 and
  lse ``sinks[h] / ln 2``.
- **Scales.** ``logits = (q · (k · k_scale)) · sm_scale`` (times ``q_scale`` for an FP8 query),
  ``sm_scale`` defaults to ``D ** -0.5``; ``out = softmax(logits) · (v · v_scale)``. A scale is a
  Python float or a 1-element fp32 tensor. FP8 values are stored as ``x / scale``, so ``scale``
  multiplies them back. An FP8 query's ``q_scale`` may also be an fp32 ``[Hkv]`` tensor (per KV
  head: query head h uses ``q_scale[h // (Hq // Hkv)]``).
- **LSE.** Base 2: ``lse = log2(sum_j 2^(logits_j · log2 e)) = logsumexp(logits) / ln 2`` of the
  scaled logits, fp32. A row that sees no KV has output 0 and lse ``-inf``.
- **FP8 conversion.** ``saturate(round_to_nearest_even(x / scale))`` to float8_e4m3fn (±448).
  A two-term FP8 query adds the residual ``lo = e4m3(x / scale - hi)`` of the codes ``hi``
  (:func:`quantize_query` with ``residual=True``); the query is then ``(hi + lo) · q_scale``.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
from torch import Tensor

from ._types import KVCache, Rope, Scale

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def scale_value(scale: Scale, name: str = "scale") -> float | torch.Tensor:
    """A float, or a 1-element tensor returned as a 0-d fp32 tensor (no host sync)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor, got shape {tuple(scale.shape)}")
        return scale.reshape(()).float()
    return float(scale)


def query_scale(q_scale: Scale, num_q_heads: int) -> float | torch.Tensor:
    """``q_scale`` per tensor (a float or a 0-d fp32 tensor) or per query head (an fp32 ``[Hq]``
    tensor expanded from a per-KV-head ``[Hkv]`` one)."""
    if isinstance(q_scale, torch.Tensor) and q_scale.numel() > 1:
        if q_scale.dim() != 1 or num_q_heads % q_scale.numel():
            raise ValueError(f"per-head q_scale must be [Hkv] with Hq % Hkv == 0, got {tuple(q_scale.shape)}")
        return q_scale.float().repeat_interleave(num_q_heads // q_scale.numel())
    return scale_value(q_scale, "q_scale")


def split_kv_cache(kv_cache: KVCache, kv_layout: str = "HND") -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` as ``[P, Hkv, page, D]`` views (HND order) whatever the input layout."""
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError("kv_cache tuple must be (k_cache, v_cache)")
        k, v = kv_cache
        if k.dim() != 4 or v.dim() != 4 or k.shape != v.shape:
            raise ValueError(f"k_cache/v_cache must be 4-D of one shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    else:
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [P, 2, ...] 5-D, got {tuple(kv_cache.shape)}")
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    if kv_layout == "NHD":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def _to_float(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype)


def _gather_request(cache: torch.Tensor, pages: torch.Tensor, length: int, dtype) -> torch.Tensor:
    """``[Hkv, length, D]`` of one request from HND-ordered ``cache [P, Hkv, page, D]``."""
    P, Hkv, page, D = cache.shape
    n_pages = (length + page - 1) // page
    ids = pages[:n_pages].long()
    valid = (ids >= 0) & (ids < P)
    rows = cache[ids.clamp(0, max(P - 1, 0))].to(dtype)  # [n_pages, Hkv, page, D]
    # select, not multiply: the clamped-to page may hold NaN/inf, and 0 * NaN is NaN
    rows = torch.where(valid.view(-1, 1, 1, 1), rows, torch.zeros((), dtype=dtype, device=rows.device))
    return rows.permute(1, 0, 2, 3).reshape(Hkv, n_pages * page, D)[:, :length]


# ----------------------------------------------------------------------------------------------
# paged decode
# ----------------------------------------------------------------------------------------------


def paged_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_layout: str = "HND",
    q_len_per_req: int = 1,
    sm_scale: float | None = None,
    q_scale: Scale | None = None,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    return_lse: bool = False,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    float64: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged decode attention (see the module docstring for the conventions).

    Args:
        q: ``[B * q_len_per_req, Hq, D]`` bf16/fp16, or float8_e4m3fn with ``q_scale``. Rows of a
            request are consecutive (request-major, then draft token).
        kv_cache: see module docstring. ``Hq`` must be a multiple of ``Hkv``; query head h reads
            KV head ``h // (Hq // Hkv)``.
        block_table: int32 ``[B, max_pages]``.
        seq_lens: int32 ``[B]``, total KV length of each request including its new tokens.
        q_len_per_req: draft tokens per request (1 for plain decode).
        sm_scale: softmax scale, default ``D ** -0.5``.
        q_scale: required for (and only for) an FP8 query.
        k_scale, v_scale: KV dequantization scales.
        return_lse: also return the base-2 LSE ``[B * q_len, Hq]`` fp32.
        window_left: sliding window (``-1``: none), see the module docstring.
        sinks: fp32 ``[Hq]`` sink logits, see the module docstring.

    Returns:
        ``out`` ``[B * q_len, Hq, D]`` in q's dtype (bf16 for an FP8 q), and ``lse`` if asked.
    """
    acc = torch.float64 if float64 else torch.float32
    k_cache, v_cache = split_kv_cache(kv_cache, kv_layout)
    T, Hq, D = q.shape
    P, Hkv, page, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has {D}, kv_cache has {Dk}")
    if Hq % Hkv:
        raise ValueError(f"num q heads {Hq} must be a multiple of num kv heads {Hkv}")
    B = block_table.shape[0]
    if T != B * q_len_per_req:
        raise ValueError(f"q has {T} rows, expected batch {B} x q_len_per_req {q_len_per_req}")
    if q.dtype == FP8:
        if q_scale is None:
            raise ValueError("an FP8 query needs q_scale")
        out_dtype = torch.bfloat16
    else:
        if q_scale is not None:
            raise ValueError("q_scale applies only to an FP8 query; a bf16/fp16 query is never rescaled")
        out_dtype = q.dtype
    group = Hq // Hkv
    if not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left must be an int >= -1, got {window_left!r}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != Hq):
        raise ValueError(f"sinks must be [Hq] = [{Hq}], got shape {tuple(sinks.shape)}")
    scale = (D ** -0.5) if sm_scale is None else float(sm_scale)
    qs = 1.0 if q_scale is None else scale_value(q_scale, "q_scale")
    ks = scale_value(k_scale, "k_scale")
    vs = scale_value(v_scale, "v_scale")

    out = torch.zeros((T, Hq, D), dtype=acc, device=q.device)
    lse = torch.full((T, Hq), float("-inf"), dtype=acc, device=q.device)
    sink = None if sinks is None else sinks.to(device=q.device, dtype=acc).view(1, Hq)
    if sink is not None:
        lse[:] = sink / _LN2  # rows that see no key
    lens = seq_lens.tolist()
    capacity = block_table.shape[1] * page  # positions past the block table are not attended
    for b in range(B):
        L = int(lens[b])
        n = min(L, capacity)  # the positions the table addresses
        if n <= 0:
            continue
        k = _gather_request(k_cache, block_table[b], n, acc) * ks  # [Hkv, n, D]
        v = _gather_request(v_cache, block_table[b], n, acc) * vs
        k = k.repeat_interleave(group, dim=0)  # [Hq, n, D]
        v = v.repeat_interleave(group, dim=0)
        rows = q[b * q_len_per_req:(b + 1) * q_len_per_req].to(acc) * qs  # [q_len, Hq, D]
        logits = torch.einsum("jhd,hld->jhl", rows, k) * scale  # [q_len, Hq, n]
        o, row_lse = _softmax_rows(logits, v, _visible(L, q_len_per_req, window_left, q.device, n), sink)
        out[b * q_len_per_req:(b + 1) * q_len_per_req] = o
        lse[b * q_len_per_req:(b + 1) * q_len_per_req] = row_lse
    out = out.to(out_dtype)
    if return_lse:
        return out, lse.float()
    return out


def _visible(L: int, q_len: int, window_left: int, device, n: int | None = None) -> torch.Tensor:
    """``[q_len, 1, n]`` bool: query j (at position ``L - q_len + j``) sees key ``pos < n``
    (``n``: the keys gathered, ``L`` by default; fewer past the block table's capacity)."""
    n = L if n is None else n
    pos = torch.arange(n, device=device).view(1, 1, n)
    q_pos = (L - q_len + torch.arange(q_len, device=device)).view(-1, 1, 1)
    visible = pos <= q_pos
    if window_left >= 0:
        visible &= pos >= q_pos - window_left
    return visible


def _softmax_rows(logits: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sink):
    """Softmax attention of ``logits [j, Hq, L]`` (natural log) over the visible keys, with the
    sink logits ``[1, Hq]`` (or None) in the denominator: ``(out [j, Hq, D], base-2 lse [j, Hq])``;
    rows with no visible key give output 0 and lse -inf (or the sink's)."""
    logits = logits.masked_fill(~visible, float("-inf"))
    # select, not multiply: a key outside every row's window may hold NaN, and 0 * NaN is NaN
    v = torch.where(visible.any(dim=0).view(1, -1, 1), v, torch.zeros((), dtype=v.dtype, device=v.device))
    has_any = visible.any(dim=-1).expand(logits.shape[:2])
    if sink is not None:
        has_any = torch.ones_like(has_any)
        logits = torch.cat([logits, sink.view(1, -1, 1).expand(logits.shape[0], -1, 1)], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[:, :1])], dim=1)  # the sink adds no value
    row_lse = torch.logsumexp(logits, dim=-1)  # [j, Hq]
    probs = torch.where(has_any.unsqueeze(-1), torch.exp(logits - row_lse.unsqueeze(-1)), 0.0)
    o = torch.einsum("jhl,hld->jhd", probs, v)
    return o, torch.where(has_any, row_lse / _LN2, torch.full_like(row_lse, float("-inf")))


# ----------------------------------------------------------------------------------------------
# paged prefill
# ----------------------------------------------------------------------------------------------

# Default chunk sizes of the prefill reference: the largest temporaries are the logits of one
# block, q_chunk x Hq x kv_chunk in the accumulation dtype (64 MiB in fp32 for 32 heads).
PREFILL_Q_CHUNK = 256
PREFILL_KV_CHUNK = 2048


def _gather_span(cache: torch.Tensor, pages: torch.Tensor, p0: int, p1: int, dtype) -> torch.Tensor:
    """``[Hkv, p1 - p0, D]``: KV positions ``[p0, p1)`` of one request from HND-ordered ``cache``;
    ``pages`` must cover position ``p1 - 1``. A page id outside ``[0, P)`` reads as zeros."""
    P, Hkv, page, D = cache.shape
    c0, c1 = p0 // page, (p1 - 1) // page + 1
    ids = pages[c0:c1].long()
    valid = (ids >= 0) & (ids < P)
    rows = cache[ids.clamp(0, max(P - 1, 0))].to(dtype)  # [c1 - c0, Hkv, page, D]
    # select, not multiply: the clamped-to page may hold NaN/inf, and 0 * NaN is NaN
    rows = torch.where(valid.view(-1, 1, 1, 1), rows, torch.zeros((), dtype=dtype, device=rows.device))
    rows = rows.permute(1, 0, 2, 3).reshape(Hkv, (c1 - c0) * page, D)
    return rows[:, p0 - c0 * page:p1 - c0 * page]


def prefill_block(state: tuple[Tensor, Tensor, Tensor], rows: Tensor, k: Tensor, v: Tensor, visible: Tensor,
                  scale: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One online-softmax step of the prefill reference: ``rows [qc, Hkv, G, D]`` against the KV
    block ``k, v [Hkv, kc, D]``; ``visible [qc, kc]``; ``state = (m, l, o)`` (running max, sum of
    exponentials, unnormalized output), returned updated. Its logits ``[qc, Hkv, G, kc]`` are the
    largest temporary of :func:`paged_prefill` (module-level so that tests can watch the bound)."""
    m, total, o = state
    logits = torch.einsum("qhgd,hkd->qhgk", rows, k) * scale
    logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
    m_new = torch.maximum(m, logits.amax(dim=-1))
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)  # no -inf - -inf
    alpha = torch.exp(m - m_safe)
    p = torch.exp(logits - m_safe.unsqueeze(-1))
    return m_new, total * alpha + p.sum(dim=-1), o * alpha.unsqueeze(-1) + torch.einsum("qhgk,hkd->qhgd", p, v)


def _fold_sink(m, total, o, sink):
    """The online state ``(m, sum exp(l - m), sum exp(l - m) v)`` with one more logit, ``sink``,
    that adds no value (natural log; a -inf max or sink contributes nothing, never ``inf - inf``)."""
    big = torch.maximum(m, sink.expand_as(m))
    safe = torch.where(torch.isneginf(big), torch.zeros_like(big), big)
    keep = torch.where(torch.isneginf(m), torch.zeros_like(m), torch.exp(m - safe))
    extra = torch.where(torch.isneginf(sink), torch.zeros_like(sink), torch.exp(sink - safe))
    return big, total * keep + extra, o * keep.unsqueeze(-1)


def check_q_residual(q: Tensor, q_residual: Tensor | None, q_scale: Scale | None) -> None:
    """``q_residual``: None, or float8_e4m3fn shaped like an FP8 ``q`` that has a ``q_scale``."""
    if q_residual is None:
        return
    if not isinstance(q_residual, torch.Tensor):
        raise TypeError(f"q_residual must be a float8_e4m3fn tensor or None, got {type(q_residual).__name__}")
    if q.dtype != FP8 or q_scale is None:
        raise ValueError("q_residual is the second term of an FP8 query: it needs a float8_e4m3fn q and its q_scale")
    if q_residual.dtype != FP8:
        raise TypeError(f"q_residual must be float8_e4m3fn, got {q_residual.dtype}")
    if q_residual.shape != q.shape:
        raise ValueError(f"q_residual must have q's shape {tuple(q.shape)}, got {tuple(q_residual.shape)}")
    if q_residual.device != q.device:
        raise ValueError(f"q_residual must be on q's device {q.device}, got {q_residual.device}")


def prefill_spans(query_start_loc: torch.Tensor, num_tokens: int, max_query_len: int | None = None) -> list[int]:
    """``query_start_loc`` as a host list, checked: ``[0] == 0``, non-decreasing, ``[-1] == T``,
    every request's query length ``<= max_query_len`` when given (raises naming the index)."""
    starts = [int(x) for x in query_start_loc.tolist()]
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(f"query_start_loc must start at 0 and end at T={num_tokens}, got {starts[0]} ... {starts[-1]}")
    for b in range(len(starts) - 1):
        n = starts[b + 1] - starts[b]
        if n < 0:
            raise ValueError(f"query_start_loc must be non-decreasing; it decreases at index {b + 1}")
        if max_query_len is not None and n > max_query_len:
            raise ValueError(f"max_query_len ({max_query_len}) is below request {b}'s query length {n}")
    return starts


def paged_prefill(
    q: torch.Tensor,
    kv_cache: KVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int | None = None,
    kv_layout: str = "HND",
    causal: bool = True,
    sm_scale: float | None = None,
    q_scale: Scale | None = None,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    float64: bool = False,
    q_chunk: int = PREFILL_Q_CHUNK,
    kv_chunk: int = PREFILL_KV_CHUNK,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    q_residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged prefill attention of a varlen batch (see the module docstring for the conventions).

    Args:
        q: ``[T, Hq, D]``: the new tokens of B requests, packed (bf16/fp16, or float8_e4m3fn with
            ``q_scale``). Request b owns rows ``query_start_loc[b] : query_start_loc[b + 1]``
            (``q_len_b`` of them, 0 allowed); they are the last ``q_len_b`` positions of its
            ``seq_lens[b]`` tokens (a cached prefix comes first).
        kv_cache, block_table, seq_lens, kv_layout, k_scale, v_scale: as :func:`paged_decode`.
        query_start_loc: int32 ``[B + 1]``, non-decreasing from 0 to T.
        max_query_len: optional upper bound on every ``q_len_b`` (checked here).
        causal: query j of request b sees KV positions ``< seq_lens[b] - q_len_b + j + 1``;
            without it, all ``seq_lens[b]`` positions.
        q_scale: required for (and only for) an FP8 query: per tensor, or fp32 ``[Hkv]``.
        return_lse: also return the base-2 LSE ``[T, Hq]`` fp32.
        out_dtype: the output dtype (default q's; bf16 for an FP8 query, which may also write fp16).
        q_chunk, kv_chunk: the block sizes (results agree across them up to rounding).
        window_left: sliding window (``-1``: none): row j of request b, at position
            ``p = seq_lens[b] - q_len_b + j``, sees only keys ``>= p - window_left`` (causal or not).
        sinks: fp32 ``[Hq]`` sink logits (natural log), as :func:`paged_decode`; a row that sees
            no key then gives 0 and LSE ``sinks[h] / ln 2``.
        q_residual: a two-term FP8 query's second term (float8_e4m3fn shaped like ``q``, from
            :func:`quantize_query` with ``residual=True``; an FP8 ``q`` and ``q_scale`` only): the
            query is ``(q + q_residual) · q_scale``.

    Defined results for data a kernel cannot refuse without synchronizing: KV positions at or
    past the block table's capacity (``max_pages * page``) are not attended; an invalid page id
    reads as zeros; a row that sees no KV (``seq_len <= 0``, or ``q_len > seq_len`` for its first
    rows) gives 0 and LSE ``-inf``. A malformed ``query_start_loc`` raises ``ValueError``.

    Memory: queries run in blocks of ``q_chunk`` rows against KV blocks of ``kv_chunk`` positions
    merged online, so besides the ``[T, Hq, D]`` output and ``[T, Hq]`` LSE (in the accumulation
    dtype) the working set is ``O(q_chunk * Hq * kv_chunk)`` for the logits plus
    ``O((kv_chunk + 2 page) * Hkv * D)`` for one gathered K/V block, whatever the prompt length
    (with the defaults and 32 fp32 heads: 64 MiB of logits).

    Returns:
        ``out`` ``[T, Hq, D]`` in ``out_dtype``, and ``lse`` if asked.
    """
    acc = torch.float64 if float64 else torch.float32
    k_cache, v_cache = split_kv_cache(kv_cache, kv_layout)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    T, Hq, D = q.shape
    P, Hkv, page, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has {D}, kv_cache has {Dk}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"num q heads {Hq} must be a multiple of num kv heads {Hkv}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [B, max_pages], got shape {tuple(block_table.shape)}")
    B, width = block_table.shape
    if tuple(seq_lens.shape) != (B,):
        raise ValueError(f"seq_lens must be [B={B}], got shape {tuple(seq_lens.shape)}")
    if tuple(query_start_loc.shape) != (B + 1,):
        raise ValueError(f"query_start_loc must be [B + 1={B + 1}], got shape {tuple(query_start_loc.shape)}")
    for name, n in (("q_chunk", q_chunk), ("kv_chunk", kv_chunk)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    check_q_residual(q, q_residual, q_scale)
    if q.dtype == FP8:
        if q_scale is None:
            raise ValueError("an FP8 query needs q_scale")
        out_dtype = out_dtype or torch.bfloat16
        qs = query_scale(q_scale, Hq)
        if isinstance(qs, torch.Tensor) and qs.dim():
            per_head = q_scale if isinstance(q_scale, torch.Tensor) else qs  # qs has a dim only for a tensor
            if qs.numel() != Hq or per_head.numel() != Hkv:
                raise ValueError(f"per-KV-head q_scale must have Hkv={Hkv} elements, got {tuple(per_head.shape)}")
            qs = qs.to(acc).view(1, Hq, 1)
    else:
        if q_scale is not None:
            raise ValueError("q_scale applies only to an FP8 query; a bf16/fp16 query is never rescaled")
        out_dtype, qs = out_dtype or q.dtype, 1.0
    scale = (D ** -0.5) if sm_scale is None else float(sm_scale)
    ks = scale_value(k_scale, "k_scale")
    vs = scale_value(v_scale, "v_scale")
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left must be an int >= -1, got {window_left!r}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != Hq):
        raise ValueError(f"sinks must be [Hq] = [{Hq}], got shape {tuple(sinks.shape)}")
    starts = prefill_spans(query_start_loc, T, max_query_len)
    lens = seq_lens.tolist()
    capacity = width * page  # positions past the block table are not attended
    group = Hq // Hkv
    dev = q.device

    out = torch.zeros((T, Hq, D), dtype=acc, device=dev)
    lse = torch.full((T, Hq), float("-inf"), dtype=acc, device=dev)
    sink = None if sinks is None else sinks.to(device=dev, dtype=acc).view(1, Hkv, group)
    if sink is not None:
        lse[:] = sink.view(1, Hq) / _LN2  # rows that see no key
    for b in range(B):
        s, n = starts[b], starts[b + 1] - starts[b]
        L = int(lens[b])
        kv_end = min(L, capacity)
        for j0 in range(0, n, q_chunk):
            j1 = min(n, j0 + q_chunk)
            pos = L - n + torch.arange(j0, j1, device=dev)  # the rows' positions
            if causal:
                limit = (pos + 1).clamp(max=kv_end)
            else:
                limit = torch.full((j1 - j0,), kv_end, device=dev)
            hi = min(kv_end, L - n + j1) if causal else kv_end  # = limit.max(), without a sync
            # a window: keys >= each row's position - window_left (the first row's bounds the block)
            lo = max(0, L - n + j0 - window_left) if window_left >= 0 else 0
            if hi <= lo:
                continue  # these rows see no KV: 0 and -inf (or the sink's LSE)
            rows = q[s + j0:s + j1].to(acc)
            if q_residual is not None:
                rows = rows + q_residual[s + j0:s + j1].to(acc)
            rows = (rows * qs).view(j1 - j0, Hkv, group, D)
            state = (torch.full((j1 - j0, Hkv, group), float("-inf"), dtype=acc, device=dev),
                     torch.zeros((j1 - j0, Hkv, group), dtype=acc, device=dev),
                     torch.zeros((j1 - j0, Hkv, group, D), dtype=acc, device=dev))
            for p0 in range(lo, hi, kv_chunk):
                p1 = min(hi, p0 + kv_chunk)
                k = _gather_span(k_cache, block_table[b], p0, p1, acc) * ks
                v = _gather_span(v_cache, block_table[b], p0, p1, acc) * vs
                keys = torch.arange(p0, p1, device=dev).view(1, -1)
                visible = keys < limit.view(-1, 1)
                if window_left >= 0:
                    visible &= keys >= (pos - window_left).view(-1, 1)
                    # select, not multiply: a key no row sees may hold anything (a freed page's NaN)
                    v = torch.where(visible.any(dim=0).view(1, -1, 1), v, torch.zeros((), dtype=acc, device=dev))
                state = prefill_block(state, rows, k, v, visible, scale)
            m, total, o = state
            if sink is not None:  # the sink joins the denominator: exp(sink), no value
                m, total, o = _fold_sink(m, total, o, sink)
            has = total > 0
            safe = torch.where(has, total, torch.ones_like(total))
            out[s + j0:s + j1] = torch.where(has.unsqueeze(-1), o / safe.unsqueeze(-1), 0.0).view(j1 - j0, Hq, D)
            lse[s + j0:s + j1] = torch.where(has, (m + torch.log(safe)) / _LN2,
                                             torch.full_like(m, float("-inf"))).view(j1 - j0, Hq)
    out = out.to(out_dtype)
    if return_lse:
        return out, lse.float()
    return out


# ----------------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------------


def merge_states(partial_out: Tensor, partial_lse: Tensor, *, float64: bool = False) -> tuple[Tensor, Tensor]:
    """Merge split partial states.

    Args:
        partial_out: fp32 ``[S, N, H, D]``.
        partial_lse: fp32 ``[S, N, H]``, base 2.

    Returns:
        ``(out fp32 [N, H, D], lse fp32 [N, H])`` with ``lse = log2(sum_s 2^lse_s)`` and
        ``out = sum_s 2^(lse_s - lse) partial_out_s``. Splits with lse -inf contribute nothing
        (even if their partial output holds NaN); all-empty rows (and every row when S = 0) give
        0 and -inf.
    """
    acc = torch.float64 if float64 else torch.float32
    if partial_lse.shape[0] == 0:  # no splits: every row is empty
        _, N, H, D = partial_out.shape
        return (torch.zeros((N, H, D), dtype=torch.float32, device=partial_out.device),
                torch.full((N, H), float("-inf"), dtype=torch.float32, device=partial_out.device))
    lse_s = partial_lse.to(acc)
    m = lse_s.max(dim=0).values
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp2(lse_s - m_safe)  # 0 for empty splits
    empty = torch.isneginf(lse_s)
    po = torch.where(empty.unsqueeze(-1), torch.zeros((), dtype=acc, device=partial_out.device),
                     partial_out.to(acc))
    total = w.sum(dim=0)
    out = (w.unsqueeze(-1) * po).sum(dim=0) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    lse = torch.where(total > 0, m_safe + torch.log2(torch.where(total > 0, total, 1.0)),
                      torch.full_like(total, float("-inf")))
    return out.float(), lse.float()


# ----------------------------------------------------------------------------------------------
# layer glue: query quantization and KV-cache writes
# ----------------------------------------------------------------------------------------------


def _div_fp32(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    """``x / scale`` as a true fp32 division on any device.

    The scale is made an fp32 tensor on x's device first: CUDA computes ``tensor / host scalar``
    (a Python float or a CPU 0-d tensor) as ``tensor * (1 / scalar)``, which is off by one ulp for
    a large share of inputs and then flips some FP8 roundings away from RNE(x / scale).
    """
    return x.float() / torch.as_tensor(scale, dtype=torch.float32, device=x.device)


def quantize_fp8(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    """float8_e4m3fn = saturate(round-to-nearest-even(x / scale)), computed in fp32."""
    y = _div_fp32(x, scale)
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def rope_neox(q: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotary embedding of ``q [T, Hq, D]``, returned in fp32.

    ``cos_sin_cache [max_pos, rot_dim]`` (vLLM's layout) holds ``cos`` in its first ``rot_dim / 2``
    columns and ``sin`` in the rest; ``positions`` int ``[T]``. With ``half = rot_dim / 2``, for
    ``i < half``: ``o_i = x_i cos_i - x_{i+half} sin_i`` and ``o_{i+half} = x_{i+half} cos_i +
    x_i sin_i``, computed in fp32 from the fp32 values of q and of the cache, every product and
    sum rounded to fp32 separately (no fused multiply-add). Dims ``>= rot_dim`` pass through. A
    position outside ``[0, max_pos)`` makes that token's rotated dims NaN (kernels never read
    out of bounds).
    """
    T, Hq, D = q.shape
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache must be [max_pos, rot_dim], got {tuple(cos_sin_cache.shape)}")
    max_pos, rot = cos_sin_cache.shape
    if rot < 2 or rot % 2 or rot > D:
        raise ValueError(f"rot_dim must be even and in [2, head_dim {D}], got {rot}")
    if positions.shape != (T,):
        raise ValueError(f"positions must be [T={T}], got {tuple(positions.shape)}")
    half = rot // 2
    pos = positions.long()
    valid = (pos >= 0) & (pos < max_pos)
    nan = torch.full((), float("nan"), device=q.device)
    if max_pos == 0:
        cs = nan.expand(T, rot)
    else:
        cs = torch.where(valid.view(T, 1), cos_sin_cache[pos.clamp(0, max_pos - 1)].float(), nan)  # [T, rot]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x = q.float()
    x1, x2 = x[..., :half], x[..., half:rot]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], dim=-1)


@overload
def quantize_query(q: Tensor, q_scale: Scale, *, rope: Rope | None = ..., residual: Literal[False] = ...) -> Tensor: ...
@overload
def quantize_query(q: Tensor, q_scale: Scale, *, rope: Rope | None = ...,
                   residual: Literal[True]) -> tuple[Tensor, Tensor]: ...
def quantize_query(q: torch.Tensor, q_scale: Scale, *, rope: Rope | None = None,
                   residual: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Quantize a bf16/fp16 query ``[T, Hq, D]`` (any strides) to float8_e4m3fn.

    ``q_scale``: a float or 1-element fp32 tensor (per tensor), or an fp32 ``[Hkv]`` tensor (per
    KV head: query head h uses ``q_scale[h // (Hq // Hkv)]``). ``rope``: optional
    ``(cos_sin_cache, positions)``; the query is first rotated in fp32 by :func:`rope_neox`, then
    quantized (the rotated fp32 values are divided by the scale, never rounded to q's dtype).
    ``residual``: also return the second term ``lo = saturate(RNE(x - hi))`` of ``x = rope(q) /
    q_scale`` (fp32; ``x - hi`` is exact), so that ``(hi + lo) · q_scale`` is the two-term query.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    if rope is not None:
        q = rope_neox(q, *rope)
    x = _div_fp32(q, _per_head(query_scale(q_scale, q.shape[1])))
    hi = x.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (hi, _residual_of(x, hi)) if residual else hi


def _per_head(s: float | Tensor) -> float | Tensor:
    return s.view(1, -1, 1) if isinstance(s, torch.Tensor) and s.dim() else s


def _residual_of(x: Tensor, hi: Tensor) -> Tensor:
    return (x - hi.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def query_residual(q: torch.Tensor, q_scale: Scale, hi: torch.Tensor, *, rope: Rope | None = None) -> torch.Tensor:
    """The residual term of :func:`quantize_query` for given codes ``hi`` (on any device, in torch
    ops without a host sync: the op's two-term path after the quantization kernel)."""
    if rope is not None:
        q = rope_neox(q, *rope)
    s = _per_head(query_scale(q_scale, q.shape[1]))
    if not isinstance(s, torch.Tensor):  # a fill on the device (a host copy would not capture)
        s = torch.full((), s, dtype=torch.float32, device=q.device)
    return _residual_of(_div_fp32(q, s), hi)


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
    """Write new keys/values ``[T, Hkv, D]`` into the paged cache, in place.

    Token i goes to slot ``s = slot_mapping[i]``: page ``s // page``, offset ``s % page``. Slots
    outside ``[0, P * page)`` (``-1`` marks padding) are skipped. The cache stores ``x / scale``,
    saturated to ±448 and rounded to nearest even for float8_e4m3fn, cast for bf16/fp16.
    """
    k_cache, v_cache = split_kv_cache(kv_cache, kv_layout)  # HND views of the caller's memory
    P, Hkv, page, D = k_cache.shape
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < P * page)
    idx = keep.nonzero().flatten()
    s = slots[idx]
    pg, off = s // page, s % page
    for cache, x, sc in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        sc = scale_value(sc)
        y = _div_fp32(x[idx], sc)
        y = y.clamp(-FP8_MAX, FP8_MAX).to(FP8) if cache.dtype == FP8 else y.to(cache.dtype)
        cache[pg, :, off] = y


# ----------------------------------------------------------------------------------------------
# QSA sparse GQA attention (top-k selected tokens per query row)
# ----------------------------------------------------------------------------------------------


def qsa_valid_entries(packed_indices: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                      page_size: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per entry of a packed QSA index buffer: ``(valid, phys, offset)``, each ``[rows, TOPK]``.

    Column ``j`` of row ``r`` is *visited* iff ``j < clamp(valid_count, 0, TOPK)`` (``valid_count``
    = the last column). A visited entry holding token ``t`` is *valid* iff the row's request
    ``token_to_req[r]`` is in ``[0, num_reqs)``, ``t >= 0``, its page ``t // page_size`` is below the
    block-table width and the physical page ``block_table[req, t // page_size]`` is in
    ``[0, num_blocks)``. ``phys``/``offset`` are clamped into range for invalid entries (never
    meaningful there).
    """
    rows, width = packed_indices.shape
    topk = width - 1
    dev = packed_indices.device
    vc = packed_indices[:, topk].long().clamp(0, topk)
    t = packed_indices[:, :topk].long()
    visited = torch.arange(topk, device=dev).view(1, topk) < vc.view(rows, 1)
    num_reqs, table_width = block_table.shape
    req = token_to_req.long().view(rows, 1)
    page = torch.div(t.clamp_min(0), page_size, rounding_mode="floor")
    offset = t.clamp_min(0) - page * page_size
    valid = visited & (t >= 0) & (req >= 0) & (req < num_reqs) & (page < table_width)
    if num_reqs == 0 or table_width == 0:
        phys = torch.zeros_like(t)
        valid = torch.zeros_like(valid)
    else:
        phys = block_table[req.clamp(0, num_reqs - 1), page.clamp(max=table_width - 1)].long()
        valid &= (phys >= 0) & (phys < num_blocks)
    phys = torch.where(valid, phys, torch.zeros_like(phys))
    offset = torch.where(valid, offset, torch.zeros_like(offset))
    return valid, phys, offset


def qsa_sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    packed_indices: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    *,
    prefill: bool = False,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    out: torch.Tensor | None = None,
    output_gate: torch.Tensor | None = None,
    return_lse: bool = False,
    float64: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """QSA sparse GQA attention: each query row attends to the KV tokens its indexer selected.

    Args:
        q: ``[rows, Hq, D]`` bf16/fp16. Query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        k_cache, v_cache: ``[num_blocks, PAGE, Hkv, D]`` bf16/fp16/float8_e4m3fn, any strides (in
            production the two halves of one ``[num_blocks, Hkv, PAGE, 2 D]`` buffer, transposed).
            ``PAGE`` need not be a power of two.
        packed_indices: int32 ``[rows, TOPK + 1]``: columns ``[0, TOPK)`` hold request-relative
            token positions (``-1`` = padding, also allowed inside the counted prefix); column
            ``TOPK`` holds ``valid_count``, the number of leading columns to visit (clamped to
            ``[0, TOPK]``; it is never a token).
        block_table: int32 ``[num_reqs, W]``: token ``t`` of row ``r`` lives at page
            ``block_table[token_to_req[r], t // PAGE]``, offset ``t % PAGE``.
        token_to_req: int32 ``[rows]``, the request of each row.
        prefill: which kernel configuration profile serves the call; no effect on the result.
        k_scale, v_scale: dequantization scales (floats), ``k = stored * k_scale``.
        out: optional ``[rows, Hq, D]`` output (q's dtype), written in place.
        output_gate: optional, q's shape: ``out = round(attn) * sigmoid(gate)``, the sigmoid and
            the product in fp32, rounded to q's dtype.
        return_lse: also return the base-2 LSE ``[rows, Hq]`` fp32 of the scaled logits (before
            the gate; ``-inf`` for rows without a valid entry).
        float64: accumulate in float64 instead of float32.

    Semantics. Every visited entry is independent (a token listed twice counts twice). An
    invalid entry (negative token, request out of range, page beyond the table width, physical
    page outside ``[0, num_blocks)``) contributes nothing and is never read. ``logits =
    (q . k) * D**-0.5 * k_scale``, ``attn = softmax(logits) . v * v_scale`` over the valid entries;
    a row with none gives 0 (never NaN).

    Returns:
        ``out`` (q's dtype), and the LSE with ``return_lse``.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [rows, Hq, D], got shape {tuple(q.shape)}")
    rows, Hq, D = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must be 4-D [num_blocks, PAGE, Hkv, D] of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    NB, page, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has {D}, k_cache has {Dk}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"num q heads {Hq} must be a multiple of num kv heads {Hkv}")
    if packed_indices.dim() != 2 or packed_indices.shape[0] != rows or packed_indices.shape[1] < 2:
        raise ValueError(f"packed_indices must be [rows={rows}, TOPK + 1 >= 2], got {tuple(packed_indices.shape)}")
    if token_to_req.shape != (rows,):
        raise ValueError(f"token_to_req must be [rows={rows}], got {tuple(token_to_req.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [num_reqs, W], got {tuple(block_table.shape)}")
    if output_gate is not None and output_gate.shape != q.shape:
        raise ValueError(f"output_gate must have q's shape {tuple(q.shape)}, got {tuple(output_gate.shape)}")
    acc = torch.float64 if float64 else torch.float32
    G = Hq // Hkv
    ks = scale_value(k_scale, "k_scale")
    vs = scale_value(v_scale, "v_scale")
    scale = D ** -0.5
    valid, phys, offset = qsa_valid_entries(packed_indices, block_table, token_to_req, page, NB)
    res = torch.zeros((rows, Hq, D), dtype=acc, device=q.device)
    lse = torch.full((rows, Hq), float("-inf"), dtype=acc, device=q.device)
    topk = valid.shape[1]
    # rows in chunks of ~256 MB of gathered K (or V) in the accumulation dtype
    chunk = max(1, (1 << 28) // max(1, topk * Hkv * D * (8 if float64 else 4)))
    zero = torch.zeros((), dtype=acc, device=q.device)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        ok = valid[r0:r1]
        n = int(ok.nonzero()[:, 1].max().item()) + 1 if bool(ok.any()) else 0
        if n == 0:
            continue
        ok, pg, off = ok[:, :n], phys[r0:r1, :n], offset[r0:r1, :n]
        # select, not multiply: an unused slot may hold NaN and 0 * NaN is NaN
        k = torch.where(ok[..., None, None], k_cache[pg, off].to(acc), zero) * ks  # [c, n, Hkv, D]
        v = torch.where(ok[..., None, None], v_cache[pg, off].to(acc), zero) * vs
        qq = q[r0:r1].to(acc).view(r1 - r0, Hkv, G, D)
        logits = torch.einsum("chgd,cnhd->chgn", qq, k) * scale
        logits = logits.masked_fill(~ok.view(r1 - r0, 1, 1, n), float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)  # [c, Hkv, G]
        has = ok.any(dim=1).view(r1 - r0, 1, 1)
        p = torch.where(has[..., None], torch.exp(logits - torch.where(has, row_lse, zero)[..., None]), zero)
        o = torch.einsum("chgn,cnhd->chgd", p, v)
        res[r0:r1] = o.reshape(r1 - r0, Hq, D)
        lse[r0:r1] = torch.where(has, row_lse / _LN2, torch.full_like(row_lse, float("-inf"))).reshape(r1 - r0, Hq)
    result = res.to(q.dtype)
    if output_gate is not None:
        result = (result.float() * torch.sigmoid(output_gate.float())).to(q.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse.float()) if return_lse else result
