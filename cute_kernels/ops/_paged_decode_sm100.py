"""The SM100 / SM103 side of ``cute_kernels.paged_decode``: the tcgen05 kernel behind its runtime
self-check.

The kernel (``sm100.decode``) is compile-verified only, so the first launch of each MMA family
(``f16``: 16-bit cache; ``cvt``: FP8 cache, 16-bit query; ``f8``: FP8 query and cache) in a process
runs :mod:`._selfcheck` on a few small problems against the reference; a family that fails serves
the reference from then on (logged once, recorded for ``cute-kernels plan``). Split-KV launches
write fp32 partials and base-2 LSEs that ``merge_states`` combines (the sinks enter once, in split 0).

Host side only: no tensor data is read and nothing is synchronized after the self-check, so a call
captures in a CUDA graph once its family has been checked (``warmup`` or one eager call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import reference
from ..jit.compiler import get_kernel
from ..plans.args import INT32_MAX, check_window_left
from ..plans.sm100 import DECODE_LIMITS, Sm100DecodeConfig, decode_launch_config, family
from . import _caller_workspace as caller_ws
from ._device import on_device
from ._launch import bind, check_scale
from ._selfcheck import Case, decode_problem, ensure
from ._torch import (
    DeviceBuffer,
    check_paged_tensors,
    check_tensor,
    compile_target,
    device_sm_count,
    dtype_name,
    ffi_tensor,
    stream_id,
)
from .merge_states import merge_states

FP8 = torch.float8_e4m3fn
# (rtol, atol) of the self-check against the fp32 reference: one bf16 rounding of P and of the
# output (16-bit families); e4m3 P and query (the FP8 family)
SELF_CHECK_TOL = {"f16": (2e-2, 1e-2), "cvt": (2e-2, 1e-2), "f8": (8e-2, 4e-2)}

_workspace = DeviceBuffer("paged_decode (sm100)", torch.float32)
_PARAMS = ("q", "k", "v", "block_table", "seq_lens", "out", "lse", "k_scale", "v_scale", "q_scale", "sinks",
           "window_left")


@dataclass
class Sm100Decode:
    """One prepared launch: the bound kernel caller, the split workspace (merged after it)."""

    config: Sm100DecodeConfig
    fn: Any  # call(*_PARAMS)
    num_splits: int
    part_out: Any  # torch.Tensor when num_splits > 1
    part_lse: Any
    out_shape: tuple
    out_dtype: torch.dtype


def check_features(q, k, q_scale, sinks, window_left) -> None:
    """What the SM100 path adds to ``paged_decode``'s arguments: an FP8 query, sinks, a window."""
    check_window_left(window_left)
    if q.dtype == FP8:
        if k.dtype != FP8:
            raise TypeError("an FP8 query needs an FP8 (float8_e4m3fn) KV cache")
        if q_scale is None:
            raise ValueError("an FP8 query needs q_scale")
    elif q_scale is not None:
        raise ValueError("q_scale applies only to an FP8 query; a bf16/fp16 query is never rescaled")
    if sinks is not None:
        check_tensor("sinks", sinks, dtype=torch.float32, shape=(q.shape[1],), device=q.device)


def check_call(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, out) -> tuple[int, int, int, torch.dtype]:
    """The kernel's geometry and tensors (head dim, page size, GQA, dtypes, shapes, devices, 16-byte
    alignment, ``out``): ``(B, Hkv, page, out dtype)``. ``paged_decode`` runs it for every FP8 query
    whatever serves it (this kernel, the reference on other archs and for CPU tensors), so code that
    passes on one device passes on another."""
    T, Hq, D = q.shape
    k4 = k if pair else k[:, 0]
    Hkv, page = (k4.shape[1], k4.shape[2]) if kv_layout == "HND" else (k4.shape[2], k4.shape[1])
    if D not in DECODE_LIMITS["head_dims"]:
        raise ValueError(f"head_dim must be one of {DECODE_LIMITS['head_dims']}, got {D}")
    if page not in DECODE_LIMITS["page_sizes"]:
        raise ValueError(f"page size must be one of {DECODE_LIMITS['page_sizes']}, got {page}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"num q heads ({Hq}) must be a multiple of num kv heads ({Hkv})")
    B = check_paged_tensors(q, k, v, pair, block_table, seq_lens, q_len)
    out_dtype = torch.bfloat16 if q.dtype == FP8 else q.dtype
    if out is not None:
        check_tensor("out", out, dtype=out_dtype, shape=(T, Hq, D), device=q.device, output=True)
    return B, Hkv, page, out_dtype


def prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, q_scale, k_scale, v_scale, out,
            num_splits, sinks, workspace=None) -> Sm100Decode | None:
    """Validation of the rest and kernel selection for one key; None when the variant's MMA family
    failed its runtime self-check (the caller then serves the reference). ``workspace``: the
    caller's buffer for the split partials (else this module's own)."""
    launch = _prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, q_scale, k_scale, v_scale,
                      out, num_splits, sinks, workspace)
    return launch if self_check_passes(launch.config, q.device) else None


def _prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, q_scale, k_scale, v_scale, out,
             num_splits, sinks, workspace=None) -> Sm100Decode:
    T, Hq, D = q.shape
    device = q.device
    B, Hkv, page, out_dtype = check_call(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, out)
    ks_t = check_scale("k_scale", k_scale, device=device)
    vs_t = check_scale("v_scale", v_scale, device=device)
    qs_t = q_scale is not None and check_scale("q_scale", q_scale, device=device)
    num_splits, config = decode_launch_config(
        q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype), head_dim=D, group=Hq // Hkv, q_len=q_len,
        page_size=page, sinks=sinks is not None, kv_form="pair" if pair else "single", kv_layout=kv_layout,
        k_scale_tensor=ks_t, v_scale_tensor=vs_t, q_scale_tensor=bool(qs_t), batch=B, num_kv_heads=Hkv,
        max_context=block_table.shape[1] * page, num_sms=device_sm_count(device.index or 0), num_splits=num_splits)
    part_out = part_lse = None
    if num_splits > 1:
        n = num_splits * T * Hq
        if workspace is None:
            ws = _workspace.get(device, n * (D + 1), stream_id(q))  # per stream: docs/design/inputs.md#workspaces
        else:  # the caller's memory (the trtllm API's workspace_buffer)
            ws, _ = caller_ws.carve(workspace, device, n * (D + 1))
        part_out = ws[:n * D].view(num_splits, T, Hq, D)
        part_lse = ws[n * D:n * (D + 1)].view(num_splits, T, Hq)
    fn = get_kernel(config, compile_target(device))
    sources = {"kv_cache": "k", "k_cache": "k", "v_cache": "v"}
    for name, is_tensor in (("k_scale", ks_t), ("v_scale", vs_t), ("q_scale", qs_t)):
        if is_tensor:  # a 1-element tensor of any rank is viewed as [1]
            sources[name] = f"{name}.view(1)?"
    constants = dict(part_out=ffi_tensor(part_out), part_lse=ffi_tensor(part_lse),
                     sm_scale=D ** -0.5 if sm_scale is None else float(sm_scale))
    caller = on_device(bind(_PARAMS, (fn, config.signature(), sources, constants)), device)
    return Sm100Decode(config, caller, num_splits, part_out, part_lse, (T, Hq, D), out_dtype)


def run(launch: Sm100Decode, q, k, v, block_table, seq_lens, out, return_lse, k_scale, v_scale, q_scale, sinks,
        window_left):
    """One call of a prepared launch (the kernel, then the merge of its split partials)."""
    if type(window_left) is not int or not -1 <= window_left <= INT32_MAX:  # refused by every path, here too
        check_features(q, k, q_scale, sinks, window_left)
    if out is None:
        out = torch.empty(launch.out_shape, dtype=launch.out_dtype, device=q.device)
    lse = torch.empty(launch.out_shape[:2], dtype=torch.float32, device=q.device)
    if launch.out_shape[0]:
        launch.fn(q, k, v, block_table, seq_lens, out, lse, k_scale, v_scale, q_scale, sinks, window_left)
        if launch.num_splits > 1:
            merge_states(launch.part_out, launch.part_lse, out=out, out_lse=lse)
    return (out, lse) if return_lse else out


def launch_now(q, kv_cache, block_table, seq_lens, *, kv_layout="HND", q_len_per_req=1, sm_scale=None, q_scale=None,
               k_scale=1.0, v_scale=1.0, sinks=None, window_left=-1, num_splits=None, return_lse=False):
    """Prepare and launch the SM100 kernel now, past the launch cache and the self-check (the
    self-check's own kernel calls)."""
    pair = isinstance(kv_cache, (tuple, list))
    k, v = (kv_cache[0], kv_cache[1]) if pair else (kv_cache, kv_cache)
    launch = _prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, q_scale, k_scale,
                      v_scale, None, num_splits, sinks)
    return run(launch, q, k, v, block_table, seq_lens, None, return_lse, k_scale, v_scale, q_scale, sinks,
               window_left)


# ---------------------------------------------------------------------------------------------
# the runtime self-check of a variant's MMA family
# ---------------------------------------------------------------------------------------------


def self_check_passes(config: Sm100DecodeConfig, device) -> bool:
    """The one-time check of ``config``'s MMA family on ``device``: the variant's shape (head dim,
    group, draft length, page, cache form and layout, sinks) on small random problems, unsplit,
    split with a window, and split with lengths past the block table, against the reference."""
    fam = family("sm100.decode", config.q_dtype, config.kv_dtype)
    return ensure(fam, device, lambda: self_check_cases(config, device))


def self_check_cases(config: Sm100DecodeConfig, device, runner=None) -> list[Case]:
    """The cases of ``config``'s family (``runner``: the kernel call, :func:`launch_now` unless a
    test substitutes one)."""
    runner = runner or launch_now
    rtol, atol = SELF_CHECK_TOL[config.mode]
    g = torch.Generator(device="cpu").manual_seed(2027)
    q_len = config.q_len
    q, cpu_cache, bt, sl = decode_problem(config, g)
    q = q.to(device)
    cache = tuple(t.to(device) for t in cpu_cache) if isinstance(cpu_cache, tuple) else cpu_cache.to(device)
    sinks = torch.randn(q.shape[1], generator=g) if config.sinks else None
    qs = 0.5 if config.q_dtype == "fp8_e4m3" else None
    kw: dict[str, Any] = dict(kv_layout=config.kv_layout, q_len_per_req=q_len, k_scale=0.9, v_scale=1.1,
                              q_scale=qs, return_lse=True)
    dev_sinks = None if sinks is None else sinks.to(device)
    # lengths past the block table's capacity (50 past it, and 2^31 - 1): never attended there
    past = sl.clone()
    past[0], past[-1] = bt.shape[1] * config.page_size + 50, 2 ** 31 - 1
    cases = []
    for splits, window, lens in ((1, -1, sl), (3, 90, sl), (2, -1, past)):
        def run_case(splits=splits, window=window, lens=lens):
            return runner(q, cache, bt.to(device), lens.to(device), sinks=dev_sinks, window_left=window,
                          num_splits=splits, **kw)

        def expect(window=window, lens=lens):
            return reference.paged_decode(q.cpu(), cpu_cache, bt, lens, sinks=sinks, window_left=window, **kw)

        name = f"splits={splits},window={window}" + (",past the table" if lens is past else "")
        cases.append(Case(name, run_case, expect, rtol, atol))
    return cases
