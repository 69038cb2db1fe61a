"""LSE merge of split-KV partial states (the combine step of split-KV decode and QSA split-K).

Given fp32 partial outputs ``O_s`` and base-2 log-sum-exps ``L_s`` of S splits of the same rows,
the merged state is ``L = log2(sum_s 2^L_s)`` and ``O = sum_s 2^(L_s - L) O_s`` (see
:mod:`cute_kernels.roles.merge`, whose :class:`~cute_kernels.roles.merge.RowMerge` does the work).

Memory-bound: every partial element is read once with 16-byte loads (``vec`` fp32 per thread)
and the output written once. One row (n, h) is handled by ``head_dim / vec`` consecutive
threads; the few LSE loads of a row hit L1 because its threads read the same addresses. Plan:
:mod:`cute_kernels.plans.merge_states`; design: docs/design/merge.md.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32

from ..jit.dtypes import cute_dtype
from ..roles.merge import RowMerge

_UNROLL = 8  # splits whose loads are in flight together (one dependent round trip per group)


class MergeStates:
    """Kernel: merge ``mPartialO [S, N, H, D]`` / ``mPartialLse [S, N, H]`` into ``mO``/``mLse``."""

    def __init__(self, cfg):
        self.out_dtype = cute_dtype(cfg.out_dtype)
        self.vec = cfg.vec
        self.rows = RowMerge(cfg.head_dim, cfg.vec, cfg.pdl)

    @cute.jit
    def __call__(
        self,
        mPartialO: cute.Tensor,
        mPartialLse: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        stream,
    ):
        self.rows.launch_rows(self.kernel(mPartialO, mPartialLse, mO, mLse), mO, stream)

    @cute.kernel
    def kernel(self, mPartialO: cute.Tensor, mPartialLse: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor):
        num_splits = mPartialO.shape[0]
        num_heads = mO.shape[1]
        row, lane = self.rows.thread_row()
        if row < mO.shape[0] * num_heads:
            n = row // num_heads
            h = row - n * num_heads
            acc, weight_sum, shift = self.merge_row(mPartialO, mPartialLse, num_splits, n, h, lane)
            inv = Float32(0.0)
            if weight_sum > Float32(0.0):
                inv = cute.arch.rcp_approx(weight_sum)
            gO = cute.local_tile(mO[n, h, None], (self.vec,), (lane,))
            gO.store((acc.load() * inv).to(self.out_dtype))
            if lane == Int32(0):
                lse = -Float32.inf
                if weight_sum > Float32(0.0):
                    lse = shift + cute.math.log2(weight_sum, fastmath=True)
                mLse[n, h] = lse

    @cute.jit
    def merge_row(self, mPartialO, mPartialLse, num_splits, n, h, lane):
        """This thread's ``vec`` dims of row (n, h) summed over the splits with weights
        ``2^(lse - shift)``: returns (unnormalized sum, sum of weights, shift = max LSE, or 0 if
        every split is empty so that every weight is exp2(-inf) = 0 and no inf - inf NaN).

        One pass in groups of UNROLL splits with a running maximum (the sum is rescaled when it
        moves): a row costs ceil(S / UNROLL) dependent round trips, where a separate max pass and
        a scalar tail would cost several times that (docs/design/merge.md#one-pass-with-loads-in-flight)."""
        acc = cute.make_rmem_tensor((self.vec,), Float32)
        acc.fill(0.0)
        weight_sum = Float32(0.0)
        shift = Float32(0.0)
        # S <= 2 (a prefix + suffix merge, the op's most common use): groups of 2, not 8, whose
        # idle predicated lanes and registers cost time (docs/design/merge.md#one-pass-with-loads-in-flight)
        if num_splits <= 2:
            weight_sum, shift = self.rows.merge_groups(acc, mPartialO, mPartialLse, num_splits, n, h, lane, 2)
        else:
            weight_sum, shift = self.rows.merge_groups(acc, mPartialO, mPartialLse, num_splits, n, h, lane, _UNROLL)
        return acc, weight_sum, shift
