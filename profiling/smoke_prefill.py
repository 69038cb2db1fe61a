"""Quick check of the SM90 paged prefill kernel on the H200: every case of
tests/gpu/test_prefill_kernel_gpu.py once against its float64 reference (errors printed), then,
with ``--bench``, a few long causal prefills timed with CUDA events (TFLOP/s of the causal work).

    python -m profiling.smoke_prefill [--bench] [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import time

import torch

from tests.gpu.test_prefill_kernel_gpu import (
    CASES,
    PREFIXES,
    Q_LENS,
    case_config,
    check,
    make_case,
    run_kernel,
)


def smoke(only: str | None) -> int:
    g = torch.Generator(device="cuda")
    failed = 0
    for i, c in enumerate(CASES):
        cfg = case_config(c)
        if only and only not in cfg.label():
            continue
        g.manual_seed(1000 + i)
        q, kv, D, Hq, Hkv, page, layout, form, causal, lse, qs = c
        case = make_case(q_lens=Q_LENS, prefixes=PREFIXES, Hq=Hq, Hkv=Hkv, D=D, page=page, q_dtype=q, kv_dtype=kv,
                         layout=layout, form=form, q_scale_kind=qs, gen=g)
        t0 = time.time()
        try:
            check(cfg, case, layout, f"[{i}] {q}/{kv} D{D} G{Hq // Hkv} p{page} {layout} {form} "
                                     f"{'causal' if causal else 'full'} seed {1000 + i}")
        except Exception as e:  # keep going: report every failing variant
            failed += 1
            print(f"[{i}] FAILED ({type(e).__name__}): {str(e)[:400]}", flush=True)
        print(f"    ({time.time() - t0:.1f} s incl. compile)", flush=True)
    return failed


def bench():
    """TFLOP/s of the defaults on the issue's long shapes, then the consumer schedules (overlap,
    pingpong) against each other at B1 S16384."""
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    runs = []
    for q, kv in (("bf16", "bf16"), ("bf16", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3")):
        c = (q, kv, 128, 32, 8, 16, "HND", "single", True, True, "scalar" if q == "fp8_e4m3" else "none")
        runs += [(c, {}, B, S) for B, S in ((1, 4096), (1, 16384), (4, 8192))]
    c = ("bf16", "bf16", 128, 32, 8, 16, "HND", "single", True, True, "none")
    runs += [(c, dict(overlap=o, pingpong=p), 1, 16384) for o, p in ((True, False), (False, False))]
    for c, override, B, S in runs:
        q, kv = c[0], c[1]
        cfg = case_config(c, **override)
        case = make_case(q_lens=[S] * B, prefixes=[0] * B, Hq=32, Hkv=8, D=128, page=16, q_dtype=q, kv_dtype=kv,
                         q_scale_kind=c[-1], gen=g, pad_rows=0)
        out, lse = run_kernel(cfg, case)
        for _ in range(3):
            run_kernel(cfg, case, out=out, lse=lse)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 10
        start.record()
        for _ in range(n):
            run_kernel(cfg, case, out=out, lse=lse)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / n
        flops = 4 * B * 32 * 128 * S * (S + 1) / 2  # causal: QK and PV over the lower triangle
        print(f"bench {q}/{kv} B{B} S{S} {override or 'defaults'}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--only")
    args = ap.parse_args()
    failed = smoke(args.only)
    if args.bench:
        bench()
    print("smoke ok" if not failed else f"smoke: {failed} case(s) failed")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
