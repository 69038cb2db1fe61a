"""``cute_kernels.merge_states``: LSE merge of split partials (CuTe-DSL kernel on CUDA)."""

from __future__ import annotations

import torch

from .. import reference
from .._nvtx import op_range
from ..jit.compiler import get_kernel
from ..jit.spec import call_arguments
from ..plans.merge_states import MergeStatesConfig
from ._torch import check_tensor, compile_target, dtype_name, widest_vector

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def merge_states(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S split partial states into one.

    Args:
        partial_out: fp32 ``[S, N, H, D]``, last dim contiguous, other strides free.
        partial_lse: fp32 ``[S, N, H]``, base-2 log-sum-exp of each split's scaled logits,
            last dim contiguous. A split with lse ``-inf`` is empty and contributes nothing
            (its partial output is not read).
        out_dtype: dtype of the merged output (fp32 default, bf16 or fp16); ignored if ``out``.
        out: optional ``[N, H, D]`` output tensor (written in place).
        out_lse: optional fp32 ``[N, H]`` for the merged base-2 LSE.

    Returns:
        ``(out, lse)``: ``out = sum_s 2^(lse_s - lse) * partial_out[s]`` and
        ``lse = log2(sum_s 2^lse_s)``; a row with every split empty gets 0 and ``-inf``.
        CPU tensors run the torch reference.
    """
    check_tensor("partial_out", partial_out, dtype=torch.float32, ndim=4)
    S, N, H, D = partial_out.shape
    check_tensor("partial_lse", partial_lse, dtype=torch.float32, shape=(S, N, H), device=partial_out.device)
    if out is not None:
        check_tensor("out", out, dtype=_OUT_DTYPES, shape=(N, H, D), device=partial_out.device)
    else:
        dt = out_dtype or torch.float32
        if dt not in _OUT_DTYPES:
            raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {dt}")
        out = torch.empty((N, H, D), dtype=dt, device=partial_out.device)
    if out_lse is not None:
        check_tensor("out_lse", out_lse, dtype=torch.float32, shape=(N, H), device=partial_out.device)
    else:
        out_lse = torch.empty((N, H), dtype=torch.float32, device=partial_out.device)

    with op_range("merge_states", partial_out=partial_out, out=out):
        if not partial_out.is_cuda:
            ref_out, ref_lse = reference.merge_states(partial_out, partial_lse)
            out.copy_(ref_out)
            out_lse.copy_(ref_lse)
            return out, out_lse
        if S == 0 or N * H == 0:
            out.zero_()
            out_lse.fill_(float("-inf"))
            return out, out_lse
        # 16-byte lanes when the partials allow it; the output needs vec * its element size.
        vec = widest_vector([partial_out]) // 4
        while vec > 1 and widest_vector([out]) < vec * out.element_size():
            vec //= 2
        config = MergeStatesConfig(out_dtype=dtype_name(out.dtype), head_dim=D, vec=vec)
        fn = get_kernel(config, compile_target(partial_out.device))
        fn(*call_arguments(config.signature(), {
            "partial_out": partial_out, "partial_lse": partial_lse, "out": out, "lse": out_lse,
        }))
    return out, out_lse
