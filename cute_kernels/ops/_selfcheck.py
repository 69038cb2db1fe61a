"""One-time runtime self-check of a kernel family that was never run on its own hardware.

The Blackwell kernels are compile-verified only (registry status ``compile-verified``): their
PTX/SASS is checked on a CPU, but no GPU of their arch has run them. On such a machine an op calls
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

from .. import reference
from ..jit.spec import call_arguments
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


def decode_problem(config, generator: torch.Generator, Hkv: int = 2, lens=None, width: int | None = None):
    """A decode family's problem on the CPU, in a variant's shape (``config``: ``head_dim``,
    ``page_size``, ``group``, ``q_len``, ``q_dtype``, ``kv_dtype``, ``kv_layout``, ``kv_form``):
    three requests (a partial last page, the shortest, 700 tokens, several tiles; or ``lens``) on a
    permuted block table of ``width`` pages (default: the longest request's). Returns ``(q, cache,
    block_table, seq_lens)``."""
    g = generator
    D, page, G, q_len = config.head_dim, config.page_size, config.group, config.q_len
    lens = [3 * page + 5, q_len, 700] if lens is None else list(lens)
    B = len(lens)
    max_pages = max([math.ceil(x / page) for x in lens] + [width or 1])
    P = B * max_pages + 2
    bt = torch.randperm(P, generator=g)[: B * max_pages].view(B, max_pages).to(torch.int32)
    shape = (P, 2, Hkv, page, D) if config.kv_layout == "HND" else (P, 2, page, Hkv, D)
    kv = torch.randn(shape, generator=g).to(_TORCH[config.kv_dtype])
    cache = (kv[:, 0], kv[:, 1]) if config.kv_form == "pair" else kv
    q = torch.randn(B * q_len, G * Hkv, D, generator=g).to(_TORCH[config.q_dtype])
    return q, cache, bt, torch.tensor(lens, dtype=torch.int32)


def prefill_problem(config, reqs, g: torch.Generator, *, q_scale: str = "none", window: int = -1,
                    past_table: bool = False) -> dict:
    """CPU tensors of one prefill problem in a variant's shape (``config``: ``head_dim``,
    ``page_size``, ``group``, dtypes, ``kv_form``, ``kv_layout``, ``sinks``, scale forms), two KV
    heads: requests ``reqs`` of ``(cached prefix, new tokens)`` on a permuted block table one
    column wider than they need, stale NaN bytes past each request's end; ``q_scale`` the form of
    an FP8 query's scale (``"none"``, ``"scalar"``, ``"tensor"``, ``"per_head"``). ``past_table``:
    the lengths then grow past the table's capacity (the first by 50, the last to 2^31 - 1), whose
    positions are never attended (docs/design/inputs.md#lengths); give whole-page requests then, so
    that every position the table addresses holds finite data."""
    Hkv, D, page = 2, config.head_dim, config.page_size
    Hq = Hkv * config.group
    lens = [p + n for p, n in reqs]
    pages = [math.ceil(L / page) for L in lens]
    P = sum(pages) + 3
    perm = torch.randperm(P, generator=g)
    table = torch.randint(0, P, (len(reqs), max(pages) + 1), generator=g, dtype=torch.int32)
    ofs = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[ofs:ofs + n].int()
        ofs += n
    shape = (P, 2, Hkv, page, D) if config.kv_layout == "HND" else (P, 2, page, Hkv, D)
    kv = torch.randn(shape, generator=g).to(_TORCH[config.kv_dtype])
    nan_byte = 0x7F if config.kv_dtype == "fp8_e4m3" else 0xFF  # a NaN in every byte (pair) of the dtype
    for b, L in enumerate(lens):  # stale bytes past each request's end: they must never reach the output
        if L % page:
            tail = (slice(None), slice(L % page, None)) if config.kv_layout == "HND" else (slice(L % page, None),)
            kv[(int(table[b, L // page]), slice(None)) + tail].view(torch.uint8).fill_(nan_byte)
    if past_table:
        capacity = table.shape[1] * page
        lens[0] = capacity + 50
        lens[-1] = 2 ** 31 - 1
    starts = [0]
    for _, n in reqs:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], Hq, D, generator=g).to(_TORCH[config.q_dtype])

    def scale(value, tensor):
        return torch.tensor([value], dtype=torch.float32) if tensor else value

    q_scales = {"none": None, "scalar": 0.5, "tensor": torch.tensor([0.5]), "per_head": torch.tensor([0.5, 0.75])}
    sinks = torch.randn(Hq, generator=g) * 2 if config.sinks else None  # sinks of either sign
    # a two-term FP8 query's second term: e4m3 values a residual's size (drawn last: the other
    # variants' problems stay as they were)
    q_residual = ((torch.randn(q.shape, generator=g) / 16).to(q.dtype) if getattr(config, "q_terms", 1) == 2
                  else None)
    return dict(q_residual=q_residual, q=q, k=kv[:, 0] if config.kv_form == "pair" else kv, v=kv[:, 1] if config.kv_form == "pair" else kv,
                block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32),
                query_start_loc=torch.tensor(starts, dtype=torch.int32), q_scale=q_scales[q_scale],
                k_scale=scale(0.9, config.k_scale_tensor), v_scale=scale(1.1, config.v_scale_tensor),
                sinks=sinks, window_left=window)


def prefill_expected(config, host: dict, max_query_len):
    """The reference result of a :func:`prefill_problem` (its CPU tensors) for ``config``."""
    cache = (host["k"], host["v"]) if config.kv_form == "pair" else host["k"]
    return reference.paged_prefill(
        host["q"], cache, host["block_table"], host["seq_lens"], host["query_start_loc"], max_query_len=max_query_len,
        kv_layout=config.kv_layout, causal=config.causal, q_scale=host["q_scale"], k_scale=host["k_scale"],
        v_scale=host["v_scale"], return_lse=config.write_lse, out_dtype=_TORCH[config.out_dtype],
        window_left=host["window_left"], sinks=host["sinks"], q_residual=host.get("q_residual"))


def launch_prefill_now(fn, config, t: dict, max_query_len):
    """Call ``fn``, the compiled prefill ``config``, on the device tensors ``t`` (a
    :func:`prefill_problem` moved to the device) now, past any launch cache and self-check: a
    self-check's own kernel call. The outputs are NaN-poisoned first."""
    T, Hq, D = t["q"].shape
    out = torch.full((T, Hq, D), float("nan"), dtype=_TORCH[config.out_dtype], device=t["q"].device)
    lse = torch.full((T, Hq), float("nan"), dtype=torch.float32, device=t["q"].device)
    values = dict(t, kv_cache=t["k"], k_cache=t["k"], v_cache=t["v"], out=out, lse=lse, sm_scale=D ** -0.5,
                  max_query_len=T if max_query_len is None else min(max_query_len, T))
    fn(*call_arguments(config.signature(), values))
    return (out, lse) if config.write_lse else out


def to_device(tensors: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


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


def run_check(family: str, device, cases: Sequence[Case], fallback: str = "the reference") -> records.CheckRecord:
    """Run ``cases`` now (no cache) and record the outcome (``fallback``: what serves the calls of a
    family that fails, for the warning)."""
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
        log.warning("cute_kernels: %s failed its self-check on %s (%s); %s runs instead",
                    family, dev, reason, fallback)
    return rec


def ensure(family: str, device, make_cases: Callable[[], Sequence[Case]], fallback: str = "the reference") -> bool:
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
    return run_check(family, device, make_cases(), fallback).ok


def guarded(family: str, device, make_cases: Callable[[], Sequence[Case]], kernel: Callable[[], object],
            reference: Callable[[], object]):
    """``kernel()`` when ``family`` passes its self-check on ``device``, else ``reference()``."""
    return kernel() if ensure(family, device, make_cases) else reference()
