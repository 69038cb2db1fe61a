"""Merge of the QSA split-K partials with the fused output gate.

``merge_states`` (``common/merge.py``) computes ``O = sum_s 2^(L_s - L) O_s`` from fp32 partials
and base-2 LSEs; QSA then needs ``round(O) * sigmoid(gate)`` in q's dtype and no merged LSE. This
kernel is :class:`~cute_kernels.common.merge.MergeStates` with that epilogue: same thread layout
(one row ``(n, h)`` per ``head_dim / vec`` threads, 16-byte partial loads, empty splits selected
away by the inherited ``accumulate``), the gate read with the same vector width, and no LSE
store. It runs as a programmatic dependent launch of the split-K kernel (``pdl``).

Unlike ``merge_states`` (whose split count is only known on the device), the op knows the split
count when it picks this kernel, so the loads in flight per thread (``group``) are a compile-time
choice made from it (:func:`merge_group`): every split of a decode batch in one round trip up to
16 splits (N = 4 rows at D 256 split 11 ways), where ``merge_states``'s groups of 8 take two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..common.merge import MergeStates
from ..jit.compiler import KernelConfig
from ..jit.dtypes import DTYPE_BITS, cute_dtype
from ..jit.spec import TensorArg


def sigmoid(x: Float32) -> Float32:
    """(Traced.) fp32 ``1 / (1 + e^-x)`` of the QSA output gate; shared by the QSA kernels.
    ``rcp.approx`` (about 1 ulp of fp32, far below the bf16 rounding that follows): an IEEE
    division is a call with a slow-path branch per element, which made the row-tile kernel's
    gated epilogue ~1/5 of its stall samples (ncu SASS, 1 x 4096). Saturates to 0 and 1."""
    return cute.arch.rcp_approx(Float32(1.0) + cute.math.exp2(-x * Float32(math.log2(math.e)), fastmath=True))


class QsaMerge(MergeStates):
    """Kernel: ``mO [N, H, D] = round(merge(mPartialO, mPartialLse)) * sigmoid(mGate)``."""

    def __init__(self, out_dtype, head_dim: int, vec: int, gate: bool, pdl: bool, group: int, lanes: int = 1):
        super().__init__(out_dtype, head_dim, vec, pdl)
        self.gate = gate
        self.group = group
        # `lanes` adjacent threads share each vec-chunk of a row, each merging every lanes-th split
        self.lanes = lanes
        self.threads_per_row = head_dim // vec * lanes
        self.rows_per_cta = max(1, 128 // self.threads_per_row)
        self.num_threads = self.rows_per_cta * self.threads_per_row

    @cute.jit
    def merge_row(self, mPartialO, mPartialLse, num_splits, n, h, lane):
        """As :meth:`MergeStates.merge_row`, in groups of the config's ``group`` splits; with
        ``lanes`` > 1, ``lane`` is the thread's index in the row and its chunk's ``lanes``
        threads each merge splits ``sub, sub + lanes, ...``, then combine their states with
        butterfly shuffles (rescaled to the larger LSE; an empty state has weight 0)."""
        acc = cute.make_rmem_tensor((self.vec,), Float32)
        acc.fill(0.0)
        if cutlass.const_expr(self.lanes == 1):
            weight_sum, shift = self.merge_groups(acc, mPartialO, mPartialLse, num_splits, n, h, lane, self.group)
            return acc, weight_sum, shift
        sub = lane % self.lanes
        weight_sum, shift = self.merge_groups(acc, mPartialO, mPartialLse, num_splits, n, h, lane // self.lanes,
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
        self.launch_rows(self.merge_kernel(mPartialO, mPartialLse, mO, mGate), mO, stream)

    @cute.kernel
    def merge_kernel(self, mPartialO: cute.Tensor, mPartialLse: cute.Tensor, mO: cute.Tensor, mGate: cute.Tensor):
        num_splits = mPartialO.shape[0]
        num_heads = mO.shape[1]
        row, t = self.thread_row()
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


MAX_MERGE_GROUP = 16


def merge_group(splits: int) -> int:
    """Splits whose partial loads one merge thread issues together: the smallest power of two
    that holds them all (at least 2, at most MAX_MERGE_GROUP), so a merge of up to 16 splits is
    one dependent L2 round trip and a small split count does not carry idle predicated loads
    (8 of them for S = 2 cost 35 % at N 256, see ``common/merge.py``)."""
    g = 2
    while g < min(splits, MAX_MERGE_GROUP):
        g *= 2
    return g


MAX_MERGE_LANES = 8


def merge_lanes(splits: int) -> int:
    """Threads sharing one chunk of a merged row: 1 up to MAX_MERGE_GROUP splits, else the fewest
    (a power of two, at most MAX_MERGE_LANES) whose share of the splits fits one group, so every
    split's load is in flight at once (N 1 at D 256: 33 splits, 4 lanes of 9; one thread walking
    all 33 took three rounds, 2.5 us, in the thirteenth session's timeline). H200, two
    interleaved pairs: N 1 BF16 7.7-7.9 -> 7.0 us, FP8 8.5 -> 8.0."""
    lanes = 1
    while -(-splits // lanes) > MAX_MERGE_GROUP and lanes < MAX_MERGE_LANES:
        lanes *= 2
    return lanes


def merge_shape(splits: int) -> tuple[int, int]:
    """``(group, lanes)`` of the merge of ``splits`` partials."""
    lanes = merge_lanes(splits)
    return merge_group(-(-splits // lanes)), lanes


@dataclass(frozen=True)
class QsaMergeConfig(KernelConfig):
    """Compile key of :class:`QsaMerge`: output (= q) dtype, head dim, vector width (fp32 lanes
    of a partial load), whether a gate is applied, PDL behind the split-K kernel, ``group``, the
    splits whose loads one thread has in flight together, and ``lanes``, the threads that share a
    chunk of a row and its splits (:func:`merge_shape` of the launch's splits)."""

    out_dtype: str = "bf16"
    head_dim: int = 256
    vec: int = 4
    gate: bool = True
    pdl: bool = True
    group: int = 8
    lanes: int = 1

    kernel_id = "sm90.qsa_merge"
    targets = ("sm_90a",)
    evidence = {"sm_90a": (r"ld\.global(\.\w+)*\.v4\.[bf]32", r"griddepcontrol\.wait")}

    def __post_init__(self):
        if self.out_dtype not in ("bf16", "fp16"):
            raise ValueError(f"qsa merge output dtype must be bf16/fp16, got {self.out_dtype}")
        if self.vec not in (1, 2, 4) or self.head_dim % self.vec or self.head_dim // self.vec > 1024:
            raise ValueError(f"bad head_dim/vec {self.head_dim}/{self.vec}")
        if self.group not in (2, 4, 8, 16):
            raise ValueError(f"qsa merge group must be 2, 4, 8 or 16 splits, got {self.group}")
        if self.lanes not in (1, 2, 4, 8) or self.head_dim // self.vec * self.lanes > 1024:
            raise ValueError(f"qsa merge lanes must be 1, 2, 4 or 8 (head_dim / vec x lanes <= 1024), got {self.lanes}")

    def signature(self):
        D = self.head_dim
        align16 = DTYPE_BITS[self.out_dtype] * self.vec // 8
        return (
            TensorArg("partial_out", "fp32", ("S", "N", "H", D), align=4 * self.vec),
            TensorArg("partial_lse", "fp32", ("S", "N", "H"), align=4),
            TensorArg("out", self.out_dtype, ("N", "H", D), align=align16),
            TensorArg("gate", self.out_dtype, ("GN", "GH", D), align=align16),
        )

    def build(self):
        return QsaMerge(cute_dtype(self.out_dtype), self.head_dim, self.vec, self.gate, self.pdl, self.group,
                        self.lanes)
