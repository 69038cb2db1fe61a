"""The runtime self-check and its fallback, on real kernels (run on the H200).

No Blackwell GPU exists for this project, so the machinery that guards the compile-verified SM100
kernels is proven here on the SM90 decode kernel: the check passes against it, and a deliberately
broken variant of it (k_scale doubled by the runner: a wrong answer, as a miscompiled or
mis-scheduled kernel would give) fails the check, after which the guarded call serves the reference
and a warning is logged. The cases are the ones the SM100 op builds for its families
(``_paged_decode_sm100.self_check_cases``, ``_paged_prefill_sm100.self_check_cases``), with the
SM90 ops as the runners.
"""

from __future__ import annotations

import logging

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops import _paged_prefill_sm100 as prefill_sm100
from cute_kernels.ops import _selfcheck as sc
from cute_kernels.ops._paged_decode_sm100 import self_check_cases
from cute_kernels.plans import selfcheck_records as records
from cute_kernels.plans.sm100 import Sm100DecodeConfig, Sm100PrefillConfig

from .conftest import sm90_only

pytestmark = sm90_only()


@pytest.fixture(autouse=True)
def _isolated_records(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "records_path", lambda: tmp_path / "selfcheck.json")  # (kernel cache kept)
    records.forget()
    yield
    records.forget()


def sm90_runner(k_scale_error: float = 1.0):
    """The SM90 op in the signature the SM100 cases call (a window or sinks run its window / sink
    variants: ops/_decode_features.py)."""

    def run(q, cache, bt, sl, *, sinks, window_left, num_splits, k_scale, **kw):
        return cute_kernels.paged_decode(q, cache, bt, sl, sinks=sinks, window_left=window_left,
                                         num_splits=num_splits, k_scale=k_scale * k_scale_error, **kw)

    return run


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_check_passes_on_the_sm90_kernel(kv):
    cfg = Sm100DecodeConfig(q_dtype="bf16", kv_dtype=kv, head_dim=128, group=4, page_size=16)
    cases = self_check_cases(cfg, "cuda", runner=sm90_runner())
    assert len(cases) == 3  # unsplit, split with a window, split with lengths past the table
    rec = sc.run_check(f"test.sm90.decode/{kv}", "cuda", cases)
    assert rec.ok, rec.reason
    assert 0 < rec.seconds < 60
    assert "passed its self-check" in records.describe(f"test.sm90.decode/{kv}")


def test_broken_kernel_fails_and_the_op_falls_back(caplog):
    cfg = Sm100DecodeConfig(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=4, page_size=16)
    broken = sm90_runner(k_scale_error=2.0)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 128, generator=g).to(torch.bfloat16).cuda()
    kv = torch.randn(8, 2, 2, 16, 128, generator=g).to(torch.float8_e4m3fn).cuda()
    bt = torch.arange(8, dtype=torch.int32).view(2, 4).cuda()
    sl = torch.tensor([50, 17], dtype=torch.int32).cuda()
    calls = []

    def kernel():
        calls.append("kernel")
        return broken(q, kv, bt, sl, sinks=None, window_left=-1, num_splits=None, k_scale=1.0)

    def ref():
        return reference.paged_decode(q, kv, bt, sl)

    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        out = sc.guarded("test.sm90.decode/broken", "cuda", lambda: self_check_cases(cfg, "cuda", runner=broken),
                         kernel, ref)
    assert calls == []  # the broken kernel never serves the call
    torch.testing.assert_close(out, ref(), rtol=0, atol=0)
    assert any("failed its self-check" in r.getMessage() for r in caplog.records)
    rec = records.lookup("test.sm90.decode/broken")
    assert not rec.ok and "beyond tolerance" in rec.reason
    assert "FAILED its self-check" in records.describe("test.sm90.decode/broken")
    # the outcome is kept for the process: the next call does not check again
    out2 = sc.guarded("test.sm90.decode/broken", "cuda", lambda: pytest.fail("checked twice"), kernel, ref)
    assert calls == [] and torch.equal(out, out2)


def test_check_refuses_graph_capture():
    """A family's first use inside CUDA-graph capture cannot check (it synchronizes): a clear error."""
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        with torch.cuda.graph(graph, stream=stream):
            sc.ensure("test.capture", "cuda", lambda: [])


def sm90_prefill_runner(k_scale_error: float = 1.0):
    """The SM90 prefill op in the signature the SM100 prefill cases call (``runner(config, tensors,
    max_query_len)``; a window or sinks run its window / sink variants behind their own check)."""

    def run(config, t, max_query_len):
        cache = (t["k"], t["v"]) if config.kv_form == "pair" else t["k"]
        out_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[config.out_dtype]
        out = torch.full(t["q"].shape, float("nan"), dtype=out_dtype, device=t["q"].device)
        return cute_kernels.paged_prefill(
            t["q"], cache, t["block_table"], t["seq_lens"], t["query_start_loc"], max_query_len=max_query_len,
            kv_layout=config.kv_layout, causal=config.causal, q_scale=t["q_scale"],
            k_scale=t["k_scale"] * k_scale_error, v_scale=t["v_scale"], out=out, return_lse=config.write_lse,
            window_left=t["window_left"], sinks=t["sinks"])

    return run


@pytest.mark.parametrize("cfg", [
    Sm100PrefillConfig(q_dtype="bf16", kv_dtype="bf16", head_dim=128, page_size=16, sinks=True),
    Sm100PrefillConfig(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=128, page_size=16, out_dtype="fp16"),
], ids=["f16", "f8"])
def test_prefill_check_passes_on_the_sm90_kernel_and_fails_a_broken_one(cfg):
    """The SM100 prefill family's cases (varlen, a window, lengths past the table) against the SM90
    prefill op: it passes; with k_scale doubled it fails."""
    rec = sc.run_check("test.sm90.prefill/ok", "cuda", prefill_sm100.self_check_cases(cfg, "cuda",
                                                                                       runner=sm90_prefill_runner()))
    assert rec.ok, rec.reason
    bad = sc.run_check("test.sm90.prefill/broken", "cuda",
                       prefill_sm100.self_check_cases(cfg, "cuda", runner=sm90_prefill_runner(2.0)))
    assert not bad.ok and "beyond tolerance" in bad.reason
