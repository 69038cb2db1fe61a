"""The SM90 prefill's lean softmax (the default) against its opt-out, the scaled-score softmax
(``lean_softmax=False``, ``sm90.prefill_scaled_softmax``; docs/design/sm90-prefill.md#the-lean-softmax),
on the GPU.

The two forms round differently (one FFMA where the scaled form multiplies, then subtracts), so
their outputs are not equal bit for bit: on every kernel case of tests/gpu/test_prefill_kernel_gpu.py
(varlen, partial tiles, NaN page tails, rows that see nothing, padding rows never written) the
scaled form must meet the float64 reference within the kind's tolerance with its LSE, and both
forms stay close to each other. The op under ``tuning_override(lean_softmax=False)`` must run
(``prefill_kernel_only``: never the reference), with a window and sinks too (the FP8 query's sinks
read the max its exponent shifted)."""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels.ops.paged_prefill import tuning_override
from cute_kernels.testing import make_paged_prefill_case

from .conftest import sm90_only, stable_seed
from .test_prefill_kernel_gpu import CASE_IDS, CASES, case_config, case_problem, check, run_kernel

pytestmark = sm90_only()
FP8 = torch.float8_e4m3fn
# the lean form against the scaled one, relative: the rounding of one FFMA against a multiply and a
# subtract moves P by an ulp of fp32 (an e4m3 P then by at most one e4m3 step on a few elements)
CLOSE = {"16": 2e-3, "widen": 2e-3, "fp8": 2e-2}


@pytest.mark.parametrize("i", range(len(CASES)), ids=CASE_IDS)
def test_scaled_softmax_matches_reference_and_lean(i, gen):
    c = CASES[i]
    case = case_problem(c, gen)
    scaled = case_config(c, lean_softmax=False)
    check(scaled, case, c[6], scaled.label())  # float64 reference, padding rows untouched, LSE
    want, want_lse = run_kernel(scaled, case)
    lean = case_config(c)
    assert lean.lean_softmax
    out, lse = run_kernel(lean, case)
    torch.cuda.synchronize()
    real = ~torch.isnan(want[:, 0, 0].float())
    diff = ((out[real].double() - want[real].double()).norm() / want[real].double().norm().clamp_min(1e-30)).item()
    assert diff <= CLOSE[lean.kind], f"{lean.label()}: {diff:.3e} from the scaled form's output"
    if lse is not None:
        fin = torch.isfinite(want_lse[real])
        assert torch.equal(fin, torch.isfinite(lse[real])), "LSE -inf rows differ from the scaled form's"
        assert (lse[real][fin] - want_lse[real][fin]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("kv,q8,D", [("bf16", False, 128), ("fp8", False, 128), ("fp8", True, 128),
                                     ("fp8", True, 64), ("fp8", True, 256), ("bf16", False, 256)])
@pytest.mark.parametrize("features", [{}, dict(window_left=150, sinks=True)], ids=["plain", "window+sinks"])
def test_op_with_scaled_override(kv, q8, D, features, gen, prefill_kernel_only, request):
    """``paged_prefill`` under the opt-out: its output and LSE stay close to the lean default's (and
    finite), with and without a window and sinks."""
    seed = stable_seed(request.node.nodeid)
    reqs = [(0, 130), (40, 0), (53, 200), (300, 1), (17, 64), (0, 7)]
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    scales = dict(k_scale=1 / 16, v_scale=1 / 32) if kv == "fp8" else {}
    c = make_paged_prefill_case(reqs=reqs, num_q_heads=8, num_kv_heads=2, head_dim=D, page_size=16,
                                kv_dtype=kv_dtype, invalid_pages=2, generator=gen, **scales)
    extra = {}
    q = c.q
    if q8:
        q_scale = float(c.q.float().abs().amax()) / 448
        q, extra = cute_kernels.quantize_query(c.q, q_scale), dict(q_scale=q_scale)
    if features:
        extra.update(window_left=features["window_left"],
                     sinks=torch.linspace(-1.0, 3.0, 8, device=c.q.device, dtype=torch.float32))
    args = (q, c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc)
    with tuning_override(lean_softmax=False):
        want, want_lse = cute_kernels.paged_prefill(*args, return_lse=True, **extra, **c.kwargs())
    got, got_lse = cute_kernels.paged_prefill(*args, return_lse=True, **extra, **c.kwargs())
    torch.cuda.synchronize()
    assert torch.isfinite(got).all() and torch.isfinite(want).all(), f"seed {seed}: NaN/inf in output"
    diff = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    kind = "fp8" if q8 else ("widen" if kv == "fp8" else "16")
    assert diff <= CLOSE[kind], f"seed {seed}: {diff:.3e} from the scaled form's output"
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(got_lse)), f"seed {seed}: LSE -inf rows differ"
    assert (got_lse[fin] - want_lse[fin]).abs().max().item() <= 1e-3, f"seed {seed}: LSE"
