"""Bad inputs on the GPU: each class gets its defined result or a clear error, and the CUDA
context stays usable afterwards (docs/design/inputs.md).

- lengths past the block table: the decode kernel attends what the table addresses, as the
  reference does, and a corrupted huge length runs no longer than a full table;
- an empty KV pool: refused before any launch (decode, QSA); the cache write writes nothing;
- a block table of no columns, an empty batch: 0 / -inf or nothing, without a compiled variant;
- 0-d and 1-element scale tensors for every op, QSA's device-tensor scales read at replay time;
- merge_states with LSEs of any finite value;
- checked mode on CUDA tensors: bad data raises naming the argument and its first bad index.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.jit import compiler
from cute_kernels.ops import _launch
from cute_kernels.testing import make_paged_decode_case, rel_err
from tests.cpu.test_qsa_reference import make_qsa_case

from .conftest import sm90_only

pytestmark = sm90_only()
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
TOL = 5e-3


def _context_alive():
    x = torch.arange(8, device="cuda", dtype=torch.float32)
    assert float((x * 2).sum()) == 56.0  # a dead context would raise here


@pytest.mark.parametrize("q_len, splits", [(1, 1), (1, 4), (1, 16), (3, 2), (2, 1)])
def test_decode_lengths_past_the_block_table(gen, q_len, splits):
    """Lengths of W * page + k, 2^31 - 1 and exactly W * page: the kernel (unsplit, global merge,
    cluster merge) agrees with the reference, which attends the positions the table addresses."""
    c = make_paged_decode_case(batch=5, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=[40, 200, 33, 100, 7], q_len=q_len, generator=gen,
                               poison_tail=False)  # the longer lengths make every page's tail visible
    W = c.block_table.shape[1]
    c.seq_lens.copy_(torch.tensor([W * 16 + 5, 2**31 - 1, W * 16, W * 16 + 1, 7], dtype=torch.int32))
    out = torch.full_like(c.q, float("nan"))
    out, lse = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, return_lse=True,
                                         num_splits=splits, **c.kwargs())
    ref, ref_lse = reference.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, return_lse=True,
                                          **c.kwargs())
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)


def test_decode_huge_length_costs_one_table(gen):
    """A corrupted seq_len of 2^31 - 1 runs no longer than the table's capacity (the tiles end
    there): within a few times the same call with seq_len = W * page."""
    c = make_paged_decode_case(batch=8, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=4000, generator=gen)
    W = c.block_table.shape[1]

    def timed(lens):
        for _ in range(3):
            cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, lens, **c.kwargs())
        best = float("inf")
        for _ in range(5):  # the fastest of five rounds: another process sharing the GPU only slows a round
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, lens, **c.kwargs())
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    full = timed(torch.full_like(c.seq_lens, W * 16))
    huge = timed(torch.full_like(c.seq_lens, 2**31 - 1))
    assert huge < 3 * full + 0.01, (huge, full)


def test_empty_pool_is_refused_and_the_context_lives(gen):
    c = make_paged_decode_case(batch=2, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=[30, 0], generator=gen)
    with pytest.raises(ValueError, match=r"no pages \(P = 0\)"):
        cute_kernels.paged_decode(c.q, c.kv_cache[:0], c.block_table, c.seq_lens, **c.kwargs())
    qsl = torch.tensor([0, 1, 1], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"no pages \(P = 0\)"):
        kw = {k: v for k, v in c.kwargs().items() if k != "q_len_per_req"}  # a decode-only argument
        cute_kernels.paged_prefill(c.q[:1], c.kv_cache[:0], c.block_table, c.seq_lens, qsl, **kw)
    q = make_qsa_case(rows=4, num_q_heads=24, num_kv_heads=2, head_dim=256, page=64, ctx=100, device="cuda")
    args = {k: v for k, v in q.items() if k != "meta"}
    with pytest.raises(ValueError, match=r"no blocks \(num_blocks = 0\)"):
        cute_kernels.qsa_sparse_attention(**dict(args, k_cache=args["k_cache"][:0], v_cache=args["v_cache"][:0]),
                                          prefill=False)
    key = torch.randn(4, 8, 128, device="cuda", dtype=BF16)
    cute_kernels.write_kv_cache(key, key, torch.empty(0, 2, 8, 16, 128, dtype=FP8, device="cuda"),
                                torch.tensor([0, 1, -1, 5], device="cuda"))
    torch.cuda.synchronize()
    _context_alive()


def test_no_columns_and_empty_batches_launch_and_compile_nothing(gen):
    c = make_paged_decode_case(batch=3, num_q_heads=16, num_kv_heads=4, head_dim=64, page_size=32,
                               seq_lens=[30, 0, 90], generator=gen)
    with compiler.forbid_compiles():  # new shapes: any compile would raise
        out, lse = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table[:, :0], c.seq_lens, return_lse=True,
                                             **c.kwargs())
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
        empty = cute_kernels.paged_decode(c.q[:0], c.kv_cache, c.block_table[:0], c.seq_lens[:0], **c.kwargs())
        assert empty.shape == (0, 16, 64)
        assert cute_kernels.quantize_query(torch.empty(0, 7, 64, device="cuda", dtype=BF16), 0.5).shape == (0, 7, 64)
        cute_kernels.write_kv_cache(torch.empty(0, 3, 40, device="cuda", dtype=BF16),
                                    torch.empty(0, 3, 40, device="cuda", dtype=BF16),
                                    torch.zeros(2, 2, 3, 16, 40, device="cuda", dtype=BF16),
                                    torch.empty(0, dtype=torch.int64, device="cuda"))
        o, lse = cute_kernels.merge_states(torch.empty(0, 3, 2, 40, device="cuda"), torch.empty(0, 3, 2, device="cuda"))
        assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
        qsa = make_qsa_case(rows=1, num_q_heads=8, num_kv_heads=1, head_dim=64, page=48, ctx=10, device="cuda")
        args = {k: v for k, v in qsa.items() if k != "meta"}
        args = dict(args, q=args["q"][:0], packed_indices=args["packed_indices"][:0],
                    token_to_req=args["token_to_req"][:0], output_gate=None)
        assert cute_kernels.qsa_sparse_attention(**args, prefill=False).shape[0] == 0
        # no query heads (rows present): nothing to attend, no group-0 config built
        heads = {k: v for k, v in qsa.items() if k != "meta"}
        assert cute_kernels.qsa_sparse_attention(**dict(heads, q=heads["q"][:, :0], output_gate=None),
                                                 prefill=False).shape == (1, 0, 64)
        # a head dim of 0: nothing to write
        cute_kernels.write_kv_cache(torch.empty(2, 3, 0, device="cuda", dtype=BF16),
                                    torch.empty(2, 3, 0, device="cuda", dtype=BF16),
                                    torch.zeros(2, 2, 3, 16, 0, device="cuda", dtype=BF16),
                                    torch.tensor([0, 1], device="cuda"))


def test_aliased_outputs_and_planes_are_refused_on_the_gpu(gen):
    """The same refusals as on the CPU (tests/cpu/test_inputs.py), after a cached launch too."""
    po = torch.randn(3, 2, 4, 64, device="cuda", generator=gen)
    pl = torch.randn(3, 2, 4, device="cuda", generator=gen)
    cute_kernels.merge_states(po, pl, out=torch.empty(2, 4, 64, device="cuda"), out_lse=torch.empty(2, 4, device="cuda"))
    with pytest.raises(ValueError, match="out must not overlap partial_out"):
        cute_kernels.merge_states(po, pl, out=po[0])
    with pytest.raises(ValueError, match="out_lse must not overlap partial_lse"):
        cute_kernels.merge_states(po, pl, out_lse=pl[2])
    key = torch.randn(3, 2, 64, device="cuda", generator=gen).to(BF16)
    kv = torch.zeros(4, 2, 2, 16, 64, device="cuda", dtype=BF16)
    slots = torch.tensor([0, 17, 40], device="cuda")
    cute_kernels.write_kv_cache(key, key, (kv[:, 0], kv[:, 1]), slots)
    with pytest.raises(ValueError, match="v_cache must not overlap k_cache"):
        cute_kernels.write_kv_cache(key, key, (kv[:, 0], kv[:, 0]), slots)
    torch.cuda.synchronize()
    _context_alive()


@pytest.mark.parametrize("form", ["0d", "1", "1x1"])
def test_tensor_scales_of_any_rank_for_every_op(gen, form):
    def sc(v):
        t = torch.tensor(v, device="cuda", dtype=torch.float32)
        return t if form == "0d" else t.view(1) if form == "1" else t.view(1, 1)

    c = make_paged_decode_case(batch=3, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=[100, 1, 700], k_scale=0.0625, v_scale=0.03125, generator=gen)
    kw = dict(c.kwargs(), k_scale=sc(0.0625), v_scale=sc(0.03125))
    out = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **kw)
    assert rel_err(out, reference.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **c.kwargs())) <= TOL
    key = torch.randn(5, 8, 128, device="cuda", dtype=BF16)
    a = torch.zeros(3, 2, 8, 16, 128, device="cuda", dtype=FP8)
    b = a.clone()
    slots = torch.tensor([0, 17, -1, 40, 5], device="cuda")
    cute_kernels.write_kv_cache(key, key, a, slots, k_scale=sc(0.5), v_scale=sc(0.25))
    reference.write_kv_cache(key, key, b, slots, k_scale=0.5, v_scale=0.25)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    q = torch.randn(6, 32, 128, device="cuda", dtype=BF16)
    assert torch.equal(cute_kernels.quantize_query(q, sc(0.5)).view(torch.uint8),
                       reference.quantize_query(q, 0.5).view(torch.uint8))
    for fp8 in (False, True):
        # 6 decode rows (per-row kernel, split or not) and 80 prefill rows (the row-tile path)
        for rows, prefill in ((6, False), (80, True)):
            qc = make_qsa_case(rows=rows, num_q_heads=24, num_kv_heads=2, head_dim=256, page=64, ctx=300, num_reqs=2,
                               kv_dtype=FP8 if fp8 else BF16, device="cuda", gate=True)
            args = {k: v for k, v in qc.items() if k not in ("meta", "k_scale", "v_scale")}
            ks, vs = (0.5 / 64, 2.0 / 64) if fp8 else (0.8, 1.25)
            got = cute_kernels.qsa_sparse_attention(**args, prefill=prefill, k_scale=sc(ks), v_scale=sc(vs))
            ref = reference.qsa_sparse_attention(**args, k_scale=ks, v_scale=vs)
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("splits", [1, 3])
def test_qsa_tensor_scales_are_read_at_replay(gen, splits):
    """A captured QSA call with device-tensor scales: new values written into the scale tensors
    before a replay change the result accordingly (a float scale would stay frozen)."""
    from cute_kernels.ops.qsa_sparse_attention import tuning_override

    qc = make_qsa_case(rows=4, num_q_heads=24, num_kv_heads=2, head_dim=256, page=64, ctx=300, num_reqs=2,
                       kv_dtype=FP8, device="cuda")
    args = {k: v for k, v in qc.items() if k not in ("meta", "k_scale", "v_scale")}
    ks, vs = torch.tensor(0.5 / 64, device="cuda"), torch.tensor(2.0 / 64, device="cuda")
    out = torch.empty_like(args["q"])
    with tuning_override(splits=splits):
        cute_kernels.qsa_sparse_attention(**args, prefill=False, k_scale=ks, v_scale=vs, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cute_kernels.qsa_sparse_attention(**args, prefill=False, k_scale=ks, v_scale=vs, out=out)
    for k_val, v_val in ((0.25 / 64, 1.0 / 64), (1.0 / 64, 3.0 / 64)):
        ks.fill_(k_val)
        vs.fill_(v_val)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.qsa_sparse_attention(**args, k_scale=k_val, v_scale=v_val)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("center", [-1e4, -500.0, -129.0, 0.0, 300.0, 1e4])
def test_merge_states_any_finite_lse(gen, center):
    S, N, H, D = 19, 33, 4, 128
    po = torch.randn(S, N, H, D, device="cuda", generator=gen)
    pl = center + torch.randn(S, N, H, device="cuda", generator=gen) * 40
    pl[torch.rand(S, N, H, device="cuda", generator=gen) < 0.3] = -math.inf
    pl[:9, :5] = -math.inf  # rows whose first group is empty
    pl[:, 7] = -math.inf  # an all-empty row
    po[torch.isneginf(pl)] = float("nan")
    out, lse = cute_kernels.merge_states(po, pl)
    ref, ref_lse = reference.merge_states(po, pl, float64=True)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin], ref_lse[fin].float(), atol=1e-5, rtol=2e-7)


def test_checked_mode_on_the_gpu(gen):
    previous = _launch.set_checked(True)
    try:
        c = make_paged_decode_case(batch=3, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                   seq_lens=[100, 1, 700], generator=gen)
        cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **c.kwargs())
        W = c.block_table.shape[1]
        with pytest.raises(ValueError, match=r"seq_lens\[2\]"):
            cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table,
                                      torch.tensor([100, 1, W * 16 + 1], dtype=torch.int32, device="cuda"),
                                      **c.kwargs())
        bt = c.block_table.clone()
        bt[0, 2] = -3
        with pytest.raises(ValueError, match=r"block_table\[0, 2\] = -3"):
            cute_kernels.paged_decode(c.q, c.kv_cache, bt, c.seq_lens, **c.kwargs())
        key = torch.randn(3, 8, 128, device="cuda", dtype=BF16)
        with pytest.raises(ValueError, match=r"slot_mapping\[1\]"):
            cute_kernels.write_kv_cache(key, key, torch.zeros(2, 2, 8, 16, 128, device="cuda", dtype=FP8),
                                        torch.tensor([0, 32, -1], device="cuda"))
    finally:
        _launch.set_checked(previous)
    _context_alive()
