"""SM90 probe: one TMA + WGMMA tile, the smallest kernel that proves the Hopper path works.

``C[64, N] = A[64, K] @ B[N, K]^T`` for one CTA (one warpgroup): A and B (bf16, K-major) arrive
in shared memory through TMA on an mbarrier transaction pipeline, one SS WGMMA chain
accumulates in fp32 registers, and each thread writes its accumulator fragment back. The
compile matrix uses it to check that sm_90a builds emit ``wgmma.mma_async`` and
``cp.async.bulk.tensor`` (and ``HGMMA``/``UTMALDG`` in SASS); a GPU test checks the numbers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum


class Sm90Probe:
    """Kernel object of :class:`cute_kernels.plans.probes.Sm90ProbeConfig` (M = one WGMMA's)."""

    def __init__(self, cfg):
        self.n, self.k, self.m = cfg.n, cfg.k, cfg.m
        self.tile_mnk = (self.m, self.n, self.k)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream):
        dtype = self.dtype = mA.element_type
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(self.m, self.n)
        )
        # K-major operands: the layout enum of a row-major [rows, K] tensor
        a_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.tile_mnk, dtype, 1)
        b_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile_mnk, dtype, 1)
        a_one = cute.slice_(a_layout, (None, None, 0))
        b_one = cute.slice_(b_layout, (None, None, 0))
        tma_a, tma_tA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA, a_one, (self.m, self.k))
        tma_b, tma_tB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mB, b_one, (self.n, self.k))

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2]
            sA: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(b_layout)], 1024]

        self.storage = Storage
        self.kernel(tma_a, tma_tA, tma_b, tma_tB, mC, tiled_mma, a_layout, b_layout).launch(
            grid=[1, 1, 1], block=[128, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, tma_a, mA, tma_b, mB, mC, tiled_mma: cute.TiledMma, a_layout, b_layout):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        tx_bytes = cute.size_in_bytes(self.dtype, cute.slice_(a_layout, (None, None, 0))) + cute.size_in_bytes(
            self.dtype, cute.slice_(b_layout, (None, None, 0))
        )
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        gA = cute.local_tile(mA, (self.m, self.k), (0, 0))
        gB = cute.local_tile(mB, (self.n, self.k), (0, 0))
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        if warp == 0:
            pipe.producer_acquire(produce)
            bar = pipe.producer_get_barrier(produce)
            cute.copy(tma_a, tAgA, tAsA[None, 0], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB, tBsB[None, 0], tma_bar_ptr=bar)
            pipe.producer_commit(produce)

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        gC = cute.local_tile(mC, (self.m, self.n), (0, 0))
        tCgC = thr_mma.partition_C(gC)
        acc = cute.make_rmem_tensor(tCgC.shape, Float32)

        pipe.consumer_wait(consume)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            cute.gemm(tiled_mma, acc, tCrA[None, None, kb, 0], tCrB[None, None, kb, 0], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        pipe.consumer_release(consume)
        tCgC.store(acc.load())
