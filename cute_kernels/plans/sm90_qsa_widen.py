"""Plan of the QSA widening pre-pass (``sm90.qsa_widen``): FP8 pages into a 16-bit copy, and when
a prefill uses it.

Host-only. The kernel is :mod:`cute_kernels.sm90.qsa_widen`; design: docs/design/qsa.md#fp8-prefill-on-a-widened-copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..jit.spec import KernelConfig, TensorArg
from . import hw

NUM_THREADS = 256
VEC = 16  # FP8 elements (16 bytes) per thread, of K and of V

# The widened copy's workspace at most (16-bit K and V of every page the block table addresses).
WIDEN_MAX_BYTES = 1 << 30
# ... and at most this much per query row of the batch, so that the widening (reading the FP8
# pages once, writing the copy) costs at most about a quarter of what the 16-bit kernel saves
# (docs/design/qsa.md#fp8-prefill-on-a-widened-copy). The block table's width decides the copy's size: a table
# trimmed to the batch's longest context keeps it small.
WIDEN_BYTES_PER_ROW = 24 << 10


def rows_per_cta(head_dim: int) -> int:
    """(token, head) rows one CTA widens: ``head_dim / VEC`` threads per row."""
    return NUM_THREADS // (head_dim // VEC)


@dataclass(frozen=True)
class QsaWidenConfig(KernelConfig):
    """Compile key of :class:`cute_kernels.sm90.qsa_widen.QsaWidenPages`: the widened dtype (the
    query's), head dim and page size (rows per page are ``page_size * Hkv``)."""

    out_dtype: str = "bf16"
    head_dim: int = 256
    page_size: int = 1568

    kernel_id = "sm90.qsa_widen"
    targets = ("sm_90a",)
    # 16-byte FP8 loads, exact e4m3 -> f16 conversion, 16-byte stores
    evidence = {"sm_90a": (("16-byte loads", r"ld\.global(\.\w+)*\.v4\.b32"),
                           ("cvt e4m3x2->f16x2", r"cvt\.rn\.f16x2\.e4m3x2"),
                           ("16-byte stores", r"st\.global(\.\w+)*\.v4\.b32"))}
    num_threads: ClassVar[int] = NUM_THREADS
    vec: ClassVar[int] = VEC

    def __post_init__(self):
        if self.out_dtype not in ("bf16", "fp16"):
            raise ValueError(f"qsa widen output dtype must be bf16/fp16, got {self.out_dtype}")
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim must be 64, 128 or 256, got {self.head_dim}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    @property
    def rows_per_cta(self) -> int:
        return rows_per_cta(self.head_dim)

    def signature(self):
        D, page = self.head_dim, self.page_size
        cache = ("NB", page, "Hkv", D)
        wide = ("NP", page, "Hkv", D)
        return (
            TensorArg("k_cache", "fp8_e4m3", cache, align=16),
            TensorArg("v_cache", "fp8_e4m3", cache, align=16),
            TensorArg("block_table", "int32", ("NR", "W"), align=4),
            TensorArg("k_wide", self.out_dtype, wide, align=16),
            TensorArg("v_wide", self.out_dtype, wide, align=16),
            TensorArg("table", "int32", ("NR", "W"), align=4),
        )

    def build(self):
        from ..sm90.qsa_widen import QsaWidenPages  # the kernel module imports the DSL: only here

        return QsaWidenPages(self)


def widen_grid_rows(page_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Row chunks per page (the launch's grid y): must stay <= 65535."""
    return -(-page_size * num_kv_heads // rows_per_cta(head_dim))


def widened_bytes(num_reqs: int, width: int, page_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of the widened copy: 16-bit K and V of ``num_reqs x width`` pages."""
    return num_reqs * width * page_size * num_kv_heads * head_dim * 2 * 2


def use_widened_cache(kv_dtype: str, rows: int, num_reqs: int, width: int, page_size: int, num_kv_heads: int,
                      head_dim: int, force: bool | None = None) -> bool:
    """Whether an FP8 prefill's row tiles run on a widened 16-bit copy of the block table's pages:
    the copy within :data:`WIDEN_MAX_BYTES` and :data:`WIDEN_BYTES_PER_ROW` per row, a page's rows
    within one launch's grid, and at least one page in the table. ``force`` (tests, benchmarks):
    False never, True whenever the cache is FP8, the grid fits and the table has a page."""
    if kv_dtype != "fp8_e4m3" or widen_grid_rows(page_size, num_kv_heads, head_dim) > hw.MAX_GRID_Y:
        return False
    if num_reqs * width == 0:  # no page to widen (and no empty grid to launch)
        return False
    if force is not None:
        return bool(force)
    size = widened_bytes(num_reqs, width, page_size, num_kv_heads, head_dim)
    return size <= WIDEN_MAX_BYTES and size <= rows * WIDEN_BYTES_PER_ROW
