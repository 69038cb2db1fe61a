"""Split scheduling study: static ranges vs dynamic tile chunks, and split counts beyond one wave.

For each shape (FP8 cache unless noted), CUDA-graph time and % of the read roofline of: the op's
default; ``static`` (each split CTA owns a fixed tile range); ``dynamic`` (split CTAs take 2-tile
chunks from a shared counter) at the default split count and at forced counts, including more
CTAs than fit in one wave (late CTAs find little left, so a second wave costs little). Every
variant's output is checked against the reference (relative error column).
"""

from __future__ import annotations

import argparse

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.bench.decode import SHAPES
from cute_kernels.bench.harness import write_json
from cute_kernels.bench.timing import bench_setup, time_graph
from cute_kernels.ops.paged_decode import tuning_override
from cute_kernels.testing import make_paged_decode_case, rel_err

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
# shape-name substring -> forced split counts to try with dynamic scheduling
PLAN = {"B8 ctx32000": (16, 24), "B128": (2,), "B1 ctx1000": (), "B64 ctx8192": (2,), "d64": (2,), "d256": (2, 3)}


def run(out_json=None, kv_dtypes=("fp8",)):
    bw, g = bench_setup()
    rows = []
    for kvn in kv_dtypes:
        for name, Hq, Hkv, D, B, ctx, q_len in SHAPES:
            forced = next((v for k, v in PLAN.items() if k in name), None)
            if forced is None or q_len > 1:
                continue
            case = make_paged_decode_case(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=16,
                                          seq_lens=ctx, kv_dtype=FP8 if kvn == "fp8" else BF16, generator=g,
                                          poison_tail=False)
            ref = reference.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, **case.kwargs())
            nbytes = case.visible_kv_bytes() + 2 * case.q.numel() * case.q.element_size()
            out = torch.empty_like(case.q)
            variants = [("default", {}, None), ("static", dict(dynamic=False), None), ("dynamic", dict(dynamic=True), None)]
            variants += [(f"dynamic s{s}", dict(dynamic=True), s) for s in forced]
            for label, ov, splits in variants:
                with tuning_override(**ov):
                    def fn():
                        return cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                         out=out, num_splits=splits, **case.kwargs())

                    out.fill_(float("nan"))
                    fn()
                    err = rel_err(out, ref)
                    t = time_graph(fn)
                row = dict(shape=name, kv=kvn, variant=label, us=t * 1e6, roofline_pct=100 * nbytes / bw / t, err=err)
                rows.append(row)
                print(f"{name:<26} {kvn:<4} {label:<12} {row['us']:8.1f} us {row['roofline_pct']:6.1f} %  e={err:.1e}",
                      flush=True)
    write_json(out_json, dict(read_bw=bw, rows=rows))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.split_schedule")
    p.add_argument("--json", default=None)
    p.add_argument("--kv", default="fp8")
    a = p.parse_args(argv)
    run(a.json, tuple(a.kv.split(",")))


if __name__ == "__main__":
    main()
