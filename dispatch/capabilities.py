"""Per-arch capability table: which kernels each (arch, phase) tries, in order.

The planner walks a row's list and takes the first available kernel whose limits accept the
request; the reference fallback closes every list, so every (arch, phase, KV dtype) has a plan.
Opt-in kernels (``sm90.decode_fp8q``) are deliberately absent from these lists: they change
numerics (FP8 query) and are used only when named with ``backend=``.

An arch without an FP8-QK kernel in its list never gets an FP8 query; that is why SM80/86/89 and
SM120/121 are pure fallback rows today (vLLM's L4 crash, anchors §3.2, was an FP8 query planned
on SM89 from a global setting).
"""

from __future__ import annotations

from .arch import SUPPORTED_ARCHS, parse_arch
from .errors import UnsupportedConfig
from .kernels import FALLBACKS, KERNELS, PHASES

# SM90 prefill with an FP8 cache: the exact BF16-query kernel (FP8 K/V widened on chip) or the
# FP8-query kernel (e4m3 QK and PV; the layer quantizes the prefill rows with q_scale). One
# constant decides; the other kernel stays selectable with backend=.
SM90_FP8_PREFILL = "sm90.prefill"
SM90_FP8_PREFILL_REASON = (
    "for an FP8 cache SM90 prefill keeps the exact BF16-query kernel (error of the FP8 widening only) until the "
    "H200 measures the FP8-query kernel's speed and error against it; sm90.prefill_fp8q is selectable with backend="
)

# (arch, phase) -> kernel ids tried automatically, real kernels first. The fallback is appended.
_AUTO = {
    ("sm90", "decode"): ("sm90.decode",),
    ("sm100", "decode"): ("sm100.decode",),
    ("sm100", "prefill"): ("sm100.prefill",),
    ("sm103", "decode"): ("sm100.decode",),
    ("sm103", "prefill"): ("sm100.prefill",),
}

ARCH_SUMMARY = {
    "sm80": "Ampere: no FP8 tensor cores; no CuTe attention kernel, reference fallback; "
            "model-dtype query always.",
    "sm86": "Ampere (consumer): as SM80; reference fallback; model-dtype query always.",
    "sm89": "Ada: FP8 tensor cores but no FP8 attention kernel here (vLLM's L4 crash was an FP8 "
            "query on SM89); reference fallback; model-dtype query always.",
    "sm90": "Hopper: sm90.decode and sm90.prefill read FP8 KV and convert it on chip, so the query "
            "stays in the model dtype and q_scale is unused; FP8-query decode (sm90.decode_fp8q, "
            "planned) and prefill (sm90.prefill_fp8q) are chosen only with backend= (prefill: "
            "SM90_FP8_PREFILL decides by measurement).",
    "sm100": "Blackwell: tcgen05 TRT-LLM-style decode and prefill (planned) compute QK in FP8 "
             "for an FP8 cache, where the layer quantizes the query with q_scale; reference "
             "fallback until they land.",
    "sm103": "Blackwell Ultra: same kernels and rules as SM100.",
    "sm120": "Blackwell (consumer): no tcgen05 and no FP8 attention kernel; reference fallback; "
             "model-dtype query always.",
    "sm121": "Blackwell (GB10): as SM120; no tcgen05; reference fallback; model-dtype query always.",
}


def _auto(name: str, phase: str) -> tuple[str, ...]:
    if (name, phase) == ("sm90", "prefill"):  # read at call time: tests and measurements flip it
        # the FP8-query kernel accepts FP8 caches only, so listed first it takes exactly those
        return ("sm90.prefill_fp8q", "sm90.prefill") if SM90_FP8_PREFILL == "sm90.prefill_fp8q" else ("sm90.prefill",)
    return _AUTO.get((name, phase), ())


def kernels_for(arch, phase: str) -> tuple[str, ...]:
    """Kernel ids tried automatically for ``(arch, phase)``, the reference fallback last."""
    name = parse_arch(arch).name
    if phase not in PHASES:
        raise UnsupportedConfig(f"phase must be one of {PHASES}, got {phase!r}")
    return _auto(name, phase) + (FALLBACKS[phase],)


def choice_note(arch: str, phase: str, kv_cache_dtype: str) -> str:
    """Why the automatic plan of ``(arch, phase, cache dtype)`` takes its kernel over an
    alternative that could serve it too ("" when there is no such choice)."""
    if (arch, phase, kv_cache_dtype) == ("sm90", "prefill", "fp8_e4m3"):
        return SM90_FP8_PREFILL_REASON
    return ""


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
