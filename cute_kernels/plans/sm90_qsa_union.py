"""Plan of the QSA row-tile union pre-pass (``sm90.qsa_union``).

Host-only. The kernel is :mod:`cute_kernels.sm90.qsa_union` (it sizes its shared memory and picks
its CTAs per SM from the hardware facts its config carries); design: docs/design/qsa.md#row-tiles-over-the-union.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

from ..jit.spec import KernelConfig, TensorArg
from . import hw

MAX_ROWS = 8  # rows of one tile
MIN_TOKENS, MAX_TOKENS = 1024, 1 << 19  # the token bitmap's capacity (a power of two)


@dataclass(frozen=True)
class QsaUnionConfig(KernelConfig):
    """Compile key of :class:`cute_kernels.sm90.qsa_union.Sm90QsaUnion`.

    ``rows_per_tile``: R, the query rows of one tile (1..8). ``page_size``: tokens per cache page
    (any; it only enters the candidate bound ``min(max_tokens, BW x page)``).
    ``max_tokens``: the bitmap's capacity, a power of two in [1024, 524288]; tokens at or above
    it are never candidates (the host picks it >= the block table's width x page). ``union_cap``:
    the most union entries a tile may have (a multiple of 64); a larger union falls back.
    """

    rows_per_tile: int = 5
    page_size: int = 1568
    max_tokens: int = 16384
    union_cap: int = 4160

    kernel_id = "sm90.qsa_union"
    targets = ("sm_90a",)
    # shared-memory atomics build the bitmap and the member words; popcounts give the ranks
    evidence = {"sm_90a": (("atom.shared.or", r"atom(\.\w+)*\.shared(::cta)?(\.\w+)*\.or\.b32"),
                           ("popc", r"popc\.b32"))}
    hw: ClassVar[ModuleType] = hw  # what the kernel reads from its config (kernels never import plans)

    def __post_init__(self):
        if not 1 <= self.rows_per_tile <= MAX_ROWS:
            raise ValueError(f"rows_per_tile must be in [1, {MAX_ROWS}], got {self.rows_per_tile}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        mt = self.max_tokens
        if mt < MIN_TOKENS or mt > MAX_TOKENS or mt & (mt - 1):
            raise ValueError(f"max_tokens must be a power of two in [{MIN_TOKENS}, {MAX_TOKENS}], got {mt}")
        if self.union_cap < 64 or self.union_cap % 64:
            raise ValueError(f"union_cap must be a positive multiple of 64, got {self.union_cap}")

    def signature(self):
        R, U = self.rows_per_tile, self.union_cap
        return (
            TensorArg("packed_indices", "int32", ("T", "W"), align=4),
            TensorArg("block_table", "int32", ("NR", "BW"), align=4),
            TensorArg("token_to_req", "int32", ("T",), align=4),
            TensorArg("union", "int32", ("NT", U), align=4),
            TensorArg("member", "int32", ("NT", R, U // 32), align=4),
            TensorArg("length", "int32", ("NT",), align=4),
        )

    def build(self):
        from ..sm90.qsa_union import Sm90QsaUnion  # the kernel module imports the DSL: only here

        return Sm90QsaUnion(self)
