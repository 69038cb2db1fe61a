"""Timing and roofline helpers shared by the benchmarks (GPU only; the method is described in
docs/design/benchmarks.md).

- ``time_graph``: median per-call time of ``fn`` captured ``reps`` times in one CUDA graph
  (launch gaps removed; this is the "kernel time" the tables report);
- ``time_eager``: median per-call time of back-to-back eager calls (host overhead included when
  the host is the bottleneck);
- ``read_bandwidth``: the device's streaming-read bandwidth, measured in the same process with a
  read-only Triton kernel over a buffer far larger than L2 — the denominator of every roofline.
"""

from __future__ import annotations

import statistics
import time

import torch


def time_eager(fn, *, warmup: int = 5, reps: int = 50, rounds: int = 5) -> float:
    """Median seconds per call over ``rounds`` rounds of ``reps`` eager calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def time_graph(fn, *, reps: int = 20, rounds: int = 7) -> float:
    """Median seconds per call of ``fn`` replayed from a CUDA graph holding ``reps`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    # warm-up replays for >= 100 ms: the SM clock ramps up under load (docs/design/benchmarks.md#warm-up)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    for _ in range(min(1000, int(0.1 / max(start.elapsed_time(end) / 1e3, 1e-6)))):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def time_graph_fresh(fn, **kw) -> tuple[float, float]:
    """:func:`time_graph` for the first kernel timed on a newly built problem: that timing is run
    twice; returns (the second, kept; the first, for the record).

    Why: the first timing on a fresh problem can read slow for a reason not yet known (not the
    clock ramp, not module loading): docs/design/benchmarks.md#first-timing."""
    first = time_graph(fn, **kw)
    return time_graph(fn, **kw), first


def interleaved_medians(fns: dict, *, rounds: int = 5, reps: int = 20, graph_rounds: int = 7) -> dict:
    """``{name: median seconds}`` of each ``fns[name]``, timed by :func:`time_graph` (``reps``,
    ``graph_rounds``) in ``rounds`` rounds whose order alternates (forward, then reversed), so that
    clock drift falls on every one alike (the A/B tools' timing)."""
    order = list(fns)
    times: dict = {k: [] for k in order}
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            times[k].append(time_graph(fns[k], reps=reps, rounds=graph_rounds))
    return {k: statistics.median(times[k]) for k in order}


def speedups(medians: dict) -> dict:
    """``{"<name>_over_<first>": speed of name / speed of the first}`` of :func:`interleaved_medians`."""
    first, *rest = medians
    return {f"{k}_over_{first}": round(medians[first] / medians[k], 3) for k in rest}


def host_overhead(fn, *, calls: int = 2000) -> float:
    """Seconds of host time per call when calls are issued back to back (GPU work is tiny)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls


_bw_cache: dict = {}


def read_bandwidth(nbytes: int = 4 << 30) -> float:
    """Streaming read bandwidth in bytes/s (median of several passes over ``nbytes``)."""
    if "bw" in _bw_cache:
        return _bw_cache["bw"]
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        base = pid.to(tl.int64) * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(acc))

    n = nbytes // 4
    x = torch.rand(n, device="cuda")
    BLOCK, ITERS = 4096, 16
    grid = (triton.cdiv(n, BLOCK * ITERS),)
    out = torch.empty(grid[0], device="cuda")
    t = time_eager(lambda: _read[grid](x, out, n, BLOCK=BLOCK, ITERS=ITERS, num_warps=8), warmup=3, reps=5, rounds=5)
    _bw_cache["bw"] = n * 4 / t
    return _bw_cache["bw"]


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, counting bytes read plus written (for reference)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = time_eager(lambda: b.copy_(a), warmup=2, reps=5, rounds=5)
    return 2 * a.numel() / t


def bench_setup(seed: int = 0):
    """(read bandwidth in bytes/s, printed, and a CUDA generator seeded with ``seed``)."""
    bw = read_bandwidth()
    print(f"read bandwidth: {bw / 1e12:.3f} TB/s", flush=True)
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return bw, g
