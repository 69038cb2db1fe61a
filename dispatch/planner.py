"""``plan()``: choose the kernel and the query dtype for one attention call site.

A plan is a pure function of its arguments. There is no global state here on purpose: vLLM chose
the query dtype from the *global* KV-cache dtype and with no arch gate, which gave an FP8 query to
bf16 skip-layer groups and to SM89 (anchors §3.1-3.2). Here the caller plans each KV-cache group
separately, and the query is FP8 only when the chosen kernel computes Q·Kᵀ in FP8 for that
group's cache, so a bf16 group or an arch without such a kernel can never get one.

Explicit ``backend=`` requests are honoured or refused with the violated constraint, never
silently replaced (a selector that accepts what the kernel later rejects is vllm#48848).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .arch import ArchLike, parse_arch
from .capabilities import kernels_for
from .dtypes import DTypeLike, kv_dtype_name, model_dtype_name, torch_dtype
from .errors import UnsupportedConfig
from .kernels import FALLBACKS, KERNELS, KV_LAYOUTS, PHASES, KernelInfo

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


def _positive_int(name: str, value) -> int:
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
    head_dim = _positive_int("head_dim", head_dim)
    num_q_heads = _positive_int("num_q_heads", num_q_heads)
    num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
    if num_q_heads % num_kv_heads:
        raise UnsupportedConfig(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    page_size = _positive_int("page_size", page_size)
    q_len = _positive_int("q_len", q_len)
    layout = kv_layout.upper() if isinstance(kv_layout, str) else kv_layout
    if layout not in KV_LAYOUTS:
        raise UnsupportedConfig(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    return _Request(arch_name, phase, kv, model, head_dim, num_q_heads, num_kv_heads, page_size, q_len,
                    layout)


def _slash(values) -> str:
    return "/".join(str(v) for v in values)


def _target_mismatch(k: KernelInfo, req: _Request) -> str | None:
    """Why ``k`` does not exist for this arch/phase at all, or None."""
    if req.arch not in k.archs:
        return f"{k.id} runs on {_slash(k.archs)}, not {req.arch}"
    if req.phase not in k.phases:
        return f"{k.id} is a {_slash(k.phases)} kernel, not {req.phase}"
    return None


def _violations(k: KernelInfo, req: _Request) -> list[str]:
    """Every reason ``k`` cannot serve ``req`` on its own arch/phase (empty = it can)."""
    out = []
    if k.status == "planned":
        out.append(f"{k.id} is planned ({k.planned_in}), not built yet")
    if req.kv_cache_dtype not in k.kv_dtypes:
        out.append(f"{k.id} supports kv_cache_dtype {_slash(k.kv_dtypes)}, got {req.kv_cache_dtype}")
    if req.model_dtype not in k.model_dtypes:
        out.append(f"{k.id} supports model_dtype {_slash(k.model_dtypes)}, got {req.model_dtype}")
    elif not k.is_fallback and req.kv_cache_dtype not in ("fp8_e4m3", req.model_dtype):
        # A tensor-core kernel multiplies Q and K in one 16-bit type; only FP8 K is converted on chip.
        out.append(f"{k.id} needs a 16-bit kv_cache_dtype equal to model_dtype {req.model_dtype}, "
                   f"got {req.kv_cache_dtype}")
    if k.head_dims is not None and req.head_dim not in k.head_dims:
        out.append(f"{k.id} supports head_dim {_slash(k.head_dims)}, got {req.head_dim}")
    if k.max_gqa_ratio is not None and req.gqa_ratio > k.max_gqa_ratio:
        out.append(f"{k.id} supports GQA ratio (num_q_heads / num_kv_heads) up to {k.max_gqa_ratio}, "
                   f"got {req.gqa_ratio}")
    if k.page_sizes is not None and req.page_size not in k.page_sizes:
        out.append(f"{k.id} supports page_size {_slash(k.page_sizes)}, got {req.page_size}")
    if k.max_q_len is not None and req.q_len > k.max_q_len:
        out.append(f"{k.id} supports q_len up to {k.max_q_len}, got {req.q_len}")
    if req.kv_layout not in k.kv_layouts:
        out.append(f"{k.id} supports kv_layout {_slash(k.kv_layouts)}, got {req.kv_layout}")
    return out


def _make_plan(k: KernelInfo, req: _Request, why: str, backend: str | None) -> Plan:
    """Fix the query dtype from the chosen kernel and this group's cache dtype, nothing else."""
    fp8_query = k.computes_qk_in_fp8(req.kv_cache_dtype)
    if fp8_query:
        query = "it computes QK in FP8, so the layer quantizes the query to fp8_e4m3 and applies q_scale"
    else:
        m = req.model_dtype
        query = f"QK never sees an FP8 query, so the query stays {m} and q_scale is not applied"
    return Plan(
        kernel=k.id,
        q_dtype="fp8_e4m3" if fp8_query else req.model_dtype,
        quantize_query=fp8_query and k.supports_quant_query_input,
        applies_q_scale=fp8_query,
        reason=f"{why}; {query}.",
        backend=backend,
        **asdict(req),
    )


def _fallback_why(req: _Request, rejected: list[str]) -> str:
    if not rejected:
        return f"slow torch reference fallback: no CuTe kernel targets {req.arch} {req.phase}"
    return f"slow torch reference fallback: {'; '.join(rejected)}"


def _auto(req: _Request) -> Plan:
    rejected = []
    for kid in kernels_for(req.arch, req.phase):
        k = KERNELS[kid]
        if k.is_fallback:
            return _make_plan(k, req, _fallback_why(req, rejected), None)
        problems = _violations(k, req)
        if not problems:
            why = f"{k.id} accepts this {req.arch} {req.phase} request: {k.description}"
            return _make_plan(k, req, why, None)
        rejected.extend(problems)
    raise AssertionError(f"capability list of {req.arch} {req.phase} has no fallback")  # pragma: no cover


def _explicit(req: _Request, backend: str) -> Plan:
    kid = FALLBACKS[req.phase] if backend == "reference" else backend
    k = KERNELS.get(kid)
    if k is None:
        raise UnsupportedConfig(
            f"backend={backend!r} is not a registered kernel id; expected 'reference' or one of "
            f"{', '.join(KERNELS)}"
        )
    problems = [m] if (m := _target_mismatch(k, req)) else _violations(k, req)
    if problems:
        raise UnsupportedConfig(f"backend={backend!r} cannot serve this request: {'; '.join(problems)}")
    return _make_plan(k, req, f"backend={backend!r} requested: {k.id}, {k.description}", backend)


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

    Raises:
        UnsupportedConfig: a bad argument, or an explicit backend that cannot serve the request.
    """
    req = _request(arch, phase, kv_cache_dtype, model_dtype, head_dim, num_q_heads, num_kv_heads, page_size,
                   q_len, kv_layout)
    if backend is None or backend == "auto":
        return _auto(req)
    if not isinstance(backend, str):
        raise UnsupportedConfig(f"backend must be a kernel id string or None, got {backend!r}")
    return _explicit(req, backend)
