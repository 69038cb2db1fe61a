"""The FP8-query prefill's V^T transpose by ``ldmatrix.trans`` + ``stmatrix`` (``vt_transpose="ldsm"``,
the FP8 query's default; docs/design/sm90-prefill.md#fp8) against its word-wise opt-out
(``vt_transpose="words"``, ``sm90.prefill_fp8q_words``) on the GPU.

Both transposes write the same V^T bytes, so the consumers run the same MMAs on the same operands:
the default kernel's output and LSE must equal the word transpose's bit for bit, and the float64
reference within the FP8 query's tolerance. Direct kernel calls on the varlen cases of
tests/gpu/test_prefill_kernel_gpu.py (partial last tiles, NaN page tails, padding rows never
written), and the op by default against ``tuning_override(vt_transpose="words")`` with one and two
query terms (the two-term families' self-checks must pass: ``prefill_kernel_only``)."""

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
    ldsm = case_config(c)
    assert ldsm.vt_transpose == "ldsm", ldsm.label()  # the FP8 query's default
    check(ldsm, case, c[6], ldsm.label())  # float64 reference, padding rows untouched, LSE
    out, lse = run_kernel(ldsm, case)
    want_out, want_lse = run_kernel(case_config(c, vt_transpose="words"), case)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(want_out)), f"{ldsm.label()}: output differs from the word transpose's"
    if lse is not None:
        assert torch.equal(_bits(lse), _bits(want_lse)), f"{ldsm.label()}: LSE differs from the word transpose's"


@pytest.mark.parametrize("D, terms", [(128, 1), (128, 2), (64, 1), (256, 1)])
def test_op_default_matches_the_words_override(D, terms, gen, prefill_kernel_only, request):
    """``paged_prefill`` on an FP8 query (the ldmatrix transpose) and under
    ``tuning_override(vt_transpose="words")``: bit for bit the same output and LSE."""
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
    got, got_lse = cute_kernels.paged_prefill(*args, q_scale=q_scale, return_lse=True, **residual, **c.kwargs())
    with tuning_override(vt_transpose="words"):
        want, want_lse = cute_kernels.paged_prefill(*args, q_scale=q_scale, return_lse=True, **residual,
                                                    **c.kwargs())
    torch.cuda.synchronize()
    assert torch.isfinite(got).all(), f"seed {seed}: NaN/inf in output"
    assert torch.equal(_bits(got), _bits(want)), f"seed {seed}: output differs from the word transpose's"
    assert torch.equal(_bits(got_lse), _bits(want_lse)), f"seed {seed}: LSE differs from the word transpose's"
