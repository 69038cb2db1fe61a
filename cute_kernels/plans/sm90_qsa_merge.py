"""Plan of the QSA split-K merge with the fused output gate (``sm90.qsa_merge``).

Host-only. The kernel is :mod:`cute_kernels.sm90.qsa_merge`; design: docs/design/qsa.md#merge.
Unlike ``merge_states`` (whose split count is only known on the device), the op knows the split
count when it picks this kernel, so the loads in flight per thread (``group``) and the threads
sharing a row's chunk (``lanes``) are compile-time choices made from it (:func:`merge_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.spec import DTYPE_BITS, KernelConfig, TensorArg

MAX_MERGE_GROUP = 16
MAX_MERGE_LANES = 8


def merge_group(splits: int) -> int:
    """Splits whose partial loads one merge thread issues together: the smallest power of two
    that holds them all (at least 2, at most MAX_MERGE_GROUP), so a merge of up to 16 splits is
    one dependent L2 round trip and a small split count does not carry idle predicated loads
    (docs/design/merge.md#one-pass-with-loads-in-flight)."""
    g = 2
    while g < min(splits, MAX_MERGE_GROUP):
        g *= 2
    return g


def merge_lanes(splits: int) -> int:
    """Threads sharing one chunk of a merged row: 1 up to MAX_MERGE_GROUP splits, else the fewest
    (a power of two, at most MAX_MERGE_LANES) whose share of the splits fits one group, so every
    split's load is in flight at once (N 1 at D 256: 33 splits, 4 lanes of 9;
    docs/design/qsa.md#merge)."""
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
    """Compile key of :class:`cute_kernels.sm90.qsa_merge.QsaMerge`: output (= q) dtype, head dim,
    vector width (fp32 lanes of a partial load), whether a gate is applied, PDL behind the split-K
    kernel, ``group``, the splits whose loads one thread has in flight together, and ``lanes``,
    the threads that share a chunk of a row and its splits (:func:`merge_shape` of the launch's
    splits)."""

    out_dtype: str = "bf16"
    head_dim: int = 256
    vec: int = 4
    gate: bool = True
    pdl: bool = True
    group: int = 8
    lanes: int = 1

    kernel_id = "sm90.qsa_merge"
    targets = ("sm_90a",)
    evidence = {"sm_90a": (("16-byte partial loads", r"ld\.global(\.\w+)*\.v4\.[bf]32"),
                           ("griddepcontrol.wait", r"griddepcontrol\.wait"))}

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
        from ..sm90.qsa_merge import QsaMerge  # the kernel module imports the DSL: only here

        return QsaMerge(self)
