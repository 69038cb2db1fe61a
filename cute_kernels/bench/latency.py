"""``cute-kernels bench latency``: small-batch paged decode (Llama-3.1-8B shape, B=1, ctx 1000,
FP8 and BF16): graph-replay and eager time for each forced split count, with and without PDL; the
host time of an eager call; and the Qwen3-30B B=8 ctx 32000 split sweep. ``--eager-study``
instead times the eager call repeatedly on the default stream, a side stream and with the
garbage collector off, and each launch form side by side.

These are the measurements behind the split heuristic, the cluster merge and the host path
(docs/design/sm90-decode.md).
"""

from __future__ import annotations

import torch

import cute_kernels
from cute_kernels.ops.paged_decode import tuning_override
from cute_kernels.testing import make_paged_decode_case

from .harness import SM90, NvtxRanges, check_unused, write_json
from .timing import host_overhead, time_eager, time_graph

NEEDS = SM90


def run(out_json=None, quick=False, nvtx=False):
    ranges = NvtxRanges(nvtx)
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    rows = []
    for kv in (torch.float8_e4m3fn, torch.bfloat16):
        case = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                      seq_lens=1000, kv_dtype=kv, generator=g, poison_tail=False)
        out = torch.empty_like(case.q)
        for name, ov in (("pdl", {}),) if quick else (("pdl", {}), ("nopdl", dict(pdl=False))):
            for splits in (None,) if quick else (None, 2, 4, 8, 16):
                with tuning_override(**ov):
                    def fn():
                        return cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                                         out=out, num_splits=splits, **case.kwargs())
                    fn = ranges.wrap("cute_kernels.paged_decode", fn)
                    t = time_graph(fn, reps=50)
                    e = time_eager(fn, reps=50)
                rows.append(dict(kv=str(kv)[6:], variant=name, splits=splits or "auto", graph_us=t * 1e6, eager_us=e * 1e6))
                print(f"{rows[-1]['kv']:<14} {name:<5} splits={str(rows[-1]['splits']):<5} graph {t*1e6:6.2f} us  eager {e*1e6:6.2f} us",
                      flush=True)
    rows.append(host_time(nvtx))
    if not quick:
        rows += split_sweep(ranges)
    write_json(out_json, rows)
    return rows


def split_sweep(ranges: NvtxRanges):
    """Qwen3-30B B=8 ctx 32000 FP8: graph time per forced split count around the schedule's
    choice (12 splits sized for 3 CTAs per SM, docs/design/sm90-decode.md#split-count-and-sizing)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(2)
    c = make_paged_decode_case(batch=8, num_q_heads=32, num_kv_heads=4, head_dim=128, page_size=16, seq_lens=32000,
                               generator=g, poison_tail=False)
    out = torch.empty_like(c.q)
    rows = []
    for splits in (None, 8, 12, 16, 20, 24, 32):
        t = time_graph(ranges.wrap("cute_kernels.paged_decode", lambda: cute_kernels.paged_decode(
            c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, num_splits=splits, **c.kwargs())))
        rows.append(dict(shape="qwen3 B8 ctx32000 fp8", splits=splits or "auto", graph_us=t * 1e6))
        print(f"qwen B8 fp8 splits={str(splits or 'auto'):<5} graph {t * 1e6:7.2f} us", flush=True)
    return rows


def host_time(nvtx: bool = False) -> dict:
    """Host microseconds of one eager paged_decode call on a tiny problem (Llama B1 shape, 64
    tokens, one split), issued back to back: what the op adds over the GPU's own time. The pieces
    of it (launch key, prepared launch, tensor conversion) are measured by the lab script
    profiling/host_costs.py."""
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    c = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, seq_lens=64,
                               generator=g, poison_tail=False)
    out = torch.empty_like(c.q)
    call = NvtxRanges(nvtx).wrap("cute_kernels.paged_decode", lambda: cute_kernels.paged_decode(
        c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, num_splits=1, **c.kwargs()))
    res = {"eager_call_us": host_overhead(call) * 1e6}
    print(f"host time of an eager call (tiny problem): {res['eager_call_us']:.2f} us", flush=True)
    return res


def eager_study(repeats: int = 5, nvtx: bool = False):
    """Why eager B1 times vary between runs: the same call timed ``repeats`` times on the default
    stream, on a side stream, and with the garbage collector off, next to its host time per call
    (perf_counter over back-to-back calls). Then the launch forms side by side (the default's
    cluster merge, the global merge, one split), each with its host time: an eager time well
    above the host time means the GPU side of the launch is the limit, not Python."""
    import gc

    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    case = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                  seq_lens=1000, kv_dtype=torch.float8_e4m3fn, generator=g, poison_tail=False)
    out = torch.empty_like(case.q)
    kw = case.kwargs()

    def call(splits=None):
        return cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                         num_splits=splits, **kw)

    call = NvtxRanges(nvtx).wrap("cute_kernels.paged_decode", call)

    rows = []
    side = torch.cuda.Stream()
    for name in ("default", "side", "nogc", "default"):
        for _ in range(repeats):
            if name == "side":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    e, h = time_eager(call, reps=50), host_overhead(call)
                torch.cuda.current_stream().wait_stream(side)
            elif name == "nogc":
                gc.disable()
                try:
                    e, h = time_eager(call, reps=50), host_overhead(call)
                finally:
                    gc.enable()
            else:
                e, h = time_eager(call, reps=50), host_overhead(call)
            rows.append(dict(study=name, eager_us=e * 1e6, host_us=h * 1e6))
        sel = [r for r in rows if r["study"] == name][-repeats:]
        print(f"eager study {name:<8} eager " + " ".join(f"{r['eager_us']:5.2f}" for r in sel)
              + "  host " + " ".join(f"{r['host_us']:5.2f}" for r in sel), flush=True)
    forms = (("cluster", {}, None), ("global", dict(cluster=False), None), ("pdl0", dict(pdl=False), None),
             ("splits1", {}, 1))
    for _ in range(2):
        for name, ov, splits in forms:
            with tuning_override(**ov):
                def form():
                    return call(splits)
                g_us = time_graph(form, reps=50) * 1e6
                e_us, h_us = time_eager(form, reps=50) * 1e6, host_overhead(form) * 1e6
            rows.append(dict(study="form " + name, graph_us=g_us, eager_us=e_us, host_us=h_us))
            print(f"launch form {name:<8} graph {g_us:5.2f}  eager {e_us:5.2f}  host {h_us:5.2f}", flush=True)
    return rows


def add_arguments(p) -> None:
    p.add_argument("--eager-study", action="store_true", help="only the eager-call variance study")
    p.add_argument("--quick", action="store_true", help="only the default launch (graph and eager) and the host time")


def check_arguments(a) -> None:
    """``--quick`` is a form of the default run: refused with ``--eager-study`` (not ignored)."""
    check_unused("with --eager-study", {"--quick": a.eager_study and a.quick})


def main(a) -> None:
    if a.eager_study:
        write_json(a.json, eager_study(nvtx=a.nvtx))
        return
    run(a.json, quick=a.quick, nvtx=a.nvtx)
