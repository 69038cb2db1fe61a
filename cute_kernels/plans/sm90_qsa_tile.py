"""Plan of the SM90 QSA row-tile prefill kernel (``sm90.qsa_tile``): config, warp roles,
register split and the row-tile launch plan.

Host-only. The kernel is :mod:`cute_kernels.sm90.qsa_tile`; design and measurements:
docs/design/qsa.md#row-tiles-over-the-union.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.spec import DTYPE_BITS, TensorArg
from . import hw
from .sm90_qsa import CONSUMER_WARPS, Sm90QsaConfig

MAX_COLUMNS = hw.WGMMA_M  # R * G: the query columns on one warpgroup's WGMMA M
MAX_ROWS = 8  # rows per tile: the union pre-pass's limit
TILE_MIN_ROWS = 64  # below this a prefill batch is decode-sized: the per-row kernel (with splits)
MAX_BITMAP_TOKENS = 1 << 19  # the pre-pass's token bitmap (64 KB + 64 KB of ranks in shared memory)

# Warp roles by cache kind: 16-bit caches run two consumer warpgroups on alternate union tiles;
# FP8 caches, whose widening gather is synchronous (loads, convert, store), run one consumer that
# overlaps its softmax with the previous tile's PV and two groups of gather warps filling
# alternate slots (docs/design/qsa.md#row-tile-warp-roles).
TILE_SCHEDULE = {"16-bit": dict(consumers=2, producers=4, gather_groups=1),
                 "fp8": dict(consumers=1, producers=8, gather_groups=2, overlap=True)}
# Above 256 threads the launch gives each thread fewer registers than the consumer's O
# accumulator and softmax need, so the warpgroups rebalance with setmaxnreg: the gather warps
# keep the fewest that ptxas compiles without spills at D = 256 (FP8 holds a batch of 16-byte
# loads in flight for the widening; one group of 8 warps holds half the batch per warp), the
# consumers take the rest. Keyed by (cache kind, producer warps, gather groups).
PRODUCER_REGS = {("16-bit", 4, 1): 56, ("16-bit", 8, 1): 56, ("16-bit", 8, 2): 56,
                 ("fp8", 4, 1): 104, ("fp8", 8, 1): 80, ("fp8", 8, 2): 112}
MAX_CONSUMER_REGS = 232


def launch_regs(threads: int) -> int:
    """Registers per thread a launch of ``threads`` gets (the register file, rounded down to 8).
    setmaxnreg.inc blocks until registers are free: the warpgroups together must stay within
    this (a total above it hangs the consumers)."""
    return hw.REGISTERS_PER_SM // threads // 8 * 8


def tile_regs(kv_dtype: str, consumers: int, producers: int, groups: int = 1) -> tuple[int, int]:
    """(producer, consumer) registers per thread, or (0, 0) when one launch's share suffices
    (256 threads or fewer: up to 255 each)."""
    threads = (CONSUMER_WARPS * consumers + producers) * 32
    if threads <= 256:
        return 0, 0
    p = PRODUCER_REGS[("fp8" if kv_dtype == "fp8_e4m3" else "16-bit", producers, groups)]
    c = (threads * launch_regs(threads) - producers * 32 * p) // (consumers * 128) // 8 * 8
    return p, min(MAX_CONSUMER_REGS, c)


@dataclass(frozen=True)
class Sm90QsaTileConfig(Sm90QsaConfig):
    """Compile key of :class:`cute_kernels.sm90.qsa_tile.Sm90QsaTileAttention`:
    :class:`Sm90QsaConfig`'s fields (``split`` must be False) plus ``rows_per_cta`` (R; R * group
    <= 64), ``consumers`` (consumer warpgroups: 1, or 2 taking alternate union tiles) and, with 2,
    the registers per thread the producer and consumer warpgroups take with ``setmaxnreg``
    (multiples of 8 in [24, 256]; the three warpgroups share the 168 per thread the launch gives
    384 threads). ``gate_vec``: gate elements per load, 2 when the gate's pointer and strides are
    4-byte aligned (the usual case, a slice of a fused projection), else 1. ``overlap`` (one
    consumer warpgroup): tile i's QK is issued with tile i-1's PV and the softmax overlaps that PV.
    (The config extends the per-row one so that its label lists the shared fields first; the two
    kernels share no class.)"""

    rows_per_cta: int = 5
    consumers: int = 1
    gather_groups: int = 1
    producer_regs: int = 0
    consumer_regs: int = 0
    gate_vec: int = 1
    overlap: bool = False

    kernel_id = "sm90.qsa_tile"

    @property  # per instance (the base: a class constant)
    def evidence(self) -> dict[str, tuple[tuple[str, str], ...]]:  # type: ignore[override]
        """Tensor cores with the query columns on M (m64n256 PV from registers), the mbarrier
        pipeline, and the gather: zero-filling cp.async for 16-bit caches; for FP8, 16-byte
        loads widened exactly to fp16 and stored as 16-byte chunks."""
        gather: tuple[tuple[str, str], ...]
        if DTYPE_BITS[self.kv_dtype] == 16:
            gather = (("cp.async gather", r"cp\.async\.cg\.shared\.global"),
                      ("cp.async.mbarrier.arrive", r"cp\.async\.mbarrier\.arrive"))
        else:
            gather = (("ld.global.nc.v4", r"ld\.global\.nc(\.\S+)*\.v4\.b32"),
                      ("cvt e4m3x2->f16x2", r"cvt\.rn\.f16x2\.e4m3x2"), ("st.shared.v4", r"st\.shared\.v4\.b32"))
        # the PV WGMMA's A operand is a register list: "{accumulators}, {P registers}, descriptor"
        rs_wgmma = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.\w+\.\w+ +\{[^}]*\}, *\{"
        return {"sm_90a": (("wgmma.mma_async (A from registers)", rs_wgmma),
                           ("mbarrier.try_wait", r"mbarrier\.try_wait")) + gather}

    def __post_init__(self):
        super().__post_init__()
        if self.split:
            raise ValueError("the row-tile kernel does not split")
        if self.pdl:  # it reads the union pre-pass's output, written by the launch just before
            raise ValueError("the row-tile kernel is not a programmatic dependent launch")
        if self.kv_barriers:  # its consumers wait on one barrier per slot
            raise ValueError("the row-tile kernel releases K and V of a slot together (kv_barriers=False)")
        if not 1 <= self.rows_per_cta or self.rows_per_cta * self.group > MAX_COLUMNS:
            raise ValueError(f"rows_per_cta * group must be in [1, {MAX_COLUMNS}], got {self.rows_per_cta} x "
                             f"{self.group}")
        if self.gate_vec not in (1, 2) or (self.gate_vec == 2 and not self.gate):
            raise ValueError(f"gate_vec must be 1, or 2 with a gate; got {self.gate_vec} (gate={self.gate})")
        if self.consumers not in (1, 2):
            raise ValueError(f"consumers must be 1 or 2, got {self.consumers}")
        if self.overlap and self.consumers != 1:
            # two consumer groups already overlap each other's softmax and MMAs; each holding two
            # stages would leave the gather no free stage of the ring
            raise ValueError("overlap needs a single consumer warpgroup")
        threads = (CONSUMER_WARPS * self.consumers + self.producers) * 32
        regs = (self.producer_regs, self.consumer_regs)
        if threads > 384:  # 512 threads leave 128 registers per thread before setmaxnreg: too few
            raise ValueError(f"consumer and producer warps must total <= 12, got {threads // 32}")
        if threads > 256:
            # setmaxnreg is per warpgroup: the gather warps must form whole ones
            if self.producers % 4:
                raise ValueError(f"{threads} threads rebalance registers per warpgroup: producers must be a "
                                 f"multiple of 4, got {self.producers}")
            if (any(r % 8 or not 24 <= r <= 256 for r in regs)
                    or self.producers * 32 * self.producer_regs + self.consumers * 128 * self.consumer_regs
                    > threads * launch_regs(threads)):
                raise ValueError(f"producer/consumer registers {regs} must be multiples of 8 in [24, 256] within "
                                 f"the launch's {launch_regs(threads)} per thread")
        elif any(regs):
            raise ValueError(f"registers are rebalanced only above 256 threads, got {threads}")
        if self.gather_groups < 1 or self.producers % self.gather_groups:
            raise ValueError(f"gather_groups must divide producers ({self.producers}), got {self.gather_groups}")
        if self.gather_groups > 1 and self.consumers > 1:
            # a group may wait on a slot's "empty" phase only if the slot's previous use was
            # released in order, which one consumer warpgroup guarantees
            raise ValueError("several gather groups need a single consumer warpgroup")
        if self.consumers == 2:
            # each group's half O fragment, maxima and sums pass through the K tiles
            if self.stages * self.tile * self.head_dim * 2 < 2 * (self.head_dim // 4 + 4) * 128 * 4:
                raise ValueError(f"{self.stages} stages of K tiles cannot hold the consumers' exchange")

    @property
    def n_pad(self) -> int:
        return MAX_COLUMNS  # Q is staged as the 64-row A operand (zeros past R x G)

    def signature(self):
        D, R = self.head_dim, self.rows_per_cta
        return (
            *self.inputs("NR"),
            TensorArg("union", "int32", ("NT", "UCAP"), align=4),
            TensorArg("member", "int32", ("NT", R, "UW"), align=4),
            TensorArg("length", "int32", ("NT",), align=4),
            TensorArg("out", self.q_dtype, ("T", "Hq", D), align=4),
            TensorArg("lse", "fp32", ("T", "Hq"), align=4),
            TensorArg("gate", self.q_dtype, ("GT", "GH", D), align=2 * self.gate_vec),
            *self.scale_args(),
        )

    def build(self):
        from ..sm90.qsa_tile import Sm90QsaTileAttention  # the kernel module imports the DSL: only here

        return Sm90QsaTileAttention(self)


def tile_rows(kv_dtype: str, group: int) -> int:
    """R of the row-tile kernel: as many rows (up to 8, the pre-pass's limit) as the WGMMA's M
    (64 query columns) holds."""
    return max(1, min(MAX_ROWS, MAX_COLUMNS // group))


def make_qsa_tile_config(*, q_dtype: str, kv_dtype: str, head_dim: int, group: int, page_size: int, gate: bool,
                         **override) -> Sm90QsaTileConfig:
    """The config the op, the warm-up and the compile matrix use (tuning filled in here; a gate is
    assumed 4-byte aligned, ``gate_vec=1`` otherwise, and K and V views to share strides,
    ``kv_same_strides=False`` otherwise); ``override`` replaces fields (benchmarks)."""
    rows = override.pop("rows_per_cta", tile_rows(kv_dtype, group))
    tile = override.pop("tile", 64)
    roles = TILE_SCHEDULE["fp8" if kv_dtype == "fp8_e4m3" else "16-bit"]
    consumers = override.pop("consumers", roles["consumers"])
    producers = override.pop("producers", roles["producers"])
    groups = override.pop("gather_groups", roles["gather_groups"])
    overlap = override.pop("overlap", roles.get("overlap", False) and consumers == 1)
    producer_regs, consumer_regs = tile_regs(kv_dtype, consumers, producers, groups)
    # query columns on M, K/V tiles in 16 bits (FP8 widened by the gather), no P tile: one CTA per
    # SM (registers) takes what shared memory holds after Q and the 2 KB header (barriers,
    # bitmasks, reduction scratch, alignment)
    stages = min(4, (hw.MAX_SMEM_PER_CTA - MAX_COLUMNS * head_dim * 2 - 2048) // (2 * tile * head_dim * 2))
    occupancy = 1
    fields = dict(q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group, page_size=page_size,
                  tile=tile, stages=stages, split=False, gate=gate, occupancy=occupancy, rows_per_cta=rows,
                  producers=producers, consumers=consumers, gather_groups=groups, producer_regs=producer_regs,
                  consumer_regs=consumer_regs, gate_vec=2 if gate else 1, kv_same_strides=True, overlap=overlap)
    fields.update(override)
    return Sm90QsaTileConfig(**fields)


@dataclass(frozen=True)
class RowTilePlan:
    """What the row-tile path needs for one launch shape: R, the pre-pass's bitmap capacity (a
    power of two >= block-table width x page) and union cap (a multiple of 64), tiles."""

    rows_per_cta: int
    max_tokens: int
    union_cap: int
    num_tiles: int


def row_tile_plan(rows: int, prefill: bool, kv_dtype: str, group: int, page_size: int, table_width: int,
                  topk: int, rows_per_cta: int | None = None) -> RowTilePlan | None:
    """The row-tile path for a prefill launch of ``rows`` rows, or None for the per-row kernel:
    decode-profile and small batches (split-K serves them better), one-row tiles, and block tables
    addressing more than 2^19 tokens (the pre-pass bitmap would not fit in shared memory).

    The union cap is ``min(R, 3) * TOPK`` rounded up to 64: a tile whose union is larger walks its
    rows' own lists (no loss against the per-row kernel), and the workspace stays below
    ``ceil(rows / R) * cap * 4.2`` bytes (81 MB + 13 MB at 16384 rows, R 5, TOPK 2051)."""
    R = tile_rows(kv_dtype, group) if rows_per_cta is None else rows_per_cta
    tokens = table_width * page_size
    if not prefill or rows < TILE_MIN_ROWS or R < 2 or tokens > MAX_BITMAP_TOKENS or topk < 1:
        return None
    max_tokens = 1024
    while max_tokens < tokens:
        max_tokens *= 2
    cap = -(-min(R, 3) * topk // 64) * 64
    return RowTilePlan(R, max_tokens, cap, -(-rows // R))
