"""``cute_kernels.paged_decode``: paged decode attention on SM90 (CuTe-DSL kernel).

The host side only looks at shapes, dtypes, strides and pointers: it never reads tensor data
and never synchronizes, so a call captures in a CUDA graph (after a warm-up call has compiled
the variant). Split-KV workspaces are allocated once per device and reused.
"""

from __future__ import annotations

import math

import torch

from .. import reference
from .._nvtx import op_range
from ..jit.compiler import get_kernel
from ..jit.spec import call_arguments
from ..sm90.decode import TILE, Sm90DecodeConfig
from ._torch import check_tensor, compile_target, device_sm_count, dtype_name

FP8 = torch.float8_e4m3fn
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32, 64, 128)
MAX_ROWS = 64  # group * q_len: the WGMMA N of one CTA
_SMEM_BUDGET = 72 * 1024  # KV stage bytes per CTA: ~3 CTAs per SM on H100/H200
_MIN_TILES_PER_SPLIT = 4


def choose_stages(kv_bytes_per_elem: int, head_dim: int) -> int:
    stage = 2 * TILE * head_dim * kv_bytes_per_elem
    return max(2, min(8, _SMEM_BUDGET // stage))


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split count from shapes only (block-table width bounds the context; no data read).

    Enough CTAs to give every SM about three of them, but never splits shorter than
    ``_MIN_TILES_PER_SPLIT`` tiles (the merge and the per-CTA setup would dominate).
    """
    ctas = batch * num_kv_heads
    want = math.ceil(3 * num_sms / max(ctas, 1))
    max_tiles = math.ceil(max_context / TILE)
    cap = max(1, max_tiles // _MIN_TILES_PER_SPLIT)
    return int(max(1, min(want, cap, 64)))


class _Workspace:
    """Per-device fp32 scratch for split partials and unused LSE outputs; grows, never shrinks."""

    def __init__(self):
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, numel: int) -> torch.Tensor:
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < numel:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "paged_decode needs a larger split-KV workspace while a CUDA graph is being "
                    "captured; run one eager call with the largest shape first (or cute_kernels.warmup)"
                )
            buf = torch.empty(max(numel, 1 << 20), dtype=torch.float32, device=device)
            self.buffers[device] = buf
        return buf


_workspace = _Workspace()


def _split_cache(kv_cache, kv_layout: str):
    """``(k, v)`` as ``[P, Hkv, page, D]`` views of the caller's memory (HND order)."""
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError("kv_cache tuple must be (k_cache, v_cache)")
        k, v = kv_cache
        check_tensor("k_cache", k, ndim=4)
        check_tensor("v_cache", v, ndim=4)
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(f"k_cache and v_cache must match, got {tuple(k.shape)} {k.dtype} / {tuple(v.shape)} {v.dtype}")
    else:
        check_tensor("kv_cache", kv_cache, ndim=5)
        if kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [P, 2, ...] (K and V), got shape {tuple(kv_cache.shape)}")
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    if kv_layout == "NHD":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def _scale_arg(name: str, value, device):
    """(kernel argument, is_tensor) for a float or a 1-element fp32 device tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32:
            raise ValueError(f"{name} must be a float or a 1-element float32 tensor, got {value.dtype} {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} must be on {device}, got {value.device}")
        return value.reshape(1), True
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a positive finite float, got {value}")
    return value, False


def paged_decode(
    q: torch.Tensor,
    kv_cache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_layout: str = "HND",
    q_len_per_req: int = 1,
    sm_scale: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
):
    """Paged decode attention with a BF16/FP16 query and an FP8/BF16/FP16 KV cache.

    Semantics are those of :func:`cute_kernels.reference.paged_decode` (read its docstring):
    ``q`` ``[B * q_len_per_req, Hq, D]`` with ``stride(-1) == 1`` and ``stride(-2) == D`` (any
    token stride, so a slice of a fused QKV tensor works); ``kv_cache`` one HND/NHD tensor or a
    ``(k, v)`` tuple; ``block_table`` int32 ``[B, max_pages]``; ``seq_lens`` int32 ``[B]`` (total
    KV length including the new tokens); k/v scales as floats or 1-element fp32 device tensors
    (read on the device, so they may change between CUDA-graph replays).

    Supported here: SM90, head_dim 64/128/256, page size 16/32/64/128, Hq / Hkv x q_len <= 64,
    a 16-bit cache of the query's dtype or an FP8 e4m3 cache. ``num_splits`` (split-KV count)
    defaults to a shape-based heuristic. Returns ``out`` (the query's dtype) and, with
    ``return_lse``, the base-2 LSE ``[B * q_len, Hq]`` fp32.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float16), ndim=3)
    T, Hq, D = q.shape
    k, v = _split_cache(kv_cache, kv_layout)
    P, Hkv, page, Dk = k.shape
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has {D}, kv_cache has {Dk}")
    if not q.is_cuda:
        return reference.paged_decode(q, kv_cache, block_table, seq_lens, kv_layout=kv_layout,
                                      q_len_per_req=q_len_per_req, sm_scale=sm_scale, k_scale=k_scale,
                                      v_scale=v_scale, return_lse=return_lse)
    device = q.device
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {D}")
    if page not in PAGE_SIZES:
        raise ValueError(f"page size must be one of {PAGE_SIZES}, got {page}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"num q heads ({Hq}) must be a multiple of num kv heads ({Hkv})")
    group = Hq // Hkv
    if not isinstance(q_len_per_req, int) or q_len_per_req < 1:
        raise ValueError(f"q_len_per_req must be a positive int, got {q_len_per_req!r}")
    if group * q_len_per_req > MAX_ROWS:
        raise ValueError(f"Hq/Hkv x q_len_per_req must be <= {MAX_ROWS}, got {group} x {q_len_per_req}")
    if q.stride(-2) != D and Hq > 1:
        raise ValueError(f"q must have contiguous heads (stride(-2) == head_dim {D}), got strides {q.stride()}")
    check_tensor("q", q, device=device, align_bytes=16)
    kv_dt = k.dtype
    if kv_dt not in (FP8, q.dtype):
        raise TypeError(f"kv_cache dtype must be float8_e4m3fn or the query's dtype {q.dtype}, got {kv_dt}")
    for name, t in (("k_cache", k), ("v_cache", v)):
        # TMA: 16-byte aligned base and strides
        check_tensor(name, t, device=device, align_bytes=16)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
    B = block_table.shape[0]
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(B,), device=device)
    if T != B * q_len_per_req:
        raise ValueError(f"q has {T} rows; expected batch {B} x q_len_per_req {q_len_per_req}")
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=(T, Hq, D), device=device)
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale}")
    ks, ks_t = _scale_arg("k_scale", k_scale, device)
    vs, vs_t = _scale_arg("v_scale", v_scale, device)

    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, block_table.shape[1] * page, device_sm_count(device.index or 0))
    elif not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    split = num_splits > 1

    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=device)
    with op_range("paged_decode", q=q, k_cache=k, block_table=block_table, splits=num_splits):
        if T == 0:
            lse = torch.empty((0, Hq), dtype=torch.float32, device=device)
            return (out, lse) if return_lse else out
        config = Sm90DecodeConfig(
            q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(kv_dt), head_dim=D, group=group,
            q_len=q_len_per_req, page_size=page, stages=choose_stages(k.element_size(), D),
            split=split, k_scale_tensor=ks_t, v_scale_tensor=vs_t,
        )
        fn = get_kernel(config, compile_target(device))
        part_o, part_lse, scratch_lse = _workspace_views(device, num_splits, T, Hq, D, split, return_lse)
        lse = torch.empty((T, Hq), dtype=torch.float32, device=device) if return_lse else scratch_lse
        kernel_out, kernel_lse = (part_o, part_lse) if split else (out, lse)
        fn(*call_arguments(config.signature(), {
            "q": q, "k_cache": k, "v_cache": v, "block_table": block_table, "seq_lens": seq_lens,
            "out": kernel_out, "lse": kernel_lse, "k_scale": ks, "v_scale": vs, "sm_scale": scale,
        }))
        if split:
            from .merge_states import merge_states

            merge_states(part_o, part_lse, out=out, out_lse=lse)
    return (out, lse) if return_lse else out


def _workspace_views(device, num_splits, T, Hq, D, split, return_lse):
    """Split partials ``[S, T, Hq, D]`` + ``[S, T, Hq]`` and, when the caller did not ask for the
    LSE, an fp32 ``[T, Hq]`` target for it: all carved from the per-device workspace."""
    part_numel = num_splits * T * Hq * D if split else 0
    plse_numel = num_splits * T * Hq if split else 0
    lse_numel = 0 if return_lse else T * Hq
    ws = _workspace.get(device, part_numel + plse_numel + lse_numel)
    part_o = ws[:part_numel].view(num_splits, T, Hq, D) if split else None
    part_lse = ws[part_numel:part_numel + plse_numel].view(num_splits, T, Hq) if split else None
    base = part_numel + plse_numel
    scratch = ws[base:base + lse_numel].view(T, Hq) if not return_lse else None
    return part_o, part_lse, scratch
