"""The bad-input classes of tests/cpu/test_inputs_ops.py on CUDA tensors: the same errors as on the
CPU, on a first call and on a call that a cached launch of good arguments would serve, and a usable
CUDA context afterwards (docs/design/inputs.md):

- an output whose elements share memory (stride 0) is refused naming it;
- ``window_left`` beyond int32 and a float scale beyond float32 are refused (the generated
  caller's inline check included);
- an ``out=`` that requires grad is written in place, outputs carry no autograd history;
- a caller's workspace too small for the split partials is refused naming it;
- an FP8 query to ``paged_decode`` (the reference on SM90) gets sm100.decode's tensor checks.
"""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.testing import make_paged_decode_case, rel_err

from .conftest import sm90_only

pytestmark = sm90_only()
BF16 = torch.bfloat16
TOL = 5e-3


def _context_alive():
    x = torch.arange(8, device="cuda", dtype=torch.float32)
    assert float((x * 2).sum()) == 56.0


def _decode_case(gen):
    return make_paged_decode_case(batch=4, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                                  seq_lens=[700, 33, 1500, 90], generator=gen, device="cuda")


def _prefill_case(gen):
    g = gen  # a CUDA generator (conftest)
    kv = torch.randn(64, 2, 4, 16, 128, generator=g, device="cuda").to(BF16)
    bt = torch.randperm(64, generator=g, device="cuda")[:48].view(3, 16).to(torch.int32)
    q = torch.randn(40, 16, 128, generator=g, device="cuda").to(BF16)
    sl = torch.tensor([100, 9, 250], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 20, 29, 40], dtype=torch.int32, device="cuda")
    return q, kv, bt, sl, qsl


def test_self_overlapping_outputs_are_refused_after_a_cached_launch(gen):
    """A launch prepared for a dense ``out``; then a stride-0 ``out`` of the same shape and dtype:
    refused (the key holds out's strides), nothing written, the context usable."""
    c = _decode_case(gen)
    q, kv, bt, sl, qsl = _prefill_case(gen)
    dense_d = torch.full_like(c.q, float("nan"))
    cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=dense_d, **c.kwargs())
    dense_p = torch.full_like(q, float("nan"))
    cute_kernels.paged_prefill(q, kv, bt, sl, qsl, out=dense_p)
    with pytest.raises(ValueError, match=r"^out must not overlap itself"):
        cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens,
                                  out=torch.empty_like(c.q[:1]).expand_as(c.q), **c.kwargs())
    with pytest.raises(ValueError, match=r"^out must not overlap itself"):
        cute_kernels.paged_prefill(q, kv, bt, sl, qsl, out=torch.empty_like(q[:1]).expand_as(q))
    po = torch.randn(3, 5, 4, 64, generator=gen, device="cuda")
    pl = torch.randn(3, 5, 4, generator=gen, device="cuda")
    cute_kernels.merge_states(po, pl, out=torch.empty(5, 4, 64, device="cuda"))
    with pytest.raises(ValueError, match=r"^out must not overlap itself"):
        cute_kernels.merge_states(po, pl, out=torch.empty(1, 4, 64, device="cuda").expand(5, 4, 64))
    with pytest.raises(ValueError, match=r"^out must not overlap itself"):
        cute_kernels.quantize_query(c.q, 0.5, out=torch.empty(1, *c.q.shape[1:], dtype=torch.float8_e4m3fn,
                                                              device="cuda").expand(c.q.shape))
    cache = torch.zeros(1, 2, 4, 16, 128, dtype=BF16, device="cuda").expand(8, 2, 4, 16, 128)
    k = c.q[:, :4]
    with pytest.raises(ValueError, match=r"^kv_cache must not overlap itself"):
        cute_kernels.write_kv_cache(k, k, cache, torch.arange(4, dtype=torch.int32, device="cuda"))
    _context_alive()
    assert rel_err(dense_d, reference.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens,
                                                   **c.kwargs())) <= TOL


def test_int32_window_and_fp32_scales_are_refused_on_cached_calls(gen):
    c = _decode_case(gen)
    q, kv, bt, sl, qsl = _prefill_case(gen)
    cute_kernels.paged_prefill(q, kv, bt, sl, qsl, window_left=64)  # the window variant's launch, cached
    with pytest.raises(ValueError, match=r"^window_left must be an int in \[-1, 2147483647\]"):
        cute_kernels.paged_prefill(q, kv, bt, sl, qsl, window_left=2**31)
    with pytest.raises(ValueError, match=r"^window_left must be an int in \[-1, 2147483647\]"):
        cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, window_left=2**31, **c.kwargs())
    cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **{**c.kwargs(), "v_scale": 1.0})
    with pytest.raises(ValueError, match=r"^v_scale must be a positive finite float.*float32"):
        cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **{**c.kwargs(), "v_scale": 3.5e38})
    with pytest.raises(ValueError, match=r"^sm_scale must be a positive finite float.*float32"):
        cute_kernels.paged_prefill(q, kv, bt, sl, qsl, sm_scale=1e39)
    _context_alive()


def test_an_out_that_requires_grad_is_written_in_place(gen):
    """As on the CPU: written in place, no autograd history (TVM-FFI passes the pointer)."""
    c = _decode_case(gen)
    q, kv, bt, sl, qsl = _prefill_case(gen)
    out = torch.full_like(c.q, float("nan")).requires_grad_()
    res = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out=out, **c.kwargs())
    assert res is out and not out.isnan().any()
    out_p = torch.full_like(q, float("nan")).requires_grad_()
    assert cute_kernels.paged_prefill(q.requires_grad_(), kv, bt, sl, qsl, out=out_p) is out_p
    assert not out_p.isnan().any()
    assert cute_kernels.paged_prefill(q, kv, bt, sl, qsl).grad_fn is None
    _context_alive()


def test_a_workspace_too_small_is_refused_as_on_the_cpu(gen):
    """The size the CPU path checks (an H200's launch) is the size the GPU path carves."""
    c = make_paged_decode_case(batch=2, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                               seq_lens=[4000, 3000], generator=gen, device="cuda")
    small = torch.empty(4096, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"^workspace_buffer holds 4096 bytes; this call needs"):
        cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, workspace=small, **c.kwargs())
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (c.q, c.kv_cache, c.block_table, c.seq_lens)]
    with pytest.raises(ValueError, match=r"^workspace_buffer holds 4096 bytes; this call needs"):
        cute_kernels.paged_decode(*cpu, workspace=small.cpu(), **c.kwargs())
    out = cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens,
                                    workspace=torch.empty(1 << 22, dtype=torch.uint8, device="cuda"), **c.kwargs())
    assert rel_err(out, reference.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **c.kwargs())) <= TOL
    _context_alive()


def test_fp8_query_decode_checks_its_tensors_on_sm90(gen):
    c = _decode_case(gen)
    q8 = c.q.to(torch.float8_e4m3fn)
    kw = {**c.kwargs(), "q_scale": 0.5}
    with pytest.raises(TypeError, match=r"^block_table must have dtype int32"):
        cute_kernels.paged_decode(q8, c.kv_cache, c.block_table.long(), c.seq_lens, **kw)
    with pytest.raises(TypeError, match=r"^out must have dtype bfloat16"):
        cute_kernels.paged_decode(q8, c.kv_cache, c.block_table, c.seq_lens, out=torch.empty_like(c.q).half(), **kw)
    out = cute_kernels.paged_decode(q8, c.kv_cache, c.block_table, c.seq_lens, **kw)
    assert out.dtype == BF16 and rel_err(out, reference.paged_decode(q8, c.kv_cache, c.block_table, c.seq_lens,
                                                                     **kw)) <= TOL
    _context_alive()
