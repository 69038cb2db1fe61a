"""Plan of the SM90 paged decode (``sm90.decode``): config, limits, tuning and launch schedule.

Host-only (no DSL, no torch): the op, the dispatcher's limits, the warm-up and the compile matrix
all read this module. The kernel (:mod:`cute_kernels.sm90.decode`) reads what it needs from the
config instance it is built with. Design and measurements: docs/design/sm90-decode.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product
from types import ModuleType
from typing import Any, ClassVar

from ..jit.spec import LABEL_IF_SET, Arg, KernelConfig, ScalarArg, TensorArg
from . import hw
from . import sm90_decode_balance as balance
from .paged_cache import kv_cache_args, scale_arg
from .sm90_attention import (  # noqa: F401 - the limits
    HEAD_DIMS,
    KV_DTYPES,
    KV_FORMS,
    KV_LAYOUTS,
    PAGE_SIZES,
    Q_DTYPES,
    check_qkv,
)

# ---------------------------------------------------------------------------------------------
# limits: what the kernel accepts (the registry and the op read these)
# ---------------------------------------------------------------------------------------------

MAX_ROWS = 64  # query rows of one CTA, group x q_len: the WGMMA N
MAX_SPLITS = 64

# ---------------------------------------------------------------------------------------------
# kernel structure the tuning depends on
# ---------------------------------------------------------------------------------------------

CONSUMER_WARPS = hw.WARPGROUP_WARPS  # one consumer warpgroup
NUM_THREADS = (CONSUMER_WARPS + 1) * 32  # plus one producer warp
TILE = 64  # KV tokens per tile (one WGMMA M); 128 = two M blocks per iteration
# K/V pipeline depth: one tile loads while the one before is consumed (the sizing's floor), and the
# deepest the sizing picks
MIN_STAGES, MAX_STAGES = 2, 8
DYNAMIC_CHUNK_TILES = 2  # dynamic split: tiles per grab (a CTA's tail is at most ~2 tiles)
MERGE_GROUP = 16  # splits whose partials one thread of the fused merge has in flight at once
CLUSTER_GROUP = 8  # splits whose DSMEM partials one thread of the cluster merge has in flight
MAX_CLUSTER = hw.MAX_CLUSTER  # most split CTAs of one cluster merge


@dataclass(frozen=True)
class Sm90DecodeConfig(KernelConfig):
    """Compile key of :class:`cute_kernels.sm90.decode.Sm90PagedDecode`.

    ``stages`` and ``occupancy`` normally come from :func:`decode_tuning`.
    ``n_pad`` = ``group * q_len`` rounded up to a multiple of 8 (the WGMMA N). ``split`` selects
    fp32 partial outputs merged in the kernel over a direct write. ``k_scale_tensor`` /
    ``v_scale_tensor``: the scale arrives as a 1-element fp32 device tensor (read by the kernel,
    so CUDA-graph replays see new values) instead of a float argument. ``kv_form``: one 5-D
    ``[P, 2, ...]`` cache tensor (``"single"``) or separate K and V tensors (``"pair"``);
    ``kv_layout``: HND or NHD. ``occupancy``: CTAs per SM the register allocation must allow
    (``__launch_bounds__`` min blocks; 0 = no constraint). ``widen`` (FP8 caches): ``"bits"``
    widens exactly to the query's type with integer ops and runs the MMAs in that type;
    ``"cvt"`` uses the one-instruction exact e4m3 -> f16 conversion and runs the MMAs in fp16
    (a BF16 query is rescaled by a power of two per CTA to fit fp16's range). ``tile``: KV
    tokens per iteration (64 or 128, i.e. one or two WGMMA M blocks). ``pdl``: launched as a
    programmatic dependent launch (the launch and prologue overlap the previous kernel's tail; the
    kernel waits in ``griddepcontrol.wait`` before touching global memory and lets its own
    dependents launch once its main loop is done). ``dynamic`` (split only): the CTAs of one
    (request, KV head) take chunks of tiles from a shared counter instead of fixed ranges (their
    counters follow the arrival counters in ``counters``). ``strided`` (static split only): split
    s takes tiles s, s + S, ... instead of a contiguous range, so its first page-table lookup does
    not wait for the request's length. ``cluster`` (static split only): the splits of one
    (request, KV head) form a thread-block cluster and merge through DSMEM. ``evict_first``: K/V
    TMA loads carry the L2 evict-first policy. ``prefetch_desc``: the producer warp prefetches the
    two TMA descriptors at the kernel's start, before the programmatic-dependent wait.
    ``smem_merge``: the fused merge stages the partials in shared memory first when they fit
    (:meth:`merge_slots`). ``window``: the variant takes a runtime ``window_left`` (-1: none) and
    walks only the tiles and pages of the keys its rows can see; ``sinks``: it takes fp32 ``[Hq]``
    sink logits folded into each row's softmax (split 0 only): docs/design/sm90-decode.md#sliding-window-and-sinks.
    These two variants are available (verified by the GPU suite on the H200; their self-check
    family: :func:`feature_family`). ``balanced`` (a split variant
    without strided, dynamic or cluster schedules, window or sinks, merging from L2): a grid of
    equal chunks of the batch's tiles per KV head, found from ``seq_lens`` on the device; its
    partials are per chunk slot (``[2 x chunks, q_len, Hq, D]``); it is available too (its
    self-check family: :func:`balanced_family`; docs/design/sm90-decode.md#balanced-schedule-opt-in).
    ``cluster_init_sync`` (cluster only, off by default): the CTAs of a cluster sync as a cluster,
    not only as a CTA, between the mbarrier initialization and the first TMA, as CUTLASS's cluster
    kernels do (docs/design/sm90-decode.md#cluster-merge-exit).
    """

    q_dtype: str = "bf16"
    kv_dtype: str = "fp8_e4m3"
    head_dim: int = 128
    group: int = 8
    q_len: int = 1
    page_size: int = 16
    stages: int = 4
    split: bool = False
    k_scale_tensor: bool = False
    v_scale_tensor: bool = False
    kv_form: str = "single"
    kv_layout: str = "HND"
    occupancy: int = 0
    widen: str = "bits"
    tile: int = 64
    pdl: bool = False
    dynamic: bool = False
    strided: bool = False
    cluster: bool = False
    evict_first: bool = True
    prefetch_desc: bool = True
    smem_merge: bool = True
    window: bool = False
    sinks: bool = False
    # (in the label only when set: the variants from before the flag keep their labels and digests)
    balanced: bool = field(default=False, metadata=LABEL_IF_SET)
    cluster_init_sync: bool = field(default=False, metadata=LABEL_IF_SET)

    kernel_id = "sm90.decode"
    targets = ("sm_90a",)
    evidence = {"sm_90a": (("wgmma.mma_async", r"wgmma\.mma_async"), ("TMA load", r"cp\.async\.bulk\.tensor"),
                           ("mbarrier.try_wait", r"mbarrier\.try_wait"))}
    # what the kernel reads from its config (kernels never import plans)
    hw: ClassVar[ModuleType] = hw
    num_threads: ClassVar[int] = NUM_THREADS
    consumer_warps: ClassVar[int] = CONSUMER_WARPS
    chunk_tiles_max: ClassVar[int] = DYNAMIC_CHUNK_TILES
    merge_group: ClassVar[int] = MERGE_GROUP
    cluster_group: ClassVar[int] = CLUSTER_GROUP
    balance_min_chunk: ClassVar[int] = balance.MIN_CHUNK_TILES
    balance_max_parts: ClassVar[int] = balance.MAX_PARTS

    def __post_init__(self):
        check_qkv(self.q_dtype, self.kv_dtype, self.head_dim)
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size must be 16, 32, 64 or 128, got {self.page_size}")
        if not 1 <= self.group * self.q_len <= MAX_ROWS:
            raise ValueError(f"group * q_len must be in [1, {MAX_ROWS}]")
        if self.kv_form not in KV_FORMS or self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"bad kv_form/kv_layout {self.kv_form}/{self.kv_layout}")
        if self.dynamic and not self.split:
            raise ValueError("dynamic tile scheduling needs split partials (split=True)")
        if self.dynamic and self.window:
            raise ValueError("a window variant takes the static split schedule (dynamic=False)")
        if self.strided and (self.dynamic or not self.split):
            raise ValueError("strided tiles are a static split schedule (split=True, dynamic=False)")
        if self.widen not in ("bits", "cvt") or self.tile not in (64, 128):
            raise ValueError(f"bad widen/tile {self.widen}/{self.tile}")
        if self.balanced and (not self.split or self.dynamic or self.strided or self.cluster or self.window
                              or self.sinks or self.smem_merge):
            raise ValueError("the balanced schedule is a split variant of its own: split=True, no dynamic, strided "
                             "or cluster schedule, no window or sinks, smem_merge=False (its merges run while the "
                             "stages hold the next request's tiles)")
        if self.cluster:
            if not self.split or self.dynamic:
                raise ValueError("the cluster merge needs a static split (split=True, dynamic=False)")
            if not self.cluster_fits():
                raise ValueError("cluster merge: the partials do not fit the K stages' shared memory")
        elif self.cluster_init_sync:
            raise ValueError("cluster_init_sync is a choice of the cluster variants (cluster=True)")
        if self.stages < MIN_STAGES:
            raise ValueError(f"stages must be >= {MIN_STAGES}, got {self.stages}")
        if self.occupancy < 0:
            raise ValueError(f"occupancy must be >= 0 CTAs per SM (0: no constraint), got {self.occupancy}")

    @property
    def n_pad(self) -> int:
        return max(8, (self.group * self.q_len + 7) // 8 * 8)

    @property
    def merge(self) -> str | None:
        """How split partials merge: ``"cluster"`` (DSMEM), ``"global"`` (the last CTA, through
        L2 or staged in shared memory) or None (no split)."""
        return "cluster" if self.cluster else "global" if self.split else None

    # -- shared memory of the split merges (the K/V stages hold the partials once the loop ends) --

    def kv_stages_bytes(self) -> int:
        """Bytes of all K stages (the V stages are as large): where a split's partial goes once the
        main loop is done."""
        return self.stages * self.tile * self.head_dim * (1 if self.kv_dtype == "fp8_e4m3" else 2)

    def merge_slot_bytes(self) -> int:
        """Bytes of one split's partial in shared memory (the cluster merge's own, or one staged by
        the fused merge): fp32 ``O[rows, D]``, then the rows' LSEs, rounded up to 16 bytes."""
        return (self.group * self.q_len * (self.head_dim + 1) * 4 + 15) // 16 * 16

    def merge_slots(self) -> int:
        """Split partials the fused merge stages in shared memory (``smem_merge``): as many as the
        K stages hold, then as many as the V stages hold. A launch with more splits merges from L2."""
        return 2 * (self.kv_stages_bytes() // self.merge_slot_bytes())

    def cluster_fits(self) -> bool:
        """Whether a CTA's partial fits the K stages, where the cluster merge leaves it once the
        main loop is done (the stages' size is a multiple of 16, so the slot's rounding changes
        nothing)."""
        return self.merge_slot_bytes() <= self.kv_stages_bytes()

    def partial_tokens(self, tokens: int) -> int:
        """Query tokens of one split partial of a launch of ``tokens`` query tokens: all of them
        (the partial of split s covers the batch), or a balanced slot's ``q_len`` (one request's)."""
        return self.q_len if self.balanced else tokens

    def signature(self):
        D = self.head_dim
        caches = kv_cache_args(self.kv_form, self.kv_layout, self.kv_dtype, self.page_size, D)
        split: tuple[Arg, ...]
        tokens = self.q_len if self.balanced else "T"  # partial_tokens
        if self.cluster:  # partials stay in the cluster's shared memory: only the grid's split count
            split = (ScalarArg("num_splits", "int32"),)
        elif self.split:
            split = (
                TensorArg("part_out", "fp32", ("S", tokens, "Hq", D), align=16),  # merged with 16-byte loads
                TensorArg("part_lse", "fp32", ("S", tokens, "Hq"), align=4),
                TensorArg("counters", "int32", ("C",), align=4),  # the fused merge's arrival counters
            )
        else:
            split = ()
        return (
            TensorArg("q", self.q_dtype, ("T", "Hq", D)),
            *caches,
            TensorArg("block_table", "int32", ("B", "W"), align=4),
            TensorArg("seq_lens", "int32", ("B",), align=4),
            TensorArg("out", self.q_dtype, ("T", "Hq", D), align=2),
            TensorArg("lse", "fp32", ("T", "Hq"), align=4),
            *split,
            scale_arg("k_scale", self.k_scale_tensor),
            scale_arg("v_scale", self.v_scale_tensor),
            ScalarArg("sm_scale", "fp32"),
            *((TensorArg("sinks", "fp32", ("Hq",), align=4),) if self.sinks else ()),
            *((ScalarArg("window_left", "int32"),) if self.window else ()),
        )

    def build(self):
        from ..sm90.decode import Sm90PagedDecode  # the kernel module imports the DSL: only here

        return Sm90PagedDecode(self)


# ---------------------------------------------------------------------------------------------
# tuning: stages and CTAs per SM of a variant (docs/design/sm90-decode.md#split-count-and-sizing)
# ---------------------------------------------------------------------------------------------

# The sizing shares 227 KB (the SM's 228 KB less one CTA's reservation) among the CTAs and counts
# 4 KB per CTA for the barriers, the 1 KB alignment of the tiles and the other CTAs' reservations.
_SMEM_BUDGET = hw.SMEM_PER_SM - hw.SMEM_RESERVED_PER_CTA
# >= ~96 KB of KV in flight per SM keeps HBM busy (a single BF16 D 256 CTA holding 2 x 64 KB
# reaches the roofline): docs/design/sm90-decode.md#split-count-and-sizing
KV_BYTES_IN_FLIGHT = 96 * 1024


def decode_tuning(kv_bytes: int, head_dim: int, n_pad: int, tile: int = TILE,
                  occupancy: int | None = None) -> tuple[int, int]:
    """(stages, CTAs per SM) for a decode variant (``occupancy`` forces the CTA count).

    More resident CTAs hide the per-tile chain (ldmatrix -> widen -> WGMMA -> softmax) better
    than deeper pipelines, as long as the SM keeps enough KV bytes in flight. Registers: a
    thread holds the O^T accumulator (``D * n / 128``), the S^T accumulator (``tile * n / 128``)
    and, for FP8, the widened K fragments (``tile * D / 256``); ``occupancy`` CTAs of
    NUM_THREADS threads must fit the register file.
    """
    stage = 2 * tile * head_dim * kv_bytes
    fixed = n_pad * head_dim * 2 + n_pad * tile * 2 + CONSUMER_WARPS * n_pad * 4 + 4 * 1024
    if occupancy is not None:
        if occupancy < 1:  # (the config's 0, "no constraint", is no CTA count to size the stages for)
            raise ValueError(f"occupancy must be >= 1 CTAs per SM, got {occupancy}")
        return max(MIN_STAGES, min(MAX_STAGES, (_SMEM_BUDGET // occupancy - fixed) // stage)), occupancy
    # calibrated on ptxas: FP8 D=128, tile 64: n=8 -> 82-89 registers, n=16 -> 96 (no spills at 4 CTAs/SM)
    regs = 40 + head_dim * n_pad // 128 + tile * n_pad // 128 + (tile * head_dim // 256 if kv_bytes == 1 else 0)
    regs = (regs + 7) // 8 * 8
    max_occ = max(1, min(4, hw.REGISTERS_PER_SM // (NUM_THREADS * regs)))
    for occ in range(max_occ, 0, -1):
        stages = min(MAX_STAGES, (_SMEM_BUDGET // occ - fixed) // stage)
        if stages >= MIN_STAGES and occ * stages * stage >= KV_BYTES_IN_FLIGHT:
            return stages, occ
    return MIN_STAGES, 1


DEFAULT_WIDEN = "cvt"  # docs/design/sm90-decode.md#fp8-widening-hardware-conversion
DEFAULT_PDL = True  # as FlashInfer's kernels on SM90+: docs/design/sm90-decode.md#programmatic-dependent-launch
DEFAULT_DYNAMIC = False  # dynamic split scheduling is opt-in: not bitwise reproducible
# split s takes tiles s, s + S, ...: its first page-table load goes out with the seq_len load
# (docs/design/sm90-decode.md#strided-split-tiles)
DEFAULT_STRIDED = True
# a static split into at most MAX_CLUSTER CTAs merges inside a thread-block cluster through DSMEM
# instead of through global memory (docs/design/sm90-decode.md#cluster-merge-for-small-split-grids)
DEFAULT_CLUSTER = True
# CTAs per SM a cluster-merged launch is sized for at least: a cluster of up to 16 split CTAs must
# fit in one GPC, which a kernel sized for one CTA per SM (135 KB of shared memory) made wait for
# a second wave (docs/design/sm90-decode.md#cluster-merge-for-small-split-grids)
CLUSTER_MIN_SIZING = 2
# an FP8 D=64 tile of 64 tokens is only 4 KB of K: two M blocks per iteration halve the per-byte
# cost of the tile chain (docs/design/sm90-decode.md#pipelining-occupancy-one-wave)
FP8_D64_TILE = 128


def make_decode_config(*, q_dtype: str, kv_dtype: str, head_dim: int, group: int, q_len: int, page_size: int,
                       split: bool, k_scale_tensor: bool = False, v_scale_tensor: bool = False,
                       kv_form: str = "single", kv_layout: str = "HND", window: bool = False, sinks: bool = False,
                       **override) -> Sm90DecodeConfig:
    """The config the op uses for a problem: tuning (stages, occupancy, tile, widening) filled in
    here, once, for the op, the warm-up and the compile matrix alike. ``override`` replaces any
    tuning field (benchmarks compare variants with it). A ``window`` variant keeps the static
    split schedule (its first tile depends on the request's length); ``balanced=True`` asks for
    the balanced schedule (a split variant without window or sinks; it replaces the strided,
    dynamic and staged-merge choices)."""
    balanced = override.pop("balanced", False) and split and not window and not sinks
    dynamic = override.pop("dynamic", DEFAULT_DYNAMIC) and split and not window and not balanced
    strided = override.pop("strided", DEFAULT_STRIDED) and split and not dynamic and not balanced
    tile = override.get("tile", FP8_D64_TILE if (kv_dtype, head_dim) == ("fp8_e4m3", 64) else TILE)
    n_pad = max(8, (group * q_len + 7) // 8 * 8)
    stages, occupancy = decode_tuning(1 if kv_dtype == "fp8_e4m3" else 2, head_dim, n_pad, tile,
                                      override.get("occupancy"))
    fields = dict(
        q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group, q_len=q_len, page_size=page_size,
        stages=stages, split=split, k_scale_tensor=k_scale_tensor, v_scale_tensor=v_scale_tensor,
        kv_form=kv_form, kv_layout=kv_layout, occupancy=occupancy, tile=tile,
        widen=DEFAULT_WIDEN if kv_dtype == "fp8_e4m3" else "bits", pdl=DEFAULT_PDL, dynamic=dynamic,
        strided=strided, window=window, sinks=sinks,
    )
    if balanced:
        fields.update(balanced=True, smem_merge=False)
    fields.update(override)
    return Sm90DecodeConfig(**fields)


# ---------------------------------------------------------------------------------------------
# launch schedule: split count, sizing, cluster choice (docs/design/sm90-decode.md#split-count-and-sizing)
# ---------------------------------------------------------------------------------------------

# CTAs per SM to aim for with an FP8 cache, by head dim: D=64 runs 128-token tiles (FP8_D64_TILE)
# and does best unsplit at up to 3 CTAs/SM; large tiles want deeper pipelines (D=256: 2 CTAs with
# 3 stages beat 3 with 2)
FP8_CTAS_PER_SM = {64: 3, 128: 3, 256: 2}
# ... and the fewest CTAs per SM an FP8 kernel is sized for: at D=64 and D=256 the kernel sized
# for 3 CTAs beats the one sized for the 2 that land (docs/design/sm90-decode.md#split-count-and-sizing)
FP8_MIN_SIZING = {64: 3, 256: 3}
# deterministic=False: dynamic split scheduling when each split has at least this many tiles (with
# a tile or two per split, as B=1, the chunk counter's round trips cost more than balancing gains)
DYNAMIC_MIN_TILES = 8


def choose_schedule(items: int, max_context: int, num_sms: int, max_occupancy: int, tile: int = TILE,
                    target_per_sm: int | None = None) -> tuple[int, int]:
    """``(num_splits, CTAs per SM)`` from shapes only (the block-table width bounds the context).

    ``items`` = requests x KV heads. When they cannot fill the GPU, split each request's context
    so that about ``target_per_sm`` CTAs land on every SM in a single wave (a second, partial
    wave runs alone); then size the kernel for the CTAs per SM that actually result, which frees
    shared memory for more pipeline stages when fewer CTAs share an SM.
    """
    target = min(target_per_sm or max_occupancy, max_occupancy)
    max_tiles = max(1, math.ceil(max_context / tile))
    splits = 1
    if items < num_sms * target:
        splits = max(1, min(MAX_SPLITS, max_tiles, (num_sms * target) // max(items, 1)))
    per_sm = max(1, min(max_occupancy, math.ceil(items * splits / num_sms)))
    return splits, per_sm


def use_cluster_merge(items: int, num_splits: int, num_sms: int) -> bool:
    """Whether a split launch merges in thread-block clusters (DSMEM) rather than through global
    memory: at most MAX_CLUSTER splits and at most one CTA per SM in all. The cluster saves the
    merge's global round trips, which matter in latency-bound launches; a grid that fills the GPU
    with several CTAs per SM loses to the clusters' co-scheduling
    (docs/design/sm90-decode.md#cluster-merge-for-small-split-grids)."""
    return 2 <= num_splits <= MAX_CLUSTER and items * num_splits <= num_sms


def launch_schedule(items: int, max_context: int, num_sms: int, max_occupancy: int, tile: int, head_dim: int,
                    fp8: bool, num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, CTAs per SM the kernel is sized for)`` of a launch, from shapes only:
    :func:`choose_schedule` with the FP8 per-head-dim targets, a caller's ``num_splits`` kept (then
    sized for the kernel's maximum), and FP8 sizing never below ``FP8_MIN_SIZING``."""
    splits, per_sm = choose_schedule(items, max_context, num_sms, max_occupancy, tile,
                                     FP8_CTAS_PER_SM.get(head_dim) if fp8 else None)
    if num_splits is not None:
        splits, per_sm = num_splits, max_occupancy
    if fp8:
        per_sm = max(per_sm, FP8_MIN_SIZING.get(head_dim, 1))
    return splits, per_sm


def plan_launch(items: int, max_context: int, num_sms: int, max_occupancy: int, tile: int, head_dim: int,
                fp8: bool, num_splits: int | None, deterministic: bool, force_cluster: bool | None,
                force_dynamic: bool = False) -> tuple[int, dict, bool]:
    """``(num_splits, tuning fields, cluster merge)`` of a launch, from shapes only. The split
    count and sizing come from :func:`launch_schedule`; a non-deterministic call with enough tiles
    per split schedules them dynamically; the cluster merge (``force_cluster`` None: the rule
    :func:`use_cluster_merge`, for a kernel that can be sized for CLUSTER_MIN_SIZING CTAs per SM;
    True: whenever the split count allows; False: never; never with a dynamic split) is decided
    before the sizing, which it raises to CLUSTER_MIN_SIZING."""
    num_splits, per_sm = launch_schedule(items, max_context, num_sms, max_occupancy, tile, head_dim, fp8, num_splits)
    split = num_splits > 1
    auto_dynamic = not deterministic and split and math.ceil(max_context / tile) >= DYNAMIC_MIN_TILES * num_splits
    dynamic = auto_dynamic or (split and force_dynamic)
    if force_cluster is None:
        # the clusters won only sized for CLUSTER_MIN_SIZING CTAs per SM (sized for one, 16-CTA
        # clusters waited for a second wave): a kernel that cannot be sized so keeps the global merge
        cluster = (DEFAULT_CLUSTER and not dynamic and max_occupancy >= CLUSTER_MIN_SIZING
                   and use_cluster_merge(items, num_splits, num_sms))
    else:
        cluster = bool(force_cluster) and not dynamic and 2 <= num_splits <= MAX_CLUSTER
    if cluster:
        per_sm = max(per_sm, CLUSTER_MIN_SIZING)
    tuning = {} if per_sm >= max_occupancy else dict(occupancy=per_sm)
    if auto_dynamic:
        tuning["dynamic"] = True
    return num_splits, tuning, cluster


# the most CTAs per SM a balanced kernel is sized for: its walk keeps a few more values live through
# the consumer's loop and merges, and sized for 4 (96 registers) the 16-bit D 64 kernel spills
# (docs/design/sm90-decode.md#balanced-schedule-opt-in)
BALANCED_MAX_CTAS_PER_SM = 3


def balanced_launch(config_for, num_kv_heads: int, num_sms: int, chunks: int | None = None):
    """``(partial slots, config)`` of a balanced launch, from shapes only: a grid of ``chunks``
    (default: one wave at the FP8 per-head-dim CTA target, or the kernel's occupancy for 16-bit
    caches, shared by the KV heads) x ``num_kv_heads`` CTAs, the kernel sized as the static
    schedule sizes it for that many CTAs per SM; two partial slots per chunk
    (docs/design/sm90-decode.md#balanced-schedule-opt-in)."""
    probe = config_for(False)
    fp8 = probe.kv_dtype == "fp8_e4m3"
    most = min(probe.occupancy, BALANCED_MAX_CTAS_PER_SM)
    target = min(FP8_CTAS_PER_SM.get(probe.head_dim, most) if fp8 else most, most)
    sizing = min(max(target, FP8_MIN_SIZING.get(probe.head_dim, 1)) if fp8 else target, most)
    chunks = chunks or balance.chunks_per_head(num_sms, target, num_kv_heads)
    tuning = {} if sizing >= probe.occupancy else dict(occupancy=sizing)
    return 2 * chunks, config_for(True, balanced=True, **tuning)


def window_context(table_tokens: int, window_left: int, q_len: int) -> int:
    """The most keys one request reads, which a launch's split count is planned for: the block
    table's capacity, or with a window (``window_left >= 0``) the ``window_left + q_len`` keys its
    rows see plus one tile of misalignment (the schedule starts at the tile holding the first)."""
    if window_left < 0:
        return table_tokens
    return min(table_tokens, window_left + q_len + max(TILE, FP8_D64_TILE))


def plan_config(config_for, items: int, max_context: int, num_sms: int, num_splits: int | None,
                deterministic: bool, force_cluster: bool | None, force_dynamic: bool = False,
                cluster_init_sync: bool = False):
    """``(num_splits, config)`` of a launch: :func:`plan_launch` on the variant ``config_for(split,
    **tuning)`` builds, then the config it asks for. When the plan wants a cluster merge but the
    partials do not fit that config's K stages (:meth:`Sm90DecodeConfig.cluster_fits`), the launch
    is planned again without the cluster, so it does not keep the sizing raised for one.
    ``cluster_init_sync`` goes to a cluster-merged config only (the other launches have no cluster)."""
    probe = config_for(False)
    fp8 = probe.kv_dtype == "fp8_e4m3"
    args = (items, max_context, num_sms, probe.occupancy, probe.tile, probe.head_dim, fp8, num_splits, deterministic)
    splits, tuning, cluster = plan_launch(*args, force_cluster, force_dynamic)
    config = config_for(splits > 1, **tuning)
    if cluster:
        if config.cluster_fits():
            return splits, dataclasses.replace(config, cluster=True, cluster_init_sync=cluster_init_sync)
        splits, tuning, _ = plan_launch(*args, False, force_dynamic)
        config = config_for(splits > 1, **tuning)
    return splits, config


# ---------------------------------------------------------------------------------------------
# variants a model shape reaches (the warm-up) and the compile matrix's variants
# ---------------------------------------------------------------------------------------------

_KV_NAMES = {"fp8": "fp8_e4m3", "bf16": "bf16", "fp16": "fp16"}


def decode_variants(*, head_dim: int, num_q_heads: int, num_kv_heads: int, page_size: int,
                    kv_dtypes: Sequence[str] = ("fp8_e4m3",), q_dtype: str = "bf16", q_lens: Sequence[int] = (1,),
                    scale_tensors: Sequence[bool] = (False, True), kv_layouts: Sequence[str] = ("HND",),
                    kv_forms: Sequence[str] = ("single",), **override: Any) -> list[Sm90DecodeConfig]:
    """Every decode config (split and not) that a model shape can reach.

    ``kv_forms``: ``"single"`` for one ``[P, 2, ...]`` cache tensor, ``"pair"`` for a (K, V) tuple.
    The op sizes a kernel for the CTAs per SM a call produces (1 up to the variant's maximum,
    depending on batch and context), so each of those occupancies is a variant too; a split
    config sized for at least CLUSTER_MIN_SIZING CTAs per SM comes with its cluster-merge form as
    well (splits of at most MAX_CLUSTER CTAs).
    """
    group = num_q_heads // num_kv_heads
    want_cluster = override.pop("cluster", DEFAULT_CLUSTER)
    init_sync = bool(override.pop("cluster_init_sync", False))
    out: list[Sm90DecodeConfig] = []
    for kv, q_len, split, st, layout, form in product(kv_dtypes, q_lens, (False, True), scale_tensors,
                                                      kv_layouts, kv_forms):
        kv = _KV_NAMES.get(kv, kv)
        fields: dict[str, Any] = dict(q_dtype=q_dtype, kv_dtype=kv, head_dim=head_dim, group=group, q_len=q_len,
                                      page_size=page_size, split=split, k_scale_tensor=st, v_scale_tensor=st,
                                      kv_form=form, kv_layout=layout)
        base = make_decode_config(**fields, **override)
        configs = [base]
        if "occupancy" not in override:
            configs += [make_decode_config(**fields, **override, occupancy=occ) for occ in range(1, base.occupancy)]
        for cfg in configs:
            out.append(cfg)
            # the op sizes a cluster-merged launch for at least CLUSTER_MIN_SIZING CTAs per SM
            if (want_cluster and cfg.split and not cfg.dynamic and not cfg.balanced
                    and cfg.occupancy >= CLUSTER_MIN_SIZING
                    and cfg.cluster_fits()):
                out.append(dataclasses.replace(cfg, cluster=True, cluster_init_sync=init_sync))
    return out


def compile_variants() -> list[Sm90DecodeConfig]:
    """The compile matrix: each head dim x KV dtype x (split / no split), GQA 8, page 16; the
    alternative FP8 widening; the cluster merge (FP8 also with ``cluster_init_sync``)."""
    out: list[Sm90DecodeConfig] = []
    for kv in ("fp8_e4m3", "bf16", "fp16"):
        for d in (64, 128, 256):
            for split in (False, True):
                out.append(make_decode_config(q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=d,
                                              group=8, q_len=1, page_size=16, split=split))
    # the alternative FP8 widening, kept compiling and tested
    out.append(make_decode_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1,
                                  page_size=16, split=False, widen="bits"))
    # the cluster merge (DSMEM) of splits of up to 16 CTAs: FP8 sized for 3 CTAs per SM, BF16
    # (FP8 also with the opt-in cluster-wide sync after the mbarrier initialization)
    for kv, occ, init_syncs in (("fp8_e4m3", 3, (False, True)), ("bf16", None, (False,))):
        sizing: dict[str, Any] = {"occupancy": occ} if occ else {}
        cluster = make_decode_config(q_dtype="bf16", kv_dtype=kv, head_dim=128, group=8, q_len=1, page_size=16,
                                     split=True, cluster=True, **sizing)
        out += [dataclasses.replace(cluster, cluster_init_sync=s) for s in init_syncs]
    return out


# ---------------------------------------------------------------------------------------------
# the launch of one call, and every launch a deployment's batches reach (the layer's warm-up)
# ---------------------------------------------------------------------------------------------


def launch_config(*, q_dtype: str, kv_dtype: str, head_dim: int, group: int, q_len: int, page_size: int,
                  k_scale_tensor: bool, v_scale_tensor: bool, kv_form: str, kv_layout: str, items: int,
                  max_context: int, num_sms: int, num_splits: int | None = None, deterministic: bool = True,
                  override: dict | None = None, window: bool = False, sinks: bool = False,
                  num_kv_heads: int = 0) -> tuple[int, Sm90DecodeConfig]:
    """``(num_splits, config)`` of a call: ``items`` = requests x KV heads, ``max_context`` = the
    block table's width x page. The op decides with this, and the warm-up enumerates it.
    ``override``: tuning fields (``tuning_override``; ``cluster`` and ``dynamic`` are launch
    choices, see :func:`plan_launch`). ``window`` / ``sinks``: the window / sink variant (a window
    keeps the static split schedule; pass the window's keys as ``max_context``: :func:`window_context`).
    ``balanced=True`` in ``override`` (with ``num_kv_heads``): the balanced schedule
    (:func:`balanced_launch`; ``num_splits`` is then its chunks per KV head and the first value
    returned its partial slots), unless the call has a window or sinks, or a batch whose unit
    counts could overflow the kernel's 32-bit sums."""
    override = dict(override or {})
    force_cluster = override.pop("cluster", None)
    init_sync = bool(override.pop("cluster_init_sync", False))
    balanced = override.pop("balanced", False)

    def config_for(split, **tuning):
        return make_decode_config(q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group, q_len=q_len,
                                  page_size=page_size, split=split, k_scale_tensor=k_scale_tensor,
                                  v_scale_tensor=v_scale_tensor, kv_form=kv_form, kv_layout=kv_layout,
                                  window=window, sinks=sinks, **{**tuning, **override})

    if (balanced and not window and not sinks and num_kv_heads
            and balance.fits_int32(items // num_kv_heads, max_context, config_for(False).tile)):
        return balanced_launch(config_for, num_kv_heads, num_sms, num_splits)
    return plan_config(config_for, items, max_context, num_sms, num_splits, deterministic or window, force_cluster,
                       bool(override.get("dynamic", False)), init_sync)


def launch_widths(max_pages: int, page_size: int, tile: int, deterministic: bool = True) -> list[int]:
    """The block-table widths whose launches stand for every width up to ``max_pages``: the
    schedule reads the width only through ``min(MAX_SPLITS, ceil(width * page / tile), ...)`` and
    (non-deterministic calls) ``ceil(width * page / tile) >= DYNAMIC_MIN_TILES * splits``, so one
    width per tile count up to the first past ``MAX_SPLITS`` tiles (``DYNAMIC_MIN_TILES *
    MAX_SPLITS`` for non-deterministic calls), and the largest, cover them all
    (tests/cpu/test_warmup.py checks it against every width)."""
    last = MAX_SPLITS if deterministic else DYNAMIC_MIN_TILES * MAX_SPLITS
    out, last_tiles = [], -1
    for w in range(1, max_pages + 1):
        tiles = -(-w * page_size // tile)
        if tiles != last_tiles:
            out.append(w)
            last_tiles = tiles
        if tiles > last:
            break
    if max_pages >= 1 and out[-1] != max_pages:
        out.append(max_pages)
    return out


# ---------------------------------------------------------------------------------------------
# the sliding-window and sink variants (docs/design/sm90-decode.md#sliding-window-and-sinks)
# ---------------------------------------------------------------------------------------------


FEATURES_ID = "sm90.decode_window_sinks"
BALANCED_ID = "sm90.decode_balanced"


def check_registry_id(config: Sm90DecodeConfig) -> str:
    """The registry entry whose status says whether a window / sink or balanced ``config`` still
    needs its self-check."""
    return BALANCED_ID if config.balanced else FEATURES_ID


def feature_family(config: Sm90DecodeConfig) -> str | None:
    """The runtime self-check family of a window / sink variant (None for the others): variants
    with the same features and the same MMA path (16-bit SS, or FP8 widened by ``cvt`` or
    ``bits``) share their numerics, so one check per process covers them."""
    features = "+".join(name for name, on in (("window", config.window), ("sinks", config.sinks)) if on)
    if not features:
        return None
    return f"sm90.decode/{features}/{_mma_path(config.kv_dtype, config.widen)}"


def _mma_path(kv_dtype: str, widen: str = DEFAULT_WIDEN) -> str:
    """A family's MMA path: 16-bit SS, or FP8 widened by ``cvt`` or ``bits``."""
    return f"fp8-{widen}" if kv_dtype == "fp8_e4m3" else "16bit"


def feature_variants() -> list[Sm90DecodeConfig]:
    """The window / sink variants of the compile matrix: every MMA path (FP8 ``cvt`` and ``bits``,
    BF16, FP16), window and sinks alone and together, unsplit and split (both merges), the
    speculative draft (q_len 4), D 64 / 128 / 256, both cache forms and layouts."""
    base: dict[str, Any] = dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1, page_size=16)
    both: dict[str, Any] = dict(window=True, sinks=True)
    out = [
        make_decode_config(**base, split=False, **both),
        make_decode_config(**base, split=True, **both),
        make_decode_config(**base, split=True, occupancy=3, cluster=True, **both),
        make_decode_config(**base, split=False, widen="bits", **both),
        make_decode_config(**{**base, "q_len": 4}, split=True, **both),
        make_decode_config(**{**base, "kv_dtype": "bf16"}, split=False, **both),
        make_decode_config(**{**base, "kv_dtype": "bf16"}, split=True, **both),
        make_decode_config(**{**base, "kv_dtype": "bf16", "head_dim": 64, "page_size": 64}, split=True,
                           kv_form="pair", kv_layout="NHD", window=True),
        make_decode_config(**{**base, "q_dtype": "fp16", "kv_dtype": "fp16"}, split=False, window=True),
        make_decode_config(**{**base, "head_dim": 256, "group": 4}, split=True, sinks=True),
    ]
    return out


# ---------------------------------------------------------------------------------------------
# the balanced schedule's variants (docs/design/sm90-decode.md#balanced-schedule-opt-in)
# ---------------------------------------------------------------------------------------------


def balanced_family(config: Sm90DecodeConfig) -> str | None:
    """The runtime self-check family of a balanced variant (None for the others), by MMA path as
    :func:`feature_family`."""
    return f"sm90.decode/balanced/{_mma_path(config.kv_dtype, config.widen)}" if config.balanced else None


def balanced_config(**fields) -> Sm90DecodeConfig:
    """The config a balanced call of ``fields`` (:func:`launch_config`'s problem fields, a batch
    of one request per KV head on the default machine) launches: the compile matrix's variants are
    the op's own."""
    fields = dict(dict(k_scale_tensor=False, v_scale_tensor=False, kv_form="single", kv_layout="HND"), **fields)
    override = dict(fields.pop("override", {}), balanced=True)
    return launch_config(**fields, items=1, max_context=32768, num_sms=hw.H200_SMS, override=override,
                         num_kv_heads=1)[1]


def balanced_variants() -> list[Sm90DecodeConfig]:
    """The balanced variants of the compile matrix: every MMA path (FP8 ``cvt`` and ``bits``, BF16,
    FP16), D 64 (FP8: 128-token tiles) / 128 / 256, GQA 4 and 8 (a 70B model under 8-way tensor
    parallelism has Hq 8 / Hkv 1), speculative drafts (q_len 2 and 4), scale tensors, both cache
    forms and layouts."""
    base = dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1, page_size=16)
    return [
        balanced_config(**base),
        balanced_config(**base, override=dict(widen="bits")),
        balanced_config(**{**base, "q_len": 4}, k_scale_tensor=True, v_scale_tensor=True),
        balanced_config(**{**base, "group": 4, "q_len": 2}),
        balanced_config(**{**base, "head_dim": 64}),
        balanced_config(**{**base, "head_dim": 256, "group": 4}),
        balanced_config(**{**base, "kv_dtype": "bf16"}),
        balanced_config(**{**base, "kv_dtype": "bf16", "head_dim": 64, "page_size": 64}, kv_form="pair",
                        kv_layout="NHD"),
        balanced_config(**{**base, "q_dtype": "fp16", "kv_dtype": "fp16", "q_len": 3}),
    ]
