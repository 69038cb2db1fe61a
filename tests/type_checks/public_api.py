"""The public API as a type checker sees it (``python -m mypy``; never imported by the tests).

Each call is written the way the docs show it; ``assert_type`` pins what the overloads return,
and a line marked ``# type: ignore[...]`` must stay an error (``warn_unused_ignores`` fails the
run when it no longer is).
"""

from __future__ import annotations

import torch
from typing_extensions import assert_type

import cute_kernels
from cute_kernels import reference
from dispatch import Arch, AttentionLayer, AttentionMetadata, Plan, QsaPlan, parse_arch, plan, plan_qsa

Tensor = torch.Tensor
Pair = tuple[torch.Tensor, torch.Tensor]


def decode(q: Tensor, kv: Tensor, k: Tensor, v: Tensor, bt: Tensor, sl: Tensor, flag: bool) -> None:
    assert_type(cute_kernels.paged_decode(q, kv, bt, sl), Tensor)
    assert_type(cute_kernels.paged_decode(q, (k, v), bt, sl, kv_layout="NHD", return_lse=False), Tensor)
    assert_type(cute_kernels.paged_decode(q, kv, bt, sl, return_lse=True), Pair)
    assert_type(cute_kernels.paged_decode(q, kv, bt, sl, return_lse=flag), Tensor | Pair)
    cute_kernels.paged_decode(q, kv, bt, sl, k_scale=0.5, v_scale=torch.ones(1), out=q, num_splits=4,
                              deterministic=False, sm_scale=None, q_len_per_req=2)
    cute_kernels.paged_decode(q, kv, bt, sl, k_scale="1.0")  # type: ignore[call-overload]
    # the reference (the contract, not a serving API) returns the union
    assert_type(reference.paged_decode(q, (k, v), bt, sl, q_scale=torch.ones(1), float64=True), Tensor | Pair)


def prefill(q: Tensor, kv: Tensor, k: Tensor, v: Tensor, bt: Tensor, sl: Tensor, qsl: Tensor, flag: bool) -> None:
    assert_type(cute_kernels.paged_prefill(q, kv, bt, sl, qsl), Tensor)
    assert_type(cute_kernels.paged_prefill(q, (k, v), bt, sl, qsl, max_query_len=64, return_lse=True), Pair)
    assert_type(cute_kernels.paged_prefill(q, kv, bt, sl, qsl, q_scale=torch.ones(8), return_lse=flag), Tensor | Pair)
    cute_kernels.paged_prefill(q, kv, bt, sl, qsl, max_query_len="64")  # type: ignore[call-overload]
    assert_type(reference.paged_prefill(q, kv, bt, sl, qsl, out_dtype=torch.bfloat16), Tensor | Pair)


def glue(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, cache_k: Tensor, slots: Tensor, cos_sin: Tensor,
         pos: Tensor, part_o: Tensor, part_lse: Tensor) -> None:
    assert_type(cute_kernels.quantize_query(q, 0.25), Tensor)
    assert_type(cute_kernels.quantize_query(q, torch.ones(1), rope=(cos_sin, pos), out=q), Tensor)
    cute_kernels.quantize_query(q, 0.25, rope=cos_sin)  # type: ignore[call-overload]
    assert_type(cute_kernels.quantize_query(q, 0.25, residual=True), Pair)
    assert_type(cute_kernels.write_kv_cache(k, v, kv, slots, k_scale=torch.ones(1), v_scale=2.0), None)
    cute_kernels.write_kv_cache(k, v, (cache_k, cache_k), slots, kv_layout="NHD")
    assert_type(cute_kernels.merge_states(part_o, part_lse, out_dtype=torch.bfloat16), Pair)
    assert_type(reference.merge_states(part_o, part_lse, float64=True), Pair)
    assert_type(reference.quantize_query(q, torch.ones(4), rope=(cos_sin, pos)), Tensor)
    reference.write_kv_cache(k, v, kv, slots, k_scale=0.5)


def qsa(q: Tensor, kc: Tensor, vc: Tensor, idx: Tensor, bt: Tensor, t2r: Tensor, gate: Tensor, flag: bool) -> None:
    assert_type(cute_kernels.qsa_sparse_attention(q, kc, vc, idx, bt, t2r, prefill=True, output_gate=gate), Tensor)
    assert_type(reference.qsa_sparse_attention(q, kc, vc, idx, bt, t2r, return_lse=flag), Tensor | Pair)
    cute_kernels.qsa_sparse_attention(q, kc, vc, idx, bt, t2r)  # type: ignore[call-arg]


def planning() -> None:
    assert_type(parse_arch("9.0"), Arch)
    parse_arch((9, 0))
    parse_arch(90)
    parse_arch(Arch(9, 0))
    parse_arch(9.0)  # type: ignore[arg-type]
    p = plan(arch="sm90", phase="decode", kv_cache_dtype=torch.float8_e4m3fn, model_dtype="bf16", head_dim=128,
             num_q_heads=32, num_kv_heads=8, page_size=16)
    assert_type(p, Plan)
    assert_type(p.torch_q_dtype(), torch.dtype)
    assert_type(plan_qsa("sm_90a", "fp8", 256, 24, 2), QsaPlan)
    cute_kernels.warmup(head_dim=128, num_q_heads=32, num_kv_heads=8, page_size=16, kv_dtypes=("fp8",))
    cute_kernels.qsa_warmup(arch=(9, 0), head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568)


def layer(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, meta: AttentionMetadata) -> None:
    attn = AttentionLayer(32, 8, 128, kv_cache_dtype="fp8", page_size=16, q_scale=torch.ones(8), k_scale=0.5,
                          arch="9.0")
    assert_type(attn.forward(q, k, v, kv, meta), Tensor)
    assert_type(attn.plan("decode", arch=(9, 0)), Plan)
