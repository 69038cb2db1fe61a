"""Merges of split partials (device roles).

Split-KV and split-K attention leave, per split ``s`` of a row, an fp32 partial output ``O_s`` and
a base-2 log-sum-exp ``L_s``; the merged state is ``L = log2(sum_s 2^L_s)`` and
``O = sum_s 2^(L_s - L) O_s``. A split whose ``L_s`` is -inf (empty) contributes nothing: its
partial output is *selected away*, never multiplied, so garbage there cannot leak into the result
(0 * NaN would); a row whose splits are all empty gets O = 0 and L = -inf.

- :func:`add_split`: one split's weighted contribution (every merge below uses it);
- :class:`RowMerge`: a separate merge kernel's rows, ``vec`` dims of a row per thread with
  16-byte loads, splits in groups whose loads are all in flight together (``merge_states``, the
  QSA merge); the fused merges inside the paged decode kernel are in :mod:`.split_merge`.

Design: docs/design/merge.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

ROW_MERGE_THREADS = 128  # threads of one merge CTA (whole rows: fewer when a row needs more)


@cute.jit
def add_split(acc, vals, lse, shift, n: cutlass.Constexpr):
    """``acc[:n] += 2^(lse - shift) * vals[:n]``; returns the weight. An empty split
    (lse = -inf, weight 0) is *selected away*, never multiplied: its partial may hold NaN garbage
    and 0 * NaN is NaN."""
    w = cute.math.exp2(lse - shift, fastmath=True)
    keep = w > Float32(0.0)
    for e in cutlass.range_constexpr(n):
        acc[e] = acc[e] + (vals[e] * w if keep else Float32(0.0))
    return w


class RowMerge:
    """The rows ``(n, h)`` of a merge kernel: ``head_dim / vec * lanes`` consecutive threads per
    row, each owning ``vec`` dims (with ``lanes`` > 1, that many adjacent threads share a chunk
    and each merges every ``lanes``-th split); ``pdl``: launched as a programmatic dependent of
    the kernel that wrote the partials."""

    def __init__(self, head_dim: int, vec: int, pdl: bool, lanes: int = 1):
        self.vec = vec
        self.pdl = pdl
        self.threads_per_row = head_dim // vec * lanes
        self.rows_per_cta = max(1, ROW_MERGE_THREADS // self.threads_per_row)
        self.num_threads = self.rows_per_cta * self.threads_per_row

    @cute.jit
    def launch_rows(self, kernel, mO, stream):
        """Launch ``kernel`` (a bound kernel call) over the rows (n, h) of ``mO``."""
        num_rows = mO.shape[0] * mO.shape[1]
        grid_x = (num_rows + self.rows_per_cta - 1) // self.rows_per_cta
        kernel.launch(grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.jit
    def thread_row(self):
        """(row, lane): the (n, h) row this thread merges and its index within the row.
        With PDL, waits first: launched as a programmatic dependent of the split kernel, the
        launch overlapped its tail, and its partials are complete (and flushed) only after this;
        and lets its own dependents launch (the next split kernel's setup overlaps this merge)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * self.rows_per_cta + tidx // self.threads_per_row
        lane = tidx % self.threads_per_row
        if cutlass.const_expr(self.pdl):
            # the next kernel may launch now: if it is a programmatic dependent, it waits in its
            # own griddepcontrol.wait until this grid has completed and its writes are visible
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
        return row, lane

    @cute.jit
    def merge_groups(self, acc, mPartialO, mPartialLse, num_splits, n, h, lane, group: cutlass.Constexpr,
                     first=0, stride: cutlass.Constexpr = 1):
        """This thread's ``vec`` dims of row (n, h) summed over splits ``first, first + stride,
        ...`` (all by default) with weights ``2^(lse - shift)``, in groups of ``group`` splits:
        accumulates into ``acc`` (zeros), returns (sum of weights, shift = the running max LSE, 0
        while every split so far is empty, so that every weight is exp2(-inf) = 0 and no
        inf - inf NaN).

        All LSE and 16-byte partial loads of a group are issued before any is used (one dependent
        round trip per group), and the last group's missing splits are predicated off (not
        clamped: idle loads cost at small split counts) and weighted as empty
        (docs/design/merge.md#one-pass-with-loads-in-flight)."""
        weight_sum = Float32(0.0)
        shift = Float32(0.0)  # the running max LSE, 0 while every split so far is empty
        lse_max = -Float32.inf
        for s0 in cutlass.range(first, num_splits, group * stride, unroll=1):
            lses = cute.make_rmem_tensor((group,), Float32)
            parts = cute.make_rmem_tensor((group * self.vec,), Float32)
            for j in cutlass.range_constexpr(group):
                lses[j] = -Float32.inf  # past the last split: weight 0, its (unread) value selected away
                if s0 + j * stride < num_splits:
                    lses[j] = mPartialLse[s0 + j * stride, n, h]
                    src = cute.local_tile(mPartialO[s0 + j * stride, n, h, None], (self.vec,), (lane,))
                    cute.local_tile(parts, (self.vec,), (j,)).store(src.load())
            # the sums are rescaled from the previous max, -inf while every split so far is empty
            # (the sums are 0 then, and exp2(-inf) = 0): rescaling from the shift of 0 instead
            # gives exp2(-new_shift) = inf for a max below -128, and 0 * inf = NaN
            # (docs/design/merge.md#any-finite-lse)
            prev_max = lse_max
            for j in cutlass.range_constexpr(group):
                lse_max = cute.arch.fmax(lse_max, lses[j])
            new_shift = lse_max if lse_max != -Float32.inf else Float32(0.0)
            scale = cute.math.exp2(prev_max - new_shift, fastmath=True)
            for e in cutlass.range_constexpr(self.vec):
                acc[e] = acc[e] * scale
            weight_sum = weight_sum * scale
            shift = new_shift
            for j in cutlass.range_constexpr(group):
                part = cute.local_tile(parts, (self.vec,), (j,)).load()
                weight_sum = self.accumulate(acc, part, lses[j], shift, weight_sum)
        return weight_sum, shift

    @cute.jit
    def accumulate(self, acc, part, lse, shift, weight_sum):
        """acc += 2^(lse - shift) * part (see :func:`add_split`); returns the new weight sum."""
        vals = cute.make_rmem_tensor((self.vec,), Float32)
        vals.store(part)
        return weight_sum + add_split(acc, vals, lse, shift, self.vec)
