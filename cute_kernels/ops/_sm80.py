"""Launch preparation of the SM80-class kernels for the attention ops (torch side).

The ops call :func:`use_sm80` to choose between an arch's own kernel and the portable one, and
:func:`prepare_decode` to build the launch: the compiled split or unsplit kernel, the split-KV
workspace views, and the LSE merge (``common.merge_states``) that follows a split launch.
"""

from __future__ import annotations

from ..common.merge import MergeStatesConfig
from ..jit.compiler import get_kernel
from ..plans.sm80 import PDL_TARGETS, decode_splits, make_decode_config, make_prefill_config
from ._torch import DeviceBuffer, dtype_name, ffi_tensor

SM90_TARGET = "sm_90a"

_workspace = None


def use_sm80(target: str, q_dtype: str, kv_dtype: str, forced: bool) -> bool:
    """Whether a decode runs the SM80-class kernel: on every arch without its own decode kernel,
    when forced (``tuning_override(backend="sm80")``), and on SM90 for what ``sm90.decode``
    refuses (an fp16 cache with a bf16 query)."""
    if forced or target != SM90_TARGET:
        return True
    return kv_dtype != "fp8_e4m3" and kv_dtype != q_dtype


def _buffer():
    global _workspace
    if _workspace is None:
        import torch

        _workspace = DeviceBuffer("paged_decode (sm80)", torch.float32)
    return _workspace


def prepare_decode(*, q, k, v, pair, block_table, kv_layout, q_len, group, page, sm_scale, ks_tensor, vs_tensor,
                   return_lse, num_splits, target, num_sms, override):
    """``(caller, scratch_lse)``: ``caller(q, k, v, block_table, seq_lens, out, lse, k_scale,
    v_scale)`` launches the decode (and the merge of a split launch); ``scratch_lse`` is the LSE
    target when the caller did not ask for one."""
    T, Hq, D = q.shape
    B = block_table.shape[0]
    Hkv = Hq // group
    common = dict(target=target, q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype), head_dim=D, group=group,
                  q_len=q_len, page_size=page, kv_form="pair" if pair else "single", kv_layout=kv_layout,
                  k_scale_tensor=ks_tensor, v_scale_tensor=vs_tensor, **override)
    probe = make_decode_config(split=False, **common)
    splits = decode_splits(B * Hkv, block_table.shape[1] * page, num_sms, probe.tile, num_splits=num_splits)
    lse_numel = T * Hq
    if splits <= 1:
        fn = get_kernel(probe, target)
        ws = _buffer().get(q.device, 0 if return_lse else lse_numel)
        scratch = None if return_lse else ffi_tensor(ws[:lse_numel].view(T, Hq))

        def caller(q, k, v, block_table, seq_lens, out, lse, k_scale, v_scale):
            if pair:
                fn(q, k, v, block_table, seq_lens, out, lse, k_scale, v_scale, sm_scale)
            else:
                fn(q, k, block_table, seq_lens, out, lse, k_scale, v_scale, sm_scale)

        return caller, scratch

    config = make_decode_config(split=True, **common)
    fn = get_kernel(config, target)
    merge = get_kernel(MergeStatesConfig(out_dtype=dtype_name(q.dtype), head_dim=D, vec=4,
                                         pdl=target in PDL_TARGETS), target)
    part_numel = splits * T * Hq * D
    ws = _buffer().get(q.device, part_numel + splits * lse_numel + (0 if return_lse else lse_numel))
    part_o = ffi_tensor(ws[:part_numel].view(splits, T, Hq, D))
    part_lse = ffi_tensor(ws[part_numel:part_numel + splits * lse_numel].view(splits, T, Hq))
    base = part_numel + splits * lse_numel
    scratch = None if return_lse else ffi_tensor(ws[base:base + lse_numel].view(T, Hq))

    def split_caller(q, k, v, block_table, seq_lens, out, lse, k_scale, v_scale):
        if pair:
            fn(q, k, v, block_table, seq_lens, part_o, part_lse, k_scale, v_scale, sm_scale)
        else:
            fn(q, k, block_table, seq_lens, part_o, part_lse, k_scale, v_scale, sm_scale)
        merge(part_o, part_lse, out, lse)

    return split_caller, scratch


def use_sm80_prefill(target: str, forced: bool) -> bool:
    """Whether a prefill runs ``sm80.prefill``: on every arch but SM90 (whose own prefill kernel
    serves it), and when forced."""
    return forced or target != SM90_TARGET


def prepare_prefill(*, q, k, pair, page, group, kv_layout, causal, write_lse, sm_scale, ks_tensor, vs_tensor,
                    target, override):
    """``caller(q, k, v, block_table, seq_lens, query_start_loc, out, lse, k_scale, v_scale,
    max_query_len)`` launching ``sm80.prefill`` (``lse`` is ignored unless ``write_lse``)."""
    config = make_prefill_config(target=target, q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype),
                                 head_dim=q.shape[2], group=group, page_size=page, causal=causal,
                                 write_lse=write_lse, kv_form="pair" if pair else "single", kv_layout=kv_layout,
                                 k_scale_tensor=ks_tensor, v_scale_tensor=vs_tensor, **override)
    fn = get_kernel(config, target)

    def caller(q, k, v, block_table, seq_lens, query_start_loc, out, lse, k_scale, v_scale, max_query_len):
        caches = (k, v) if pair else (k,)
        lses = (lse,) if write_lse else ()
        fn(q, *caches, block_table, seq_lens, query_start_loc, out, *lses, k_scale, v_scale, sm_scale, max_query_len)

    return caller


def run_prefill(q, kv_cache, block_table, seq_lens, query_start_loc, *, max_query_len: int, kv_layout="HND",
                causal=True, sm_scale=None, k_scale=1.0, v_scale=1.0, out=None, return_lse=False, **override):
    """``sm80.prefill`` on CUDA tensors with the ``paged_prefill`` contract, without the op's
    validation and launch cache (the op in ``ops.paged_prefill`` adds those); for tests and
    benchmarks that force the portable kernel on any arch."""
    import torch

    from ._torch import compile_target

    pair = isinstance(kv_cache, (tuple, list))
    k = kv_cache[0] if pair else kv_cache
    v = kv_cache[1] if pair else kv_cache
    T, Hq, D = q.shape
    k4 = k if pair else k[:, 0]
    Hkv, page = (k4.shape[1], k4.shape[2]) if kv_layout == "HND" else (k4.shape[2], k4.shape[1])
    caller = prepare_prefill(q=q, k=k, pair=pair, page=page, group=Hq // Hkv, kv_layout=kv_layout, causal=causal,
                             write_lse=return_lse, sm_scale=D ** -0.5 if sm_scale is None else float(sm_scale),
                             ks_tensor=isinstance(k_scale, torch.Tensor), vs_tensor=isinstance(v_scale, torch.Tensor),
                             target=compile_target(q.device), override=override)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device) if return_lse else None
    if T:
        caller(q, k, v, block_table, seq_lens, query_start_loc, out, lse, k_scale, v_scale, max_query_len)
    return (out, lse) if return_lse else out
