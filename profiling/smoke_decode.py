"""Quick decode smoke check (a few split counts against the reference), run before longer GPU steps
so that a broken variant fails in seconds rather than at a step's time limit."""

from __future__ import annotations

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.testing import make_paged_decode_case, rel_err


def main():
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    for kv in (torch.float8_e4m3fn, torch.bfloat16):
        case = make_paged_decode_case(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                      seq_lens=[0, 7, 1500, 48], kv_dtype=kv, generator=g)
        ref = reference.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, **case.kwargs())
        for splits in (1, 3, 5, 40):
            out = torch.full_like(case.q, float("nan"))
            cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                      num_splits=splits, **case.kwargs())
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            print(f"{str(kv)[6:]:<14} splits={splits:<3} rel err {err:.2e}", flush=True)
            assert torch.isfinite(out).all() and err < 5e-3
    print("smoke ok")


if __name__ == "__main__":
    main()
