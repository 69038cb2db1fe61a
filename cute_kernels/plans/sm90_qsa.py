"""Plan of the SM90 QSA per-row kernel (``sm90.qsa``): config, limits, tuning and split table.

Host-only. The kernel is :mod:`cute_kernels.sm90.qsa`; the row-tile prefill path, the merge and
the pre-passes have their own plans (``sm90_qsa_tile``, ``sm90_qsa_merge``, ``sm90_qsa_union``,
``sm90_qsa_widen``); which kernels serve a call is decided by :mod:`.sm90_qsa_launch`. Design and
measurements: docs/design/qsa.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import ClassVar

from ..jit.spec import DTYPE_BITS, KernelConfig, ScalarArg, TensorArg
from . import hw
from .sm90_attention import HEAD_DIMS, KV_DTYPES, Q_DTYPES, check_qkv  # noqa: F401 - the limits

# ---------------------------------------------------------------------------------------------
# limits
# ---------------------------------------------------------------------------------------------

MAX_GROUP = 16  # query heads of one KV head: the WGMMA N of one CTA
PRODUCTION_TOPK = 2051  # 2048 selected tokens + 4 - 1 (qsa-contract §1)

CONSUMER_WARPS = hw.WARPGROUP_WARPS  # one consumer warpgroup; the gather warps follow it
TILE = 64
TILES = (64, 128)  # KV tokens per iteration: one or two WGMMA M blocks
MAX_SPLITS = 64


@dataclass(frozen=True)
class Sm90QsaConfig(KernelConfig):
    """Compile key of :class:`cute_kernels.sm90.qsa.Sm90QsaAttention`.

    ``group``: query heads per KV head (1..16; the WGMMA N is ``n_pad``, a multiple of 8).
    ``page_size``: tokens per cache page (any; ``t // page`` divides by this constant).
    ``tile``: tokens per iteration (64 or 128: one or two WGMMA M blocks). ``stages``: gather
    slots in flight. ``split``: fp32 partials for the merge (the split count is the grid's
    third dim, a runtime value) instead of the final output. ``gate``: multiply the output by
    ``sigmoid(gate)`` (non-split; the merge applies it otherwise). ``occupancy``: CTAs per SM the
    register allocation must allow (0 = no constraint). ``producers``: gather warps (1, or a
    multiple of the tile's 32-token words: each then copies a slice of one word's rows).
    ``kv_same_strides``: k_cache and v_cache have identical strides (the two halves of one
    buffer, as in production): V row addresses are K's plus a constant, half the gather's address
    shuffles. ``pdl``: launched as a programmatic dependent of the previous kernel (its
    shared-memory setup overlaps that kernel's tail; it waits before its first global read); on
    for split launches only (docs/design/qsa.md#pdl-split-launches-only). ``evict_first``:
    the gathered K/V rows carry the L2 evict-first policy, so that they do not push the index
    lists, block tables, partials and gates out of L2; on for the per-row kernel, off for the row
    tiles, whose union rows are read again by neighbouring tiles (docs/design/qsa.md#l2-evict-first-per-row-gather).
    ``kv_barriers``: a slot's K rows are copied first and released on their own barrier, V after
    them on a second one, so QK and the softmax overlap V's arrival (per-row kernel only); on for
    split launches, whose few tiles per CTA end on the last tile's chain, off without splits, where
    the split copies slowed the memory-bound loop (docs/design/qsa.md#k-before-v-split-launches).
    ``k_scale_tensor`` / ``v_scale_tensor``: that scale arrives as a 1-element fp32 device tensor,
    read by the kernel (a captured CUDA graph then sees its current value), instead of a float.
    """

    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    head_dim: int = 256
    group: int = 12
    page_size: int = 1568
    tile: int = 64
    stages: int = 3
    split: bool = False
    gate: bool = False
    occupancy: int = 1
    producers: int = 1
    pdl: bool = False
    kv_same_strides: bool = False
    evict_first: bool = False
    kv_barriers: bool = False
    k_scale_tensor: bool = False
    v_scale_tensor: bool = False

    kernel_id = "sm90.qsa"
    targets = ("sm_90a",)
    # tensor cores, the zero-filling cp.async gather and the mbarrier pipeline
    evidence = {"sm_90a": (("wgmma.mma_async", r"wgmma\.mma_async"), ("cp.async gather", r"cp\.async\.cg\.shared\.global"),
                           ("cp.async.mbarrier.arrive", r"cp\.async\.mbarrier\.arrive"),
                           ("mbarrier.try_wait", r"mbarrier\.try_wait"))}
    hw: ClassVar[ModuleType] = hw  # what the kernel reads from its config (kernels never import plans)
    consumer_warps: ClassVar[int] = CONSUMER_WARPS

    def __post_init__(self):
        check_qkv(self.q_dtype, self.kv_dtype, self.head_dim)
        if not 1 <= self.group <= MAX_GROUP:
            raise ValueError(f"group (num_q_heads / num_kv_heads) must be in [1, {MAX_GROUP}], got {self.group}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.tile not in TILES or self.stages < 1:
            raise ValueError(f"bad tile/stages {self.tile}/{self.stages}")
        if self.gate and self.split:
            raise ValueError("the gate of a split launch is applied by the merge")
        words = self.tile // 32
        chunks_per_row = self.head_dim * DTYPE_BITS[self.kv_dtype] // 8 // 16
        copies = 32 // max(1, 32 // chunks_per_row)  # warp-wide copies per 32-token word
        if self.producers != 1 and not (self.producers % words == 0 and self.producers <= 8
                                         and copies % (self.producers // words) == 0):
            raise ValueError(f"producers must be 1 or a multiple of the tile's {words} words (<= 8) that "
                             f"divides its rows, got {self.producers}")

    @property
    def n_pad(self) -> int:
        return max(8, (self.group + 7) // 8 * 8)

    @property
    def widen(self) -> str:
        """FP8 widening of the swap-AB fragments: exact ``cvt`` to fp16."""
        return "cvt"

    def inputs(self, table_rows: str = "R"):
        """The query, the cache halves and the selection arguments every QSA attention kernel
        takes first (the block table's row extent is named ``table_rows``)."""
        cache = ("NB", self.page_size, "Hkv", self.head_dim)
        return (
            TensorArg("q", self.q_dtype, ("T", "Hq", self.head_dim)),
            TensorArg("k_cache", self.kv_dtype, cache),
            TensorArg("v_cache", self.kv_dtype, cache),
            TensorArg("packed_indices", "int32", ("T", "W"), align=4),
            TensorArg("block_table", "int32", (table_rows, "BW"), align=4),
            TensorArg("token_to_req", "int32", ("T",), align=4),
        )

    def signature(self):
        D = self.head_dim
        out = "fp32" if self.split else self.q_dtype
        o_shape = ("S", "T", "Hq", D) if self.split else ("T", "Hq", D)
        lse_shape = ("S", "T", "Hq") if self.split else ("T", "Hq")
        return (
            *self.inputs(),
            TensorArg("out", out, o_shape, align=4),
            TensorArg("lse", "fp32", lse_shape, align=4),
            TensorArg("gate", self.q_dtype, ("GT", "GH", D), align=2),
            *self.scale_args(),
        )

    def scale_args(self):
        """``k_scale`` and ``v_scale``: fp32 scalars, or ``[1]`` fp32 device tensors."""
        return tuple(TensorArg(name, "fp32", (1,), align=4) if tensor else ScalarArg(name, "fp32")
                     for name, tensor in (("k_scale", self.k_scale_tensor), ("v_scale", self.v_scale_tensor)))

    def build(self):
        from ..sm90.qsa import Sm90QsaAttention  # the kernel module imports the DSL: only here

        return Sm90QsaAttention(self)


# ---------------------------------------------------------------------------------------------
# tuning and the config table (docs/design/qsa.md#split-table)
# ---------------------------------------------------------------------------------------------

# >= 96 KB of K/V in flight per SM (what the paged decode kernel measured to saturate HBM)
KV_BYTES_IN_FLIGHT = 96 * 1024


def qsa_producers(tile: int = TILE) -> int:
    """Gather warps of the per-row kernel: one per 32-token word of the tile (one warp issuing
    every copy was the limit once a CTA owned its SM: docs/design/qsa.md#per-row-kernel)."""
    return tile // 32


def qsa_tuning(kv_dtype: str, head_dim: int, group: int, tile: int = TILE,
               producers: int | None = None) -> tuple[int, int]:
    """(stages, CTAs per SM) of a variant: the most resident CTAs that still get >= 3 gather
    slots each (falling back to 2, then 1) while keeping >= 96 KB of K/V in flight per SM
    (what the paged decode kernel measured to saturate HBM) and fitting the registers (measured
    with ptxas at D = 256, G = 12: ~100 for 16-bit caches, 156-172 for FP8, whose K/V fragments
    live in registers) of the consumer warpgroup plus ``producers`` gather warps."""
    producers = qsa_producers(tile) if producers is None else producers
    threads = (CONSUMER_WARPS + producers) * 32
    kv_bytes = DTYPE_BITS[kv_dtype] // 8
    n_pad = max(8, (group + 7) // 8 * 8)
    stage = 2 * tile * head_dim * kv_bytes
    # Q, P, reduction, barriers + bitmasks + 1024-byte alignment slack, the CTA's reservation
    fixed = (n_pad * head_dim * 2 + n_pad * tile * 2 + CONSUMER_WARPS * n_pad * 4 + 2 * 1024
             + hw.SMEM_RESERVED_PER_CTA)
    # accumulators O^T and S^T (fp32) + the widened K/V fragments of FP8 (fp16 pairs per register)
    regs = 32 + head_dim * n_pad // 128 + tile * n_pad // 128 + (tile * head_dim // 256 if kv_bytes == 1 else 0)
    regs = (regs + 7) // 8 * 8
    max_occ = max(1, min(4, hw.REGISTERS_PER_SM // (threads * regs)))
    for want in (3, 2, 1):
        for occ in range(max_occ, 0, -1):
            stages = min(4, (hw.SMEM_PER_SM // occ - fixed) // stage)
            if stages >= want and occ * stages * stage >= KV_BYTES_IN_FLIGHT:
                return stages, occ
    return 1, 1


@cache
def split_table(kv_dtype: str, head_dim: int, group: int, prefill: bool, topk: int = PRODUCTION_TOPK,
                num_sms: int = hw.H200_SMS) -> tuple[tuple[int, int, int], ...]:
    """The config table: ``((max_bp, tile, splits), ...)`` by increasing ``max_bp`` (0 on the last
    entry = no bound), keyed by ``bp = rows * num_kv_heads``.

    Built from a cost model in units of one tile's gather (the kernel is bound by gathered bytes):
    ``bp * S`` CTAs of ``ceil(tiles / S)`` tiles each load ``ceil(bp * S / num_sms)`` of them per
    SM (CTAs sharing an SM share its gather rate), plus 2 tiles of start-up (index and page
    lookups, Q staging, epilogue) per wave of ``slots = num_sms * occupancy`` (co-resident CTAs
    overlap theirs); with ``S > 1`` the merge adds one tile of latency plus its traffic (fp32
    partials written and read back, ``2 * G * D * 4`` bytes per CTA, spread over the SMs).
    Waves are counted per SM as well as per slot: counting slots alone split FP8 (2 CTAs per SM)
    3x too finely (docs/design/qsa.md#split-table). ``S`` never exceeds the tiles of a full row and
    never grows with ``bp`` (wave-quantization wiggles are not worth a non-monotonic table).
    ``prefill`` batches beyond 2048 (row, head) pairs never split: they fill the machine and a
    merge would only add traffic; below that both profiles agree (the flag is kept so they can be
    tuned apart).
    """
    tile = TILE
    _, occ = qsa_tuning(kv_dtype, head_dim, group, tile)
    slots = num_sms * occ
    tiles = max(1, -(-topk // tile))
    tile_bytes = 2 * tile * head_dim * (DTYPE_BITS[kv_dtype] // 8)
    partial_bytes = 2 * group * head_dim * 4

    def cost(bp, s):
        per_sm = -(-bp * s // num_sms)
        waves = -(-bp * s // slots)
        merge = 1 + bp * s * partial_bytes / (num_sms * tile_bytes) if s > 1 else 0
        return per_sm * -(-tiles // s) + 2 * waves + merge

    table: list[tuple[int, int, int]] = []
    prev = min(MAX_SPLITS, tiles)
    for bp in range(1, (2048 if prefill else 8 * slots) + 1):
        s = min(range(1, prev + 1), key=lambda k: (cost(bp, k), k))
        prev = s
        if table and table[-1][2] == s:
            table[-1] = (bp, tile, s)
        else:
            table.append((bp, tile, s))
        if s == 1:
            break
    table[-1] = (0, tile, table[-1][2]) if table[-1][2] == 1 else table[-1]
    if table[-1][0] != 0:
        table.append((0, tile, 1))
    return tuple(table)


def select_config(rows: int, num_kv_heads: int, prefill: bool, kv_dtype: str, head_dim: int, group: int,
                  topk: int = PRODUCTION_TOPK, num_sms: int = hw.H200_SMS) -> tuple[int, int]:
    """``(tile, splits)`` for a launch, from the table (0 = unbounded last entry)."""
    bp = rows * num_kv_heads
    for max_bp, tile, splits in split_table(kv_dtype, head_dim, group, prefill, topk, num_sms):
        if max_bp == 0 or bp <= max_bp:
            return tile, max(1, min(splits, -(-max(topk, 1) // tile)))
    raise AssertionError("config table without a last entry")  # pragma: no cover


def make_qsa_config(*, q_dtype: str, kv_dtype: str, head_dim: int, group: int, page_size: int, split: bool,
                    gate: bool, tile: int = TILE, **override) -> Sm90QsaConfig:
    """The config the op, the warm-up and the compile matrix use: tuning filled in here, once.
    ``override`` replaces tuning fields (benchmarks)."""
    producers = override.get("producers", qsa_producers(tile))
    stages, occupancy = qsa_tuning(kv_dtype, head_dim, group, tile, producers)
    fields = dict(q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group, page_size=page_size,
                  tile=tile, stages=stages, split=split, gate=gate and not split, occupancy=occupancy,
                  producers=producers, pdl=split, kv_same_strides=True, evict_first=True, kv_barriers=split)
    fields.update(override)
    return Sm90QsaConfig(**fields)
