"""The portable decode's fused merge against its merge as a second launch, by the fused merge's
dependent L2 round trips per thread (``plans.sm80.fused_merge_trips``: query rows x splits), with
programmatic dependent launch and without it (the SM80 / SM86 / SM89 launch, emulated here).

Rows: one request of one KV head (GQA 8 / 16, draft lengths 1 / 2 / 4, 32 000 tokens, BF16) and
two batches of several heads (Llama3-8B B1 ctx 1000; B4 ctx 8000 FP8), each at 4, 16, 32 and 64
splits; CUDA-graph medians of both forms. Design: docs/design/sm80.md#the-fused-merge.
"""

from __future__ import annotations

import argparse

import torch

import cute_kernels
from cute_kernels.bench.harness import write_json
from cute_kernels.bench.timing import bench_setup, time_graph
from cute_kernels.ops.paged_decode import tuning_override
from cute_kernels.plans.sm80 import fused_merge_trips, make_decode_config
from cute_kernels.testing import make_paged_decode_case

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
# group, q_len, batch, KV heads, context, cache dtype
SHAPES = ((4, 1, 1, 8, 1000, BF16), (8, 1, 1, 1, 32000, BF16), (16, 1, 1, 1, 32000, BF16), (8, 2, 1, 1, 32000, BF16),
          (16, 2, 1, 1, 32000, BF16), (16, 4, 1, 1, 32000, BF16), (8, 1, 4, 8, 8000, FP8))


def main(out_json=None):
    bw, g = bench_setup()
    rows = []
    for G, q_len, B, Hkv, ctx, kv in SHAPES:
        case = make_paged_decode_case(batch=B, num_q_heads=G * Hkv, num_kv_heads=Hkv, head_dim=128, page_size=16,
                                      seq_lens=ctx, kv_dtype=kv, q_len=q_len, generator=g, poison_tail=False)
        out = torch.empty_like(case.q)
        cfg = make_decode_config(target="sm_90a", q_dtype="bf16", kv_dtype="bf16" if kv == BF16 else "fp8_e4m3",
                                 head_dim=128, group=G, q_len=q_len, page_size=16, split=True)
        for splits in (4, 16, 32, 64):
            for pdl in (True, False):
                row = dict(G=G, q_len=q_len, B=B, Hkv=Hkv, ctx=ctx, kv=str(kv), splits=splits, pdl=pdl,
                           trips=fused_merge_trips(cfg, splits))
                for fused in (True, False):
                    def fn(fused=fused, pdl=pdl, splits=splits):
                        with tuning_override(backend="sm80", fused_merge=fused, pdl=pdl):
                            cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                      out=out, num_splits=splits, **case.kwargs())
                    try:
                        fn()
                        torch.cuda.synchronize()
                        row["fused_us" if fused else "launch_us"] = time_graph(fn) * 1e6
                    except Exception as e:
                        row["error"] = str(e)[:200]
                rows.append(row)
                print(row, flush=True)
    write_json(out_json, dict(read_bw=bw, rows=rows))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    main(p.parse_args().json)
