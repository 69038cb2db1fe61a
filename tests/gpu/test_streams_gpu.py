"""Concurrent streams: split launches on two streams at once never share partials or arrival
counters (workspaces are per stream, docs/design/inputs.md#workspaces), eagerly and as CUDA graphs
replayed on both streams, under load and for many iterations, with different shapes per stream.

Every result is compared bit for bit with the same call run alone (split launches with a static
schedule are deterministic), so a shared workspace, whose partials or counters the other stream
overwrites, fails at the first corrupted iteration.
"""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels.ops.paged_decode import tuning_override as decode_override
from cute_kernels.ops.qsa_sparse_attention import tuning_override as qsa_override
from cute_kernels.testing import make_paged_decode_case
from tests.cpu.test_qsa_reference import make_qsa_case

from .conftest import sm90_only

pytestmark = sm90_only()
ITERS = 60


def _decode_cases(gen):
    """Two shapes per stream, every launch split (global merge: partials and counters in the
    workspace)."""
    shapes = [dict(batch=2, num_q_heads=32, num_kv_heads=8, seq_lens=[3000, 2500], splits=8),
              dict(batch=3, num_q_heads=16, num_kv_heads=4, seq_lens=[5000, 100, 4100], splits=12),
              dict(batch=1, num_q_heads=32, num_kv_heads=8, seq_lens=[8000], splits=16),
              dict(batch=4, num_q_heads=8, num_kv_heads=2, seq_lens=[900, 1900, 2900, 3900], splits=6)]
    cases = []
    for sh in shapes:
        splits = sh.pop("splits")
        c = make_paged_decode_case(head_dim=128, page_size=16, generator=gen, **sh)
        cases.append((c, splits))
    return cases


def _decode(c, splits, out):
    return cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, num_splits=splits,
                                     **c.kwargs())


def _load(stream, x):
    """Background work on a third stream, so the two streams' kernels interleave unpredictably."""
    with torch.cuda.stream(stream):
        for _ in range(4):
            x = x @ x
            x = x / x.abs().max()
    return x


@pytest.mark.parametrize("cluster", [False, None])
def test_split_decode_on_two_streams(gen, cluster):
    cases = _decode_cases(gen)
    with decode_override(**({} if cluster is None else {"cluster": cluster})):
        expected = [_decode(c, s, torch.empty_like(c.q)).clone() for c, s in cases]
        torch.cuda.synchronize()
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        loader, x = torch.cuda.Stream(), torch.randn(2048, 2048, device="cuda")
        history = [[], []]
        for it in range(ITERS):
            x = _load(loader, x)
            for k, stream in enumerate(streams):
                c, s = cases[2 * k + it % 2]  # stream k alternates between its two shapes
                with torch.cuda.stream(stream):
                    out = torch.full_like(c.q, float("nan"))
                    history[k].append((2 * k + it % 2, _decode(c, s, out)))
        torch.cuda.synchronize()
    for k in range(2):
        for it, (i, out) in enumerate(history[k]):
            assert torch.equal(out, expected[i]), f"stream {k}, iteration {it}: differs from the call run alone"


def test_split_decode_graphs_replayed_on_two_streams(gen):
    """Each stream captures its own graph (so it owns its workspaces); both graphs replay at once,
    with new queries copied in before each replay on their stream."""
    cases = _decode_cases(gen)[:2]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [torch.empty_like(c.q) for c, _ in cases]
    graphs = []
    with decode_override(cluster=False):
        for (c, s), stream, out in zip(cases, streams, outs):
            with torch.cuda.stream(stream):
                _decode(c, s, out)  # eager call on the stream that captures: sizes its workspace
            stream.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                _decode(c, s, out)
            graphs.append(g)
    queries = [[torch.randn(c.q.shape, device="cuda", generator=gen).to(c.q.dtype) for _ in range(4)]
               for c, _ in cases]
    expected = []
    with decode_override(cluster=False):
        for (c, s), qs in zip(cases, queries):
            row = []
            for qn in qs:
                c.q.copy_(qn)
                row.append(_decode(c, s, torch.empty_like(c.q)).clone())
            expected.append(row)
    torch.cuda.synchronize()
    loader, x = torch.cuda.Stream(), torch.randn(2048, 2048, device="cuda")
    history = [[], []]
    for it in range(ITERS):
        x = _load(loader, x)
        for k, (stream, graph) in enumerate(zip(streams, graphs)):
            with torch.cuda.stream(stream):
                cases[k][0].q.copy_(queries[k][it % 4])
                outs[k].fill_(float("nan"))
                graph.replay()
                history[k].append(outs[k].clone())
    torch.cuda.synchronize()
    for k in range(2):
        for it, out in enumerate(history[k]):
            assert torch.equal(out, expected[k][it % 4]), f"graph {k}, replay {it}"


def test_split_qsa_on_two_streams(gen):
    g = torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=gen, device="cuda")))
    cases = [make_qsa_case(rows=r, num_q_heads=24, num_kv_heads=2, head_dim=256, page=800, ctx=3000, num_reqs=2,
                           block_budget=300, width=1208, generator=g, device="cuda", gate=gate)
             for r, gate in ((4, True), (3, False))]
    args = [{k: v for k, v in c.items() if k != "meta"} for c in cases]
    with qsa_override(splits=6):
        expected = [cute_kernels.qsa_sparse_attention(**a, prefill=False).clone() for a in args]
        torch.cuda.synchronize()
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        history = [[], []]
        for _ in range(ITERS):
            for k, stream in enumerate(streams):
                with torch.cuda.stream(stream):
                    out = torch.full_like(args[k]["q"], float("nan"))
                    history[k].append(cute_kernels.qsa_sparse_attention(**args[k], prefill=False, out=out))
        torch.cuda.synchronize()
    for k in range(2):
        for it, out in enumerate(history[k]):
            assert torch.equal(out, expected[k]), f"stream {k}, iteration {it}"


def test_each_stream_gets_its_own_workspace(gen):
    from cute_kernels.ops.paged_decode import _workspace

    (c, s), _ = _decode_cases(gen)[:2]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    with decode_override(cluster=False):
        for stream in streams:
            with torch.cuda.stream(stream):
                _decode(c, s, torch.empty_like(c.q))
    torch.cuda.synchronize()
    ptrs = {_workspace.buffers[(c.q.device, st.cuda_stream)].data_ptr() for st in streams}
    assert len(ptrs) == 2


def test_graphs_captured_on_a_fresh_stream_replay_in_any_order(gen):
    """Two split graphs captured on torch's capture stream (no eager call ever ran there, so their
    workspaces are created during the captures), the second replayed first: its arrival counters
    must already be zero (carved from memory zeroed eagerly, never zeroed by the first graph)."""
    cases = _decode_cases(gen)[:2]
    outs, graphs, expected = [], [], []
    with decode_override(cluster=False):
        for c, s in cases:
            expected.append(_decode(c, s, torch.empty_like(c.q)).clone())  # compiles, on the default stream
        torch.cuda.synchronize()
        for c, s in cases:
            out = torch.empty_like(c.q)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                _decode(c, s, out)
            outs.append(out)
            graphs.append(g)
    for k in (1, 0, 1, 0):
        outs[k].fill_(float("nan"))
        graphs[k].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[k], expected[k]), f"graph {k}"


def test_workspace_growth_escapes_a_thread_routed_pool(gen):
    """torch.compile's CUDA-graph trees (and ``torch.cuda.use_mem_pool``) route every allocation of
    the current thread to a private pool. A split launch on a new stream grows that stream's
    workspace and arrival counters there; they outlive the call, so they must not come from the
    pool: once the call's output is freed the pool holds no live block."""
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda.MemPool, "snapshot"):
        pytest.skip("this torch has no MemPool.snapshot")
    c = make_paged_decode_case(batch=3, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=[2900, 31, 700], generator=gen)
    want = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, num_splits=8, **c.kwargs())
    pool, stream = torch.cuda.MemPool(), torch.cuda.Stream()  # a new stream: its workspaces do not exist yet
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool):
        out = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, num_splits=8, **c.kwargs())
    stream.synchronize()
    assert torch.equal(out, want)
    del out
    torch.cuda.synchronize()
    live = [b for seg in pool.snapshot() for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert not live, f"{len(live)} block(s) of the call stayed live in the caller's pool: {live[:3]}"
