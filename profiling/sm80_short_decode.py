"""What limits the portable decode on a short read (the Llama3-70B TP8 FP8 row: 67 MB of KV).

Prints and writes (``--json``) CUDA-graph medians and % of the read roofline of:

- floors that read the same bytes: one tiny kernel (the launch-to-launch gap in a graph),
  ``torch.sum`` over 67 / 134 / 268 MB and a copy of half of each (reads plus writes the bytes);
- ``sm80.decode`` on the 70B row against its split count (the plan's, and 1 to 16), its stage
  tiling (``tw`` 16 / 64, 2 / 6 stages) and the SM90 decode on the same call; the same row with a
  BF16 cache and with 2x the bytes (B128, or ctx 8192);
- the D 64 FP8 row (h32/8 B32 ctx 8192) against ``tw`` and stages, and its BF16 row (the FP8 /
  BF16 time ratio).

Design: docs/design/sm80.md#the-short-decode-against-a-plain-read.
"""

from __future__ import annotations

import argparse

import torch

import cute_kernels
from cute_kernels.bench.harness import write_json
from cute_kernels.bench.timing import bench_setup, time_graph
from cute_kernels.ops.paged_decode import tuning_override
from cute_kernels.testing import make_paged_decode_case

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


def main(out_json=None):
    bw, g = bench_setup()
    rows = []

    def record(row):
        rows.append(row)
        print(row, flush=True)

    def decode(name, Hq, Hkv, D, B, ctx, kv, splits, fields, backend="sm80"):
        case = make_paged_decode_case(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=16,
                                      seq_lens=ctx, kv_dtype=kv, generator=g, poison_tail=False, k_scale=0.0625,
                                      v_scale=0.03125)
        nbytes = case.visible_kv_bytes() + 2 * case.q.numel() * case.q.element_size()
        out = torch.empty_like(case.q)
        forced = {} if backend is None else {"backend": backend}

        def fn():
            with tuning_override(**forced, **fields):
                cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                          num_splits=splits, **case.kwargs())
        row = dict(shape=name, splits=splits, fields=fields, backend=backend or "default")
        try:
            fn()
            torch.cuda.synchronize()
            t = time_graph(fn)
            row.update(us=t * 1e6, roof=100 * nbytes / bw / t)
        except Exception as e:  # a variant that does not build is a row, not the end of the run
            row["error"] = str(e)[:200]
        record(row)

    x = torch.zeros(1, device="cuda")
    record(dict(shape="floor: one tiny kernel", us=time_graph(lambda: x.add_(1)) * 1e6))
    for mb in (67.1, 134.2, 268.4):
        n = int(mb * 1e6) // 2
        big = torch.randn(n, device="cuda", dtype=BF16)
        acc = torch.empty((), device="cuda", dtype=torch.float32)
        t = time_graph(lambda: torch.sum(big, 0, dtype=torch.float32, out=acc))
        record(dict(shape=f"floor: torch.sum of {mb} MB bf16", us=t * 1e6, roof=100 * n * 2 / bw / t))
        half = big[: n // 2]
        dst = torch.empty_like(half)
        t = time_graph(lambda: dst.copy_(half))
        record(dict(shape=f"floor: copy of {mb / 2} MB bf16 (reads + writes {mb} MB)", us=t * 1e6,
                    roof=100 * n * 2 / bw / t))
    for splits in (None, 1, 2, 3, 4, 6, 8, 12, 16):
        decode("70b fp8", 8, 1, 128, 64, 4096, FP8, splits, {})
    for f in ({"tw": 16}, {"tw": 64}, {"stages": 2}, {"stages": 6}):
        decode("70b fp8", 8, 1, 128, 64, 4096, FP8, None, f)
    decode("70b fp8", 8, 1, 128, 64, 4096, FP8, None, {}, backend=None)
    decode("70b bf16", 8, 1, 128, 64, 4096, BF16, None, {})
    decode("70b bf16", 8, 1, 128, 64, 4096, BF16, None, {}, backend=None)
    for B, ctx in ((128, 4096), (64, 8192)):
        decode(f"70b fp8 B{B} ctx{ctx}", 8, 1, 128, B, ctx, FP8, None, {})
    for f in ({}, {"tw": 64}, {"tw": 16}, {"stages": 4}):
        decode("d64 fp8", 32, 8, 64, 32, 8192, FP8, None, f)
    decode("d64 bf16", 32, 8, 64, 32, 8192, BF16, None, {})
    write_json(out_json, dict(read_bw=bw, rows=rows))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    main(p.parse_args().json)
