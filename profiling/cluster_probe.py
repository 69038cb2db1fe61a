"""Thread-block cluster probe: the smallest launches that separate compute-sanitizer's verdict on
16-CTA clusters from the decode kernel (docs/design/sm90-decode.md#cluster-merge-exit).

Each CTA of a cluster of ``N`` (2..16; 16 is the non-portable size, which the DSL allows on every
kernel it builds) fills a 1 KB buffer of its shared memory with its row of ``src``, passes a
cluster barrier, reads the buffer of the next CTA of its cluster (rank + 1 mod N) through DSMEM
(``mapa`` + ``ld.shared::cluster``) into its row of ``out``, and passes a second cluster barrier
before it exits, as the decode's cluster merge does. How the buffer is filled is the case:

- ``plain-N``: plain loads and stores, no mbarrier;
- ``init-cta-sync-N``: as the decode's cluster variants: one ``PipelineTmaAsync`` stage (its full
  and empty mbarriers initialized, ``fence.mbarrier_init``, then only a CTA barrier), the producer
  warp acquires the stage and issues a TMA of the row completing on the full barrier, the four
  consumer warps wait on it and release the stage, the producer waits for the release
  (``producer_tail``);
- ``init-cluster-sync-N``: the same with the cluster-wide sync (``barrier.cluster.arrive.relaxed``
  + ``wait``) in place of the CTA barrier after the initialization, as CUTLASS's cluster kernels do.

The grid is ``[N, 8]``: 8 clusters, as the decode's one-request FP8 launch. ``out`` is checked on
the host against ``src`` (exact): a mismatch raises. Named cases as the sanitizer drivers take them
(``profiling/sanitize_cases.sh``)::

    python3 -m profiling.cluster_probe --list
    python3 -m profiling.cluster_probe --case init-cta-sync-16,init-cluster-sync-16
    OUT=/tmp/r/probe bash profiling/sanitize_cases.sh synccheck profiling.cluster_probe
"""

from __future__ import annotations

import argparse
import sys
import zlib
from dataclasses import dataclass
from typing import ClassVar

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import torch
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync

from cute_kernels.jit.compiler import compile_config
from cute_kernels.jit.spec import KernelConfig, TensorArg, call_arguments
from cute_kernels.plans import hw
from cute_kernels.roles.fragments import load_dsmem_f32

WORDS = 256  # fp32 words of a CTA's buffer (1 KB: one TMA box of 256 elements)
CLUSTERS = 8  # clusters of the probe's grid
MODES = ("plain", "init-cta-sync", "init-cluster-sync")
SIZES = (8, 16)  # the cluster sizes of the named cases (2..16 compile)


@dataclass(frozen=True)
class ClusterProbeConfig(KernelConfig):
    """Compile key of :class:`ClusterProbe`: the cluster size and how a CTA fills its buffer."""

    cluster: int = 16
    mode: str = "init-cta-sync"

    kernel_id = "profiling.cluster_probe"
    targets = ("sm_90a",)
    evidence = {"sm_90a": (("barrier.cluster", r"barrier\.cluster\.arrive"), ("mapa", r"mapa\.shared::cluster"),
                           ("ld.shared::cluster", r"ld\.shared::cluster"))}
    num_threads: ClassVar[int] = (hw.WARPGROUP_WARPS + 1) * 32  # four consumer warps and a producer warp

    def __post_init__(self):
        if not 2 <= self.cluster <= hw.MAX_CLUSTER:
            raise ValueError(f"cluster must be in [2, {hw.MAX_CLUSTER}], got {self.cluster}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def tma(self) -> bool:
        return self.mode != "plain"

    def signature(self):
        # one row per CTA: cluster c's rank r has row c * cluster + r
        return (TensorArg("src", "fp32", ("R", WORDS), align=16), TensorArg("out", "fp32", ("R", WORDS), align=16))

    def build(self):
        return ClusterProbe(self)


class ClusterProbe:
    """Kernel object of :class:`ClusterProbeConfig`."""

    def __init__(self, cfg: ClusterProbeConfig):
        self.cfg = cfg
        self.N = cfg.cluster
        self.num_threads = cfg.num_threads
        self.producer_warp = hw.WARPGROUP_WARPS
        self.consumer_warps = hw.WARPGROUP_WARPS

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mOut: cute.Tensor, stream):
        buf_layout = cute.make_layout((1, WORDS, 1))  # (row, word, stage)
        tma, tma_src = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mSrc,
                                                   cute.make_layout((1, WORDS)), (1, WORDS))

        @cute.struct
        class Storage:
            bar: cute.struct.MemRange[cutlass.Int64, 2]
            buf: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, WORDS], 1024]

        self.storage = Storage
        self.kernel(tma, tma_src, mSrc, mOut, buf_layout).launch(
            grid=[self.N, mSrc.shape[0] // self.N, 1], block=[self.num_threads, 1, 1], cluster=[self.N, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, tma: cute.CopyAtom, mTma: cute.Tensor, mSrc: cute.Tensor, mOut: cute.Tensor, buf_layout):
        tidx, _, _ = cute.arch.thread_idx()
        rank, cluster_id, _ = cute.arch.block_idx()  # the cluster spans x: rank in cluster = block x
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        row = cluster_id * self.N + rank
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sBuf = storage.buf.get_tensor(buf_layout)
        if const_expr(self.cfg.tma):
            self.fill_by_tma(tma, mTma, sBuf, storage, row, warp)
        else:
            for i in cutlass.range(tidx, WORDS, self.num_threads, unroll=1):
                sBuf[0, i, 0] = mSrc[row, i]
        # the decode's cluster merge: publish, read a peer's shared memory, keep ours alive until read
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        peer = (rank + 1) % self.N
        base = storage.buf.data_ptr().toint()
        for i in cutlass.range(tidx, WORDS, self.num_threads, unroll=1):
            mOut[row, i] = load_dsmem_f32(base + i * 4, peer)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def fill_by_tma(self, tma, mTma, sBuf, storage, row, warp):
        """The buffer through one TMA stage, with the decode's pipeline and its ordering after
        the barriers' initialization (CTA or cluster sync, by the mode)."""
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bar.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_warps),
            tx_count=WORDS * 4, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        if const_expr(self.cfg.mode == "init-cluster-sync"):
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        gRow = cute.local_tile(mTma, (1, WORDS), (row, 0))
        tBsB, tBgB = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sBuf, 0, 2),
                                           cute.group_modes(gRow, 0, 2))
        if warp == self.producer_warp:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe.producer_acquire(state)
            cute.copy(tma, tBgB, tBsB[None, 0], tma_bar_ptr=pipe.producer_get_barrier(state))
            pipe.producer_commit(state)
            state.advance()
            pipe.producer_tail(state)  # the consumers' release, as the decode's cluster variants
        else:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe.consumer_wait(state)
            pipe.consumer_release(state)


# ---------------------------------------------------------------------------------------------
# the driver: named cases for compute-sanitizer (profiling/sanitize_cases.sh)
# ---------------------------------------------------------------------------------------------

CASES = {f"{mode}-{n}": ClusterProbeConfig(cluster=n, mode=mode) for n in SIZES for mode in MODES}
# the cases synccheck cannot check: an mbarrier pipeline in a 16-CTA cluster, whichever init order
# (docs/design/sm90-decode.md#cluster-merge-exit); plain-16 and every 8-CTA case are clean
SYNCCHECK_TOOL_LIMIT = frozenset(n for n, c in CASES.items() if c.cluster > hw.PORTABLE_CLUSTER and c.mode != "plain")


def run_case(name: str) -> None:
    cfg = CASES[name]
    seed = zlib.crc32(name.encode())
    print(f"case {name}: start (inputs seed {seed})", flush=True)
    g = torch.Generator().manual_seed(seed)
    rows = CLUSTERS * cfg.cluster
    src = torch.randn(rows, WORDS, generator=g).cuda()
    out = torch.full((rows, WORDS), float("nan"), device="cuda")
    # compiled here, not through the package's disk cache: its key covers the package's sources only
    fn = compile_config(cfg, "sm_90a").fn
    print(f"case {name}: {CLUSTERS} clusters of {cfg.cluster} CTAs, {cfg.mode}", flush=True)
    fn(*call_arguments(cfg.signature(), {"src": src, "out": out}))
    torch.cuda.synchronize()
    peer = (torch.arange(rows) % cfg.cluster + 1) % cfg.cluster + torch.arange(rows) // cfg.cluster * cfg.cluster
    want = src.cpu()[peer]
    got = out.cpu()
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise AssertionError(f"case {name}: rows {bad[:8]} (of {len(bad)}) differ from their peer's row "
                             f"(seed {seed})")
    print(f"case {name}: ok", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.cluster_probe",
                                description="thread-block cluster launches for compute-sanitizer, as named cases")
    p.add_argument("--list", action="store_true", help="print the case names, one a line, and exit")
    p.add_argument("--case", default=None, help="NAME[,NAME...]: run only these (default: every case, in order)")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    names = list(CASES) if args.case is None else [n.strip() for n in args.case.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        p.error(f"unknown case(s) {unknown or args.case!r}; --list prints the names")
    for name in names:
        run_case(name)
    print("probe run finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
