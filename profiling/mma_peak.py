"""The ``mma.sync`` m16n8k16 ceiling of this GPU: what warp-level MMA alone can issue.

The portable prefill (``sm80.prefill``) and FlashInfer's fa2 both run on ``mma.sync`` m16n8k16 with
fp32 accumulation; on SM90 that is not the tensor cores' peak (WGMMA's is). This kernel measures
the ceiling the two share: every warp keeps ``m_tiles x n_tiles`` independent accumulators and
issues nothing but the MMAs of one register-resident A / B pair, ``iters`` times, with no shared
memory, no softmax and no loads in the loop. Sweeping the four-warp CTAs launched per SM (one warp
per scheduler each, as many resident as the registers allow) shows how many warps per scheduler
the pipe needs to be full; the attention kernels' TFLOP/s divided by this ceiling is the fraction
of the pipe they use.

``python -m profiling.mma_peak [--json PATH]`` (GPU only). docs/design/sm80.md#the-mma-ceiling.
"""

from __future__ import annotations

import argparse

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from cute_kernels.bench.harness import write_json
from cute_kernels.bench.timing import time_eager

FLOPS_PER_MMA = 2 * 16 * 8 * 16


class MmaPeak:
    """``warps`` warps per CTA, each issuing ``iters`` rounds of ``m_tiles * n_tiles`` independent
    m16n8k16 MMAs on operands held in registers."""

    def __init__(self, dtype, m_tiles: int, n_tiles: int, iters: int, warps: int):
        self.dtype = dtype
        self.m_tiles, self.n_tiles = m_tiles, n_tiles
        self.iters, self.warps = iters, warps

    @cute.jit
    def __call__(self, mOut: cute.Tensor, seed: Int32, ctas: Int32):
        self.kernel(mOut, seed).launch(grid=[ctas, 1, 1], block=[32 * self.warps, 1, 1])

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, seed: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        atom = cute.make_mma_atom(warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)))
        tCrA = cute.make_rmem_tensor(((2, 2, 2), self.m_tiles), self.dtype)
        tCrB = cute.make_rmem_tensor(((2, 2), self.n_tiles), self.dtype)
        acc = cute.make_rmem_tensor(((2, 2), self.m_tiles, self.n_tiles), Float32)
        # operands from the thread index and a runtime seed, so nothing folds at compile time
        base = Float32(tidx + seed) * Float32(1.0 / 4096.0)
        for i in cutlass.range_constexpr(cute.size(tCrA)):
            tCrA[i] = (base + Float32(i) * Float32(1.0 / 64.0)).to(self.dtype)
        for i in cutlass.range_constexpr(cute.size(tCrB)):
            tCrB[i] = (base - Float32(i) * Float32(1.0 / 128.0)).to(self.dtype)
        acc.fill(0.0)
        for _ in cutlass.range(self.iters, unroll=4):
            cute.gemm(atom, acc, tCrA, tCrB, acc)
        total = Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc)):
            total = total + acc[i]
        mOut[bidx * (32 * self.warps) + tidx] = total


def _compiled(dtype, m_tiles, n_tiles, iters, warps, out, seed, ctas, options=""):
    from cutlass.cute.runtime import from_dlpack

    kernel = MmaPeak(dtype, m_tiles, n_tiles, iters, warps)
    return cute.compile(kernel, from_dlpack(out), Int32(seed), Int32(ctas), options=options)


def run(out_json=None) -> dict:
    from cutlass.cute.runtime import from_dlpack

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    iters, warps = 4096, 4
    # one wave of four-warp CTAs, `per_sm` of them per SM (as many as the registers let reside:
    # 4 x 8 accumulators take ~170 registers, so at most three CTAs), i.e. per_sm warps per scheduler
    sweep = [("bf16", cutlass.BFloat16, tiles) for tiles in ((4, 8), (2, 4), (1, 4))]
    sweep += [("fp16", cutlass.Float16, (4, 8))]
    out = torch.empty(sms * 8 * 32 * warps, device="cuda", dtype=torch.float32)
    t_out = from_dlpack(out)
    rows = []
    for dtype_name, dtype, (m_tiles, n_tiles) in sweep:
        fn = _compiled(dtype, m_tiles, n_tiles, iters, warps, out, 1, sms)
        for per_sm in (1, 2, 3, 4, 8):
            ctas = sms * per_sm

            def call():
                fn(t_out, Int32(1), Int32(ctas))

            out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            if not torch.isfinite(out[: ctas * 32 * warps]).all():
                raise RuntimeError("mma_peak produced a non-finite value")
            ms = time_eager(call, reps=10) * 1e3
            flops = ctas * warps * iters * m_tiles * n_tiles * FLOPS_PER_MMA
            row = {"dtype": dtype_name, "m_tiles": m_tiles, "n_tiles": n_tiles, "ctas_per_sm": per_sm,
                   "warps_per_scheduler": per_sm, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
            rows.append(row)
            print(f"{dtype_name} {m_tiles}x{n_tiles} CTAs/SM {per_sm}: {row['tflops']:.1f} TFLOP/s "
                  f"({ms:.3f} ms)", flush=True)
    best = max(r["tflops"] for r in rows)
    print(f"ceiling: {best:.1f} TFLOP/s ({props.name}, {sms} SMs)")
    result = {"gpu": props.name, "sms": sms, "iters": iters, "rows": rows, "ceiling_tflops": best}
    if out_json:
        write_json(out_json, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    run(parser.parse_args().json)


if __name__ == "__main__":
    main()
