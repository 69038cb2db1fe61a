"""The SM100 / SM103 side of ``cute_kernels.paged_prefill``: which calls the tcgen05 kernel
``sm100.prefill`` takes, its config, and its runtime self-check.

The kernel is compile-verified only, so the first launch of each MMA family (``f16``: 16-bit
query and cache; ``f8``: e4m3 query and cache) in a process runs :mod:`._selfcheck` on a few
small problems against the reference; a family that fails is served by ``sm80.prefill`` (or the
reference where that kernel cannot take the call) from then on, logged once and recorded for
``cute-kernels plan``.

A 16-bit query on an FP8 cache is not quantized here: QK in FP8 needs the query's scale, which
only the caller knows (the attention layer quantizes with its ``q_scale`` when its plan picks this
kernel, as for trtllm-gen). Such a call runs the portable kernel, which widens FP8 K/V exactly
(docs/design/sm100.md#the-op). A per-KV-head ``q_scale`` has no variant here: the reference.
"""

from __future__ import annotations

from functools import partial

import torch

from ..jit.compiler import get_kernel
from ..plans.sm100 import Sm100PrefillConfig, family
from ..registry import KERNELS, arch_of_target
from ._selfcheck import Case, ensure, launch_prefill_now, prefill_expected, prefill_problem, to_device
from ._torch import compile_target

KERNEL_ID = "sm100.prefill"
FP8 = torch.float8_e4m3fn

# (rtol, atol) per MMA family: outputs of V ~ N(0, 1); P rounded to 16 bits, or e4m3 P and query.
# The check catches broken kernels (garbage rows, NaN, wrong masks), not the last bits.
SELF_CHECK_TOL = {"f16": (2e-2, 2e-2), "f8": (1e-1, 1e-1)}
SELF_CHECK_SEED = 2031


def runs_on(target: str) -> bool:
    return arch_of_target(target) in KERNELS[KERNEL_ID].archs


def takes(q_dtype: torch.dtype, kv_dtype: torch.dtype, q_scale_kind: str) -> bool:
    """Whether the kernel takes these dtypes: a 16-bit query on a cache of its own dtype, or an
    e4m3 query with a scalar (float or 1-element) ``q_scale`` on an e4m3 cache."""
    if q_dtype == FP8:
        return kv_dtype == FP8 and q_scale_kind in ("scalar", "tensor")
    return kv_dtype == q_dtype


def make_config(*, out_dtype: str, q_scale: str, sinks: bool, override: dict, **fields) -> Sm100PrefillConfig:
    """The config of a call (``fields``: the op's common fields). The kernel has no tuning fields."""
    if override:
        raise ValueError(f"{KERNEL_ID} has no tuning fields, got {sorted(override)}")
    return Sm100PrefillConfig(out_dtype=out_dtype, q_scale_tensor=q_scale == "tensor", sinks=sinks, **fields)


def self_check_passes(config: Sm100PrefillConfig, device) -> bool:
    """The one-time check of ``config``'s MMA family (``sm100.prefill/f16`` or ``/f8``) on
    ``device``. True at once when the registry no longer lists the kernel as compile-verified."""
    if KERNELS[KERNEL_ID].status != "compile-verified":
        return True
    fam = family(KERNEL_ID, config.q_dtype, config.kv_dtype)
    return ensure(fam, device, lambda: self_check_cases(config, device))


def self_check_cases(config: Sm100PrefillConfig, device, runner=None) -> list[Case]:
    """Three problems in the variant's own dtypes, layout, container, scale forms, sinks and output
    dtype, on two KV heads, inputs built on the CPU from a fixed seed (the reference runs on the
    CPU copies): varlen with an empty request, a chunk after a prefix ending mid-page and one row
    after a long prefix (NaN-poisoned page tails); one request of two Q tiles with
    ``max_query_len`` and a window of 75 (blocks skipped, pages zero-filled at its start); lengths
    past the block table's capacity (50 past it, and 2^31 - 1). ``runner(config, tensors,
    max_query_len)``: the kernel call, :func:`launch_now` unless a test substitutes one."""
    runner = runner or launch_now
    rtol, atol = SELF_CHECK_TOL[config.mode]
    page = config.page_size
    q_scale = ("tensor" if config.q_scale_tensor else "scalar") if config.q_dtype == "fp8_e4m3" else "none"
    problems = (
        ("varlen", [(0, 130), (40, 0), (3 * page + 5, 20), (300, 1)], None, -1, False),
        ("window", [(0, 256)], 256, 75, False),
        ("past the table", [(2 * page, page), (page, 2 * page)], None, -1, True),  # whole pages: no NaN tails
    )
    g = torch.Generator(device="cpu").manual_seed(SELF_CHECK_SEED)
    cases = []
    for name, reqs, max_q, window, past in problems:
        host = prefill_problem(config, reqs, g, q_scale=q_scale, window=window, past_table=past)
        dev = to_device(host, device)
        cases.append(Case(f"{name} (seed {SELF_CHECK_SEED})", partial(runner, config, dev, max_q),
                          partial(prefill_expected, config, host, max_q), rtol, atol))
    return cases


def launch_now(config: Sm100PrefillConfig, t: dict, max_query_len):
    """The self-check's own call of ``config`` (compiled for the tensors' device)."""
    return launch_prefill_now(get_kernel(config, compile_target(t["q"].device)), config, t, max_query_len)
