"""``cute-kernels bench merge``: merge_states against the measured read bandwidth.

Bytes that must move: the fp32 partials and partial LSEs (read) and the merged output + LSE
(written). Shapes: split-KV decode of 64 and 256 requests x 32 heads x 128 dims, S in {2, 8, 32}.
Each merge is compared with the torch reference (relative error), which is also timed.
"""

from __future__ import annotations

import torch

import cute_kernels
from cute_kernels import reference

from .harness import SM80_PLUS, NvtxRanges, write_json
from .timing import read_bandwidth, time_graph

NEEDS = SM80_PLUS
# (splits S, rows N, heads H, head dim D)
SHAPES = [(S, N, 32, 128) for N in (64, 256) for S in (2, 8, 32)]


def run(out_json: str | None = None, nvtx: bool = False) -> list[dict]:
    ranges = NvtxRanges(nvtx)
    bw = read_bandwidth()
    rows = []
    for S, N, H, D in SHAPES:
        po = torch.randn(S, N, H, D, device="cuda")
        pl = torch.randn(S, N, H, device="cuda") * 4
        out = torch.empty(N, H, D, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(N, H, device="cuda")
        fn = ranges.wrap("cute_kernels.merge_states", lambda: cute_kernels.merge_states(po, pl, out=out, out_lse=lse))
        fn()
        ref_o, _ = reference.merge_states(po, pl)
        err = ((out.float() - ref_o).norm() / ref_o.norm()).item()
        t = time_graph(fn)
        nbytes = po.numel() * 4 + pl.numel() * 4 + out.numel() * 2 + lse.numel() * 4
        torch_t = time_graph(ranges.wrap("bench.torch", lambda: reference.merge_states(po, pl)))
        rows.append(dict(S=S, N=N, H=H, D=D, us=t * 1e6, bytes=nbytes, roofline_pct=100 * nbytes / bw / t,
                         torch_us=torch_t * 1e6, rel_err=err))
    print(f"read bandwidth: {bw / 1e12:.2f} TB/s")
    print(f"{'S':>3} {'N':>4} {'H':>3} {'D':>4} {'us':>8} {'%roof':>6} {'torch us':>9} {'rel err':>8}")
    for r in rows:
        print(f"{r['S']:>3} {r['N']:>4} {r['H']:>3} {r['D']:>4} {r['us']:>8.2f} {r['roofline_pct']:>6.1f} "
              f"{r['torch_us']:>9.2f} {r['rel_err']:>8.1e}")
    write_json(out_json, dict(read_bw=bw, rows=rows))
    return rows


def add_arguments(p) -> None:
    """No flags of its own (the common --json and --nvtx)."""


def main(args) -> None:
    run(args.json, nvtx=args.nvtx)
