"""Per-arch capability table: which kernels each (arch, phase) tries, in order.

The planner walks a row's list and takes the first available kernel whose limits accept the
request; the reference fallback closes every list, so every (arch, phase, KV dtype) has a plan.
Opt-in kernels (``sm90.decode_fp8q``) are deliberately absent from these lists: they change
numerics (FP8 query) and are used only when named with ``backend=``.

An arch without an FP8-QK kernel in its list never gets an FP8 query: SM80/86/89 and SM120/121
run the portable ``sm80.*`` kernels, which widen FP8 K/V on chip and keep the model-dtype query
(vLLM's L4 crash, anchors §3.2, was an FP8 query planned on SM89 from a global setting). The
portable kernels also close the SM90 and SM100/103 lists, for what the arch's own kernels refuse.
"""

from __future__ import annotations

from .arch import SUPPORTED_ARCHS, parse_arch
from .errors import UnsupportedConfig
from .kernels import FALLBACKS, KERNELS, PHASES

# (arch, phase) -> kernel ids tried automatically, real kernels first. The fallback is appended.
_PORTABLE = {"decode": ("sm80.decode",), "prefill": ("sm80.prefill",)}
_AUTO = {
    **{(arch, phase): ids for arch in ("sm80", "sm86", "sm89", "sm120", "sm121") for phase, ids in _PORTABLE.items()},
    ("sm90", "decode"): ("sm90.decode",) + _PORTABLE["decode"],
    ("sm90", "prefill"): _PORTABLE["prefill"],
    ("sm100", "decode"): ("sm100.decode",) + _PORTABLE["decode"],
    ("sm100", "prefill"): ("sm100.prefill",) + _PORTABLE["prefill"],
    ("sm103", "decode"): ("sm100.decode",) + _PORTABLE["decode"],
    ("sm103", "prefill"): ("sm100.prefill",) + _PORTABLE["prefill"],
}

ARCH_SUMMARY = {
    "sm80": "Ampere: no FP8 tensor cores; portable sm80.decode / sm80.prefill (warp MMA, cp.async; "
            "FP8 K/V widened by bit operations, 163 KB shared memory); model-dtype query always.",
    "sm86": "Ampere (consumer): as SM80 with 99 KB of shared memory per block; model-dtype query always.",
    "sm89": "Ada: portable sm80.* kernels, FP8 K/V widened by the cvt instruction (vLLM's L4 crash was "
            "an FP8 query on SM89: never here); 99 KB; model-dtype query always.",
    "sm90": "Hopper: sm90.decode (issue 3) reads FP8 KV and converts it on chip, so the query "
            "stays in the model dtype and q_scale is unused; FP8-query decode "
            "(sm90.decode_fp8q) is opt-in only; sm80.* serve what sm90.decode refuses and prefill.",
    "sm100": "Blackwell: tcgen05 TRT-LLM-style decode and prefill (planned) compute QK in FP8 "
             "for an FP8 cache, where the layer quantizes the query with q_scale; the portable "
             "sm80.* kernels until they land.",
    "sm103": "Blackwell Ultra: same kernels and rules as SM100.",
    "sm120": "Blackwell (consumer): no tcgen05; portable sm80.* kernels (cvt widening, 99 KB); "
             "model-dtype query always.",
    "sm121": "Blackwell (GB10): as SM120; no tcgen05; portable sm80.* kernels; model-dtype query always.",
}


def kernels_for(arch, phase: str) -> tuple[str, ...]:
    """Kernel ids tried automatically for ``(arch, phase)``, the reference fallback last."""
    name = parse_arch(arch).name
    if phase not in PHASES:
        raise UnsupportedConfig(f"phase must be one of {PHASES}, got {phase!r}")
    return _AUTO.get((name, phase), ()) + (FALLBACKS[phase],)


def opt_in_kernels(arch, phase: str) -> tuple[str, ...]:
    """Registered non-fallback kernels for ``(arch, phase)`` that are only used via ``backend=``."""
    name = parse_arch(arch).name
    auto = kernels_for(name, phase)
    return tuple(
        k.id for k in KERNELS.values()
        if name in k.archs and phase in k.phases and not k.is_fallback and k.id not in auto
    )


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
