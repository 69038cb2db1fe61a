"""``cute-kernels bench serve``: a vLLM serving run replayed at the attention level, step by step.

A workload (:mod:`.serve_schedule`: Qwen3-30B-A3B's attention, 48 layers, Hq 32, Hkv 4, D 128,
page 16, HND; e.g. 16 requests of 32000 prompt and 500 output tokens at concurrency 8) is turned
into the steps vLLM's scheduler forms with chunked prefill (decode rows first, then prefill chunks
filling a token budget). Each configuration replays every step: for each of the ``layers`` layers
(each with its own cache tensor, so no layer reads another's K/V from L2) it writes the step's new
K/V (``cute_kernels.write_kv_cache``) and runs the layer's attention over the decode and prefill
rows. A decode-only step is timed as a CUDA graph of all its layers (the median of a few
replays); a step with prefill rows is timed eagerly with CUDA events after one warm-up run.

Configurations (a peer whose library is missing is skipped with one line):
- ``ours``: :class:`dispatch.AttentionLayer` (write, then one decode launch and one prefill launch);
- ``ours_fp8q``: the same layer with ``prefill_query_dtype="fp8"``: the prefill rows of an FP8
  cache quantized with ``q_scale`` and run by ``sm90.prefill_fp8q``, the decode rows unchanged (FP8
  workloads only);
- ``ours_fp8x2``: the same with ``prefill_query_dtype="fp8x2"``: the two-term FP8 query
  (``sm90.prefill_fp8x2``; FP8 workloads only);
- ``fi_xqa``: FlashInfer ``trtllm_batch_decode_with_kv_cache(backend="xqa")`` for the decode rows
  and ``BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`` for the prefill rows (vLLM's
  "FlashInfer + XQA" on SM90); with an FP8 cache the prefill query is quantized to FP8 first, as
  vLLM does when the KV cache is FP8 (``--fi-prefill-query bf16`` keeps it 16-bit);
- ``fi_native``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` + the same fa3 prefill;
- ``fa4``: ``flash_attn.cute.flash_attn_varlen_func`` for both phases on a paged NHD cache: one
  varlen call per mixed step, the batched decode form on decode-only steps (BF16 caches only:
  FA4 has no FP8 KV on SM90).
Every configuration uses the same cache write (ours), so the comparison is the attention.
FlashInfer's ``plan()`` runs once per step outside the timing (vLLM plans once per step for all
layers).

Reported per workload and configuration: the total attention time of the run, and over the
requests the mean / median / p99 of the attention part of the time to first token (the steps
from a request's arrival to the one sampling its first token) and of the time per output token.
Prints a table; writes JSON (``--json``: every step's time and how it was timed) and a PNG of the
per-step times (``--png``). ``--quick`` scales every workload down (4 layers, a quarter of the
requests and concurrency, 64 output tokens). Method: docs/design/benchmarks.md#bench-serve.
"""

from __future__ import annotations

import statistics
import traceback

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.plans.args import check_positive_ints
from cute_kernels.testing import per_tensor_q_scale, rel_err
from dispatch import AttentionLayer, AttentionMetadata

from .harness import SM90, NvtxRanges, Peer, check_unused, choice_list, runnable, self_check_state, write_json
from .serve_schedule import (
    DEFAULT_WORKLOADS,
    WORKLOADS,
    Schedule,
    Step,
    Workload,
    assign_slots,
    fill_untimed,
    latency_summary,
    quick,
    schedule,
    timed_steps,
)
from .timing import bench_setup

NEEDS = SM90
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
CONFIGS = ("ours", "ours_fp8q", "ours_fp8x2", "fi_xqa", "fi_native", "fa4")
_FLASHINFER = Peer("flashinfer", "flashinfer-python")
PEER_LIBS = {"fi_xqa": _FLASHINFER, "fi_native": _FLASHINFER, "fa4": Peer("flash_attn", "flash-attn-4")}
# configurations that run on one cache dtype only: (that dtype, why), reported as the row's error
ONLY_ON = {"fa4": ("bf16", "FA4 has no FP8 KV cache on SM90"),
           "ours_fp8q": ("fp8", "an FP8 prefill query needs an FP8 KV cache"),
           "ours_fp8x2": ("fp8", "an FP8 prefill query needs an FP8 KV cache")}
SCALES = dict(fp8=(0.0625, 0.03125), bf16=(1.0, 1.0))  # (k_scale, v_scale): FP8 codes stay O(16)


# ----------------------------------------------------------------------------------------------
# the replayed state: caches, the step's inputs
# ----------------------------------------------------------------------------------------------


class Replay:
    """The device side of one workload: per-layer caches (allocated per layout), the query/key/
    value buffers of the largest step, and each request's pages."""

    def __init__(self, w: Workload, sched: Schedule, g: torch.Generator, device: str = "cuda"):
        self.w, self.sched, self.device = w, sched, device
        self.kv_dtype = FP8 if w.kv_dtype == "fp8" else BF16
        self.k_scale, self.v_scale = SCALES[w.kv_dtype]
        self.sm_scale = w.head_dim ** -0.5
        T = max(s.num_tokens for s in sched.steps)
        dev = device
        self.q = torch.randn(T, w.num_q_heads, w.head_dim, device=dev, generator=g).to(BF16)
        self.k = torch.randn(T, w.num_kv_heads, w.head_dim, device=dev, generator=g).to(BF16)
        self.v = torch.randn(T, w.num_kv_heads, w.head_dim, device=dev, generator=g).to(BF16)
        self.q_scale = per_tensor_q_scale(self.q)
        self.q8 = torch.empty(T, w.num_q_heads, w.head_dim, dtype=FP8, device=dev)
        self.slot = assign_slots(sched, w.concurrency)
        pool = w.concurrency * w.pages_per_request
        perm = torch.randperm(pool, generator=torch.Generator().manual_seed(0)).to(torch.int32)
        self.slot_pages = perm.view(w.concurrency, w.pages_per_request)  # host, int32
        self.caches, self.layout = None, None

    def allocate(self, layout: str):
        """Per-layer caches in ``layout``: ``[P, 2, Hkv, page, D]`` (HND) or a ``(K, V)`` pair of
        ``[P, page, Hkv, D]`` (NHD, FA4's)."""
        if self.layout == layout:
            return
        self.caches = None
        torch.cuda.empty_cache()
        w = self.w
        P = w.concurrency * w.pages_per_request + 1
        shape = (P, 2, w.num_kv_heads, w.page_size, w.head_dim) if layout == "HND" else \
            (P, w.page_size, w.num_kv_heads, w.head_dim)
        self.caches = []
        for _ in range(w.layers):
            t = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            self.caches.append(t if layout == "HND" else (t, torch.zeros_like(t)))
        self.layout = layout

    def release(self):
        self.caches, self.layout = None, None
        torch.cuda.empty_cache()

    def step_inputs(self, step: Step) -> StepInputs:
        return StepInputs(self, step)


class StepInputs:
    """One step's metadata on the device (decode requests first, vLLM's order), built on the host
    before anything is timed; ``q``/``k``/``v`` are views of the replay's buffers."""

    def __init__(self, rp: Replay, step: Step):
        w = rp.w
        chunks = step.chunks
        self.nd = len(step.decodes)
        self.num_reqs = len(chunks)
        self.T = step.num_tokens
        self.lens = [c.seq_len for c in chunks]
        self.q_lens = [c.length for c in chunks]
        self.max_prefill = max([c.length for c in step.prefills], default=0)
        table = torch.zeros(self.num_reqs, w.table_pages, dtype=torch.int32)
        slots = []
        for i, c in enumerate(chunks):
            pages = rp.slot_pages[rp.slot[c.req]]
            table[i, :w.pages_per_request] = pages
            pos = torch.arange(c.start, c.seq_len)
            slots.append(pages[pos // w.page_size].long() * w.page_size + pos % w.page_size)
        starts = [0]
        for n in self.q_lens:
            starts.append(starts[-1] + n)
        self.starts, self.table_host = starts, table
        dev = rp.device
        self.block_table = table.to(dev)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.cat(slots).to(dev)
        self.q, self.k, self.v = rp.q[:self.T], rp.k[:self.T], rp.v[:self.T]
        self.q8 = rp.q8[:self.T]


# ----------------------------------------------------------------------------------------------
# configurations: prepare(st) on the host (not timed), layer(i, st) -> the layer's output
# ----------------------------------------------------------------------------------------------


class Ours:
    layout = "HND"
    prefill_query_dtype = "auto"  # the layer's default plans

    def __init__(self, rp: Replay, args):
        w = rp.w
        self.rp = rp
        # on CPU tensors (tests) the layer plans for SM90 and its ops run the reference
        self.layer_ = AttentionLayer(w.num_q_heads, w.num_kv_heads, w.head_dim, kv_cache_dtype=rp.kv_dtype,
                                     page_size=w.page_size, kv_layout="HND", q_scale=rp.q_scale,
                                     k_scale=rp.k_scale, v_scale=rp.v_scale,
                                     arch="sm90" if rp.device == "cpu" else None,
                                     prefill_query_dtype=self.prefill_query_dtype)
        self.plans = {}  # (phase, kernel) -> the plan, of every step's plans

    def prepare(self, st: StepInputs):
        self.md = AttentionMetadata(query_start_loc=st.query_start_loc, seq_lens=st.seq_lens,
                                    block_table=st.block_table, slot_mapping=st.slot_mapping,
                                    num_decode_tokens=st.nd, max_query_len=st.max_prefill or None)
        self.plans.update({(k, p.kernel): p for k, p in self.layer_.plans_for(self.md).items() if p})

    def layer(self, i: int, st: StepInputs):
        return self.layer_.forward(st.q, st.k, st.v, self.rp.caches[i], self.md)


class OursFp8q(Ours):
    """Our layer with the FP8-query prefill (docs/design/layer.md#fp8-query-prefill-opt-in)."""

    prefill_query_dtype = "fp8"


class OursFp8x2(Ours):
    """Our layer with the two-term FP8-query prefill (docs/design/sm90-prefill.md)."""

    prefill_query_dtype = "fp8x2"


class _FlashInferBase:
    """The write and the fa3 prefill shared by both FlashInfer configurations."""

    layout = "HND"

    def __init__(self, rp: Replay, args):
        import flashinfer

        self.rp = rp
        self.fp8_query = rp.kv_dtype == FP8 and args.fi_prefill_query in (None, "fp8")  # fp8 unless told bf16
        self.prefill_ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.prefill_ws, "HND", backend="fa3")
        self.out = torch.empty_like(rp.q)

    def _page_lists(self, st: StepInputs, lo: int, hi: int, device):
        """(indptr, indices, last_page_len) of requests ``lo:hi`` of the step (host-built)."""
        page = self.rp.w.page_size
        n = [-(-L // page) for L in st.lens[lo:hi]]
        indptr = [0]
        for x in n:
            indptr.append(indptr[-1] + x)
        table = st.table_host[lo:hi]
        indices = torch.cat([table[b, :n[b]] for b in range(hi - lo)])
        last = [L - (k - 1) * page for L, k in zip(st.lens[lo:hi], n)]
        as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        return as_t(indptr), indices.to(device=device, dtype=torch.int32), as_t(last)

    def prepare(self, st: StepInputs):
        self.prepare_decode(st)
        if st.nd == st.T:
            return
        rp, w = self.rp, self.rp.w
        qo = [x - st.nd for x in st.starts[st.nd:]]
        indptr, indices, last = self._page_lists(st, st.nd, st.num_reqs, "cuda")
        self.prefill.plan(torch.tensor(qo, dtype=torch.int32, device="cuda"), indptr, indices, last,
                          w.num_q_heads, w.num_kv_heads, w.head_dim, w.page_size, causal=True,
                          sm_scale=rp.sm_scale, q_data_type=FP8 if self.fp8_query else BF16,
                          kv_data_type=rp.kv_dtype, o_data_type=BF16)

    def layer(self, i: int, st: StepInputs):
        rp = self.rp
        cache = rp.caches[i]
        cute_kernels.write_kv_cache(st.k, st.v, cache, st.slot_mapping, kv_layout="HND", k_scale=rp.k_scale,
                                    v_scale=rp.v_scale)
        out = self.out[:st.T]
        if st.nd:
            self.decode(cache, st, out[:st.nd])
        if st.nd < st.T:
            q, o = st.q[st.nd:], out[st.nd:]
            scales = {}
            if rp.kv_dtype == FP8:
                scales = dict(k_scale=rp.k_scale, v_scale=rp.v_scale)
            if self.fp8_query:
                q = cute_kernels.quantize_query(q, rp.q_scale, out=st.q8[st.nd:])
                scales["q_scale"] = rp.q_scale
            self.prefill.run(q, cache, out=o, **scales)
        return out


class FiXqa(_FlashInferBase):
    def __init__(self, rp: Replay, args):
        super().__init__(rp, args)
        self.ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")  # XQA needs a zeroed one

    def prepare_decode(self, st: StepInputs):
        self.max_decode_len = max(st.lens[:st.nd], default=0)

    def decode(self, cache, st: StepInputs, out):
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache

        rp = self.rp
        trtllm_batch_decode_with_kv_cache(
            query=st.q[:st.nd], kv_cache=cache, workspace_buffer=self.ws, block_tables=st.block_table[:st.nd],
            seq_lens=st.seq_lens[:st.nd], max_seq_len=self.max_decode_len, bmm1_scale=rp.sm_scale * rp.k_scale,
            bmm2_scale=rp.v_scale, backend="xqa", kv_layout="HND", out=out)


class FiNative(_FlashInferBase):
    def __init__(self, rp: Replay, args):
        import flashinfer

        super().__init__(rp, args)
        self.ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.ws, "HND", use_tensor_cores=True)

    def prepare_decode(self, st: StepInputs):
        if not st.nd:
            return
        rp, w = self.rp, self.rp.w
        indptr, indices, last = self._page_lists(st, 0, st.nd, "cuda")
        self.wrapper.plan(indptr, indices, last, w.num_q_heads, w.num_kv_heads, w.head_dim, w.page_size,
                          q_data_type=BF16, kv_data_type=rp.kv_dtype, sm_scale=rp.sm_scale)

    def decode(self, cache, st: StepInputs, out):
        rp = self.rp
        self.wrapper.run(st.q[:st.nd], cache, out=out, k_scale=rp.k_scale, v_scale=rp.v_scale)


class Fa4:
    layout = "NHD"

    def __init__(self, rp: Replay, args):
        if rp.kv_dtype != BF16:
            raise NotImplementedError("FA4 has no FP8 KV cache on SM90")
        self.rp = rp
        self.num_splits = 0  # FA4's own split heuristic; 1 if this FA4 refuses it (see layer())

    def prepare(self, st: StepInputs):
        pass

    def layer(self, i: int, st: StepInputs):
        from flash_attn.cute import flash_attn_varlen_func

        rp = self.rp
        cache = rp.caches[i]
        cute_kernels.write_kv_cache(st.k, st.v, cache, st.slot_mapping, kv_layout="NHD")
        k, v = cache
        common = dict(seqused_k=st.seq_lens, page_table=st.block_table, softmax_scale=rp.sm_scale, causal=True)
        if st.nd == st.T:  # decode-only: the batched form (bench decode's)
            q = st.q.view(st.nd, 1, *st.q.shape[1:])
            try:
                out = flash_attn_varlen_func(q, k, v, num_splits=self.num_splits, **common)
            except (AssertionError, NotImplementedError, ValueError, RuntimeError):
                if self.num_splits == 1 or torch.cuda.is_current_stream_capturing():
                    raise
                self.num_splits = 1
                out = flash_attn_varlen_func(q, k, v, num_splits=1, **common)
        else:
            out = flash_attn_varlen_func(st.q, k, v, cu_seqlens_q=st.query_start_loc,
                                         max_seqlen_q=max(st.q_lens), num_splits=1, **common)
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(st.T, *st.q.shape[1:])


MAKERS = {"ours": Ours, "ours_fp8q": OursFp8q, "ours_fp8x2": OursFp8x2, "fi_xqa": FiXqa, "fi_native": FiNative,
          "fa4": Fa4}


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def _events_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_step(run_step, graph: bool, reps: int) -> tuple[float, str]:
    """Seconds of one step: the median of ``reps`` CUDA-graph replays of all its layers, or of
    ``reps`` eager runs with CUDA events, after one eager warm-up run (it compiles what is new)."""
    if graph:  # warm up on a side stream, as torch wants before a capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run_step()
        g.replay()
        times = [_events_ms(g.replay) for _ in range(reps)]
        del g
        return statistics.median(times) / 1e3, "graph"
    run_step()
    torch.cuda.synchronize()
    return statistics.median(_events_ms(run_step) for _ in range(reps)) / 1e3, "eager"


def step_kind(step: Step) -> str:
    """``decode`` (decode rows only), ``prefill`` (prefill rows only) or ``mixed``."""
    return "decode" if step.decode_only else ("mixed" if step.decodes else "prefill")


def check_step(cfg, rp: Replay, st: StepInputs) -> dict:
    """Layer 0's output of this step against the reference on the same cache (after the write)."""
    out = cfg.layer(0, st)
    cache = rp.caches[0]
    common = dict(kv_layout=rp.layout, sm_scale=rp.sm_scale, k_scale=rp.k_scale, v_scale=rp.v_scale)
    errs = {}
    if st.nd:
        ref = reference.paged_decode(st.q[:st.nd], cache, st.block_table[:st.nd], st.seq_lens[:st.nd], **common)
        errs["decode_err"] = rel_err(out[:st.nd].float(), ref.float())
    if st.nd < st.T:
        qsl = st.query_start_loc[st.nd:] - st.nd
        ref = reference.paged_prefill(st.q[st.nd:], cache, st.block_table[st.nd:], st.seq_lens[st.nd:], qsl,
                                      out_dtype=BF16, **common)
        errs["prefill_err"] = rel_err(out[st.nd:].float(), ref.float())
    return errs


def replay_config(name: str, rp: Replay, args, ranges: NvtxRanges) -> dict:
    """Every timed step of the workload for one configuration, and the latency summary."""
    sched, w = rp.sched, rp.w
    cfg = MAKERS[name](rp, args)
    rp.allocate(cfg.layout)
    timed = timed_steps(sched, args.decode_stride)
    times, how = [0.0] * len(sched.steps), [None] * len(sched.steps)
    checks, checked = {}, set()
    label = f"bench.serve.{name}"
    for s, step in enumerate(sched.steps):
        if not timed[s]:
            continue
        st = rp.step_inputs(step)
        cfg.prepare(st)
        kind = step_kind(step)
        if args.check and kind not in checked:
            checked.add(kind)
            checks.update({f"{kind}_{k}": v for k, v in check_step(cfg, rp, st).items()})

        def run_step(st=st):
            for i in range(w.layers):
                cfg.layer(i, st)

        fn = ranges.wrap(label, run_step)
        graph = step.decode_only and not args.no_graphs
        t, how[s] = time_step(fn, graph, args.graph_reps if graph else args.eager_reps)
        times[s] = t
        if args.verbose:
            print(f"  {name:<10} step {s:5d} {kind:<6} T {st.T:5d} reqs {st.num_reqs:3d} {t * 1e3:9.3f} ms "
                  f"({how[s]})", flush=True)
    times = fill_untimed(times, timed, sched)
    summ = latency_summary(sched, times, w.output_len)
    res = dict(step_s=times, timed=timed, how=how, summary=summ, **checks)
    if isinstance(cfg, Ours):
        res["plans"] = sorted(f"{phase}: {kernel}" for phase, kernel in cfg.plans)
        # a compile-verified kernel whose family failed its self-check ran as the reference
        states = [self_check_state(p.kernel, p.q_dtype, p.kv_cache_dtype, p.head_dim) for p in cfg.plans.values()]
        res["self_check"] = sorted(text for _, text in states if text)
        failed = [text for ok, text in states if not ok]
        if failed:
            res["self_check_failed"] = "; ".join(failed)
    if name == "fa4":
        res["fa4_decode_num_splits"] = "heuristic (0)" if cfg.num_splits == 0 else str(cfg.num_splits)
    return res


# ----------------------------------------------------------------------------------------------
# run, table, plot
# ----------------------------------------------------------------------------------------------


def describe(w: Workload, sched: Schedule) -> dict:
    steps = sched.steps
    return dict(name=w.name, num_requests=w.num_requests, input_len=w.input_len, output_len=w.output_len,
                concurrency=w.concurrency, token_budget=w.token_budget, layers=w.layers, Hq=w.num_q_heads,
                Hkv=w.num_kv_heads, D=w.head_dim, page=w.page_size, kv=w.kv_dtype, table_tokens=w.table_tokens,
                cache_gb=w.cache_bytes() / 1e9, steps=len(steps),
                decode_only_steps=sum(1 for x in steps if x.decode_only),
                step_decodes=[len(x.decodes) for x in steps],
                step_prefill_tokens=[sum(c.length for c in x.prefills) for x in steps])


def run(workloads, configs, args) -> dict:
    ranges = NvtxRanges(args.nvtx)
    bw, g = bench_setup()
    results = []
    for w in workloads:
        sched = schedule(w)
        info = describe(w, sched)
        print(f"\n{w.name}: {info['steps']} steps ({info['decode_only_steps']} decode-only), "
              f"{w.layers} layers, caches {info['cache_gb']:.1f} GB", flush=True)
        rp = Replay(w, sched, g)
        entry = dict(workload=info, configs={})
        for name in sorted(configs, key=lambda c: MAKERS[c].layout):  # HND configs share the caches
            only, why = ONLY_ON.get(name, (w.kv_dtype, ""))
            if w.kv_dtype != only:
                print(f"{name} skipped on {w.name}: {why} (it runs on the {only.upper()} workloads only)", flush=True)
                entry["configs"][name] = dict(error=why)
                continue
            try:
                entry["configs"][name] = replay_config(name, rp, args, ranges)
            except Exception as e:  # a configuration that cannot run is reported, not fatal
                traceback.print_exc()
                entry["configs"][name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            _print_config(name, entry["configs"][name])
        rp.release()
        del rp
        torch.cuda.empty_cache()
        results.append(entry)
    result = dict(device=torch.cuda.get_device_name(), read_bw=bw, decode_stride=args.decode_stride,
                  graph_reps=args.graph_reps, eager_reps=args.eager_reps, workloads=results)
    write_json(args.json, result)
    print_table(results)
    return result


def _print_config(name: str, r: dict):
    if "error" in r:
        print(f"  {name:<10} skipped: {r['error']}", flush=True)
        return
    s = r["summary"]
    chk = " ".join(f"{k}={v:.1e}" for k, v in r.items() if k.endswith("_err"))
    print(f"  {name:<10} total {s['total'] * 1e3:10.1f} ms  {chk}", flush=True)
    if "self_check_failed" in r:
        print(f"  {name:<10} NOT the kernel's times: {r['self_check_failed']}", flush=True)


def _trio(x) -> str:
    return "-" if x is None else f"{x['mean'] * 1e3:.2f}/{x['median'] * 1e3:.2f}/{x['p99'] * 1e3:.2f}"


def print_table(results: list):
    head = f"{'workload':<38} {'config':<10} {'total s':>8} {'TTFT ms mean/med/p99':>26} {'TPOT ms mean/med/p99':>26}"
    print("\nattention time (write + attention, all layers)\n" + head)
    for e in results:
        for name, r in e["configs"].items():
            if "error" in r:
                print(f"{e['workload']['name'][:38]:<38} {name:<10} {'-':>8}  {r['error'][:52]}")
                continue
            s = r["summary"]
            print(f"{e['workload']['name'][:38]:<38} {name:<10} {s['total']:8.3f} {_trio(s['ttft']):>26} "
                  f"{_trio(s['tpot']):>26}")


def plot(results: list, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(12, 3.6 * len(results)), squeeze=False)
    for ax, e in zip(axes[:, 0], results):
        for name, r in e["configs"].items():
            if "step_s" in r:
                ax.plot([t * 1e3 for t in r["step_s"]], lw=0.8, label=name)
        mixed = [i for i, n in enumerate(e["workload"]["step_prefill_tokens"]) if n]
        for i in mixed:
            ax.axvspan(i - 0.5, i + 0.5, color="0.9", lw=0)
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (all layers)")
        ax.set_title(f"{e['workload']['name']} (shaded: steps with prefill rows)", fontsize=9)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)} (default: %(default)s)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of configurations (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="scale every workload down: 4 layers, a quarter of the requests and concurrency, <= 64 "
                        "output tokens")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--requests", type=int, default=None, help="override the number of requests")
    p.add_argument("--concurrency", type=int, default=None, help="override the concurrency")
    p.add_argument("--output-len", type=int, default=None, help="override the output tokens per request")
    p.add_argument("--decode-stride", type=int, default=1,
                   help="time every N-th step of each run of decode-only steps (plus its first and last) and "
                        "interpolate the others (default: %(default)s, every step)")
    p.add_argument("--graph-reps", type=int, default=3, help="timed graph replays per decode-only step")
    p.add_argument("--eager-reps", type=int, default=1, help="timed eager runs per step with prefill rows")
    p.add_argument("--no-graphs", action="store_true", help="time decode-only steps eagerly too")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the check of layer 0 against the reference on the first decode and mixed step")
    p.add_argument("--fi-prefill-query", choices=("fp8", "bf16"), default=None,  # None: not given
                   help="FlashInfer's fa3 prefill query with an FP8 cache (fi_xqa, fi_native; default: fp8, as vLLM)")
    p.add_argument("--png", default=None, metavar="PATH", help="also plot the per-step times to PATH")
    p.add_argument("--verbose", action="store_true", help="print every timed step")


def select_workloads(args) -> list[Workload]:
    """The workloads named by ``--workloads``, scaled by ``--quick`` and the overrides;
    ``ValueError`` naming the flag of a bad value."""
    overrides = {"--layers": args.layers, "--requests": args.requests, "--concurrency": args.concurrency,
                 "--output-len": args.output_len}
    given = {flag: v for flag, v in overrides.items() if v is not None}
    check_positive_ints(**given)
    out = []
    for n in choice_list("--workloads", args.workloads, WORKLOADS):
        w = quick(WORKLOADS[n]) if args.quick else WORKLOADS[n]
        try:
            out.append(w.scaled(layers=args.layers, num_requests=args.requests, concurrency=args.concurrency,
                                output_len=args.output_len))
        except ValueError as e:  # e.g. an --output-len past the block table
            with_ = "".join(f" {flag} {v}" for flag, v in given.items())
            raise ValueError(f"--workloads {n}{' with' + with_ if with_ else ''}: {e}") from None
    return out


def check_arguments(args) -> tuple[list[Workload], tuple[str, ...]]:
    """``(workloads, configurations)`` of the command line, each value checked (names, counts
    and repetitions of at least 1): ``ValueError`` naming the flag, before the GPU check."""
    check_positive_ints(**{"--decode-stride": args.decode_stride, "--graph-reps": args.graph_reps,
                           "--eager-reps": args.eager_reps})
    workloads, configs = select_workloads(args), choice_list("--configs", args.configs, MAKERS)
    given = args.fi_prefill_query is not None
    check_unused("without a FlashInfer configuration (fi_xqa, fi_native)",
                 {"--fi-prefill-query": given and not any(PEER_LIBS.get(c) is _FLASHINFER for c in configs)})
    check_unused("without an FP8-cache workload",
                 {"--fi-prefill-query": given and all(w.kv_dtype != "fp8" for w in workloads)})
    return workloads, configs


def main(args) -> None:
    workloads, requested = check_arguments(args)
    configs, png = runnable(list(requested), PEER_LIBS, args.png)
    result = run(workloads, configs, args)
    if png:
        plot(result["workloads"], png)
