"""The FP8-query prefill with V^T written by ``ldmatrix.trans`` + ``stmatrix``
(``vt_transpose="ldsm"``, ``sm90.prefill_fp8q_ldsm``; docs/design/sm90-prefill.md#fp8) on the GPU.

Both transposes write the same V^T bytes, so the consumers run the same MMAs on the same operands:
the output and the LSE must equal the default (word transpose) kernel's bit for bit, and the
float64 reference within the FP8 query's tolerance. Direct kernel calls on the varlen cases of
tests/gpu/test_prefill_kernel_gpu.py (partial last tiles, NaN page tails, padding rows never
written), and the op under ``tuning_override(vt_transpose="ldsm")`` (its self-check must pass:
``prefill_kernel_only``) with one and two query terms."""

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
FP8_CASES = [i for i, c in enumerate(CASES) if c[0] == "fp8_e4m3"]


def _bits(t):
    return None if t is None else t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("i", FP8_CASES, ids=[CASE_IDS[i] for i in FP8_CASES])
def test_ldsm_transpose_matches_the_word_transpose(i, gen):
    c = CASES[i]
    case = case_problem(c, gen)
    ldsm = case_config(c, vt_transpose="ldsm")
    check(ldsm, case, c[6], ldsm.label())  # float64 reference, padding rows untouched, LSE
    out, lse = run_kernel(ldsm, case)
    want_out, want_lse = run_kernel(case_config(c), case)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(want_out)), f"{ldsm.label()}: output differs from the word transpose's"
    if lse is not None:
        assert torch.equal(_bits(lse), _bits(want_lse)), f"{ldsm.label()}: LSE differs from the word transpose's"


@pytest.mark.parametrize("D, terms", [(128, 1), (128, 2), (64, 1), (256, 1)])
def test_op_with_ldsm_override(D, terms, gen, prefill_kernel_only, request):
    """``paged_prefill`` on an FP8 query under the override: the variant self-checks, and its
    output equals the default kernel's bit for bit."""
    seed = stable_seed(request.node.nodeid)
    reqs = [(0, 130), (40, 0), (53, 200), (300, 1), (17, 64), (0, 7)]
    c = make_paged_prefill_case(reqs=reqs, num_q_heads=8, num_kv_heads=2, head_dim=D, page_size=16, kv_dtype=FP8,
                                k_scale=1 / 16, v_scale=1 / 32, invalid_pages=2, generator=gen)
    q_scale = float(c.q.float().abs().amax()) / 448
    if terms == 2:
        hi, lo = cute_kernels.quantize_query(c.q, q_scale, residual=True)
        residual = dict(q_residual=lo)
    else:
        hi, residual = cute_kernels.quantize_query(c.q, q_scale), {}
    args = (hi, c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc)
    with tuning_override(vt_transpose="ldsm"):
        got, got_lse = cute_kernels.paged_prefill(*args, q_scale=q_scale, return_lse=True, **residual, **c.kwargs())
    want, want_lse = cute_kernels.paged_prefill(*args, q_scale=q_scale, return_lse=True, **residual, **c.kwargs())
    torch.cuda.synchronize()
    assert torch.isfinite(got).all(), f"seed {seed}: NaN/inf in output"
    assert torch.equal(_bits(got), _bits(want)), f"seed {seed}: output differs from the default kernel's"
    assert torch.equal(_bits(got_lse), _bits(want_lse)), f"seed {seed}: LSE differs from the default kernel's"
