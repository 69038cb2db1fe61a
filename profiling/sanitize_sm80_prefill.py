"""A compute-sanitizer driver for the portable prefill (``sm80.prefill`` forced with
``backend="sm80"``): a few small varlen calls of its D 128 forms, each checked against the
reference, so that memcheck, racecheck, synccheck and initcheck see the ring, the shared row
statistics and the ping-pong turns on named barriers (docs/design/sm80.md#ping-pong-warps).

``python -m profiling.sanitize_sm80_prefill [--only NAME]`` (GPU only; run it once plainly to
compile, then under ``compute-sanitizer --tool racecheck`` etc.).
"""

from __future__ import annotations

import argparse

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops.paged_prefill import tuning_override
from cute_kernels.plans.sm80 import PREFILL_D128_PINGPONG, PREFILL_D128_TW64S
from cute_kernels.testing import make_paged_prefill_case, rel_err

# name -> (tuning fields, return the LSE): the default (the ping-pong form on sm_90a with a BF16
# cache), its four-warp form, its eight warps without the turns, the 99 KB targets' 128-row
# ping-pong (a ring sized for sm_86), with kv_first, the ping-pong override with the scaled
# softmax and the LSE, both ping-pong forms with the stages released at the turn (ring_release), and
# the opt-in output per warp (warp_store) on the default, the 128-row ping-pong and with the LSE
CASES = {
    "default": ({}, False),
    "four_warp": (dict(warps_m=4, pingpong=False), False),
    "eight_warp": (dict(pingpong=False), False),
    "pingpong16": (dict(smem_target="sm_86"), False),
    "kv_first": (dict(kv_first=True), False),
    "pingpong_lse": (dict(PREFILL_D128_TW64S, **PREFILL_D128_PINGPONG), True),
    "ring_release": (dict(ring_release=True), False),
    "ring_release16": (dict(smem_target="sm_86", ring_release=True), False),
    "ring_release_kv_first": (dict(ring_release=True, kv_first=True), False),
    "warp_store": (dict(warp_store=True), False),
    "warp_store16": (dict(smem_target="sm_86", warp_store=True), False),
    "warp_store_lse": (dict(PREFILL_D128_TW64S, **PREFILL_D128_PINGPONG, warp_store=True), True),
}


def run(only: str | None = None) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    # ragged: a request shorter than one row tile, one across several, one chunked after a prefix
    c = make_paged_prefill_case(reqs=[(0, 37), (0, 300), (200, 129)], num_q_heads=16, num_kv_heads=4, head_dim=128,
                                page_size=16, generator=g)
    qsl = c.query_start_loc
    for name, (fields, lse) in CASES.items():
        if only and name != only:
            continue
        print(f"case {name}", flush=True)
        out = torch.full_like(c.q, float("nan"))
        with tuning_override(backend="sm80", **fields):
            res = cute_kernels.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, max_query_len=300,
                                             out=out, return_lse=lse)
        torch.cuda.synchronize()
        o = res[0] if lse else res
        ref = reference.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl)
        err = rel_err(o.float(), ref.float())
        if not (err < 5e-3):  # NaN fails too
            raise SystemExit(f"{name}: relative error {err}")
        print(f"case {name}: ok ({err:.2e})", flush=True)
    print("sanitize run finished")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, choices=sorted(CASES))
    run(p.parse_args().only)


if __name__ == "__main__":
    main()
