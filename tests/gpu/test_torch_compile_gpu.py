"""torch.compile on the GPU: the registered ops run the CuTe kernels inside compiled graphs.

- every op in every form (the CPU tier's step, on CUDA tensors) compiled with ``fullgraph=True``
  equals eager bit for bit (the same kernels run, the default deterministic decode);
- a decode-only AttentionLayer step compiled with inductor equals eager bit for bit;
- the same step compiled with ``mode="reduce-overhead"`` is captured in a CUDA graph (no
  cudagraph skip: an uncapturable graph raises here) and each replay on fresh inputs equals eager;
- the portable kernels' routes (``sm80.decode`` for an fp16 cache with a bf16 query, split and
  merged; ``sm80.prefill`` forced with ``backend="sm80"``) compiled equal eager bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from cute_kernels import paged_decode, paged_prefill
from cute_kernels.ops import paged_prefill as prefill_op
from cute_kernels.testing import make_paged_decode_case, make_paged_prefill_case
from dispatch import AttentionLayer
from tests.cpu.test_layer_dispatch import clone_cache, make_step
from tests.cpu.test_torch_compile import _bits, assert_same, make_inputs, poisoned_outputs, step

from .conftest import sm90_only

FP8 = torch.float8_e4m3fn
# Qwen3-30B-like decode: GQA 8, FP8 cache, two CUDA-graph padding requests
HQ, HKV, D, PAGE = 32, 4, 128, 16
CTX = (1000, 37, 3, 16 * 5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _cuda(x):
    if isinstance(x, torch.Tensor):
        return x.cuda()
    if isinstance(x, dict):
        return {k: _cuda(v) for k, v in x.items()}
    return x


def _inputs(seed: int):
    x = make_inputs(seed)
    for name, value in list(vars(x).items()):
        setattr(x, name, _cuda(value))
    return x


@sm90_only()
def test_every_op_compiled_equals_eager():
    compiled = torch.compile(step, fullgraph=True)
    for seed in (81, 82):  # the second call: fresh inputs through the compiled graph
        x = _inputs(seed)
        eager_kv = x.kv.clone()
        want = step(x, {k: _cuda(v) for k, v in poisoned_outputs(x).items()}, eager_kv)
        kv = x.kv.clone()
        got = compiled(x, {k: _cuda(v) for k, v in poisoned_outputs(x).items()}, kv)
        torch.cuda.synchronize()
        assert_same(got, want)
        assert torch.equal(_bits(kv), _bits(eager_kv))


def _layer_step(seed: int, **kw):
    return make_step(decode_ctx=CTX, pad_decode=2, Hq=HQ, Hkv=HKV, D=D, page=PAGE, kv_dtype=FP8, device="cuda",
                     generator=torch.Generator().manual_seed(seed), **kw)


def _layer():
    return AttentionLayer(HQ, HKV, D, kv_cache_dtype=FP8, page_size=PAGE, k_scale=0.0625,
                          v_scale=torch.tensor(0.03125, device="cuda"))


@sm90_only()
def test_compiled_layer_step_equals_eager():
    layer = _layer()
    st = _layer_step(91)
    assert layer.plans_for(st.metadata)["decode"].kernel == "sm90.decode"

    def forward(q, k, v, kv, md):
        return layer(q, k, v, kv, md)

    eager_kv, kv = clone_cache(st.kv_cache), clone_cache(st.kv_cache)
    want = forward(st.q, st.k, st.v, eager_kv, st.metadata)
    got = torch.compile(forward, fullgraph=True)(st.q, st.k, st.v, kv, st.metadata)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    assert torch.equal(_bits(kv), _bits(eager_kv))


@sm90_only()
def test_compiled_layer_step_captures_in_a_cuda_graph():
    """mode="reduce-overhead": the step (cache write, then decode) is one CUDA graph; the cache is
    a static address (mutated inputs must be, as in an engine); replays see fresh q/k/v."""
    layer = _layer()
    st = _layer_step(92)
    kv = st.kv_cache
    torch._dynamo.mark_static_address(kv)

    def forward(q, k, v, cache, md):
        return layer(q, k, v, cache, md)

    compiled = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(93)
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        for _ in range(4):  # warm-up, record, then replays
            q, k, v = (torch.randn(t.shape, device="cuda", generator=g).to(t.dtype) for t in (st.q, st.k, st.v))
            expected_kv = kv.clone()
            want = forward(q, k, v, expected_kv, st.metadata)
            got = compiled(q, k, v, kv, st.metadata).clone()
            torch.cuda.synchronize()
            assert torch.equal(got, want)
            assert torch.equal(_bits(kv), _bits(expected_kv))
            assert (got[len(CTX):] == 0).all()  # padding requests
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


@sm90_only()
def test_portable_routes_compiled_equal_eager():
    """The registered ops serve whichever kernel the op picks: on SM90 an fp16 cache with a bf16
    query runs sm80.decode (a split launch, then merge_states), and backend="sm80" forces
    sm80.prefill; both traced with fullgraph=True equal eager bit for bit."""
    g = torch.Generator().manual_seed(95)
    print("seed=95")
    c = make_paged_decode_case(batch=3, num_q_heads=32, num_kv_heads=4, head_dim=128, page_size=16,
                               seq_lens=[3000, 17, 800], kv_dtype=torch.float16, q_dtype=torch.bfloat16, generator=g)
    p = make_paged_prefill_case(reqs=[(40, 9), (0, 33), (300, 1)], num_q_heads=32, num_kv_heads=4, head_dim=128,
                                page_size=16, kv_dtype=torch.bfloat16, generator=g)

    def decode(q, kv, bt, sl, out):
        o, lse = paged_decode(q, kv, bt, sl, k_scale=c.k_scale, v_scale=c.v_scale, num_splits=4, return_lse=True)
        paged_decode(q, kv, bt, sl, k_scale=c.k_scale, v_scale=c.v_scale, out=out)
        return o, lse, out

    def prefill(q, kv, bt, sl, qsl):
        return paged_prefill(q, kv, bt, sl, qsl, return_lse=True)

    poison = lambda: torch.full_like(c.q, float("nan"))  # noqa: E731
    want = decode(c.q, c.kv_cache, c.block_table, c.seq_lens, poison())
    got = torch.compile(decode, fullgraph=True)(c.q, c.kv_cache, c.block_table, c.seq_lens, poison())
    with prefill_op.tuning_override(backend="sm80"):
        want += prefill(p.q, p.kv_cache, p.block_table, p.seq_lens, p.query_start_loc)
        got += torch.compile(prefill, fullgraph=True)(p.q, p.kv_cache, p.block_table, p.seq_lens, p.query_start_loc)
    torch.cuda.synchronize()
    assert_same(got, want)
