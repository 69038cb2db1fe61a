"""Blackwell (SM100 / SM103) tcgen05 attention kernels: configs, limits and on-chip budgets.

Host-only: imports neither the CuTe DSL nor torch, so that dispatch, the ops and the tests can read
every limit without a compiler. Each kernel config is a frozen dataclass whose fields are its
compile key; everything else (MMA shapes, chunking, pipeline depths, shared-memory bytes, TMEM
columns, per-role register budgets) is derived here, once, and checked against the SM's limits
when the config is built. Design and budget tables: docs/design/sm100.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..jit.spec import Arg, KernelConfig, ScalarArg, TensorArg
from .hw import MAX_SMEM_PER_CTA, REGISTERS_PER_SM
from .paged_cache import kv_cache_args, scale_arg

# ---- hardware (B200/GB200 = sm_100a, B300/GB300 = sm_103a) ------------------------------------
TARGETS = ("sm_100a", "sm_103a")
SMEM_BYTES = MAX_SMEM_PER_CTA  # 227 KB per CTA, as on SM90 (228 KB per SM, 1 KB reserved per CTA)
TMEM_LANES = 128  # tensor-memory lanes = accumulator rows of a 1-CTA M=128 tcgen05.mma
TMEM_COLUMNS = 512  # 32-bit columns per SM; an allocation is a power of two >= 32
TMEM_MIN_ALLOC = 32
SETMAXNREG_MIN, SETMAXNREG_MAX = 24, 256  # setmaxnreg operand range (multiples of 8)
WARP = 32
WARPGROUP = 128

KV_TILE = 128  # KV tokens per decode tile: the M of one tcgen05.mma (swap-AB: KV on M)
MAX_ROWS_PER_CTA = 32  # query rows (heads x draft tokens) one decode CTA keeps on the MMA's N
MAX_STAGES = 8  # deeper K/V rings stop paying once ~100 KB are in flight per SM
MMA_K_BYTES = 32  # bytes of K per tcgen05.mma instruction (16 x 16-bit, 32 x 8-bit)
SWIZZLE_BYTES = 128  # widest UMMA / TMA swizzle: one chunk row

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp32": 4}
MODEL_DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32, 64, 128)


# What dispatch may route to the tcgen05 kernels (the configs below refuse anything else).
DECODE_LIMITS: dict[str, Any] = dict(head_dims=HEAD_DIMS, page_sizes=PAGE_SIZES, max_gqa_ratio=None, max_q_len=None,
                     kv_layouts=("HND", "NHD"))
PREFILL_LIMITS: dict[str, Any] = dict(head_dims=HEAD_DIMS, page_sizes=PAGE_SIZES, max_gqa_ratio=None, max_q_len=None,
                      kv_layouts=("HND", "NHD"))


def mode_of(q_dtype: str, kv_dtype: str) -> str:
    """The MMA family a (query, cache) dtype pair runs in (see :attr:`_Sm100Config.mode`)."""
    if kv_dtype != "fp8_e4m3":
        return "f16"
    return "f8" if q_dtype == "fp8_e4m3" else "cvt"


def family(kernel_id: str, q_dtype: str, kv_dtype: str) -> str:
    """The self-check family of a kernel for a (query, cache) dtype pair: variants of one MMA
    family share their numerics, so one runtime check per process covers them."""
    return f"{kernel_id}/{mode_of(q_dtype, kv_dtype)}"


def pow2_at_least(x: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ---- register budgets -------------------------------------------------------------------------


@dataclass(frozen=True)
class RegisterBudget:
    """Registers per thread of each warpgroup role after ``setmaxnreg`` (launch count first).

    ``roles`` maps a role name to its per-thread register count; every role is one warpgroup
    (setmaxnreg acts on whole warpgroups). A kernel that reconfigures registers is given the most
    its launch bounds allow (``launch`` per thread, ``ctas_per_sm`` CTAs per SM); the roles then
    trade registers within that pool, so their sum must fit it (and hence the SM's 64K).
    """

    roles: tuple[tuple[str, int], ...]
    ctas_per_sm: int = 1

    @property
    def threads(self) -> int:
        return WARPGROUP * len(self.roles)

    @property
    def launch(self) -> int:
        """The register count ptxas may give every thread at launch (``__launch_bounds__``)."""
        return min(SETMAXNREG_MAX - 1, REGISTERS_PER_SM // (self.threads * self.ctas_per_sm)) // 8 * 8

    @property
    def total(self) -> int:
        return sum(r for _, r in self.roles) * WARPGROUP * self.ctas_per_sm

    def of(self, role: str) -> int:
        return dict(self.roles)[role]

    def check(self) -> None:
        for name, regs in self.roles:
            if regs % 8 or not SETMAXNREG_MIN <= regs <= SETMAXNREG_MAX:
                raise ValueError(f"register budget of {name}: {regs} is not a multiple of 8 in "
                                 f"[{SETMAXNREG_MIN}, {SETMAXNREG_MAX}]")
        if self.launch < SETMAXNREG_MIN:
            raise ValueError(f"{self.threads} threads x {self.ctas_per_sm} CTA(s) leave {self.launch} registers "
                             "per thread at launch")
        pool = self.launch * self.threads * self.ctas_per_sm
        if self.total > pool:
            raise ValueError(f"register budgets {dict(self.roles)} x {WARPGROUP} threads x {self.ctas_per_sm} CTA(s) "
                             f"= {self.total} exceed the {pool} registers the launch provides "
                             f"({self.launch} per thread; the SM has {REGISTERS_PER_SM})")


# ---- shared helpers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sm100Config(KernelConfig):
    """What every SM100 config shares: the fields of the dtypes, shapes and cache arguments, the
    compile targets, the evidence, the common checks."""

    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    head_dim: int = 128
    group: int = 8
    page_size: int = 16
    sinks: bool = False
    kv_form: str = "single"
    kv_layout: str = "HND"
    k_scale_tensor: bool = False
    v_scale_tensor: bool = False
    q_scale_tensor: bool = False
    pdl: bool = True

    targets: ClassVar[tuple[str, ...]] = TARGETS

    def _check_common(self) -> None:
        if self.kv_dtype not in ("bf16", "fp16", "fp8_e4m3"):
            raise ValueError(f"kv_dtype must be bf16, fp16 or fp8_e4m3, got {self.kv_dtype!r}")
        if self.q_dtype not in ("bf16", "fp16", "fp8_e4m3"):
            raise ValueError(f"q_dtype must be bf16, fp16 or fp8_e4m3, got {self.q_dtype!r}")
        if self.kv_dtype != "fp8_e4m3" and self.q_dtype != self.kv_dtype:
            raise ValueError(f"a 16-bit KV cache ({self.kv_dtype}) needs a query of the same dtype, "
                             f"got {self.q_dtype}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size must be one of {PAGE_SIZES}, got {self.page_size}")
        if self.kv_form not in ("single", "pair") or self.kv_layout not in ("HND", "NHD"):
            raise ValueError(f"bad kv_form/kv_layout {self.kv_form!r}/{self.kv_layout!r}")
        if self.group < 1:
            raise ValueError(f"group must be >= 1, got {self.group}")
        if self.q_scale_tensor and self.q_dtype != "fp8_e4m3":
            raise ValueError("q_scale applies only to an FP8 query")

    # -- the K and V rings: equal depth, what shared memory holds besides ``fixed_smem`` --------
    @property
    def fixed_smem(self) -> int:  # pragma: no cover - each kernel's config says
        raise NotImplementedError

    @property
    def stage_bytes(self) -> int:  # pragma: no cover - each kernel's config says
        raise NotImplementedError

    @property
    def stages(self) -> int:
        return max(1, min(MAX_STAGES, (SMEM_BYTES - self.fixed_smem) // (2 * self.stage_bytes)))

    @property
    def smem_bytes(self) -> int:
        return self.fixed_smem + 2 * self.stages * self.stage_bytes

    # -- the MMA family ------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``"f16"``: 16-bit K/V straight from shared memory (kind::f16); ``"f8"``: FP8 query and
        FP8 K/V (kind::f8f6f4, P in e4m3); ``"cvt"``: FP8 K/V widened exactly to fp16 by
        converter warps into tensor memory, 16-bit query (kind::f16, A operand from TMEM)."""
        return mode_of(self.q_dtype, self.kv_dtype)

    @property
    def mma_dtype(self) -> str:
        return {"f16": self.q_dtype, "f8": "fp8_e4m3", "cvt": "fp16"}[self.mode]

    @property
    def out_dtype(self) -> str:
        return "bf16" if self.q_dtype == "fp8_e4m3" else self.q_dtype

    @property
    def kv_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def mma_bytes(self) -> int:
        return DTYPE_BYTES[self.mma_dtype]

    @property
    def mma_k(self) -> int:
        """K elements of one tcgen05.mma instruction."""
        return MMA_K_BYTES // self.mma_bytes

    @property
    def kinds(self) -> tuple[str, ...]:
        """The tcgen05.mma kinds the compiled kernel must contain."""
        return ("kind::f8f6f4",) if self.mode == "f8" else ("kind::f16",)

    def evidence_patterns(self) -> tuple[tuple[str, str], ...]:
        """(display name, PTX regex): the MMA kind, TMEM allocation, loads (and stores), TMA, the
        register reconfiguration; converted K/V need the exact e4m3 -> f16 conversion."""
        pats = tuple((f"tcgen05.mma {k}", r"tcgen05\.mma\.cta_group::1\." + k) for k in self.kinds)
        pats += (("tcgen05.alloc", r"tcgen05\.alloc"), ("tcgen05.dealloc", r"tcgen05\.dealloc"),
                 ("tcgen05.ld", r"tcgen05\.ld"), ("TMA load", r"cp\.async\.bulk\.tensor"),
                 ("setmaxnreg", r"setmaxnreg"))
        if self.mode == "cvt":
            pats += (("tcgen05.st", r"tcgen05\.st"), ("cvt e4m3x2->f16x2", r"cvt\.rn\.f16x2\.e4m3x2"))
        return pats


# ---- decode -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sm100DecodeConfig(_Sm100Config):
    """Compile key of ``sm100.decode`` (:class:`cute_kernels.sm100.decode.Sm100PagedDecode`).

    One CTA per (split, KV head x row tile, request). The KV group's query rows (``group`` heads x
    ``q_len`` draft tokens) are the MMA's N (at most MAX_ROWS_PER_CTA per CTA; more rows take
    several row tiles), 128 KV tokens its M: ``S^T = K Q^T`` and ``O^T += V^T P^T`` accumulate in
    tensor memory. ``split``: fp32 partials normalized per split and their base-2 LSE (merged by
    ``common.merge_states``); else the output and LSE are written directly. ``sinks``: a fp32
    ``[Hq]`` tensor of per-head sink logits. The sliding window (``window_left``) is a runtime
    argument of every variant.
    """

    q_len: int = 1
    split: bool = False

    kernel_id: ClassVar[str] = "sm100.decode"

    def __post_init__(self):
        self._check_common()
        if self.q_len < 1:
            raise ValueError(f"q_len must be >= 1, got {self.q_len}")
        self.check_budgets()

    # -- geometry ------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.group * self.q_len

    @property
    def row_tile(self) -> int:
        """Query rows per CTA: all of the group when they fit, else equal tiles of <= 32."""
        tiles = math.ceil(self.rows / MAX_ROWS_PER_CTA)
        return math.ceil(self.rows / tiles)

    @property
    def row_tiles(self) -> int:
        return math.ceil(self.rows / self.row_tile)

    @property
    def n(self) -> int:
        """The MMA's N: rows padded to a multiple of 16 (M = 128 needs N % 16 == 0; so does an
        MN-major 8-bit P)."""
        return max(16, round_up(self.row_tile, 16))

    @property
    def chunk(self) -> int:
        """K-extent of one K/V ring stage: 128 bytes of the cache dtype (one swizzle row), at most
        the head dim. A K tile is ``head_dim / chunk`` stages, a V tile ``m_blocks * 128 / chunk``."""
        return min(self.head_dim, SWIZZLE_BYTES // self.kv_bytes)

    @property
    def m_blocks(self) -> int:
        """128-row M blocks of ``O^T`` (head dim rounded up to 128; D 64 pads with zero-filled rows)."""
        return math.ceil(self.head_dim / KV_TILE)

    @property
    def k_chunks(self) -> int:
        return self.head_dim // self.chunk

    @property
    def v_chunks(self) -> int:
        return self.m_blocks * (KV_TILE // self.chunk)

    @property
    def chunk_bytes(self) -> int:
        return KV_TILE * self.chunk * self.kv_bytes

    # -- budgets -------------------------------------------------------------------------------
    @property
    def registers(self) -> RegisterBudget:
        """Softmax warpgroup (per thread ~4 n live fp32: S, correction, running max, row sums),
        the MMA + TMA warpgroup (the TMA warp keeps a tile's box addresses live), and in ``cvt``
        mode the converter warpgroup (one ldmatrix tile and its fp16 copy)."""
        softmax = 192 if self.n <= 16 else 240
        if self.mode == "cvt":
            return RegisterBudget((("softmax", softmax), ("mma_tma", 104), ("convert", 160)))
        return RegisterBudget((("softmax", softmax), ("mma_tma", 192)))

    @property
    def threads(self) -> int:
        return self.registers.threads

    @property
    def fixed_smem(self) -> int:
        """Shared memory besides the K/V rings: Q, P (1 KB aligned for the UMMA descriptors), the
        column-max exchange (two parities x 4 warps x N fp32), the row-sum exchange, mbarriers."""
        q = round_up(self.n * self.head_dim * self.mma_bytes, 1024)
        p = round_up(KV_TILE * self.n * self.mma_bytes, 1024)
        red = (2 * 4 * self.n + 4 * self.n) * 4
        bars = 8 * 64
        return q + p + round_up(red + bars, 1024) + 1024  # + alignment slack of the rings

    @property
    def stage_bytes(self) -> int:
        return self.chunk_bytes

    @property
    def cvt_cols(self) -> int:
        """TMEM columns of one converted fp16 chunk (two elements per 32-bit column)."""
        return self.chunk // 2

    @property
    def cvt_stages(self) -> int:
        if self.mode != "cvt":
            return 0
        free = TMEM_COLUMNS - self.s_cols - self.o_cols
        return max(0, min(MAX_STAGES, free // self.cvt_cols))

    @property
    def s_cols(self) -> int:
        return 2 * self.n  # S^T double-buffered: QK(i + 1) runs during softmax(i)

    @property
    def o_cols(self) -> int:
        return self.m_blocks * self.n

    @property
    def tmem_cols(self) -> int:
        """Columns allocated: S stages, O, converted K/V stages, rounded up to a power of two."""
        used = self.s_cols + self.o_cols + self.cvt_stages * self.cvt_cols
        return pow2_at_least(used, TMEM_MIN_ALLOC)

    def check_budgets(self) -> None:
        if self.smem_bytes > SMEM_BYTES:
            raise ValueError(f"{self.kernel_id}: {self.smem_bytes} bytes of shared memory exceed {SMEM_BYTES}")
        if self.mode == "cvt" and self.cvt_stages < 2:
            raise ValueError(f"{self.kernel_id}: TMEM has room for {self.cvt_stages} converted stage(s); need 2")
        if self.tmem_cols > TMEM_COLUMNS:
            raise ValueError(f"{self.kernel_id}: {self.tmem_cols} TMEM columns exceed {TMEM_COLUMNS}")
        self.registers.check()

    # -- compile key ---------------------------------------------------------------------------
    @property  # per instance (the base: a class constant)
    def evidence(self) -> dict[str, tuple[tuple[str, str], ...]]:  # type: ignore[override]
        return {t: self.evidence_patterns() for t in self.targets}

    def signature(self):
        D = self.head_dim
        caches = kv_cache_args(self.kv_form, self.kv_layout, self.kv_dtype, self.page_size, D)
        outs: tuple[Arg, ...]
        if self.split:
            outs = (TensorArg("part_out", "fp32", ("S", "T", "Hq", D), align=16),
                    TensorArg("part_lse", "fp32", ("S", "T", "Hq"), align=4))
        else:
            outs = (TensorArg("out", self.out_dtype, ("T", "Hq", D), align=2),
                    TensorArg("lse", "fp32", ("T", "Hq"), align=4))

        extra: tuple[Arg, ...] = ()
        if self.q_dtype == "fp8_e4m3":
            extra += (scale_arg("q_scale", self.q_scale_tensor),)
        if self.sinks:
            extra += (TensorArg("sinks", "fp32", ("Hq",), align=4),)
        return (
            TensorArg("q", self.q_dtype, ("T", "Hq", D)),
            *caches,
            TensorArg("block_table", "int32", ("B", "W"), align=4),
            TensorArg("seq_lens", "int32", ("B",), align=4),
            *outs,
            scale_arg("k_scale", self.k_scale_tensor),
            scale_arg("v_scale", self.v_scale_tensor),
            *extra,
            ScalarArg("sm_scale", "fp32"),
            ScalarArg("window_left", "int32"),
        )

    def build(self):
        from ..sm100.decode import Sm100PagedDecode

        return Sm100PagedDecode(self)


MAX_SPLITS = 64


def decode_splits(items: int, max_context: int, num_sms: int) -> int:
    """Split-KV count of a decode launch of ``items`` CTAs (requests x KV heads x row tiles): fill
    one wave of one CTA per SM (a decode CTA holds ~200 KB of shared memory), never more splits
    than 128-token tiles, at most MAX_SPLITS. Not measured on hardware (docs/design/sm100.md)."""
    if items >= num_sms:
        return 1
    return max(1, min(MAX_SPLITS, math.ceil(max_context / KV_TILE), num_sms // max(items, 1)))


def decode_launch_config(*, q_dtype: str, kv_dtype: str, head_dim: int, group: int, q_len: int, page_size: int,
                         sinks: bool, kv_form: str, kv_layout: str, k_scale_tensor: bool, v_scale_tensor: bool,
                         q_scale_tensor: bool, batch: int, num_kv_heads: int, max_context: int, num_sms: int,
                         num_splits: int | None = None) -> tuple[int, Sm100DecodeConfig]:
    """``(num_splits, config)`` of a decode call (the op decides with this; the layer's warm-up
    enumerates it): the split count from :func:`decode_splits` unless given."""
    config = Sm100DecodeConfig(q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group, q_len=q_len,
                               page_size=page_size, sinks=sinks, kv_form=kv_form, kv_layout=kv_layout,
                               k_scale_tensor=k_scale_tensor, v_scale_tensor=v_scale_tensor,
                               q_scale_tensor=q_scale_tensor)
    if num_splits is None:
        num_splits = decode_splits(batch * num_kv_heads * config.row_tiles, max_context, num_sms)
    if num_splits > 1:
        config = Sm100DecodeConfig(**{**config.__dict__, "split": True})
    return num_splits, config


# ---- prefill ----------------------------------------------------------------------------------

M_TILE = 128  # query rows per Q tile (one TMEM lane each)


@dataclass(frozen=True)
class Sm100PrefillConfig(_Sm100Config):
    """Compile key of ``sm100.prefill`` (:class:`cute_kernels.sm100.prefill.Sm100PagedPrefill`).

    The FA4 / CUTLASS Blackwell FMHA structure on a paged cache: one CTA per (pair of 128-row Q
    tiles of one request, query head); two softmax warpgroups on the two Q tiles (ping-pong), a
    correction warpgroup (rescales O in TMEM, writes the output), an MMA warp and a load warp (TMA:
    the Q tiles and one K / V box per page). S and P share TMEM columns. ``causal``: queries see
    keys up to their own position (the last ``q_len`` of the request's ``seq_len`` tokens);
    ``write_lse``: the base-2 LSE is an output. The window is a runtime argument.
    16-bit or FP8 (e4m3 Q, K, V: kind::f8f6f4, P in e4m3); a 16-bit query on an FP8 cache is
    refused (the plan quantizes the query for this kernel). ``out_dtype``: the query's dtype for
    a 16-bit query; bf16 (the default) or fp16 for an FP8 query (the model's dtype).
    """

    causal: bool = True
    write_lse: bool = True
    out_dtype: str = ""  # "" = bf16 for an FP8 query, else the query's dtype (normalized when built)

    kernel_id: ClassVar[str] = "sm100.prefill"

    def __post_init__(self):
        self._check_common()
        if self.mode == "cvt":
            raise ValueError(f"{self.kernel_id}: a 16-bit query on an FP8 cache is not supported: quantize the query "
                             "(FP8 Q, K, V run in kind::f8f6f4)")
        fp8_query = self.q_dtype == "fp8_e4m3"
        if not self.out_dtype:
            object.__setattr__(self, "out_dtype", "bf16" if fp8_query else self.q_dtype)
        allowed = MODEL_DTYPES if fp8_query else (self.q_dtype,)
        if self.out_dtype not in allowed:
            raise ValueError(f"{self.kernel_id}: out_dtype must be one of {allowed} for a {self.q_dtype} query, "
                             f"got {self.out_dtype!r}")
        self.check_budgets()

    # -- geometry ------------------------------------------------------------------------------
    @property
    def q_stages(self) -> int:
        """Q tiles per CTA: two (ping-pong softmax warpgroups) while S0, S1, O0, O1 fit TMEM."""
        return 2 if self.head_dim <= 128 else 1

    @property
    def n_block(self) -> int:
        """Keys per KV block (the QK MMA's N): 128, or 64 at head dim 256 (shared memory)."""
        return 128 if self.head_dim <= 128 else 64

    @property
    def kv_tile_bytes(self) -> int:
        return self.n_block * self.head_dim * self.kv_bytes

    @property
    def fixed_smem(self) -> int:
        q = round_up(self.q_stages * M_TILE * self.head_dim * self.mma_bytes, 1024)
        stats = 3 * 2 * M_TILE * 4  # per row of two tiles: the correction scale, the final max and sum
        bars = 8 * (4 * MAX_STAGES + 14) + 16  # the K/V rings, seven barrier pairs, the TMEM address
        return q + round_up(stats + bars, 1024) + 1024  # + alignment of the 1 KB-aligned buffers

    @property
    def stage_bytes(self) -> int:
        return self.kv_tile_bytes  # a stage is one KV block of K, or of V

    @property
    def s_cols(self) -> int:
        return self.q_stages * self.n_block

    @property
    def o_cols(self) -> int:
        return self.q_stages * self.head_dim

    @property
    def p_offset(self) -> int:
        """Columns from an S stage's start to its P (P overwrites the S it was computed from)."""
        return self.n_block // 2

    @property
    def tmem_cols(self) -> int:
        return pow2_at_least(self.s_cols + self.o_cols, TMEM_MIN_ALLOC)

    @property
    def registers(self) -> RegisterBudget:
        """Softmax warpgroups (a row of S: n_block fp32 per thread), the correction warpgroup
        (32-column chunks of an O row), the MMA + load warps (FA4's split of 512 per lane)."""
        return RegisterBudget((("softmax0", 184), ("softmax1", 184), ("correction", 64), ("mma_load", 80)))

    @property
    def threads(self) -> int:
        return self.registers.threads

    def check_budgets(self) -> None:
        if self.smem_bytes > SMEM_BYTES:
            raise ValueError(f"{self.kernel_id}: {self.smem_bytes} bytes of shared memory exceed {SMEM_BYTES}")
        if self.s_cols + self.o_cols > TMEM_COLUMNS:
            raise ValueError(f"{self.kernel_id}: S and O need {self.s_cols + self.o_cols} TMEM columns, "
                             f"more than {TMEM_COLUMNS}")
        if self.stages < 2:
            raise ValueError(f"{self.kernel_id}: shared memory holds {self.stages} K/V stage(s); need 2")
        self.registers.check()

    @property  # per instance (the base: a class constant)
    def evidence(self) -> dict[str, tuple[tuple[str, str], ...]]:  # type: ignore[override]
        pats = self.evidence_patterns() + (("tcgen05.st (P)", r"tcgen05\.st"),)  # P is written into TMEM
        return {t: pats for t in self.targets}

    def signature(self):
        D = self.head_dim
        caches = kv_cache_args(self.kv_form, self.kv_layout, self.kv_dtype, self.page_size, D)

        lse = (TensorArg("lse", "fp32", ("T", "Hq"), align=4),) if self.write_lse else ()
        qs = (scale_arg("q_scale", self.q_scale_tensor),) if self.q_dtype == "fp8_e4m3" else ()
        sinks = (TensorArg("sinks", "fp32", ("Hq",), align=4),) if self.sinks else ()
        return (
            TensorArg("q", self.q_dtype, ("T", "Hq", D)),
            *caches,
            TensorArg("block_table", "int32", ("B", "W"), align=4),
            TensorArg("seq_lens", "int32", ("B",), align=4),
            TensorArg("query_start_loc", "int32", ("B1",), align=4),
            TensorArg("out", self.out_dtype, ("T", "Hq", D), align=16),
            *lse,
            scale_arg("k_scale", self.k_scale_tensor),
            scale_arg("v_scale", self.v_scale_tensor),
            *qs,
            ScalarArg("sm_scale", "fp32"),
            ScalarArg("max_query_len", "int32"),
            *sinks,
            ScalarArg("window_left", "int32"),
        )

    def build(self):
        from ..sm100.prefill import Sm100PagedPrefill

        return Sm100PagedPrefill(self)


# ---- compile matrix ---------------------------------------------------------------------------


def decode_variants() -> list[Sm100DecodeConfig]:
    """A representative set for CI (each compiles for sm_100a and sm_103a in 2-4 s): every MMA
    family (16-bit, FP8 widened into TMEM, FP8 query), every head dim, split and unsplit, sinks,
    both cache forms and layouts, scale tensors, row tiling (64 rows), pages 16-128."""
    return [
        Sm100DecodeConfig(q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=8, page_size=16),
        Sm100DecodeConfig(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16, split=True,
                          sinks=True),
        Sm100DecodeConfig(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16,
                          split=True, kv_form="pair", kv_layout="NHD", k_scale_tensor=True, v_scale_tensor=True,
                          q_scale_tensor=True),
        Sm100DecodeConfig(q_dtype="fp16", kv_dtype="fp16", head_dim=64, group=4, q_len=2, page_size=32),
        Sm100DecodeConfig(q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=32, page_size=128, split=True),
        Sm100DecodeConfig(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=256, group=16, q_len=4, page_size=64),
        Sm100DecodeConfig(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=64, group=4, page_size=16, sinks=True),
    ]


def prefill_variants() -> list[Sm100PrefillConfig]:
    """Every MMA family and head dim (D 256: one Q tile per CTA), causal and not, sinks, no LSE,
    both cache forms and layouts, pages 16-128, both outputs of an FP8 query."""
    return [
        Sm100PrefillConfig(q_dtype="bf16", kv_dtype="bf16", head_dim=128, page_size=16),
        Sm100PrefillConfig(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=128, page_size=16, sinks=True,
                           q_scale_tensor=True),
        Sm100PrefillConfig(q_dtype="fp16", kv_dtype="fp16", head_dim=64, page_size=32, causal=False,
                           kv_form="pair", kv_layout="NHD", write_lse=False),
        Sm100PrefillConfig(q_dtype="bf16", kv_dtype="bf16", head_dim=256, page_size=128, sinks=True),
        Sm100PrefillConfig(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=256, page_size=64, out_dtype="fp16"),
    ]
