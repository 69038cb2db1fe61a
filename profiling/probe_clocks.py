"""SM clock and power while one QSA problem is timed again and again (diagnostic).

Why: the 1x16384 correlated QSA prefill reads slower on a process's second graph timing (the
one ``bench qsa`` keeps) than on its first, by up to 5 %. This times the same problem
``--rounds`` times (graph, then eager, alternating) while ``nvidia-smi`` samples the SM clock,
the power draw and the active clock-event reasons every 100 ms, and reports each timing next to
the clock seen during it (docs/design/qsa.md#prefill-under-the-power-cap).

``python -m profiling.probe_clocks --kv bf16 --rounds 4 --json out.json``
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time

import torch

from cute_kernels.bench.harness import write_json
from cute_kernels.bench.qsa import BF16, FP8, Problem
from cute_kernels.bench.timing import time_eager, time_graph

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class ClockSampler:
    """``nvidia-smi`` polled every ``period_ms`` in the background; samples carry host time."""

    def __init__(self, period_ms: int = 100):
        self.samples: list[tuple[float, str]] = []
        self._proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(period_ms)],
            stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self._proc.stdout:
            self.samples.append((time.time(), line.strip()))

    def between(self, t0: float, t1: float) -> list[list[str]]:
        return [s.split(", ") for t, s in self.samples if t0 <= t <= t1]

    def stop(self):
        self._proc.terminate()
        self._proc.wait()


def summarize(rows: list[list[str]]) -> dict:
    """Median SM clock and power over the samples, and every clock-event reason seen (hex mask)."""
    clocks = [float(r[0]) for r in rows if len(r) >= 4]
    power = [float(r[1]) for r in rows if len(r) >= 4]
    reasons = sorted({r[3] for r in rows if len(r) >= 4})
    return dict(samples=len(clocks), sm_mhz=statistics.median(clocks) if clocks else None,
                sm_mhz_min=min(clocks) if clocks else None,
                power_w=statistics.median(power) if power else None, reasons=reasons)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.probe_clocks")
    p.add_argument("--kv", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--tokens", type=int, default=16384, help="prefill rows of one request from position 0")
    p.add_argument("--selection", default="correlated")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    kv = FP8 if args.kv == "fp8" else BF16
    prob = Problem(rows_per_copy=args.tokens, positions=torch.arange(args.tokens, device="cuda"), reqs_per_copy=1,
                   ctx=args.tokens, kv_dtype=kv, copies=1, seed=args.tokens, selection=args.selection)
    prob.call(0, True)
    torch.cuda.synchronize()
    sampler = ClockSampler()
    time.sleep(1.0)
    out = []
    for i in range(args.rounds):
        for how, timer in (("graph", lambda: time_graph(lambda: prob.call(0, True), reps=20)),
                           ("eager", lambda: time_eager(lambda: prob.call(0, True), reps=20))):
            t0 = time.time()
            sec = timer()
            t1 = time.time()
            r = dict(round=i, how=how, us=sec * 1e6, wall_s=t1 - t0, **summarize(sampler.between(t0, t1)))
            out.append(r)
            print(f"{how:<5} round {i}: {r['us']:8.1f} us  SM {r['sm_mhz']} MHz (min {r['sm_mhz_min']})  "
                  f"{r['power_w']} W  reasons {r['reasons']}  ({r['samples']} samples, {r['wall_s']:.2f} s)",
                  flush=True)
    sampler.stop()
    write_json(args.json, dict(kv=args.kv, tokens=args.tokens, selection=args.selection, rows=out))


if __name__ == "__main__":
    main()
