"""Sweep the SM90 paged prefill's tuning fields (``tile_n``, ``stages``, ``staging``, ``overlap``,
``pingpong``, and the opt-in ``persistent`` schedule and shared-memory ``epilogue`` once per group
at the default tiling: docs/design/sm90-prefill.md#scheduling,
docs/design/sm90-prefill.md#epilogue-through-shared-memory-opt-in-epiloguesmem) around the defaults of :func:`cute_kernels.plans.sm90_prefill.make_prefill_config`,
per kind (16-bit cache; FP8 cache with a 16-bit query, "widen"; FP8 query, "fp8") and head dim:
docs/design/sm90-prefill.md#budgets-defaults-of-make_prefill_config-gqa-8-page-16,
docs/design/sm90-prefill.md#measured--not-measured.

Every config of the sweep is compiled first, in parallel processes (the disk cache is shared);
each is then checked on a small varlen case against the float64 reference of
``tests/gpu/test_prefill_kernel_gpu.py`` (a config that fails is reported, not timed) and timed on
``--shapes`` with CUDA-graph replay medians (:mod:`cute_kernels.bench.timing`); its output on each
timed shape is also compared with the default config's. TFLOP/s count the causal work (as
``cute-kernels bench prefill``). Prints per (kind, D) a table sorted by speed, the default marked,
and writes ``--json`` after every (kind, D): the sweep's size, the compile's wall seconds, the shapes,
and per (kind, D) ``rows`` (tag, default, status, tuning fields, shared memory, compile seconds,
the check's error, per shape ``us`` / ``tflops`` / ``finite`` / ``diff_vs_default``, the default's
``first_us`` and ``again_us`` for drift, ``geomean_tflops``), ``best`` and ``default_over_best``.

    python -m profiling.tune_prefill [--kinds 16,widen,fp8] [--dims 64,128,256] [--shapes SUBSTR,...]
        [--wide] [--match TAG,...] [--json PATH]
    python -m profiling.tune_prefill --compile-only [--workers N] [--json PATH]   # no GPU: sm_90a
        compile, registers and spills (STL/LDL) of every config of the sweep
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import product
from multiprocessing import get_context
from typing import Any

import torch

from cute_kernels.bench.timing import time_graph, time_graph_fresh
from cute_kernels.plans.sm90_prefill import (
    CONSUMER_SCHEDULES,
    Sm90PrefillConfig,
    make_prefill_config,
    schedule_name,
    smem_bytes,
)

ARCH = "sm_90a"
KINDS = {"16": ("bf16", "bf16"), "widen": ("bf16", "fp8_e4m3"), "fp8": ("fp8_e4m3", "fp8_e4m3")}
DIMS = (64, 128, 256)
HQ, HKV, PAGE = 32, 8, 16
# name, requests, cached prefix, new tokens per request (Hq 32, Hkv 8, page 16)
SHAPES = [
    ("causal B1 S16384", 1, 0, 16384),
    ("chunked B8 q512 ctx16384", 8, 16384 - 512, 512),
    ("causal B1 S4096", 1, 0, 4096),
    ("causal B4 S8192", 4, 0, 8192),
    ("short B16 S512", 16, 0, 512),
]
DEFAULT_SHAPES = "causal B1 S16384,chunked B8"
TUNING = ("tile_n", "stages", "staging", "overlap", "pingpong", "producer_regs", "consumer_regs", "persistent",
          "epilogue")
# CUDA-graph medians: 5 replays of 10 calls each (a long prefill is milliseconds a call, and ~60
# configs x 2 shapes must fit one short run)
TIMING = dict(reps=10, rounds=5)
# tile_n tried besides the default, per head dim: a smaller and a larger tile; 176 at D 128 and 80
# at D 256 are FA3's KV tiles for those head dims (rounded up to the FP8 query's 32-token k step)
ALT_TILES = {64: (64, 192), 128: (64, 176), 256: (80, 128)}
# (kind, D, tile_n) whose sm_90a compile spills registers (STL/LDL in SASS; `--compile-only` on the
# CPU): the consumers' O + S + P accumulators outgrow their registers, or the widening producer's;
# left out of the default sweep, kept in `--wide`
SPILLS = {("16", 256, 128), ("widen", 128, 176), ("fp8", 256, 128)}


# ---------------------------------------------------------------------------------------------
# the sweep (host only)
# ---------------------------------------------------------------------------------------------


def problem_config(kind: str, head_dim: int, **override: Any) -> Sm90PrefillConfig:
    """The config of the timed problems (causal, HND single container, no LSE, page 16, GQA 4)
    with ``override`` replacing tuning fields; raises ``ValueError`` for an invalid combination."""
    q, kv = KINDS[kind]
    return make_prefill_config(q_dtype=q, kv_dtype=kv, head_dim=head_dim, group=HQ // HKV, page_size=PAGE,
                               write_lse=False, **override)


@dataclass
class Entry:
    """One point of the sweep: its tuning, the config it builds, or the reason the checks refuse it."""

    kind: str
    head_dim: int
    tuning: dict
    config: Sm90PrefillConfig | None = None
    refused: str | None = None
    default: bool = False
    result: dict = field(default_factory=dict)

    @property
    def tag(self) -> str:
        t = self.tuning
        staging = f" g{t['staging']}" if t.get("staging") else ""
        grid = " persistent" if t.get("persistent") else ""
        epi = " smem-epilogue" if t.get("epilogue") == "smem" else ""
        return f"n{t['tile_n']} s{t['stages']}{staging} {schedule_name(t['overlap'], t['pingpong'])}{grid}{epi}"


def _tuning_of(cfg: Sm90PrefillConfig) -> dict:
    return {k: getattr(cfg, k) for k in TUNING}


def _entry(kind: str, D: int, tuning: dict, default: bool = False) -> Entry:
    try:
        cfg = problem_config(kind, D, **tuning)
    except ValueError as e:
        return Entry(kind, D, dict(tuning), refused=str(e).removeprefix("sm90.prefill: "))
    return Entry(kind, D, _tuning_of(cfg), cfg, default=default)


def _fitting(kind: str, D: int, tuning: dict) -> dict:
    """``tuning`` with its stages (then its staging) lowered until shared memory holds it."""
    for stages in range(tuning["stages"], 0, -1):
        for staging in ((0,) if kind == "16" else range(tuning["staging"], 0, -1)):
            t = dict(tuning, stages=stages, staging=staging)
            if _entry(kind, D, t).config is not None:
                return t
    return tuning  # refused as asked


def group_sweep(kind: str, D: int, wide: bool = False) -> list[Entry]:
    """The sweep of one (kind, head dim), the default first, then the persistent schedule and the
    shared-memory epilogue at the default tiling. Default sweep: each consumer schedule at the
    default tiling, one stage more (fewer where more does not fit: the refusal is recorded), one
    FP8 staging buffer fewer (and more at D >= 128), and each :data:`ALT_TILES` tile with the deepest stages that
    fit (but the tiles that spill, :data:`SPILLS`). ``wide``: schedules x tiles x stages +-1 (x
    staging +-1), spilling tiles included."""
    d = _tuning_of(problem_config(kind, D))
    k_step = 32 if kind == "fp8" else 16
    tiles = [d["tile_n"]] + [-(-t // k_step) * k_step for t in ALT_TILES[D]]
    # the persistent schedule at the default tiling (a fixed grid of one CTA per SM, longest tiles first),
    # and the O tile written through shared memory in 16-byte chunks
    wanted: list[dict] = [d, dict(d, persistent=True), dict(d, epilogue="smem")]
    if wide:
        stagings = (0,) if kind == "16" else (d["staging"] - 1, d["staging"], d["staging"] + 1)
        for sched, tile, ds, staging in product(CONSUMER_SCHEDULES.values(), tiles, (-1, 0, 1), stagings):
            wanted.append(dict(d, **sched, tile_n=tile, stages=d["stages"] + ds, staging=staging))
    else:
        wanted += [dict(d, **sched) for sched in CONSUMER_SCHEDULES.values()]
        deeper = dict(d, stages=d["stages"] + 1)
        wanted += [deeper] if _entry(kind, D, deeper).config is not None else [deeper, dict(d, stages=d["stages"] - 1)]
        if kind != "16":
            # one staging buffer fewer; one more only at D >= 128 (at D 64 four consumer stages
            # already buffer the producer's rewrite)
            wanted += [dict(d, staging=d["staging"] + ds) for ds in ((-1, 1) if D >= 128 else (-1,))]
        wanted += [_fitting(kind, D, dict(d, tile_n=t)) for t in tiles[1:] if (kind, D, t) not in SPILLS]
    entries: list[Entry] = []
    seen: set = set()
    for i, t in enumerate(wanted):
        if t["stages"] < 1 or (kind != "16" and t["staging"] < 1):
            continue  # below the smallest pipeline: not a candidate
        e = _entry(kind, D, t, default=i == 0)
        key = e.config if e.config is not None else tuple(sorted(t.items()))
        if key not in seen:
            seen.add(key)
            entries.append(e)
    return entries


def sweep(kinds=tuple(KINDS), dims=DIMS, wide: bool = False, match: tuple[str, ...] = ()) -> list[Entry]:
    """Every (kind, D)'s :func:`group_sweep`; ``match``: only the entries whose tag contains one of
    these substrings (each group's default is always kept, as the reference)."""
    out = []
    for kind, D in product(kinds, dims):
        out += [e for e in group_sweep(kind, D, wide) if e.default or not match or any(m in e.tag for m in match)]
    return out


# ---------------------------------------------------------------------------------------------
# compiles (parallel processes, spawn: no CUDA context is forked)
# ---------------------------------------------------------------------------------------------


def _compile_cached(config):
    """Worker: compile into the shared disk cache; (seconds, error)."""
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    from cute_kernels.jit.compiler import get_kernel

    t0 = time.perf_counter()
    try:
        get_kernel(config, ARCH)
        return time.perf_counter() - t0, None
    except Exception as e:  # a config that does not compile is reported, not fatal
        return time.perf_counter() - t0, f"{type(e).__name__}: {str(e).strip()[:300]}"


def _compile_evidence(config):
    """Worker: compile with PTX/SASS (no cache); seconds, registers, spills, missing evidence."""
    from cute_kernels.jit.evidence import compile_with_evidence

    t0 = time.perf_counter()
    try:
        _, ev = compile_with_evidence(config, ARCH)
    except Exception as e:
        return dict(seconds=time.perf_counter() - t0, error=f"{type(e).__name__}: {str(e).strip()[:300]}")
    return dict(seconds=time.perf_counter() - t0, registers=ev.registers, spills="STL" in ev.sass or "LDL" in ev.sass,
                missing=ev.missing, sass=ev.sass)


def compile_all(entries: list[Entry], worker, workers: int | None) -> float:
    """Run ``worker`` on every entry's config in ``workers`` processes; results go to
    ``entry.result["compile"]``; returns the wall seconds."""
    todo = [e for e in entries if e.config is not None]
    workers = workers or max(1, min(len(todo), (os.cpu_count() or 2) - 1, 16))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        for i, (e, res) in enumerate(zip(todo, pool.map(worker, [e.config for e in todo])), 1):
            e.result["compile"] = res
            bad = res[1] if isinstance(res, tuple) else res.get("error") or ("SPILLS" if res.get("spills") else None)
            print(f"[{i}/{len(todo)}] {e.kind} D{e.head_dim} {e.tag}: "
                  f"{bad or 'ok'} ({(res[0] if isinstance(res, tuple) else res['seconds']):.1f} s)", flush=True)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# GPU: check, time, report
# ---------------------------------------------------------------------------------------------


def causal_flops(B: int, prefix: int, n: int, D: int) -> float:
    """QK and PV of the attended (row, KV position) pairs, 2 flops per multiply-add."""
    return 4.0 * D * HQ * B * (n * prefix + n * (n + 1) // 2)


class Watchdog:
    """Ends the process (after ``on_fire`` wrote what is known) when one step hangs: a kernel that
    deadlocks would otherwise take the whole run's time limit."""

    def __init__(self, seconds: float, on_fire):
        self.seconds, self.on_fire, self.timer = seconds, on_fire, None

    def arm(self, what: str):
        self.disarm()

        def fire():
            print(f"\nHUNG after {self.seconds:.0f} s: {what}; ending the run", flush=True)
            self.on_fire(what)
            os._exit(3)

        self.timer = threading.Timer(self.seconds, fire)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _kernel_tests():
    """tests/gpu/test_prefill_kernel_gpu.py: its case maker, float64 check and direct launch (a GPU
    test module: it skips itself at import without CUDA, hence imported here, on the GPU path)."""
    import tests.gpu.test_prefill_kernel_gpu as kt

    return kt


def _problem(kind, D, shape, gen):
    make_case = _kernel_tests().make_case
    _, B, prefix, n = shape
    q, kv = KINDS[kind]
    return make_case(q_lens=[n] * B, prefixes=[prefix] * B, Hq=HQ, Hkv=HKV, D=D, page=PAGE, q_dtype=q, kv_dtype=kv,
                     q_scale_kind="scalar" if kind == "fp8" else "none", gen=gen, pad_rows=0)


def run_group(entries: list[Entry], shapes, gen, dog: Watchdog) -> None:
    """Check and time one (kind, D)'s entries (the default first) on ``shapes``."""
    kt = _kernel_tests()
    kind, D = entries[0].kind, entries[0].head_dim
    q, kv = KINDS[kind]
    live = [e for e in entries if e.config is not None and not _compile_error(e)]
    for e in live:
        gen.manual_seed(4242)  # the same small case for every config of the group
        small = kt.make_case(q_lens=kt.Q_LENS, prefixes=kt.PREFIXES, Hq=8, Hkv=2, D=D, page=PAGE, q_dtype=q, kv_dtype=kv,
                          q_scale_kind="scalar" if kind == "fp8" else "none", gen=gen)
        dog.arm(f"check {kind} D{D} {e.tag}")
        try:
            e.result["check_err"] = kt.check(e.config, small, "HND", f"{kind} D{D} {e.tag} (seed 4242)")
        except Exception as ex:  # keep going: a failing config is reported, never timed
            e.result["failed"] = f"check: {type(ex).__name__}: {str(ex).strip()[:300]}"
            print(f"{kind} D{D} {e.tag}: FAILED {e.result['failed']}", flush=True)
        dog.disarm()
    timed = [e for e in live if "failed" not in e.result]
    for shape in shapes:
        gen.manual_seed(7)
        pb = _problem(kind, D, shape, gen)
        flops = causal_flops(*shape[1:], D)
        ref_out = None
        for i, e in enumerate(timed):
            if "failed" in e.result:
                continue
            out = torch.full(pb.q.shape, float("nan"), dtype=torch.bfloat16, device=pb.q.device)
            dog.arm(f"time {kind} D{D} {e.tag} on {shape[0]}")
            try:
                row = _time_one(e, pb, out, ref_out, fresh=i == 0)
            except Exception as ex:  # a launch that fails is reported; the others still run
                e.result["failed"] = f"on {shape[0]}: {type(ex).__name__}: {str(ex).strip()[:300]}"
                print(f"{kind} D{D} {e.tag}: FAILED {e.result['failed']}", flush=True)
                continue
            finally:
                dog.disarm()
            row["tflops"] = flops / row["us"] * 1e-6
            e.result.setdefault("shapes", {})[shape[0]] = row
            if e.default:
                ref_out = out
        default = next((e for e in timed if e.default), None)
        if ref_out is not None and len(timed) > 1:  # drift: the default again, last
            t = time_graph(lambda cfg=default.config, pb=pb, out=ref_out: kt.run_kernel(cfg, pb, out=out), **TIMING)
            default.result["shapes"][shape[0]]["again_us"] = t * 1e6
        del pb, ref_out
        torch.cuda.empty_cache()


def _time_one(e: Entry, pb, out, ref_out, fresh: bool) -> dict:
    """One config on one problem: its output (finite, and against the default's), then its time."""
    kt = _kernel_tests()
    run_kernel = kt.run_kernel
    run_kernel(e.config, pb, out=out)
    torch.cuda.synchronize()
    row: dict[str, Any] = dict(finite=bool(torch.isfinite(out.float()).all()))
    if not e.default and ref_out is not None:
        diff = ((out.float() - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-30)).item()
        row.update(diff_vs_default=diff, mismatch=not diff <= 2 * kt.TOL[e.kind])

    def fn():
        run_kernel(e.config, pb, out=out)

    if fresh:  # the first timing on a fresh problem is run twice (timing.time_graph_fresh)
        t, first = time_graph_fresh(fn, **TIMING)
        row["first_us"] = first * 1e6
    else:
        t = time_graph(fn, **TIMING)
    row["us"] = t * 1e6
    return row


def _compile_error(e: Entry):
    res = e.result.get("compile")
    return res[1] if isinstance(res, tuple) else None


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs and all(x > 0 for x in xs) else None


def status(e: Entry) -> str:
    if e.refused:
        return "refused: " + e.refused
    if _compile_error(e):
        return "compile failed: " + _compile_error(e)
    if "failed" in e.result:
        return "failed: " + e.result["failed"]
    bad = [s for s, r in e.result.get("shapes", {}).items() if not r["finite"] or r.get("mismatch")]
    return f"ok, but differs from the default on {', '.join(bad)}" if bad else "ok"


def summarize(entries: list[Entry], shape_names) -> dict:
    """One group's JSON: rows sorted by the geometric mean TFLOP/s over the shapes (fastest first),
    the default's ratio to the best, per shape and overall."""
    rows = []
    for e in entries:
        sh = e.result.get("shapes", {})
        g = geomean([sh[s]["tflops"] for s in shape_names if s in sh]) if len(sh) == len(shape_names) else None
        cr = e.result.get("compile")
        rows.append(dict(tag=e.tag, default=e.default, status=status(e), tuning=e.tuning,
                         smem_bytes=smem_bytes(e.config) if e.config else None,
                         compile_s=cr[0] if isinstance(cr, tuple) else None, check_err=e.result.get("check_err"),
                         shapes=sh, geomean_tflops=g))
    rows.sort(key=lambda r: -(r["geomean_tflops"] or 0))
    ok = [r for r in rows if r["geomean_tflops"] and r["status"] == "ok"]
    d = next((r for r in rows if r["default"]), None)
    out: dict[str, Any] = dict(kind=entries[0].kind, head_dim=entries[0].head_dim, rows=rows,
                               default=d["tag"] if d else None, best=ok[0]["tag"] if ok else None)
    if ok and d and d["geomean_tflops"]:
        out["default_over_best"] = d["geomean_tflops"] / ok[0]["geomean_tflops"]
        out["default_over_best_per_shape"] = {
            s: d["shapes"][s]["tflops"] / max(r["shapes"][s]["tflops"] for r in ok) for s in shape_names}
    return out


def print_group(g: dict, shape_names) -> None:
    name = {"16": "16-bit cache", "widen": "FP8 cache, bf16 query (widen)", "fp8": "FP8 query"}[g["kind"]]
    print(f"\n== {name}, D {g['head_dim']} (default {g['default']}; * marks it) ==", flush=True)
    print(f"  {'config':<24}" + "".join(f"{s[:34]:>36}" for s in shape_names) + f"{'geomean':>10}{'err':>10}")
    print(f"  {'':<24}" + f"{'TFLOP/s':>10}{'us':>13}{'vs default':>13}" * len(shape_names))
    for r in g["rows"]:
        if not r["geomean_tflops"]:
            continue
        cells = "".join(f"{r['shapes'][s]['tflops']:10.1f}{r['shapes'][s]['us']:13.1f}"
                        + (f"{r['shapes'][s]['diff_vs_default']:13.1e}" if 'diff_vs_default' in r['shapes'][s]
                           else f"{'-':>13}") for s in shape_names)
        mark = "*" if r["default"] else " "
        print(f"{mark} {r['tag']:<24}{cells}{r['geomean_tflops']:10.1f}{r['check_err'] or 0:10.1e}"
              + ("" if r["status"] == "ok" else f"  [{r['status']}]"))
    untimed = [r for r in g["rows"] if not r["geomean_tflops"]]
    refused = [r for r in untimed if r["status"].startswith("refused")]
    for r in untimed if len(refused) <= 6 else [r for r in untimed if r not in refused]:
        print(f"{'*' if r['default'] else ' '} {r['tag']:<24} {r['status'][:160]}")
    if len(refused) > 6:
        print(f"  {len(refused)} combinations refused by the config's checks (listed in the JSON)")
    if "default_over_best" in g:
        per = ", ".join(f"{s}: {v:.3f}" for s, v in g["default_over_best_per_shape"].items())
        print(f"  default / best ({g['best']}): {g['default_over_best']:.3f} geomean ({per})", flush=True)


def select_shapes(keys: str) -> list[tuple]:
    parts = [k.strip() for k in keys.split(",") if k.strip()]
    chosen = [s for s in SHAPES if any(k in s[0] for k in parts)]
    if not chosen:
        raise SystemExit(f"error: --shapes {keys!r} selects none of {[s[0] for s in SHAPES]}")
    return chosen


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m profiling.tune_prefill", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: 16, widen, fp8 (default: all)")
    p.add_argument("--dims", default=",".join(map(str, DIMS)), help="head dims (default: 64,128,256)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="comma-separated substrings of the timed shapes' names: " + "; ".join(s[0] for s in SHAPES)
                   + " (default: %(default)s)")
    p.add_argument("--wide", action="store_true", help="schedules x tiles x stages +-1 (x staging +-1)")
    p.add_argument("--match", default="", help="comma-separated tag substrings (e.g. 'n176,serial'): only those "
                   "configs, and each group's default")
    p.add_argument("--list", action="store_true", help="print the sweep and exit (no GPU, no compile)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every config for sm_90a with PTX/SASS evidence (no cache, no GPU): seconds, "
                   "registers, spills")
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: cores - 1, at most 16)")
    p.add_argument("--hang-s", type=float, default=120.0, help="end the run when one check or timing takes longer")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results to PATH")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.dims = [int(d) for d in args.dims.split(",") if d]
    unknown = [k for k in args.kinds if k not in KINDS] + [d for d in args.dims if d not in DIMS]
    if unknown:
        p.error(f"unknown kinds/dims {unknown}; expected kinds {list(KINDS)} and dims {list(DIMS)}")
    args.shapes = select_shapes(args.shapes)
    args.match = tuple(m for m in args.match.split(",") if m)
    return args


def _write(path, result) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    entries = sweep(args.kinds, args.dims, args.wide, args.match)
    n_ok = sum(e.config is not None for e in entries)
    print(f"sweep: {n_ok} configs, {len(entries) - n_ok} refused ({'wide' if args.wide else 'default'}; "
          f"kinds {','.join(args.kinds)}, dims {','.join(map(str, args.dims))})", flush=True)
    result: dict[str, Any] = dict(arch=ARCH, wide=args.wide, kinds=args.kinds, dims=args.dims,
                                  Hq=HQ, Hkv=HKV, page=PAGE, configs=n_ok, refused=len(entries) - n_ok)
    if args.list:
        for e in entries:
            print(f"  {e.kind:<5} D{e.head_dim:<4}{'*' if e.default else ' '} {e.tag:<24} "
                  f"{'refused: ' + e.refused if e.refused else f'{smem_bytes(e.config) // 1024} KB'}")
        return 0
    if args.compile_only:
        result["compile_wall_s"] = compile_all(entries, _compile_evidence, args.workers)
        result["compiles"] = [dict(kind=e.kind, head_dim=e.head_dim, tag=e.tag, default=e.default, tuning=e.tuning,
                                   refused=e.refused, **(e.result.get("compile") or {})) for e in entries]
        bad = [c for c in result["compiles"] if not c["refused"] and (c.get("error") or c.get("spills"))]
        print(f"compiled {n_ok} configs in {result['compile_wall_s']:.0f} s wall; {len(bad)} failed or spilled"
              + "".join(f"\n  {c['kind']} D{c['head_dim']} {c['tag']}: {c.get('error') or 'spills'}" for c in bad))
        _write(args.json, result)
        return 1 if bad else 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("tune_prefill needs an SM90 GPU (--list and --compile-only run without one)", file=sys.stderr)
        return 2
    shape_names = [s[0] for s in args.shapes]
    result.update(device=torch.cuda.get_device_name(), shapes=[dict(zip(("name", "B", "prefix", "q_len"), s))
                                                               for s in args.shapes], groups=[])
    result["compile_wall_s"] = compile_all(entries, _compile_cached, args.workers)

    def on_hang(what):
        result["hung"] = what
        _write(args.json, result)

    dog = Watchdog(args.hang_s, on_hang)
    gen = torch.Generator(device="cuda")
    for kind, D in product(args.kinds, args.dims):
        group = [e for e in entries if (e.kind, e.head_dim) == (kind, D)]
        run_group(group, args.shapes, gen, dog)
        g = summarize(group, shape_names)
        result["groups"].append(g)
        print_group(g, shape_names)
        _write(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
