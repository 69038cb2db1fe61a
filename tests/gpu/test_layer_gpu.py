"""AttentionLayer on the GPU: a serving step (write the new K/V, then attend) against the reference.

Each step mixes decode requests (first) with prefill requests, with fused-QKV views for q, k and
v. Tolerance: ‖out − ref‖/‖ref‖ ≤ 5e-3 against the fp32 reference on the same cache (the decode
rows may run the SM90 decode kernel, the prefill rows the SM90 prefill kernel;
rows served by a reference fallback must match it to float noise). The written cache must equal
the reference's byte for byte. Which kernel serves each phase follows the registry (and, for a
compile-verified kernel, its runtime self-check), so the tests hold either way; the CUDA-graph test makes the
decode kernel available (it needs a capturable decode path).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cute_kernels.ops import write_kv_cache as kv_op
from dispatch import KERNELS, AttentionLayer, UnsupportedConfig
from tests.cpu.test_layer_dispatch import clone_cache, make_step, reference_step

from .conftest import rel_err, sm90_only

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
TOL = 5e-3

# kv dtype, layout, container, q_len_per_req, Hq, Hkv, D, page
CASES = [
    (FP8, "HND", "single", 1, 32, 4, 128, 16),  # Qwen3-30B
    (FP8, "NHD", "tuple", 2, 32, 8, 128, 16),
    (BF16, "HND", "tuple", 1, 16, 2, 64, 32),
    (BF16, "NHD", "single", 3, 8, 8, 256, 16),
]
DECODE_CTX = (1000, 37, 3, 16 * 5)
PREFILL = ((0, 50), (200, 17), (31, 1))


def _step(case, seed, **extra):
    kv, layout, container, q_len, Hq, Hkv, D, page = case
    kw = dict(decode_ctx=DECODE_CTX, prefill=PREFILL)
    kw.update(extra)
    return make_step(**kw, q_len_per_req=q_len, Hq=Hq, Hkv=Hkv, D=D, page=page, kv_dtype=kv, kv_layout=layout,
                     container=container, device="cuda", generator=torch.Generator().manual_seed(seed))


def _layer(case, **kw):
    kv, layout, container, q_len, Hq, Hkv, D, page = case
    scales = dict(k_scale=0.0625, v_scale=0.03125) if kv == FP8 else {}
    return AttentionLayer(Hq, Hkv, D, kv_cache_dtype=kv, page_size=page, kv_layout=layout, **scales, **kw)


def _ids(c):
    return "-".join(str(x).replace("torch.", "") for x in c)


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    from cute_kernels.jit.parallel import precompile
    from cute_kernels.ops._torch import compile_target
    from cute_kernels.warmup import decode_variants, prefill_variants

    target = compile_target(torch.device("cuda"))
    configs = []
    for case in CASES + [GRAPH_CASE]:
        kv, layout, container, q_len, Hq, Hkv, D, page = case
        step = _step(case, 0)
        configs.append(kv_op.make_config(step.k, step.v, step.kv_cache, step.metadata.slot_mapping, layout,
                                         False, False))
        if target == "sm_90a":
            configs += decode_variants(head_dim=D, num_q_heads=Hq, num_kv_heads=Hkv, page_size=page,
                                       kv_dtypes=("fp8_e4m3" if kv == FP8 else "bf16",), q_lens=(q_len,),
                                       scale_tensors=(False,), kv_layouts=(layout,),
                                       kv_forms=("pair" if container == "tuple" else "single",))
            configs += prefill_variants(head_dim=D, num_q_heads=Hq, num_kv_heads=Hkv, page_size=page,
                                        kv_dtypes=("fp8_e4m3" if kv == FP8 else "bf16",), scale_tensors=(False,),
                                        kv_layouts=(layout,), kv_forms=("pair" if container == "tuple" else "single",))
    # device-tensor scales (test_layer_tensor_scales)
    kv, layout, container, q_len, Hq, Hkv, D, page = GRAPH_CASE
    step = _step(GRAPH_CASE, 0)
    configs.append(kv_op.make_config(step.k, step.v, step.kv_cache, step.metadata.slot_mapping, layout, True, True))
    if target == "sm_90a":
        configs += decode_variants(head_dim=D, num_q_heads=Hq, num_kv_heads=Hkv, page_size=page,
                                   scale_tensors=(True,))
    precompile([c for c in configs if target in c.targets], target, progress=False)


def _cache_bytes(kv_cache):
    parts = kv_cache if isinstance(kv_cache, tuple) else (kv_cache,)
    return torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_layer_step_matches_reference(case):
    step = _step(case, 1)
    layer = _layer(case)
    plans = layer.plans_for(step.metadata)
    assert not plans["decode"].quantize_query and not plans["prefill"].quantize_query  # no FP8-QK kernel here
    expected_cache = clone_cache(step.kv_cache)
    ks, vs = layer.k_scale, layer.v_scale
    expected = reference_step(step, expected_cache, k_scale=ks, v_scale=vs)
    out = torch.full_like(step.q, float("nan"))
    out.copy_(layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata))
    torch.cuda.synchronize()
    assert torch.equal(_cache_bytes(step.kv_cache), _cache_bytes(expected_cache))
    assert torch.isfinite(out).all()
    err = rel_err(out, expected)
    assert err <= TOL, f"relative error {err:.2e} > {TOL} (decode plan: {plans['decode'].kernel})"
    nd = step.metadata.num_decode_tokens
    if plans["prefill"].is_fallback:  # prefill rows: the same reference computation
        assert rel_err(out[nd:], expected[nd:]) <= 1e-5


def test_skip_layer_next_to_fp8_layer():
    """Two layers of one model on one step: an FP8 layer and a bf16 skip layer, each with its own
    cache, each planned and served on its own."""
    fp8_case, bf16_case = (FP8, "HND", "single", 1, 32, 4, 128, 16), (BF16, "HND", "single", 1, 32, 4, 128, 16)
    fp8_step, bf16_step = _step(fp8_case, 2), _step(bf16_case, 2)
    fp8_layer, skip_layer = _layer(fp8_case, q_scale=0.5), _layer(bf16_case, q_scale=0.5)
    for layer, step in ((fp8_layer, fp8_step), (skip_layer, bf16_step)):
        plans = layer.plans_for(step.metadata)
        assert all(p.q_dtype == "bf16" and not p.applies_q_scale for p in plans.values())
        expected = reference_step(step, clone_cache(step.kv_cache), k_scale=layer.k_scale, v_scale=layer.v_scale)
        out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
        assert rel_err(out, expected) <= TOL
    assert fp8_layer.plans_for(fp8_step.metadata)["decode"].kv_cache_dtype == "fp8_e4m3"
    assert skip_layer.plans_for(bf16_step.metadata)["decode"].kv_cache_dtype == "bf16"


# prefill_query_dtype="fp8" (sm90.prefill_fp8q): ‖out − ref‖/‖ref‖ of the prefill rows against the
# reference on the same quantized query, the FP8-query kernel's tolerance in the prefill kernel tests
# (e4m3 P: test_prefill_kernel_gpu.py TOL["fp8"]); against the unquantized query its measured error is
# about 6e-2 (docs/design/sm90-prefill.md#measured--not-measured), bounded here by 1e-1
FP8_QUERY_TOL, FP8_QUERY_EXACT_TOL = 4e-2, 1e-1


@sm90_only()
@pytest.mark.parametrize("case, per_head", [(CASES[0], False), (CASES[1], True)], ids=["hnd-float", "nhd-per_head"])
def test_layer_fp8_prefill_query_step(case, per_head):
    """``prefill_query_dtype="fp8"``: a mixed step's prefill rows run ``sm90.prefill_fp8q`` on the
    query quantized with q_scale (a float, or per KV head), its decode rows the bf16-query decode;
    each part against its reference, the cache written byte for byte as the reference writes it."""
    seed = 8
    print(f"seed {seed}")
    step = _step(case, seed)
    Hkv = case[5]
    amax = float(step.q.float().abs().amax())
    q_scale = torch.full((Hkv,), amax / 448, device="cuda") if per_head else amax / 448
    layer = _layer(case, q_scale=q_scale, prefill_query_dtype="fp8")
    plans = layer.plans_for(step.metadata)
    assert plans["prefill"].kernel == "sm90.prefill_fp8q" and plans["prefill"].quantize_query
    assert plans["decode"].q_dtype == "bf16" and not plans["decode"].quantize_query
    ks, vs = layer.k_scale, layer.v_scale
    expected_cache = clone_cache(step.kv_cache)
    expected = reference_step(step, expected_cache, k_scale=ks, v_scale=vs, q_scale=q_scale, quantize=(False, True))
    exact = reference_step(step, clone_cache(step.kv_cache), k_scale=ks, v_scale=vs)
    out = torch.full_like(step.q, float("nan"))
    out.copy_(layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata))
    torch.cuda.synchronize()
    assert torch.equal(_cache_bytes(step.kv_cache), _cache_bytes(expected_cache))
    assert torch.isfinite(out).all()
    nd = step.metadata.num_decode_tokens
    decode_err, prefill_err = rel_err(out[:nd], expected[:nd]), rel_err(out[nd:], expected[nd:])
    exact_err = rel_err(out[nd:], exact[nd:])
    print(f"decode {decode_err:.2e}, prefill {prefill_err:.2e} (against the unquantized query {exact_err:.2e})")
    assert decode_err <= TOL, f"seed {seed}: decode rows {decode_err:.2e} > {TOL}"
    assert prefill_err <= FP8_QUERY_TOL, f"seed {seed}: prefill rows {prefill_err:.2e} > {FP8_QUERY_TOL}"
    assert exact_err <= FP8_QUERY_EXACT_TOL, f"seed {seed}: {exact_err:.2e} against the unquantized query"


GRAPH_CASE = (FP8, "HND", "single", 1, 32, 4, 128, 16)


def test_layer_tensor_scales():
    """k/v scales as device tensors (a 0-d one included) are read by the kernels: changing them in
    place changes the next step's result exactly as the reference says."""
    step = _step(GRAPH_CASE, 6)
    ks, vs = torch.tensor(0.0625, device="cuda"), torch.tensor([0.03125], device="cuda")
    kv, layout, container, q_len, Hq, Hkv, D, page = GRAPH_CASE
    layer = AttentionLayer(Hq, Hkv, D, kv_cache_dtype=kv, page_size=page, k_scale=ks, v_scale=vs)
    for k_value in (0.0625, 0.25):
        ks.fill_(k_value)
        expected_cache = clone_cache(step.kv_cache)
        expected = reference_step(step, expected_cache, k_scale=ks, v_scale=vs)
        out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
        torch.cuda.synchronize()
        assert torch.equal(_cache_bytes(step.kv_cache), _cache_bytes(expected_cache))
        assert rel_err(out, expected) <= TOL


@sm90_only()
def test_layer_in_cuda_graph_equals_eager(monkeypatch):
    """A uniform decode batch (with two CUDA-graph padding requests) captured once, replayed on
    new inputs written into the captured buffers: each replay equals an eager step bit for bit."""
    monkeypatch.setitem(KERNELS, "sm90.decode", dataclasses.replace(KERNELS["sm90.decode"], status="available"))
    ctx = (20, 33, 7, 50, 1000, 3)  # none page-aligned: the next token stays in the same page
    step = _step(GRAPH_CASE, 3, decode_ctx=ctx, prefill=(), pad_decode=2)
    layer = _layer(GRAPH_CASE)
    assert layer.plans_for(step.metadata)["decode"].kernel == "sm90.decode"
    md = step.metadata
    eager = layer.forward(step.q, step.k, step.v, step.kv_cache, md).clone()  # compiles, sizes workspaces
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.forward(step.q, step.k, step.v, step.kv_cache, md)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer.forward(step.q, step.k, step.v, step.kv_cache, md)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    g = torch.Generator(device="cuda").manual_seed(4)
    bt = md.block_table.long()
    for _ in range(2):  # next step: one more token per real request, new q/k/v values
        lens = md.seq_lens.clone()
        lens[:len(ctx)] += 1
        pos = (lens - 1).clamp_min(0).long()
        slots = bt.gather(1, (pos // 16).view(-1, 1)).view(-1) * 16 + pos % 16
        slots[len(ctx):] = -1
        md.seq_lens.copy_(lens)
        md.slot_mapping.copy_(slots)
        for t in (step.q, step.k, step.v):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g).to(t.dtype))
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured.clone()
        after_replay = _cache_bytes(step.kv_cache).clone()
        eager = layer.forward(step.q, step.k, step.v, step.kv_cache, md)  # rewrites the same K/V
        torch.cuda.synchronize()
        assert torch.equal(_cache_bytes(step.kv_cache), after_replay)
        assert torch.equal(replayed, eager)
        assert (replayed[len(ctx):] == 0).all()  # padding requests
        expected = reference_step(step, clone_cache(step.kv_cache), k_scale=layer.k_scale, v_scale=layer.v_scale)
        assert rel_err(replayed, expected) <= TOL


def test_layer_bad_inputs_raise():
    case = (FP8, "HND", "single", 1, 32, 4, 128, 16)
    step = _step(case, 5)
    layer = _layer(case)
    md = step.metadata
    bad = [
        (dict(q=step.q.cpu()), ValueError, "k must be on cpu"),
        (dict(k=step.k.cpu()), ValueError, "k must be on cuda"),
        (dict(q=step.q.half()), TypeError, "q must have the layer's model dtype bf16"),
        (dict(q=step.q[:, :16]), ValueError, r"q must be \[T, num_q_heads=32, head_dim=128\]"),
        (dict(q=step.q.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "q must have contiguous heads"),
        (dict(kv_cache=step.kv_cache.view(torch.uint8)), TypeError, "uint8, which is ambiguous"),
        (dict(kv_cache=step.kv_cache.to(BF16)), TypeError, "kv_cache must have this layer's kv_cache_dtype"),
        (dict(kv_cache=step.kv_cache.cpu()), ValueError, "kv_cache must be on cuda"),
        (dict(metadata=dataclasses.replace(md, slot_mapping=md.slot_mapping.cpu())), ValueError,
         "metadata.slot_mapping must be on cuda"),
        (dict(metadata=dataclasses.replace(md, block_table=md.block_table.long())), TypeError,
         "metadata.block_table must have dtype"),
    ]
    before = _cache_bytes(step.kv_cache).clone()
    for change, exc, match in bad:
        args = dict(q=step.q, k=step.k, v=step.v, kv_cache=step.kv_cache, metadata=md)
        args.update(change)
        with pytest.raises(exc, match=match):
            layer.forward(**args)
    assert torch.equal(_cache_bytes(step.kv_cache), before)  # every refusal came before any write
    with pytest.raises(UnsupportedConfig, match="q_scale"):
        AttentionLayer(32, 4, 128, kv_cache_dtype=FP8, page_size=16, q_scale=torch.ones(3, device="cuda"))
