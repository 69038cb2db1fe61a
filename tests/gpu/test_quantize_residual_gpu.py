"""The fused residual of ``quantize_query(..., residual=True)`` (``common.quantize_query_residual``)
on the GPU: both terms bit-identical to the torch-ops path (``reference.quantize_query`` with
``residual=True`` on the same device, i.e. the codes and ``reference.query_residual``).

- a seeded sweep of shapes, every ``q_scale`` form (float, 0-d, 1-element, per KV head), RoPE off,
  full and partial (an invalid position included: NaN rows), fp16/bf16 q, contiguous and strided
  (a fused-QKV slice; an 8-byte aligned one), given output buffers, values over many binades;
- inside a CUDA graph, replayed with a new scale value and new q;
- ``paged_prefill(..., q_residual=lo)`` with the fused ``lo`` equals the torch-ops path bit for bit;
- the self-check of every registered residual variant passes.

The fused launch is enforced (``fused_only``): a family that failed its self-check fails the test
instead of taking the torch-ops path.
"""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops import _quantize_residual as check
from cute_kernels.ops import quantize_query as qq_op
from cute_kernels.plans import quantize_query as plan
from cute_kernels.plans import selfcheck_records
from cute_kernels.testing import capture_graph, make_paged_prefill_case

from .conftest import sm90_only, stable_seed

FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 conversions (SM89+)")


@pytest.fixture
def fused_only(monkeypatch):
    """The residual family's self-check must pass (the test verifies the kernel); every fused
    launch is counted."""
    checked = qq_op.self_check_passes
    fused = []

    def strict(config, device):
        if not checked(config, device):
            pytest.fail(f"the fused kernel is under test: {selfcheck_records.describe(plan.residual_family(config))}")
        fused.append(config)
        return True

    monkeypatch.setattr(qq_op, "self_check_passes", strict)
    qq_op._two_launcher.launches.clear()
    yield fused
    qq_op._two_launcher.launches.clear()


def same_codes(got: torch.Tensor, want: torch.Tensor, what: str, seed: int):
    """Equal bytes; a NaN code equals a NaN code (the sign of an arithmetic NaN is unspecified)."""
    nan_g, nan_w = got.float().isnan(), want.float().isnan()
    assert torch.equal(nan_g, nan_w), f"{what}: NaN positions differ (seed {seed})"
    diff = (got.view(torch.uint8) != want.view(torch.uint8)) & ~nan_w
    assert not diff.any(), f"{what}: {int(diff.sum())} codes differ, first at {diff.nonzero()[0].tolist()} (seed {seed})"


def make_q(kind: str, T: int, Hq: int, D: int, dtype, g, Hkv: int):
    """``contiguous``; ``fused`` (a slice of a fused QKV row, 16-byte aligned); ``shifted`` (8-byte
    aligned: a narrower vector). Values over many binades, some beyond 448 · q_scale."""
    mag = torch.pow(2.0, torch.randint(-14, 8, (T, Hq, D), device="cuda", generator=g).float())
    x = (torch.randn(T, Hq, D, device="cuda", generator=g) * mag).to(dtype)
    if kind == "contiguous":
        return x
    width = (Hq + 2 * Hkv) * D + 8
    qkv = torch.full((T, width), float("nan"), device="cuda").to(dtype)
    start = 0 if kind == "fused" else 4
    view = qkv[:, start:start + Hq * D].view(T, Hq, D)
    view.copy_(x)
    return view


def make_scale(form: str, Hkv: int, g):
    s = torch.rand(Hkv, device="cuda", generator=g) * 0.05 + 0.002
    return {"float": float(s[0]), "0-d": s[0].clone(), "1-element": s[:1].clone(), "per-kv-head": s}[form]


def make_rope(T: int, rot: int, cs_dtype, pos_dtype, g):
    cos_sin = torch.randn(97, rot, device="cuda", generator=g).to(cs_dtype)
    pos = torch.randint(0, 97, (T,), device="cuda", generator=g)
    if T > 1:  # one row out of range (rotated dims NaN in both paths); a lone row stays finite
        pos[0] = 97
    return cos_sin, pos.to(pos_dtype)


def _cases():
    """A seeded sweep: each axis value at least once, without the full product."""
    forms = ("float", "0-d", "1-element", "per-kv-head")
    kinds = ("contiguous", "fused", "shifted")
    ropes = (0, "full", "partial")
    out = []
    for i in range(24):
        out.append(dict(dtype=(BF16, FP16)[i % 2], form=forms[i % 4], kind=kinds[i % 3], rope=ropes[(i // 3) % 3],
                        D=(128, 64, 256, 96)[(i // 2) % 4], T=(1, 37, 300, 8)[(i // 4) % 4],
                        Hkv=(1, 2, 4)[i % 3], group=(1, 4, 8)[(i // 6) % 3], buffers=i % 5 == 0))
    return out


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_fused_residual_is_the_torch_ops_residual(case, fused_only, request):
    seed = stable_seed(request.node.nodeid)
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, D, Hkv = case["T"], case["D"], case["Hkv"]
    Hq = Hkv * case["group"]
    q = make_q(case["kind"], T, Hq, D, case["dtype"], g, Hkv)
    q_scale = make_scale(case["form"], Hkv, g)
    rope = None
    if case["rope"]:
        rot = D if case["rope"] == "full" else D // 2
        rope = make_rope(T, rot, (torch.float32, case["dtype"])[seed % 2], (torch.int64, torch.int32)[seed % 2], g)
    out = lo_out = None
    if case["buffers"]:
        out = torch.full((T, Hq, D), 0x7F, dtype=torch.uint8, device="cuda").view(FP8)
        lo_out = torch.full((T, Hq, D), 0x7F, dtype=torch.uint8, device="cuda").view(FP8)
    hi, lo = cute_kernels.quantize_query(q, q_scale, rope=rope, out=out, residual=True, residual_out=lo_out)
    want_hi, want_lo = reference.quantize_query(q, q_scale, rope=rope, residual=True)
    torch.cuda.synchronize()
    assert fused_only and all(c.residual for c in fused_only), "the fused kernel did not run"
    if case["buffers"]:
        assert hi is out and lo is lo_out
    same_codes(hi, want_hi, "hi", seed)
    same_codes(lo, want_lo, "lo", seed)
    # the residual is not trivially zero, and the one-term op gives the same codes
    assert (lo.float().nan_to_num() != 0).any()
    same_codes(cute_kernels.quantize_query(q, q_scale, rope=rope), want_hi, "one-term hi", seed)


def test_empty_query_takes_no_launch(fused_only):
    q = torch.randn(0, 8, 128, device="cuda").to(BF16)
    hi, lo = cute_kernels.quantize_query(q, 0.5, residual=True)
    assert hi.shape == lo.shape == (0, 8, 128) and not fused_only


@pytest.mark.parametrize("with_rope", [False, True])
def test_fused_residual_in_a_cuda_graph(with_rope, fused_only, request):
    """Captured once; replays read the scale tensor and q at replay time."""
    seed = stable_seed(request.node.nodeid)
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, Hq, D = 64, 32, 128
    q = (torch.randn(T, Hq, D, device="cuda", generator=g) * 10).to(BF16)
    scale = torch.tensor([0.05], device="cuda")
    rope = make_rope(T, D, torch.float32, torch.int64, g) if with_rope else None
    out = torch.empty(T, Hq, D, dtype=FP8, device="cuda")
    lo = torch.empty(T, Hq, D, dtype=FP8, device="cuda")

    def call():
        cute_kernels.quantize_query(q, scale, rope=rope, out=out, residual=True, residual_out=lo)

    graph = capture_graph(call)  # the first (eager) call compiles and self-checks outside capture
    for s in (0.02, 0.3):
        scale.fill_(s)
        q.copy_((torch.randn(T, Hq, D, device="cuda", generator=g) * 10).to(BF16))
        out.view(torch.uint8).fill_(0x7F)
        lo.view(torch.uint8).fill_(0x7F)
        graph.replay()
        torch.cuda.synchronize()
        want_hi, want_lo = reference.quantize_query(q, scale, rope=rope, residual=True)
        same_codes(out, want_hi, f"hi, scale {s}", seed)
        same_codes(lo, want_lo, f"lo, scale {s}", seed)


@sm90_only()
@pytest.mark.parametrize("q_scale_form", ["float", "per-kv-head"])
def test_paged_prefill_with_the_fused_residual(q_scale_form, fused_only, prefill_kernel_only, request):
    """``paged_prefill(..., q_residual=lo)`` on the fused terms equals the call on the torch-ops
    terms bit for bit (the same terms, the same kernel)."""
    seed = stable_seed(request.node.nodeid)
    g = torch.Generator(device="cuda").manual_seed(seed)
    c = make_paged_prefill_case(reqs=[(0, 130), (200, 7), (64, 300)], num_q_heads=8, num_kv_heads=2, head_dim=128,
                                page_size=16, kv_dtype=FP8, k_scale=1 / 16, v_scale=1 / 32, generator=g)
    s = float(c.q.float().abs().amax()) / 448
    q_scale = s if q_scale_form == "float" else torch.tensor([s, 1.5 * s], device="cuda")
    hi, lo = cute_kernels.quantize_query(c.q, q_scale, residual=True)
    t_hi, t_lo = reference.quantize_query(c.q, q_scale, residual=True)
    same_codes(hi, t_hi, "hi", seed)
    same_codes(lo, t_lo, "lo", seed)
    args = (c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc)
    got = cute_kernels.paged_prefill(hi, *args, max_query_len=300, q_scale=q_scale, q_residual=lo, **c.kwargs())
    want = cute_kernels.paged_prefill(t_hi, *args, max_query_len=300, q_scale=q_scale, q_residual=t_lo, **c.kwargs())
    torch.cuda.synchronize()
    assert not got.isnan().any() and torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.get_device_capability() < (9, 0), reason="the registered variants use PDL (SM90+)")
@pytest.mark.parametrize("config", plan.residual_variants(), ids=lambda c: c.label())
def test_every_registered_variant_passes_its_self_check_cases(config):
    """The cases themselves, run directly (not once per family): exact bytes."""
    from cute_kernels.ops._selfcheck import compare

    for case in check.self_check_cases(config, torch.device("cuda")):
        got, want = case.run(), case.expect()
        torch.cuda.synchronize()
        assert compare(got, want, 0.0, 0.0) == "", case.name
