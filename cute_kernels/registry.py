"""The kernel registry: every kernel this package builds or plans, in one table.

One entry per kernel id: the archs and phases it serves, exactly what it accepts (read from its
host-only plan, where every limit is written once), its status, the public op that runs it and
its compile variants. The dispatcher (``dispatch``), the warm-up, the compile matrix and the CLI's
``matrix``/``compile`` read it; ``cute_kernels.<op>`` resolves public op names through
:data:`OPS`. Host-only: importing it loads neither the DSL nor torch.

Kernel ids are a contract (the attention layer maps an id to an op; benchmarks and the CLI print
them), so they never change meaning. A kernel is:

- ``"available"``: built and tested; chosen automatically when its limits accept a request;
- ``"compile-verified"``: built, and compile-checked for its arch on the CPU (instruction
  evidence, shared-memory / TMEM / register budgets, no spills, PTX digests), but not yet verified
  on that hardware;
  chosen like an available kernel, and its op runs a one-time runtime self-check per process and
  variant family (``family``) before the first use (:mod:`cute_kernels.ops._selfcheck`): a family
  that fails it is served by the reference, and the dispatcher refuses it on that machine with
  the recorded reason;
- ``"planned"``: designed but not built; named in plans so the reason can say why it was not
  used, refused when asked for explicitly;
- ``"fallback"``: a slow torch reference (:mod:`cute_kernels.reference`), which serves every
  arch, dtype and shape so that every request has a plan.

``call_site`` says which dispatcher list a kernel is on: ``"attention"`` (paged prefill/decode,
:func:`dispatch.plan`), ``"qsa"`` (QSA sparse attention, :func:`dispatch.plan_qsa`), or none of
them (the kernels an op runs around the attention kernel, and the hardware probes).

A kernel that has not run on every arch it serves says so in ``verified``: the portable
``sm80.*`` kernels passed their GPU suite as SM80 code on SM90 hardware (the H200) and have never
run on SM80/86/89/100/103/120/121 hardware; ``hardware_runs`` lists the archs whose hardware ran
it, and a plan for another arch says so in its reason.

``qk_dtype`` records the precision of Q·Kᵀ. ``"fp8_e4m3"`` means the kernel runs QK as an FP8
GEMM *when the KV cache is FP8* (with a 16-bit cache every kernel computes QK in the model dtype);
only then does the query become FP8 and ``q_scale`` apply. Such a kernel takes an already
quantized query (``supports_quant_query_input``): the layer quantizes Q with ``q_scale``, never
the kernel by a silent cast. Design: docs/design/architecture.md#registry and
docs/design/dispatch.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from .jit.spec import ALL_TARGETS, COMPILE_TARGETS, KernelConfig, normalize_target
from .plans import (
    merge_states,
    probes,
    quantize_query,
    sm80,
    sm80_matrix,
    sm90_decode,
    sm90_prefill,
    sm90_qsa,
    sm90_qsa_launch,
    sm90_qsa_tile,
    sm100,
    write_kv_cache,
)

STATUSES = ("available", "compile-verified", "planned", "fallback")
USABLE = ("available", "compile-verified")  # the statuses a dispatcher or an op chooses automatically
PHASES = ("prefill", "decode")
KV_LAYOUTS = ("HND", "NHD")
CALL_SITES = ("attention", "qsa")
# dispatch's arch names (compute capabilities this package plans for); see dispatch/arch.py
ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm120", "sm121")
MODEL_DTYPES = ("bf16", "fp16")
KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")

# public op name -> (module, attribute): ``cute_kernels.<name>`` resolves through this table
OPS = {
    "merge_states": ("cute_kernels.ops.merge_states", "merge_states"),
    "paged_decode": ("cute_kernels.ops.paged_decode", "paged_decode"),
    "paged_prefill": ("cute_kernels.ops.paged_prefill", "paged_prefill"),
    "qsa_sparse_attention": ("cute_kernels.ops.qsa_sparse_attention", "qsa_sparse_attention"),
    "qsa_warmup": ("cute_kernels.qsa_warmup", "qsa_warmup"),
    "quantize_query": ("cute_kernels.ops.quantize_query", "quantize_query"),
    "write_kv_cache": ("cute_kernels.ops.write_kv_cache", "write_kv_cache"),
    "warmup": ("cute_kernels.warmup", "warmup"),
}


def arch_of_target(target: str) -> str:
    """``"sm_90a"`` -> ``"sm90"`` (a compile target's dispatch arch name)."""
    return normalize_target(target).replace("_", "").rstrip("a")


def _archs(targets) -> tuple[str, ...]:
    return tuple(arch_of_target(t) for t in targets)


@dataclass(frozen=True)
class KernelInfo:
    """One registered kernel and the requests it accepts (None = no limit).

    ``max_rows``: query rows one CTA serves, ``num_q_heads / num_kv_heads x q_len`` (a kernel that
    puts a KV group's rows on one MMA dimension); ``opt_in``: never chosen automatically, only
    when named with ``backend=``; ``op``: the public op (a key of :data:`OPS`, or
    ``"reference.<name>"`` for :mod:`cute_kernels.reference`) that runs it; ``variants``: a
    function returning its compile variants (configs, each naming its targets), ``ci_variants``
    the representative part of them the CPU test suite compiles (None: all of them);
    ``mixed_16bit``: (model dtype, 16-bit cache dtype) pairs served besides a cache of the model's
    dtype; ``verified``: how its GPU tests verified it where that is not its own hardware, with
    ``hardware_runs`` the archs whose hardware ran them; ``family`` (a compile-verified kernel):
    ``family(q_dtype, kv_dtype, head_dim)``, the name of the runtime self-check family a request
    runs (its record is what the dispatcher reads).
    """

    id: str
    status: str
    call_site: str | None
    archs: tuple[str, ...]
    phases: tuple[str, ...]
    description: str
    kv_dtypes: tuple[str, ...] = KV_DTYPES
    model_dtypes: tuple[str, ...] = MODEL_DTYPES
    qk_dtype: str = "model"
    supports_quant_query_input: bool = False
    head_dims: tuple[int, ...] | None = None
    max_gqa_ratio: int | None = None
    page_sizes: tuple[int, ...] | None = None
    max_q_len: int | None = None
    max_rows: int | None = None
    kv_layouts: tuple[str, ...] = KV_LAYOUTS
    opt_in: bool = False
    op: str | None = None
    variants: Callable[[], Sequence[KernelConfig]] | None = None
    ci_variants: Callable[[], Sequence[KernelConfig]] | None = None
    mixed_16bit: tuple[tuple[str, str], ...] = ()
    verified: str = ""
    hardware_runs: tuple[str, ...] = ()
    family: Callable[[str, str, int], str] | None = None
    query_terms: int = 1  # 2: an FP8 query in two terms (codes and residual; query_dtype "fp8x2")

    def __post_init__(self):
        # Registry entries are code, so an inconsistent one is a bug caught at import time.
        def subset(field, allowed):
            values = getattr(self, field)
            if not values or not set(values) <= set(allowed):
                raise ValueError(f"kernel {self.id!r}: {field}={values!r} must be a non-empty subset of {allowed}")

        if self.status not in STATUSES:
            raise ValueError(f"kernel {self.id!r}: status {self.status!r} not in {STATUSES}")
        if self.call_site is not None and self.call_site not in CALL_SITES:
            raise ValueError(f"kernel {self.id!r}: call_site {self.call_site!r} not in {CALL_SITES}")
        subset("archs", ARCHS)
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
        if self.op is not None and self.op not in OPS and not self.op.startswith("reference."):
            raise ValueError(f"kernel {self.id!r}: op {self.op!r} is not a public op")
        if not set(self.hardware_runs) <= set(self.archs) or bool(self.verified) != bool(self.hardware_runs):
            raise ValueError(f"kernel {self.id!r}: verified and hardware_runs (a subset of its archs) go together")
        if self.status == "compile-verified" and self.family is None:
            raise ValueError(f"kernel {self.id!r}: a compile-verified kernel names its self-check family")

    @property
    def is_fallback(self) -> bool:
        return self.status == "fallback"

    def computes_qk_in_fp8(self, kv_dtype: str) -> bool:
        """Whether QK runs as an FP8 GEMM for a cache of ``kv_dtype`` (so Q must be FP8)."""
        return self.qk_dtype == "fp8_e4m3" and kv_dtype == "fp8_e4m3"

    def takes_dtypes(self, model: str, kv: str) -> bool:
        """Whether it takes a ``model``-dtype query against a ``kv`` cache: both listed, and (a
        tensor-core kernel multiplies Q and K in one 16-bit type) an FP8 cache (widened on chip), a
        cache of the model's dtype or a pair in ``mixed_16bit``; the fallback takes any listed pair."""
        if model not in self.model_dtypes or kv not in self.kv_dtypes:
            return False
        return self.is_fallback or kv in ("fp8_e4m3", model) or (model, kv) in self.mixed_16bit

    def unverified_on(self, arch: str) -> str | None:
        """``"verified as SM80 code on SM90 hardware, not on sm86"`` when this kernel's GPU tests
        have not run on ``arch``'s hardware, else None."""
        if not self.verified or arch in self.hardware_runs:
            return None
        return f"verified as {self.verified}, not on {arch}"


_ALL_16 = ("bf16", "fp16")

# What the SM90 paged decode kernel accepts: its plan's limits, nothing narrower.
_SM90_DECODE: dict[str, Any] = dict(
    call_site="attention", archs=("sm90",), phases=("decode",), model_dtypes=sm90_decode.Q_DTYPES,
    head_dims=sm90_decode.HEAD_DIMS, page_sizes=sm90_decode.PAGE_SIZES, max_rows=sm90_decode.MAX_ROWS,
    kv_layouts=sm90_decode.KV_LAYOUTS,
)
# What the SM90 paged prefill kernel accepts: its plan's limits. Both query paths, the window / sink
# variants, the persistent schedule and the shared-memory epilogue are available: verified by the GPU
# suite on the H200 (docs/design/sm90-prefill.md#status).
_SM90_PREFILL: dict[str, Any] = dict(
    status="available", call_site="attention", archs=("sm90",), phases=("prefill",),
    model_dtypes=sm90_prefill.MODEL_DTYPES, head_dims=sm90_prefill.HEAD_DIMS, max_gqa_ratio=sm90_prefill.MAX_GROUP,
    page_sizes=sm90_prefill.PAGE_SIZES, kv_layouts=sm90_prefill.KV_LAYOUTS, op="paged_prefill",
)
# The Blackwell kernels: QK in FP8 for an FP8 cache (the layer quantizes the query, as for
# trtllm-gen); what they accept is their plan's (cute_kernels/plans/sm100.py).
_SM100: dict[str, Any] = dict(
    call_site="attention", archs=_archs(sm100.TARGETS), qk_dtype="fp8_e4m3", supports_quant_query_input=True,
    model_dtypes=sm100.MODEL_DTYPES,
)
# The portable SM80-class kernels: every arch from SM80 on, exactly their plan's limits; their GPU
# suite passed on the H200 (the same code: only SM80 instructions inside), nowhere else yet
_SM80: dict[str, Any] = dict(
    status="available", call_site="attention", archs=ARCHS, kv_dtypes=sm80.KV_DTYPES, model_dtypes=sm80.Q_DTYPES,
    head_dims=sm80.HEAD_DIMS, page_sizes=sm80.PAGE_SIZES, kv_layouts=sm80.KV_LAYOUTS, mixed_16bit=sm80.MIXED_16BIT,
    verified="SM80 code on SM90 hardware", hardware_runs=("sm90",),
)
_REFERENCE: dict[str, Any] = dict(status="fallback", archs=ARCHS)
_HELPER: dict[str, Any] = dict(status="available", phases=PHASES)


def _sm90_prefill_opt_in(kernel_id: str, description: str, variants) -> KernelInfo:
    """An opt-in schedule or epilogue of the SM90 prefill (``tuning_override``): available, verified by
    the GPU suite on the H200 like the default; not on a dispatcher list."""
    return KernelInfo(id=kernel_id, kv_dtypes=sm90_prefill.KV_DTYPES, description=description, variants=variants,
                      **{**_SM90_PREFILL, "call_site": None})


def _sm100_family(kernel_id: str) -> Callable[[str, str, int], str]:
    """A Blackwell kernel's self-check family: its MMA family (the head dim does not enter)."""
    return lambda q_dtype, kv_dtype, head_dim: sm100.family(kernel_id, q_dtype, kv_dtype)


_ENTRIES = (
    KernelInfo(
        id="sm90.decode", status="available", kv_dtypes=sm90_decode.KV_DTYPES, op="paged_decode",
        description="SM90 paged decode: WGMMA and TMA, FP8 K/V widened exactly on chip, never an FP8 query",
        variants=sm90_decode.compile_variants, **_SM90_DECODE,
    ),
    # the window / sink variants of sm90.decode: available, verified by the GPU suite on the H200
    # (docs/design/sm90-prefill.md#status); not on a dispatcher list: paged_decode picks them for
    # window_left >= 0 or sinks
    KernelInfo(
        id=sm90_decode.FEATURES_ID, status="available", kv_dtypes=sm90_decode.KV_DTYPES, op="paged_decode",
        description="SM90 paged decode's sliding-window (runtime window_left, pages outside skipped) and "
                    "attention-sink variants",
        variants=sm90_decode.feature_variants, **{**_SM90_DECODE, "call_site": None},
    ),
    # the balanced split schedule of sm90.decode (opt-in: ``tuning_override(balanced=True)``): available,
    # verified by the GPU suite on the H200 (docs/design/sm90-decode.md#balanced-schedule-opt-in); not on a
    # dispatcher list
    KernelInfo(
        id=sm90_decode.BALANCED_ID, status="available", kv_dtypes=sm90_decode.KV_DTYPES, op="paged_decode",
        description="SM90 paged decode's balanced split schedule: equal chunks of a ragged batch's KV tiles per "
                    "CTA, found from seq_lens on the device (fixed grid), partials merged in chunk order",
        variants=sm90_decode.balanced_variants, **{**_SM90_DECODE, "call_site": None},
    ),
    KernelInfo(
        id="sm90.decode_fp8q", status="planned", kv_dtypes=("fp8_e4m3",), qk_dtype="fp8_e4m3",
        supports_quant_query_input=True, opt_in=True,
        description="SM90 paged decode with FP8 WGMMA on a q_scale-quantized query (opt-in)",
        **_SM90_DECODE,
    ),
    # the FP8-query prefill first: when it is the FP8-cache choice (sm90_prefill.FP8_CACHE_KERNEL), it
    # takes exactly the FP8 caches; otherwise it is opt-in
    KernelInfo(
        id="sm90.prefill_fp8q", kv_dtypes=("fp8_e4m3",), qk_dtype="fp8_e4m3", supports_quant_query_input=True,
        opt_in=sm90_prefill.FP8_CACHE_KERNEL != "sm90.prefill_fp8q",
        description="SM90 varlen paged prefill with e4m3 WGMMA for QK and PV on a q_scale-quantized query "
                    "(V transposed on chip, P rounded to e4m3)",
        variants=sm90_prefill.fp8_query_compile_variants, **_SM90_PREFILL,
    ),
    # the two-term FP8 query of the prefill (paged_prefill(..., q_residual=); planned for query_dtype "fp8x2"):
    # available, verified by the GPU suite on the H200 (docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2);
    # its family stays named for the self-check machinery's tests
    KernelInfo(
        id=sm90_prefill.TWO_TERM_ID, kv_dtypes=("fp8_e4m3",), qk_dtype="fp8_e4m3", supports_quant_query_input=True,
        opt_in=True, query_terms=2,
        description="SM90 varlen paged prefill with a two-term FP8 query (e4m3 codes and their e4m3 residual, "
                    "both TMA'd; QK issued per term into one fp32 accumulator), otherwise sm90.prefill_fp8q",
        variants=sm90_prefill.two_term_variants, family=lambda q, kv, d: f"{sm90_prefill.family(q, kv, d)}/two_term",
        **_SM90_PREFILL,
    ),
    # the FP8-query prefill with V^T written in 4-byte words, the opt-out of its ldmatrix.trans + stmatrix
    # default (``tuning_override(vt_transpose="words")``, for A/B): the former default, verified by the GPU
    # suite on the H200 (docs/design/sm90-prefill.md#vt-by-ldmatrixtrans--stmatrix-the-fp8-querys-default)
    KernelInfo(
        id=sm90_prefill.VT_WORDS_ID, kv_dtypes=("fp8_e4m3",), qk_dtype="fp8_e4m3", supports_quant_query_input=True,
        opt_in=True,
        description="sm90.prefill_fp8q with its producer transposing V in 4-byte words (prmt) instead of by "
                    "ldmatrix.trans + stmatrix (16 bytes per lane)",
        variants=sm90_prefill.vt_words_variants, **{**_SM90_PREFILL, "call_site": None}),
    # the prefill with its former softmax (scores scaled, then the max, then a subtract; P's FP8 range by a
    # multiply; O always rescaled), the opt-out of the lean default (``tuning_override(lean_softmax=False)``,
    # for A/B): verified by the GPU suite on the H200 (docs/design/sm90-prefill.md#the-lean-softmax)
    KernelInfo(
        id=sm90_prefill.SCALED_SOFTMAX_ID, kv_dtypes=sm90_prefill.KV_DTYPES, opt_in=True,
        description="SM90 varlen paged prefill with the scaled-score softmax: each score scaled, the max, then "
                    "a subtract before its exp2; an FP8 query's P scaled by a multiply; O rescaled every tile",
        variants=sm90_prefill.scaled_softmax_variants,
        family=lambda q, kv, d: f"{sm90_prefill.family(q, kv, d)}/scaled_softmax",
        # the CI set: the three kinds at D 128 (the full set: `cute-kernels compile --arch sm_90a`)
        ci_variants=lambda: sm90_prefill.scaled_softmax_variants()[:3],
        **{**_SM90_PREFILL, "call_site": None}),
    # the window / sink variants of the prefill: picked by paged_prefill for window_left >= 0 or
    # sinks (not on a dispatcher list)
    KernelInfo(
        id=sm90_prefill.FEATURES_ID, kv_dtypes=sm90_prefill.KV_DTYPES,
        description="SM90 varlen paged prefill's sliding-window (runtime window_left, tiles and pages outside "
                    "skipped) and attention-sink variants",
        variants=sm90_prefill.feature_variants, **{**_SM90_PREFILL, "call_site": None}),
    # the persistent schedule of the prefill (``tuning_override(persistent=True)``)
    _sm90_prefill_opt_in(
        sm90_prefill.PERSISTENT_ID,
        "SM90 varlen paged prefill's persistent schedule: a fixed grid of one CTA per SM walks the (query block, "
        "request, head) tiles longest first, the TMA/mbarrier pipeline carried across tiles",
        sm90_prefill.persistent_variants),
    # the shared-memory epilogue of the prefill (``tuning_override(epilogue="smem")``)
    _sm90_prefill_opt_in(
        sm90_prefill.EPILOGUE_ID,
        "SM90 varlen paged prefill's shared-memory epilogue: each consumer warpgroup stages its O rows in a "
        "free swizzled shared-memory tile and writes them in 16-byte row chunks, rows past the request masked",
        sm90_prefill.epilogue_variants),
    KernelInfo(
        id="sm90.prefill", kv_dtypes=sm90_prefill.KV_DTYPES,
        description="SM90 varlen paged prefill with WGMMA and TMA (warp-specialized, causal blocks skipped); FP8 "
                    "K/V widened exactly on chip, the query stays in the model dtype",
        variants=sm90_prefill.compile_variants, **_SM90_PREFILL,
    ),
    KernelInfo(id="sm100.decode", status="compile-verified", phases=("decode",), op="paged_decode",
               description="Blackwell tcgen05 paged decode (swap-AB, S and O in TMEM, TMA page boxes, split-KV, "
                           "sinks, sliding window); QK in FP8 for an FP8 cache",
               variants=sm100.decode_variants, family=_sm100_family("sm100.decode"), **sm100.DECODE_LIMITS,
               **_SM100),
    # a 16-bit query on an FP8 cache reaches it quantized by the layer (the plan's q_scale); the op
    # itself runs the portable kernel for one (ops/_paged_prefill_sm100.py)
    KernelInfo(id="sm100.prefill", status="compile-verified", phases=("prefill",), op="paged_prefill",
               description="Blackwell tcgen05 paged prefill (ping-pong softmax warpgroups, a correction warpgroup, "
                           "S and P aliased in TMEM, varlen, causal, sinks, sliding window); QK in FP8 for an "
                           "FP8 cache",
               variants=sm100.prefill_variants, family=_sm100_family("sm100.prefill"), **sm100.PREFILL_LIMITS,
               **_SM100),
    # after the arch-specific kernels: they serve what those refuse, and the archs without one
    KernelInfo(
        id="sm80.decode", phases=("decode",), max_rows=sm80.MAX_DECODE_ROWS, op="paged_decode",
        description="portable paged decode (warp mma.sync, ldmatrix, cp.async page gathers; split-KV with "
                    "merge_states); FP8 K/V widened exactly (cvt from SM89, bit operations before), never an "
                    "FP8 query",
        variants=partial(sm80_matrix.compile_variants, "sm80.decode"),
        ci_variants=partial(sm80_matrix.ci_variants, "sm80.decode"),
        **_SM80,
    ),
    KernelInfo(
        id="sm80.prefill", phases=("prefill",), op="paged_prefill",
        description="portable FA2-style paged prefill (warp mma.sync, ldmatrix, cp.async page gathers): varlen, "
                    "chunked, causal; FP8 K/V widened exactly, never an FP8 query",
        variants=partial(sm80_matrix.compile_variants, "sm80.prefill"),
        ci_variants=partial(sm80_matrix.ci_variants, "sm80.prefill"), **_SM80,
    ),
    KernelInfo(id="reference.paged_decode", call_site="attention", phases=("decode",), op="reference.paged_decode",
               description="slow torch reference fallback (cute_kernels.reference.paged_decode)", **_REFERENCE),
    KernelInfo(id="reference.paged_prefill", call_site="attention", phases=("prefill",),
               op="reference.paged_prefill",
               description="slow torch reference fallback (cute_kernels.reference.paged_prefill)", **_REFERENCE),
    # QSA sparse attention: its own call site, one op for prefill and decode batches (``prefill``
    # only picks a tuning profile); ``phases`` names the profiles a kernel serves
    KernelInfo(
        id="sm90.qsa", status="available", call_site="qsa", archs=("sm90",), phases=PHASES,
        kv_dtypes=sm90_qsa.KV_DTYPES, model_dtypes=sm90_qsa.Q_DTYPES, head_dims=sm90_qsa.HEAD_DIMS,
        max_gqa_ratio=sm90_qsa.MAX_GROUP, op="qsa_sparse_attention",
        description="SM90 QSA sparse attention: split-K gathers for decode-sized batches, shared row-tile "
                    "gathers for prefill, FP8 K/V converted exactly on chip",
        variants=sm90_qsa_launch.compile_variants,
    ),
    KernelInfo(id="reference.qsa_sparse_attention", call_site="qsa", phases=PHASES,
               op="reference.qsa_sparse_attention",
               description="slow torch reference fallback (cute_kernels.reference.qsa_sparse_attention)", **_REFERENCE),
    # kernels an op runs around its attention kernel (their variants are compiled with the
    # attention kernel's in the QSA list above, or listed here)
    KernelInfo(id="sm90.qsa_tile", call_site=None, archs=("sm90",), op="qsa_sparse_attention",
               head_dims=sm90_qsa.HEAD_DIMS, max_rows=sm90_qsa_tile.MAX_COLUMNS,
               description="QSA prefill over row tiles: R rows x G heads on the WGMMA's M, one gather of "
                           "their union", **_HELPER),
    KernelInfo(id="sm90.qsa_union", call_site=None, archs=("sm90",), op="qsa_sparse_attention",
               description="QSA row-tile pre-pass: the sorted union of R rows' selections and the rows' "
                           "membership bits", **_HELPER),
    KernelInfo(id="sm90.qsa_widen", call_site=None, archs=("sm90",), op="qsa_sparse_attention", kv_dtypes=("fp8_e4m3",),
               description="QSA prefill pre-pass: the FP8 pages a block table addresses widened into a "
                           "16-bit copy", **_HELPER),
    KernelInfo(id="sm90.qsa_merge", call_site=None, archs=("sm90",), op="qsa_sparse_attention",
               description="QSA split-K merge with the fused output gate", **_HELPER),
    KernelInfo(id="common.merge_states", call_site=None, archs=_archs(merge_states.MergeStatesConfig.targets),
               op="merge_states", description="LSE merge of split partial states",
               variants=merge_states.compile_variants, **_HELPER),
    KernelInfo(id="common.quantize_query", call_site=None, archs=_archs(quantize_query.FP8_TARGETS),
               op="quantize_query", description="query quantization to FP8 e4m3, with optional fused NeoX RoPE",
               variants=quantize_query.compile_variants, **_HELPER),
    # the quantization with the two-term query's residual in the same pass (quantize_query(...,
    # residual=True) on a GPU): available, both terms bit-identical to the torch-ops path in the GPU
    # suite on the H200 (docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2)
    KernelInfo(id=quantize_query.RESIDUAL_ID, status="available", call_site=None,
               archs=_archs(quantize_query.FP8_TARGETS), phases=PHASES, op="quantize_query",
               description="query quantization to FP8 e4m3 with the two-term query's e4m3 residual written in the "
                           "same pass (one read of q), optional fused NeoX RoPE",
               variants=quantize_query.residual_variants,
               family=lambda q, kv, d: f"{quantize_query.RESIDUAL_ID}/{q}/d{d}"),
    KernelInfo(id="common.write_kv_cache", call_site=None, archs=ARCHS, op="write_kv_cache",
               description="new K/V written into the paged cache (FP8 caches from SM89 on)",
               variants=write_kv_cache.compile_variants, **_HELPER),
    KernelInfo(id="sm90.probe", call_site=None, archs=("sm90",),
               description="the smallest TMA + WGMMA kernel: proves the Hopper path compiles",
               variants=lambda: [probes.Sm90ProbeConfig()], **_HELPER),
    KernelInfo(id="sm100.probe", call_site=None, archs=("sm100",),
               description="the smallest TMA + tcgen05 + TMEM kernel: proves the Blackwell path compiles",
               variants=lambda: [probes.Sm100ProbeConfig()], **_HELPER),
)

# id -> KernelInfo. The dispatcher reads it at call time, so a test may swap an entry (monkeypatch).
KERNELS: dict[str, KernelInfo] = {k.id: k for k in _ENTRIES}

# The reference fallback of each call site and phase; ``backend="reference"`` is an alias for it.
FALLBACKS = {"decode": "reference.paged_decode", "prefill": "reference.paged_prefill"}
QSA_FALLBACK = "reference.qsa_sparse_attention"


def op_kernel(op: str, phase: str, target: str, model: str, kv: str, group: int | None = None) -> KernelInfo:
    """The kernel public op ``op`` runs for a ``phase`` call on ``target`` with these dtypes: the
    first automatic kernel of the dispatcher's list (registration order) run by that op, available
    or compile-verified (not the window / sink variants an op picks itself), whose
    archs include the target's and that takes the dtypes. So ``paged_decode`` runs ``sm90.decode``
    on SM90, ``sm100.decode`` on SM100/103 and ``sm80.decode`` for what those refuse (an fp16 cache
    with a bf16 query) and on every other arch; with ``group`` (num_q_heads / num_kv_heads), its GQA
    limit too (``paged_prefill`` beyond the SM90 kernel's group). The op's own validation then
    applies the kernel's other limits."""
    arch = arch_of_target(target)
    for info in KERNELS.values():
        if (info.op == op and info.call_site == "attention" and info.status in USABLE and not info.opt_in
                and arch in info.archs
                and phase in info.phases and info.takes_dtypes(model, kv)
                and (group is None or info.max_gqa_ratio is None or group <= info.max_gqa_ratio)):
            return info
    raise ValueError(f"{op} has no kernel for a {model} query and a {kv} cache on {target}")


def kernels_on(call_site: str) -> dict[str, KernelInfo]:
    """The entries of one dispatcher list (in registration order, which is the priority order)."""
    return {k: v for k, v in KERNELS.items() if v.call_site == call_site}


def variants(*, ci: bool = False) -> list[KernelConfig]:
    """Every compile variant of every registered kernel; with ``ci``, the representative set the
    CPU test suite compiles (a kernel's ``ci_variants`` where it has them)."""
    out: list[KernelConfig] = []
    for info in KERNELS.values():
        fn = (info.ci_variants or info.variants) if ci else info.variants
        if fn is not None:
            out += fn()
    return out


def variants_for(arch: str, *, ci: bool = False) -> list[KernelConfig]:
    """The compile variants that target ``arch`` (a compile target such as ``"sm_90a"``)."""
    target = normalize_target(arch)
    return [v for v in variants(ci=ci) if target in v.targets]


def compile_matrix(*, ci: bool = False) -> list[tuple[str, KernelConfig]]:
    """``(target, variant)`` pairs whose build, instruction evidence and PTX digest the compile
    tier checks: every variant on the main targets (``COMPILE_TARGETS``); on the other targets the
    attention kernels that serve those archs (the portable ``sm80.*``), not the arch-neutral
    helpers. With ``ci``, the representative set (docs/design/testing.md)."""
    attention = {k for k, v in KERNELS.items() if v.call_site == "attention"}
    return [(t, v) for t in ALL_TARGETS for v in variants_for(t, ci=ci)
            if t in COMPILE_TARGETS or v.kernel_id in attention]
