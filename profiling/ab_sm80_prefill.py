"""An interleaved A/B of portable-prefill tilings (``sm80.prefill`` forced with
``backend="sm80"``) on the D 128 shapes of ``cute-kernels bench sm80 prefill``: each named tiling
is compiled, checked against the reference where the batch is small enough, then timed (CUDA-graph
medians) in alternating order, five rounds, so that clock drift falls on every tiling alike.

``python -m profiling.ab_sm80_prefill --variants "a:smem_target=sm_86+max_ctas_per_sm=1;b:..." [--shapes S]
[--kv-dtype bf16|fp16|fp8] [--page-size N] [--json PATH]``

The variant syntax is the benchmark's (``name:field=value+field=value;...``); ``plan`` (no field)
is the plan's own tiling. ``max_ctas_per_sm=1`` runs a tiling at the occupancy of a target whose
shared memory holds one CTA (docs/design/sm80.md#ping-pong-in-99-kb). ``rr:ring_release=true``: the
ping-pong default with its stages released at the turns instead of a CTA barrier per tile
(docs/design/sm80.md#ping-pong-warps).
"""

from __future__ import annotations

import json

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.bench.harness import ab_parser
from cute_kernels.bench.sm80 import PAGE, PREFILL_SHAPES, _causal_flops, parse_named_variants
from cute_kernels.bench.timing import bench_setup, interleaved_medians, speedups
from cute_kernels.ops.paged_prefill import tuning_override
from cute_kernels.testing import make_paged_prefill_case, rel_err

ROUNDS = 5
CHECK_MAX_ROWS = 4096  # the reference runs where the batch has at most this many query tokens


KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def run(variants: dict[str, dict], shapes: str | None, kv_dtype: str = "bf16", page_size: int = PAGE) -> list[dict]:
    _, g = bench_setup()
    wanted = [s.strip() for s in shapes.split(",")] if shapes else None
    rows = []
    for name, Hq, Hkv, D, B, q_len, prefix in PREFILL_SHAPES:
        if D != 128 or (wanted and not any(w in name for w in wanted)):
            continue
        c = make_paged_prefill_case(reqs=[(prefix, q_len)] * B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                    page_size=page_size, kv_dtype=KV_DTYPES[kv_dtype],
                                    q_dtype=torch.float16 if kv_dtype == "fp16" else torch.bfloat16,
                                    k_scale=0.5 if kv_dtype == "fp8" else 1.0, v_scale=0.75 if kv_dtype == "fp8" else 1.0,
                                    generator=g, poison_tail=False)
        qsl = c.query_start_loc
        ref = (reference.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, **c.kwargs())
               if B * q_len <= CHECK_MAX_ROWS else None)
        outs = {k: torch.full_like(c.q, float("nan")) for k in variants}

        def call(k):
            def fn():
                with tuning_override(backend="sm80", **variants[k]):
                    cute_kernels.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, max_query_len=q_len,
                                               out=outs[k], **c.kwargs())
            return fn

        fns = {k: call(k) for k in variants}
        row: dict = dict(shape=name, kv_dtype=kv_dtype, page_size=page_size)
        for k, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            if ref is not None:
                row[k + "_err"] = rel_err(outs[k].float(), ref.float())  # NaN where a row was never written
        medians = interleaved_medians(fns, rounds=ROUNDS, reps=3, graph_rounds=5)
        flops = _causal_flops([q_len] * B, [prefix] * B, Hq, D)
        for k, t in medians.items():
            row[k + "_tflops"] = round(flops / t / 1e12, 1)
        row.update(speedups(medians))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = ab_parser(__doc__, "comma-separated substrings of the D 128 shape names")
    p.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPES), help="the cache dtype (fp16: an fp16 query)")
    p.add_argument("--page-size", type=int, default=PAGE)
    args = p.parse_args()
    rows = run(parse_named_variants(args.variants), args.shapes, args.kv_dtype, args.page_size)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
