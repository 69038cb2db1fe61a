"""Merge of the QSA split-K partials with the fused output gate (``sm90.qsa_merge``).

``merge_states`` (``common/merge.py``) computes ``O = sum_s 2^(L_s - L) O_s`` from fp32 partials
and base-2 LSEs; QSA then needs ``round(O) * sigmoid(gate)`` in q's dtype and no merged LSE. This
kernel uses the same row merge (:class:`~cute_kernels.roles.merge.RowMerge`: one row ``(n, h)``
per ``head_dim / vec`` threads, 16-byte partial loads, empty splits selected away), reads the
gate with the same vector width, and stores no LSE. It runs as a programmatic dependent launch of
the split-K kernel (``pdl``).

The op knows the split count when it picks this kernel, so the loads in flight per thread
(``group``) and the threads sharing a chunk (``lanes``) are compile-time choices made from it
(:func:`cute_kernels.plans.sm90_qsa_merge.merge_shape`). Design: docs/design/qsa.md#merge.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..jit.dtypes import cute_dtype
from ..roles.fragments import sigmoid
from ..roles.merge import RowMerge


class QsaMerge:
    """Kernel: ``mO [N, H, D] = round(merge(mPartialO, mPartialLse)) * sigmoid(mGate)``."""

    def __init__(self, cfg):
        self.out_dtype = cute_dtype(cfg.out_dtype)
        self.vec = cfg.vec
        self.gate = cfg.gate
        self.group = cfg.group
        # `lanes` adjacent threads share each vec-chunk of a row, each merging every lanes-th split
        self.lanes = cfg.lanes
        self.rows = RowMerge(cfg.head_dim, cfg.vec, cfg.pdl, cfg.lanes)

    @cute.jit
    def merge_row(self, mPartialO, mPartialLse, num_splits, n, h, lane):
        """Row (n, h) merged in groups of the config's ``group`` splits; with
        ``lanes`` > 1, ``lane`` is the thread's index in the row and its chunk's ``lanes``
        threads each merge splits ``sub, sub + lanes, ...``, then combine their states with
        butterfly shuffles (rescaled to the larger LSE; an empty state has weight 0)."""
        acc = cute.make_rmem_tensor((self.vec,), Float32)
        acc.fill(0.0)
        if cutlass.const_expr(self.lanes == 1):
            weight_sum, shift = self.rows.merge_groups(acc, mPartialO, mPartialLse, num_splits, n, h, lane, self.group)
            return acc, weight_sum, shift
        sub = lane % self.lanes
        weight_sum, shift = self.rows.merge_groups(acc, mPartialO, mPartialLse, num_splits, n, h, lane // self.lanes,
                                              self.group, sub, self.lanes)
        m = -Float32.inf  # this state's max LSE (-inf: empty, weight 0)
        if weight_sum > Float32(0.0):
            m = shift
        for k in cutlass.range_constexpr(self.lanes.bit_length() - 1):
            m_o = cute.arch.shuffle_sync_bfly(m, 1 << k)
            w_o = cute.arch.shuffle_sync_bfly(weight_sum, 1 << k)
            vals = cute.make_rmem_tensor((self.vec,), Float32)
            for e in cutlass.range_constexpr(self.vec):
                vals[e] = cute.arch.shuffle_sync_bfly(acc[e], 1 << k)
            m_new = cute.arch.fmax(m, m_o)
            sh = m_new if m_new != -Float32.inf else Float32(0.0)
            a = cute.math.exp2(m - sh, fastmath=True)
            b = cute.math.exp2(m_o - sh, fastmath=True)
            for e in cutlass.range_constexpr(self.vec):
                acc[e] = acc[e] * a + vals[e] * b
            weight_sum = weight_sum * a + w_o * b
            m = m_new
        return acc, weight_sum, m if m != -Float32.inf else Float32(0.0)

    @cute.jit
    def __call__(self, mPartialO: cute.Tensor, mPartialLse: cute.Tensor, mO: cute.Tensor, mGate: cute.Tensor,
                 stream):
        self.rows.launch_rows(self.merge_kernel(mPartialO, mPartialLse, mO, mGate), mO, stream)

    @cute.kernel
    def merge_kernel(self, mPartialO: cute.Tensor, mPartialLse: cute.Tensor, mO: cute.Tensor, mGate: cute.Tensor):
        num_splits = mPartialO.shape[0]
        num_heads = mO.shape[1]
        row, t = self.rows.thread_row()
        lane = t
        if cutlass.const_expr(self.lanes > 1):
            lane = t // self.lanes  # this thread's vec-chunk of the row
        if row < mO.shape[0] * num_heads:
            n = row // num_heads
            h = row - n * num_heads
            g = None
            if cutlass.const_expr(self.gate):  # in flight with the first group of partials
                g = cute.local_tile(mGate[n, h, None], (self.vec,), (lane,)).load().to(Float32)
            acc, weight_sum, _ = self.merge_row(mPartialO, mPartialLse, num_splits, n, h, t)
            inv = Float32(0.0)
            if weight_sum > Float32(0.0):
                inv = Float32(1.0) / weight_sum
            o = (acc.load() * inv).to(self.out_dtype)  # the attention output, rounded first
            if cutlass.const_expr(self.gate):
                sig = cute.make_rmem_tensor((self.vec,), Float32)
                sig.store(g)
                for e in cutlass.range_constexpr(self.vec):
                    sig[e] = sigmoid(sig[e])
                o = (o.to(Float32) * sig.load()).to(self.out_dtype)
            if cutlass.const_expr(self.lanes == 1):
                cute.local_tile(mO[n, h, None], (self.vec,), (lane,)).store(o)
            else:
                if t % self.lanes == 0:  # every lane of the chunk holds the combined state
                    cute.local_tile(mO[n, h, None], (self.vec,), (lane,)).store(o)
