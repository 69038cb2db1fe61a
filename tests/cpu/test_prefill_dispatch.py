"""SM90 prefill in dispatch and in ``AttentionLayer``, on the CPU.

- plan rows: SM90 prefill is served by ``sm90.prefill`` for every cache dtype, with the limits of
  ``plans/sm90_prefill.py`` (not typed twice), available (verified by the GPU suite on the H200:
  the reason speaks of no self-check); the FP8-cache choice between the BF16-query and the FP8-query kernel is one
  constant with its reason, the other kernel selectable with backend=;
- the layer: all prefill rows of a step in one launch, a mixed step is one decode launch plus one
  prefill launch, no host synchronization, and only the prefill rows quantized when the prefill
  plan computes QK in FP8 (the ops stubbed, so the CUDA path's plumbing runs on the CPU);
- end to end on CPU tensors through the op's reference path, FP8 query with an fp16 model included.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.cli import main as cli_main
from cute_kernels.plans import sm90_prefill as prefill_plan
from dispatch import KERNELS, AttentionLayer, UnsupportedConfig, capabilities, plan

from .test_layer_dispatch import BATCHES, clone_cache, make_step, reference_step

FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16


def _plan(kv="fp8", model="bf16", **kw):
    args = dict(arch="sm90", phase="prefill", kv_cache_dtype=kv, model_dtype=model, head_dim=128, num_q_heads=32,
                num_kv_heads=8, page_size=16, q_len=4096)
    args.update(kw)
    return plan(**args)


def _choose_fp8_query(monkeypatch):
    """The registry as ``FP8_CACHE_KERNEL = "sm90.prefill_fp8q"`` builds it: the FP8-query kernel
    no longer opt-in (registered first, it takes exactly the FP8 caches)."""
    monkeypatch.setitem(KERNELS, "sm90.prefill_fp8q", dataclasses.replace(KERNELS["sm90.prefill_fp8q"], opt_in=False))


@pytest.fixture
def fp8_query_chosen(monkeypatch):
    """The measured choice flipped to the FP8-query kernel."""
    _choose_fp8_query(monkeypatch)


# ----------------------------------------------------------------------------------------------
# plan rows
# ----------------------------------------------------------------------------------------------


def test_registry_limits_are_the_plan_modules():
    for kid in ("sm90.prefill", "sm90.prefill_fp8q"):
        k = KERNELS[kid]
        assert k.status == "available" and k.archs == ("sm90",) and k.phases == ("prefill",)
        assert k.head_dims == prefill_plan.HEAD_DIMS and k.page_sizes == prefill_plan.PAGE_SIZES
        assert k.max_gqa_ratio == prefill_plan.MAX_GROUP and k.model_dtypes == prefill_plan.MODEL_DTYPES
        assert k.op == "paged_prefill" and k.family is None
        assert k.max_q_len is None and set(k.kv_layouts) == {"HND", "NHD"}
    assert KERNELS["sm90.prefill"].kv_dtypes == prefill_plan.KV_DTYPES
    assert KERNELS["sm90.prefill"].qk_dtype == "model"
    fp8q = KERNELS["sm90.prefill_fp8q"]
    assert fp8q.kv_dtypes == ("fp8_e4m3",) and fp8q.qk_dtype == "fp8_e4m3" and fp8q.supports_quant_query_input
    assert "fp8_e4m3" in prefill_plan.Q_DTYPES
    assert KERNELS["sm90.prefill_fp8q"].opt_in == (prefill_plan.FP8_CACHE_KERNEL == "sm90.prefill")


def test_matrix_shows_sm90_prefill_served_by_the_kernel(capsys):
    assert cli_main(["matrix", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    cells = {r["kv_cache_dtype"]: r for r in rows if (r["arch"], r["phase"]) == ("sm90", "prefill")}
    assert set(cells) == {"bf16", "fp16", "fp8_e4m3"}
    for kv in ("bf16", "fp8_e4m3"):  # a bf16 model: its own dtype or FP8 in the cache
        r = cells[kv]
        assert r["kernel"] == "sm90.prefill" and not r["is_fallback"], r
        assert r["q_dtype"] == "bf16" and not r["quantize_query"] and not r["applies_q_scale"]
    fp16 = cells["fp16"]  # an fp16 cache under a bf16 model: the portable kernel (exact in fp16)
    assert fp16["kernel"] == "sm80.prefill" and "one of the model dtype bf16 (got fp16)" in fp16["reason"]
    assert prefill_plan.FP8_CACHE_REASON in cells["fp8_e4m3"]["reason"]
    assert prefill_plan.FP8_CACHE_REASON not in cells["bf16"]["reason"]
    for kv in ("bf16", "fp8_e4m3"):
        assert "compile-verified" not in cells[kv]["reason"] and "self-check" not in cells[kv]["reason"]
    table = {(r["arch"], r["phase"]): r for r in capabilities.capability_table()}
    assert [k["id"] for k in table["sm90", "prefill"]["kernels"]] == ["sm90.prefill", "sm80.prefill",
                                                                       "reference.paged_prefill"]
    assert [k["id"] for k in table["sm90", "prefill"]["opt_in"]] == ["sm90.prefill_fp8q", "sm90.prefill_fp8x2"]


@pytest.mark.parametrize("kv,model", [("bf16", "bf16"), ("fp16", "fp16"), ("fp8", "bf16"), ("fp8", "fp16")])
def test_default_plan_keeps_the_model_dtype_query(kv, model):
    p = _plan(kv, model)
    assert p.kernel == "sm90.prefill" and p.q_dtype == model
    assert not p.quantize_query and not p.applies_q_scale


def test_limits_fall_back_with_the_reason():
    assert _plan(num_q_heads=prefill_plan.MAX_GROUP, num_kv_heads=1).kernel == "sm90.prefill"
    for change, needle in ((dict(head_dim=96), "head_dim 64/128/256 (got 96)"),
                           (dict(page_size=8), "page_size 16/32/64/128 (got 8)")):
        p = _plan(**{"kv": "fp8", **change})
        assert p.kernel == "reference.paged_prefill" and needle in p.reason, p.reason
    # what only the SM90 kernel refuses goes to the portable kernel, with the reason
    for change, needle in ((dict(kv="fp16", model="bf16"), "one of the model dtype bf16 (got fp16)"),
                           (dict(num_q_heads=2 * prefill_plan.MAX_GROUP, num_kv_heads=1), "GQA ratio")):
        p = _plan(**{"kv": "fp8", **change})
        assert p.kernel == "sm80.prefill" and needle in p.reason, p.reason


def test_the_choice_is_one_constant(fp8_query_chosen):
    p = _plan("fp8")
    assert p.kernel == "sm90.prefill_fp8q" and p.q_dtype == "fp8_e4m3"
    assert p.quantize_query and p.applies_q_scale
    for kv in ("bf16", "fp16"):  # a 16-bit cache is never served in FP8
        p = _plan(kv, kv)
        assert p.kernel == "sm90.prefill" and not p.applies_q_scale
    # the other variant stays selectable
    p = _plan("fp8", backend="sm90.prefill")
    assert p.kernel == "sm90.prefill" and p.q_dtype == "bf16"
    # decode is never affected
    assert plan(arch="sm90", phase="decode", kv_cache_dtype="fp8", model_dtype="bf16", head_dim=128,
                num_q_heads=32, num_kv_heads=8, page_size=16).q_dtype == "bf16"


def test_fp8_query_backend_by_name():
    p = _plan("fp8", backend="sm90.prefill_fp8q")
    assert (p.kernel, p.q_dtype, p.quantize_query, p.applies_q_scale) == ("sm90.prefill_fp8q", "fp8_e4m3", True, True)
    with pytest.raises(UnsupportedConfig, match=r"needs kv_cache_dtype fp8_e4m3 \(got bf16\)"):
        _plan("bf16", backend="sm90.prefill_fp8q")
    with pytest.raises(UnsupportedConfig, match="is a prefill kernel, not decode"):
        _plan("fp8", phase="decode", backend="sm90.prefill")


# ----------------------------------------------------------------------------------------------
# the layer: one prefill launch, no host sync, per-phase query
# ----------------------------------------------------------------------------------------------


def _stub_ops(monkeypatch):
    """Record the ops' calls; any device-to-host read fails the step."""
    seen = []

    def fake_write(key, value, kv_cache, slot_mapping, **kw):
        seen.append(("write", key.shape[0]))

    def fake_decode(q, kv_cache, block_table, seq_lens, *, out, **kw):
        seen.append(("decode", q, block_table, seq_lens, out, kw))
        out.fill_(1.0)
        return out

    def fake_prefill(q, kv_cache, block_table, seq_lens, query_start_loc, *, out, **kw):
        seen.append(("prefill", q, block_table, seq_lens, query_start_loc, out, kw))
        out.fill_(2.0)
        return out

    def fake_quantize(q, q_scale, **kw):
        seen.append(("quantize", q, q_scale))
        return torch.zeros(q.shape, dtype=FP8)

    monkeypatch.setattr(cute_kernels, "write_kv_cache", fake_write, raising=False)
    monkeypatch.setattr(cute_kernels, "paged_decode", fake_decode, raising=False)
    monkeypatch.setattr(cute_kernels, "paged_prefill", fake_prefill, raising=False)
    monkeypatch.setattr(cute_kernels, "quantize_query", fake_quantize, raising=False)
    return seen


def _forbid_sync(monkeypatch):
    def no_sync(*a, **k):
        raise AssertionError("host sync in a kernel-served step")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)


@pytest.mark.parametrize("fp8_query", [False, True])
@pytest.mark.parametrize("batch", ["mixed", "prefill"])
def test_one_prefill_launch_without_host_sync(batch, fp8_query, monkeypatch):
    if fp8_query:
        _choose_fp8_query(monkeypatch)
    step = make_step(**BATCHES[batch])
    q_scale = torch.tensor([0.25, 0.5])  # per KV head
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90", q_scale=q_scale, sm_scale=0.2,
                           k_scale=0.0625)
    md = dataclasses.replace(step.metadata, max_query_len=6)
    seen = _stub_ops(monkeypatch)
    _forbid_sync(monkeypatch)
    out = layer.forward(step.q, step.k, step.v, step.kv_cache, md)
    monkeypatch.undo()
    nd, first = md.num_decode_tokens, md.num_decode_reqs
    kinds = [s[0] for s in seen]
    assert kinds == ["write"] + (["decode"] if nd else []) + (["quantize"] if fp8_query else []) + ["prefill"]
    _, q, bt, sl, qsl, pout, kw = seen[-1]
    if fp8_query:
        _, qq, qs = seen[-2]
        assert qq.shape[0] == step.q.shape[0] - nd and qq.data_ptr() == step.q[nd:].data_ptr()  # prefill rows only
        assert qs is layer.q_scale and kw["q_scale"] is layer.q_scale and q.dtype == FP8
    else:
        assert q.dtype == BF16 and kw["q_scale"] is None
        assert q.data_ptr() == step.q[nd:].data_ptr() and q.shape[0] == step.q.shape[0] - nd
    if nd:
        _, dq, *_, dkw = seen[1]
        assert dq.dtype == BF16 and dq.shape[0] == nd  # decode rows keep the model dtype
    else:
        assert q is step.q or fp8_query  # the all-prefill path passes the caller's query itself
    assert torch.equal(bt, md.block_table[first:]) and torch.equal(sl, md.seq_lens[first:])
    assert torch.equal(qsl, md.query_start_loc[first:] - nd) and int(qsl[0]) == 0
    assert pout.data_ptr() == out[nd:].data_ptr() and pout.shape == out[nd:].shape
    assert kw["max_query_len"] == 6 and kw["sm_scale"] == 0.2 and kw["k_scale"] == 0.0625
    assert (out[:nd] == 1).all() and (out[nd:] == 2).all()


# ----------------------------------------------------------------------------------------------
# end to end on CPU tensors (the op's reference path)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [BF16, FP16])
def test_fp8_query_prefill_end_to_end_on_cpu(model, fp8_query_chosen):
    g = torch.Generator().manual_seed(5)
    step = make_step(decode_ctx=(20, 40), prefill=((0, 6), (9, 4), (3, 0), (15, 1)), generator=g)
    if model == FP16:
        step.q, step.k, step.v = step.q.half(), step.k.half(), step.v.half()
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype=FP8, page_size=16, arch="sm90", q_scale=0.02, k_scale=0.0625,
                           v_scale=0.03125, model_dtype=model)
    assert layer.plans_for(step.metadata)["prefill"].kernel == "sm90.prefill_fp8q"
    expected_cache = clone_cache(step.kv_cache)
    out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
    assert out.dtype == model
    md, nd = step.metadata, step.metadata.num_decode_tokens
    reference.write_kv_cache(step.k, step.v, expected_cache, md.slot_mapping, k_scale=0.0625, v_scale=0.03125)
    qq = reference.quantize_query(step.q[nd:], 0.02)
    want = reference.paged_prefill(qq, expected_cache, md.block_table[2:], md.seq_lens[2:],
                                   md.query_start_loc[2:] - nd, q_scale=0.02, k_scale=0.0625, v_scale=0.03125,
                                   out_dtype=model)
    assert torch.equal(out[nd:], want)
    if model == BF16:  # decode rows: the BF16-query decode path, as reference_step computes it
        assert torch.equal(out[:nd], reference_step(step, clone_cache(step.kv_cache), k_scale=0.0625,
                                                    v_scale=0.03125)[:nd])
