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
from typing import Any

from .jit.spec import KernelConfig, normalize_target
from .plans import (
    merge_states,
    probes,
    quantize_query,
    sm90_decode,
    sm90_prefill,
    sm90_qsa,
    sm90_qsa_launch,
    sm90_qsa_tile,
    sm100,
    write_kv_cache,
)

STATUSES = ("available", "compile-verified", "planned", "fallback")
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
    function returning its compile matrix (configs, each naming its targets); ``family`` (a
    compile-verified kernel): ``family(q_dtype, kv_dtype, head_dim)``, the name of the runtime
    self-check family a request runs (its record is what the dispatcher reads).
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
    family: Callable[[str, str, int], str] | None = None

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
        if self.status == "compile-verified" and self.family is None:
            raise ValueError(f"kernel {self.id!r}: a compile-verified kernel names its self-check family")

    @property
    def is_fallback(self) -> bool:
        return self.status == "fallback"

    def computes_qk_in_fp8(self, kv_dtype: str) -> bool:
        """Whether QK runs as an FP8 GEMM for a cache of ``kv_dtype`` (so Q must be FP8)."""
        return self.qk_dtype == "fp8_e4m3" and kv_dtype == "fp8_e4m3"


_ALL_16 = ("bf16", "fp16")

# What the SM90 paged decode kernel accepts: its plan's limits, nothing narrower.
_SM90_DECODE: dict[str, Any] = dict(
    call_site="attention", archs=("sm90",), phases=("decode",), model_dtypes=sm90_decode.Q_DTYPES,
    head_dims=sm90_decode.HEAD_DIMS, page_sizes=sm90_decode.PAGE_SIZES, max_rows=sm90_decode.MAX_ROWS,
    kv_layouts=sm90_decode.KV_LAYOUTS,
)
# What the SM90 paged prefill kernel accepts: its plan's limits. Both query paths are compile-verified
# (docs/design/sm90-prefill.md#status): the op runs a runtime self-check before their first launch.
_SM90_PREFILL: dict[str, Any] = dict(
    status="compile-verified", call_site="attention", archs=("sm90",), phases=("prefill",),
    model_dtypes=sm90_prefill.MODEL_DTYPES, head_dims=sm90_prefill.HEAD_DIMS, max_gqa_ratio=sm90_prefill.MAX_GROUP,
    page_sizes=sm90_prefill.PAGE_SIZES, kv_layouts=sm90_prefill.KV_LAYOUTS, op="paged_prefill",
    family=sm90_prefill.family,
)
# The Blackwell kernels: QK in FP8 for an FP8 cache (the layer quantizes the query, as for
# trtllm-gen); what they accept is their plan's (cute_kernels/plans/sm100.py).
_SM100: dict[str, Any] = dict(
    call_site="attention", archs=_archs(sm100.TARGETS), qk_dtype="fp8_e4m3", supports_quant_query_input=True,
    model_dtypes=sm100.MODEL_DTYPES,
)

_REFERENCE: dict[str, Any] = dict(status="fallback", archs=ARCHS)
_HELPER: dict[str, Any] = dict(status="available", phases=PHASES)


def _sm100_family(kernel_id: str) -> Callable[[str, str, int], str]:
    """A Blackwell kernel's self-check family: its MMA family (the head dim does not enter)."""
    return lambda q_dtype, kv_dtype, head_dim: sm100.family(kernel_id, q_dtype, kv_dtype)


_ENTRIES = (
    KernelInfo(
        id="sm90.decode", status="available", kv_dtypes=sm90_decode.KV_DTYPES, op="paged_decode",
        description="SM90 paged decode: WGMMA and TMA, FP8 K/V widened exactly on chip, never an FP8 query",
        variants=sm90_decode.compile_variants, **_SM90_DECODE,
    ),
    # the window / sink variants of sm90.decode: never run on a GPU yet, so compile-verified (the op
    # runs a one-time self-check per family before their first launch); not on a dispatcher list:
    # paged_decode picks them for window_left >= 0 or sinks
    KernelInfo(
        id="sm90.decode_window_sinks", status="compile-verified", kv_dtypes=sm90_decode.KV_DTYPES, op="paged_decode",
        description="SM90 paged decode's sliding-window (runtime window_left, pages outside skipped) and "
                    "attention-sink variants",
        variants=sm90_decode.feature_variants, family=sm90_decode.request_family,
        **{**_SM90_DECODE, "call_site": None},
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
    # the window / sink variants of the prefill: compile-verified, picked by paged_prefill for
    # window_left >= 0 or sinks (not on a dispatcher list)
    KernelInfo(
        id=sm90_prefill.FEATURES_ID, kv_dtypes=sm90_prefill.KV_DTYPES,
        description="SM90 varlen paged prefill's sliding-window (runtime window_left, tiles and pages outside "
                    "skipped) and attention-sink variants",
        variants=sm90_prefill.feature_variants, **{**_SM90_PREFILL, "call_site": None,
                                                    "family": sm90_prefill.feature_family}),
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
    KernelInfo(id="sm100.prefill", status="compile-verified", phases=("prefill",),
               description="Blackwell tcgen05 paged prefill (ping-pong softmax warpgroups, a correction warpgroup, "
                           "S and P aliased in TMEM, varlen, causal, sinks, sliding window); QK in FP8 for an "
                           "FP8 cache",
               variants=sm100.prefill_variants, family=_sm100_family("sm100.prefill"), **sm100.PREFILL_LIMITS,
               **_SM100),
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

def kernels_on(call_site: str) -> dict[str, KernelInfo]:
    """The entries of one dispatcher list (in registration order, which is the priority order)."""
    return {k: v for k, v in KERNELS.items() if v.call_site == call_site}


def variants() -> list[KernelConfig]:
    """Every compile variant of every registered kernel (the compile matrix)."""
    out: list[KernelConfig] = []
    for info in KERNELS.values():
        if info.variants is not None:
            out += info.variants()
    return out


def variants_for(arch: str) -> list[KernelConfig]:
    """The compile variants that target ``arch`` (a compile target such as ``"sm_90a"``)."""
    target = normalize_target(arch)
    return [v for v in variants() if target in v.targets]
