"""merge_states kernel on the GPU against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference


@pytest.mark.parametrize("S,N,H,D", [(2, 64, 32, 128), (8, 7, 5, 64), (32, 33, 8, 256), (1, 3, 4, 128), (5, 2, 3, 96)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_matches_reference(S, N, H, D, out_dtype, gen):
    po = torch.randn(S, N, H, D, device="cuda", generator=gen) * 3
    pl = torch.randn(S, N, H, device="cuda", generator=gen) * 8
    empty = torch.rand(S, N, H, device="cuda", generator=gen) < 0.3
    pl[empty] = float("-inf")
    po[empty] = float("nan")  # an empty split's partial must never be read
    pl[:, 0, 0] = float("-inf")  # a row with every split empty
    out = torch.full((N, H, D), float("nan"), dtype=out_dtype, device="cuda")
    lse = torch.full((N, H), float("nan"), device="cuda")
    cute_kernels.merge_states(po, pl, out=out, out_lse=lse)
    ref_o, ref_l = reference.merge_states(po, pl, float64=True)
    assert torch.isfinite(out).all()
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_o, atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    torch.testing.assert_close(lse[fin], ref_l[fin], atol=1e-5, rtol=1e-5)
    assert (out[0, 0] == 0).all() and torch.isneginf(lse[0, 0])


def test_merge_strided_partials(gen):
    big = torch.randn(4, 10, 8, 160, device="cuda", generator=gen)
    po = big[:, :, :, 16:144]  # strides not compact, still 16-byte aligned
    pl = torch.randn(4, 10, 8, device="cuda", generator=gen)
    out, lse = cute_kernels.merge_states(po, pl, out_dtype=torch.bfloat16)
    ref_o, ref_l = reference.merge_states(po, pl, float64=True)
    torch.testing.assert_close(out.float(), ref_o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_l, atol=1e-5, rtol=1e-5)


def test_merge_bad_inputs_raise():
    po = torch.randn(2, 3, 4, 64, device="cuda")
    with pytest.raises(TypeError, match="partial_out must have dtype float32"):
        cute_kernels.merge_states(po.half(), torch.zeros(2, 3, 4, device="cuda"))
    with pytest.raises(ValueError, match=r"partial_lse must have shape \[2, 3, 4\]"):
        cute_kernels.merge_states(po, torch.zeros(2, 3, 5, device="cuda"))
