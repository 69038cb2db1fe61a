"""Plans of the hardware probes: the smallest kernels that prove a tensor-core path compiles
(``sm90.probe``: TMA + WGMMA; ``sm100.probe``: TMA + tcgen05 + TMEM).

Host-only. The kernels are :mod:`cute_kernels.sm90.probe` and :mod:`cute_kernels.sm100.probe`.
Static shapes on purpose: they exist to prove the hardware path, not to serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..jit.spec import KernelConfig, TensorArg
from . import hw

SM100_TILE_M = 128  # a 1-CTA tcgen05 MMA with M = 128 spans all 128 TMEM lanes
SM100_TILE_K = 64  # 64 bf16 = 128 bytes per row: one 128B-swizzle atom, the widest TMA/UMMA layout
SM100_EPI_COLS = 32  # accumulator columns read per tcgen05.ld (32 fp32 registers per thread)


@dataclass(frozen=True)
class Sm90ProbeConfig(KernelConfig):
    """``C[64, n] = A[64, k] @ B[n, k]^T`` in one CTA (one warpgroup's WGMMA M)."""

    n: int = 64
    k: int = 64

    kernel_id = "sm90.probe"
    targets = ("sm_90a",)
    evidence = {"sm_90a": (("wgmma.mma_async", r"wgmma\.mma_async"), ("TMA load", r"cp\.async\.bulk\.tensor"),
                           ("mbarrier.try_wait", r"mbarrier\.try_wait"))}
    m: ClassVar[int] = hw.WGMMA_M

    def signature(self):
        return (
            TensorArg("a", "bf16", (self.m, self.k)),
            TensorArg("b", "bf16", (self.n, self.k)),
            TensorArg("c", "fp32", (self.m, self.n)),
        )

    def build(self):
        from ..sm90.probe import Sm90Probe  # the kernel module imports the DSL: only here

        return Sm90Probe(self)


@dataclass(frozen=True)
class Sm100ProbeConfig(KernelConfig):
    """Compile key of the SM100 probe: N (multiple of 32, 32..256) and K (multiple of 64)."""

    n: int = 64
    k: int = 64

    kernel_id = "sm100.probe"
    targets = ("sm_100a",)
    # the tensor-core MMA, the TMEM allocation and the TMA loads are what the probe is for
    evidence = {"sm_100a": (("tcgen05.mma", r"tcgen05\.mma"), ("tcgen05.alloc", r"tcgen05\.alloc"),
                            ("TMA load", r"cp\.async\.bulk\.tensor"))}
    tile_m: ClassVar[int] = SM100_TILE_M
    tile_k: ClassVar[int] = SM100_TILE_K
    epi_cols: ClassVar[int] = SM100_EPI_COLS

    def __post_init__(self):
        # N is the UMMA instruction's N (M = 128 allows 16..256 in steps of 16); the epilogue
        # reads 32 columns per tcgen05.ld, hence the multiple of 32.
        if self.n % SM100_EPI_COLS or not SM100_EPI_COLS <= self.n <= 256:
            raise ValueError(f"sm100 probe n must be a multiple of {SM100_EPI_COLS} in [32, 256], got {self.n}")
        if self.k % SM100_TILE_K or self.k <= 0:
            raise ValueError(f"sm100 probe k must be a positive multiple of {SM100_TILE_K}, got {self.k}")

    def signature(self):
        return (
            TensorArg("a", "bf16", (SM100_TILE_M, self.k), align=16),
            TensorArg("b", "bf16", (self.n, self.k), align=16),
            TensorArg("c", "fp32", (SM100_TILE_M, self.n), align=16),
        )

    def build(self):
        from ..sm100.probe import Sm100Probe  # the kernel module imports the DSL: only here

        return Sm100Probe(self)
