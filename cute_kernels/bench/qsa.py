"""``cute-kernels bench qsa``: QSA sparse attention (SM90) against the gathered-bytes roofline.

Shapes: Hq 24, Hkv 2, D 256, page 1568, TOPK 2051, production cache layout (the transposed
halves of one ``[blocks, Hkv, PAGE, 2 D]`` buffer), randomly permuted block tables.

- **decode**: N in {1, 4, 16, 64, 256} rows, one request each, at context 32768: each row selects
  512 distinct random 4-token blocks of its 8191 complete ones plus its open tail group (query
  position 32766, valid_count 2051 = TOPK). Small N would otherwise be timed from a warm L2, so
  the timed CUDA graph rotates over enough independent copies (own requests, pages, rows) that
  the bytes touched per rotation exceed 256 MB.
- **prefill**: 1 x {1024, 4096, 16384} tokens of one request from position 0: row p has
  valid_count ``min(p + 1, 2048 + (p + 1) % 4)``: dense causal up to 2051 (in random block
  order), then 512 of the visible blocks plus the tail. The request's whole cache
  (<= 32 MB BF16) fits in L2, as it does in serving. ``--selection`` picks how the 512 blocks are
  chosen (:mod:`cute_kernels.bench.qsa_selection`): ``correlated`` (default, first) models a real
  indexer, with neighbouring rows sharing most blocks (adjacent-row Jaccard ~0.90, as vllm RFC
  #55394 measured on real dumps); ``independent`` draws each row on its own (the worst case for
  a kernel that gathers the union of several rows). Each prefill line also reports the
  selection's adjacent-row Jaccard and the union factor of R-row tiles (R = 4, 5, 8: union
  size / mean row set; 1 = all shared, R = none), over the rows with 512 complete blocks.
  Decode rows are one request each, so decode always uses ``independent``.

Reported per shape and cache dtype: µs (median CUDA-graph replay), the roofline share =
bytes of the selected K/V rows / (read bandwidth measured in this process) / time, TFLOP/s for
prefill (4 * valid entries * Hq * D), the split count used, the selection model, and with
``--check`` the error against the reference. ``--splits 1,2,4`` sweeps forced split counts and
``--tile 128`` forces the tile (table tuning), ``--tile-rows 1,5`` the prefill rows per CTA (1 = the
per-row kernel). ``--json PATH``.

Diagnostics of the per-row decode kernel (docs/design/qsa.md#where-the-decode-time-goes):
``--decode-counts 64,1024,2051`` caps every row's valid_count (time against tiles per row: the
slope is the per-tile cost, the intercept the fixed cost of a launch); ``--decode-shared`` makes
every row select the same tokens of one request, so the gather hits L2 and the time is the
kernel's own (the roofline column is then not a bound); ``--no-gate`` calls without the output
gate.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops.qsa_sparse_attention import check_tuning_override, tuning_override
from cute_kernels.plans.sm90_qsa import MAX_SPLITS, TILES, select_config
from cute_kernels.plans.sm90_qsa_tile import Sm90QsaTileConfig, row_tile_plan
from cute_kernels.plans.sm90_qsa_widen import use_widened_cache

from .harness import SM90, NvtxRanges, check_unused, choice_list, int_list, parse_variants, write_json
from .qsa_selection import SELECTIONS, TOPK, qsa_indices, selection_stats
from .timing import read_bandwidth, time_eager, time_graph, time_graph_fresh

NEEDS = SM90

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
HQ, HKV, D, PAGE = 24, 2, 256, 1568
DECODE_N = (1, 4, 16, 64, 256)
DECODE_CTX = 32768
PREFILL_T = (1024, 4096, 16384)
PREFILL_SELECTIONS = ("correlated", "independent")
KINDS = ("decode", "prefill")
KV_DTYPES = ("bf16", "fp8")
STATS_TILES = (4, 5, 8)  # tile rows R of the reported union factors
ROTATE_BYTES = 256 << 20


class Problem:
    """One benchmark problem: ``copies`` independent instances over one cache pool."""

    def __init__(self, *, rows_per_copy: int, positions: torch.Tensor, reqs_per_copy: int, ctx: int, kv_dtype,
                 copies: int, seed: int, selection: str = "independent", same_rows: bool = False,
                 max_count: int | None = None, use_gate: bool = True, nvtx: bool = False):
        self.call = NvtxRanges(nvtx).wrap("cute_kernels.qsa_sparse_attention", self._call)
        g = torch.Generator(device="cuda").manual_seed(seed)
        pages = math.ceil(ctx / PAGE)
        n_req = reqs_per_copy * copies
        NB = n_req * pages + 3
        raw = torch.randn(NB, HKV, PAGE, 2 * D, device="cuda", generator=g)
        raw = (raw * 64).clamp(-448, 448).to(FP8) if kv_dtype == FP8 else raw.to(kv_dtype)
        kv = raw.transpose(1, 2)
        self.k_cache, self.v_cache = kv[..., :D], kv[..., D:]
        perm = torch.randperm(NB, device="cuda", generator=g)[: n_req * pages]
        self.block_table = perm.view(n_req, pages).int().contiguous()
        self.kv_dtype = kv_dtype
        # FP8 codes are randn * 64: these scales make the dequantized K/V O(1) like calibrated
        # serving scales (with 0.5 / 2.0 the values reach ~900 and --check's max-abs error only
        # measures bf16 rounding of values in the hundreds)
        self.k_scale, self.v_scale = (0.5 / 64, 2.0 / 64) if kv_dtype == FP8 else (1.0, 1.0)
        self.copies = []
        for c in range(copies):
            q = torch.randn(rows_per_copy, HQ, D, device="cuda", generator=g).to(BF16)
            gate = torch.randn(rows_per_copy, HQ, D, device="cuda", generator=g).to(BF16)
            req = (torch.arange(rows_per_copy, device="cuda") * reqs_per_copy // rows_per_copy + c * reqs_per_copy)
            packed = qsa_indices(positions, selection=selection, generator=g)
            if same_rows:  # every row selects row 0's tokens (of one request): an L2-resident gather
                packed = packed[:1].expand_as(packed).contiguous()
            if max_count is not None:  # only the first max_count columns are visited
                packed[:, TOPK] = packed[:, TOPK].clamp(max=max_count)
            self.copies.append(dict(q=q, output_gate=gate if use_gate else None, packed_indices=packed,
                                    token_to_req=req.int(),
                                    out=torch.empty_like(q)))
        counts = self.copies[0]["packed_indices"][:, TOPK].long()
        self.entries = int(counts.sum())
        self.selected_bytes = self.entries * HKV * 2 * D * raw.element_size()  # K and V rows per copy

    def _call(self, c, prefill):
        x = self.copies[c]
        return cute_kernels.qsa_sparse_attention(
            x["q"], self.k_cache, self.v_cache, x["packed_indices"], self.block_table, x["token_to_req"],
            prefill=prefill, k_scale=self.k_scale, v_scale=self.v_scale, out=x["out"], output_gate=x["output_gate"])

    def check(self, prefill) -> float:
        x = self.copies[0]
        self.call(0, prefill)
        ref = reference.qsa_sparse_attention(
            x["q"], self.k_cache, self.v_cache, x["packed_indices"], self.block_table, x["token_to_req"],
            k_scale=self.k_scale, v_scale=self.v_scale, output_gate=x["output_gate"])
        diff = (x["out"].float() - ref.float()).abs().max().item()
        return diff


def problem_geometry(kind: str, n: int, shared: bool = False) -> dict:
    """The rows, query positions, requests and context of a ``kind`` ("decode": n rows, one request
    each unless ``shared``, at DECODE_CTX; "prefill": 1 x n tokens from position 0) problem."""
    if kind == "prefill":
        return dict(rows_per_copy=n, positions=torch.arange(n, device="cuda"), reqs_per_copy=1, ctx=n)
    return dict(rows_per_copy=n, positions=torch.full((n,), DECODE_CTX - 2, device="cuda"),
                reqs_per_copy=1 if shared else n, ctx=DECODE_CTX)


def _time(problem: Problem, prefill: bool, first: bool = False) -> tuple[float, float | None]:
    """(graph-replay seconds per call, the discarded first timing or None); ``first``: the
    problem's first timing, run twice (``timing.time_graph_fresh``)."""
    state = {"i": 0}

    def fn():
        problem.call(state["i"] % len(problem.copies), prefill)
        state["i"] += 1

    reps = max(20, len(problem.copies))
    return time_graph_fresh(fn, reps=reps) if first else (time_graph(fn, reps=reps), None)


def _selection_fields(packed: torch.Tensor) -> dict:
    """The JSON fields describing a prefill problem's selection (None where no row is sparse)."""
    stats = {t: selection_stats(packed, t) for t in STATS_TILES}
    jac = stats[STATS_TILES[0]][0]
    return dict(adjacent_jaccard=None if math.isnan(jac) else round(jac, 4),
                union_factor={str(t): None if math.isnan(u) else round(u, 4) for t, (_, u) in stats.items()})


def run(kinds=("decode", "prefill"), kv_dtypes=("bf16", "fp8"), decode_n=DECODE_N, prefill_t=PREFILL_T,
        splits=None, tile=None, check=False, out_json=None, selections=PREFILL_SELECTIONS, tile_rows=None,
        tunings=None, decode_shared=False, decode_counts=(None,), gate=True, nvtx=False):
    for sel in selections:
        if sel not in SELECTIONS:
            raise ValueError(f"unknown selection {sel!r}; choose from {SELECTIONS}")
    bw = read_bandwidth()
    print(f"read bandwidth: {bw / 1e12:.3f} TB/s", flush=True)
    rows_out = []
    for kvn in kv_dtypes:
        kv = FP8 if kvn == "fp8" else BF16
        shapes = []
        if "decode" in kinds:  # one request per row: no neighbouring rows to correlate
            shapes += [("decode", n, "shared-l2" if decode_shared else "independent", cnt)
                       for n in decode_n for cnt in decode_counts]
        if "prefill" in kinds:
            shapes += [("prefill", t, sel, None) for t in prefill_t for sel in selections]
        for kind, n, sel, cnt in shapes:
            prefill = kind == "prefill"
            geometry = problem_geometry(kind, n, shared=decode_shared)
            positions, ctx, reqs, rows = (geometry[k] for k in ("positions", "ctx", "reqs_per_copy", "rows_per_copy"))
            gen_sel = "independent" if sel == "shared-l2" else sel
            probe = Problem(rows_per_copy=rows, positions=positions, reqs_per_copy=reqs, ctx=ctx, kv_dtype=kv,
                            copies=1, seed=n, selection=gen_sel, same_rows=decode_shared and not prefill,
                            max_count=cnt, use_gate=gate, nvtx=nvtx)
            # rotation sized by the uncapped selection (every decode row selects TOPK tokens): capped
            # counts touch fewer bytes, but the pool (copies x rows x ctx) must fit the GPU's memory
            full_bytes = probe.selected_bytes if cnt is None else rows * TOPK * HKV * 2 * D * kv.itemsize
            copies = 1 if prefill or decode_shared else max(1, min(16, math.ceil(ROTATE_BYTES / full_bytes)))
            prob = probe if copies == 1 else Problem(rows_per_copy=rows, positions=positions, reqs_per_copy=reqs,
                                                      ctx=ctx, kv_dtype=kv, copies=copies, seed=n,
                                                      selection=gen_sel, max_count=cnt, use_gate=gate, nvtx=nvtx)
            del probe
            sel_fields = _selection_fields(prob.copies[0]["packed_indices"]) if prefill else {}
            kv_name = "fp8_e4m3" if kv == FP8 else "bf16"
            _, table_splits = select_config(rows, HKV, prefill, kv_name, D, HQ // HKV, TOPK)
            variants = [(s, tr, tu) for s in (splits or [None]) for tr in ((tile_rows or [None]) if prefill else [None])
                        for tu in (tunings or [{}])]
            for vi, (s, tr, tu) in enumerate(variants):
                override = ({} if s is None else {"splits": s}) | ({} if tile is None else {"tile": tile})
                override |= ({} if tr is None else {"tile_rows": tr}) | tu
                plan = row_tile_plan(rows, prefill, kv_name, HQ // HKV, PAGE, prob.block_table.shape[1], TOPK, tr)
                # FP8 row tiles on the widened 16-bit copy (the op's choice, or forced by widen=0|1)
                widened = plan is not None and use_widened_cache(kv_name, rows, *prob.block_table.shape, PAGE, HKV,
                                                                 D, override.get("widen"))
                with tuning_override(**override):
                    r = dict(kind=kind, n=n, kv=kvn, selection=sel, **sel_fields, max_count=cnt, gate=gate,
                             splits=1 if plan else (s or table_splits), tile=tile or 64,
                             rows_per_cta=plan.rows_per_cta if plan else 1, tuning=tu, copies=copies,
                             selected_bytes=prob.selected_bytes, entries=prob.entries, widened=widened)
                    try:
                        prob.call(0, prefill)
                        torch.cuda.synchronize()
                        t, t_first = _time(prob, prefill, first=vi == 0)
                        r["us"] = t * 1e6
                        if t_first is not None:
                            r["first_timing_us"] = t_first * 1e6  # discarded (see time_graph_fresh)
                        r["roofline_pct"] = 100 * prob.selected_bytes / bw / t
                        r["eager_us"] = time_eager(lambda: prob.call(0, prefill), reps=20) * 1e6  # noqa: B023
                        if prefill:
                            r["tflops"] = 4 * prob.entries * HQ * D / t / 1e12
                        if check:
                            r["max_abs_err"] = prob.check(prefill)
                    except Exception as e:  # report and go on
                        r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    rows_out.append(r)
                    _print(r)
            prob = None  # free the pool before the next shape
            torch.cuda.empty_cache()
    result = dict(read_bw=bw, rows=rows_out)
    write_json(out_json, result)
    return result


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print(r):
    cap = (f" cnt<={r['max_count']}" if r.get("max_count") is not None else "") + ("" if r.get("gate", True) else " nogate")
    head = (f"{r['kind']:<8} {r['kv']:<5} N={r['n']:<6}{cap} {r['selection']:<11} S={r['splits']:<3} "
            f"tile={r['tile']:<4} R={r['rows_per_cta']}{''.join(f' {k}={v}' for k, v in r['tuning'].items())}"
            f"{' widened' if r.get('widened') else ''}")
    if "union_factor" in r:  # prefill: the selection's adjacent Jaccard and tile union factors
        unions = "/".join(_fmt(u) for u in r["union_factor"].values())
        head += f" [J={_fmt(r['adjacent_jaccard'])} U{'/'.join(r['union_factor'])}={unions}]"
    if "error" in r:
        print(f"{head} ERROR {r['error']}", flush=True)
        return
    extra = f" {r['tflops']:6.1f} TFLOP/s" if "tflops" in r else ""
    err = f" err={r['max_abs_err']:.1e}" if "max_abs_err" in r else ""
    print(f"{head} {r['us']:9.1f} us  {r['roofline_pct']:6.1f} % roofline{extra}  eager {r['eager_us']:8.1f} us "
          f"({r['selected_bytes'] / 1e6:.1f} MB selected, {r['copies']} copies){err}", flush=True)


def add_arguments(p) -> None:
    p.add_argument("--kinds", default=",".join(KINDS), help="decode, prefill or both (default: %(default)s)")
    p.add_argument("--kv", default=",".join(KV_DTYPES), help="KV-cache dtypes (default: %(default)s)")
    p.add_argument("--decode-n", default=",".join(map(str, DECODE_N)), help="decode rows (default: %(default)s)")
    p.add_argument("--prefill-t", default=",".join(map(str, PREFILL_T)),
                   help="prefill tokens of one request (default: %(default)s)")
    p.add_argument("--selection", default=None,  # None: not given (refused without the prefill kind)
                   help=f"comma list of prefill selection models from {', '.join(SELECTIONS)} "
                        f"(default: {','.join(PREFILL_SELECTIONS)}; decode always uses independent)")
    p.add_argument("--splits", default=None, help="comma list of forced split counts (default: the table's)")
    p.add_argument("--tile", type=int, default=None, help=f"force the KV tile ({' or '.join(map(str, TILES))})")
    p.add_argument("--tile-rows", default=None,
                   help="comma list of forced prefill rows per CTA (1 = the per-row kernel; default: the op's)")
    p.add_argument("--tuning", default=None,
                   help="';'-separated kernel tuning variants, each 'field=value,...' (e.g. 'producers=1;producers=2'; "
                        "a flag field takes 0 or 1)")
    p.add_argument("--decode-shared", action="store_true",
                   help="decode rows all select the same tokens of one request (an L2-resident gather: the "
                        "kernel's own per-tile time; the roofline column is then not a bound)")
    p.add_argument("--decode-counts", default=None,
                   help="comma list of valid_count caps for decode rows (time vs tiles: per-tile and fixed costs)")
    p.add_argument("--no-gate", action="store_true", help="call without output_gate (default: gated, as QSA layers)")
    p.add_argument("--check", action="store_true", help="also compare each output with the reference")


# the kernels' flag fields, given as 0 or 1 on the command line
_FLAGS = {f.name for f in dataclasses.fields(Sm90QsaTileConfig) if str(f.type) == "bool"}


def check_arguments(a) -> dict:
    """The keyword arguments of :func:`run` from the command line, each value checked (a typo in
    a name, a count below 1, a tile or split count the kernel does not take, a malformed
    ``--tuning``): ``ValueError`` naming the flag, before the GPU check."""
    ints = {flag: int_list(flag, text) if text else None for flag, text in (
        ("--decode-n", a.decode_n), ("--prefill-t", a.prefill_t), ("--splits", a.splits),
        ("--tile-rows", a.tile_rows), ("--decode-counts", a.decode_counts))}
    if ints["--splits"] and max(ints["--splits"]) > MAX_SPLITS:
        raise ValueError(f"--splits: at most {MAX_SPLITS}, got {max(ints['--splits'])}")
    if a.tile is not None and a.tile not in TILES:
        raise ValueError(f"--tile: must be one of {', '.join(map(str, TILES))}, got {a.tile}")
    kinds = choice_list("--kinds", a.kinds, KINDS)
    check_unused("without the decode kind", {"--decode-counts": "decode" not in kinds and a.decode_counts is not None,
                                             "--decode-shared": "decode" not in kinds and a.decode_shared})
    check_unused("without the prefill kind", {"--tile-rows": "prefill" not in kinds and a.tile_rows is not None,
                                              "--selection": "prefill" not in kinds and a.selection is not None})
    try:
        tunings = parse_variants(a.tuning) if a.tuning else None
        for tu in tunings or ():  # the op's own check: a typo would otherwise fail each row after its timing
            tu.update({k: bool(v) for k, v in tu.items() if k in _FLAGS and v in (0, 1)})
            check_tuning_override(tu)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--tuning: {str(e).removeprefix('tuning_override: ')}") from None
    return dict(kinds=kinds, kv_dtypes=choice_list("--kv", a.kv, KV_DTYPES),
                decode_n=ints["--decode-n"] or (), prefill_t=ints["--prefill-t"] or (), splits=ints["--splits"],
                tile=a.tile, check=a.check, out_json=a.json, selections=choice_list("--selection", a.selection or ",".join(PREFILL_SELECTIONS), SELECTIONS),
                tile_rows=ints["--tile-rows"], tunings=tunings, decode_shared=a.decode_shared,
                decode_counts=ints["--decode-counts"] or (None,), gate=not a.no_gate, nvtx=a.nvtx)


def main(a) -> None:
    run(**check_arguments(a))
