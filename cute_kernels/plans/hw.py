"""Hardware facts the plans size kernels with, each written once (SM90: H100 / H200).

Shared memory on SM90: each SM has 228 KB of shared memory (out of its 256 KB of unified L1 and
shared memory), the runtime reserves 1 KB of it for every resident CTA, and one CTA may allocate
at most 227 KB (``cudaDevAttrMaxSharedMemoryPerBlockOptin``, i.e. 228 KB less its own
reservation). So ``occ`` CTAs of ``s`` bytes fit one SM when ``occ * (s + 1 KB) <= 228 KB`` and
``s <= 227 KB``. See docs/design/architecture.md#hardware-facts.
"""

from __future__ import annotations

SMEM_PER_SM = 228 * 1024  # shared memory capacity of one SM
SMEM_RESERVED_PER_CTA = 1024  # reserved by the runtime for every resident CTA
MAX_SMEM_PER_CTA = SMEM_PER_SM - SMEM_RESERVED_PER_CTA  # the most one CTA may allocate
REGISTERS_PER_SM = 65536  # 32-bit registers of one SM (the whole file a launch can share)
MAX_THREADS_PER_CTA = 1024
H200_SMS = 132  # SMs of an H200 (and of an H100 SXM): the schedules' default machine
WARPGROUP_WARPS = 4  # warps of one warpgroup, the unit of a WGMMA
WGMMA_M = 64  # rows of one WGMMA (its M)
MAX_CLUSTER = 16  # CTAs of one thread-block cluster (the non-portable limit; 8 is portable)
MAX_GRID_Y = 65535  # the largest grid extent in y (and z)


def smem_fits(smem_bytes: int, ctas_per_sm: int) -> bool:
    """Whether ``ctas_per_sm`` CTAs of ``smem_bytes`` of shared memory each fit one SM."""
    return smem_bytes <= MAX_SMEM_PER_CTA and ctas_per_sm * (smem_bytes + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM
