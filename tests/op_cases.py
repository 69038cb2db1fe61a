"""One small call of every public op (and of the trtllm API), built on the CPU from a seed and moved to any device, for
the device tests (tests/cpu/test_devices.py on the CPU and the meta device,
tests/gpu/test_multi_gpu.py on two GPUs). Each case lists its tensor arguments by the name the
op's errors use, so a test can put one of them on another device and expect that name in the
error. Views keep their layout on the target device (a view of a buffer moves with its buffer:
QSA's K and V halves stay one allocation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import cute_kernels
from cute_kernels import trtllm
from cute_kernels.testing import make_paged_decode_case, make_paged_prefill_case
from tests.cpu.test_qsa_reference import make_qsa_case

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@dataclass
class OpCase:
    """``fn(**kwargs)``; ``args``: argument name (as the op's errors name it) -> (keyword, index
    in a tuple keyword or None); ``outputs(result, kwargs)``: the tensors to compare."""

    name: str
    fn: Callable
    kwargs: dict
    args: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    outputs: Callable = None
    exact: bool = True  # deterministic: the same bits on every device (a reference path may differ in the last bits)

    def run(self, kwargs=None):
        kwargs = self.kwargs if kwargs is None else kwargs
        result = self.fn(**kwargs)
        return self.outputs(result, kwargs)

    def tensor(self, name: str):
        key, index = self.args[name]
        value = self.kwargs[key]
        return value if index is None else value[index]

    def with_arg(self, name: str, value) -> dict:
        """The keyword arguments with argument ``name`` replaced by ``value``."""
        key, index = self.args[name]
        kwargs = dict(self.kwargs)
        if index is None:
            kwargs[key] = value
        else:
            parts = list(kwargs[key])
            parts[index] = value
            kwargs[key] = type(kwargs[key])(parts)
        return kwargs


def move(value, device, memo=None):
    """``value`` (a tensor, a tuple of them, anything else as is) on ``device``; a view moves with
    its base buffer and keeps its strides and offset (views of one buffer stay one buffer)."""
    memo = {} if memo is None else memo
    if isinstance(value, (tuple, list)):
        return type(value)(move(v, device, memo) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    base = value._base if value._base is not None else value
    if id(base) not in memo:
        memo[id(base)] = base.to(device)
    moved = memo[id(base)]
    if base is value:
        return moved
    return moved.as_strided(value.shape, value.stride(), value.storage_offset())


def step_on(step, device):
    """A layer step of tests/cpu/test_layer_dispatch.py (built on the CPU) on ``device``: its
    tensors and its metadata's, views of the fused QKV buffer still views of one buffer."""
    memo: dict = {}
    md = dataclasses.replace(step.metadata, **{f.name: move(getattr(step.metadata, f.name), device, memo)
                                               for f in dataclasses.fields(step.metadata)})
    return dataclasses.replace(step, q=move(step.q, device, memo), k=move(step.k, device, memo),
                               v=move(step.v, device, memo), kv_cache=move(step.kv_cache, device, memo), metadata=md)


def moved(case: OpCase, device) -> OpCase:
    memo: dict = {}
    return OpCase(case.name, case.fn, {k: move(v, device, memo) for k, v in case.kwargs.items()}, case.args,
                  case.outputs, case.exact)


def _first(result, kwargs):
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _nan_like(t, dtype=None):
    return torch.full(t.shape, float("nan"), dtype=dtype or t.dtype)


def _decode(seed: int, *, pair: bool, kv_dtype, splits: int | None) -> OpCase:
    g = torch.Generator().manual_seed(seed)
    c = make_paged_decode_case(batch=3, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                               seq_lens=[700, 33, 170], kv_dtype=kv_dtype, container="tuple" if pair else "single",
                               generator=g, device="cpu")
    kw = dict(q=c.q, kv_cache=c.kv_cache, block_table=c.block_table, seq_lens=c.seq_lens, kv_layout=c.kv_layout,
              q_len_per_req=c.q_len, k_scale=torch.tensor([c.k_scale]), v_scale=torch.tensor(c.v_scale),
              out=_nan_like(c.q), return_lse=True, num_splits=splits)
    args = dict(block_table=("block_table", None), seq_lens=("seq_lens", None), out=("out", None),
                k_scale=("k_scale", None), v_scale=("v_scale", None))
    args.update({"k_cache": ("kv_cache", 0), "v_cache": ("kv_cache", 1)} if pair else {"kv_cache": ("kv_cache", None)})
    return OpCase(f"paged_decode/{'pair' if pair else 'single'}/{str(kv_dtype).removeprefix('torch.')}"
                  f"/splits={splits}", cute_kernels.paged_decode, kw, args, _first)


def _decode_fp8_query(seed: int) -> OpCase:
    """An FP8 query with a window: the tcgen05 kernel on SM100 / SM103, the reference on SM90 (the
    validation covers every argument on both paths)."""
    case = _decode(seed, pair=False, kv_dtype=FP8, splits=None)
    kw = dict(case.kwargs, q=case.kwargs["q"].to(FP8), q_scale=torch.tensor([0.5]), window_left=100)
    kw["out"] = kw["out"].to(BF16)
    args = dict(case.args, q_scale=("q_scale", None))
    return OpCase("paged_decode/fp8-query/window", case.fn, kw, args, _first, exact=False)


def _prefill(seed: int, *, pair: bool) -> OpCase:
    g = torch.Generator().manual_seed(seed)
    c = make_paged_prefill_case(reqs=[(0, 70), (40, 9), (300, 1)], num_q_heads=8, num_kv_heads=2, head_dim=128,
                                page_size=16, kv_dtype=FP8, container="tuple" if pair else "single", generator=g,
                                device="cpu")
    kw = dict(q=c.q, kv_cache=c.kv_cache, block_table=c.block_table, seq_lens=c.seq_lens,
              query_start_loc=c.query_start_loc, max_query_len=70, kv_layout=c.kv_layout,
              k_scale=torch.tensor([0.5]), v_scale=torch.tensor(0.25), out=_nan_like(c.q), return_lse=True)
    args = dict(block_table=("block_table", None), seq_lens=("seq_lens", None),
                query_start_loc=("query_start_loc", None), out=("out", None), k_scale=("k_scale", None),
                v_scale=("v_scale", None))
    args.update({"k_cache": ("kv_cache", 0), "v_cache": ("kv_cache", 1)} if pair else {"kv_cache": ("kv_cache", None)})
    return OpCase(f"paged_prefill/{'pair' if pair else 'single'}", cute_kernels.paged_prefill, kw, args, _first)


def _merge(seed: int) -> OpCase:
    g = torch.Generator().manual_seed(seed)
    S, N, H, D = 5, 7, 4, 128
    po = torch.randn(S, N, H, D, generator=g)
    pl = torch.randn(S, N, H, generator=g) * 6
    pl[1, 2] = -float("inf")  # an empty split
    kw = dict(partial_out=po, partial_lse=pl, out=torch.full((N, H, D), float("nan"), dtype=BF16),
              out_lse=torch.full((N, H), float("nan")))
    args = dict(partial_lse=("partial_lse", None), out=("out", None), out_lse=("out_lse", None))
    return OpCase("merge_states", cute_kernels.merge_states, kw, args, _first)


def _quantize(seed: int) -> OpCase:
    g = torch.Generator().manual_seed(seed)
    T, Hq, D, rot, max_pos = 9, 8, 128, 64, 100
    q = (torch.randn(T, Hq, D, generator=g) * 4).to(BF16)
    cos_sin = torch.randn(max_pos, rot, generator=g)
    pos = torch.randint(0, max_pos, (T,), generator=g, dtype=torch.int64)
    kw = dict(q=q, q_scale=torch.tensor([0.03]), out=torch.empty(T, Hq, D, dtype=FP8), rope=(cos_sin, pos))
    args = dict(q_scale=("q_scale", None), out=("out", None), cos_sin_cache=("rope", 0), positions=("rope", 1))
    return OpCase("quantize_query", cute_kernels.quantize_query, kw, args,
                  lambda r, kw: (r.view(torch.uint8),))  # FP8 codes compared as bytes (NaN codes too)


def _write(seed: int, *, pair: bool) -> OpCase:
    g = torch.Generator().manual_seed(seed)
    P, Hkv, page, D, T = 6, 2, 16, 128, 11
    cache = torch.randn(P, 2, Hkv, page, D, generator=g).to(FP8)
    kv_cache = (cache[:, 0].clone(), cache[:, 1].clone()) if pair else cache
    slots = torch.randperm(P * page, generator=g)[:T].to(torch.int64)
    slots[3] = -1  # padding: skipped
    kw = dict(key=torch.randn(T, Hkv, D, generator=g).to(BF16), value=torch.randn(T, Hkv, D, generator=g).to(BF16),
              kv_cache=kv_cache, slot_mapping=slots, kv_layout="HND", k_scale=torch.tensor([0.05]),
              v_scale=torch.tensor(0.07))
    args = dict(value=("value", None), slot_mapping=("slot_mapping", None), k_scale=("k_scale", None),
                v_scale=("v_scale", None))
    args.update({"k_cache": ("kv_cache", 0), "v_cache": ("kv_cache", 1)} if pair else {"kv_cache": ("kv_cache", None)})

    def outputs(_, kw):
        caches = kw["kv_cache"] if isinstance(kw["kv_cache"], tuple) else (kw["kv_cache"],)
        return tuple(c.view(torch.uint8) for c in caches)

    return OpCase(f"write_kv_cache/{'pair' if pair else 'single'}", cute_kernels.write_kv_cache, kw, args, outputs)


def _qsa(seed: int, *, prefill: bool) -> OpCase:
    g = torch.Generator().manual_seed(seed)
    rows = 70 if prefill else 4
    c = make_qsa_case(rows=rows, num_q_heads=8, num_kv_heads=2, head_dim=128, page=64, ctx=900, num_reqs=2,
                      block_budget=6, kv_dtype=FP8, gate=True, generator=g, device="cpu")
    kw = {k: v for k, v in c.items() if k != "meta"}
    kw.update(prefill=prefill, k_scale=torch.tensor([0.02]), v_scale=torch.tensor(0.03), out=_nan_like(kw["q"]))
    args = {name: (name, None) for name in ("k_cache", "v_cache", "packed_indices", "block_table", "token_to_req",
                                            "out", "output_gate", "k_scale", "v_scale")}
    return OpCase(f"qsa_sparse_attention/{'prefill' if prefill else 'decode'}", cute_kernels.qsa_sparse_attention,
                  kw, args, _first)


def _trtllm_decode(seed: int) -> OpCase:
    """FlashInfer's decode call (the caller's workspace buffer, a window and sinks) on paged_decode."""
    g = torch.Generator().manual_seed(seed)
    c = make_paged_decode_case(batch=3, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                               seq_lens=[700, 33, 170], kv_dtype=FP8, generator=g, device="cpu")
    kw = dict(query=c.q, kv_cache=c.kv_cache, workspace_buffer=torch.zeros(1 << 20, dtype=torch.uint8),
              block_tables=c.block_table, seq_lens=c.seq_lens, max_seq_len=700, bmm1_scale=torch.tensor([0.01]),
              bmm2_scale=torch.tensor(0.03), window_left=200, out=_nan_like(c.q), sinks=torch.randn(8, generator=g),
              kv_layout=c.kv_layout, return_lse=True)
    args = {name: (name, None) for name in ("kv_cache", "workspace_buffer", "block_tables", "seq_lens", "bmm1_scale",
                                            "bmm2_scale", "out", "sinks")}
    return OpCase("trtllm.batch_decode_with_kv_cache", trtllm.batch_decode_with_kv_cache, kw, args, _first)


def _trtllm_context(seed: int) -> OpCase:
    """FlashInfer's context call on paged_prefill."""
    g = torch.Generator().manual_seed(seed)
    c = make_paged_prefill_case(reqs=[(0, 70), (40, 9), (300, 1)], num_q_heads=8, num_kv_heads=2, head_dim=128,
                                page_size=16, kv_dtype=BF16, generator=g, device="cpu")
    kw = dict(query=c.q, kv_cache=c.kv_cache, workspace_buffer=torch.zeros(1 << 16, dtype=torch.uint8),
              block_tables=c.block_table, seq_lens=c.seq_lens, max_q_len=70, max_kv_len=301,
              bmm1_scale=0.08, bmm2_scale=torch.tensor([1.0]), batch_size=3, cum_seq_lens_q=c.query_start_loc,
              cum_seq_lens_kv=torch.cat([torch.zeros(1, dtype=torch.int32), c.seq_lens.cumsum(0).int()]),
              out=_nan_like(c.q), kv_layout=c.kv_layout, return_lse=True)
    args = {name: (name, None) for name in ("kv_cache", "workspace_buffer", "block_tables", "seq_lens", "bmm2_scale",
                                            "cum_seq_lens_q", "cum_seq_lens_kv", "out")}
    return OpCase("trtllm.batch_context_with_kv_cache", trtllm.batch_context_with_kv_cache, kw, args, _first)


def op_cases(seed: int = 0) -> list[OpCase]:
    """Every public op once, in its common forms (CPU tensors)."""
    return [
        _decode(seed, pair=False, kv_dtype=FP8, splits=None),
        _decode(seed + 1, pair=True, kv_dtype=BF16, splits=3),
        _decode(seed + 13, pair=False, kv_dtype=torch.float16, splits=3),  # bf16 query: sm80.decode on SM90
        _decode_fp8_query(seed + 10),
        _prefill(seed + 2, pair=False),
        _prefill(seed + 3, pair=True),
        _merge(seed + 4),
        _quantize(seed + 5),
        _write(seed + 6, pair=False),
        _write(seed + 7, pair=True),
        _qsa(seed + 8, prefill=False),
        _qsa(seed + 9, prefill=True),
        _trtllm_decode(seed + 11),
        _trtllm_context(seed + 12),
    ]
