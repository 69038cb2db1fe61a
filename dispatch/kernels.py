"""The kernel registry: every kernel id the dispatch layer can name, with its limits.

Kernel ids are the contract with the rest of the package (the attention layer maps an id to an
op; benchmarks and the CLI print them), so they never change meaning. A kernel is:

- ``"available"``: built and tested; chosen automatically when its limits accept a request;
- ``"planned"``: designed but not built; named in plans so the reason can say why it was not
  used, refused when asked for explicitly;
- ``"fallback"``: the slow torch reference (:mod:`cute_kernels.reference`), which serves every
  arch, dtype and shape so that every request has a plan.

``qk_dtype`` records the precision of Q·Kᵀ. ``"fp8_e4m3"`` means the kernel runs QK as an FP8
GEMM *when the KV cache is FP8* (with a 16-bit cache every kernel computes QK in the model dtype);
only then does the query become FP8 and ``q_scale`` apply. Such a kernel takes an already
quantized query (``supports_quant_query_input``): the layer quantizes Q with ``q_scale``, never the
kernel by a silent cast (XQA's in-kernel cast drops ``q_scale``, anchors §2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from cute_kernels.plans import sm90_prefill as _sm90_prefill

from .arch import SUPPORTED_ARCHS
from .dtypes import KV_DTYPES, MODEL_DTYPES

STATUSES = ("available", "planned", "fallback")
PHASES = ("prefill", "decode")
KV_LAYOUTS = ("HND", "NHD")


@dataclass(frozen=True)
class KernelInfo:
    """One registered kernel and the requests it accepts (None = no limit)."""

    id: str
    status: str
    archs: tuple[str, ...]
    phases: tuple[str, ...]
    kv_dtypes: tuple[str, ...]
    model_dtypes: tuple[str, ...]
    qk_dtype: str
    supports_quant_query_input: bool
    head_dims: tuple[int, ...] | None
    max_gqa_ratio: int | None
    page_sizes: tuple[int, ...] | None
    max_q_len: int | None
    kv_layouts: tuple[str, ...]
    description: str
    planned_in: str = ""

    def __post_init__(self):
        # Registry entries are code, so an inconsistent one is a bug caught at import time.
        def subset(field, allowed):
            values = getattr(self, field)
            if not values or not set(values) <= set(allowed):
                raise ValueError(
                    f"kernel {self.id!r}: {field}={values!r} must be a non-empty subset of {allowed}"
                )

        if self.status not in STATUSES:
            raise ValueError(f"kernel {self.id!r}: status {self.status!r} not in {STATUSES}")
        subset("archs", SUPPORTED_ARCHS)
        subset("phases", PHASES)
        subset("kv_dtypes", KV_DTYPES)
        subset("model_dtypes", MODEL_DTYPES)
        subset("kv_layouts", KV_LAYOUTS)
        if self.qk_dtype not in ("model", "fp8_e4m3"):
            raise ValueError(f"kernel {self.id!r}: qk_dtype {self.qk_dtype!r} must be 'model' or 'fp8_e4m3'")
        if self.qk_dtype == "fp8_e4m3" and not self.supports_quant_query_input:
            raise ValueError(f"kernel {self.id!r}: an FP8-QK kernel must take a pre-quantized query")
        if self.is_fallback != self.id.startswith("reference."):
            raise ValueError(f"kernel {self.id!r}: fallback ids (and only they) start with 'reference.'")
        if self.status == "planned" and not self.planned_in:
            raise ValueError(f"kernel {self.id!r}: a planned kernel must say where (planned_in)")

    @property
    def is_fallback(self) -> bool:
        return self.status == "fallback"

    def computes_qk_in_fp8(self, kv_dtype: str) -> bool:
        """Whether QK runs as an FP8 GEMM for a cache of ``kv_dtype`` (so Q must be FP8)."""
        return self.qk_dtype == "fp8_e4m3" and kv_dtype == "fp8_e4m3"


_ALL_16 = ("bf16", "fp16")
_ALL_KV = ("bf16", "fp16", "fp8_e4m3")

_SM90_DECODE_LIMITS = dict(
    archs=("sm90",), phases=("decode",), model_dtypes=_ALL_16, head_dims=(64, 128, 256),
    max_gqa_ratio=16, page_sizes=(16, 32, 64, 128), max_q_len=4, kv_layouts=("HND", "NHD"),
)
# the SM90 prefill's limits, as its plan module writes them (host-only, no DSL at import)
_SM90_PREFILL_LIMITS = dict(
    archs=("sm90",), phases=("prefill",), model_dtypes=_sm90_prefill.OUT_DTYPES, head_dims=_sm90_prefill.HEAD_DIMS,
    max_gqa_ratio=_sm90_prefill.MAX_GROUP, page_sizes=_sm90_prefill.PAGE_SIZES, max_q_len=None,
    kv_layouts=KV_LAYOUTS, planned_in="cute_kernels/sm90/prefill.py",
)
# Provisional limits of the Blackwell kernels, to be confirmed when they are built.
_SM100_LIMITS = dict(
    archs=("sm100", "sm103"), kv_dtypes=_ALL_KV, model_dtypes=_ALL_16, qk_dtype="fp8_e4m3",
    supports_quant_query_input=True, head_dims=(64, 128, 256), max_gqa_ratio=None,
    page_sizes=(16, 32, 64, 128), kv_layouts=("HND",), planned_in="a later SM100 tcgen05 issue",
)
_REFERENCE_LIMITS = dict(
    status="fallback", archs=SUPPORTED_ARCHS, kv_dtypes=_ALL_KV, model_dtypes=_ALL_16, qk_dtype="model",
    supports_quant_query_input=False, head_dims=None, max_gqa_ratio=None, page_sizes=None,
    max_q_len=None, kv_layouts=("HND", "NHD"),
)

_REGISTRY = (
    KernelInfo(
        id="sm90.decode",
        status="available",
        kv_dtypes=_ALL_KV, qk_dtype="model", supports_quant_query_input=False,
        description=("SM90 paged decode with WGMMA and TMA; FP8 K/V widened exactly on chip "
                     "(fp16 MMA, the bf16 query rescaled by a power of two), never an FP8 query"),
        planned_in="issue 3",
        **_SM90_DECODE_LIMITS,
    ),
    KernelInfo(
        id="sm90.decode_fp8q",
        status="planned",
        kv_dtypes=("fp8_e4m3",), qk_dtype="fp8_e4m3", supports_quant_query_input=True,
        description="opt-in SM90 paged decode, FP8 WGMMA on a q_scale-quantized query (XQA-style precision)",
        planned_in="issue 3 follow-up (opt-in, explicit backend only)",
        **_SM90_DECODE_LIMITS,
    ),
    KernelInfo(
        id="sm90.prefill",
        status="available",
        kv_dtypes=_sm90_prefill.KV_DTYPES, qk_dtype="model", supports_quant_query_input=False,
        description=("SM90 varlen paged prefill with WGMMA and TMA (warp-specialized, causal blocks skipped); "
                     "FP8 K/V widened exactly on chip, the query stays in the model dtype"),
        **_SM90_PREFILL_LIMITS,
    ),
    KernelInfo(
        id="sm90.prefill_fp8q",
        status="available",
        kv_dtypes=("fp8_e4m3",), qk_dtype="fp8_e4m3", supports_quant_query_input=True,
        description=("SM90 varlen paged prefill with e4m3 WGMMA for QK and PV on a q_scale-quantized query "
                     "(V transposed on chip, P rounded to e4m3)"),
        **_SM90_PREFILL_LIMITS,
    ),
    KernelInfo(
        id="sm100.decode", status="planned", phases=("decode",), max_q_len=None,
        description="Blackwell tcgen05 paged decode (TRT-LLM style); QK in FP8 for an FP8 cache",
        **_SM100_LIMITS,
    ),
    KernelInfo(
        id="sm100.prefill", status="planned", phases=("prefill",), max_q_len=None,
        description="Blackwell tcgen05 paged prefill (TRT-LLM style); QK in FP8 for an FP8 cache",
        **_SM100_LIMITS,
    ),
    KernelInfo(
        id="reference.paged_decode", phases=("decode",),
        description="slow torch reference fallback: cute_kernels.reference.paged_decode",
        **_REFERENCE_LIMITS,
    ),
    KernelInfo(
        id="reference.paged_prefill", phases=("prefill",),
        description="slow torch reference fallback: cute_kernels.reference.paged_prefill",
        **_REFERENCE_LIMITS,
    ),
)

# id -> KernelInfo. Read at call time by the planner, so tests may swap an entry (monkeypatch).
KERNELS: dict[str, KernelInfo] = {k.id: k for k in _REGISTRY}

# The reference fallback of each phase; ``backend="reference"`` is an alias for it.
FALLBACKS = {"decode": "reference.paged_decode", "prefill": "reference.paged_prefill"}


# QSA sparse attention (issue 4) is its own call site: a layer with top-k selected tokens per query
# row, served in one op whatever the batch's phase (``prefill`` only picks a tuning profile), so
# its kernels are listed apart from the paged prefill/decode lists above and planned by
# :func:`dispatch.qsa.plan_qsa`. Entries use the same :class:`KernelInfo` validation; ``phases``
# names the profiles a kernel serves.
_QSA_REGISTRY = (
    KernelInfo(
        id="sm90.qsa",
        status="available",
        archs=("sm90",), phases=PHASES, kv_dtypes=_ALL_KV, model_dtypes=_ALL_16, qk_dtype="model",
        supports_quant_query_input=False, head_dims=(64, 128, 256), max_gqa_ratio=16, page_sizes=None,
        max_q_len=None, kv_layouts=KV_LAYOUTS,
        description="SM90 QSA sparse GQA attention: decode-sized batches gather each row's tokens "
                    "(cp.async, swap-AB WGMMA, split-K + merge); prefill batches of >= 64 rows gather the "
                    "union of R consecutive rows' selections once (pre-pass + row-tile kernel, the R x G "
                    "query columns on the WGMMA's M); FP8 K/V converted exactly on chip (fp16 MMAs), "
                    "or, for a prefill whose block table addresses a small enough cache, widened once into "
                    "a 16-bit copy the 16-bit row-tile kernel reads; QK never in FP8",
    ),
    KernelInfo(
        id="reference.qsa_sparse_attention", phases=PHASES,
        description="slow torch reference fallback: cute_kernels.reference.qsa_sparse_attention",
        **_REFERENCE_LIMITS,
    ),
)

# id -> KernelInfo of the QSA call site (read at call time by plan_qsa; tests may swap entries)
QSA_KERNELS: dict[str, KernelInfo] = {k.id: k for k in _QSA_REGISTRY}
QSA_FALLBACK = "reference.qsa_sparse_attention"
