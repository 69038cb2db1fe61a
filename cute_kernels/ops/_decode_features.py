"""The SM90 paged decode's variants behind a runtime self-check: the sliding-window and sink
variants, and the balanced split schedule.

``sm90.decode`` compiles a window variant (a runtime ``window_left``; tiles and pages outside the
window are skipped) and a sink variant (fp32 ``[Hq]`` sink logits) as config flags
(:mod:`cute_kernels.plans.sm90_decode`). They passed their GPU suite on the H200, so the registry
lists them as available (``sm90.decode_window_sinks``) and :func:`self_check_passes` lets them
run at once. Their check stays (:func:`self_check_cases`: the variant's own shape on a few small
problems against the reference, unsplit and split, cluster and global merges): it runs before the
first launch of each family in a process whenever the registry lists the entry as
compile-verified, and the GPU suite runs its cases directly. A family that fails is logged,
recorded, and served by the reference from then on (:mod:`._selfcheck`).
Design: docs/design/sm90-decode.md#sliding-window-and-sinks.

The balanced schedule (``tuning_override(balanced=True)``; registry id ``sm90.decode_balanced``)
passed its GPU suite on the H200 too, so it is available and runs at once. Its check stays, a
family per MMA path (:func:`balanced_cases`: ragged problems whose chunks cut requests (merges),
walk many requests in one chunk, or none, and a bitwise repeat), run whenever the registry lists
the entry as compile-verified; a family that fails then leaves its calls to the default schedule,
not the reference (docs/design/sm90-decode.md#balanced-schedule-opt-in).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

from .. import reference
from ..plans.sm90_decode import Sm90DecodeConfig, balanced_family, check_registry_id, feature_family
from ..registry import KERNELS
from ._selfcheck import Case, decode_problem, ensure

# (rtol, atol) against the fp32 reference: one 16-bit rounding of P and of the output
SELF_CHECK_TOL = (2e-2, 1e-2)

_checking = False  # inside a self-check: the op's kernel calls go past the guard


def family_of(config: Sm90DecodeConfig) -> str | None:
    """The self-check family of a window / sink or balanced variant (None: a variant that needs none)."""
    return feature_family(config) or balanced_family(config)


def without_balanced(override: dict) -> dict:
    """A tuning override without the balanced schedule: what a call whose balanced family failed
    its check runs with."""
    return {k: v for k, v in override.items() if k != "balanced"}


@contextmanager
def unguarded(launcher):
    """The self-check's own kernel calls: past the guard, and leaving no launch in ``launcher``'s
    cache (a later call of the same key is guarded again: it finds the recorded outcome)."""
    global _checking
    before = set(launcher.entries)
    saved, _checking = _checking, True
    try:
        yield
    finally:
        _checking = saved
        for key in [k for k in launcher.entries if k not in before]:
            del launcher.entries[key]


def self_check_passes(config: Sm90DecodeConfig, device, runner) -> bool:
    """Whether ``config``'s family may run on ``device`` (its check runs on the first call of the
    process). ``runner(override, **kwargs)``: the op's unguarded call (``paged_decode``'s). True
    at once when the registry no longer lists the variant's kernel as compile-verified (verified
    on the GPU: ``available``)."""
    family = family_of(config)
    if _checking or family is None:  # a variant without a window or sinks needs no check
        return True
    if KERNELS[check_registry_id(config)].status != "compile-verified":
        return True
    if config.balanced:
        return ensure(family, device, lambda: balanced_cases(config, device, runner), fallback="the default schedule")
    return ensure(family, device, lambda: self_check_cases(config, device, runner))


def self_check_cases(config: Sm90DecodeConfig, device, runner) -> list[Case]:
    """Small problems of ``config``'s shape (head dim, group, draft length, page, cache form and
    layout, dtypes, scale forms, FP8 widening): three requests (a partial last page, the
    shortest, 700 tokens), unsplit and split into three (the cluster merge, then the global one),
    windows of 90 and 5 keys when the family has a window, random sinks when it has sinks."""
    rtol, atol = SELF_CHECK_TOL
    g = torch.Generator(device="cpu").manual_seed(2029)
    q_len = config.q_len
    q, cache, bt, sl = decode_problem(config, g)
    sinks = torch.randn(q.shape[1], generator=g) if config.sinks else None

    def scale(value: float, tensor: bool):
        return torch.tensor(value, dtype=torch.float32, device=device) if tensor else value

    ks, vs = scale(0.9, config.k_scale_tensor), scale(1.1, config.v_scale_tensor)
    override = {"widen": config.widen} if config.kv_dtype == "fp8_e4m3" else {}
    dev_cache = tuple(t.to(device) for t in cache) if isinstance(cache, tuple) else cache.to(device)
    dev = dict(q=q.to(device), kv_cache=dev_cache, block_table=bt.to(device), seq_lens=sl.to(device),
               sinks=None if sinks is None else sinks.to(device))
    windows = (90, 90, 5) if config.window else (-1, -1, -1)
    cases = []
    for (splits, cluster), window in zip(((1, None), (3, True), (3, False)), windows):
        def run_case(splits=splits, cluster=cluster, window=window):
            over = override if cluster is None else {**override, "cluster": cluster}
            return runner(over, **dev, kv_layout=config.kv_layout, q_len_per_req=q_len, k_scale=ks, v_scale=vs,
                          window_left=window, num_splits=splits, return_lse=True)

        def expect(window=window):
            return reference.paged_decode(q, cache, bt, sl, kv_layout=config.kv_layout, q_len_per_req=q_len,
                                          k_scale=0.9, v_scale=1.1, sinks=sinks, window_left=window, return_lse=True)

        name = f"splits={splits},{'cluster' if cluster else 'global' if cluster is False else 'single'},window={window}"
        cases.append(Case(name, run_case, expect, rtol, atol))
    return cases


# ragged lengths in units of the variant's page: empty, one token, the draft, page edges, requests
# of several tiles and one long enough to cross several chunks; a block table wider than any
BALANCED_LENS = (0, 1, "q_len", 37, 700, "page", 1500, 33, "5page+3", 260)
BALANCED_CHUNKS = (7, 1, None)  # chunks per KV head: many cut requests, every request in one chunk, the plan's


def balanced_cases(config: Sm90DecodeConfig, device, runner) -> list[Case]:
    """Small ragged problems of a balanced variant's shape: ten requests (empty, one token, the
    draft, page edges, up to 1500 tokens) on a block table wider than the longest, split into 7
    chunks per KV head (requests cut by chunk boundaries: partials and merges), 1 chunk (a chunk
    walking every request) and the plan's grid; then the first problem again, bitwise equal."""
    rtol, atol = SELF_CHECK_TOL
    g = torch.Generator(device="cpu").manual_seed(2031)
    page = config.page_size
    named = {"q_len": config.q_len, "page": page, "5page+3": 5 * page + 3}
    lens = [x if isinstance(x, int) else named[x] for x in BALANCED_LENS]
    q, cache, bt, sl = decode_problem(config, g, lens=lens, width=2048 // page + 3)
    ks = torch.tensor(0.9, device=device) if config.k_scale_tensor else 0.9
    vs = torch.tensor(1.1, device=device) if config.v_scale_tensor else 1.1
    override = {"balanced": True, **({"widen": config.widen} if config.kv_dtype == "fp8_e4m3" else {})}
    dev_cache = tuple(t.to(device) for t in cache) if isinstance(cache, tuple) else cache.to(device)
    dev = dict(q=q.to(device), kv_cache=dev_cache, block_table=bt.to(device), seq_lens=sl.to(device))

    def run(chunks):
        return runner(override, **dev, kv_layout=config.kv_layout, q_len_per_req=config.q_len, k_scale=ks,
                      v_scale=vs, num_splits=chunks, return_lse=True)

    def expect():
        return reference.paged_decode(q, cache, bt, sl, kv_layout=config.kv_layout, q_len_per_req=config.q_len,
                                      k_scale=0.9, v_scale=1.1, return_lse=True)

    cases = [Case(f"balanced,chunks={c or 'plan'}", partial(run, c), expect, rtol, atol) for c in BALANCED_CHUNKS]
    first = BALANCED_CHUNKS[0]
    cases.append(Case(f"balanced,chunks={first},repeat", lambda: run(first), lambda: run(first), 0.0, 0.0))
    return cases
