"""Precompile benchmark tuning variants in parallel before timing them (GPU sessions are short;
the benchmarks compile missing variants one by one). Usage:

``python -m profiling.warm_variants qsa "producers=1;tile=128" [fp8_e4m3,bf16]``
``python -m profiling.warm_variants decode "occupancy=3+tile=128"``

QSA: the per-row kernel of ``bench qsa``'s decode shapes (Hq 24, Hkv 2, D 256, page 1568, BF16 and
FP8, split and unsplit, gated as the benchmark calls it). Decode: ``bench decode``'s FP8 shapes.
"""

from __future__ import annotations

import sys

from cute_kernels.jit.parallel import precompile


def _built(make, kwargs_list):
    out = []
    for kw in kwargs_list:
        try:
            out.append(make(**kw))
        except ValueError:  # a combination the kernel refuses
            pass
    return out


def qsa_configs(specs: list[dict], kv_dtypes=("bf16", "fp8_e4m3")):
    from cute_kernels.sm90.qsa import make_qsa_config

    return _built(make_qsa_config, [dict(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=12, page_size=1568,
                                         split=split, gate=gate, kv_same_strides=True, **spec)
                                    for spec in specs for kv in kv_dtypes for split in (True, False)
                                    for gate in (True, False)])


def decode_configs(specs: list[dict]):
    from cute_kernels.sm90.decode import make_decode_config

    from .bench_decode import SHAPES

    return _built(make_decode_config, [dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=D, group=Hq // Hkv,
                                            q_len=q_len, page_size=16, split=split, **spec)
                                       for spec in specs for _, Hq, Hkv, D, _, _, q_len in SHAPES
                                       for split in (True, False)])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    kind, specs = argv[0], argv[1]
    sep = "+" if kind == "decode" else ","
    parsed = [{k: int(v) for k, v in (f.split("=") for f in spec.split(sep) if f)} for spec in specs.split(";") if spec]
    kv = tuple(argv[2].split(",")) if len(argv) > 2 else ("bf16", "fp8_e4m3")
    configs = qsa_configs(parsed, kv) if kind == "qsa" else decode_configs(parsed)
    print(f"{len(set(configs))} {kind} variants", flush=True)
    precompile(configs, "sm_90a", load=False)


if __name__ == "__main__":
    main()
