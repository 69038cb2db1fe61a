"""A few decode and merge calls for ``compute-sanitizer --tool memcheck`` (``profiling/run.sh
sanitize``; docs/design/testing.md#sanitizer):

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m profiling.sanitize_decode

Shapes include out-of-range page ids, a partial last page, an empty request, split and no split,
HND and NHD, FP8 and BF16 caches, the cluster merge (DSMEM; 2, 3 and 16 CTAs) and the global fused
merge (3 splits: staged in shared memory; 40: more than the stages hold, merged from L2): any
out-of-bounds access fails the run.
"""

from __future__ import annotations

import torch

import cute_kernels
from cute_kernels.testing import make_paged_decode_case


def main():
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    from cute_kernels.ops.paged_decode import tuning_override

    for kv, layout, splits, cluster in ((torch.float8_e4m3fn, "HND", 1, None), (torch.float8_e4m3fn, "NHD", 3, None),
                                        (torch.bfloat16, "HND", 2, None), (torch.float8_e4m3fn, "HND", 16, True),
                                        (torch.float8_e4m3fn, "HND", 3, False), (torch.float8_e4m3fn, "HND", 40, False)):
        c = make_paged_decode_case(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                   seq_lens=[0, 17, 300, 1000], kv_dtype=kv, kv_layout=layout, generator=g)
        c.block_table[2, 3] = 10**6  # out-of-range page ids must be zero-filled, never read
        c.block_table[3, 5] = -5
        with tuning_override(**({} if cluster is None else {"cluster": cluster})):
            cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, num_splits=splits, **c.kwargs())
    po = torch.randn(3, 5, 4, 128, device="cuda")
    pl = torch.randn(3, 5, 4, device="cuda")
    cute_kernels.merge_states(po, pl, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print("sanitize run finished")


if __name__ == "__main__":
    main()
