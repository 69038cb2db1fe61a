"""``cute-kernels bench decode --api trtllm`` and ``bench prefill --api trtllm``: the
``cute_kernels.trtllm`` API next to FlashInfer's own ``trtllm_batch_decode_with_kv_cache`` (XQA on
SM90, trtllm-gen on SM100) and ``trtllm_batch_context_with_kv_cache`` (trtllm-gen: SM100 only,
skipped on SM90 with its reason) on the same inputs.

Rows: Llama-shaped decode (B 64, Hq 32 / Hkv 8, D 128, ctx 32768) with the full context, with
sinks, with a 4096-token window (``window_left = 4095``) and both; a gpt-oss-shaped decode (Hq 64
/ Hkv 8, D 64, window 128 and sinks); two shapes of the plain decode bench. Per row: ``api`` (our
trtllm call), ``op`` (``cute_kernels.paged_decode`` with the same arguments: the API's own cost is
their difference) and ``flashinfer``. Times are CUDA-graph replays; the roofline counts the keys a
row's queries see (a window reads at most ``window_left + q_len`` keys per request). The
requirement checked at the end: a 4096-token window runs at least 6x faster than the full 32768
context (it reads an eighth of the keys). Method: docs/design/benchmarks.md; API:
docs/design/trtllm.md.
"""

from __future__ import annotations

import torch

import cute_kernels
from cute_kernels import reference, trtllm
from cute_kernels.testing import make_paged_decode_case, make_paged_prefill_case, rel_err

from .harness import NvtxRanges, choice_list, module_available, select_named, write_json, write_partial
from .timing import bench_setup, host_overhead, time_graph

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
KV_DTYPES = ("fp8", "bf16")  # what --kv takes
PAGE = 16
WINDOW_SPEEDUP = 6.0  # a 4096-token window of a 32768 context: at least this much faster

# name, Hq, Hkv, D, B, ctx, q_len, window_left, sinks
DECODE_SHAPES = [
    ("llama3-8b B64 ctx32768", 32, 8, 128, 64, 32768, 1, -1, False),
    ("llama3-8b B64 ctx32768 sinks", 32, 8, 128, 64, 32768, 1, -1, True),
    ("llama3-8b B64 ctx32768 win4096", 32, 8, 128, 64, 32768, 1, 4095, False),
    ("llama3-8b B64 ctx32768 win4096 sinks", 32, 8, 128, 64, 32768, 1, 4095, True),
    ("gpt-oss h64/8 d64 B32 ctx8192 win128 sinks", 64, 8, 64, 32, 8192, 1, 127, True),
    ("llama3-8b B64 ctx8192", 32, 8, 128, 64, 8192, 1, -1, False),
    ("qwen3-30b B8 ctx32000 win4096 sinks", 32, 4, 128, 8, 32000, 1, 4095, True),
]
SIDES = ("api", "op", "flashinfer")


def _visible_bytes(case, window_left: int) -> int:
    per_token = 2 * case.meta["num_kv_heads"] * case.meta["head_dim"] * case.meta["kv_bytes"]
    lens = case.seq_lens.tolist()
    keys = sum(L if window_left < 0 else min(L, window_left + case.q_len) for L in lens)
    return keys * per_token + 2 * case.q.numel() * case.q.element_size()


def _callers(case, window_left, sinks, ranges: NvtxRanges):
    """side -> (fn, out) for one problem: the same scales, window and sinks for every side."""
    bmm1 = case.meta["head_dim"] ** -0.5 * case.k_scale
    bmm2 = case.v_scale
    ctx = int(case.seq_lens.max())
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    fi_ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")  # FlashInfer's own, zeroed
    outs = {s: torch.empty_like(case.q) for s in SIDES}

    def api():
        return trtllm.batch_decode_with_kv_cache(case.q, case.kv_cache, ws, case.block_table, case.seq_lens, ctx,
                                                 bmm1_scale=bmm1, bmm2_scale=bmm2, window_left=window_left,
                                                 out=outs["api"], sinks=sinks, kv_layout=case.kv_layout,
                                                 q_len_per_req=case.q_len)

    def op():
        return cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=outs["op"],
                                         kv_layout=case.kv_layout, q_len_per_req=case.q_len, sm_scale=1.0,
                                         k_scale=bmm1, v_scale=bmm2, window_left=window_left, sinks=sinks)

    def flashinfer():
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache

        return trtllm_batch_decode_with_kv_cache(case.q, case.kv_cache, fi_ws, case.block_table, case.seq_lens, ctx,
                                                 bmm1_scale=bmm1, bmm2_scale=bmm2, window_left=window_left,
                                                 out=outs["flashinfer"], sinks=sinks, kv_layout=case.kv_layout,
                                                 q_len_per_req=case.q_len)

    return _sides(ranges, "paged_decode", (api, op, flashinfer), outs)


def _sides(ranges: NvtxRanges, op_name: str, fns, outs) -> dict:
    """side -> (the timed call in its NVTX range, its output)."""
    names = ("cute_kernels.trtllm", f"cute_kernels.{op_name}", "bench.flashinfer")
    return {side: (ranges.wrap(name, fn), outs[side]) for side, name, fn in zip(SIDES, names, fns)}


def _measure(row: dict, callers: dict, sides, ref, nbytes=None, bw=None) -> None:
    """Time every side (CUDA-graph replays), its error against ``ref`` and (``nbytes``) its % of the
    read roofline; a side that cannot run the problem is reported in the row, not fatal."""
    for side, (fn, out) in callers.items():
        if side not in sides:
            continue
        try:
            fn()
            torch.cuda.synchronize()
            t = time_graph(fn)
            row[side + "_us"] = t * 1e6
            if nbytes is not None:
                row[side + "_roof"] = 100 * nbytes / bw / t
            if ref is not None:
                row[side + "_err"] = rel_err(out.float(), ref.float())
        except Exception as e:
            row[side + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _kv_scales(kvn: str) -> dict:
    return dict(k_scale=0.0625, v_scale=0.03125) if kvn == "fp8" else dict(k_scale=1.0, v_scale=1.0)


def run_decode(kv_dtypes=("fp8", "bf16"), sides=SIDES, shapes=None, out_json=None, quick=False, nvtx=False):
    ranges = NvtxRanges(nvtx)
    bw, g = bench_setup()
    rows = []
    for kvn in kv_dtypes:
        kv_dtype = FP8 if kvn == "fp8" else BF16
        for name, Hq, Hkv, D, B, ctx, q_len, window, with_sinks in shapes or DECODE_SHAPES:
            case = make_paged_decode_case(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=PAGE,
                                          seq_lens=ctx, kv_dtype=kv_dtype, q_len=q_len, generator=g,
                                          poison_tail=False, **_kv_scales(kvn))
            sinks = torch.randn(Hq, device="cuda", generator=g) if with_sinks else None
            nbytes = _visible_bytes(case, window)
            row = dict(shape=name, kv=kvn, B=B, ctx=ctx, Hq=Hq, Hkv=Hkv, D=D, q_len=q_len, window_left=window,
                       sinks=with_sinks, bytes=nbytes)
            ref = None
            if not quick:
                ref = reference.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                             kv_layout=case.kv_layout, q_len_per_req=q_len,
                                             sm_scale=D ** -0.5 * case.k_scale, v_scale=case.v_scale,
                                             window_left=window, sinks=sinks)
            _measure(row, _callers(case, window, sinks, ranges), sides, ref, nbytes, bw)
            rows.append(row)
            write_partial(out_json, rows=rows)
            _print_row(row, sides)
            del case
            torch.cuda.empty_cache()
    checks = window_checks(rows)
    for line in checks:
        print(line)
    host = host_costs(g, sides)
    print("host time per eager call (B1, ctx 64): " + ", ".join(f"{s} {us:.1f} us" for s, us in host.items()))
    result = dict(read_bw=bw, rows=rows, checks=checks, host_us=host)
    write_json(out_json, result)
    return result


def host_costs(g, sides) -> dict:
    """Host microseconds per eager call of each side on a tiny problem (the API's own checks are
    the difference between ``api`` and ``op``)."""
    case = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=PAGE,
                                  seq_lens=64, generator=g, poison_tail=False)
    out = {}
    for side, (fn, _) in _callers(case, 127, torch.zeros(32, device="cuda"), NvtxRanges(False)).items():
        if side in sides:
            try:
                out[side] = host_overhead(fn) * 1e6
            except Exception as e:  # reported, not fatal
                print(f"host cost of {side}: {type(e).__name__}: {e}")
    return out


def window_checks(rows) -> list[str]:
    """For each KV dtype and sink setting: full 32768 context vs its 4096-token window (our API)."""
    lines = []
    for r in rows:
        if r["ctx"] != 32768 or r["window_left"] != 4095 or "api_us" not in r:
            continue
        full = next((f for f in rows if f["kv"] == r["kv"] and f["sinks"] == r["sinks"] and f["ctx"] == 32768
                     and f["window_left"] == -1 and f["B"] == r["B"] and "api_us" in f), None)
        if full is None:
            continue
        ratio = full["api_us"] / r["api_us"]
        verdict = "PASS" if ratio >= WINDOW_SPEEDUP else "FAIL"
        lines.append(f"window 4096 vs ctx 32768 ({r['kv']}, sinks {r['sinks']}): x{ratio:.2f} "
                     f"(need >= {WINDOW_SPEEDUP:g}) {verdict}")
    return lines


def _print_row(r, sides):
    def f(s):
        if s + "_us" in r:
            e, roof = r.get(s + "_err"), r.get(s + "_roof")
            return (f"{r[s + '_us']:9.1f}us" + (f" {roof:5.1f}%" if roof is not None else "")
                    + (f" e={e:.1e}" if e is not None else ""))
        return f"{'-':>9} ({r.get(s + '_error', 'n/a')[:60]})"

    print(f"{r['shape']:<44} {r['kv']:<4}", flush=True)
    for s in sides:
        print(f"{'':<6} {s:<10} {f(s)}", flush=True)


def check_arguments(args, shapes: list[tuple]) -> None:
    """``--kv`` and ``--shapes`` of ``--api trtllm`` (over its own ``shapes``), before the GPU check."""
    choice_list("--kv", args.kv, KV_DTYPES)
    select_named("--shapes", args.shapes, shapes)


def main_decode(args) -> None:
    sides = [s for s in SIDES if s != "flashinfer" or module_available("flashinfer")]
    if "flashinfer" not in sides:
        print("flashinfer skipped: flashinfer-python is not installed (pip install \"cute-kernels[bench]\")")
    run_decode(kv_dtypes=choice_list("--kv", args.kv, KV_DTYPES), sides=tuple(sides),
               shapes=select_named("--shapes", args.shapes, DECODE_SHAPES), out_json=args.json,
               quick=args.quick, nvtx=args.nvtx)


# ---------------------------------------------------------------------------------------------
# prefill (the context call)
# ---------------------------------------------------------------------------------------------

# name, B, cached prefix, new tokens per request, Hq, Hkv, D, window_left, sinks
PREFILL_SHAPES = [
    ("causal B1 S16384", 1, 0, 16384, 32, 8, 128, -1, False),
    ("causal B1 S16384 win4096 sinks", 1, 0, 16384, 32, 8, 128, 4095, True),
    ("chunked B4 q2048 ctx32768 win4096 sinks", 4, 32768 - 2048, 2048, 32, 8, 128, 4095, True),
    ("gpt-oss h64/8 d64 B4 S8192 win128 sinks", 4, 0, 8192, 64, 8, 64, 127, True),
]


def _context_callers(case, window_left, sinks, ranges: NvtxRanges):
    """side -> (fn, out) for one prefill problem (FlashInfer's context call: SM100 only)."""
    bmm1 = case.meta["head_dim"] ** -0.5 * case.k_scale
    bmm2 = case.v_scale
    B = case.block_table.shape[0]
    kv_starts = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    kv_starts[1:] = case.seq_lens.cumsum(0)
    max_q, max_kv = case.max_query_len, int(case.seq_lens.max())
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    outs = {s: torch.empty_like(case.q) for s in SIDES}

    def api():
        return trtllm.batch_context_with_kv_cache(case.q, case.kv_cache, ws, case.block_table, case.seq_lens, max_q,
                                                  max_kv, bmm1, bmm2, B, case.query_start_loc, kv_starts,
                                                  window_left=window_left, out=outs["api"], sinks=sinks,
                                                  kv_layout=case.kv_layout)

    def op():
        return cute_kernels.paged_prefill(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                          case.query_start_loc, max_query_len=max_q, kv_layout=case.kv_layout,
                                          sm_scale=1.0, k_scale=bmm1, v_scale=bmm2, out=outs["op"],
                                          window_left=window_left, sinks=sinks)

    def flashinfer():
        if torch.cuda.get_device_capability()[0] != 10:
            raise NotImplementedError("FlashInfer's trtllm context call runs trtllm-gen cubins: SM100/SM103 only")
        from flashinfer.prefill import trtllm_batch_context_with_kv_cache

        return trtllm_batch_context_with_kv_cache(case.q, case.kv_cache, ws, case.block_table, case.seq_lens, max_q,
                                                  max_kv, bmm1, bmm2, B, case.query_start_loc, kv_starts,
                                                  window_left=window_left, out=outs["flashinfer"], sinks=sinks,
                                                  kv_layout=case.kv_layout)

    return _sides(ranges, "paged_prefill", (api, op, flashinfer), outs)


def run_prefill(kv_dtypes=("bf16", "fp8"), sides=SIDES, shapes=None, out_json=None, quick=False, nvtx=False):
    ranges = NvtxRanges(nvtx)
    _, g = bench_setup()
    rows = []
    for kvn in kv_dtypes:
        kv_dtype = FP8 if kvn == "fp8" else BF16
        for name, B, prefix, n, Hq, Hkv, D, window, with_sinks in shapes or PREFILL_SHAPES:
            case = make_paged_prefill_case(reqs=[(prefix, n)] * B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                           page_size=PAGE, kv_dtype=kv_dtype, generator=g, poison_tail=False,
                                           **_kv_scales(kvn))
            sinks = torch.randn(Hq, device="cuda", generator=g) if with_sinks else None
            row = dict(shape=name, kv=kvn, B=B, prefix=prefix, q_len=n, Hq=Hq, Hkv=Hkv, D=D, window_left=window,
                       sinks=with_sinks)
            ref = None
            if not quick:
                ref = reference.paged_prefill(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                              case.query_start_loc, kv_layout=case.kv_layout,
                                              sm_scale=D ** -0.5 * case.k_scale, v_scale=case.v_scale,
                                              window_left=window, sinks=sinks)
            _measure(row, _context_callers(case, window, sinks, ranges), sides, ref)  # compute-bound: no roofline
            rows.append(row)
            write_partial(out_json, rows=rows)
            _print_row(row, sides)
            del case
            torch.cuda.empty_cache()
    result = dict(rows=rows)
    write_json(out_json, result)
    return result


def main_prefill(args) -> None:
    sides = [s for s in SIDES if s != "flashinfer" or module_available("flashinfer")]
    run_prefill(kv_dtypes=choice_list("--kv", args.kv, KV_DTYPES), sides=tuple(sides),
                shapes=select_named("--shapes", args.shapes, PREFILL_SHAPES), out_json=args.json,
                quick=args.quick, nvtx=args.nvtx)
