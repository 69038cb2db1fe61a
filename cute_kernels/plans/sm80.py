"""Plan of the portable SM80-class kernels (``sm80.decode``, ``sm80.prefill``): their configs
(compile key and call signature), limits, tiling and ring depth per target, the split schedule
and the warm-up's variants (the compile matrix: :mod:`.sm80_matrix`).

Host-only. The kernels are :mod:`cute_kernels.sm80.decode` and :mod:`cute_kernels.sm80.prefill`;
the shared-memory capacity of each target comes from :mod:`.hw`. Design: docs/design/sm80.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product
from typing import Any, ClassVar

from ..jit.spec import ALL_TARGETS, LABEL_IF_SET, KernelConfig, ScalarArg, TensorArg
from . import hw
from .merge_states import MergeStatesConfig
from .paged_cache import kv_cache_args, scale_arg
from .sm90_decode import MERGE_GROUP

# mma.sync / ldmatrix / cp.async exist on every target from SM80 on
TARGETS = ALL_TARGETS
CVT_TARGETS = hw.FP8_CVT_TARGETS  # where the "cvt" FP8 widening exists
PDL_TARGETS = hw.PDL_TARGETS

# ------------------------------------------------------------------------------------------------
# Limits: the registry, the dispatcher and the ops state exactly these
# ------------------------------------------------------------------------------------------------
Q_DTYPES = ("bf16", "fp16")
KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")
# (query, cache) pairs of different 16-bit types that run exactly (a bf16 query scaled per row
# into an fp16 MMA); fp16 -> bf16 is not exact, so the reverse pair is refused
MIXED_16BIT = (("bf16", "fp16"),)
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32, 64, 128)
KV_LAYOUTS = ("HND", "NHD")
MAX_DECODE_ROWS = 64  # group x q_len: four 16-row MMA tiles, one per warp row
MAX_SPLITS = 64

EVIDENCE = (
    ("mma.sync m16n8k16", r"mma\.sync\.aligned\.m16n8k16"),
    ("ldmatrix", r"ldmatrix\.sync\.aligned"),
    ("cp.async 16-byte gather", r"cp\.async\.cg\.shared\.global"),
)
CVT_EVIDENCE = ("cvt e4m3x2 -> f16x2", r"cvt\.rn\.f16x2\.e4m3x2")
MERGE_EVIDENCE = ("fused merge arrival atomic", r"atom\.global\.acq_rel\.add")


def mma_dtype(q_dtype: str, kv_dtype: str) -> str:
    """The MMA operand type: the cache's for a 16-bit cache of the query's type; fp16 for an FP8
    cache (exact widening) and for a bf16 query against an fp16 cache (query scaled per row by a
    power of two). A bf16 cache with an fp16 query is refused (fp16 -> bf16 is not exact)."""
    if kv_dtype == "fp8_e4m3" or kv_dtype == q_dtype == "fp16" or (q_dtype, kv_dtype) in MIXED_16BIT:
        return "fp16"
    if kv_dtype == q_dtype == "bf16":
        return "bf16"
    raise ValueError(f"a {kv_dtype} cache with a {q_dtype} query is not supported (no exact common 16-bit type)")


@dataclass(frozen=True)
class _Sm80Common(KernelConfig):
    """Fields both kernels share. ``warps_m x warps_n`` warps; ``m_tiles`` 16-row MMA tiles per
    warp; ``tw`` tokens per warp and stage (a stage holds ``warps_n * tw`` tokens); ``stages``
    cp.async ring depth; ``q_regs`` keeps Q's fragments in registers; ``widen`` ("bits" or "cvt",
    FP8 caches); ``pdl`` programmatic dependent launch (SM90+ targets only); ``ldsm_xor``: each
    operand's ``ldmatrix`` addresses as one base register XOR a constant per k-step (the 128-row
    prefill's, docs/design/sm80.md#128-row-ctas; the head-dim-256 decode's without spills,
    docs/design/sm80.md#head-dim-256-decode); ``stats_smem`` (prefill): each row's online-softmax
    max and sum in shared memory between tiles, ``gather_one_base``: the page gather's
    shared-memory destinations as one base plus immediates (both for the 64-token 128-row prefill,
    docs/design/sm80.md#64-token-stages-at-head-dim-128); ``lean_softmax``: the softmax's max over
    the raw scores, one FFMA per score before its exp2 and O's rescale skipped by a warp whose rows'
    max did not move (opt-in tuning, docs/design/sm80.md#the-lean-softmax-opt-in); ``kv_first``: the
    ring's first stages' copies issued before the query rows are staged, their latencies overlapped
    (opt-in, docs/design/sm80.md#kv-copies-before-the-query). ``target``: the one
    compile target the tiling was chosen for (the plan sizes the ring by its shared memory)."""

    target: str = "sm_80"
    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    head_dim: int = 128
    page_size: int = 16
    kv_form: str = "single"
    kv_layout: str = "HND"
    k_scale_tensor: bool = False
    v_scale_tensor: bool = False
    warps_m: int = 1
    warps_n: int = 4
    m_tiles: int = 1
    tw: int = 16
    stages: int = 3
    q_regs: bool = True
    widen: str = "bits"
    pdl: bool = False
    ldsm_xor: bool = field(default=False, metadata=LABEL_IF_SET)
    stats_smem: bool = field(default=False, metadata=LABEL_IF_SET)
    gather_one_base: bool = field(default=False, metadata=LABEL_IF_SET)
    lean_softmax: bool = field(default=False, metadata=LABEL_IF_SET)
    kv_first: bool = field(default=False, metadata=LABEL_IF_SET)

    def _validate(self):
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target}")
        if self.fp8 and self.widen == "cvt" and self.target not in CVT_TARGETS:
            raise ValueError(f"the cvt widening needs SM89 or newer, not {self.target}")
        if self.pdl and self.target not in PDL_TARGETS:
            raise ValueError(f"programmatic dependent launch needs SM90 or newer, not {self.target}")
        if self.q_dtype not in Q_DTYPES:
            raise ValueError(f"q dtype must be one of {Q_DTYPES}, got {self.q_dtype}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {self.kv_dtype}")
        mma_dtype(self.q_dtype, self.kv_dtype)
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size must be one of {PAGE_SIZES}, got {self.page_size}")
        if self.kv_form not in ("single", "pair") or self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"bad kv_form/kv_layout {self.kv_form}/{self.kv_layout}")
        if (self.tw % 16 or self.tw < 16 or min(self.warps_m, self.warps_n) < 1 or self.warps_m * self.warps_n > 8
                or self.stages < 2):
            raise ValueError(f"bad tiling: tw {self.tw}, warps {self.warps_m}x{self.warps_n}, stages {self.stages}")
        if self.widen not in ("bits", "cvt"):
            raise ValueError(f"widen must be 'bits' or 'cvt', got {self.widen}")

    def _check_smem(self):
        """After the structural checks: a tiling (an override's) whose CTA cannot launch on its target."""
        if self.smem_bytes() > hw.max_smem_per_cta(self.target):
            raise ValueError(f"the tiling takes {self.smem_bytes()} bytes of shared memory per CTA, more than "
                             f"{self.target}'s {hw.max_smem_per_cta(self.target)}: fewer stages, rows or tokens fit")

    @property
    def mma_dtype(self) -> str:
        return mma_dtype(self.q_dtype, self.kv_dtype)

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def tile(self) -> int:
        return self.tw * self.warps_n

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles * self.warps_m

    @property
    def targets(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.target,)

    @property
    def evidence(self) -> dict[str, tuple[tuple[str, str], ...]]:  # type: ignore[override]
        pairs = EVIDENCE + ((CVT_EVIDENCE,) if self.fp8 and self.widen == "cvt" else ())
        return {t: pairs for t in self.targets}

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA (see the kernels' storage structs)."""
        return smem_bytes(self.head_dim, 1 if self.fp8 else 2, self.tile, self.stages, self.rows, self.warps_n)

    def _caches(self):
        return kv_cache_args(self.kv_form, self.kv_layout, self.kv_dtype, self.page_size, self.head_dim)

    def _scales(self):
        return scale_arg("k_scale", self.k_scale_tensor), scale_arg("v_scale", self.v_scale_tensor)


def smem_bytes(D: int, kv_bytes: int, tile: int, stages: int, rows: int, warps_n: int) -> int:
    """Shared memory of a CTA: the K/V ring (which the fp32 merge rows overlay after the main
    loop; in CTAs of more than 64 rows they overlay the staged query rows as well, as
    ``roles.warp_attention.engine_for`` lays them out), the staged query rows, the per-row
    statistics and logit scales, alignment padding."""
    q = (rows * D * 2 + 1023) // 1024 * 1024
    merge = warps_n * rows * (D + 4) * 4 - (rows * D * 2 if rows > 64 else 0)
    ring = max(stages * 2 * tile * D * kv_bytes, merge)
    ring = (ring + 1023) // 1024 * 1024
    return ring + q + ((2 * warps_n + 1) * rows + rows) * 4


@dataclass(frozen=True)
class Sm80DecodeConfig(_Sm80Common):
    """Compile key of ``sm80.decode``: the KV group's ``group x q_len`` query rows against one
    request's pages. ``split``: fp32 partials ``[S, T, Hq, D]`` and their LSE instead of the
    output, merged by ``common.merge_states`` in a second launch or, ``fused_merge`` (opt-in), by
    the last of a (request, KV head)'s split CTAs to finish
    (:class:`~cute_kernels.roles.split_merge.SplitMerge`, the SM90 decode's global merge: one
    launch, arrival counters in ``counters``)."""

    group: int = 8
    q_len: int = 1
    split: bool = False
    # opt-in: slower than the merge launch wherever measured, with PDL and without
    # (docs/design/sm80.md#the-fused-merge)
    fused_merge: bool = field(default=False, metadata=LABEL_IF_SET)
    page_prefetch: bool = field(default=False, metadata=LABEL_IF_SET)  # docs/design/sm80.md#page-ids-a-tile-ahead
    merge_group: ClassVar[int] = MERGE_GROUP  # splits in flight per thread of the fused merge (the SM90 decode's)

    kernel_id = "sm80.decode"

    def __post_init__(self):
        self._validate()
        if not 1 <= self.group * self.q_len <= MAX_DECODE_ROWS:
            raise ValueError(f"group * q_len must be in [1, {MAX_DECODE_ROWS}]")
        if self.rows < self.group * self.q_len:
            raise ValueError(f"{self.rows} MMA rows cannot hold {self.group} x {self.q_len} query rows")
        if self.stats_smem:
            raise ValueError("stats_smem is a prefill field (the decode merges warps_n > 1 token warps)")
        if self.fused_merge and not self.split:
            raise ValueError("fused_merge merges a split launch's partials: it needs split=True")
        self._check_smem()

    def signature(self):
        D = self.head_dim
        ks, vs = self._scales()
        parts = (TensorArg("part_out", "fp32", ("S", "T", "Hq", D), align=16),
                 TensorArg("part_lse", "fp32", ("S", "T", "Hq"), align=4))
        outs: tuple[TensorArg, ...]
        if self.fused_merge:
            outs = (TensorArg("out", self.q_dtype, ("T", "Hq", D), align=8),
                    TensorArg("lse", "fp32", ("T", "Hq"), align=4),
                    *parts,
                    TensorArg("counters", "int32", ("C",), align=4))  # arrival counters, zero between launches
        elif self.split:
            outs = parts
        else:
            outs = (TensorArg("out", self.q_dtype, ("T", "Hq", D), align=8),
                    TensorArg("lse", "fp32", ("T", "Hq"), align=4))
        return (
            TensorArg("q", self.q_dtype, ("T", "Hq", D)),
            *self._caches(),
            TensorArg("block_table", "int32", ("B", "W"), align=4),
            TensorArg("seq_lens", "int32", ("B",), align=4),
            *outs,
            ks, vs,
            ScalarArg("sm_scale", "fp32"),
        )

    @property
    def evidence(self) -> dict[str, tuple[tuple[str, str], ...]]:  # type: ignore[override]
        more = (MERGE_EVIDENCE,) if self.fused_merge else ()
        return {t: pairs + more for t, pairs in super().evidence.items()}

    def merge_config(self) -> MergeStatesConfig:
        """The merge of a split launch's partials in a second launch (a programmatic dependent
        launch where PDL exists); a ``fused_merge`` launch needs none."""
        return MergeStatesConfig(out_dtype=self.q_dtype, head_dim=self.head_dim, vec=4, pdl=self.pdl)

    def build(self):
        from ..sm80.decode import Sm80PagedDecode  # the kernel module imports the DSL: only here

        return Sm80PagedDecode(self)


# ------------------------------------------------------------------------------------------------
# decode tuning and schedule
# ------------------------------------------------------------------------------------------------

DECODE_CTAS_PER_SM = 2  # the split schedule fills one wave of two CTAs per SM
DECODE_MAX_STAGES = 8
# FP8 caches: 32 tokens per warp and stage (a 16-token FP8 tile is half the bytes of a BF16 one for the same
# per-tile softmax and barrier cost); BF16 caches keep 16 (docs/design/sm80.md#measurements)
DECODE_FP8_TW = 32
# one ldmatrix base per operand from head dim 128 on: D 256 reaches the read roofline with it, FP8 at D 128 is
# as fast or faster, at D 64 it was slower (docs/design/sm80.md#defaults)
DECODE_XOR_MIN_HEAD_DIM = 128
# but not for 16-bit caches at D 128 and one query token here: ptxas spills their split build at GQA 8 with it
# (10 STL), the per-address build of q_len 2 at GQA 4 (10-12 STL) (docs/design/sm80.md#the-swizzle-per-row-length)
DECODE_XOR_16BIT_D128_SPILL_TARGETS = ("sm_100a", "sm_103a")
# page ids a tile ahead: 1.01-1.06x at D 64 / 256, 0.90-1.04x at D 128, not FP8 D 64 on sm_100a (1 STL) (docs/design/sm80.md#page-ids-a-tile-ahead)
DECODE_PAGE_PREFETCH_HEAD_DIMS = (64, 256)
DECODE_PAGE_PREFETCH_SPILLS = (("sm_100a", "fp8_e4m3", 64),)  # (compile target, cache dtype, head dim)


def default_widen(target: str) -> str:
    """FP8 widening: the conversion instruction where it exists, the bit trick before SM89."""
    return "cvt" if target in CVT_TARGETS else "bits"


def decode_tiling(target: str, kv_dtype: str, head_dim: int, rows: int) -> dict:
    """Warp grid and ring of a decode CTA on ``target``: one warp row per 16-row MMA tile, the
    other warps (of up to four) splitting each stage's tokens, 16 each (``DECODE_FP8_TW`` for an
    FP8 cache; decode is memory-bound: each K/V byte is read and widened by one warp only).
    Candidates: 4, 2 or 1 token warps, each sized for 3, 2 or 1 CTAs per SM with the deepest ring
    that fits; the winner keeps the most warps per SM busy up to 8 (two per scheduler), then the
    most K/V bytes in flight per SM (``stages - 1`` tiles per CTA). Q stays in registers up to
    D 128 (at D 256 its 64 registers would crowd out O's 128)."""
    warps_m = max(1, math.ceil(rows / 16))
    kvb = 1 if kv_dtype == "fp8_e4m3" else 2
    tw = DECODE_FP8_TW if kv_dtype == "fp8_e4m3" else 16
    best = None
    for warps_n in (4, 2, 1):
        if warps_m * warps_n > 4:
            continue
        fields = dict(kv_dtype=kv_dtype, head_dim=head_dim, warps_m=warps_m, warps_n=warps_n, m_tiles=1, tw=tw)
        for ctas in (3, 2, 1):
            stages = fit_stages(target, fields, ctas, DECODE_MAX_STAGES)
            if stages is None:
                continue
            in_flight = ctas * (stages - 1) * 2 * tw * warps_n * head_dim * kvb
            key = (min(ctas * warps_m * warps_n, 8), in_flight, warps_n)
            if best is None or key > best[0]:
                best = (key, dict(warps_m=warps_m, warps_n=warps_n, m_tiles=1, tw=tw, stages=stages))
    if best is None:
        raise ValueError(f"no decode tiling of D {head_dim} fits {target}'s shared memory")
    return dict(best[1], q_regs=head_dim <= 128)


def decode_ldsm_xor(target: str, kv_dtype: str, head_dim: int, q_len: int) -> bool:
    """The decode's default ``ldmatrix`` addressing on compile target ``target`` (a spill is its ptxas's)."""
    if head_dim < DECODE_XOR_MIN_HEAD_DIM:
        return False
    return not (head_dim == 128 and kv_dtype != "fp8_e4m3" and q_len == 1
                and target in DECODE_XOR_16BIT_D128_SPILL_TARGETS)


def fit_stages(target: str, cfg_fields: dict, ctas_per_sm: int, max_stages: int) -> int | None:
    """Deepest ring (2 .. max_stages) within the target's per-CTA limit that lets ``ctas_per_sm``
    CTAs share an SM's shared memory (each with the runtime's reservation); None if none does."""
    D, kvb = cfg_fields["head_dim"], (1 if cfg_fields["kv_dtype"] == "fp8_e4m3" else 2)
    tile = cfg_fields["tw"] * cfg_fields["warps_n"]
    rows = 16 * cfg_fields["m_tiles"] * cfg_fields["warps_m"]
    budget = min(hw.max_smem_per_cta(target), hw.SMEM_PER_SM_OF[target] // ctas_per_sm - hw.SMEM_RESERVED_PER_CTA)
    fits = [s for s in range(2, max_stages + 1)
            if smem_bytes(D, kvb, tile, s, rows, cfg_fields["warps_n"]) <= budget]
    return max(fits) if fits else None


def _smem_target(override: dict, target: str) -> str:
    """The target sizing the ring: ``override``'s ``smem_target`` (taken out of it), else ``target``."""
    smem_target = override.pop("smem_target", target)
    if smem_target not in TARGETS:
        raise ValueError(f"smem_target must be one of {TARGETS}, got {smem_target!r}")
    return smem_target


def _scale_fields(kv_dtype: str, target: str) -> dict:
    return dict(widen=default_widen(target) if kv_dtype == "fp8_e4m3" else "bits", pdl=target in PDL_TARGETS)


def make_decode_config(*, target: str, q_dtype: str, kv_dtype: str, head_dim: int, group: int, q_len: int,
                       page_size: int, split: bool, kv_form: str = "single", kv_layout: str = "HND",
                       k_scale_tensor: bool = False, v_scale_tensor: bool = False, **override) -> Sm80DecodeConfig:
    """The config the op, the warm-up and the compile matrix use for a problem on ``target``;
    ``override`` replaces any tuning field (tests force the bit-trick widening, or, with
    ``smem_target``, a ring sized for another target's shared memory: a 99 KB build run on an
    H200; ``ldsm_xor=False``: the per-address ``ldmatrix`` form, the default below D 128;
    ``fused_merge=True``: a split launch's merge in its last CTAs, the opt-in; ``page_prefetch``)."""
    fields = dict(target=target, q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group, q_len=q_len,
                  page_size=page_size, split=split, kv_form=kv_form, kv_layout=kv_layout,
                  k_scale_tensor=k_scale_tensor, v_scale_tensor=v_scale_tensor, **_scale_fields(kv_dtype, target))
    override = dict(override)
    fields.update(decode_tiling(_smem_target(override, target), kv_dtype, head_dim, group * q_len))
    fields.update(ldsm_xor=decode_ldsm_xor(target, kv_dtype, head_dim, q_len), page_prefetch=head_dim in
                  DECODE_PAGE_PREFETCH_HEAD_DIMS and (target, kv_dtype, head_dim) not in DECODE_PAGE_PREFETCH_SPILLS)
    fields.update(override)
    if not split:  # an unsplit launch has nothing to merge, whatever an override says
        fields["fused_merge"] = False
    return Sm80DecodeConfig(**fields)


def decode_splits(items: int, max_context: int, num_sms: int, tile: int, ctas_per_sm: int = DECODE_CTAS_PER_SM,
                  num_splits: int | None = None) -> int:
    """Split count from shapes only (``items`` = requests x KV heads, ``max_context`` from the
    block-table width): enough CTAs for one full wave of ``ctas_per_sm`` per SM, never more
    splits than tiles, at most MAX_SPLITS; a caller's ``num_splits`` wins."""
    if num_splits is not None:
        return num_splits
    slots = num_sms * ctas_per_sm
    if items >= slots:
        return 1
    max_tiles = max(1, math.ceil(max_context / tile))
    return max(1, min(MAX_SPLITS, max_tiles, slots // max(items, 1)))


def fused_merge_trips(config: Sm80DecodeConfig, splits: int) -> int:
    """Dependent L2 round trips per thread of the fused merge (``fused_merge``) of ``splits``
    partials: the CTA's threads share the rows' 4-dim chunks, and each chunk reads its splits
    ``merge_group`` at a time (the measurements: docs/design/sm80.md#the-fused-merge)."""
    chunks = config.group * config.q_len * config.head_dim // 4
    return math.ceil(chunks / config.threads) * math.ceil(splits / config.merge_group)


def plan_decode(config_for, items: int, max_context: int, num_sms: int,
                num_splits: int | None) -> tuple[int, Sm80DecodeConfig]:
    """``(splits, config)`` of one decode launch: ``config_for(split)`` builds the config; the
    unsplit one's tile sizes the split schedule."""
    probe = config_for(False)
    splits = decode_splits(items, max_context, num_sms, probe.tile, num_splits=num_splits)
    return splits, (probe if splits <= 1 else config_for(True))


def decode_variants(*, target: str, head_dim: int, num_q_heads: int, num_kv_heads: int, page_size: int,
                    kv_dtypes=("fp8_e4m3",), q_dtype: str = "bf16", q_lens=(1,), scale_tensors=(False, True),
                    kv_layouts=("HND",), kv_forms=("single",), **override) -> list[KernelConfig]:
    """The ``sm80.decode`` configs (split and not, with the split's merge unless ``fused_merge``)
    that a model shape reaches on ``target`` (the warm-up's list)."""
    group = num_q_heads // num_kv_heads
    out: list[KernelConfig] = []
    merges: list[KernelConfig] = []
    for kv, q_len, split, st, layout, form in product(kv_dtypes, q_lens, (False, True), scale_tensors, kv_layouts,
                                                      kv_forms):
        cfg = make_decode_config(target=target, q_dtype=q_dtype, kv_dtype={"fp8": "fp8_e4m3"}.get(kv, kv),
                                 head_dim=head_dim, group=group, q_len=q_len, page_size=page_size, split=split,
                                 k_scale_tensor=st, v_scale_tensor=st, kv_form=form, kv_layout=layout, **override)
        out.append(cfg)
        if split and not cfg.fused_merge and cfg.merge_config() not in merges:
            merges.append(cfg.merge_config())
    return out + merges


# ------------------------------------------------------------------------------------------------
# prefill
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sm80PrefillConfig(_Sm80Common):
    """Compile key of ``sm80.prefill``: varlen query tiles against paged K/V, FA2-style. A CTA
    takes ``rows`` packed query rows (row p of a request: token p // group, head p % group) of one
    request and KV head. ``causal``: query j of a request sees positions < seq_len - q_len + j + 1
    (else all seq_len). ``write_lse``: the base-2 LSE is an argument and is written.
    ``heads_first``: the grid ``(KV heads, row tiles, requests)``, so that each request's
    longest row tiles of every KV head start first, instead of ``(row tiles, KV heads, requests)``
    (docs/design/sm80.md#the-grid-order). ``pingpong``: the two halves of an eight-warp CTA take
    turns at the tensor pipe, the second half's QK of a tile after the first's, so that one half's
    softmax overlaps the other's MMAs (docs/design/sm80.md#ping-pong-warps). ``max_ctas_per_sm``
    (a measurement knob, 0: off): the launch asks for enough shared memory that at most that many
    CTAs share an SM of ``target``, so that a larger GPU runs a tiling at the occupancy of a target
    with less shared memory (docs/design/sm80.md#ping-pong-in-99-kb). ``ring_release`` (opt-in, ``pingpong``
    only): each stage's copies tracked by an mbarrier, not a CTA barrier per tile, so that only the turns
    pace the halves and one half's QK may overlap the other's PV (docs/design/sm80.md#ping-pong-warps).
    ``q_loads_first``: every load of the query's staging issued before the first is used
    (docs/design/sm80.md#the-query-loads-at-once). ``one_cta_bound``: the launch bound of one CTA per
    SM, so that ptxas does not cap the build at 128 registers (docs/design/sm80.md#the-one-cta-bound).
    ``warp_store`` (opt-in): each warp writes its own rows' output through its staged query rows, with
    no CTA barrier or fp32 merge rows (docs/design/sm80.md#the-output-per-warp)."""

    group: int = 4
    causal: bool = True
    write_lse: bool = False
    heads_first: bool = field(default=False, metadata=LABEL_IF_SET)
    q_loads_first: bool = field(default=False, metadata=LABEL_IF_SET)
    one_cta_bound: bool = field(default=False, metadata=LABEL_IF_SET)
    pingpong: bool = field(default=False, metadata=LABEL_IF_SET)
    max_ctas_per_sm: int = field(default=0, metadata=LABEL_IF_SET)
    ring_release: bool = field(default=False, metadata=LABEL_IF_SET)
    warp_store: bool = field(default=False, metadata=LABEL_IF_SET)

    kernel_id = "sm80.prefill"

    def __post_init__(self):
        self._validate()
        if self.group < 1:
            raise ValueError(f"group must be >= 1, got {self.group}")
        if self.stats_smem and self.warps_n != 1:
            raise ValueError(f"stats_smem needs one token warp, not warps_n={self.warps_n}")
        if self.pingpong and (self.warps_m, self.warps_n) != PINGPONG_WARPS:
            raise ValueError(f"pingpong pairs warps w and w + 4 (one scheduler): it needs warps "
                             f"{PINGPONG_WARPS[0]}x{PINGPONG_WARPS[1]}, not {self.warps_m}x{self.warps_n} "
                             f"(pingpong=False with other warps)")
        if self.ring_release and not (self.pingpong and self.stages == RING_RELEASE_STAGES):
            raise ValueError(f"ring_release frees a stage at the ping-pong turn: it needs pingpong=True and "
                             f"stages={RING_RELEASE_STAGES}, not pingpong={self.pingpong}, stages={self.stages}")
        if self.warp_store and self.warps_n != 1:
            raise ValueError(f"warp_store writes each row from the one warp that holds it: it needs warps_n=1, "
                             f"not {self.warps_n}")
        if self.max_ctas_per_sm < 0:
            raise ValueError(f"max_ctas_per_sm must be >= 0 (0: no cap), got {self.max_ctas_per_sm}")
        self._check_smem()  # the padding under max_ctas_per_sm (>= 1) stays below half the SM's

    def smem_bytes(self) -> int:  # under ring_release with the stages' mbarriers after the rest
        return super().smem_bytes() + (RING_RELEASE_STAGES * 8 if self.ring_release else 0)

    @property
    def ring_suspend(self) -> bool:  # ring_release's wait may suspend the thread (mbarrier.try_wait)
        return self.target in hw.MBARRIER_TRY_WAIT_TARGETS

    def launch_smem_bytes(self) -> int:
        """The dynamic shared memory the launch asks for: :meth:`smem_bytes`, raised under
        ``max_ctas_per_sm`` to one byte past what ``max_ctas_per_sm + 1`` CTAs could share."""
        if not self.max_ctas_per_sm:
            return self.smem_bytes()
        floor = hw.SMEM_PER_SM_OF[self.target] // (self.max_ctas_per_sm + 1) - hw.SMEM_RESERVED_PER_CTA + 1
        return max(self.smem_bytes(), floor)

    @property
    def lean(self) -> bool:
        """:func:`prefill_lean` of this variant (derived from its fields)."""
        return prefill_lean(causal=self.causal, write_lse=self.write_lse, k_scale_tensor=self.k_scale_tensor,
                            v_scale_tensor=self.v_scale_tensor, kv_form=self.kv_form)

    def signature(self):
        D = self.head_dim
        ks, vs = self._scales()
        lse = (TensorArg("lse", "fp32", ("T", "Hq"), align=4),) if self.write_lse else ()
        return (
            TensorArg("q", self.q_dtype, ("T", "Hq", D)),
            *self._caches(),
            TensorArg("block_table", "int32", ("B", "W"), align=4),
            TensorArg("seq_lens", "int32", ("B",), align=4),
            TensorArg("query_start_loc", "int32", ("B1",), align=4),
            TensorArg("out", self.q_dtype, ("T", "Hq", D), align=8),
            *lse,
            ks, vs,
            ScalarArg("sm_scale", "fp32"),
            ScalarArg("max_query_len", "int32"),
        )

    def build(self):
        from ..sm80.prefill import Sm80PagedPrefill  # the kernel module imports the DSL: only here

        return Sm80PagedPrefill(self)


def prefill_heads_first_max_q(group: int, rows: int) -> int:
    """The longest request (``max_query_len``) whose row tiles of ``rows`` packed rows fit the
    ``heads_first`` grid's y extent (``hw.MAX_GRID_Y``); past it the op launches the grid with the
    row tiles first (docs/design/sm80.md#the-grid-order)."""
    return hw.MAX_GRID_Y * rows // group


PREFILL_CTAS_PER_SM = 2
PREFILL_MAX_STAGES = 3
# the query's loads issued at once, not one round trip per item: every prefill build but these (target, cache
# dtype, head dim), where ptxas spills with them (docs/design/sm80.md#the-query-loads-at-once)
PREFILL_Q_LOADS_FIRST_SPILLS = (("sm_89", "fp8_e4m3", 128), ("sm_90a", "fp16", 128))
# (target, cache dtype, head dim) launched with one CTA per SM as the bound: ptxas caps them at 128 registers
# and spills without it, at any bound only some other builds (docs/design/sm80.md#the-one-cta-bound)
PREFILL_ONE_CTA_BOUND = tuple((t, "fp8_e4m3", 64) for t in ("sm_103a", "sm_120a", "sm_121a"))
# 128-row CTAs (two 16-row tiles per warp) reach up to D 128 (D 256 cannot hold two tiles' O: 256 registers)
PREFILL_M2_MAX_HEAD_DIM = 128
# where ptxas keeps the 128-row CTA's 32-token stages without spills for lean variants (causal, one cache
# tensor, no LSE, no scale tensors; each of the others adds 2-31 STL at D 128 there): the only 128-row form
# measured (1.09-1.45x the 64-row CTA on the H200), so the only one the plan chooses (at D 128 the 64-token
# PREFILL_D128_TW64S below where it applies); everything else keeps the 64-row CTA, the 128-row one with
# 16-token stages at D 128 is an unmeasured override (docs/design/sm80.md#defaults)
PREFILL_M2_TW32_TARGETS = ("sm_80", "sm_86", "sm_90a")
# head dim 256, the default: 32-token stages with one ldmatrix base per operand (1.23x the 64-token
# ring on the H200). Two stages take 97 KB, so two CTAs (eight warps) share a 227 KB SM, FA2's H100
# occupancy at this head dim; the one-base addressing keeps the build spill-free where the
# per-address one needs 254 registers (docs/design/sm80.md#prefill-tilings-measured)
PREFILL_D256_TW32X: dict[str, Any] = dict(m_tiles=1, tw=32, ldsm_xor=True)
# where ptxas spills it, the 16-token form before stays the default: a 16-bit cache at page 32 (3-32 STL; not
# on sm_80), a 16-bit cache with scale tensors on sm_120a / sm_121a (1 STL) (docs/design/sm80.md#head-dim-256-prefill)
PREFILL_D256_TW32X_PAGE32_SPILL_TARGETS = tuple(t for t in TARGETS if t != "sm_80")
PREFILL_D256_TW32X_SCALES_SPILL_TARGETS = ("sm_120a", "sm_121a")
# head dim 256 on sm_80: eight warps of one 16-row tile (128-row CTAs, Q and the merge rows sharing their shared
# memory), 32-token stages, a two-stage ring: one CTA of eight warps per SM where the four-warp form's 132 KB
# ring left one CTA of four. 1.42x it with the rings sized for sm_80 on the H200 (one CTA per SM there too).
# Lean variants with 16-bit caches, spill-free at every page size and GQA; the 99 KB targets cannot hold its 64
# KB of Q beside a ring (docs/design/sm80.md#eight-warps-at-head-dim-256)
PREFILL_D256_W8: dict[str, Any] = dict(warps_m=8, m_tiles=1, tw=32, stages=2, q_regs=False, ldsm_xor=True)
PREFILL_D256_W8_TARGETS = ("sm_80",)
# head dim 128, an override: 128-row CTAs with 64-token stages, FA2's 128 x 64 tile of four warps
# (1.14-1.15x the 32-token default on the H200). At 255 registers it is spill-free only for BF16 at GQA
# 4, page 16 on sm_90a, so only those are registered (docs/design/sm80.md#64-token-stages-at-head-dim-128)
PREFILL_D128_TW64: dict[str, Any] = dict(m_tiles=2, tw=64)
PREFILL_D128_TW64_TARGETS = ("sm_90a",)
# the same tile with the register margin won back: the rows' softmax max and sum in shared memory, the
# gather's destinations one base plus immediates (1.13x the 32-token 128-row CTA on the H200). Spill-free
# for lean variants with 16-bit caches on sm_80 / 86 / 89 / 90a, FP8 on sm_86 / 89 (sm_80 FP8: 3-12 STL)
# (docs/design/sm80.md#64-token-stages-at-head-dim-128)
PREFILL_D128_TW64S: dict[str, Any] = dict(PREFILL_D128_TW64, stats_smem=True, gather_one_base=True)
PREFILL_D128_TW64S_TARGETS: dict[str, tuple[str, ...]] = {
    "bf16": ("sm_80", "sm_86", "sm_89", "sm_90a"), "fp16": ("sm_80", "sm_86", "sm_89", "sm_90a"),
    "fp8_e4m3": ("sm_86", "sm_89")}
# the D 128 default for lean variants on sm_86 / sm_89 (spill-free, one CTA per SM as the 32-token
# form) and sm_90a (16-bit caches; 1.12-1.15x the 32-token 128-row CTA there); sm_80 keeps the 32-token
# 128-row CTA (two per SM at its 164 KB: this form's one is 8-19 % slower), the other variants their
# 64-row CTA (1-7 STL without the mask, with FP8 and the LSE) (docs/design/sm80.md#defaults)
PREFILL_D128_TW64S_DEFAULT_TARGETS = ("sm_86", "sm_89", "sm_90a")
# the lean softmax (fields.lean_softmax) in the D 128 default of lean variants where that default is
# the 32-token 128-row CTA: 1.8-3.8 % on that form's sm_90a build once the row swizzle removed the
# bank conflicts; every sm_80 build of it spill-free (BF16 / FP16 / FP8, pages 16-128, GQA 1-16,
# both layouts: 248-255 registers) (docs/design/sm80.md#next-to-fa2-with-the-row-swizzle)
PREFILL_D128_LEAN_SOFTMAX_TARGETS = ("sm_80",)
# and in PREFILL_D128_TW64S where that is the default, for BF16 caches up to page 64: 1.5-7 % on the
# H200, spill-free on sm_86 / sm_89 / sm_90a at every GQA swept, both layouts; page 128 (1 STL at some
# GQA) and FP16 (1-12 STL) keep the scaled softmax (docs/design/sm80.md#in-the-64-token-form)
PREFILL_D128_TW64S_LEAN_KV_DTYPES = ("bf16",)
PREFILL_D128_TW64S_LEAN_PAGE_SIZES = (16, 32, 64)
PINGPONG_WARPS = (8, 1)  # two halves of four warps, w and w + 4 on one scheduler (docs/design/sm80.md#ping-pong-warps)
RING_RELEASE_STAGES = 2  # ring_release: tile i + 1 into the stage of tile i - 1 at tile i's turn
# the 256-row ping-pong's default where its stage wait may suspend (mbarrier.try_wait): 1.01-1.05x
# on the H200's long D 128 rows, 1.02x at B16 S512 (docs/design/sm80.md#stages-released-at-the-turn)
PREFILL_D128_RING_RELEASE_TARGETS = ("sm_90a",)
# and the D 128 default of lean variants with a BF16 cache on sm_90a (pages 16-64, where PREFILL_D128_TW64S takes
# the lean softmax) and sm_80 (pages 16-32): PREFILL_D128_TW64S with the lean softmax in eight warps (256 rows, one
# CTA per SM) whose halves take turns at the tensor pipe, two 64-token stages (three were slower). On the H200
# 1.01-1.05x the four-warp form on the long rows (0.98x at B16 S512) and 1.12-1.16x sm_80's 32-token 128-row default
# (the sm_90a build; 1.05x at B16 S512). Spill-free at every GQA swept; sm_80's build spills at page 64 (1 STL). Its
# 136 KB leave out the 99 KB targets (docs/design/sm80.md#ping-pong-warps)
PREFILL_D128_PINGPONG: dict[str, Any] = dict(warps_m=8, stages=2, pingpong=True)
PREFILL_D128_PINGPONG_KV_DTYPES = ("bf16",)
PREFILL_D128_PINGPONG_PAGE_SIZES: dict[str, tuple[int, ...]] = {"sm_80": (16, 32), "sm_90a": (16, 32, 64)}
PREFILL_D128_PINGPONG_TARGETS = tuple(PREFILL_D128_PINGPONG_PAGE_SIZES)
# and where the 256-row form does not fit the target's shared memory (the 99 KB targets, where every D 128 form runs
# one CTA of four warps per SM): the same turns in 128 rows, eight warps of one 16-row tile each with Q in
# registers, PREFILL_D128_TW64S's two 64-token stages (98 KB), the lean softmax, one ldmatrix base per operand. Lean
# variants, every cache dtype, pages 16-128: spill-free on every target listed at every GQA swept. At one CTA per SM
# on the H200, against sm_86's form before, long rows / B16 S512: BF16 1.03-1.07x / 1.22x, FP16 1.05-1.07x / 1.20x,
# FP8 1.14-1.15x / 1.24x, BF16 at page 128 1.01-1.03x / 1.18x (docs/design/sm80.md#ping-pong-in-99-kb)
PREFILL_D128_PINGPONG16: dict[str, Any] = dict(warps_m=8, m_tiles=1, tw=64, stages=2, pingpong=True, q_regs=True,
                                               ldsm_xor=True)
PREFILL_D128_PINGPONG16_TARGETS = ("sm_86", "sm_89", "sm_90a", "sm_120a", "sm_121a")
PREFILL_D128_PINGPONG16_KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")
PREFILL_D128_PINGPONG16_PAGE_SIZES = (16, 32, 64, 128)
_D128_MARGIN = {k: v for k, v in PREFILL_D128_TW64S.items() if k not in PREFILL_D128_TW64}  # what TW64S adds


def prefill_lean(*, causal: bool, write_lse: bool, k_scale_tensor: bool, v_scale_tensor: bool, kv_form: str) -> bool:
    """A variant with the fewest live registers: causal, one cache tensor, neither the LSE nor scale
    tensors (the one the measured defaults were measured on, docs/design/sm80.md#defaults)."""
    return causal and not (write_lse or k_scale_tensor or v_scale_tensor or kv_form == "pair")


def prefill_d256_tw32x(target: str, kv_dtype: str, page_size: int, scale_tensors: bool) -> bool:
    """Whether the head-dim-256 default on compile target ``target`` is ``PREFILL_D256_TW32X``:
    wherever ptxas keeps it without spills (a fact of the target's ptxas, not of the ring's shared
    memory)."""
    if kv_dtype == "fp8_e4m3":
        return True
    return not ((page_size == 32 and target in PREFILL_D256_TW32X_PAGE32_SPILL_TARGETS)
                or (scale_tensors and target in PREFILL_D256_TW32X_SCALES_SPILL_TARGETS))


def prefill_d256_w8(target: str, kv_dtype: str, lean: bool) -> bool:
    """Whether the head-dim-256 default on compile target ``target`` is ``PREFILL_D256_W8``: lean
    variants with 16-bit caches on ``PREFILL_D256_W8_TARGETS`` (where the ring sized for the
    target holds it)."""
    return lean and kv_dtype != "fp8_e4m3" and target in PREFILL_D256_W8_TARGETS


def prefill_d128_lean_softmax(target: str, lean: bool, kv_dtype: str, page_size: int) -> bool:
    """Whether the head-dim-128 default on compile target ``target`` takes the lean softmax: lean
    variants on ``PREFILL_D128_LEAN_SOFTMAX_TARGETS``, and where ``PREFILL_D128_TW64S`` is the default
    with a cache dtype of ``PREFILL_D128_TW64S_LEAN_KV_DTYPES`` and a page size of
    ``PREFILL_D128_TW64S_LEAN_PAGE_SIZES`` (at any GQA: spill-free at every one swept)."""
    if not lean:
        return False
    if target in PREFILL_D128_LEAN_SOFTMAX_TARGETS:
        return True
    return (prefill_d128_tw64s(target, kv_dtype, lean) and kv_dtype in PREFILL_D128_TW64S_LEAN_KV_DTYPES
            and page_size in PREFILL_D128_TW64S_LEAN_PAGE_SIZES)


def prefill_d128_pingpong(target: str, lean: bool, kv_dtype: str, page_size: int) -> bool:
    """Whether the head-dim-128 default on compile target ``target`` is the ping-pong form
    (``PREFILL_D128_TW64S`` with the lean softmax and ``PREFILL_D128_PINGPONG``): lean variants with
    a cache dtype of ``PREFILL_D128_PINGPONG_KV_DTYPES`` at the target's
    ``PREFILL_D128_PINGPONG_PAGE_SIZES`` (at any GQA: spill-free at every one swept), where the ring
    is sized for a target that holds it."""
    return lean and kv_dtype in PREFILL_D128_PINGPONG_KV_DTYPES and page_size in PREFILL_D128_PINGPONG_PAGE_SIZES.get(
        target, ())


def prefill_d128_pingpong16(target: str, lean: bool, kv_dtype: str, page_size: int) -> bool:
    """Whether the head-dim-128 default on compile target ``target`` is ``PREFILL_D128_PINGPONG16``
    where the ring cannot hold the 256-row form (:func:`prefill_tiling` checks): lean variants of
    ``PREFILL_D128_PINGPONG16_KV_DTYPES`` / ``_PAGE_SIZES`` / ``_TARGETS`` (spill-free at every GQA swept),
    FP8 only where it is widened with ``cvt`` (0.89-0.92x sm_86's form with the bit trick)."""
    return (lean and kv_dtype in PREFILL_D128_PINGPONG16_KV_DTYPES and page_size in PREFILL_D128_PINGPONG16_PAGE_SIZES
            and target in PREFILL_D128_PINGPONG16_TARGETS and (kv_dtype != "fp8_e4m3" or target in CVT_TARGETS))


def prefill_d128_tw64s(target: str, kv_dtype: str, lean: bool) -> bool:
    """Whether the head-dim-128 default on compile target ``target`` is ``PREFILL_D128_TW64S``: for
    lean variants on ``PREFILL_D128_TW64S_DEFAULT_TARGETS`` wherever ptxas keeps it without spills
    (a fact of the target's ptxas and the cache dtype, not of the ring's shared memory)."""
    return lean and target in PREFILL_D128_TW64S_DEFAULT_TARGETS and target in PREFILL_D128_TW64S_TARGETS[kv_dtype]


# the grid with the KV heads fastest (``heads_first``: every head's longest causal row tiles of a request start
# first) up to head dim 128: 1.13-1.17x at B1 S4096 and D 64 B1 S8192 on the H200, within 1.5 % on the other shapes;
# 0.97x at D 256, which keeps the row tiles fastest. Not in sm_80's 128-row 32-token form without the lean softmax
# (an override), whose build spills with it (4 STL) (docs/design/sm80.md#the-grid-order)
PREFILL_HEADS_FIRST_MAX_HEAD_DIM = 128
PREFILL_ROWS_FIRST_FORMS = (("sm_80", 2, 32, False),)  # (target, m_tiles, tw, lean_softmax)


def prefill_heads_first(target: str, head_dim: int, m_tiles: int, tw: int, lean_softmax: bool) -> bool:
    """Whether the prefill form launches the ``heads_first`` grid (``PREFILL_HEADS_FIRST_MAX_HEAD_DIM``,
    ``PREFILL_ROWS_FIRST_FORMS``)."""
    return head_dim <= PREFILL_HEADS_FIRST_MAX_HEAD_DIM and \
        (target, m_tiles, tw, lean_softmax) not in PREFILL_ROWS_FIRST_FORMS


def prefill_tiling(target: str, kv_dtype: str, head_dim: int, m_tiles: int | None = None, tw: int | None = None,
                   lean: bool = True, d256_x: bool = False, d128_s: bool = False, d256_w8: bool = False,
                   d128_lean: bool = False, d128_pp: bool = False, d128_pp16: bool = False) -> dict:
    """FA2-style prefill tiling on ``target``: four warps of ``m_tiles`` 16-row tiles each, each warp reading
    the whole stage; the deepest ring (2 or 3 stages) that lets two CTAs share an SM, else one. ``m_tiles``,
    ``tw``: the plan's unless given (the fit is for the given ones). ``d256_x``: :func:`prefill_d256_tw32x` of
    the variant (32-token stages with one ``ldmatrix`` base at D 256; without it the 16-token ring with
    per-address ``ldmatrix``). ``d128_s``: :func:`prefill_d128_tw64s` of the variant (at D 128 with neither
    ``m_tiles`` nor ``tw`` given: ``PREFILL_D128_TW64S``). ``d256_w8``: :func:`prefill_d256_w8` of the variant
    (at D 256 with neither given: the eight warps of ``PREFILL_D256_W8`` where their ring fits ``target``).
    ``d128_lean``: :func:`prefill_d128_lean_softmax` of the variant (at D 128 with neither given: the lean
    softmax; every form with either given, and every other head dim, leaves it off). ``d128_pp``:
    :func:`prefill_d128_pingpong` of the variant (at D 128 with neither given, where ``target``'s shared memory
    holds it: the ping-pong form). ``d128_pp16``: :func:`prefill_d128_pingpong16` (likewise, where only
    ``PREFILL_D128_PINGPONG16`` fits: that form).

    ``m_tiles=2`` (the default up to D 128 for ``lean`` variants on ``PREFILL_M2_TW32_TARGETS``,
    with 64-token stages where ``d128_s``): 128 rows per CTA. O takes 128 registers at D 128, so
    Q is read from shared memory at every tile and the ``ldmatrix`` addresses are immediate or XOR
    steps from one base per operand;
    32-token stages, 16 at D 128 off those (an override only). ``m_tiles=1`` (the default
    elsewhere): 64 rows per CTA, Q in registers up to D 128, 32-token stages (at D 256, where O
    alone takes 128 registers, with one ``ldmatrix`` base where ``d256_x``, else 16). ``lean``:
    :func:`prefill_lean` (docs/design/sm80.md#128-row-ctas)."""
    lean_softmax = d128_lean and head_dim == 128 and m_tiles is None and tw is None
    no_margin = {k: False for k in _D128_MARGIN}
    if d256_w8 and head_dim == 256 and m_tiles is None and tw is None:
        w8 = {k: PREFILL_D256_W8[k] for k in ("warps_m", "m_tiles", "tw")}
        if fit_stages(target, dict(kv_dtype=kv_dtype, head_dim=256, warps_n=1, **w8), 1,
                      PREFILL_D256_W8["stages"]) == PREFILL_D256_W8["stages"]:
            return dict(warps_n=1, **PREFILL_D256_W8, **no_margin, lean_softmax=False, heads_first=False,
                        pingpong=False, ring_release=False)
    # the ping-pong forms: the 256-row one where the target's shared memory holds it, else the 128-row
    # one (where two four-warp CTAs share an SM, they beat it: docs/design/sm80.md#ping-pong-in-99-kb)
    pp256 = dict(m_tiles=PREFILL_D128_TW64S["m_tiles"], tw=PREFILL_D128_TW64S["tw"], q_regs=False, ldsm_xor=True,
                 **PREFILL_D128_PINGPONG)
    fits = [fit_stages(target, dict(kv_dtype=kv_dtype, head_dim=128, warps_n=1, warps_m=f["warps_m"],
                                    m_tiles=f["m_tiles"], tw=f["tw"]), 1, f["stages"]) == f["stages"]
            for f in (pp256, PREFILL_D128_PINGPONG16)]
    for chosen, form in ((d128_pp and fits[0], pp256),
                         (d128_pp16 and fits[1] and not fits[0], PREFILL_D128_PINGPONG16)):
        if chosen and head_dim == 128 and m_tiles is None and tw is None:
            return dict(warps_n=1, **form, **_D128_MARGIN, lean_softmax=True, ring_release=False,
                        heads_first=prefill_heads_first(target, 128, form["m_tiles"], form["tw"], True))
    m2_tw32 = lean and target in PREFILL_M2_TW32_TARGETS
    margin = d128_s and head_dim == 128 and m_tiles is None and tw is None
    if margin:
        m_tiles, tw = PREFILL_D128_TW64S["m_tiles"], PREFILL_D128_TW64S["tw"]
    if m_tiles is None:
        m_tiles = 2 if head_dim <= PREFILL_M2_MAX_HEAD_DIM and m2_tw32 else 1
    if m_tiles not in (1, 2) or (m_tiles == 2 and head_dim > PREFILL_M2_MAX_HEAD_DIM):
        raise ValueError(f"prefill m_tiles must be 1, or 2 up to head_dim {PREFILL_M2_MAX_HEAD_DIM}; "
                         f"got {m_tiles} at {head_dim}")
    if tw is None:
        tw = 16 if head_dim == 256 and not d256_x else 32
        if m_tiles == 2 and head_dim == 128 and not m2_tw32:
            tw = 16
    fields = dict(kv_dtype=kv_dtype, head_dim=head_dim, warps_m=4, warps_n=1, m_tiles=m_tiles, tw=tw)
    for ctas in (PREFILL_CTAS_PER_SM, 1):
        stages = fit_stages(target, fields, ctas, PREFILL_MAX_STAGES)
        if stages is not None:
            break
    if stages is None:
        raise ValueError(f"no prefill tiling of D {head_dim} with {tw}-token stages fits {target}'s shared memory")
    # the PREFILL_D128_TW64S fields: the default's where d128_s, else an override's (every form
    # derived from a variant with m_tiles or tw given leaves them off)
    off = dict(_D128_MARGIN, lean_softmax=lean_softmax) if margin else dict(no_margin, lean_softmax=lean_softmax)
    off["heads_first"] = prefill_heads_first(target, head_dim, m_tiles, tw, lean_softmax)
    off["pingpong"] = off["ring_release"] = False
    if m_tiles == 2:
        return dict(warps_m=4, warps_n=1, m_tiles=2, tw=tw, stages=stages, q_regs=False, ldsm_xor=True, **off)
    return dict(warps_m=4, warps_n=1, m_tiles=1, tw=tw, stages=stages, q_regs=head_dim <= 128,
                ldsm_xor=head_dim == 256 and tw == 32 and d256_x, **off)


def make_prefill_config(*, target: str, q_dtype: str, kv_dtype: str, head_dim: int, group: int, page_size: int,
                        causal: bool = True, write_lse: bool = False, kv_form: str = "single",
                        kv_layout: str = "HND", k_scale_tensor: bool = False, v_scale_tensor: bool = False,
                        **override) -> Sm80PrefillConfig:
    """The config the prefill op, the warm-up and the compile matrix use on ``target``;
    ``override`` replaces tuning fields (``smem_target``: size the ring for another target;
    ``m_tiles``: the 64- or 128-row tiling of :func:`prefill_tiling`, ``tw``: its stage, the ring
    fitted to them; at D 256 ``tw=16`` / ``tw=64`` reach the per-address forms of the default before
    ``PREFILL_D256_TW32X``, at D 128 ``m_tiles=2`` alone the 128-row CTA with 32-token stages where
    ``PREFILL_D128_TW64S`` is the default)."""
    fields = dict(target=target, q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group,
                  page_size=page_size, causal=causal, write_lse=write_lse, kv_form=kv_form, kv_layout=kv_layout,
                  k_scale_tensor=k_scale_tensor, v_scale_tensor=v_scale_tensor, **_scale_fields(kv_dtype, target))
    override = dict(override)
    lean = prefill_lean(causal=causal, write_lse=write_lse, k_scale_tensor=k_scale_tensor,
                        v_scale_tensor=v_scale_tensor, kv_form=kv_form)
    d256_x = head_dim == 256 and prefill_d256_tw32x(target, kv_dtype, page_size, k_scale_tensor or v_scale_tensor)
    d128_s = head_dim == 128 and prefill_d128_tw64s(target, kv_dtype, lean)
    d256_w8 = head_dim == 256 and prefill_d256_w8(target, kv_dtype, lean)
    d128_lean = head_dim == 128 and prefill_d128_lean_softmax(target, lean, kv_dtype, page_size)
    d128_pp = head_dim == 128 and prefill_d128_pingpong(target, lean, kv_dtype, page_size)
    d128_pp16 = head_dim == 128 and prefill_d128_pingpong16(target, lean, kv_dtype, page_size)
    fields.update(prefill_tiling(_smem_target(override, target), kv_dtype, head_dim, override.get("m_tiles"),
                                 override.get("tw"), lean, d256_x, d128_s, d256_w8, d128_lean, d128_pp, d128_pp16))
    key = (target, kv_dtype, head_dim)
    fields.update({"q_loads_first": key not in PREFILL_Q_LOADS_FIRST_SPILLS,
                   "one_cta_bound": key in PREFILL_ONE_CTA_BOUND, **override})
    if (fields.get("pingpong") and fields["m_tiles"] == 2 and fields["stages"] == RING_RELEASE_STAGES
            and target in PREFILL_D128_RING_RELEASE_TARGETS and "ring_release" not in override):
        fields["ring_release"] = True
    return Sm80PrefillConfig(**fields)
