"""Read bandwidth of random fixed-size chunks: the gather ceiling of the QSA decode kernels.

QSA's selected tokens come in random 4-token blocks, and in the production cache layout (the two
halves of one ``[blocks, Hkv, PAGE, 2 D]`` buffer) a KV head's K and V rows of one token are
adjacent, so the per-row kernel reads one contiguous run of ``4 * 2 * D * elem`` bytes per
selected block: 2 KB for an FP8 cache at D 256, 4 KB for BF16. This measures what the memory
system gives for such runs, with plenty of parallelism and no attention work: a read-only Triton
kernel sums ``per`` chunks of ``chunk`` bytes per program, at random chunk-aligned offsets in a
buffer far larger than L2 (``random``) or at consecutive ones (``sequential``), next to the
streaming read bandwidth of ``cute_kernels.bench.timing.read_bandwidth`` (the rooflines'
denominator).

``python -m profiling.gather_ceiling [--json PATH]`` (GPU only). docs/design/qsa.md#the-gather-ceiling.
"""

from __future__ import annotations

import argparse

import torch

from cute_kernels.bench.harness import write_json
from cute_kernels.bench.timing import read_bandwidth, time_eager

CHUNKS = (256, 512, 1024, 2048, 4096, 8192)
BUFFER = 4 << 30
READ = 1 << 30  # bytes gathered per launch


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather(x_ptr, idx_ptr, out_ptr, CHUNK: tl.constexpr, PER: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([CHUNK], dtype=tl.float32)
        for i in tl.static_range(PER):  # all loads of a program independent: PER chunks in flight
            c = tl.load(idx_ptr + pid * PER + i).to(tl.int64)
            acc += tl.load(x_ptr + c * CHUNK + tl.arange(0, CHUNK))
        tl.store(out_ptr + pid, tl.sum(acc))

    return triton, gather


def run(chunks=CHUNKS, per: int = 4, out_json=None) -> dict:
    triton, gather = _kernel()
    stream_bw = read_bandwidth()
    print(f"streaming read bandwidth: {stream_bw / 1e12:.3f} TB/s", flush=True)
    x = torch.rand(BUFFER // 4, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for chunk in chunks:
        n_chunks = READ // chunk
        total = BUFFER // chunk
        programs = n_chunks // per
        out = torch.empty(programs, device="cuda")
        warps = max(1, min(8, chunk // 512))
        for mode in ("random", "sequential"):
            if mode == "random":
                idx = torch.randperm(total, device="cuda", generator=g)[:n_chunks].int()
            else:
                idx = torch.arange(n_chunks, device="cuda", dtype=torch.int32)
            elems = chunk // 4

            def fn():
                gather[(programs,)](x, idx, out, CHUNK=elems, PER=per, num_warps=warps)

            t = time_eager(fn, warmup=3, reps=5, rounds=5)
            bw = n_chunks * chunk / t
            row = {"chunk_bytes": chunk, "mode": mode, "per_program": per, "us": t * 1e6, "tb_s": bw / 1e12,
                   "pct_of_streaming": 100 * bw / stream_bw}
            rows.append(row)
            print(f"chunk {chunk:5d} B {mode:10s} {row['tb_s']:.3f} TB/s  {row['pct_of_streaming']:5.1f} % of "
                  f"streaming", flush=True)
    result = {"read_bw": stream_bw, "rows": rows}
    write_json(out_json, result)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.gather_ceiling")
    p.add_argument("--chunks", default=",".join(map(str, CHUNKS)), help="comma list of chunk sizes in bytes")
    p.add_argument("--per", type=int, default=4, help="chunks per program (independent loads in flight)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    run(tuple(int(c) for c in a.chunks.split(",")), a.per, a.json)


if __name__ == "__main__":
    main()
