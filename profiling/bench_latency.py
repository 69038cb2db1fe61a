"""Small-batch latency study for paged decode (Llama-3.1-8B shape, B=1, ctx 1000, FP8/BF16):
graph-replay time for each forced split count and tuning variant, and the eager time of a call.

Used to choose the split heuristic and tile for latency-bound shapes (profiling/NOTES.md).
"""

from __future__ import annotations

import argparse

import torch

import cute_kernels
from cute_kernels.ops.paged_decode import tuning_override
from cute_kernels.testing import make_paged_decode_case

from .bench_utils import time_eager, time_graph, write_json


def run(out_json=None, quick=False):
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
                    t = time_graph(fn, reps=50)
                    e = time_eager(fn, reps=50)
                rows.append(dict(kv=str(kv)[6:], variant=name, splits=splits or "auto", graph_us=t * 1e6, eager_us=e * 1e6))
                print(f"{rows[-1]['kv']:<14} {name:<5} splits={str(rows[-1]['splits']):<5} graph {t*1e6:6.2f} us  eager {e*1e6:6.2f} us",
                      flush=True)
    rows.append(host_costs())
    if not quick:
        rows += split_sweep()
    write_json(out_json, rows)
    return rows


def split_sweep():
    """Qwen3-30B B=8 ctx 32000 FP8: graph time per forced split count (the split heuristic's
    single-wave choice is 16 at 4 CTAs/SM)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(2)
    c = make_paged_decode_case(batch=8, num_q_heads=32, num_kv_heads=4, head_dim=128, page_size=16, seq_lens=32000,
                               generator=g, poison_tail=False)
    out = torch.empty_like(c.q)
    rows = []
    for splits in (None, 8, 12, 16, 20, 24, 32):
        t = time_graph(lambda: cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out,
                                                        num_splits=splits, **c.kwargs()))
        rows.append(dict(shape="qwen3 B8 ctx32000 fp8", splits=splits or "auto", graph_us=t * 1e6))
        print(f"qwen B8 fp8 splits={str(splits or 'auto'):<5} graph {t * 1e6:7.2f} us", flush=True)
    return rows


def host_costs():
    """Host-side pieces of an eager decode call: the NVTX range (off and forced on, no profiler
    attached), the launch-cache key (and the previous, longer one), a whole call on a tiny problem,
    its prepared launch alone, and what TVM-FFI spends converting one torch tensor argument."""
    import time

    import cute_kernels._nvtx as nv
    from cute_kernels.ops.paged_decode import _key

    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    c = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, seq_lens=64,
                               generator=g, poison_tail=False)
    out = torch.empty_like(c.q)
    n = 20000

    def per_call(fn):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    def nvtx_range():
        with nv.op_range("paged_decode", q=c.q, kv_cache=c.kv_cache, block_table=c.block_table):
            pass

    res = {"nvtx_off_us": per_call(nvtx_range)}
    saved = nv.ENABLED
    nv.ENABLED = True
    try:
        res["nvtx_forced_on_us"] = per_call(nvtx_range)
    finally:
        nv.ENABLED = saved
    res["launch_key_us"] = per_call(lambda: _key(c.q, c.kv_cache, c.kv_cache, False, c.block_table, "HND", 1, None,
                                                  1.0, 1.0, out, False, 1, True))

    def old_key():  # the fifth session's key (every tensor's shape, strides, dtype, device, alignment)
        return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
                     for t in (c.q, c.kv_cache, c.block_table, c.seq_lens, out))

    res["old_launch_key_us"] = per_call(old_key)
    from .bench_utils import host_overhead

    def call():
        return cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, num_splits=1,
                                         **c.kwargs())

    res["eager_call_us"] = host_overhead(call) * 1e6
    call()
    from cute_kernels.ops.paged_decode import _cache

    launch = _cache.get(_key(c.q, c.kv_cache, c.kv_cache, False, c.block_table, "HND", 1, None, 1.0, 1.0, out, False,
                             1, True))
    lse = launch.scratch_lse
    res["launch_only_us"] = host_overhead(lambda: launch.fn(c.q, c.kv_cache, c.kv_cache, c.block_table, c.seq_lens,
                                                            out, lse, 1.0, 1.0)) * 1e6
    import tvm_ffi

    pack = tvm_ffi.get_global_func("ffi.Array")
    ts = [torch.empty(8, 32, 128, device="cuda") for _ in range(8)]
    fts = [tvm_ffi.from_dlpack(t) for t in ts]
    res["torch_tensor_arg_us"] = (per_call(lambda: pack(*ts)) - per_call(lambda: pack(*fts))) / len(ts)
    print(" ".join(f"{k}={v:.2f}" for k, v in res.items()), flush=True)
    return res


def eager_study(repeats: int = 5):
    """Why eager B1 times vary between runs: the same call timed ``repeats`` times on the default
    stream, on a side stream, and with the garbage collector off, next to its host time per call
    (perf_counter over back-to-back calls). Then the launch forms side by side (the default's
    cluster merge, the global merge, one split), each with its host time: an eager time well
    above the host time means the GPU side of the launch is the limit, not Python."""
    import gc

    from .bench_utils import host_overhead

    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    case = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                  seq_lens=1000, kv_dtype=torch.float8_e4m3fn, generator=g, poison_tail=False)
    out = torch.empty_like(case.q)
    kw = case.kwargs()

    def call(splits=None):
        return cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                         num_splits=splits, **kw)

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


def main(argv=None):
    p = argparse.ArgumentParser(prog="cute-kernels bench latency")
    p.add_argument("--json", default=None)
    p.add_argument("--eager-study", action="store_true", help="only the eager-call variance study")
    p.add_argument("--quick", action="store_true", help="only the default launch (graph and eager) and host costs")
    a = p.parse_args(argv)
    if a.eager_study:
        rows = eager_study()
        write_json(a.json, rows)
        return
    run(a.json, quick=a.quick)


if __name__ == "__main__":
    main()
