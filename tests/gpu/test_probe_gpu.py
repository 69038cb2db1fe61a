"""The SM90 TMA + WGMMA probe computes the right tile on the H200."""

from __future__ import annotations

import torch

from cute_kernels.jit.compiler import get_kernel
from cute_kernels.jit.spec import call_arguments
from cute_kernels.plans.probes import Sm90ProbeConfig

from .conftest import rel_err, sm90_only


@sm90_only()
def test_sm90_probe_gemm_tile(gen):
    cfg = Sm90ProbeConfig(n=64, k=64)
    a = torch.randn(64, 64, device="cuda", generator=gen).bfloat16()
    b = torch.randn(64, 64, device="cuda", generator=gen).bfloat16()
    c = torch.full((64, 64), float("nan"), device="cuda")
    get_kernel(cfg, "sm_90a")(*call_arguments(cfg.signature(), {"a": a, "b": b, "c": c}))
    ref = a.double() @ b.double().T
    assert torch.isfinite(c).all()
    assert rel_err(c, ref) < 1e-5
