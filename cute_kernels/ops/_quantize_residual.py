"""The runtime self-check of ``quantize_query``'s residual variants (``common.quantize_query_residual``).

The fused kernel writes the two-term query's codes and residual in one pass. It is compile-verified
(registry status): before the first launch of a family (:func:`plans.quantize_query.residual_family`)
in a process, the variant itself runs a few small problems in its own shape and must reproduce the
torch-ops path it replaces (:func:`cute_kernels.reference.quantize_query` with ``residual=True`` on
the same device) byte for byte, both terms. A family that fails is recorded and logged, and its
calls take the torch-ops path (:mod:`._selfcheck`). Design:
docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2.
"""

from __future__ import annotations

from functools import partial

import torch

from .. import reference
from ..jit.compiler import get_kernel
from ..jit.spec import call_arguments
from ..plans.quantize_query import RESIDUAL_ID, QuantizeQueryConfig, residual_family
from ..registry import KERNELS
from ._selfcheck import Case, ensure
from ._torch import compile_target

SELF_CHECK_SEED = 2031
FALLBACK = "the torch-ops residual"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int32": torch.int32,
           "int64": torch.int64}
_FP8 = torch.float8_e4m3fn


def self_check_passes(config: QuantizeQueryConfig, device) -> bool:
    """Whether ``config`` (a residual variant) may launch on ``device``: its family's one-time check
    (it synchronizes: inside CUDA-graph capture without a record it raises, see
    :func:`._selfcheck.ensure`). True at once when the registry no longer lists the residual kernel
    as compile-verified."""
    if KERNELS[RESIDUAL_ID].status != "compile-verified":
        return True
    return ensure(residual_family(config), device, lambda: self_check_cases(config, device), FALLBACK)


def check_problem(config: QuantizeQueryConfig, g: torch.Generator, scale_form: str) -> dict:
    """CPU tensors of one problem in ``config``'s shape: 37 tokens x 8 heads (2 KV heads), values
    over many binades (tiny ones under the smallest code, beyond 448 · q_scale), a rotation
    cache and positions for a RoPE variant; ``scale_form`` ``"float"``, ``"tensor"`` (``[1]``) or
    ``"per_kv_head"`` (``[2]``)."""
    T, Hq, D = 37, 8, config.head_dim
    mag = torch.pow(2.0, torch.randint(-12, 10, (T, Hq, D), generator=g).float())
    q = (torch.randn(T, Hq, D, generator=g) * mag).to(_DTYPES[config.q_dtype])
    scales: dict[str, float | torch.Tensor] = {"float": 0.37, "tensor": torch.tensor([0.37]),
                                               "per_kv_head": torch.tensor([0.37, 0.0061])}
    q_scale = scales[scale_form]
    rope = None
    if config.rot_dim:
        cos_sin = torch.randn(64, config.rot_dim, generator=g).to(_DTYPES[config.cos_sin_dtype])
        rope = (cos_sin, torch.randint(0, 64, (T,), generator=g).to(_DTYPES[config.pos_dtype]))
    return dict(q=q, q_scale=q_scale, rope=rope)


def _move(problem: dict, device) -> dict:
    def to(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    rope = problem["rope"]
    return dict(q=to(problem["q"]), q_scale=to(problem["q_scale"]),
                rope=None if rope is None else (to(rope[0]), to(rope[1])))


def launch_now(config: QuantizeQueryConfig, t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the compiled ``config`` on the device tensors ``t`` now, past any launch cache and
    self-check; both outputs poisoned first (0x7F: an e4m3 NaN). Returns the codes' and the
    residual's bytes."""
    q = t["q"]
    out = torch.full(q.shape, 0x7F, dtype=torch.uint8, device=q.device).view(_FP8)
    lo = torch.full(q.shape, 0x7F, dtype=torch.uint8, device=q.device).view(_FP8)
    cos_sin, positions = t["rope"] if t["rope"] is not None else (None, None)
    values = dict(q=q, out=out, q_scale=t["q_scale"], cos_sin_cache=cos_sin, positions=positions, residual_out=lo)
    get_kernel(config, compile_target(q.device))(*call_arguments(config.signature(), values))
    return out.view(torch.uint8), lo.view(torch.uint8)


def torch_ops(t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The path the fused kernel replaces, on the same device: the codes and their residual by
    torch ops (bytes)."""
    hi, lo = reference.quantize_query(t["q"], t["q_scale"], rope=t["rope"], residual=True)
    return hi.view(torch.uint8), lo.view(torch.uint8)


def self_check_cases(config: QuantizeQueryConfig, device) -> list[Case]:
    """One problem per scale form the variant takes (a float; or a ``[1]`` and a per-KV-head
    ``[2]`` tensor), built on the CPU from a fixed seed; exact equality of the bytes."""
    g = torch.Generator(device="cpu").manual_seed(SELF_CHECK_SEED)
    forms = ("tensor", "per_kv_head") if config.scale_tensor else ("float",)
    cases = []
    for form in forms:
        dev = _move(check_problem(config, g, form), device)
        cases.append(Case(f"{form} scale (seed {SELF_CHECK_SEED})", partial(launch_now, config, dev),
                          partial(torch_ops, dev), rtol=0.0, atol=0.0))
    return cases
