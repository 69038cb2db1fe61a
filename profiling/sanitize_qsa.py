"""A few QSA calls for compute-sanitizer's memcheck, racecheck, synccheck and initcheck
(tests/gpu/test_sanitize_gpu.py; docs/design/testing.md#sanitizer):

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m profiling.sanitize_qsa

Shapes: BF16 and FP8 caches, direct output and split-K + merge, with every kind of invalid
entry: negative tokens (also inside the counted prefix), pages beyond the block-table width,
physical pages < 0 and >= num_blocks, requests out of range, zero / oversized / negative valid
counts; and the prefill row-tile path (union pre-pass + row-tile kernel) with such entries in
union tiles and in tiles that fall back, and for FP8 on the widened 16-bit copy. The cache pool is allocated exactly (no spare pages), so any dereference of an invalid
entry lands outside its allocation and fails the run.
"""

from __future__ import annotations

import torch

import cute_kernels
from cute_kernels.ops.qsa_sparse_attention import tuning_override

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def case(kv_dtype, rows=6, hq=24, hkv=2, D=256, page=800, ctx=3000, topk=2051, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-ctx // page)
    reqs = 2
    NB = reqs * pages
    # K and V in separate exact-size allocations: out-of-range rows are outside both
    k = torch.randn(NB, page, hkv, D, device="cuda", generator=g)
    v = torch.randn(NB, page, hkv, D, device="cuda", generator=g)
    k, v = (k.to(FP8), v.to(FP8)) if kv_dtype == FP8 else (k.to(kv_dtype), v.to(kv_dtype))
    table = torch.randperm(NB, device="cuda", generator=g).view(reqs, pages).int().contiguous()
    packed = torch.full((rows, topk + 1), -1, dtype=torch.int32, device="cuda")
    for r in range(rows):
        n = 1500
        packed[r, :n] = torch.randint(0, ctx, (n,), device="cuda", generator=g).int()
        packed[r, topk] = n
    t2r = torch.tensor([0, 1] * (rows // 2), dtype=torch.int32, device="cuda")
    # every kind of invalid entry
    packed[0, 3:50:2] = -1  # -1 inside the counted prefix
    packed[0, 60:70] = -12345  # other negative tokens
    packed[1, 5:40] = pages * page + 17  # page beyond the table width
    table[0, 1] = -4  # physical page < 0 (every token of request 0's page 1)
    table[1, 2] = NB + 1000  # physical page >= num_blocks
    t2r[2] = 7  # request out of range
    t2r[3] = -1
    packed[4, topk] = 0  # inert row
    packed[5, topk] = 10**7  # count above TOPK: clamped
    q = torch.randn(rows, hq, D, device="cuda", generator=g).to(BF16)
    gate = torch.randn(rows, hq, D, device="cuda", generator=g).to(BF16)
    return q, k, v, packed, table, t2r, gate


def main():
    for kv in (BF16, FP8):
        q, k, v, packed, table, t2r, gate = case(kv)
        for splits in (1, 3, 24):
            for g in (gate, None):
                with tuning_override(splits=splits):
                    out = cute_kernels.qsa_sparse_attention(q, k, v, packed, table, t2r, prefill=False,
                                                            k_scale=0.5, v_scale=2.0, output_gate=g)
                assert not torch.isnan(out).any()
        packed[5, 2051] = -3  # negative count
        cute_kernels.qsa_sparse_attention(q, k, v, packed, table, t2r, prefill=True)
        # scales as device tensors (0-d and [1]), read by the kernels
        ks, vs = torch.tensor(0.5, device="cuda"), torch.tensor([2.0], device="cuda")
        for splits in (1, 3):
            with tuning_override(splits=splits):
                cute_kernels.qsa_sparse_attention(q, k, v, packed, table, t2r, prefill=False, k_scale=ks, v_scale=vs)
        # the prefill row-tile path (>= 64 rows): the invalid rows above in fallback tiles (mixed
        # requests), then one request whose rows share a selection (union tiles) with invalid
        # entries and a duplicate token inside
        q, k, v, packed, table, t2r, gate = case(kv, rows=80)
        t2r[10:] = 1
        packed[10:, :1500] = packed[10, :1500]
        packed[10:, 1400:1500] = torch.randint(0, 3000, (70, 100), device="cuda", dtype=torch.int32)
        packed[20, 7:30] = 2 * 800 * 4 + 5  # pages beyond the table width inside a union tile
        packed[31, 9] = packed[31, 8]  # a duplicate: that tile walks its rows' own lists
        packed[47, 2051] = 3
        for g in (gate, None):
            out = cute_kernels.qsa_sparse_attention(q, k, v, packed, table, t2r, prefill=True, k_scale=0.5,
                                                    v_scale=2.0, output_gate=g)
            assert not torch.isnan(out).any()
        # one consumer warpgroup, the other consumer schedule than the cache's default (FP8 overlaps
        # QK of a tile with the previous tile's PV by default; BF16 runs two serial consumers)
        with tuning_override(consumers=1, producers=8, gather_groups=2, overlap=kv == BF16):
            out = cute_kernels.qsa_sparse_attention(q, k, v, packed, table, t2r, prefill=True, output_gate=gate)
        assert not torch.isnan(out).any()
        if kv == FP8:
            # the widened copy (forced: this batch is small): invalid page ids are neither read nor
            # written by the widening pre-pass, and stay invalid in the table it writes
            with tuning_override(widen=1):
                for g in (gate, None):
                    out = cute_kernels.qsa_sparse_attention(q, k, v, packed, table, t2r, prefill=True, k_scale=0.5,
                                                            v_scale=2.0, output_gate=g)
                    assert not torch.isnan(out).any()
        # V with other strides than K (an exact-size [NB, Hkv, PAGE, D] buffer seen transposed):
        # the gather computes V's row addresses itself instead of deriving them from K's
        v_t = torch.empty(v.shape[0], v.shape[2], v.shape[1], v.shape[3], device="cuda", dtype=v.dtype)
        v_t.copy_(v.transpose(1, 2))
        v_other = v_t.transpose(1, 2)
        assert v_other.stride() != k.stride()
        for prefill in (False, True):
            out = cute_kernels.qsa_sparse_attention(q, k, v_other, packed, table, t2r, prefill=prefill,
                                                    output_gate=gate)
            assert not torch.isnan(out).any()
        # a partial last tile (78 rows, R 5) with a 2-byte aligned gate in an exact-size buffer:
        # the dead rows' gate loads (token 0) and the element-wise gate path
        odd = torch.empty(78 * q.shape[1] * q.shape[2] + 1, device="cuda", dtype=BF16)[1:].view(78, *q.shape[1:])
        odd.copy_(gate[:78])
        out = cute_kernels.qsa_sparse_attention(q[:78], k, v, packed[:78], table, t2r[:78], prefill=True,
                                                output_gate=odd)
        assert not torch.isnan(out).any()
    torch.cuda.synchronize()
    print("sanitize run finished")


if __name__ == "__main__":
    main()
