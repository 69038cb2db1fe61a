"""LSE merge of split-KV partial states (the combine step of split-KV decode and QSA split-K).

Given fp32 partial outputs ``O_s`` and base-2 log-sum-exps ``L_s`` of S splits of the same rows,
the merged state is ``L = log2(sum_s 2^L_s)`` and ``O = sum_s 2^(L_s - L) O_s``. Splits whose
``L_s`` is -inf (empty) contribute nothing: their partial output is selected away, never
multiplied, so garbage there cannot leak into the result; a row whose splits are all empty gets
O = 0 and L = -inf.

Memory-bound: every partial element is read once with 16-byte loads (``vec`` fp32 per thread)
and the output written once. One row (n, h) is handled by ``head_dim / vec`` consecutive
threads; the few LSE loads of a row hit L1 because its threads read the same addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..jit.compiler import ALL_TARGETS, KernelConfig
from ..jit.dtypes import DTYPE_BITS, cute_dtype
from ..jit.spec import TensorArg

_MAX_THREADS = 128
_UNROLL = 8  # splits whose loads are in flight together (one dependent round trip per group)


class MergeStates:
    """Kernel: merge ``mPartialO [S, N, H, D]`` / ``mPartialLse [S, N, H]`` into ``mO``/``mLse``."""

    def __init__(self, out_dtype, head_dim: int, vec: int, pdl: bool = False):
        self.pdl = pdl
        self.out_dtype = out_dtype
        self.head_dim = head_dim
        self.vec = vec
        self.threads_per_row = head_dim // vec
        self.rows_per_cta = max(1, _MAX_THREADS // self.threads_per_row)
        self.num_threads = self.rows_per_cta * self.threads_per_row

    @cute.jit
    def __call__(
        self,
        mPartialO: cute.Tensor,
        mPartialLse: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        stream,
    ):
        self.launch_rows(self.kernel(mPartialO, mPartialLse, mO, mLse), mO, stream)

    @cute.jit
    def launch_rows(self, kernel, mO, stream):
        """Launch ``kernel`` (a bound kernel call) over the rows (n, h) of ``mO``."""
        num_rows = mO.shape[0] * mO.shape[1]
        grid_x = (num_rows + self.rows_per_cta - 1) // self.rows_per_cta
        kernel.launch(grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mPartialO: cute.Tensor, mPartialLse: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor):
        num_splits = mPartialO.shape[0]
        num_heads = mO.shape[1]
        row, lane = self.thread_row()
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
    def thread_row(self):
        """(row, lane): the (n, h) row this thread merges and its ``vec``-chunk within the row.
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
    def merge_row(self, mPartialO, mPartialLse, num_splits, n, h, lane):
        """This thread's ``vec`` dims of row (n, h) summed over the splits with weights
        ``2^(lse - shift)``: returns (unnormalized sum, sum of weights, shift = max LSE, or 0 if
        every split is empty so that every weight is exp2(-inf) = 0 and no inf - inf NaN).

        One pass in groups of UNROLL splits with a running maximum (the sum is rescaled when it
        moves): all LSE and 16-byte partial loads of a group are issued before any is used, and
        the last group's missing splits are predicated off (not clamped: 8 loads for S = 2 cost
        35 % at N 256) and weighted as empty. A row costs ceil(S / UNROLL) dependent round trips;
        a separate max pass and a scalar tail cost S / 4 + S / UNROLL + S % UNROLL, ~14 at S = 33,
        where the merge is pure latency. An empty split's value is *selected away*, never
        multiplied, so NaN garbage in its partial cannot leak (0 * NaN would)."""
        acc = cute.make_rmem_tensor((self.vec,), Float32)
        acc.fill(0.0)
        weight_sum = Float32(0.0)
        shift = Float32(0.0)
        # S <= 2 (a prefix + suffix merge, the op's most common use): groups of 2, not 8 (the
        # idle predicated lanes and registers of a group of 8 cost 1.4 us at S = 2, N = 256)
        if num_splits <= 2:
            weight_sum, shift = self.merge_groups(acc, mPartialO, mPartialLse, num_splits, n, h, lane, 2)
        else:
            weight_sum, shift = self.merge_groups(acc, mPartialO, mPartialLse, num_splits, n, h, lane, _UNROLL)
        return acc, weight_sum, shift

    @cute.jit
    def merge_groups(self, acc, mPartialO, mPartialLse, num_splits, n, h, lane, group: cutlass.Constexpr,
                     first=0, stride: cutlass.Constexpr = 1):
        """``merge_row`` in groups of ``group`` splits: accumulates into ``acc`` (zeros), returns
        (sum of weights, shift). Visits splits ``first, first + stride, ...`` (all by default)."""
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
            for j in cutlass.range_constexpr(group):
                lse_max = cute.arch.fmax(lse_max, lses[j])
            new_shift = lse_max if lse_max != -Float32.inf else Float32(0.0)
            scale = cute.math.exp2(shift - new_shift, fastmath=True)
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


@cute.jit
def add_split(acc, vals, lse, shift, n: cutlass.Constexpr):
    """``acc[:n] += 2^(lse - shift) * vals[:n]``; returns the weight. An empty split
    (lse = -inf, weight 0) is *selected away*, never multiplied: its partial may hold NaN garbage
    and 0 * NaN is NaN. Shared by this merge and the paged decode's fused merge."""
    w = cute.math.exp2(lse - shift, fastmath=True)
    keep = w > Float32(0.0)
    for e in cutlass.range_constexpr(n):
        acc[e] = acc[e] + (vals[e] * w if keep else Float32(0.0))
    return w


@dataclass(frozen=True)
class MergeStatesConfig(KernelConfig):
    """Compile key of :class:`MergeStates`: output dtype, head dim and vector width (fp32 lanes).

    ``vec`` fp32 elements per thread: 4 gives 16-byte loads and needs every partial stride and
    the data pointer 16-byte aligned; the op picks the widest width the tensors allow.
    """

    out_dtype: str = "bf16"
    head_dim: int = 128
    vec: int = 4
    pdl: bool = False  # programmatic dependent launch behind the kernel that wrote the partials

    kernel_id = "common.merge_states"
    targets = ALL_TARGETS
    # 16-byte loads of the partials are what makes it run at bandwidth
    evidence = {t: (r"ld\.global(\.\w+)*\.(v4\.[bf]32|v2\.[bf]64)",) for t in ALL_TARGETS}

    def __post_init__(self):
        if self.out_dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"merge_states output dtype must be bf16/fp16/fp32, got {self.out_dtype}")
        if self.vec not in (1, 2, 4) or self.head_dim % self.vec:
            raise ValueError(f"head_dim {self.head_dim} is not a multiple of vec {self.vec}")
        if self.head_dim // self.vec > 1024:
            raise ValueError(f"head_dim {self.head_dim} too large for merge_states (max {1024 * self.vec})")

    def signature(self):
        D = self.head_dim
        out_align = max(DTYPE_BITS[self.out_dtype] * self.vec // 8, DTYPE_BITS[self.out_dtype] // 8)
        return (
            TensorArg("partial_out", "fp32", ("S", "N", "H", D), align=4 * self.vec),
            TensorArg("partial_lse", "fp32", ("S", "N", "H"), align=4),
            TensorArg("out", self.out_dtype, ("N", "H", D), align=out_align),
            TensorArg("lse", "fp32", ("N", "H"), align=4),
        )

    def build(self):
        return MergeStates(cute_dtype(self.out_dtype), self.head_dim, self.vec, self.pdl)
