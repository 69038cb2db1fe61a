"""``cute-kernels bench serve`` without a GPU: the workloads, the scheduler's steps (budget, decodes
first, every prompt and output token, the concurrency cap, determinism), the slots, the latency
arithmetic, the decode-stride interpolation and the command line. Timing: tests/gpu/test_bench_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_kernels import reference
from cute_kernels.bench import build_parser
from cute_kernels.bench import serve_schedule as ss
from dispatch import UnsupportedConfig

# ----------------------------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------------------------


def test_workloads_are_the_agreed_ones():
    w = ss.WORKLOADS["long-fp8"]
    assert (w.num_requests, w.input_len, w.output_len, w.concurrency, w.token_budget) == (16, 32000, 500, 8, 8192)
    assert (w.layers, w.num_q_heads, w.num_kv_heads, w.head_dim, w.page_size, w.kv_dtype) == (48, 32, 4, 128, 16, "fp8")
    assert w.table_tokens == 32768
    assert ss.WORKLOADS["long-bf16"] == ss.Workload(**{**w.__dict__, "name": ss.WORKLOADS["long-bf16"].name,
                                                        "kv_dtype": "bf16"})
    s = ss.WORKLOADS["short-fp8"]
    assert (s.num_requests, s.input_len, s.output_len, s.concurrency, s.kv_dtype) == (128, 2000, 200, 64, "fp8")
    assert set(ss.DEFAULT_WORKLOADS) <= set(ss.WORKLOADS)


def test_cache_bytes_fit_an_h200():
    w = ss.WORKLOADS["long-fp8"]
    # 8 requests in flight x 2032 pages x 16 tokens x (4 heads x 128 x K,V x 1 byte) x 48 layers
    assert w.pages_per_request == math.ceil(32499 / 16) == 2032
    assert w.cache_bytes() == 48 * 8 * 2032 * 16 * 1024
    assert ss.WORKLOADS["long-bf16"].cache_bytes() == 2 * w.cache_bytes() < 30e9


@pytest.mark.parametrize("bad, match", [
    (dict(concurrency=0), "concurrency"),
    (dict(kv_dtype="fp16"), "kv_dtype"),
    (dict(num_kv_heads=5), "multiple"),
    (dict(input_len=40000), "block table"),
    (dict(layers=True), "layers"),
])
def test_workload_rejects_bad_fields(bad, match):
    fields = dict(name="x", num_requests=2, input_len=100, output_len=3, concurrency=1, kv_dtype="fp8")
    with pytest.raises(ValueError, match=match):
        ss.Workload(**{**fields, **bad})


def test_quick_and_overrides_scale_down_and_say_so():
    q = ss.quick(ss.WORKLOADS["long-fp8"])
    assert (q.layers, q.num_requests, q.concurrency, q.output_len, q.input_len) == (4, 4, 2, 64, 32000)
    assert "layers=4" in q.name and q.name.startswith(ss.WORKLOADS["long-fp8"].name)
    w = ss.WORKLOADS["short-fp8"]
    assert w.scaled() is w
    assert w.scaled(layers=2).layers == 2 and "layers=2" in w.scaled(layers=2).name


# ----------------------------------------------------------------------------------------------
# the schedule
# ----------------------------------------------------------------------------------------------


def check_schedule(w: ss.Workload, sched: ss.Schedule):
    """Every property the scheduler promises, for any workload."""
    n, C = w.num_requests, w.concurrency
    prompt = [[] for _ in range(n)]
    decode = [[] for _ in range(n)]
    holding = set()  # requests that hold a slot (admitted, not finished)
    for s, step in enumerate(sched.steps):
        assert 1 <= step.num_tokens <= w.token_budget, s
        for c in step.decodes:
            assert c.length == 1 and c.start >= w.input_len
            decode[c.req].append(c.start)
        for c in step.prefills:
            assert c.start < w.input_len and 1 <= c.length and c.seq_len <= w.input_len
            prompt[c.req].append((c.start, c.length))
            holding.add(c.req)
        reqs = [c.req for c in step.chunks]
        assert len(reqs) == len(set(reqs)), f"step {s} runs a request twice"
        assert len(holding) <= C, f"step {s}: {len(holding)} requests in flight"
        # decodes first: a request past its prompt never waits while the step has budget for it
        for r in holding:
            past_prompt = sum(x[1] for x in prompt[r]) == w.input_len and r not in [c.req for c in step.prefills]
            if past_prompt and sched.first_token[r] < s:
                assert r in [c.req for c in step.decodes], f"step {s}: request {r} skipped its decode"
        # prefill fills the budget: a step that leaves budget unused has no prompt work left to give
        if step.num_tokens < w.token_budget:
            started = [r for r in holding if sum(x[1] for x in prompt[r]) < w.input_len]
            assert not started, f"step {s} left budget while requests {started} still had prompt tokens"
            waiting = [r for r in range(n) if sched.arrival[r] <= s and r not in holding and sched.finish[r] > s]
            assert not waiting or len(holding) == C, f"step {s} left budget and a free slot to waiting {waiting}"
        for r in step.finished:
            holding.discard(r)
    for r in range(n):
        starts = [0]
        for a, length in prompt[r]:
            assert a == starts[-1], f"request {r}: prompt chunks out of order"
            starts.append(a + length)
        assert starts[-1] == w.input_len, f"request {r} computed {starts[-1]} prompt tokens"
        assert decode[r] == list(range(w.input_len, w.input_len + w.output_len - 1)), r
        assert sched.arrival[r] <= sched.first_token[r] <= sched.finish[r]
        assert sched.first_token[r] == [s for s, st_ in enumerate(sched.steps) if r in st_.first_tokens][0]
        assert sched.finish[r] == [s for s, st_ in enumerate(sched.steps) if r in st_.finished][0]
        first_chunk = min(s for s, st_ in enumerate(sched.steps) if r in [c.req for c in st_.prefills])
        assert sched.arrival[r] <= first_chunk
    # the first C requests arrive at once; every later one right after a request finishes
    assert list(sched.arrival[:C]) == [0] * min(C, n)
    finishes = sorted(f + 1 for f in sched.finish)
    for r in range(C, n):
        assert sched.arrival[r] in finishes
    assert sorted(sched.arrival[C:]) == list(sched.arrival[C:])  # in order


@pytest.mark.parametrize("name", sorted(ss.WORKLOADS))
def test_schedule_of_every_workload(name):
    w = ss.WORKLOADS[name]
    sched = ss.schedule(w)
    check_schedule(w, sched)
    assert ss.schedule(w) == sched  # deterministic
    assert sum(s.num_tokens for s in sched.steps) == w.num_requests * (w.input_len + w.output_len - 1)


def test_long_workload_first_steps():
    sched = ss.schedule(ss.WORKLOADS["long-fp8"])
    s = sched.steps
    assert s[0].prefills == (ss.Chunk(0, 0, 8192),) and not s[0].decodes
    assert s[3].prefills == (ss.Chunk(0, 24576, 7424), ss.Chunk(1, 0, 768))
    assert s[3].first_tokens == (0,)
    assert s[4].decodes == (ss.Chunk(0, 32000, 1),) and s[4].prefills == (ss.Chunk(1, 768, 8191),)
    # request 0 finishes 499 decode steps after its first token; request 8 arrives right after
    assert sched.finish[0] == sched.first_token[0] + 499
    assert sched.arrival[8] == sched.finish[0] + 1
    assert max(sum(1 for _ in st_.decodes) for st_ in s) == 8


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), inp=st.integers(1, 300), out=st.integers(1, 12), c=st.integers(1, 6),
       budget=st.integers(1, 400))
def test_schedule_properties_on_random_workloads(n, inp, out, c, budget):
    w = ss.Workload("h", n, inp, out, c, "bf16", token_budget=budget, table_tokens=1024)
    sched = ss.schedule(w)
    check_schedule(w, sched)
    slots = ss.assign_slots(sched, c)
    check_slots(sched, slots, c)


def check_slots(sched: ss.Schedule, slots, C: int):
    first = {r: min(s for s, st_ in enumerate(sched.steps) if r in [x.req for x in st_.prefills])
             for r in range(len(slots))}
    for r in range(len(slots)):
        assert 0 <= slots[r] < C
        for q in range(r):
            overlap = first[r] <= sched.finish[q] and first[q] <= sched.finish[r]
            assert not (overlap and slots[r] == slots[q]), f"requests {q} and {r} share slot {slots[r]}"


def test_slots_of_the_long_workload():
    sched = ss.schedule(ss.WORKLOADS["long-fp8"])
    slots = ss.assign_slots(sched, 8)
    check_slots(sched, slots, 8)
    assert slots[:8] == tuple(range(8)) and slots[8] == slots[0]  # request 8 takes request 0's pages


# ----------------------------------------------------------------------------------------------
# latencies from step times
# ----------------------------------------------------------------------------------------------


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert ss.percentile(xs, 50) == 3.0
    assert ss.percentile(xs, 0) == 1.0 and ss.percentile(xs, 100) == 5.0
    assert ss.percentile(xs, 99) == pytest.approx(4.96)
    assert ss.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        ss.percentile([], 50)
    assert ss.summary([1.0, 2.0, 6.0]) == dict(mean=3.0, median=2.0, p99=pytest.approx(5.92))


def test_ttft_and_tpot_by_hand():
    # 2 requests, prompt 4 tokens, 3 output tokens, concurrency 1, budget 4: steps
    # 0 prefill r0 (first token), 1-2 decode r0 (finish at 2), 3 prefill r1, 4-5 decode r1
    w = ss.Workload("t", 2, 4, 3, 1, "bf16", token_budget=4, table_tokens=64)
    sched = ss.schedule(w)
    assert [ss.Step(s.decodes, s.prefills, s.first_tokens, s.finished) for s in sched.steps] == list(sched.steps)
    assert sched.arrival == (0, 3) and sched.first_token == (0, 3) and sched.finish == (2, 5)
    times = [10.0, 1.0, 2.0, 20.0, 3.0, 5.0]
    lat = ss.request_latencies(sched, times, w.output_len)
    assert lat["ttft"] == [10.0, 20.0]
    assert lat["tpot"] == [1.5, 4.0]  # (1 + 2) / 2 and (3 + 5) / 2
    summ = ss.latency_summary(sched, times, w.output_len)
    assert summ["total"] == 41.0 and summ["ttft"]["mean"] == 15.0 and summ["tpot"]["median"] == 2.75
    with pytest.raises(ValueError, match="step times"):
        ss.request_latencies(sched, times[:-1], w.output_len)


def test_ttft_counts_the_wait_for_a_slot_or_budget():
    # concurrency 2, budget 5: r1 arrives at step 0 but its prompt waits behind r0's
    w = ss.Workload("t", 2, 8, 2, 2, "bf16", token_budget=5, table_tokens=64)
    sched = ss.schedule(w)
    lat = ss.request_latencies(sched, [1.0] * len(sched.steps), w.output_len)
    assert sched.arrival == (0, 0)
    assert lat["ttft"] == [sched.first_token[0] + 1.0, sched.first_token[1] + 1.0]
    one = ss.Workload("t", 1, 8, 1, 1, "bf16", token_budget=8, table_tokens=64)
    assert ss.latency_summary(ss.schedule(one), [2.0], 1)["tpot"] is None  # one output token: no TPOT


def test_decode_stride_times_ends_of_runs_and_interpolates_linearly():
    w = ss.Workload("t", 2, 4, 12, 2, "bf16", token_budget=8, table_tokens=64)
    sched = ss.schedule(w)
    timed = ss.timed_steps(sched, 4)
    assert all(timed[s] for s, x in enumerate(sched.steps) if not x.decode_only)
    runs = [list(r) for r in ss.decode_runs(sched)]
    assert sum(len(r) for r in runs) == sum(1 for x in sched.steps if x.decode_only)
    for r in runs:
        for a, b in zip(r, r[1:]):
            assert [c.req for c in sched.steps[a].decodes] == [c.req for c in sched.steps[b].decodes]
    # step 0 runs both prompts; steps 1-11 decode both requests: one run, timed at 1, 5, 9 and 11
    assert runs == [list(range(1, 12))] and len(sched.steps) == 12
    assert [s for s in runs[0] if timed[s]] == [1, 5, 9, 11]
    truth = [3.0 + 0.5 * s for s in range(len(sched.steps))]  # linear in the step index
    partial = [t if timed[s] else -1.0 for s, t in enumerate(truth)]
    assert ss.fill_untimed(partial, timed, sched) == pytest.approx(truth)
    partial[9] = 100.0  # a run's step times need not be linear: each gap uses its own two ends
    filled = ss.fill_untimed(partial, timed, sched)
    assert filled[6] == pytest.approx(partial[5] + (100.0 - partial[5]) / 4)
    assert filled[10] == pytest.approx((100.0 + partial[11]) / 2)
    with pytest.raises(ValueError, match="no timed step"):
        ss.fill_untimed(partial, [not x.decode_only for x in sched.steps], sched)
    assert ss.timed_steps(sched, 1) == [True] * len(sched.steps)
    with pytest.raises(ValueError):
        ss.timed_steps(sched, 0)


# ----------------------------------------------------------------------------------------------
# command line (the no-GPU refusal is tests/cpu/test_bench.py's, for every benchmark)
# ----------------------------------------------------------------------------------------------


def test_runnable_reports_what_it_skips(capsys):
    from cute_kernels.bench.harness import runnable
    from cute_kernels.bench.serve import PEER_LIBS

    run, png = runnable(["ours", "fi_xqa", "fa4"], PEER_LIBS, "x.png", available=lambda m: m == "flash_attn")
    assert run == ["ours", "fa4"] and png is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("peer fi_xqa skipped") and err[1].startswith("--png skipped")
    assert runnable(["ours"], PEER_LIBS, "x.png", available=lambda m: True) == (["ours"], "x.png")


def test_serve_flags():
    p, module = build_parser("serve")
    a = p.parse_args([])
    assert a.workloads == "long-fp8,long-bf16,short-fp8" and a.configs == "ours,ours_fp8q,ours_fp8x2,fi_xqa,fi_native,fa4"
    assert (a.quick, a.decode_stride, a.graph_reps, a.eager_reps, a.check, a.fi_prefill_query) == \
        (False, 1, 3, 1, True, None)  # --fi-prefill-query: not given (FlashInfer's query is then fp8)
    a = p.parse_args(["--quick", "--workloads", "short-bf16", "--configs", "ours,fa4", "--decode-stride", "8",
                      "--no-check", "--layers", "2", "--png", "x.png", "--fi-prefill-query", "bf16"])
    ws = module.select_workloads(a)
    assert [w.layers for w in ws] == [2] and ws[0].kv_dtype == "bf16" and ws[0].num_requests == 32
    assert (a.configs, a.decode_stride, a.check, a.png, a.fi_prefill_query) == ("ours,fa4", 8, False, "x.png", "bf16")
    with pytest.raises(ValueError, match="--workloads: 'nothing' is not one of long-fp8"):
        module.select_workloads(p.parse_args(["--workloads", "nothing"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--fi-prefill-query", "fp16"])


def test_every_configuration_is_known_and_its_library_in_the_bench_extra():
    from pathlib import Path

    import tomllib

    from cute_kernels.bench import serve

    extra = " ".join(tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
                     ["project"]["optional-dependencies"]["bench"])
    assert set(serve.CONFIGS) == set(serve.MAKERS)
    assert set(serve.MAKERS) - set(serve.PEER_LIBS) == {"ours", "ours_fp8q", "ours_fp8x2"}
    for peer in serve.PEER_LIBS.values():
        assert peer.distribution in extra, peer
    assert {serve.MAKERS[c].layout for c in serve.CONFIGS} == {"HND", "NHD"}
    # a configuration of one cache dtype names a workload dtype and why
    assert {c: kv for c, (kv, _) in serve.ONLY_ON.items()} == {"fa4": "bf16", "ours_fp8q": "fp8", "ours_fp8x2": "fp8"}
    assert set(serve.ONLY_ON) <= set(serve.CONFIGS)


def test_ours_fp8q_is_our_layer_with_the_fp8_prefill_query():
    """``ours_fp8q`` builds the layer ``ours`` builds, with ``prefill_query_dtype="fp8"``: the prefill
    rows of the FP8 workloads plan ``sm90.prefill_fp8q``, the decode rows the same plan as ``ours``."""
    from cute_kernels.bench import serve

    w = ss.Workload("cpu", 2, 40, 3, 2, "fp8", token_budget=24, layers=1, num_q_heads=4, num_kv_heads=2,
                    head_dim=64, page_size=16, table_tokens=64)
    sched = ss.schedule(w)
    rp = serve.Replay(w, sched, torch.Generator().manual_seed(0), device="cpu")
    ours, fp8q = serve.Ours(rp, None), serve.OursFp8q(rp, None)
    assert (ours.layer_.prefill_query_dtype, fp8q.layer_.prefill_query_dtype) == ("auto", "fp8_e4m3")
    assert fp8q.layer_.q_scale == ours.layer_.q_scale == rp.q_scale > 0
    mixed = next(s for s in sched.steps if s.decodes and s.prefills)
    st = rp.step_inputs(mixed)
    ours.prepare(st)
    fp8q.prepare(st)
    assert sorted(ours.plans) == [("decode", "sm90.decode"), ("prefill", "sm90.prefill")]
    assert sorted(fp8q.plans) == [("decode", "sm90.decode"), ("prefill", "sm90.prefill_fp8q")]
    assert fp8q.plans[("prefill", "sm90.prefill_fp8q")].quantize_query
    bf16 = serve.Replay(ss.Workload(**{**w.__dict__, "kv_dtype": "bf16"}), sched, torch.Generator(), device="cpu")
    with pytest.raises(UnsupportedConfig, match="needs an FP8 KV cache"):
        serve.OursFp8q(bf16, None)


def test_ours_fp8x2_plans_the_two_term_prefill():
    """``ours_fp8x2``: the same layer with ``prefill_query_dtype="fp8x2"``; its prefill rows plan
    ``sm90.prefill_fp8x2``, its decode rows the plan ``ours`` has."""
    from cute_kernels.bench import serve

    w = ss.Workload("cpu", 2, 40, 3, 2, "fp8", token_budget=24, layers=1, num_q_heads=4, num_kv_heads=2,
                    head_dim=64, page_size=16, table_tokens=64)
    sched = ss.schedule(w)
    rp = serve.Replay(w, sched, torch.Generator().manual_seed(0), device="cpu")
    x2 = serve.OursFp8x2(rp, None)
    x2.prepare(rp.step_inputs(next(s for s in sched.steps if s.decodes and s.prefills)))
    assert sorted(x2.plans) == [("decode", "sm90.decode"), ("prefill", "sm90.prefill_fp8x2")]
    bf16 = serve.Replay(ss.Workload(**{**w.__dict__, "kv_dtype": "bf16"}), sched, torch.Generator(), device="cpu")
    with pytest.raises(UnsupportedConfig):
        serve.OursFp8x2(bf16, None)


def test_run_skips_a_configuration_on_the_other_cache_dtype(monkeypatch, capsys):
    """``run`` reports ``ours_fp8q`` on a BF16 workload and ``fa4`` on an FP8 one as skipped rows
    (the error says why), without building them; the other configurations replay."""
    from cute_kernels.bench import serve

    replayed = []
    monkeypatch.setattr(serve, "bench_setup", lambda: (1.0, None))
    monkeypatch.setattr(serve, "Replay", lambda w, sched, g: type("R", (), {"release": lambda self: None})())
    monkeypatch.setattr(serve, "replay_config", lambda name, rp, args, ranges: replayed.append(name) or dict(
        error="stub"))
    monkeypatch.setattr(serve.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(serve.torch.cuda, "get_device_name", lambda: "cpu")
    args = build_parser("serve")[0].parse_args(["--workloads", "short-fp8,short-bf16"])
    result = serve.run(serve.select_workloads(args), ["ours", "ours_fp8q", "fa4"], args)
    fp8, bf16 = (e["configs"] for e in result["workloads"])
    assert replayed == ["ours", "ours_fp8q", "ours", "fa4"]
    assert fp8["fa4"] == dict(error="FA4 has no FP8 KV cache on SM90")
    assert bf16["ours_fp8q"] == dict(error="an FP8 prefill query needs an FP8 KV cache")
    out = capsys.readouterr().out
    assert "ours_fp8q skipped on" in out and "it runs on the FP8 workloads only" in out
    assert "fa4 skipped on" in out and "it runs on the BF16 workloads only" in out


# ----------------------------------------------------------------------------------------------
# the replayed steps, end to end on the CPU (the layer's ops run the reference there)
# ----------------------------------------------------------------------------------------------


def _dense_attention(q, keys, values, sm_scale):
    """float64 softmax(q k^T) v of one query row over one KV head's dense history."""
    s = (q.double() @ keys.double().T) * sm_scale
    return torch.softmax(s, dim=-1) @ values.double()


@pytest.mark.parametrize("kv, config", [("bf16", "ours"), ("fp8", "ours"), ("fp8", "ours_fp8q")])
def test_replayed_steps_attend_to_each_requests_own_history(kv, config):
    """Every step of a small workload through ``ours`` (write + attention) matches attention over a
    dense K/V history kept independently per request: the slots, block tables, slot mapping, query
    offsets, the decode-first order and the reuse of a finished request's pages are right. With
    ``ours_fp8q`` the prefill rows attend with the query as quantized with q_scale, the decode rows
    with the bf16 query."""
    from cute_kernels.bench import serve

    w = ss.Workload("cpu", 3, 37, 4, 2, kv, token_budget=24, layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                    page_size=16, table_tokens=96)
    sched = ss.schedule(w)
    assert any(not s.decode_only and s.decodes for s in sched.steps)  # mixed steps are covered
    assert ss.assign_slots(sched, 2)[2] in (0, 1)  # request 2 reuses a finished request's pages
    seed = 1234
    print(f"seed {seed}")
    rp = serve.Replay(w, sched, torch.Generator().manual_seed(seed), device="cpu")
    rp.allocate("HND")
    cfg = serve.MAKERS[config](rp, None)
    G = w.num_q_heads // w.num_kv_heads
    checked = set()
    history = {}  # (layer, request) -> list of (k, v) rows [Hkv, D] as the cache holds them
    scale = {"k": rp.k_scale, "v": rp.v_scale}

    def stored(x, which):  # what the cache returns for x: x / scale rounded to the cache dtype, times scale
        return (x.float() / scale[which]).to(rp.kv_dtype).double() * scale[which]

    def query(st, row):  # what the layer's kernels multiply K with: the prefill rows' FP8 query, dequantized
        if config == "ours" or row < st.nd:
            return st.q[row]
        return reference.quantize_query(st.q[row:row + 1], rp.q_scale)[0].double() * rp.q_scale

    for s, step in enumerate(sched.steps):
        st = rp.step_inputs(step)
        cfg.prepare(st)
        assert st.T == step.num_tokens and st.nd == len(step.decodes)
        for layer in range(w.layers):
            out = cfg.layer(layer, st).double()
            row = 0
            for c in step.chunks:
                hist = history.setdefault((layer, c.req), [])
                assert len(hist) == c.start, (s, c)
                for j in range(c.length):
                    hist.append((stored(st.k[row + j], "k"), stored(st.v[row + j], "v")))
                keys = torch.stack([h[0] for h in hist])  # [L, Hkv, D]
                vals = torch.stack([h[1] for h in hist])
                for j in range(c.length):
                    visible = c.start + j + 1  # causal within the chunk
                    for h in range(w.num_q_heads):
                        want = _dense_attention(query(st, row + j)[h], keys[:visible, h // G],
                                                vals[:visible, h // G], rp.sm_scale)
                        got = out[row + j, h]
                        assert torch.isfinite(got).all()
                        err = ((got - want).norm() / want.norm()).item()
                        assert err < 2e-2, f"seed {seed} step {s} layer {layer} request {c.req} row {j} head {h}: {err}"
                row += c.length
        if serve.step_kind(step) == "mixed" and "mixed" not in checked:  # the benchmark's own check
            checked.add("mixed")
            errs = serve.check_step(cfg, rp, st)  # against the bf16-query reference
            assert set(errs) == {"decode_err", "prefill_err"} and errs["decode_err"] < 1e-6, errs
            if config == "ours":
                assert errs["prefill_err"] < 1e-6, errs
            else:  # the FP8 query's own error, and only that
                assert 1e-4 < errs["prefill_err"] < 6e-2, errs
        for r in step.finished:
            for layer in range(w.layers):
                history.pop((layer, r))
    assert checked == {"mixed"}


def test_report_table(capsys):
    from cute_kernels.bench import serve

    w = ss.Workload("t", 2, 4, 3, 1, "bf16", token_budget=4, table_tokens=64, layers=2)
    sched = ss.schedule(w)
    info = serve.describe(w, sched)
    assert info["steps"] == 6 and info["decode_only_steps"] == 4
    assert info["step_decodes"] == [0, 1, 1, 0, 1, 1] and info["step_prefill_tokens"] == [4, 0, 0, 4, 0, 0]
    times = [1e-3 * (i + 1) for i in range(6)]
    ok = dict(step_s=times, timed=[True] * 6, how=["eager", "graph", "graph", "eager", "graph", "graph"],
              summary=ss.latency_summary(sched, times, w.output_len), decode_decode_err=1e-3)
    results = [dict(workload=info, configs={"ours": ok, "fa4": dict(error="FA4 has no FP8 KV cache on SM90")})]
    serve.print_table(results)
    serve._print_config("ours", ok)
    out = capsys.readouterr().out
    assert "TTFT ms mean/med/p99" in out and "FA4 has no FP8" in out
    assert "1.00/1.00/1.00" not in out and f"{ok['summary']['total']:8.3f}" in out
    assert "decode_decode_err=1.0e-03" in out


def test_plot_of_per_step_times(tmp_path):
    pytest.importorskip("matplotlib")  # the bench extra's; absent from a bare CPU environment
    from cute_kernels.bench import serve

    w = ss.Workload("t", 2, 4, 3, 1, "bf16", token_budget=4, table_tokens=64, layers=2)
    sched = ss.schedule(w)
    results = [dict(workload=serve.describe(w, sched),
                    configs={"ours": dict(step_s=[1e-3] * 6), "fa4": dict(error="x")})]
    path = tmp_path / "steps.png"
    serve.plot(results, str(path))
    assert path.stat().st_size > 1000
