"""Blackwell tcgen05 probe: one 128 x N tile of C = A @ B^T on one CTA.

A probe, not a GEMM product: it exists so that the compile matrix builds (and checks the PTX/SASS
of) one kernel that touches every SM100 feature our attention kernels will depend on, namely
TMA loads into swizzled shared memory, an mbarrier pipeline between TMA and the tensor core,
``tcgen05.mma`` accumulating in tensor memory (TMEM), TMEM allocation/deallocation, and
``tcgen05.ld`` from TMEM to registers. Shapes are static (M = 128, N = ``n``, K = ``k``).

A ``[128, K]`` and B ``[N, K]`` are bf16 and K-major (row-major in torch terms); C ``[128, N]`` is
fp32. One CTA of four warps: warp 0 issues the TMA loads and the MMAs (one elected thread
issues each), then all four warps read the accumulator out of TMEM, one accumulator row per
thread, and store it to global memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols

_THREADS = 128  # four warps: TMEM lane quadrant q is only readable by warp q % 4


class Sm100Probe:
    """Kernel: ``mC [128, N] = mA [128, K] @ mB [N, K]^T`` (bf16 in, fp32 accumulate and out)."""

    def __init__(self, cfg):
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        # tile M and K and the epilogue's columns per tcgen05.ld: see plans/probes.py
        self.epi_cols = cfg.epi_cols
        self.mma_tiler_mnk = (cfg.tile_m, cfg.n, cfg.tile_k)
        self.num_k_tiles = cfg.k // cfg.tile_k
        # Two stages let the TMA of k-tile i+1 overlap the MMAs of k-tile i.
        self.ab_stages = min(2, self.num_k_tiles)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream):
        # Both operands K-major, A and B read from shared memory by the tensor core.
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            tcgen05.CtaGroup.ONE,
            self.mma_tiler_mnk[:2],
        )
        # Staged, swizzled smem layouts in the shape the UMMA descriptors expect.
        sA_layout = sm100_utils.make_smem_layout_a(
            tiled_mma, self.mma_tiler_mnk, self.ab_dtype, self.ab_stages
        )
        sB_layout = sm100_utils.make_smem_layout_b(
            tiled_mma, self.mma_tiler_mnk, self.ab_dtype, self.ab_stages
        )
        # The TMA box is one stage of that layout; the atoms come with coordinate tensors (mA_tma)
        # that stand in for mA when partitioning.
        tma_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_atom_a, mA_tma = cute.nvgpu.make_tiled_tma_atom_A(
            tma_op, mA, cute.select(sA_layout, mode=[0, 1, 2]), self.mma_tiler_mnk, tiled_mma
        )
        tma_atom_b, mB_tma = cute.nvgpu.make_tiled_tma_atom_B(
            tma_op, mB, cute.select(sB_layout, mode=[0, 1, 2]), self.mma_tiler_mnk, tiled_mma
        )
        self.kernel(tiled_mma, tma_atom_a, mA_tma, tma_atom_b, mB_tma, mC, sA_layout, sB_layout).launch(
            grid=[1, 1, 1], block=[_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mC: cute.Tensor,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = SmemAllocator()
        # mbarriers as plain Int64 arrays: a cute.struct sized from self would need its
        # annotations evaluated, which `from __future__ import annotations` turns into strings.
        ab_mbar = smem.allocate_array(cutlass.Int64, self.ab_stages * 2)  # full + empty per stage
        acc_mbar = smem.allocate_array(cutlass.Int64, 2)
        # 128-byte alignment is what the 128B swizzle pattern is defined against.
        sA = smem.allocate_tensor(self.ab_dtype, sA_layout.outer, byte_alignment=128, swizzle=sA_layout.inner)
        sB = smem.allocate_tensor(self.ab_dtype, sB_layout.outer, byte_alignment=128, swizzle=sB_layout.inner)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)

        # TMA -> MMA: the full barrier completes on the TMA byte count; the empty barrier is
        # arrived by tcgen05.commit once the MMAs that read the stage have finished.
        tx_bytes = cute.size_in_bytes(
            self.ab_dtype, cute.select(sA_layout, mode=[0, 1, 2])
        ) + cute.size_in_bytes(self.ab_dtype, cute.select(sB_layout, mode=[0, 1, 2]))
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            tx_count=tx_bytes,
            barrier_storage=ab_mbar,
        ).make_participants()
        # MMA -> epilogue: all 128 threads wait for the commit that ends the accumulation.
        acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _THREADS),
            barrier_storage=acc_mbar,
        ).make_participants()

        # (bM, bK, RestK) / (bN, bK, RestK) / (bM, bN): the single tile at (0, 0)
        tile_coord = (0, 0, None)
        gA = cute.local_tile(mA_tma, self.mma_tiler_mnk, tile_coord, proj=(1, None, 1))
        gB = cute.local_tile(mB_tma, self.mma_tiler_mnk, tile_coord, proj=(None, 1, 1))
        gC = cute.local_tile(mC, self.mma_tiler_mnk, tile_coord, proj=(1, 1, None))
        thr_mma = tiled_mma.get_slice(0)  # 1-CTA MMA: one "thread" (the CTA) in the MMA
        tCgA = thr_mma.partition_A(gA)  # (MMA, MMA_M, MMA_K, RestK)
        tCgB = thr_mma.partition_B(gB)  # (MMA, MMA_N, MMA_K, RestK)
        tCgC = thr_mma.partition_C(gC)  # (MMA, MMA_M, MMA_N)
        tCrA = tiled_mma.make_fragment_A(sA)  # smem descriptors, (MMA, MMA_M, MMA_K, Stage)
        tCrB = tiled_mma.make_fragment_B(sB)
        tCtAcc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler_mnk[:2]))

        # TMA partitions: the smem stage and the gmem k-tile, each flattened to one TMA mode.
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3)
        )

        # TMEM: warp 0 allocates (a power of two >= 32 columns, one per fp32 accumulator
        # column) and writes the base address to smem; the named barrier publishes it.
        tmem = TmemAllocator(barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=_THREADS))
        tmem.allocate(get_num_tmem_alloc_cols(tCtAcc))
        # No further allocation in this CTA: lets a co-resident CTA's allocation proceed.
        tmem.relinquish_alloc_permit()
        tmem.wait_for_alloc()
        tCtAcc = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), tCtAcc.layout)

        # ---- mainloop (warp 0): TMA k-tile into a stage, then the MMAs over its k-blocks ----
        if warp_idx == 0:
            acc_empty = acc_producer.acquire_and_advance()
            # The first MMA overwrites whatever TMEM held; every later one accumulates.
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for k_tile in cutlass.range(self.num_k_tiles):
                ab_empty = ab_producer.acquire_and_advance()
                cute.copy(
                    tma_atom_a, tAgA[None, k_tile], tAsA[None, ab_empty.index], tma_bar_ptr=ab_empty.barrier
                )
                cute.copy(
                    tma_atom_b, tBgB[None, k_tile], tBsB[None, ab_empty.index], tma_bar_ptr=ab_empty.barrier
                )
                ab_full = ab_consumer.wait_and_advance()
                for k_block in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    coord = (None, None, k_block, ab_full.index)
                    cute.gemm(tiled_mma, tCtAcc, tCrA[coord], tCrB[coord], tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                ab_full.release()  # tcgen05.commit: the stage is free once these MMAs retire
            acc_empty.commit()  # tcgen05.commit on the accumulator barrier

        # ---- epilogue (all warps): TMEM -> registers -> global, epi_cols columns at a time ----
        # Ld32x32b: each thread reads one TMEM lane (= one row of C), 32 consecutive columns.
        epi_tiler = ((cute.size(tCtAcc, mode=[0, 0]), self.epi_cols),)
        tCtAcc_epi = cute.zipped_divide(tCtAcc, epi_tiler)  # (EpiTile, NumEpi)
        tCgC_epi = cute.zipped_divide(tCgC, epi_tiler)
        tmem_load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), self.acc_dtype),
            tCtAcc_epi[None, 0],
        )
        thr_load = tmem_load.get_slice(tidx)
        tDtAcc = thr_load.partition_S(tCtAcc_epi)  # (CpyT, NumCpy, NumEpi)
        tDgC = thr_load.partition_D(tCgC_epi)
        tDrAcc = cute.make_rmem_tensor(tDgC[None, None, 0].shape, self.acc_dtype)

        acc_full = acc_consumer.wait_and_advance()
        for i in cutlass.range_constexpr(cute.size(tDtAcc, mode=[2])):
            cute.copy(tmem_load, tDtAcc[None, None, i], tDrAcc)
            cute.autovec_copy(tDrAcc, tDgC[None, None, i])  # 128 contiguous bytes per thread
        # tcgen05.ld is asynchronous: tcgen05.wait::ld before the barrier that lets warp 0
        # free the columns these loads read (and before releasing the accumulator).
        cute.arch.fence_view_async_tmem_load()
        acc_full.release()
        pipeline.sync(barrier_id=1)
        tmem.free(tCtAcc.iterator)
