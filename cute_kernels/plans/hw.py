"""Hardware facts the plans size kernels with, each written once (SM90: H100 / H200; the
per-target tables at the end cover every compile target).

Shared memory on SM90: each SM has 228 KB of shared memory (out of its 256 KB of unified L1 and
shared memory), the runtime reserves 1 KB of it for every resident CTA, and one CTA may allocate
at most 227 KB (``cudaDevAttrMaxSharedMemoryPerBlockOptin``, i.e. 228 KB less its own
reservation). So ``occ`` CTAs of ``s`` bytes fit one SM when ``occ * (s + 1 KB) <= 228 KB`` and
``s <= 227 KB``. See docs/design/architecture.md#hardware-facts.
"""

from __future__ import annotations

from ..jit.spec import ALL_TARGETS

SMEM_PER_SM = 228 * 1024  # shared memory capacity of one SM
SMEM_RESERVED_PER_CTA = 1024  # reserved by the runtime for every resident CTA
MAX_SMEM_PER_CTA = SMEM_PER_SM - SMEM_RESERVED_PER_CTA  # the most one CTA may allocate
REGISTERS_PER_SM = 65536  # 32-bit registers of one SM (the whole file a launch can share)
MAX_THREADS_PER_CTA = 1024
H200_SMS = 132  # SMs of an H200 (and of an H100 SXM): the schedules' default machine
WARPGROUP_WARPS = 4  # warps of one warpgroup, the unit of a WGMMA
WGMMA_M = 64  # rows of one WGMMA (its M)
PORTABLE_CLUSTER = 8  # CTAs of one thread-block cluster that every launch may ask for
MAX_CLUSTER = 16  # CTAs of one thread-block cluster with the non-portable size allowed (SM90)
MAX_GRID_Y = 65535  # the largest grid extent in y (and z)


def smem_fits(smem_bytes: int, ctas_per_sm: int) -> bool:
    """Whether ``ctas_per_sm`` CTAs of ``smem_bytes`` of shared memory each fit one SM."""
    return smem_bytes <= MAX_SMEM_PER_CTA and ctas_per_sm * (smem_bytes + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM


# Per compile target: shared memory of one SM, from the CUDA programming guide's
# compute-capability table (8.0: 164 KB; 8.6, 8.9, 12.x: 100 KB; 9.0, 10.x: 228 KB). Every one
# of them reserves SMEM_RESERVED_PER_CTA per resident CTA, so one CTA may allocate the capacity
# less 1 KB (cudaDevAttrMaxSharedMemoryPerBlockOptin: 163, 99, 227 KB).
SMEM_PER_SM_OF = {
    "sm_80": 164 * 1024, "sm_86": 100 * 1024, "sm_89": 100 * 1024, "sm_90a": SMEM_PER_SM, "sm_100a": SMEM_PER_SM,
    "sm_103a": SMEM_PER_SM, "sm_120a": 100 * 1024, "sm_121a": 100 * 1024,
}
# the e4m3 <-> f16x2 conversion instructions (cvt ... e4m3x2) exist from SM89 on; SM80/86 have none
FP8_CVT_TARGETS = tuple(t for t in ALL_TARGETS if t not in ("sm_80", "sm_86"))
# programmatic dependent launch (griddepcontrol) exists from SM90 on
PDL_TARGETS = tuple(t for t in ALL_TARGETS if t not in ("sm_80", "sm_86", "sm_89"))
# mbarrier.try_wait (a wait that may suspend the thread) exists from SM90 on; before, test_wait polls
MBARRIER_TRY_WAIT_TARGETS = tuple(t for t in ALL_TARGETS if t not in ("sm_80", "sm_86", "sm_89"))


def max_smem_per_cta(target: str) -> int:
    """The most shared memory one CTA may allocate on ``target`` (the opt-in limit)."""
    return SMEM_PER_SM_OF[target] - SMEM_RESERVED_PER_CTA
