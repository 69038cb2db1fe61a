"""``plan_qsa()``: which kernel serves a QSA sparse-attention layer, per arch.

QSA is its own call site, not a phase of paged attention: every query row attends to the tokens
its indexer selected (``cute_kernels.qsa_sparse_attention``), and one op serves prefill and
decode batches alike (its ``prefill`` flag only picks a tuning profile). So it has its own
capability listing (:func:`qsa_capability_table`, the registry's ``call_site="qsa"`` kernels) and
never appears in :func:`dispatch.plan`'s per-phase lists. The query is never FP8 here: the SM90
kernel converts FP8 K/V on chip and runs QK in the model dtype, so ``q_scale`` never applies.

Pure Python like the rest of ``dispatch`` (no torch, no DSL). Design: docs/design/dispatch.md#the-design-as-it-stands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cute_kernels.registry import KERNELS, QSA_FALLBACK

from .arch import SUPPORTED_ARCHS, ArchLike, parse_arch
from .dtypes import DTypeLike, kv_dtype_name, model_dtype_name
from .errors import UnsupportedConfig
from .planner import Decision, positive_int, refusal, target_mismatch, unmet_limits


@dataclass(frozen=True)
class QsaPlan(Decision):
    """The decision for one QSA layer: the kernel id and why; the remaining fields are the
    normalized inputs. ``q_dtype`` is always the model dtype (no query quantization)."""

    kernel: str
    q_dtype: str
    reason: str
    arch: str
    kv_cache_dtype: str
    model_dtype: str
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    backend: str | None = None

    @property
    def gqa_ratio(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def qsa_kernels_for(arch) -> tuple[str, ...]:
    """QSA kernel ids tried automatically on ``arch``, the reference fallback last."""
    name = parse_arch(arch).name
    auto = tuple(k.id for k in KERNELS.values()
                 if k.call_site == "qsa" and not k.is_fallback and not k.opt_in and name in k.archs)
    return auto + (QSA_FALLBACK,)


def qsa_capability_table() -> list[dict]:
    """One row per arch: ``{"arch", "kernels": [{"id", "status"}]}`` (what ``plan_qsa`` tries)."""
    return [
        {"arch": arch, "kernels": [{"id": k, "status": KERNELS[k].status} for k in qsa_kernels_for(arch)]}
        for arch in SUPPORTED_ARCHS
    ]


def plan_qsa(
    arch: ArchLike,
    kv_cache_dtype: DTypeLike,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    *,
    model_dtype: DTypeLike = "bf16",
    backend: str | None = None,
) -> QsaPlan:
    """Plan one QSA layer: ``"sm90.qsa"`` on SM90 when its limits accept the shape, otherwise
    the labelled fallback ``"reference.qsa_sparse_attention"`` with the reason.

    Args:
        arch: any spelling :func:`dispatch.parse_arch` accepts.
        kv_cache_dtype: torch dtype or name (``"auto"`` = model dtype, ``"fp8"``...).
        head_dim, num_q_heads, num_kv_heads: the layer's per-rank shape.
        model_dtype: bf16 or fp16 (the query's dtype).
        backend: None/``"auto"``, a QSA kernel id to force, or ``"reference"``.

    Raises:
        UnsupportedConfig: a bad argument, or an explicit backend that cannot serve the layer.
    """
    arch_name = parse_arch(arch).name
    model = model_dtype_name(model_dtype)
    kv = kv_dtype_name(kv_cache_dtype, model)
    head_dim = positive_int("head_dim", head_dim)
    hq = positive_int("num_q_heads", num_q_heads)
    hkv = positive_int("num_kv_heads", num_kv_heads)
    if hq % hkv:
        raise UnsupportedConfig(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    fields: dict[str, Any] = dict(q_dtype=model, arch=arch_name, kv_cache_dtype=kv, model_dtype=model, head_dim=head_dim,
                  num_q_heads=hq, num_kv_heads=hkv)

    def why_not(k):
        return refusal(k, unmet_limits(k, kv=kv, model=model, head_dim=head_dim, hq=hq, hkv=hkv))

    if backend is not None and backend != "auto":
        if not isinstance(backend, str):
            raise UnsupportedConfig(f"backend must be a kernel id string or None, got {backend!r}")
        kid = QSA_FALLBACK if backend == "reference" else backend
        k = KERNELS.get(kid)
        if k is None or k.call_site != "qsa":
            ids = ", ".join(i for i, v in KERNELS.items() if v.call_site == "qsa")
            raise UnsupportedConfig(f"backend={backend!r} is not a QSA kernel id; expected 'reference' or one of {ids}")
        why = target_mismatch(k, arch_name, None) or why_not(k)
        if why:
            raise UnsupportedConfig(f"backend={backend!r} cannot serve this QSA layer: {why}")
        label = "the reference fallback" if k.is_fallback else kid
        return QsaPlan(kernel=kid, reason=f"{label} requested with backend={backend!r}.", backend=backend, **fields)
    rejected: list[str] = []
    for kid in qsa_kernels_for(arch_name):
        k = KERNELS[kid]
        if k.is_fallback:
            why = "; ".join(rejected) if rejected else f"no CuTe QSA kernel targets {arch_name}"
            return QsaPlan(kernel=kid, reason=f"reference fallback: {why}.", **fields)
        why = why_not(k)
        if why is None:
            return QsaPlan(kernel=kid, reason=f"{kid} accepts this layer.", **fields)
        rejected.append(why)
    raise AssertionError("QSA capability list has no fallback")  # pragma: no cover
