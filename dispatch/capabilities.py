"""Per-arch capability table: which kernels each (arch, phase) tries, in order.

A row's list is read from the kernel registry: the attention kernels registered for that arch and
phase, in registration order, then the reference fallback, so every (arch, phase, KV dtype) has
a plan. The planner takes the first available kernel whose limits accept the request. Opt-in
kernels (``sm90.decode_fp8q``) are deliberately absent from these lists: they change numerics
(FP8 query) and are used only when named with ``backend=``.

An arch without an FP8-QK kernel in its list never gets an FP8 query: SM80/86/89 and SM120/121 run
the portable ``sm80.*`` kernels, which widen FP8 K/V on chip and keep the model-dtype query
(vLLM's L4 crash, anchors §3.2, was an FP8 query planned on SM89 from a global setting). The
portable kernels, registered after the arch-specific ones, also close the SM90 and SM100/103 lists.
"""

from __future__ import annotations

from cute_kernels.plans import sm90_prefill
from cute_kernels.registry import FALLBACKS, KERNELS, PHASES

from .arch import SUPPORTED_ARCHS, parse_arch
from .errors import UnsupportedConfig

# one sentence per arch, printed under the ``cute-kernels matrix`` table
ARCH_SUMMARY = {
    "sm80": "Ampere: the portable sm80.* kernels (warp MMA, cp.async; FP8 K/V widened by bit operations, "
            "163 KB of shared memory), a model-dtype query.",
    "sm86": "Ampere (consumer): as SM80 with 99 KB of shared memory.",
    "sm89": "Ada: the portable sm80.* kernels, FP8 K/V widened by the cvt instruction, a model-dtype query.",
    "sm90": "Hopper: sm90.decode and sm90.prefill widen FP8 K/V on chip, so the query stays in the model "
            "dtype (sm90.decode_fp8q and sm90.prefill_fp8q are opt-in); sm80.* serve what they refuse.",
    "sm100": "Blackwell: the tcgen05 kernels (compile-verified: a runtime self-check before first use) compute QK "
             "in FP8 for an FP8 cache, with a query the layer quantizes; sm80.* serve what they refuse.",
    "sm103": "Blackwell Ultra: as SM100.",
    "sm120": "Blackwell (consumer): no tcgen05 kernel; the portable sm80.* kernels (cvt widening, 99 KB), a "
             "model-dtype query.",
    "sm121": "Blackwell (GB10): as SM120.",
}


def kernels_for(arch, phase: str) -> tuple[str, ...]:
    """Kernel ids tried automatically for ``(arch, phase)``, the reference fallback last."""
    name = parse_arch(arch).name
    if phase not in PHASES:
        raise UnsupportedConfig(f"phase must be one of {PHASES}, got {phase!r}")
    auto = tuple(k.id for k in KERNELS.values() if k.call_site == "attention" and not k.is_fallback
                 and not k.opt_in and name in k.archs and phase in k.phases)
    return auto + (FALLBACKS[phase],)


def choice_note(arch: str, phase: str, kv_cache_dtype: str) -> str:
    """Why the automatic plan of ``(arch, phase, cache dtype)`` takes its kernel over an
    alternative that could serve it too ("" when there is no such choice)."""
    if (arch, phase, kv_cache_dtype) == ("sm90", "prefill", "fp8_e4m3"):
        return sm90_prefill.FP8_CACHE_REASON
    return ""


def opt_in_kernels(arch, phase: str) -> tuple[str, ...]:
    """Registered non-fallback kernels for ``(arch, phase)`` that are only used via ``backend=``."""
    name = parse_arch(arch).name
    return tuple(k.id for k in KERNELS.values()
                 if k.call_site == "attention" and k.opt_in and name in k.archs and phase in k.phases)


def capability_table() -> list[dict]:
    """One row per (arch, phase): the ordered kernel ids with their current status.

    Rows are plain dicts (``arch``, ``phase``, ``kernels`` as ``[{"id", "status"}]``, ``opt_in``,
    ``summary``) so the CLI can print or JSON-dump them without knowing the dataclasses.
    """
    rows = []
    for arch in SUPPORTED_ARCHS:
        for phase in PHASES:
            rows.append({
                "arch": arch,
                "phase": phase,
                "kernels": [{"id": k, "status": KERNELS[k].status} for k in kernels_for(arch, phase)],
                "opt_in": [{"id": k, "status": KERNELS[k].status} for k in opt_in_kernels(arch, phase)],
                "summary": ARCH_SUMMARY[arch],
            })
    return rows
