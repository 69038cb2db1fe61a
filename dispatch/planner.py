"""``plan()``: choose the kernel and the query dtype for one attention call site.

A plan is a pure function of its arguments and of the kernel registry
(:mod:`cute_kernels.registry`, read at call time). There is no global state here on purpose:
vLLM chose the query dtype from the *global* KV-cache dtype and with no arch gate, which gave an
FP8 query to bf16 skip-layer groups and to SM89 (anchors §3.1-3.2). Here the caller plans each
KV-cache group separately, and the query is FP8 only when the chosen kernel computes Q·Kᵀ in FP8
for that group's cache, so a bf16 group or an arch without such a kernel can never get one.

Explicit ``backend=`` requests are honoured or refused with the violated constraint, never
silently replaced (a selector that accepts what the kernel later rejects is vllm#48848).
Design: docs/design/dispatch.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from cute_kernels.plans import selfcheck_records
from cute_kernels.registry import FALLBACKS, KERNELS, KV_LAYOUTS, PHASES, KernelInfo

from .arch import ArchLike, parse_arch
from .capabilities import choice_note, kernels_for, opt_in_kernels
from .dtypes import FP8_TWO_TERMS, DTypeLike, kv_dtype_name, model_dtype_name, query_dtype_name, torch_dtype
from .errors import UnsupportedConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class _Request:
    """The normalized inputs of one call site (see :func:`_request`)."""

    arch: str
    phase: str
    kv_cache_dtype: str
    model_dtype: str
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    page_size: int
    q_len: int
    kv_layout: str

    @property
    def gqa_ratio(self) -> int:
        return self.num_q_heads // self.num_kv_heads


class Decision:
    """What :class:`Plan` and :class:`dispatch.qsa.QsaPlan` share: a kernel id and its dict form."""

    if TYPE_CHECKING:  # provided by the dataclasses that derive it
        kernel: str
        __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def is_fallback(self) -> bool:
        return self.kernel.startswith("reference.")

    def to_dict(self) -> dict:
        return {**asdict(self), "is_fallback": self.is_fallback}


@dataclass(frozen=True)
class Plan(Decision, _Request):
    """The decision for one (arch, phase, KV group): which kernel, and what query it takes.

    ``q_dtype`` is the dtype of the query the kernel receives; ``quantize_query`` says the layer
    must quantize the model-dtype query to FP8 (with ``q_scale``) before the call, and
    ``applies_q_scale`` that ``q_scale`` enters the logits. A model-dtype query never has
    ``q_scale`` applied. The remaining fields are the normalized inputs.
    """

    kernel: str
    q_dtype: str
    quantize_query: bool
    applies_q_scale: bool
    reason: str
    backend: str | None = None

    def torch_q_dtype(self) -> torch.dtype:
        """``q_dtype`` as a torch dtype (imports torch; planning itself never does)."""
        return torch_dtype(self.q_dtype)


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedConfig(f"{name} must be a positive int (>= 1), got {value!r}")
    return value


def _request(arch, phase, kv_cache_dtype, model_dtype, head_dim, num_q_heads, num_kv_heads, page_size,
             q_len, kv_layout) -> _Request:
    """Validate and normalize every argument, naming the one at fault."""
    arch_name = parse_arch(arch).name
    if phase not in PHASES:
        raise UnsupportedConfig(f"phase must be 'prefill' or 'decode', got {phase!r}")
    model = model_dtype_name(model_dtype)
    kv = kv_dtype_name(kv_cache_dtype, model)
    head_dim = positive_int("head_dim", head_dim)
    num_q_heads = positive_int("num_q_heads", num_q_heads)
    num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
    if num_q_heads % num_kv_heads:
        raise UnsupportedConfig(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    page_size = positive_int("page_size", page_size)
    q_len = positive_int("q_len", q_len)
    layout = kv_layout.upper() if isinstance(kv_layout, str) else kv_layout
    if layout not in KV_LAYOUTS:
        raise UnsupportedConfig(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    return _Request(arch_name, phase, kv, model, head_dim, num_q_heads, num_kv_heads, page_size, q_len,
                    layout)


def _slash(values) -> str:
    return "/".join(str(v) for v in values)


def target_mismatch(k: KernelInfo, arch: str, phase: str | None) -> str | None:
    """Why ``k`` does not exist for this arch/phase at all, or None."""
    if arch not in k.archs:
        return f"{k.id} runs on {_slash(k.archs)}, not {arch}"
    if phase is not None and phase not in k.phases:
        return f"{k.id} is a {_slash(k.phases)} kernel, not {phase}"
    return None


def unmet_limits(k: KernelInfo, *, kv: str, model: str, head_dim: int, hq: int, hkv: int, page_size=None,
                 q_len=None, kv_layout=None) -> list[str]:
    """The limits of ``k`` a request misses, each as ``"<what it needs> (got <value>)"``
    (empty = it accepts the request). ``page_size``, ``q_len``, ``kv_layout`` None: not asked."""
    out = []
    if kv not in k.kv_dtypes:
        out.append(f"kv_cache_dtype {_slash(k.kv_dtypes)} (got {kv})")
    if model not in k.model_dtypes:
        out.append(f"model_dtype {_slash(k.model_dtypes)} (got {model})")
    elif kv in k.kv_dtypes and not k.takes_dtypes(model, kv):
        # A tensor-core kernel multiplies Q and K in one 16-bit type; only FP8 K is converted on chip
        # (and, by the kernels that list the pair, an fp16 cache against a bf16 query).
        out.append(f"an FP8 cache or one of the model dtype {model} (got {kv})")
    if k.head_dims is not None and head_dim not in k.head_dims:
        out.append(f"head_dim {_slash(k.head_dims)} (got {head_dim})")
    group = hq // hkv
    if k.max_gqa_ratio is not None and group > k.max_gqa_ratio:
        out.append(f"GQA ratio (num_q_heads / num_kv_heads) up to {k.max_gqa_ratio} (got {group})")
    if page_size is not None and k.page_sizes is not None and page_size not in k.page_sizes:
        out.append(f"page_size {_slash(k.page_sizes)} (got {page_size})")
    if q_len is not None:
        if k.max_q_len is not None and q_len > k.max_q_len:
            out.append(f"q_len up to {k.max_q_len} (got {q_len})")
        if k.max_rows is not None and group * q_len > k.max_rows:
            out.append(f"GQA ratio x q_len up to {k.max_rows} (got {group} x {q_len})")
    if kv_layout is not None and kv_layout not in k.kv_layouts:
        out.append(f"kv_layout {_slash(k.kv_layouts)} (got {kv_layout})")
    return out


def refusal(k: KernelInfo, unmet: list[str]) -> str | None:
    """One clause saying why ``k`` cannot serve a request (None = it can): ``"sm100.decode is not
    built yet"``, ``"sm90.decode needs head_dim 64/128/256 (got 96) and page_size ... (got 8)"``."""
    needs = f"needs {', '.join(unmet[:-1])} and {unmet[-1]}" if len(unmet) > 1 else (
        f"needs {unmet[0]}" if unmet else "")
    if k.status == "planned":
        return f"{k.id} is not built yet" + (f" and {needs}" if needs else "")
    return f"{k.id} {needs}" if needs else None


def _family(k: KernelInfo, req: _Request) -> str:
    """The self-check family ``k`` runs for ``req`` (the query dtype follows from the cache; the
    registry entry names the family: ``KernelInfo.family``)."""
    q = "fp8_e4m3" if k.computes_qk_in_fp8(req.kv_cache_dtype) else req.model_dtype
    assert k.family is not None, f"{k.id} names no self-check family"  # only compile-verified kernels get here
    return k.family(q, req.kv_cache_dtype, req.head_dim)


def _runtime_refusal(k: KernelInfo, req: _Request) -> str | None:
    """Why a compile-verified kernel whose limits accept ``req`` still cannot run it here: its op
    is not in this build yet, or its MMA family failed its runtime self-check on this machine."""
    if k.status != "compile-verified":
        return None
    if k.op is None:
        return f"{k.id} has no op in this build"
    rec = selfcheck_records.lookup(_family(k, req))
    if rec is not None and not rec.ok:
        return f"{rec.family} failed its runtime self-check on this machine ({rec.reason})"
    return None


def _unmet(k: KernelInfo, req: _Request) -> list[str]:
    return unmet_limits(k, kv=req.kv_cache_dtype, model=req.model_dtype, head_dim=req.head_dim, hq=req.num_q_heads,
                        hkv=req.num_kv_heads, page_size=req.page_size, q_len=req.q_len, kv_layout=req.kv_layout)


def _make_plan(k: KernelInfo, req: _Request, why: str, backend: str | None) -> Plan:
    """Fix the query dtype from the chosen kernel and this group's cache dtype, nothing else. The
    reason is one sentence: why this kernel, what its GPU tests have not run on (a kernel verified
    on other hardware than the request's arch), and the query's quantization when there is one
    (the plan's ``q_dtype`` and ``applies_q_scale`` say the rest)."""
    fp8_query = k.computes_qk_in_fp8(req.kv_cache_dtype)
    note = k.unverified_on(req.arch)
    why = f"{why} ({note})" if note else why
    query = ", where QK runs in FP8: the layer quantizes the query with q_scale" if fp8_query else ""
    if k.status == "compile-verified":  # never run on this arch's hardware: say what the check found
        rec = selfcheck_records.lookup(_family(k, req))
        state = "its runtime self-check runs on first use" if rec is None else (
            f"it passed its runtime self-check on {rec.device}")
        query += f"; compile-verified only, {state}"
    return Plan(
        kernel=k.id,
        q_dtype="fp8_e4m3" if fp8_query else req.model_dtype,
        quantize_query=fp8_query and k.supports_quant_query_input,
        applies_q_scale=fp8_query,
        reason=f"{why}{query}.",
        backend=backend,
        **asdict(req),
    )


def _joined(refusals: list[tuple[str, str]]) -> list[str]:
    """``(kernel id, refusal)`` pairs -> clauses; kernels refused for the same reason share one
    (``"sm90.decode and sm80.decode need head_dim 64/128/256 (got 96)"``)."""
    groups: dict[str, list[str]] = {}
    for kid, why in refusals:
        groups.setdefault(why[len(kid):], []).append(kid)
    plural = {" needs ": " need ", " is not built yet": " are not built yet", " has no ": " have no "}
    out = []
    for tail, ids in groups.items():
        verb = next((v for v in plural if tail.startswith(v)), None)
        if len(ids) > 1 and verb is not None:
            out.append(" and ".join(ids) + plural[verb] + tail[len(verb):])
        else:
            out += [kid + tail for kid in ids]
    return out


def _auto(req: _Request) -> Plan:
    rejected: list[tuple[str, str]] = []
    for kid in kernels_for(req.arch, req.phase):
        k = KERNELS[kid]
        if k.is_fallback:
            reason = "; ".join(_joined(rejected)) if rejected else f"no CuTe kernel targets {req.arch} {req.phase}"
            return _make_plan(k, req, f"reference fallback: {reason}", None)
        why = refusal(k, _unmet(k, req)) or _runtime_refusal(k, req)
        if why is None:
            # why this kernel over an alternative that could serve it too (the first one tried only)
            note = "" if rejected else choice_note(req.arch, req.phase, req.kv_cache_dtype)
            accepts = f"{k.id} accepts this request" + (f" ({note})" if note else "")
            return _make_plan(k, req, "; ".join(_joined(rejected) + [accepts]), None)
        rejected.append((k.id, why))
    raise AssertionError(f"capability list of {req.arch} {req.phase} has no fallback")  # pragma: no cover


def _explicit(req: _Request, backend: str) -> Plan:
    kid = FALLBACKS[req.phase] if backend == "reference" else backend
    k = KERNELS.get(kid)
    if k is None or k.call_site != "attention":
        ids = ", ".join(i for i, v in KERNELS.items() if v.call_site == "attention")
        raise UnsupportedConfig(f"backend={backend!r} is not an attention kernel id; expected 'reference' or one of {ids}")
    why = target_mismatch(k, req.arch, req.phase) or refusal(k, _unmet(k, req)) or _runtime_refusal(k, req)
    if why:
        raise UnsupportedConfig(f"backend={backend!r} cannot serve this request: {why}")
    label = "the reference fallback" if k.is_fallback else k.id
    return _make_plan(k, req, f"{label} requested with backend={backend!r}", backend)


def _fp8_query(req: _Request, backend: str | None, terms: int = 1) -> Plan:
    """``query_dtype="fp8"`` (``terms`` 1) or ``"fp8x2"`` (2: the query's e4m3 codes and their
    residual): the first kernel of the (arch, phase) row, then of its opt-in kernels, that computes
    QK in FP8 for this cache on a query of that many terms and accepts the request (an opt-in
    FP8-query kernel such as ``sm90.prefill_fp8q`` included: asking for an FP8 query is the
    opt-in). Never a kernel that keeps the model-dtype query, never the reference: refused with
    each candidate's reason."""
    asked = "query_dtype='fp8'" if terms == 1 else "query_dtype='fp8x2'"
    if req.kv_cache_dtype != "fp8_e4m3":
        raise UnsupportedConfig(f"{asked} needs an FP8 KV cache (QK runs in FP8 only against FP8 K), "
                                f"got kv_cache_dtype {req.kv_cache_dtype}")
    if backend is not None and backend != "auto":
        p = _explicit(req, backend)
        if p.q_dtype != "fp8_e4m3" or KERNELS[p.kernel].query_terms != terms:
            what = f"a {p.q_dtype} query" if p.q_dtype != "fp8_e4m3" else \
                f"an FP8 query of {KERNELS[p.kernel].query_terms} term(s)"
            raise UnsupportedConfig(f"{asked} asks for a kernel that computes QK in FP8 on a query of {terms} "
                                    f"term(s), but backend={backend!r} takes {what}")
        return p
    rejected: list[tuple[str, str]] = []
    for kid in kernels_for(req.arch, req.phase)[:-1] + opt_in_kernels(req.arch, req.phase):
        k = KERNELS[kid]
        if not k.computes_qk_in_fp8(req.kv_cache_dtype) or k.query_terms != terms:
            continue
        why = refusal(k, _unmet(k, req)) or _runtime_refusal(k, req)
        if why is None:
            how = "an opt-in kernel; " if k.opt_in else ""
            accepts = f"{k.id} accepts this request ({how}an FP8 query requested with {asked})"
            return _make_plan(k, req, "; ".join(_joined(rejected) + [accepts]), None)
        rejected.append((k.id, why))
    why = "; ".join(_joined(rejected)) if rejected else \
        f"no {req.phase} kernel computes QK in FP8 on {req.arch}" + (" with a two-term query" if terms == 2 else "")
    raise UnsupportedConfig(f"{asked} cannot be served on {req.arch} {req.phase}: {why}")


def plan(
    *,
    arch: ArchLike,
    phase: str,
    kv_cache_dtype: DTypeLike,
    model_dtype: DTypeLike,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    q_len: int = 1,
    kv_layout: str = "HND",
    backend: str | None = None,
    query_dtype: DTypeLike = "auto",
) -> Plan:
    """Plan one attention call for one KV-cache group.

    Args:
        arch: target arch in any spelling :func:`dispatch.parse_arch` accepts.
        phase: ``"prefill"`` or ``"decode"``.
        kv_cache_dtype: this group's cache dtype: a torch dtype (bfloat16, float16,
            float8_e4m3fn) or ``"auto"`` (= model dtype), ``"bf16"``, ``"fp16"``, ``"fp8"``...
            ``torch.uint8`` is refused: view the cache as float8_e4m3fn.
        model_dtype: bf16 or fp16 (torch dtype or name); the dtype of the unquantized query.
        head_dim, num_q_heads, num_kv_heads, page_size: the group's shape.
        q_len: query tokens per request (> 1 for speculative decode or prefill chunks).
        kv_layout: ``"HND"`` or ``"NHD"``.
        backend: None/``"auto"`` for automatic choice, a kernel id to force one, or
            ``"reference"`` for the phase's reference fallback.
        query_dtype: ``"auto"`` (the query dtype the chosen kernel takes) or ``"fp8"``: a kernel
            that computes QK in FP8 on a query quantized with ``q_scale``, opt-in kernels included
            (``sm90.prefill_fp8q``); only for an FP8 cache, refused where no such kernel accepts
            the request (never served by a model-dtype-query kernel or the reference instead).
            ``"fp8x2"``: the same with a two-term query (codes and residual, ``sm90.prefill_fp8x2``).

    Raises:
        UnsupportedConfig: a bad argument, an explicit backend that cannot serve the request, or
            ``query_dtype="fp8"`` where no FP8-QK kernel serves it.
    """
    req = _request(arch, phase, kv_cache_dtype, model_dtype, head_dim, num_q_heads, num_kv_heads, page_size,
                   q_len, kv_layout)
    query = query_dtype_name(query_dtype)
    if query in ("fp8_e4m3", FP8_TWO_TERMS):
        if backend is not None and not isinstance(backend, str):
            raise UnsupportedConfig(f"backend must be a kernel id string or None, got {backend!r}")
        return _fp8_query(req, backend, 2 if query == FP8_TWO_TERMS else 1)
    if backend is None or backend == "auto":
        return _auto(req)
    if not isinstance(backend, str):
        raise UnsupportedConfig(f"backend must be a kernel id string or None, got {backend!r}")
    return _explicit(req, backend)
