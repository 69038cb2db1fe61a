"""The SM100 / SM103 side of ``cute_kernels.paged_decode``: the tcgen05 kernel behind its runtime
self-check.

The kernel (``sm100.decode``) is compile-verified only, so the first launch of each MMA family
(``f16`` 16-bit cache, ``cvt`` FP8 cache with a 16-bit query, ``f8`` FP8 query and cache) in a
process runs :mod:`._selfcheck` on a few small problems against the reference; a family that
fails serves the reference from then on (logged once). Split-KV launches write fp32 partials and
base-2 LSEs that ``merge_states`` combines (the sinks are added once, by split 0).

Host side only: no tensor data is read, nothing is synchronized after the self-check, so a call
captures in a CUDA graph once its family has been checked (``warmup`` or one eager call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import reference
from ..jit.compiler import get_kernel
from ..plans.sm100 import DECODE_LIMITS, Sm100DecodeConfig, family
from ._selfcheck import Case, ensure
from ._torch import DeviceBuffer, check_tensor, compile_target, device_sm_count, dtype_name
from .merge_states import merge_states

FP8 = torch.float8_e4m3fn
MAX_SPLITS = 64
SELF_CHECK_TOL = {"f16": (2e-2, 1e-2), "cvt": (2e-2, 1e-2), "f8": (6e-2, 3e-2)}  # (rtol, atol)

_workspace = DeviceBuffer("paged_decode (sm100)", torch.float32)


def split_count(items: int, max_context: int, num_sms: int) -> int:
    """Splits per (request, KV head, row tile): one wave of one CTA per SM (the kernel holds
    ~200 KB of shared memory), never more splits than 128-token tiles."""
    if items >= num_sms:
        return 1
    return max(1, min(MAX_SPLITS, math.ceil(max_context / 128), num_sms // max(items, 1)))


@dataclass
class Sm100Decode:
    """One prepared launch: the compiled kernel, its argument order, the split workspace."""

    config: Sm100DecodeConfig
    fn: object
    order: tuple
    num_splits: int
    part_out: torch.Tensor | None
    part_lse: torch.Tensor | None
    sm_scale: float

    def __call__(self, q, k, v, block_table, seq_lens, out, lse, k_scale, v_scale, q_scale, sinks, window_left):
        values = dict(q=q, kv_cache=k, k_cache=k, v_cache=v, block_table=block_table, seq_lens=seq_lens,
                      out=out, lse=lse, part_out=self.part_out, part_lse=self.part_lse, k_scale=k_scale,
                      v_scale=v_scale, q_scale=q_scale, sinks=sinks, sm_scale=self.sm_scale,
                      window_left=window_left)
        self.fn(*[values[name] for name in self.order])
        if self.num_splits > 1:
            merge_states(self.part_out, self.part_lse, out=out, out_lse=lse)


def check_args(q, k, pair, kv_layout, q_scale, sinks, window_left):
    """Validation of what the SM100 path adds to ``paged_decode`` (the FP8 query, sinks, window)."""
    if not isinstance(window_left, int) or isinstance(window_left, bool) or window_left < -1:
        raise ValueError(f"window_left must be an int >= -1 (-1: no window), got {window_left!r}")
    if q.dtype == FP8:
        if k.dtype != FP8:
            raise TypeError("an FP8 query needs an FP8 (float8_e4m3fn) KV cache")
        if q_scale is None:
            raise ValueError("an FP8 query needs q_scale")
    elif q_scale is not None:
        raise ValueError("q_scale applies only to an FP8 query; a bf16/fp16 query is never rescaled")
    if sinks is not None:
        check_tensor("sinks", sinks, dtype=torch.float32, shape=(q.shape[1],), device=q.device)


def prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len, sm_scale, q_scale, k_scale, v_scale, out,
            return_lse, num_splits, sinks) -> Sm100Decode:
    """Kernel selection for one key (shapes, dtypes, strides, options); arguments validated by
    the caller (``paged_decode._prepare``)."""
    T, Hq, D = q.shape
    k4 = k if pair else k[:, 0]
    Hkv, page = (k4.shape[1], k4.shape[2]) if kv_layout == "HND" else (k4.shape[2], k4.shape[1])
    if D not in DECODE_LIMITS["head_dims"]:
        raise ValueError(f"head_dim must be one of {DECODE_LIMITS['head_dims']}, got {D}")
    if page not in DECODE_LIMITS["page_sizes"]:
        raise ValueError(f"page size must be one of {DECODE_LIMITS['page_sizes']}, got {page}")
    B = block_table.shape[0]
    config = Sm100DecodeConfig(
        q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype), head_dim=D, group=Hq // Hkv, q_len=q_len,
        page_size=page, split=False, sinks=sinks is not None, kv_form="pair" if pair else "single",
        kv_layout=kv_layout, k_scale_tensor=isinstance(k_scale, torch.Tensor),
        v_scale_tensor=isinstance(v_scale, torch.Tensor), q_scale_tensor=isinstance(q_scale, torch.Tensor))
    if num_splits is None:
        num_splits = split_count(B * Hkv * config.row_tiles, block_table.shape[1] * page,
                                 device_sm_count(q.device.index or 0))
    part_out = part_lse = None
    if num_splits > 1:
        config = Sm100DecodeConfig(**{**config.__dict__, "split": True})
        ws = _workspace.get(q.device, num_splits * T * Hq * (D + 1))
        part_out = ws[:num_splits * T * Hq * D].view(num_splits, T, Hq, D)
        part_lse = ws[num_splits * T * Hq * D:num_splits * T * Hq * (D + 1)].view(num_splits, T, Hq)
    fn = get_kernel(config, compile_target(q.device))
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    return Sm100Decode(config, fn, tuple(a.name for a in config.signature()), num_splits,
                       part_out, part_lse, scale)


def launch(q, kv_cache, block_table, seq_lens, *, kv_layout="HND", q_len_per_req=1, sm_scale=None, q_scale=None,
           k_scale=1.0, v_scale=1.0, sinks=None, window_left=-1, num_splits=None, return_lse=False, out=None):
    """Prepare and launch the SM100 kernel now, without the launch cache or the self-check (the
    self-check's own kernel calls)."""
    pair = isinstance(kv_cache, (tuple, list))
    k = kv_cache[0] if pair else kv_cache
    v = kv_cache[1] if pair else kv_cache
    T, Hq, D = q.shape
    prepared = prepare(q, k, v, pair, block_table, seq_lens, kv_layout, q_len_per_req, sm_scale, q_scale, k_scale,
                       v_scale, out, return_lse, num_splits, sinks)
    out = torch.empty((T, Hq, D), dtype=torch.bfloat16 if q.dtype == FP8 else q.dtype, device=q.device) \
        if out is None else out
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    prepared(q, k, v, block_table, seq_lens, out, lse, k_scale, v_scale, q_scale, sinks, window_left)
    return (out, lse) if return_lse else out


def self_check_passes(config: Sm100DecodeConfig, device) -> bool:
    """The one-time runtime check of ``config``'s MMA family on ``device``: the variant itself
    (same compile key, so no extra compile) and its split form on small random problems with a
    window and, when the variant has them, sinks, against the reference."""
    fam = family("sm100.decode", config.q_dtype, config.kv_dtype)
    return ensure(fam, device, lambda: _cases(config, device))


def _cases(config: Sm100DecodeConfig, device) -> list[Case]:
    rtol, atol = SELF_CHECK_TOL[config.mode]
    g = torch.Generator(device="cpu").manual_seed(2027)
    D, page, G, q_len = config.head_dim, config.page_size, config.group, config.q_len
    Hkv = 2
    lens = [3 * page + 5, 1, 700]
    B = len(lens)
    max_pages = max(math.ceil(x / page) for x in lens)
    P = B * max_pages + 2
    perm = torch.randperm(P, generator=g)[: B * max_pages].view(B, max_pages).to(torch.int32)
    kv_dt = torch.float8_e4m3fn if config.kv_dtype == "fp8_e4m3" else q_torch(config.kv_dtype)
    shape = (P, 2, Hkv, page, D) if config.kv_layout == "HND" else (P, 2, page, Hkv, D)
    kv = torch.randn(shape, generator=g).to(kv_dt).to(device)
    cache = (kv[:, 0], kv[:, 1]) if config.kv_form == "pair" else kv
    q = torch.randn(B * q_len, G * Hkv, D, generator=g).to(device)
    q = q.to(FP8) if config.q_dtype == "fp8_e4m3" else q.to(q_torch(config.q_dtype))
    bt, sl = perm.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    sinks = torch.randn(G * Hkv, generator=g).to(device) if config.sinks else None
    qs = 0.5 if config.q_dtype == "fp8_e4m3" else None
    kw = dict(kv_layout=config.kv_layout, q_len_per_req=q_len, k_scale=0.9, v_scale=1.1, q_scale=qs,
              sinks=sinks, return_lse=True)
    cases = []
    for splits, window in ((1, -1), (3, 90)):
        def run(splits=splits, window=window):
            return launch(q, cache, bt, sl, window_left=window, num_splits=splits, **kw)

        def expect(window=window):
            return reference.paged_decode(q.cpu(), _cpu(cache), bt.cpu(), sl.cpu(), window_left=window,
                                          **{**kw, "sinks": None if sinks is None else sinks.cpu()})

        cases.append(Case(f"splits={splits},window={window}", run, expect, rtol, atol))
    return cases


def _cpu(cache):
    return tuple(t.cpu() for t in cache) if isinstance(cache, tuple) else cache.cpu()


def q_torch(name: str):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]

