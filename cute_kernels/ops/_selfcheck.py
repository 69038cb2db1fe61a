"""One-time runtime self-check of a kernel family that was never run on its own hardware.

The Blackwell kernels are compile-verified only (registry status ``compile-verified``): their
PTX/SASS is checked on a CPU, but no SM100 GPU has run them. On such a machine an op calls
:func:`ensure` before its first launch of a variant family: a few small problems run through the
kernel and through the reference (tens of milliseconds), once per process and family. A family
that fails (an error, a non-finite value where the reference is finite, or a deviation beyond the
tolerance) is recorded (:mod:`cute_kernels.plans.selfcheck_records`), logged as a warning, and its
op serves the reference instead; ``cute-kernels plan`` on the machine reports the record.

Generic: a family is a name and a list of :class:`Case` (a kernel call and a reference call that
return tensors to compare), so any op can guard any kernel with it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..plans import selfcheck_records as records
from ._device import capturing

log = logging.getLogger("cute_kernels")


@dataclass(frozen=True)
class Case:
    """One small problem: ``run()`` calls the kernel, ``expect()`` the reference; both return a
    tensor or a tuple of tensors of equal shapes. Tolerance: ``|got - want| <= atol + rtol |want|``."""

    name: str
    run: Callable[[], object]
    expect: Callable[[], object]
    rtol: float = 2e-2
    atol: float = 2e-2


_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}


def decode_problem(config, generator: torch.Generator, Hkv: int = 2):
    """A decode family's problem on the CPU, in a variant's shape (``config``: ``head_dim``,
    ``page_size``, ``group``, ``q_len``, ``q_dtype``, ``kv_dtype``, ``kv_layout``, ``kv_form``):
    three requests (a partial last page, the shortest, 700 tokens, several tiles) on a permuted
    block table. Returns ``(q, cache, block_table, seq_lens)``."""
    g = generator
    D, page, G, q_len = config.head_dim, config.page_size, config.group, config.q_len
    lens = [3 * page + 5, q_len, 700]
    B = len(lens)
    max_pages = max(math.ceil(x / page) for x in lens)
    P = B * max_pages + 2
    bt = torch.randperm(P, generator=g)[: B * max_pages].view(B, max_pages).to(torch.int32)
    shape = (P, 2, Hkv, page, D) if config.kv_layout == "HND" else (P, 2, page, Hkv, D)
    kv = torch.randn(shape, generator=g).to(_TORCH[config.kv_dtype])
    cache = (kv[:, 0], kv[:, 1]) if config.kv_form == "pair" else kv
    q = torch.randn(B * q_len, G * Hkv, D, generator=g).to(_TORCH[config.q_dtype])
    return q, cache, bt, torch.tensor(lens, dtype=torch.int32)


def device_name(device) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{torch.cuda.get_device_name(index)} (cuda:{index})"


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def compare(got, want, rtol: float, atol: float) -> str:
    """'' when ``got`` matches ``want``; else what differs. NaN never passes; infinities must
    match exactly (an empty row's -inf LSE)."""
    got, want = _as_tuple(got), _as_tuple(want)
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if tuple(g.shape) != tuple(w.shape):
            return f"output {i}: shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        g = g.detach().double().cpu()
        w = w.detach().double().cpu()
        if torch.isnan(g).any():
            return f"output {i}: {int(torch.isnan(g).sum())} NaN"
        inf_w = torch.isinf(w)
        if not torch.equal(torch.isinf(g), inf_w) or not torch.equal(g[inf_w], w[inf_w]):
            return f"output {i}: infinities differ from the reference"
        fin = ~inf_w
        err = (g[fin] - w[fin]).abs()
        bound = atol + rtol * w[fin].abs()
        if err.numel() and bool((err > bound).any()):
            worst = int(torch.argmax(err - bound))
            return (f"output {i}: {int((err > bound).sum())} of {err.numel()} values beyond tolerance "
                    f"(|diff| {float(err[worst]):.3g} at a value {float(w[fin][worst]):.3g})")
    return ""


def run_check(family: str, device, cases: Sequence[Case]) -> records.CheckRecord:
    """Run ``cases`` now (no cache) and record the outcome."""
    dev = device_name(device)
    t0 = time.perf_counter()
    reason = ""
    cuda = torch.device(device).type == "cuda"
    # the cases' launches run on the checked device whichever device is current (docs/design/multi-gpu.md)
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        for case in cases:
            try:
                got = case.run()
                want = case.expect()
                if cuda:
                    torch.cuda.synchronize(device)
                problem = compare(got, want, case.rtol, case.atol)
            except Exception as exc:  # a kernel that raises fails its check, it does not crash the op
                problem = f"{type(exc).__name__}: {exc}"
            if problem:
                reason = f"case {case.name}: {problem}"
                break
    rec = records.CheckRecord(family=family, device=dev, ok=not reason, reason=reason,
                              seconds=round(time.perf_counter() - t0, 4), when=time.time())
    records.store(rec)
    if rec.ok:
        log.info("cute_kernels: %s passed its self-check on %s in %.3f s", family, dev, rec.seconds)
    else:
        log.warning("cute_kernels: %s failed its self-check on %s (%s); the reference runs instead",
                    family, dev, reason)
    return rec


def ensure(family: str, device, make_cases: Callable[[], Sequence[Case]]) -> bool:
    """Whether ``family`` may run on ``device``: its check runs on the first call of the process
    (``make_cases`` builds the problems only then); later calls return the recorded outcome.
    Inside CUDA-graph capture the check cannot run (it synchronizes): a clear error asks for a
    first call (or ``cute_kernels.warmup``) outside capture."""
    rec = records.in_process(family, device_name(device))
    if rec is not None:
        return rec.ok
    if capturing(device):
        raise RuntimeError(f"{family} must pass its one-time self-check before CUDA-graph capture: call the op "
                           "once (or cute_kernels.warmup) outside capture first")
    return run_check(family, device, make_cases()).ok


def guarded(family: str, device, make_cases: Callable[[], Sequence[Case]], kernel: Callable[[], object],
            reference: Callable[[], object]):
    """``kernel()`` when ``family`` passes its self-check on ``device``, else ``reference()``."""
    return kernel() if ensure(family, device, make_cases) else reference()
