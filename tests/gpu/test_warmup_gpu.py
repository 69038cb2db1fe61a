"""``AttentionLayer.warmup`` on the GPU: after it, layer steps of any batch up to its limits
(decode rows, and prefill rows after them) compile nothing (compiles are forbidden during the steps: any miss of the in-memory kernel cache
raises), allocate no decode workspace on the stream it warmed, and capture in a CUDA graph on that
stream without allocating one either. The host-only half (the warm-up lists every variant a step
can reach): tests/cpu/test_warmup.py."""

from __future__ import annotations

import random

import pytest
import torch

from cute_kernels.jit import compiler
from cute_kernels.ops.paged_decode import _counters, _workspace
from dispatch import AttentionLayer
from tests.cpu.test_layer_dispatch import clone_cache, make_step, reference_step

from .conftest import rel_err, sm90_only, stable_seed

pytestmark = sm90_only()
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
MAX_SEQS, MAX_LEN, PAGE = 16, 4096, 16


def _buffers():
    return {k: (b.data_ptr(), b.numel()) for buf in (_workspace, _counters) for k, b in buf.buffers.items()}


@pytest.mark.parametrize("kv, tensors", [(FP8, False), (BF16, True)])
def test_steps_after_warmup_compile_and_allocate_nothing(request, kv, tensors):
    stream = torch.cuda.Stream()
    scale = (lambda v: torch.tensor(v, device="cuda")) if tensors else float  # noqa: E731
    layer = AttentionLayer(32, 8, 128, kv_cache_dtype=kv, page_size=PAGE, k_scale=scale(0.0625),
                           v_scale=scale(0.03125))
    with torch.cuda.stream(stream):
        configs = layer.warmup(MAX_SEQS, MAX_LEN, device="cuda", q_lens=(1, 2))
    assert any(c.kernel_id == "sm90.decode" and c.split for c in configs)
    stats, buffers = dict(compiler.stats), _buffers()
    rng = random.Random(stable_seed(request.node.nodeid))
    with compiler.forbid_compiles(), torch.cuda.stream(stream):
        for i in range(30):
            q_len = rng.choice((1, 2))
            B = rng.randint(1, MAX_SEQS)
            ctx = tuple(rng.randint(q_len, MAX_LEN - PAGE) for _ in range(B))  # the step adds a junk column
            prefill = tuple((rng.randint(0, 1000), rng.randint(1, 64)) for _ in range(rng.randint(0, 2)))
            step = make_step(decode_ctx=ctx, q_len_per_req=q_len, prefill=prefill, Hq=32, Hkv=8, D=128, page=PAGE,
                             kv_dtype=kv,
                             slot_dtype=rng.choice((torch.int32, torch.int64)), device="cuda",
                             generator=torch.Generator().manual_seed(i))
            expected = reference_step(step, clone_cache(step.kv_cache), k_scale=layer.k_scale, v_scale=layer.v_scale)
            out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
            assert rel_err(out, expected) <= 5e-3, f"step {i}: B={B}, q_len={q_len}"
        # a graph captured on the warmed stream allocates no workspace either
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
    torch.cuda.synchronize()
    assert compiler.stats == stats
    assert _buffers() == buffers, "a step allocated a decode workspace the warm-up should have reserved"
