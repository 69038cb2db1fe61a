"""Plan of the SM90 paged prefill (``sm90.prefill``, ``sm90.prefill_fp8q``): limits, the compile
key and call signature (:class:`Sm90PrefillConfig`), tuning, the launch grid, the compile variants,
the variants a model shape reaches and the FP8-cache choice between the two query paths.

Host-only (no DSL, no torch): the op, the dispatcher, the warm-up and the compile matrix read it;
the kernel (:mod:`cute_kernels.sm90.prefill`) reads what it needs from the config instance it is
built with. Design: docs/design/sm90-prefill.md.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field
from itertools import product
from types import ModuleType
from typing import Any, ClassVar

from ..jit.spec import LABEL_IF_SET, Arg, KernelConfig, ScalarArg, TensorArg
from ..roles.prefill_blocks import persistent_tile
from . import hw
from .paged_cache import kv_cache_args, scale_arg
from .sm90_attention import HEAD_DIMS, KV_FORMS, KV_LAYOUTS, PAGE_SIZES

__all__ = [
    "HEAD_DIMS", "PAGE_SIZES", "MAX_GROUP", "MODEL_DTYPES", "Q_DTYPES", "KV_DTYPES", "OUT_DTYPES", "KV_LAYOUTS",
    "KV_FORMS", "Q_SCALE_KINDS", "TILE_M", "SMEM_BUDGET", "MAX_BATCH", "FP8_CACHE_KERNEL", "FP8_CACHE_REASON",
    "Sm90PrefillConfig", "make_prefill_config", "grid", "smem_bytes", "registry_id", "family", "compile_variants",
    "fp8_query_compile_variants", "prefill_variants", "CTAS_PER_SM", "persistent_ctas", "persistent_grid",
    "persistent_tile", "cta_walk", "persistent_variants", "PERSISTENT_ID", "EPILOGUES",
    "EPILOGUE_ID", "epilogue_variants", "Q_TERMS", "TWO_TERM_ID", "two_term_variants",
    "VT_TRANSPOSES", "default_vt_transpose", "VT_WORDS_ID", "vt_words_variants", "CONSUMER_SCHEDULES",
    "schedule_name", "default_schedule", "SCALED_SOFTMAX_ID", "scaled_softmax_variants",
]

# ---------------------------------------------------------------------------------------------
# limits (each written once; the registry, the dispatcher and the op read them from here)
# ---------------------------------------------------------------------------------------------

# one query head per CTA (no GQA packing): any ratio works; this bounds the compile key
MAX_GROUP = 128
MODEL_DTYPES = ("bf16", "fp16")  # the query's dtype before any quantization, and the output's
Q_DTYPES = (*MODEL_DTYPES, "fp8_e4m3")
KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")
OUT_DTYPES = MODEL_DTYPES
# q_scale of an FP8 query: a Float32 argument, a 1-element fp32 tensor, or fp32 [Hkv]
Q_SCALE_KINDS = ("none", "scalar", "tensor", "per_head")
MAX_BATCH = hw.MAX_GRID_Y  # requests: the grid's z extent
# how O leaves the consumers: 4-byte pairs from registers, or through a shared-memory tile in
# 16-byte row chunks (opt-in: docs/design/sm90-prefill.md#epilogue-through-shared-memory-opt-in-epiloguesmem)
EPILOGUES = ("registers", "smem")
# terms of an FP8 query: its e4m3 codes alone, or those plus the e4m3 residual (q = (hi + lo) q_scale,
# QK issued once per term into one accumulator; FP8 query only, opt-in:
# docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2)
Q_TERMS = (1, 2)
# how the FP8-query kernel's producer transposes V: ldmatrix.trans + stmatrix 16 bytes per lane (its
# default: docs/design/sm90-prefill.md#the-v-transpose-measured), or 4 x 4 byte blocks in 4-byte words
# (the opt-out, for A/B). The other kinds transpose nothing: "words" there, the only value they take.
VT_TRANSPOSES = ("ldsm", "words")

# SM90 prefill with an FP8 cache: the exact BF16-query kernel (FP8 K/V widened on chip: the error of
# the cache's quantization only) or the FP8-query kernel (e4m3 QK and PV; the layer quantizes the
# prefill rows with q_scale). This one constant decides; the registry lists the others as opt-in,
# selectable with backend= or the layer's prefill_query_dtype. Measured on the H200: the one-term
# FP8 query is 1.6x faster at twice the error target, the two-term one 1.25-1.4x faster within it;
# the exact query keeps a 27-29x lower error and needs no q_scale, so it stays the automatic choice:
# docs/design/sm90-prefill.md#status.
FP8_CACHE_KERNEL = "sm90.prefill"
FP8_CACHE_REASON = ("an FP8 cache keeps the exact BF16 query (the FP8-query kernels are opt-in: one term "
                    "is faster but its error exceeds the target; two terms meet it, at a 27-29x higher "
                    "error than the exact query's)")

# ---------------------------------------------------------------------------------------------
# kernel structure the tuning depends on
# ---------------------------------------------------------------------------------------------

WARPGROUP = hw.WARPGROUP_WARPS * 32  # threads of one warpgroup
NUM_THREADS = 3 * WARPGROUP  # one producer and two consumer warpgroups
TILE_M = 2 * hw.WGMMA_M  # query rows per CTA: two consumer warpgroups of one 64-row WGMMA M each
SMEM_BUDGET = hw.MAX_SMEM_PER_CTA  # dynamic shared memory one CTA may use
SMEM_RESERVE = 2048  # barriers, the per-row query scales, alignment padding

# ---- tuning defaults: (kv kind, head dim) -> (tile_n, stages) ----
# "16": 16-bit K/V straight from TMA; "widen": FP8 K/V widened to fp16 in shared memory for a
# 16-bit query; "fp8": FP8 query and K/V (e4m3 WGMMA, V transposed in shared memory)
_TILE_N = {("16", 64): 128, ("16", 128): 128, ("16", 256): 64,
           ("widen", 64): 128, ("widen", 128): 128, ("widen", 256): 64,
           ("fp8", 64): 128, ("fp8", 128): 128, ("fp8", 256): 64}
# the consumers' schedule per (kv kind, head dim), as (overlap, pingpong) fields: serial (neither),
# overlap (QK of tile n with PV of n-1) or pingpong (overlap, and the two warpgroups take turns).
# The fastest at the default tiling in the H200 sweep wherever it beat FA3's choice (pingpong at
# D <= 128, overlap at 256) by >= 2.5 % on both shapes and 3 % in all; bit-identical outputs:
# docs/design/sm90-prefill.md#tuning-sweep
CONSUMER_SCHEDULES = {"pingpong": dict(overlap=True, pingpong=True), "overlap": dict(overlap=True, pingpong=False),
                      "serial": dict(overlap=False, pingpong=False)}
_SCHEDULE = {("16", 64): "overlap", ("16", 128): "pingpong", ("16", 256): "overlap",
             ("widen", 64): "serial", ("widen", 128): "serial", ("widen", 256): "serial",
             ("fp8", 64): "overlap", ("fp8", 128): "pingpong", ("fp8", 256): "serial"}
# setmaxnreg targets (producer, consumer) within the launch's REGS_PER_THREAD x 384: the TMA-only
# producer needs 32 (24 spilled), the rewriting producer warpgroup 56
_REGS = {"16": (32, 232), "widen": (56, 224), "fp8": (56, 224)}
# registers per thread a 384-thread launch gets (64K / 384 rounded down to 8): setmaxnreg only moves
# registers within the CTA's allocation, and an increase beyond it waits forever
REGS_PER_THREAD = hw.REGISTERS_PER_SM // NUM_THREADS // 8 * 8


def schedule_name(overlap: bool, pingpong: bool) -> str:
    """The :data:`CONSUMER_SCHEDULES` name of a config's (``overlap``, ``pingpong``) fields."""
    return "pingpong" if pingpong else "overlap" if overlap else "serial"


def default_schedule(kind: str, head_dim: int) -> str:
    """The consumer schedule :func:`make_prefill_config` gives a (kind, head dim) by default."""
    return _SCHEDULE[(kind, head_dim)]


def kv_kind(q_dtype: str, kv_dtype: str) -> str:
    if kv_dtype != "fp8_e4m3":
        return "16"
    return "fp8" if q_dtype == "fp8_e4m3" else "widen"


def default_vt_transpose(kind: str) -> str:
    """``vt_transpose`` of a config that names none: ``"ldsm"`` for the FP8 query, else ``"words"``."""
    return "ldsm" if kind == "fp8" else "words"


@dataclass(frozen=True)
class Sm90PrefillConfig(KernelConfig):
    """Compile key of :class:`cute_kernels.sm90.prefill.Sm90PagedPrefill`; the instance is the key.

    Problem: ``q_dtype`` (bf16/fp16, or fp8_e4m3 for an FP8 query), ``kv_dtype`` (the query's
    16-bit dtype, or fp8_e4m3), ``out_dtype`` (16-bit; the query's dtype for a 16-bit query),
    ``head_dim``, ``group`` (Hq / Hkv), ``page_size``, ``kv_form`` ("single" ``[P, 2, ...]`` or
    "pair" of K and V tensors), ``kv_layout`` ("HND"/"NHD"), ``causal``, ``write_lse`` (no LSE
    argument when False), ``k_scale_tensor`` / ``v_scale_tensor`` (a 1-element fp32 tensor
    instead of a float), ``q_scale`` (FP8 query only, :data:`Q_SCALE_KINDS`).

    Tuning: ``tile_n`` KV tokens per tile; ``stages`` K/V stages the consumers read (16-bit or,
    for FP8 KV, the widened / transposed copies); ``staging`` FP8 stages TMA writes before the
    producer warpgroup widens or transposes them (0 for a 16-bit cache); ``overlap``: each
    consumer warpgroup issues tile n's QK with tile n-1's PV and runs the softmax while PV is in
    the tensor cores (FA3's intra-warpgroup overlap); ``pingpong``: the two consumer warpgroups
    take turns issuing their WGMMAs (named barriers), so one's softmax overlaps the other's MMAs;
    ``producer_regs`` / ``consumer_regs``: ``setmaxnreg`` targets (three warpgroups share 64K).

    Schedule: ``persistent`` launches a fixed grid (the runtime ``num_ctas``: SMs x
    :data:`CTAS_PER_SM`) whose CTAs walk the (query block, request, head) tiles longest first
    (:func:`cta_walk`; opt-in: docs/design/sm90-prefill.md#scheduling).
    ``epilogue``: how O is written (:data:`EPILOGUES`; ``"smem"`` opt-in). Both are available,
    verified by the GPU suite on the H200 like the default.

    ``q_terms`` (FP8 query only, :data:`Q_TERMS`): 2 takes a ``q_residual`` argument (the e4m3
    residual of the quantized query, same ``q_scale``) loaded by TMA next to the query, and issues
    QK once per term into one accumulator (opt-in, compile-verified only).

    ``vt_transpose`` (:data:`VT_TRANSPOSES`): how the FP8 query's producer writes V^T; by default
    (empty: :func:`default_vt_transpose`, resolved at construction) ``"ldsm"``, by ``ldmatrix.trans``
    + ``stmatrix``; ``"words"`` by 4-byte words (the opt-out, ``sm90.prefill_fp8q_words``). The
    other kinds take ``"words"`` only. A label names it only where it is not the kind's default.

    ``lean_softmax`` (the default; ``False`` is the opt-out ``sm90.prefill_scaled_softmax``): the
    softmax's max over the raw scores and one FFMA per score before its exp2 (instead of a multiply,
    the max, then a subtract), for an FP8 query P's ``2^P_SHIFT`` taken from the exponent instead of
    a multiply per score, and O's rescale skipped by a warp when no max of its rows moved:
    docs/design/sm90-prefill.md#the-lean-softmax.

    Features (:func:`feature_variants`): ``window`` takes a runtime
    ``window_left`` (-1: none) and walks only the KV tiles a block's rows see; ``sinks`` takes fp32
    ``[Hq]`` sink logits: docs/design/sm90-prefill.md#sliding-window-and-sinks.
    """

    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    out_dtype: str = "bf16"
    head_dim: int = 128
    group: int = 8
    page_size: int = 16
    kv_form: str = "single"
    kv_layout: str = "HND"
    causal: bool = True
    write_lse: bool = True
    k_scale_tensor: bool = False
    v_scale_tensor: bool = False
    q_scale: str = "none"
    tile_n: int = 128
    stages: int = 2
    staging: int = 0
    overlap: bool = True
    pingpong: bool = True
    producer_regs: int = 32
    consumer_regs: int = 232
    window: bool = False
    sinks: bool = False
    persistent: bool = field(default=False, metadata=LABEL_IF_SET)
    epilogue: str = field(default="registers", metadata=LABEL_IF_SET)
    q_terms: int = field(default=1, metadata=LABEL_IF_SET)
    vt_transpose: str = field(default="", metadata=LABEL_IF_SET)
    lean_softmax: bool = field(default=True, metadata=LABEL_IF_SET)

    kernel_id = "sm90.prefill"
    targets = ("sm_90a",)
    # what the kernel reads from its config (kernels never import plans)
    hw: ClassVar[ModuleType] = hw
    tile_m: ClassVar[int] = TILE_M
    num_threads: ClassVar[int] = NUM_THREADS

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"sm90.prefill: {msg}")

        if not self.vt_transpose:  # the kind's default, resolved once: equal configs compile alike
            object.__setattr__(self, "vt_transpose", default_vt_transpose(self.kind))
        if self.q_dtype not in Q_DTYPES or self.kv_dtype not in KV_DTYPES or self.out_dtype not in OUT_DTYPES:
            bad(f"dtypes q={self.q_dtype} kv={self.kv_dtype} out={self.out_dtype} not supported")
        if self.q_dtype == "fp8_e4m3":
            if self.kv_dtype != "fp8_e4m3":
                bad("an FP8 query needs an FP8 KV cache")
            if self.q_scale not in ("scalar", "tensor", "per_head"):
                bad(f"an FP8 query needs q_scale in ('scalar', 'tensor', 'per_head'), got {self.q_scale!r}")
        else:
            if self.q_scale != "none":
                bad("q_scale applies only to an FP8 query")
            if self.out_dtype != self.q_dtype:
                bad(f"a {self.q_dtype} query writes {self.q_dtype} output, got out_dtype={self.out_dtype}")
            if self.kv_dtype != "fp8_e4m3" and self.kv_dtype != self.q_dtype:
                bad("a 16-bit KV cache must have the query's dtype")
        if self.q_terms not in Q_TERMS or (self.q_terms > 1 and self.kind != "fp8"):
            bad(f"q_terms must be one of {Q_TERMS}, and 2 only for an FP8 query, got {self.q_terms}")
        if self.vt_transpose not in VT_TRANSPOSES or (self.vt_transpose != "words" and self.kind != "fp8"):
            bad(f"vt_transpose must be one of {VT_TRANSPOSES}, and 'ldsm' only for an FP8 query (its default), "
                f"got {self.vt_transpose!r}")
        if self.head_dim not in HEAD_DIMS:
            bad(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.page_size not in PAGE_SIZES:
            bad(f"page_size must be one of {PAGE_SIZES}, got {self.page_size}")
        if not 1 <= self.group <= MAX_GROUP:
            bad(f"group (Hq / Hkv) must be in [1, {MAX_GROUP}], got {self.group}")
        if self.kv_form not in KV_FORMS or self.kv_layout not in KV_LAYOUTS:
            bad(f"kv_form/kv_layout {self.kv_form}/{self.kv_layout} not supported")
        k_step = 32 if self.kind == "fp8" else 16
        if self.tile_n % k_step or not 16 <= self.tile_n <= 256:
            bad(f"tile_n must be a multiple of {k_step} in [16, 256], got {self.tile_n}")
        if self.tile_n % self.page_size and self.page_size % self.tile_n:
            bad(f"tile_n {self.tile_n} and page_size {self.page_size}: one must divide the other")
        if self.stages < 1 or (self.kind != "16") != (self.staging > 0):
            bad(f"stages {self.stages} / staging {self.staging}: staging is for FP8 caches only")
        if any(r % 8 or not 24 <= r <= 256 for r in (self.producer_regs, self.consumer_regs)) or (
                WARPGROUP * self.producer_regs + 2 * WARPGROUP * self.consumer_regs > NUM_THREADS * REGS_PER_THREAD):
            bad(f"registers {self.producer_regs}/{self.consumer_regs} (producer/consumer) exceed the launch's "
                f"{REGS_PER_THREAD} x {NUM_THREADS}")
        if self.pingpong and not self.overlap:
            bad("pingpong takes turns between overlapped consumers (overlap=True)")
        if smem_bytes(self) > SMEM_BUDGET:
            bad(f"{smem_bytes(self)} bytes of shared memory exceed {SMEM_BUDGET}")
        if self.persistent and (self.window or self.sinks):
            bad("the persistent schedule takes no window or sinks (not compiled with them)")
        if self.epilogue not in EPILOGUES:
            bad(f"epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if self.epilogue == "smem":
            if self.persistent:
                # the next tile's query and K/V loads reuse every buffer the O tile could take
                bad("the persistent schedule keeps the register epilogue (epilogue='registers')")
            if self.kind == "fp8" and self.stages * self.tile_n < 2 * hw.WGMMA_M:
                # an FP8 query's O tile (64 x D, 2 bytes) takes a K or a V stage buffer (1 byte per element)
                bad(f"epilogue='smem' with an FP8 query needs stages * tile_n >= {2 * hw.WGMMA_M}")

    def label_default(self, f: Field) -> Any:
        """The label leaves out the kind's own transpose (:func:`default_vt_transpose`)."""
        return default_vt_transpose(self.kind) if f.name == "vt_transpose" else f.default

    # ---- derived ----
    @property
    def kind(self) -> str:
        """"16", "widen" or "fp8" (see :func:`kv_kind`)."""
        return kv_kind(self.q_dtype, self.kv_dtype)

    @property
    def mma_dtype(self) -> str:
        """The WGMMA operand type: the query's 16-bit type, fp16 for widened FP8 K/V, or e4m3."""
        return {"16": self.q_dtype, "widen": "fp16", "fp8": "fp8_e4m3"}[self.kind]

    @property
    def box(self) -> int:
        """KV tokens per TMA box: one page, or a tile-sized piece of a larger page."""
        return min(self.page_size, self.tile_n)

    @property  # per instance (the base: a class constant)
    def evidence(self) -> dict[str, tuple[tuple[str, str], ...]]:  # type: ignore[override]
        """WGMMA with the operand types this variant claims, the PV one with P from registers (an
        RS WGMMA: a register list for A), TMA loads and mbarrier waits."""
        if self.kind == "fp8":
            name, ops = "e4m3", r"k32\.f32\.e4m3\.e4m3"
        else:
            name = {"bf16": "bf16", "fp16": "f16"}[self.mma_dtype]
            ops = r"k16\.f32\." + {"bf16": r"bf16\.bf16", "fp16": r"f16\.f16"}[self.mma_dtype]
        wgmma = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+" + ops
        smem_epilogue = ((("O in 16-byte stores", r"st\.global\.v4\.b32"),) if self.epilogue == "smem" else ())
        vt_ldsm = ((("V^T ldmatrix.trans", r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16"),
                    ("V^T stmatrix", r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16"))
                   if self.vt_transpose == "ldsm" else ())
        return {"sm_90a": ((f"wgmma.mma_async {name}", wgmma), (f"wgmma {name} with P from registers",
                                                                 wgmma + r" +\{[^}]*\}, *\{"),
                           ("TMA load", r"cp\.async\.bulk\.tensor"), ("mbarrier.try_wait", r"mbarrier\.try_wait"),
                           *smem_epilogue, *self._two_term_evidence(wgmma), *vt_ldsm)}

    def _two_term_evidence(self, wgmma: str) -> tuple[tuple[str, str], ...]:
        """Two terms: a QK group of both terms' SS WGMMAs (2 x D/32 of N ``tile_n``, shared-memory
        descriptors for A) with no other WGMMA or commit between them."""
        if self.q_terms == 1:
            return ()
        qk = wgmma.replace(r"m64n\d+", f"m64n{self.tile_n}") + r" +\{[^}]*\}, *%rd"
        steps = self.q_terms * self.head_dim // 32
        return (("QK group of both query terms", f"(?:{qk}(?:(?!wgmma\\.)[\\s\\S])*){{{steps}}}wgmma\\.commit_group"),)

    def signature(self):
        """Call arguments, in order (the op binds them by name)."""
        D = self.head_dim
        caches = kv_cache_args(self.kv_form, self.kv_layout, self.kv_dtype, self.page_size, D)
        q_scale: tuple[Arg, ...] = ()
        if self.q_scale in ("scalar", "tensor"):
            q_scale = (scale_arg("q_scale", self.q_scale == "tensor"),)
        elif self.q_scale == "per_head":
            q_scale = (TensorArg("q_scale", "fp32", ("Hkv",), align=4),)
        lse = (TensorArg("lse", "fp32", ("T", "Hq"), align=4),) if self.write_lse else ()
        residual = (TensorArg("q_residual", self.q_dtype, ("T", "Hq", D)),) if self.q_terms == 2 else ()
        return (
            TensorArg("q", self.q_dtype, ("T", "Hq", D)),  # TMA: 16-byte aligned base and strides
            *residual,
            *caches,
            TensorArg("block_table", "int32", ("B", "W"), align=4),
            TensorArg("seq_lens", "int32", ("B",), align=4),
            TensorArg("query_start_loc", "int32", ("B1",), align=4),  # B + 1 entries
            TensorArg("out", self.out_dtype, ("T", "Hq", D)),
            *lse,
            scale_arg("k_scale", self.k_scale_tensor),
            scale_arg("v_scale", self.v_scale_tensor),
            *q_scale,
            ScalarArg("sm_scale", "fp32"),
            ScalarArg("max_query_len", "int32"),
            *((TensorArg("sinks", "fp32", ("Hq",), align=4),) if self.sinks else ()),
            *((ScalarArg("window_left", "int32"),) if self.window else ()),
            # the persistent grid's CTAs (persistent_ctas of the device's SM count)
            *((ScalarArg("num_ctas", "int32"),) if self.persistent else ()),
        )

    def build(self):
        from ..sm90.prefill import Sm90PagedPrefill  # kernels < plans: the allowed direction

        return Sm90PagedPrefill(self)


def smem_bytes(cfg: Sm90PrefillConfig) -> int:
    """Shared memory of one CTA: Q, the stages the consumers read, the FP8 staging, the reserve."""
    D, n = cfg.head_dim, cfg.tile_n
    mma_bytes = 1 if cfg.kind == "fp8" else 2
    kv_bytes = 1 if cfg.kv_dtype == "fp8_e4m3" else 2
    q = TILE_M * D * mma_bytes * cfg.q_terms
    consumer_stages = cfg.stages * 2 * n * D * mma_bytes  # K and V (or V^T) of each stage
    staging = cfg.staging * (2 if cfg.kind == "widen" else 1) * n * D * kv_bytes  # FP8: K+V, or V only
    return q + consumer_stages + staging + SMEM_RESERVE


def _tuning(kind: str, head_dim: int) -> tuple[int, int, int]:
    """(tile_n, stages, staging): the deepest pipeline that fits, consumer stages first."""
    tile_n = _TILE_N[(kind, head_dim)]
    probe: dict[str, Any] = dict(q_dtype={"16": "bf16", "widen": "bf16", "fp8": "fp8_e4m3"}[kind],
                                 kv_dtype="bf16" if kind == "16" else "fp8_e4m3", out_dtype="bf16",
                                 head_dim=head_dim, q_scale="scalar" if kind == "fp8" else "none", tile_n=tile_n)
    best = None
    for stages in (4, 3, 2, 1):
        for staging in ((0,) if kind == "16" else (2, 1)):
            if stages > 2 and head_dim > 64:
                continue  # two stages already cover the TMA latency at D >= 128 (FA3's choice)
            try:
                Sm90PrefillConfig(**probe, stages=stages, staging=staging)
            except ValueError:
                continue
            best = best or (tile_n, stages, staging)
    if best is None:
        raise ValueError(f"no tiling fits shared memory for {kind} D={head_dim}")
    return best


def make_prefill_config(*, q_dtype: str, kv_dtype: str, head_dim: int, group: int, page_size: int,
                        out_dtype: str | None = None, kv_form: str = "single", kv_layout: str = "HND",
                        causal: bool = True, write_lse: bool = True, k_scale_tensor: bool = False,
                        v_scale_tensor: bool = False, q_scale: str | None = None,
                        **override: Any) -> Sm90PrefillConfig:
    """The config the op, the warm-up and the compile matrix use for a problem: tuning filled in
    here, once. ``out_dtype`` defaults to the query's dtype (bf16 for an FP8 query); ``q_scale``
    to "scalar" for an FP8 query. ``override`` replaces tuning fields (benchmarks, tests); the consumer
    schedule is :func:`default_schedule`'s unless ``overlap`` / ``pingpong`` are overridden."""
    fp8_q = q_dtype == "fp8_e4m3"
    out_dtype = out_dtype or ("bf16" if fp8_q else q_dtype)
    q_scale = q_scale or ("scalar" if fp8_q else "none")
    kind = kv_kind(q_dtype, kv_dtype)
    tile_n, stages, staging = _tuning(kind, head_dim)
    tile_n = override.pop("tile_n", tile_n)
    if tile_n % page_size and page_size % tile_n:
        tile_n = page_size  # e.g. 96-token tiles on 64-token pages
    producer_regs, consumer_regs = _REGS[kind]
    schedule = dict(CONSUMER_SCHEDULES[default_schedule(kind, head_dim)])
    # one schedule field overridden alone takes the other with it: pingpong needs overlap, and no
    # overlap means no pingpong
    if override.get("pingpong"):
        schedule["overlap"] = True
    if override.get("overlap") is False:
        schedule["pingpong"] = False
    fields_: dict[str, Any] = dict(
        q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype, head_dim=head_dim, group=group,
        page_size=page_size, kv_form=kv_form, kv_layout=kv_layout, causal=causal, write_lse=write_lse,
        k_scale_tensor=k_scale_tensor, v_scale_tensor=v_scale_tensor, q_scale=q_scale, tile_n=tile_n,
        stages=stages, staging=staging, producer_regs=producer_regs, consumer_regs=consumer_regs, **schedule)
    if override.get("window") or override.get("sinks"):
        override.pop("persistent", None)  # not with a window or sinks: those calls keep the default grid
    fields_.update(override)
    return Sm90PrefillConfig(**fields_)


def num_m_blocks(max_query_len: int) -> int:
    return max(0, (max_query_len + TILE_M - 1) // TILE_M)


def grid(num_q_heads: int, batch: int, max_query_len: int) -> tuple[int, int, int]:
    """The launch grid (computed inside the kernel's host function from the same values):
    x = query head (fastest, so the heads of one KV group run together and share K/V in L2),
    y = query block (reversed inside the kernel: longest first), z = request."""
    return num_q_heads, num_m_blocks(max_query_len), batch


# ---- the persistent schedule (docs/design/sm90-prefill.md#scheduling) ----
# 384 threads x REGS_PER_THREAD registers take the SM's whole register file: one CTA per SM
CTAS_PER_SM = hw.REGISTERS_PER_SM // (NUM_THREADS * REGS_PER_THREAD)


def persistent_ctas(num_sms: int) -> int:
    """The ``num_ctas`` argument of a persistent launch: one wave of resident CTAs."""
    if num_sms < 1:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    return num_sms * CTAS_PER_SM


def persistent_grid(num_ctas: int, num_q_heads: int, batch: int, max_query_len: int) -> int:
    """The persistent launch's grid x (computed inside the kernel's host function from the same
    values): ``num_ctas``, no more than there are tiles, at least one."""
    tiles = num_q_heads * max(num_m_blocks(max_query_len), 1) * batch
    return max(min(num_ctas, tiles), 1)


def cta_walk(cta: int, num_ctas: int, num_q_heads: int, q_lens, max_query_len: int):
    """The ``(m_block, request, head)`` tiles CTA ``cta`` of a persistent launch works on, in
    order: tiles ``cta, cta + grid, ...`` of the longest-first order (:func:`persistent_tile`),
    without those past their request's rows (which the kernel skips after reading
    ``query_start_loc``). ``q_lens``: each request's new tokens, as the kernel reads them."""
    batch = len(q_lens)
    m_blocks = max(num_m_blocks(max_query_len), 1)
    step = persistent_grid(num_ctas, num_q_heads, batch, max_query_len)
    out = []
    for t in range(cta, num_q_heads * m_blocks * batch, step):
        m_block, b, head = persistent_tile(t, num_q_heads, batch, m_blocks)
        if m_block * TILE_M < q_lens[b]:
            out.append((m_block, b, head))
    return out


# ---------------------------------------------------------------------------------------------
# runtime self-check families, compile variants, the variants a model shape reaches
# ---------------------------------------------------------------------------------------------


def registry_id(q_dtype: str, kv_dtype: str) -> str:
    """The registry entry a (query, cache) dtype pair runs: the FP8-query kernel, or the other."""
    return "sm90.prefill_fp8q" if kv_kind(q_dtype, kv_dtype) == "fp8" else "sm90.prefill"


def config_family(config: Sm90PrefillConfig) -> str:
    """A variant's self-check family: :func:`family`, and its scaled-score softmax (the opt-out), its
    second query term, its word-wise V^T transpose, its window / sink features, its persistent schedule
    or its shared-memory epilogue if any."""
    features = "+".join(name for name, on in (("scaled_softmax", not config.lean_softmax),
                                              ("two_term", config.q_terms == 2),
                                              ("vt_words", config.vt_transpose != default_vt_transpose(config.kind)),
                                              ("window", config.window), ("sinks", config.sinks),
                                              ("persistent", config.persistent),
                                              ("smem_epilogue", config.epilogue == "smem")) if on)
    base = family(config.q_dtype, config.kv_dtype, config.head_dim)
    return f"{base}/{features}" if features else base


def check_registry_id(config: Sm90PrefillConfig) -> str:
    """The registry entry whose status says whether ``config`` still needs its self-check."""
    if config.q_terms == 2:  # compile-verified: its check runs whatever else the variant has
        return TWO_TERM_ID
    if not config.lean_softmax:  # the former default's entry, with whatever verified feature it has
        return SCALED_SOFTMAX_ID
    if config.persistent:
        return PERSISTENT_ID
    if config.epilogue == "smem":
        return EPILOGUE_ID
    if config.window or config.sinks:
        return FEATURES_ID
    if config.vt_transpose != default_vt_transpose(config.kind):
        return VT_WORDS_ID
    return registry_id(config.q_dtype, config.kv_dtype)


FEATURES_ID = "sm90.prefill_window_sinks"
PERSISTENT_ID = "sm90.prefill_persistent"
EPILOGUE_ID = "sm90.prefill_smem_epilogue"
TWO_TERM_ID = "sm90.prefill_fp8x2"
VT_WORDS_ID = "sm90.prefill_fp8q_words"
SCALED_SOFTMAX_ID = "sm90.prefill_scaled_softmax"


def family(q_dtype: str, kv_dtype: str, head_dim: int) -> str:
    """The runtime self-check family of a (query, cache) dtype pair and head dim: its registry id,
    its kind (the MMA path: 16-bit K/V, FP8 widened, FP8 query) and its head dim (which sets the
    tile and the consumer schedule), e.g. ``"sm90.prefill/widen/d128"``."""
    return f"{registry_id(q_dtype, kv_dtype)}/{kv_kind(q_dtype, kv_dtype)}/d{head_dim}"


def _variant(q, kv, d, g, page, **kw) -> Sm90PrefillConfig:
    return make_prefill_config(q_dtype=q, kv_dtype=kv, head_dim=d, group=g, page_size=page, **kw)


def compile_variants() -> list[Sm90PrefillConfig]:
    """``sm90.prefill``'s compile matrix: each head dim of the 16-bit and the FP8-widened kinds
    (a bf16 query narrowed to fp16, and an fp16 one), with both layouts and containers, scale
    tensors, causal and not, with and without LSE; a consumer schedule other than the default once
    per kind (16-bit D 128 serial, widened D 128 pingpong)."""
    return [
        _variant("bf16", "bf16", 128, 8, 16),
        _variant("fp16", "fp16", 64, 4, 32, kv_form="pair", kv_layout="NHD", causal=False),
        _variant("bf16", "bf16", 256, 1, 128, write_lse=False),
        _variant("bf16", "bf16", 128, 8, 16, **CONSUMER_SCHEDULES["serial"]),
        _variant("bf16", "fp8_e4m3", 128, 8, 16),
        _variant("bf16", "fp8_e4m3", 128, 8, 16, **CONSUMER_SCHEDULES["pingpong"]),
        _variant("fp16", "fp8_e4m3", 64, 16, 64, kv_layout="NHD", k_scale_tensor=True, v_scale_tensor=True),
        _variant("bf16", "fp8_e4m3", 256, 4, 32, kv_form="pair", causal=False),
    ]


def _opt_in_variants(**on: Any) -> list[Sm90PrefillConfig]:
    """An opt-in field's compile matrix at the default tiling: 16-bit, FP8 widened and FP8 query at
    D 128, 16-bit D 64 and widened D 256."""
    return [
        _variant("bf16", "bf16", 128, 8, 16, **on),
        _variant("bf16", "fp8_e4m3", 128, 8, 16, **on),
        _variant("fp8_e4m3", "fp8_e4m3", 128, 8, 16, q_scale="scalar", **on),
        _variant("fp16", "fp16", 64, 4, 32, kv_form="pair", kv_layout="NHD", causal=False, **on),
        _variant("bf16", "fp8_e4m3", 256, 4, 32, kv_form="pair", write_lse=False, **on),
    ]


def scaled_softmax_variants() -> list[Sm90PrefillConfig]:
    """The former default softmax's compile matrix (registry id ``sm90.prefill_scaled_softmax``, the
    opt-out ``lean_softmax=False``): the opt-in set, the FP8 query at D 64 and D 256 (each
    ``q_scale`` form), and with a window and sinks."""
    off = dict(lean_softmax=False)
    return [*_opt_in_variants(**off), *fp8_query_compile_variants(**off)[1:],
            _variant("fp8_e4m3", "fp8_e4m3", 128, 8, 16, q_scale="scalar", window=True, sinks=True, **off),
            _variant("bf16", "bf16", 128, 8, 16, window=True, sinks=True, **off)]


def persistent_variants() -> list[Sm90PrefillConfig]:
    """The persistent schedule's compile matrix (registry id ``sm90.prefill_persistent``)."""
    return _opt_in_variants(persistent=True)


def epilogue_variants() -> list[Sm90PrefillConfig]:
    """The shared-memory epilogue's compile matrix (registry id ``sm90.prefill_smem_epilogue``)."""
    return _opt_in_variants(epilogue="smem")


def fp8_query_compile_variants(**on: Any) -> list[Sm90PrefillConfig]:
    """``sm90.prefill_fp8q``'s compile matrix: each head dim (tile_n 128 / 128 / 64: both V^T
    swizzles), each ``q_scale`` form, fp16 output once."""
    return [
        _variant("fp8_e4m3", "fp8_e4m3", 128, 8, 16, q_scale="scalar", **on),
        _variant("fp8_e4m3", "fp8_e4m3", 64, 8, 128, q_scale="tensor", kv_form="pair", kv_layout="NHD", **on),
        _variant("fp8_e4m3", "fp8_e4m3", 256, 4, 16, q_scale="per_head", out_dtype="fp16", write_lse=False, **on),
    ]


def vt_words_variants() -> list[Sm90PrefillConfig]:
    """The word-wise V^T transpose's compile matrix (registry id ``sm90.prefill_fp8q_words``): the
    FP8 query's variants with ``vt_transpose="words"`` (the two-term one is in :func:`two_term_variants`)."""
    return fp8_query_compile_variants(vt_transpose="words")


def two_term_variants() -> list[Sm90PrefillConfig]:
    """The two-term FP8 query's compile matrix (registry id ``sm90.prefill_fp8x2``): each head dim
    at its default tiling (every one fits shared memory: Q doubles to 16 / 32 / 64 KB), each
    ``q_scale`` form, both containers and layouts, causal and not, with and without LSE; and D 128
    with the word-wise V^T transpose (its self-check is the two-term entry's)."""
    return [
        _variant("fp8_e4m3", "fp8_e4m3", 128, 8, 16, q_scale="scalar", q_terms=2),
        _variant("fp8_e4m3", "fp8_e4m3", 128, 8, 16, q_scale="scalar", q_terms=2, vt_transpose="words"),
        _variant("fp8_e4m3", "fp8_e4m3", 64, 8, 128, q_scale="tensor", kv_form="pair", kv_layout="NHD",
                 causal=False, q_terms=2),
        _variant("fp8_e4m3", "fp8_e4m3", 256, 4, 16, q_scale="per_head", out_dtype="fp16", write_lse=False,
                 q_terms=2),
    ]


def feature_variants() -> list[Sm90PrefillConfig]:
    """The window / sink variants' compile matrix (registry id ``sm90.prefill_window_sinks``):
    every kind (16-bit, FP8 widened, FP8 query), both features alone and together, causal and not,
    D 64 / 128 / 256, with and without LSE, the serial consumer schedule once."""
    both = dict(window=True, sinks=True)
    return [
        _variant("bf16", "bf16", 128, 8, 16, **both),
        _variant("bf16", "bf16", 128, 8, 16, overlap=False, pingpong=False, **both),
        _variant("fp16", "fp16", 64, 4, 32, kv_form="pair", kv_layout="NHD", causal=False, window=True),
        _variant("bf16", "fp8_e4m3", 128, 8, 16, **both),
        _variant("bf16", "fp8_e4m3", 256, 4, 32, write_lse=False, sinks=True),
        _variant("fp8_e4m3", "fp8_e4m3", 128, 8, 16, q_scale="scalar", **both),
    ]


_KV_NAMES = {"fp8": "fp8_e4m3", "bf16": "bf16", "fp16": "fp16"}


def prefill_variants(*, head_dim: int, num_q_heads: int, num_kv_heads: int, page_size: int,
                     kv_dtypes=("fp8_e4m3",), q_dtype: str = "bf16", fp8_query: bool = False,
                     q_scale_kinds=("scalar",), scale_tensors=(False, True), kv_layouts=("HND",),
                     kv_forms=("single",), causal=(True,), return_lse=(False,)) -> list[Sm90PrefillConfig]:
    """Every prefill config a model shape can reach: per cache dtype, layout, container, scale form,
    mask and LSE output. ``fp8_query``: for an FP8 cache, the FP8-query kernel's variants (one
    per ``q_scale_kinds``, bf16 output: what :class:`dispatch.AttentionLayer` launches when the
    prefill plan computes QK in FP8) instead of the BF16-query ones."""
    out: list[Sm90PrefillConfig] = []
    group = num_q_heads // num_kv_heads
    for kv, st, layout, form, mask, lse in product(kv_dtypes, scale_tensors, kv_layouts, kv_forms, causal,
                                                    return_lse):
        kv = _KV_NAMES.get(kv, kv)
        fields_ = dict(kv_dtype=kv, head_dim=head_dim, group=group, page_size=page_size, kv_form=form,
                       kv_layout=layout, causal=mask, write_lse=lse, k_scale_tensor=st, v_scale_tensor=st)
        if fp8_query and kv == "fp8_e4m3":
            out += [make_prefill_config(q_dtype="fp8_e4m3", out_dtype=q_dtype, q_scale=qs, **fields_)
                    for qs in q_scale_kinds]
        else:
            out.append(make_prefill_config(q_dtype=q_dtype, **fields_))
    return out
