"""The serving workloads of ``cute-kernels bench serve`` and the steps a vLLM-style scheduler forms
from them, host-only (no torch, no GPU): which request runs which rows in each step, and the
time-to-first-token / time-per-output-token of each request once each step's time is known.

The scheduler (:func:`schedule`) follows vLLM's with chunked prefill
(docs/design/benchmarks.md#bench-serve):

- at most ``concurrency`` requests run at once; the first ``concurrency`` arrive at step 0, and
  every later one arrives right after a running request finishes (a client that keeps
  ``concurrency`` requests in flight);
- each step has a budget of ``token_budget`` new tokens: every running request that has finished
  its prompt decodes one token first, then requests still in their prompt get chunks that fill
  the budget (admission order), then arrived requests are admitted while the budget lasts;
- the step that computes a request's last prompt chunk samples its first output token; each
  decode step samples one more; a request finishes with its ``output_len``-th token (so it runs
  ``output_len - 1`` decode rows: the last token is never fed back).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Workload:
    """A replayed serving run at the attention level: the requests, the scheduler's limits and
    the attention layer of the model (one layer shape repeated ``layers`` times)."""

    name: str
    num_requests: int
    input_len: int
    output_len: int
    concurrency: int
    kv_dtype: str  # "fp8" (e4m3) or "bf16"
    token_budget: int = 8192
    layers: int = 48
    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    page_size: int = 16
    table_tokens: int = 32768  # block-table width: vLLM's table spans max_model_len

    def __post_init__(self):
        for f in ("num_requests", "input_len", "output_len", "concurrency", "token_budget", "layers",
                  "num_q_heads", "num_kv_heads", "head_dim", "page_size", "table_tokens"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Workload.{f} must be a positive int, got {v!r}")
        if self.kv_dtype not in ("fp8", "bf16"):
            raise ValueError(f"Workload.kv_dtype must be 'fp8' or 'bf16', got {self.kv_dtype!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("Workload.num_q_heads must be a multiple of num_kv_heads")
        if self.max_seq_len > self.table_tokens:
            raise ValueError(f"a request reaches {self.max_seq_len} tokens, past the block table's "
                             f"{self.table_tokens}")

    @property
    def max_seq_len(self) -> int:
        """Tokens in a finished request's cache: the prompt and every output token but the last."""
        return self.input_len + self.output_len - 1

    @property
    def pages_per_request(self) -> int:
        return math.ceil(self.max_seq_len / self.page_size)

    @property
    def table_pages(self) -> int:
        return math.ceil(self.table_tokens / self.page_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * (1 if self.kv_dtype == "fp8" else 2)

    def cache_bytes(self) -> int:
        """The KV pool of every layer: ``concurrency`` requests' pages (pages are reused once a
        request finishes, as vLLM's allocator does)."""
        return self.layers * self.concurrency * self.pages_per_request * self.page_size * self.kv_bytes_per_token

    def scaled(self, *, layers: int | None = None, num_requests: int | None = None, concurrency: int | None = None,
               output_len: int | None = None) -> Workload:
        """A smaller copy (``--quick``): the fields given replaced, the name noting it."""
        fields = {k: v for k, v in dict(layers=layers, num_requests=num_requests, concurrency=concurrency,
                                        output_len=output_len).items() if v is not None}
        if not fields:
            return self
        note = ", ".join(f"{k}={v}" for k, v in fields.items())
        return replace(self, name=f"{self.name} [{note}]", **fields)


# Qwen3-30B-A3B: 48 layers, Hq 32, Hkv 4, D 128, page 16, HND
WORKLOADS = {
    "long-fp8": Workload("qwen3-30b fp8 16 x 32000/500 c8", 16, 32000, 500, 8, "fp8"),
    "long-bf16": Workload("qwen3-30b bf16 16 x 32000/500 c8", 16, 32000, 500, 8, "bf16"),
    "short-fp8": Workload("qwen3-30b fp8 128 x 2000/200 c64", 128, 2000, 200, 64, "fp8"),
    "short-bf16": Workload("qwen3-30b bf16 128 x 2000/200 c64", 128, 2000, 200, 64, "bf16"),
}
DEFAULT_WORKLOADS = ("long-fp8", "long-bf16", "short-fp8")


def quick(w: Workload) -> Workload:
    """``--quick``: 4 layers, a quarter of the requests and of the concurrency (at least 2 and 1),
    at most 64 output tokens; prompts keep their length (long-context prefill chunks are the point)."""
    return w.scaled(layers=min(w.layers, 4), num_requests=max(2, w.num_requests // 4),
                    concurrency=max(1, w.concurrency // 4), output_len=min(w.output_len, 64))


@dataclass(frozen=True)
class Chunk:
    """Request ``req`` computes its tokens ``[start, start + length)`` in a step: their K/V are
    written and their queries attend to the request's first ``start + length`` tokens."""

    req: int
    start: int
    length: int

    @property
    def seq_len(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Step:
    """One scheduler step: the decode rows (one token each) first, then the prefill chunks."""

    decodes: tuple[Chunk, ...]
    prefills: tuple[Chunk, ...]
    first_tokens: tuple[int, ...]  # requests that sample their first output token in this step
    finished: tuple[int, ...]  # requests that sample their last output token in this step

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.length for c in self.prefills)

    @property
    def decode_only(self) -> bool:
        return not self.prefills

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return self.decodes + self.prefills


@dataclass(frozen=True)
class Schedule:
    steps: tuple[Step, ...]
    arrival: tuple[int, ...]  # per request: the first step it can be scheduled in
    first_token: tuple[int, ...]  # per request: the step that samples its first output token
    finish: tuple[int, ...]  # per request: the step that samples its last output token


def schedule(w: Workload) -> Schedule:
    """The steps of workload ``w`` (see the module docstring); deterministic."""
    n, budget_max = w.num_requests, w.token_budget
    computed = [0] * n  # tokens whose K/V are in the cache
    generated = [0] * n  # output tokens sampled
    arrival = [-1] * n
    first_token = [-1] * n
    finish = [-1] * n
    waiting: deque[int] = deque()
    next_req = 0
    for _ in range(min(w.concurrency, n)):
        arrival[next_req] = 0
        waiting.append(next_req)
        next_req += 1
    running: list[int] = []
    steps: list[Step] = []
    while running or waiting:
        s = len(steps)
        budget = budget_max
        decodes, prefills = [], []
        for r in running:  # decodes first
            if computed[r] >= w.input_len and budget > 0:
                decodes.append(Chunk(r, computed[r], 1))
                budget -= 1
        for r in running:  # then the prompts already started, in admission order
            if computed[r] < w.input_len and budget > 0:
                n_new = min(w.input_len - computed[r], budget)
                prefills.append(Chunk(r, computed[r], n_new))
                budget -= n_new
        while waiting and budget > 0 and len(running) < w.concurrency:  # then new requests
            r = waiting.popleft()
            running.append(r)
            n_new = min(w.input_len, budget)
            prefills.append(Chunk(r, 0, n_new))
            budget -= n_new
        firsts, done = [], []
        for c in decodes + prefills:
            computed[c.req] = c.seq_len
            if computed[c.req] >= w.input_len:  # a decode row, or the prompt's last chunk
                generated[c.req] += 1
                if generated[c.req] == 1:
                    first_token[c.req] = s
                    firsts.append(c.req)
                if generated[c.req] == w.output_len:
                    finish[c.req] = s
                    done.append(c.req)
        running = [r for r in running if r not in done]
        for _ in done:  # the client sends its next request: schedulable from the next step
            if next_req < n:
                arrival[next_req] = s + 1
                waiting.append(next_req)
                next_req += 1
        steps.append(Step(tuple(decodes), tuple(prefills), tuple(firsts), tuple(done)))
    return Schedule(tuple(steps), tuple(arrival), tuple(first_token), tuple(finish))


def assign_slots(sched: Schedule, concurrency: int) -> tuple[int, ...]:
    """Per request, the cache slot (``concurrency`` slots of ``pages_per_request`` pages each) it
    holds from its first chunk to its finish: the lowest slot free at its first step. A slot is
    freed after its request's finishing step, so the next request reuses its pages, as vLLM's
    allocator hands freed pages to new requests."""
    n = len(sched.arrival)
    slot = [-1] * n
    free = list(range(concurrency))
    for s, step in enumerate(sched.steps):
        for c in step.prefills:
            if c.start == 0:
                if not free:
                    raise ValueError(f"step {s}: more than {concurrency} requests hold a slot")
                slot[c.req] = min(free)
                free.remove(slot[c.req])
        for r in step.finished:
            free.append(slot[r])
    return tuple(slot)


# ----------------------------------------------------------------------------------------------
# per-request latencies from per-step times
# ----------------------------------------------------------------------------------------------


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics
    (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values) -> dict:
    """mean, median and p99 of ``values``."""
    xs = list(values)
    return dict(mean=sum(xs) / len(xs), median=percentile(xs, 50), p99=percentile(xs, 99))


def request_latencies(sched: Schedule, step_times, output_len: int) -> dict:
    """Per request, the attention part of its latencies given each step's time (any unit):
    ``ttft`` = the steps from its arrival to the one sampling its first token (inclusive);
    ``tpot`` = the steps after that one up to its last token, per output token after the first
    (vLLM's definition; None for a one-token output)."""
    if len(step_times) != len(sched.steps):
        raise ValueError(f"{len(step_times)} step times for {len(sched.steps)} steps")
    prefix = [0.0]
    for t in step_times:
        prefix.append(prefix[-1] + t)
    ttft = [prefix[f + 1] - prefix[a] for a, f in zip(sched.arrival, sched.first_token)]
    tpot = [None if output_len == 1 else (prefix[e + 1] - prefix[f + 1]) / (output_len - 1)
            for f, e in zip(sched.first_token, sched.finish)]
    return dict(ttft=ttft, tpot=tpot)


def latency_summary(sched: Schedule, step_times, output_len: int) -> dict:
    """Total time and the mean/median/p99 over requests of TTFT and TPOT."""
    lat = request_latencies(sched, step_times, output_len)
    tpot = [x for x in lat["tpot"] if x is not None]
    return dict(total=sum(step_times), ttft=summary(lat["ttft"]), tpot=summary(tpot) if tpot else None)


def decode_runs(sched: Schedule) -> list[range]:
    """The runs of consecutive decode-only steps with the same requests (each context one token
    longer per step): the stretches over which a step's time changes smoothly."""
    steps, runs, i = sched.steps, [], 0
    while i < len(steps):
        if not steps[i].decode_only:
            i += 1
            continue
        j = i + 1
        while j < len(steps) and steps[j].decode_only and steps[j].decodes == _advance(steps[i].decodes, j - i):
            j += 1
        runs.append(range(i, j))
        i = j
    return runs


def _advance(decodes: tuple[Chunk, ...], k: int) -> tuple[Chunk, ...]:
    return tuple(Chunk(c.req, c.start + k, 1) for c in decodes)


def timed_steps(sched: Schedule, stride: int) -> list[bool]:
    """Which steps ``bench serve`` times with ``--decode-stride stride``: every step with prefill
    rows, and in each of the :func:`decode_runs` its first, last and every ``stride``-th step."""
    if stride < 1:
        raise ValueError(f"decode stride must be >= 1, got {stride}")
    timed = [True] * len(sched.steps)
    for run in decode_runs(sched):
        for k in run:
            timed[k] = (k - run.start) % stride == 0 or k == run.stop - 1
    return timed


def fill_untimed(times: list, timed: list[bool], sched: Schedule) -> list:
    """Step times where only some decode-only steps were timed (:func:`timed_steps`): an untimed
    step gets the linear interpolation between the nearest timed steps of its
    :func:`decode_runs` run (the nearest one when it has a single neighbour)."""
    out = list(times)
    for run in decode_runs(sched):
        known = [k for k in run if timed[k]]
        if not known and not all(timed[k] for k in run):
            raise ValueError(f"decode-only steps {run.start}..{run.stop - 1} have no timed step")
        for k in run:
            if timed[k]:
                continue
            before = [x for x in known if x < k]
            after = [x for x in known if x > k]
            if before and after:
                a, b = before[-1], after[0]
                out[k] = out[a] + (out[b] - out[a]) * (k - a) / (b - a)
            else:
                out[k] = out[before[-1] if before else after[0]]
    return out
