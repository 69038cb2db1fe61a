"""A few decode and merge calls for compute-sanitizer's memcheck, racecheck, synccheck and
initcheck (``profiling/run.sh sanitize``, tests/gpu/test_sanitize_gpu.py;
docs/design/testing.md#sanitizer):

    compute-sanitizer --tool synccheck --report-api-errors no --error-exitcode 9 python3 -m profiling.sanitize_decode

Shapes include out-of-range page ids, a partial last page, an empty request, lengths past the
block table (and 2^31 - 1), split and no split, HND and NHD, FP8 and BF16 caches, q_len 2, tensor
scales, the cluster merge (DSMEM; 2, 3 and 16 CTAs, and the one-request FP8 launch the schedule
merges in a 16-CTA cluster: B 1, context 1000, Hq 32 / Hkv 8, D 128) and the global fused merge
(3 splits: staged in shared memory; 40: more than the stages hold, merged from L2), the
balanced schedule (a ragged batch in a wide table, 7 chunks per KV head cutting requests into
merged partials and 1 chunk walking every request; FP8 and BF16, q_len 2); then the
portable ``sm80.decode`` (forced) with the same bad page ids and lengths past the table, both FP8
widenings, a ring sized for 99 KB, split and not, and ``sm80.prefill`` on varlen chunks against
cached prefixes: any out-of-bounds access or barrier misuse fails the run.
"""

from __future__ import annotations

import torch

import cute_kernels
from cute_kernels.ops.paged_prefill import tuning_override as prefill_override
from cute_kernels.testing import make_paged_decode_case, make_paged_prefill_case


def main():
    # inputs drawn on the CPU: under synccheck the run failed inside the case construction, before any
    # kernel of the package launched (docs/design/testing.md#sanitizer), so only copies and the package's
    # kernels run on the GPU here
    g = torch.Generator()
    g.manual_seed(1)
    # the first CUDA work of the process, alone: a failure here is the tool's or torch's, not a kernel's
    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    print("CUDA context ready", flush=True)
    assert int(torch.randperm(50, generator=g).to("cuda").sum()) == 1225  # a pageable host-to-device copy
    print("host-to-device copy done", flush=True)
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
    # the schedule's own choice for one request of 1000 tokens: a cluster merge of 16 CTAs
    c = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, seq_lens=1000,
                               generator=g)
    cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **c.kwargs())
    # lengths past the block table (a huge one too), q_len 2, tensor scales, cluster and global merges
    for cluster in (True, False):
        c = make_paged_decode_case(batch=3, num_q_heads=16, num_kv_heads=8, head_dim=128, page_size=16,
                                   seq_lens=[200, 40, 90], q_len=2, generator=g)
        W = c.block_table.shape[1]
        c.seq_lens.copy_(torch.tensor([W * 16 + 3, 2**31 - 1, 90], dtype=torch.int32))
        kw = dict(c.kwargs(), k_scale=torch.tensor(0.0625, device="cuda"), v_scale=torch.tensor([0.03125], device="cuda"))
        with tuning_override(cluster=cluster):
            cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, num_splits=4, **kw)
    # the balanced schedule: chunks cutting requests (partials, merges), one chunk walking them all
    for kv, q_len in ((torch.float8_e4m3fn, 1), (torch.bfloat16, 2)):
        c = make_paged_decode_case(batch=9, num_q_heads=32, num_kv_heads=4, head_dim=128, page_size=16,
                                   seq_lens=[0, 1, 700, 33, 1500, 2, 64, 5000, 17], kv_dtype=kv, q_len=q_len,
                                   table_tokens=8192, generator=g)
        c.block_table[2, 3] = 10**6
        with tuning_override(balanced=True):
            for chunks in (7, 1):
                cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, num_splits=chunks,
                                          **c.kwargs())
    for kv, layout, splits, extra in ((torch.float8_e4m3fn, "HND", 1, {"widen": "bits"}),
                                      (torch.float8_e4m3fn, "NHD", 5, {}),
                                      (torch.bfloat16, "HND", 3, {"smem_target": "sm_86"})):
        c = make_paged_decode_case(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                   seq_lens=[0, 17, 300, 1000], kv_dtype=kv, kv_layout=layout, generator=g)
        c.block_table[2, 3] = 10**6
        c.block_table[3, 5] = -5
        c.seq_lens[0] = 2**31 - 1  # past the table: the positions past its capacity are not attended
        with tuning_override(backend="sm80", **extra):
            cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, num_splits=splits, **c.kwargs())
    for kv in (torch.float8_e4m3fn, torch.bfloat16):
        c = make_paged_prefill_case(reqs=[(0, 37), (50, 0), (33, 130), (1000, 5)], num_q_heads=32, num_kv_heads=8,
                                    head_dim=128, page_size=16, kv_dtype=kv, k_scale=0.5, v_scale=0.25, generator=g)
        qsl = c.query_start_loc
        c.block_table[2, 3] = 10**6
        c.block_table[3, 5] = -5
        with prefill_override(backend="sm80"):
            cute_kernels.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, max_query_len=130,
                                       k_scale=c.k_scale, v_scale=c.v_scale, return_lse=True)
    po = torch.randn(3, 5, 4, 128, generator=g).cuda()
    pl = torch.randn(3, 5, 4, generator=g).cuda()
    cute_kernels.merge_states(po, pl, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print("sanitize run finished")


if __name__ == "__main__":
    main()
