"""Nsight Compute readings of the QSA kernels (``profiling/run.sh ncu``).

Each shape is called WARMUP + 1 times; ncu's ``--kernel-name regex:qsa --launch-skip`` /
``--launch-count`` pick the last call's launches. Shapes: the decode rows that miss their
target (BF16 N = 256, one CTA per SM; BF16 N = 1 and FP8 N = 4, split-K + merge) and the 1 x 4096 prefill with correlated selections (the
row-tile kernel and its union pre-pass).
"""

from __future__ import annotations

import argparse

import torch

from cute_kernels.bench.qsa import DECODE_CTX, Problem

WARMUP = 3
# name: (kind, rows, kv dtype, selection)
SHAPES = {
    "decode-bf16-256": ("decode", 256, torch.bfloat16, "independent"),
    "decode-bf16-1": ("decode", 1, torch.bfloat16, "independent"),
    "decode-fp8-4": ("decode", 4, torch.float8_e4m3fn, "independent"),
    "decode-bf16-4": ("decode", 4, torch.bfloat16, "independent"),
    "decode-fp8-256": ("decode", 256, torch.float8_e4m3fn, "independent"),
    "decode-bf16-64": ("decode", 64, torch.bfloat16, "independent"),
    "decode-fp8-64": ("decode", 64, torch.float8_e4m3fn, "independent"),
    "prefill-bf16-4096": ("prefill", 4096, torch.bfloat16, "correlated"),
    "prefill-fp8-4096": ("prefill", 4096, torch.float8_e4m3fn, "correlated"),
}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    a = p.parse_args(argv)
    kind, n, kv, sel = SHAPES[a.shape]
    prefill = kind == "prefill"
    positions = torch.arange(n, device="cuda") if prefill else torch.full((n,), DECODE_CTX - 2, device="cuda")
    prob = Problem(rows_per_copy=n, positions=positions, reqs_per_copy=1 if prefill else n,
                   ctx=n if prefill else DECODE_CTX, kv_dtype=kv, copies=1, seed=n, selection=sel)
    for _ in range(WARMUP + 1):
        prob.call(0, prefill)
    torch.cuda.synchronize()
    print(a.shape, "done")


if __name__ == "__main__":
    main()
