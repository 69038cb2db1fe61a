"""Nsight Compute readings of the decode kernel on the shapes that miss a target.

Run under ncu (``profiling/run.sh ncu``): each shape is called WARMUP + 1 times; ncu's
``--kernel-name regex:decode --launch-skip 3 --launch-count 1`` profiles the last call. The report
gives DRAM throughput, achieved occupancy and the warp stall breakdown.
"""

from __future__ import annotations

import argparse

import torch

import cute_kernels
from cute_kernels.testing import make_paged_decode_case

# name: (Hq, Hkv, D, B, ctx)
SHAPES = {
    "qwen3-30b B8 ctx32000": (32, 4, 128, 8, 32000),
    "d256 h16/8 B32 ctx8192": (16, 8, 256, 32, 8192),
    "llama3-8b B1 ctx1000": (32, 8, 128, 1, 1000),
}
WARMUP = 3  # calls before the profiled one (ncu --launch-skip counts the decode launches)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    a = p.parse_args(argv)
    Hq, Hkv, D, B, ctx = SHAPES[a.shape]
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    case = make_paged_decode_case(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=16,
                                  seq_lens=ctx, kv_dtype=torch.float8_e4m3fn, generator=g, poison_tail=False)
    out = torch.empty_like(case.q)
    for _ in range(WARMUP + 1):
        cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out, **case.kwargs())
    torch.cuda.synchronize()
    print(a.shape, "done")


if __name__ == "__main__":
    main()
