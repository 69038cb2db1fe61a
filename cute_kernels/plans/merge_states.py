"""Plan of the LSE merge of split partials (``common.merge_states``).

Host-only. The kernel is :mod:`cute_kernels.common.merge`; design: docs/design/merge.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.spec import ALL_TARGETS, DTYPE_BITS, KernelConfig, TensorArg

OUT_DTYPES = ("bf16", "fp16", "fp32")
VECTOR_WIDTHS = (4, 2, 1)  # fp32 partial elements per thread, widest first
MAX_ROW_THREADS = 1024  # head_dim / vec threads serve one row


@dataclass(frozen=True)
class MergeStatesConfig(KernelConfig):
    """Compile key of :class:`cute_kernels.common.merge.MergeStates`: output dtype, head dim and
    vector width (fp32 lanes).

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
    evidence = {t: (("16-byte partial loads", r"ld\.global(\.\w+)*\.(v4\.[bf]32|v2\.[bf]64)"),) for t in ALL_TARGETS}

    def __post_init__(self):
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"merge_states output dtype must be bf16/fp16/fp32, got {self.out_dtype}")
        if self.vec not in VECTOR_WIDTHS or self.head_dim % self.vec:
            raise ValueError(f"head_dim {self.head_dim} is not a multiple of vec {self.vec}")
        if self.head_dim // self.vec > MAX_ROW_THREADS:
            raise ValueError(f"head_dim {self.head_dim} too large for merge_states (max {MAX_ROW_THREADS * self.vec})")

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
        from ..common.merge import MergeStates  # the kernel module imports the DSL: only here

        return MergeStates(self)


def compile_variants() -> list[MergeStatesConfig]:
    return [MergeStatesConfig(out_dtype=dt, head_dim=d, vec=4) for dt in ("fp32", "bf16", "fp16") for d in (64, 128, 256)]
