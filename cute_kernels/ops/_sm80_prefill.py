"""``sm80.prefill`` on CUDA tensors with the ``paged_prefill`` contract (varlen via
``query_start_loc``, chunked against cached prefixes, causal or not), on any arch from SM80: what
the attention layer runs for a prefill plan of ``sm80.prefill``, and what its GPU tests and
``cute-kernels bench sm80 prefill`` force on the H200.

The caller is trusted for shapes (the layer validates its inputs); the compiled function checks
dtypes, ranks, shared extents and alignment itself. The config comes from
:mod:`cute_kernels.plans.sm80`; the grid from ``max_query_len`` (no host sync, graph-capturable).
"""

from __future__ import annotations

import torch

from ..jit.compiler import get_kernel
from ..plans.sm80 import make_prefill_config
from ._torch import compile_target, dtype_name


def run_prefill(q, kv_cache, block_table, seq_lens, query_start_loc, *, max_query_len: int, kv_layout="HND",
                causal=True, sm_scale=None, k_scale=1.0, v_scale=1.0, out=None, return_lse=False, **override):
    """``out`` ``[T, Hq, D]`` (and the base-2 LSE ``[T, Hq]`` with ``return_lse``) of the
    requests' new tokens ``q[query_start_loc[b]:query_start_loc[b + 1]]``, the last tokens of
    their ``seq_lens[b]`` positions. ``override`` replaces tuning fields of the config
    (``widen="bits"``, ``smem_target="sm_86"``...)."""
    pair = isinstance(kv_cache, (tuple, list))
    k = kv_cache[0] if pair else kv_cache
    v = kv_cache[1] if pair else kv_cache
    T, Hq, D = q.shape
    k4 = k if pair else k[:, 0]
    Hkv, page = (k4.shape[1], k4.shape[2]) if kv_layout == "HND" else (k4.shape[2], k4.shape[1])
    target = compile_target(q.device)
    config = make_prefill_config(
        target=target, q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype), head_dim=D, group=Hq // Hkv,
        page_size=page, causal=causal, write_lse=return_lse, kv_form="pair" if pair else "single",
        kv_layout=kv_layout, k_scale_tensor=isinstance(k_scale, torch.Tensor),
        v_scale_tensor=isinstance(v_scale, torch.Tensor), **override)
    fn = get_kernel(config, target)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device) if return_lse else None
    if T:
        k_scale, v_scale = (x.view(1) if isinstance(x, torch.Tensor) and x.dim() != 1 else x for x in (k_scale, v_scale))
        values = dict(q=q, kv_cache=k, k_cache=k, v_cache=v, block_table=block_table, seq_lens=seq_lens,
                      query_start_loc=query_start_loc, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale,
                      sm_scale=D ** -0.5 if sm_scale is None else float(sm_scale), max_query_len=max_query_len)
        fn(*(values[name] for name in config.arg_names()))
    return (out, lse) if return_lse else out
