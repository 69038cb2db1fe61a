"""An interleaved A/B of portable-decode tilings (``sm80.decode`` forced with ``backend="sm80"``)
on the shapes of ``cute-kernels bench sm80 decode``: each named tiling is checked against the
reference, then timed (CUDA-graph medians) in alternating order, five rounds, so that clock drift
falls on every tiling alike. Percent of the read roofline as in the benchmark (visible KV + Q + O
over the read bandwidth measured in the same run).

``python -m profiling.ab_sm80_decode --variants "plan:;nopf:page_prefetch=false" [--shapes S]
[--kv bf16,fp8] [--fi] [--json PATH]``

The variant syntax is the benchmark's (``name:field=value+field=value;...``); ``plan`` (no field)
is the plan's own tiling, and the first variant is the baseline of the ratios. ``--fi`` adds
FlashInfer's tensor-core decode wrapper (``fi_tc``, one query token per request only) to the rounds.
"""

from __future__ import annotations

import json

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.bench.decode import SHAPES
from cute_kernels.bench.harness import ab_parser, choice_list, select_named
from cute_kernels.bench.sm80 import PAGE, _fi_decode, decode_case, parse_named_variants
from cute_kernels.bench.timing import bench_setup, interleaved_medians, speedups
from cute_kernels.jit.parallel import precompile
from cute_kernels.jit.spec import normalize_target
from cute_kernels.ops.paged_decode import tuning_override
from cute_kernels.plans.sm80 import decode_variants
from cute_kernels.testing import rel_err

ROUNDS = 5
KV_DTYPES = ("bf16", "fp8")


def warm(variants: dict[str, dict], shapes: list[tuple], kv_dtypes) -> None:
    """Every variant's configs (split and not, and the merge) compiled in parallel first: the
    op would compile them one by one."""
    target = normalize_target(torch.cuda.get_device_capability())
    configs = [c for f in variants.values() for _, Hq, Hkv, D, _, _, q_len in shapes
               for c in decode_variants(target=target, head_dim=D, num_q_heads=Hq, num_kv_heads=Hkv, page_size=PAGE,
                                        kv_dtypes=kv_dtypes, q_lens=(q_len,), scale_tensors=(False,), **f)]
    precompile(configs, target, progress=False)


def run(variants: dict[str, dict], shapes: str | None, kv_dtypes=KV_DTYPES, fi: bool = False) -> list[dict]:
    bw, g = bench_setup()
    rows = []
    chosen = select_named("--shapes", shapes, SHAPES)
    warm(variants, chosen, kv_dtypes)
    for shape in chosen:
        name, D, q_len = shape[0], shape[3], shape[6]
        for kvn in kv_dtypes:
            c, nbytes = decode_case(shape, kvn, g)
            ref = reference.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **c.kwargs())
            outs = {k: torch.full_like(c.q, float("nan")) for k in variants}

            def call(k):
                def fn():
                    with tuning_override(backend="sm80", **variants[k]):
                        cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=outs[k],
                                                  **c.kwargs())
                return fn

            fns = {k: call(k) for k in variants}
            if fi and q_len == 1:
                fns["fi_tc"], outs["fi_tc"] = _fi_decode(c, D ** -0.5, True)
            row: dict = dict(shape=name, kv=kvn, kv_mb=round(c.visible_kv_bytes() / 1e6, 1))
            for k, fn in fns.items():
                fn()
                torch.cuda.synchronize()
                row[k + "_err"] = rel_err(outs[k].float(), ref.float())  # NaN where a row was never written
            medians = interleaved_medians(fns, rounds=ROUNDS)
            for k, t in medians.items():
                row[k + "_us"] = round(t * 1e6, 2)
                row[k + "_roof"] = round(100 * nbytes / bw / t, 1)
            row.update(speedups(medians))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = ab_parser(__doc__, "comma-separated substrings of the shape names")
    p.add_argument("--kv", default="bf16,fp8", help="comma-separated cache dtypes: bf16, fp8")
    p.add_argument("--fi", action="store_true", help="add FlashInfer's tensor-core decode wrapper (fi_tc)")
    args = p.parse_args()
    rows = run(parse_named_variants(args.variants), args.shapes, choice_list("--kv", args.kv, KV_DTYPES), args.fi)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
