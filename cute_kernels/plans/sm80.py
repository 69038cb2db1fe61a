"""Host-only plan of the SM80-class kernels (``sm80.decode``, ``sm80.prefill``): their configs
(compile key and call signature), limits, per-arch hardware budgets and tile/stage choice, and the
split schedule. No torch, no DSL at import time (the kernels are imported by ``build()`` only).
Design and measurements: docs/design/sm80.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..jit.compiler import KernelConfig
from ..jit.spec import ScalarArg, TensorArg

# ------------------------------------------------------------------------------------------------
# Hardware, written once. Opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin)
# and per SM, per compile target, from the CUDA programming guide's compute-capability table:
# 8.0 163 / 164 KB, 8.6 and 8.9 99 / 100 KB, 9.0 and 10.x 227 / 228 KB, 12.x 99 / 100 KB.
# ------------------------------------------------------------------------------------------------
KB = 1024
SMEM_PER_BLOCK = {
    "sm_80": 163 * KB, "sm_86": 99 * KB, "sm_89": 99 * KB, "sm_90a": 227 * KB, "sm_100a": 227 * KB,
    "sm_103a": 227 * KB, "sm_120a": 99 * KB, "sm_121a": 99 * KB,
}
SMEM_PER_SM = {
    "sm_80": 164 * KB, "sm_86": 100 * KB, "sm_89": 100 * KB, "sm_90a": 228 * KB, "sm_100a": 228 * KB,
    "sm_103a": 228 * KB, "sm_120a": 100 * KB, "sm_121a": 100 * KB,
}
SMEM_RESERVED_PER_BLOCK = 1 * KB  # the runtime's own share of every resident block (8.x and later)
REGS_PER_SM = 64 * KB
# every target these kernels are built for: mma.sync / ldmatrix / cp.async exist on all of them
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a")
# the e4m3 -> f16x2 conversion instruction exists from SM89 on (cuda_fp8.hpp gates it at 890)
CVT_TARGETS = ("sm_89", "sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a")
# griddepcontrol (programmatic dependent launch) exists from SM90 on
PDL_TARGETS = ("sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a")

# ------------------------------------------------------------------------------------------------
# Limits (the registry and the ops state the same ones)
# ------------------------------------------------------------------------------------------------
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32, 64, 128)
MAX_DECODE_ROWS = 64  # group x q_len: four 16-row MMA tiles, one per warp row
MAX_SPLITS = 64

EVIDENCE = (r"mma\.sync\.aligned\.m16n8k16", r"ldmatrix\.sync\.aligned", r"cp\.async\.cg\.shared\.global")
CVT_EVIDENCE = r"cvt\.rn\.f16x2\.e4m3x2"


def mma_dtype(q_dtype: str, kv_dtype: str) -> str:
    """The MMA operand type: the cache's for a 16-bit cache of the query's type; fp16 for an FP8
    cache (exact widening) and for a bf16 query against an fp16 cache (query scaled per row by a
    power of two). A bf16 cache with an fp16 query is refused (fp16 -> bf16 is not exact)."""
    if kv_dtype == "fp8_e4m3" or kv_dtype == "fp16":
        return "fp16"
    if kv_dtype == "bf16" and q_dtype == "bf16":
        return "bf16"
    raise ValueError(f"a {kv_dtype} cache with a {q_dtype} query is not supported (no exact common 16-bit type)")


@dataclass(frozen=True)
class _Sm80Common(KernelConfig):
    """Fields both kernels share. ``warps_m x warps_n`` warps; ``m_tiles`` 16-row MMA tiles per
    warp; ``tw`` tokens per warp and stage (a stage holds ``warps_n * tw`` tokens); ``stages``
    cp.async ring depth; ``q_regs`` keeps Q's fragments in registers; ``widen`` ("bits" or "cvt",
    FP8 caches); ``pdl`` programmatic dependent launch (SM90+ targets only). ``target``: the one
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

    def _validate(self):
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target}")
        if self.fp8 and self.widen == "cvt" and self.target not in CVT_TARGETS:
            raise ValueError(f"the cvt widening needs SM89 or newer, not {self.target}")
        if self.pdl and self.target not in PDL_TARGETS:
            raise ValueError(f"programmatic dependent launch needs SM90 or newer, not {self.target}")
        if self.q_dtype not in ("bf16", "fp16"):
            raise ValueError(f"q dtype must be bf16 or fp16, got {self.q_dtype}")
        if self.kv_dtype not in ("bf16", "fp16", "fp8_e4m3"):
            raise ValueError(f"kv dtype must be bf16, fp16 or fp8_e4m3, got {self.kv_dtype}")
        mma_dtype(self.q_dtype, self.kv_dtype)
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size must be one of {PAGE_SIZES}, got {self.page_size}")
        if self.kv_form not in ("single", "pair") or self.kv_layout not in ("HND", "NHD"):
            raise ValueError(f"bad kv_form/kv_layout {self.kv_form}/{self.kv_layout}")
        if self.tw % 16 or self.tw < 16 or self.warps_m * self.warps_n > 8 or self.stages < 2:
            raise ValueError(f"bad tiling: tw {self.tw}, warps {self.warps_m}x{self.warps_n}, stages {self.stages}")
        if self.widen not in ("bits", "cvt"):
            raise ValueError(f"widen must be 'bits' or 'cvt', got {self.widen}")

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
    def targets(self) -> tuple[str, ...]:
        return (self.target,)

    @property
    def evidence(self) -> dict:
        pats = EVIDENCE + ((CVT_EVIDENCE,) if self.fp8 and self.widen == "cvt" else ())
        return {t: pats for t in self.targets}

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA (see the kernels' storage structs)."""
        return smem_bytes(self.head_dim, 1 if self.fp8 else 2, self.tile, self.stages, self.rows, self.warps_n)

    def _caches(self):
        page, D = self.page_size, self.head_dim
        inner = ("Hkv", page) if self.kv_layout == "HND" else (page, "Hkv")
        if self.kv_form == "single":
            return (TensorArg("kv_cache", self.kv_dtype, ("P", 2, *inner, D)),)
        return (TensorArg("k_cache", self.kv_dtype, ("P", *inner, D)),
                TensorArg("v_cache", self.kv_dtype, ("P", *inner, D)))

    def _scales(self):
        ks = TensorArg("k_scale", "fp32", (1,), align=4) if self.k_scale_tensor else ScalarArg("k_scale", "fp32")
        vs = TensorArg("v_scale", "fp32", (1,), align=4) if self.v_scale_tensor else ScalarArg("v_scale", "fp32")
        return ks, vs


def smem_bytes(D: int, kv_bytes: int, tile: int, stages: int, rows: int, warps_n: int) -> int:
    """Shared memory of a CTA: the K/V ring (which the fp32 merge rows overlay after the main
    loop), the staged query rows, the per-row statistics and logit scales, alignment padding."""
    ring = max(stages * 2 * tile * D * kv_bytes, warps_n * rows * (D + 4) * 4)
    ring = (ring + 1023) // 1024 * 1024
    q = (rows * D * 2 + 1023) // 1024 * 1024
    return ring + q + ((2 * warps_n + 1) * rows + rows) * 4


@dataclass(frozen=True)
class Sm80DecodeConfig(_Sm80Common):
    """Compile key of ``sm80.decode``: the KV group's ``group x q_len`` query rows against one
    request's pages. ``split``: fp32 partials ``[S, T, Hq, D]`` and their LSE (merged by
    ``common.merge_states``) instead of the output."""

    group: int = 8
    q_len: int = 1
    split: bool = False

    kernel_id = "sm80.decode"

    def __post_init__(self):
        self._validate()
        if not 1 <= self.group * self.q_len <= MAX_DECODE_ROWS:
            raise ValueError(f"group * q_len must be in [1, {MAX_DECODE_ROWS}]")
        if self.rows < self.group * self.q_len:
            raise ValueError(f"{self.rows} MMA rows cannot hold {self.group} x {self.q_len} query rows")

    def signature(self):
        D = self.head_dim
        ks, vs = self._scales()
        if self.split:
            outs = (TensorArg("part_out", "fp32", ("S", "T", "Hq", D), align=16),
                    TensorArg("part_lse", "fp32", ("S", "T", "Hq"), align=4))
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

    def build(self):
        from ..sm80 import decode

        entry = {(False, "single"): decode.Sm80DecodeSingle, (False, "pair"): decode.Sm80DecodePair,
                 (True, "single"): decode.Sm80DecodeSplitSingle, (True, "pair"): decode.Sm80DecodeSplitPair}
        return entry[(self.split, self.kv_form)](self)


# ------------------------------------------------------------------------------------------------
# tuning
# ------------------------------------------------------------------------------------------------

DECODE_CTAS_PER_SM = 2  # the decode kernel is sized so that two CTAs share an SM
DECODE_MAX_STAGES = 8
# FP8 caches: 32 tokens per warp and stage (a 16-token FP8 tile is half the bytes of a BF16 one
# for the same per-tile softmax and barrier cost). H200, tokens per warp 16 -> 32: Qwen3 B8
# ctx 32000 78.0 -> 72.7 us, D 64 B32 ctx 8192 114 -> 75.9 us, D 256 384 -> 362 us; BF16 caches
# lose with 32 (D 256: 650 -> 1060 us): profiling/results/sm80_decode_tune_h200.json
DECODE_FP8_TW = 32


def default_widen(target: str) -> str:
    """FP8 widening: the conversion instruction where it exists, the bit trick before SM89."""
    return "cvt" if target in CVT_TARGETS else "bits"


def decode_tiling(target: str, kv_dtype: str, head_dim: int, rows: int) -> dict:
    """Warp grid and ring of a decode CTA on ``target``: one warp row per 16-row MMA tile, the
    other warps (of up to four) splitting each stage's tokens, 16 each (32 for an FP8 cache,
    ``DECODE_FP8_TW``; decode is memory-bound:
    each K/V byte is read and widened by one warp only). Candidates: 4, 2 or 1 token warps, each
    sized for 3, 2 or 1 CTAs per SM with the deepest ring that fits; the winner keeps the most
    warps per SM busy up to 8 (two per scheduler), then the most K/V bytes in flight per SM
    (``stages - 1`` tiles per CTA). Q stays in registers up to D 128 (at D 256 its 64 registers would crowd
    out O's 128)."""
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


def fit_stages(target: str, cfg_fields: dict, ctas_per_sm: int, max_stages: int) -> int | None:
    """Deepest ring (2 .. max_stages) within the target's per-block opt-in that lets
    ``ctas_per_sm`` CTAs share an SM's shared memory; None if none does."""
    D, kvb = cfg_fields["head_dim"], (1 if cfg_fields["kv_dtype"] == "fp8_e4m3" else 2)
    tile = cfg_fields["tw"] * cfg_fields["warps_n"]
    rows = 16 * cfg_fields["m_tiles"] * cfg_fields["warps_m"]
    budget = min(SMEM_PER_BLOCK[target], SMEM_PER_SM[target] // ctas_per_sm - SMEM_RESERVED_PER_BLOCK)
    fits = [s for s in range(2, max_stages + 1) if smem_bytes(D, kvb, tile, s, rows, cfg_fields["warps_n"]) <= budget]
    return max(fits) if fits else None


def make_decode_config(*, target: str, q_dtype: str, kv_dtype: str, head_dim: int, group: int, q_len: int,
                       page_size: int, split: bool, kv_form: str = "single", kv_layout: str = "HND",
                       k_scale_tensor: bool = False, v_scale_tensor: bool = False, **override) -> Sm80DecodeConfig:
    """The config the op, the warm-up and the compile matrix use for a problem on ``target``;
    ``override`` replaces any tuning field (tests force the bit-trick widening or a small-smem
    ring with it)."""
    fields = dict(target=target, q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group, q_len=q_len,
                  page_size=page_size, split=split, kv_form=kv_form, kv_layout=kv_layout,
                  k_scale_tensor=k_scale_tensor, v_scale_tensor=v_scale_tensor,
                  widen=default_widen(target) if kv_dtype == "fp8_e4m3" else "bits",
                  pdl=target in PDL_TARGETS)
    # ``smem_target``: size the ring for another arch's shared memory (a 99 KB build run on an H200)
    fields.update(decode_tiling(override.pop("smem_target", target), kv_dtype, head_dim, group * q_len))
    fields.update(override)
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


# ------------------------------------------------------------------------------------------------
# prefill
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sm80PrefillConfig(_Sm80Common):
    """Compile key of ``sm80.prefill``: varlen query tiles against paged K/V, FA2-style. A CTA
    takes ``rows`` packed query rows (row p of a request: token p // group, head p % group) of one
    request and KV head. ``causal``: query j of a request sees positions < seq_len - q_len + j + 1
    (else all seq_len). ``write_lse``: the base-2 LSE is an argument and is written."""

    group: int = 4
    causal: bool = True
    write_lse: bool = False

    kernel_id = "sm80.prefill"

    def __post_init__(self):
        self._validate()
        if self.group < 1:
            raise ValueError(f"group must be >= 1, got {self.group}")

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
        from ..sm80 import prefill

        entry = {(False, "single"): prefill.Sm80PrefillSingle, (False, "pair"): prefill.Sm80PrefillPair,
                 (True, "single"): prefill.Sm80PrefillSingleLse, (True, "pair"): prefill.Sm80PrefillPairLse}
        return entry[(self.write_lse, self.kv_form)](self)


PREFILL_CTAS_PER_SM = 2
PREFILL_MAX_STAGES = 3


def prefill_tiling(target: str, kv_dtype: str, head_dim: int) -> dict:
    """FA2-style prefill tiling on ``target``: four warps of 16 query rows each (64 rows per
    CTA), each reading the whole stage of 32 tokens (16 at D 256, where O alone takes 128
    registers; 64 spill: ptxas keeps every k-block's K fragments live at once); the deepest ring
    (2 or 3 stages) that lets two CTAs share an SM, else one. Q stays in registers up to D 128."""
    tw = 16 if head_dim == 256 else 32
    fields = dict(kv_dtype=kv_dtype, head_dim=head_dim, warps_m=4, warps_n=1, m_tiles=1, tw=tw)
    for ctas in (PREFILL_CTAS_PER_SM, 1):
        stages = fit_stages(target, fields, ctas, PREFILL_MAX_STAGES)
        if stages is not None:
            break
    if stages is None:
        raise ValueError(f"no prefill tiling of D {head_dim} fits {target}'s shared memory")
    return dict(warps_m=4, warps_n=1, m_tiles=1, tw=tw, stages=stages, q_regs=head_dim <= 128)


def make_prefill_config(*, target: str, q_dtype: str, kv_dtype: str, head_dim: int, group: int, page_size: int,
                        causal: bool = True, write_lse: bool = False, kv_form: str = "single",
                        kv_layout: str = "HND", k_scale_tensor: bool = False, v_scale_tensor: bool = False,
                        **override) -> Sm80PrefillConfig:
    """The config the prefill op, the warm-up and the compile matrix use on ``target``;
    ``override`` replaces tuning fields (``smem_target``: size the ring for another arch)."""
    fields = dict(target=target, q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group,
                  page_size=page_size, causal=causal, write_lse=write_lse, kv_form=kv_form, kv_layout=kv_layout,
                  k_scale_tensor=k_scale_tensor, v_scale_tensor=v_scale_tensor,
                  widen=default_widen(target) if kv_dtype == "fp8_e4m3" else "bits", pdl=target in PDL_TARGETS)
    fields.update(prefill_tiling(override.pop("smem_target", target), kv_dtype, head_dim))
    fields.update(override)
    return Sm80PrefillConfig(**fields)
