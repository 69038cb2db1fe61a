"""``plan_qsa()``: which kernel serves a QSA sparse-attention layer (issue 4), per arch.

QSA is its own call site, not a phase of paged attention: every query row attends to the tokens
its indexer selected (``cute_kernels.qsa_sparse_attention``), and one op serves prefill and
decode batches alike (its ``prefill`` flag only picks a tuning profile). So it has its own
capability listing (:func:`qsa_capability_table`) and never appears in :func:`dispatch.plan`'s
per-phase lists. The query is never FP8 here: the SM90 kernel converts FP8 K/V on chip and runs
QK in the model dtype, so ``q_scale`` never applies.

Pure Python like the rest of ``dispatch`` (no torch, no DSL).
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import SUPPORTED_ARCHS, ArchLike, parse_arch
from .dtypes import DTypeLike, kv_dtype_name, model_dtype_name
from .errors import UnsupportedConfig
from .kernels import QSA_FALLBACK, QSA_KERNELS, KernelInfo
from .planner import Decision

# arch -> QSA kernel ids tried automatically, real kernels first; the fallback closes every list
_QSA_AUTO = {"sm90": ("sm90.qsa",)}


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
    return _QSA_AUTO.get(parse_arch(arch).name, ()) + (QSA_FALLBACK,)


def qsa_capability_table() -> list[dict]:
    """One row per arch: ``{"arch", "kernels": [{"id", "status"}]}`` (what ``plan_qsa`` tries)."""
    return [
        {"arch": arch, "kernels": [{"id": k, "status": QSA_KERNELS[k].status} for k in qsa_kernels_for(arch)]}
        for arch in SUPPORTED_ARCHS
    ]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedConfig(f"{name} must be a positive int (>= 1), got {value!r}")
    return value


def _violations(k: KernelInfo, arch: str, kv: str, model: str, head_dim: int, hq: int, hkv: int) -> list[str]:
    out = []
    if arch not in k.archs:
        return [f"{k.id} runs on {'/'.join(k.archs)}, not {arch}"]
    if k.status == "planned":
        out.append(f"{k.id} is planned ({k.planned_in}), not built yet")
    if kv not in k.kv_dtypes:
        out.append(f"{k.id} supports kv_cache_dtype {'/'.join(k.kv_dtypes)}, got {kv}")
    if model not in k.model_dtypes:
        out.append(f"{k.id} supports model_dtype {'/'.join(k.model_dtypes)}, got {model}")
    elif not k.is_fallback and kv not in ("fp8_e4m3", model):
        out.append(f"{k.id} needs a 16-bit kv_cache_dtype equal to model_dtype {model}, got {kv}")
    if k.head_dims is not None and head_dim not in k.head_dims:
        out.append(f"{k.id} supports head_dim {'/'.join(map(str, k.head_dims))}, got {head_dim}")
    if k.max_gqa_ratio is not None and hq // hkv > k.max_gqa_ratio:
        out.append(f"{k.id} supports GQA ratio (num_q_heads / num_kv_heads) up to {k.max_gqa_ratio}, "
                   f"got {hq // hkv}")
    return out


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
    head_dim = _positive_int("head_dim", head_dim)
    hq = _positive_int("num_q_heads", num_q_heads)
    hkv = _positive_int("num_kv_heads", num_kv_heads)
    if hq % hkv:
        raise UnsupportedConfig(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    fields = dict(q_dtype=model, arch=arch_name, kv_cache_dtype=kv, model_dtype=model, head_dim=head_dim,
                  num_q_heads=hq, num_kv_heads=hkv)
    if backend is not None and backend != "auto":
        if not isinstance(backend, str):
            raise UnsupportedConfig(f"backend must be a kernel id string or None, got {backend!r}")
        kid = QSA_FALLBACK if backend == "reference" else backend
        k = QSA_KERNELS.get(kid)
        if k is None:
            raise UnsupportedConfig(f"backend={backend!r} is not a QSA kernel id; expected 'reference' or one of "
                                    f"{', '.join(QSA_KERNELS)}")
        problems = _violations(k, arch_name, kv, model, head_dim, hq, hkv)
        if problems:
            raise UnsupportedConfig(f"backend={backend!r} cannot serve this QSA layer: {'; '.join(problems)}")
        return QsaPlan(kernel=kid, reason=f"backend={backend!r} requested: {k.id}, {k.description}.",
                       backend=backend, **fields)
    rejected: list[str] = []
    for kid in qsa_kernels_for(arch_name):
        k = QSA_KERNELS[kid]
        if k.is_fallback:
            why = "; ".join(rejected) if rejected else f"no CuTe QSA kernel targets {arch_name}"
            return QsaPlan(kernel=kid, reason=f"slow torch reference fallback: {why}.", **fields)
        problems = _violations(k, arch_name, kv, model, head_dim, hq, hkv)
        if not problems:
            return QsaPlan(kernel=kid, reason=f"{kid} accepts this {arch_name} QSA layer: {k.description}; "
                                              f"the query stays {model}.", **fields)
        rejected.extend(problems)
    raise AssertionError("QSA capability list has no fallback")  # pragma: no cover
