"""Precompile benchmark tuning variants in parallel before timing them (the benchmarks compile
missing variants one by one, which can dominate a short run on a fresh machine). Usage:

``python -m profiling.warm_variants qsa "producers=1;tile=128" [fp8_e4m3,bf16]``
``python -m profiling.warm_variants decode "occupancy=3+tile=128"``

QSA: what :func:`cute_kernels.qsa_warmup.qsa_variants` reaches for ``bench qsa``'s decode shape
(Hq 24, Hkv 2, D 256, page 1568), with each variant's fields. Decode: what
:func:`cute_kernels.warmup.decode_variants` reaches for ``bench decode``'s FP8 shapes.
"""

from __future__ import annotations

import sys

from cute_kernels.bench.harness import parse_variants
from cute_kernels.jit.parallel import precompile
from cute_kernels.qsa_warmup import qsa_variants
from cute_kernels.warmup import decode_variants


def qsa_configs(specs: list[dict], kv_dtypes=("bf16", "fp8_e4m3")):
    return [c for spec in specs for kv in kv_dtypes
            for c in qsa_variants(head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568, kv_cache_dtype=kv,
                                  **spec)]


def decode_configs(specs: list[dict]):
    from cute_kernels.bench.decode import SHAPES

    return [c for spec in specs for _, Hq, Hkv, D, _, _, q_len in SHAPES
            for c in decode_variants(head_dim=D, num_q_heads=Hq, num_kv_heads=Hkv, page_size=16, q_lens=(q_len,),
                                     scale_tensors=(False,), **spec)]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    kind, specs = argv[0], argv[1]
    sep = "+" if kind == "decode" else ","
    parsed = [v for v in parse_variants(specs, sep) if v]
    kv = tuple(argv[2].split(",")) if len(argv) > 2 else ("bf16", "fp8_e4m3")
    configs = list(dict.fromkeys(qsa_configs(parsed, kv) if kind == "qsa" else decode_configs(parsed)))
    print(f"{len(configs)} {kind} variants", flush=True)
    precompile(configs, "sm_90a", load=False)


if __name__ == "__main__":
    main()
