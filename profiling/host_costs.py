"""Host-side pieces of an eager ``paged_decode`` call (lab script: it reads the op's internals,
so it follows them when they move).

Measured on a tiny problem (Llama B1 shape, 64 tokens, one split), per call: the NVTX range off
and forced on (no profiler attached), the launch-cache key, the whole call issued back to back,
its prepared launch alone, and what TVM-FFI spends converting one torch tensor argument.
``cute-kernels bench latency`` reports the whole call only. docs/design/sm90-decode.md#host-path.

``python -m profiling.host_costs [--json PATH]`` (GPU only).
"""

from __future__ import annotations

import argparse
import time

import torch

import cute_kernels
import cute_kernels._nvtx as nv
from cute_kernels.bench.harness import write_json
from cute_kernels.bench.timing import host_overhead
from cute_kernels.ops.paged_decode import _cache, _key
from cute_kernels.testing import make_paged_decode_case

CALLS = 20000


def per_call(fn, n: int = CALLS) -> float:
    """Microseconds per call of ``fn`` issued ``n`` times back to back (host clock)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def host_costs() -> dict:
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    c = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, seq_lens=64,
                               generator=g, poison_tail=False)
    out = torch.empty_like(c.q)

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
    key_args = (c.q, c.kv_cache, c.kv_cache, False, c.block_table, "HND", 1, None, 1.0, 1.0, out, False, 1, True)
    res["launch_key_us"] = per_call(lambda: _key(*key_args))

    def call():
        return cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, num_splits=1,
                                         **c.kwargs())

    res["eager_call_us"] = host_overhead(call) * 1e6
    call()
    launch = _cache.get(_key(*key_args))
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.host_costs")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    write_json(a.json, host_costs())


if __name__ == "__main__":
    main()
