"""Summarize an ``ncu --page source --csv --print-source sass`` export (``profiling/run.sh ncu-source``):
the instructions with the most warp-stall samples, their dominant stall reasons, and the samples
per stall reason over the whole kernel.

Usage: ``python -m profiling.ncu_sass_hotspots FILE.csv[.gz] [--top 25]``. Also the samples before,
inside and after the main loop (the backward branch whose body holds the most MMA instructions),
with each part's top reasons: a kernel's fixed cost per CTA against its loop.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import re
from collections import Counter


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    opener = gzip.open if a.csv.endswith(".gz") else open
    with opener(a.csv, "rt") as f:
        rows = list(csv.reader(f))
    hdr = rows[1]
    col = {h: i for i, h in enumerate(hdr)}
    body = [r for r in rows[2:] if len(r) == len(hdr)]
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    samples = col["Warp Stall Sampling (All Samples)"]
    total = sum(_num(r[samples]) for r in body)
    per_reason = _by_reason(body, col, stalls)
    print(f"{len(body)} instructions, {total:.0f} samples")
    print("by reason:", ", ".join(f"{k[6:]} {v / total:.1%}" for k, v in per_reason.most_common(8)))
    _regions(body, col, stalls, samples, total)
    print(f"{'addr':>6} {'share':>6}  top reasons  |  sass")
    for r in sorted(body, key=lambda r: -_num(r[samples]))[:a.top]:
        reasons = sorted(((_num(r[col[s]]), s[6:]) for s in stalls), reverse=True)[:2]
        why = ", ".join(f"{n} {v:.0f}" for v, n in reasons if v)
        print(f"{r[col['Address']]:>6} {_num(r[samples]) / total:6.1%}  {why:<28} | {r[col['Source']].strip()[:90]}")


def _by_reason(rows, col, stalls) -> Counter:
    """Stall samples of ``rows`` per stall reason."""
    out: Counter = Counter()
    for r in rows:
        for s in stalls:
            out[s] += _num(r[col[s]])
    return out


def _regions(body, col, stalls, samples, total):
    """Samples before, inside and after the main loop: the backward branch whose body holds the most
    MMA instructions (HMMA, HGMMA, UTCHMMA)."""
    src = col["Source"]
    addr = [int(r[col["Address"]], 16) for r in body]
    loops = []
    for i, r in enumerate(body):
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", r[src])
        if m and int(m.group(1), 16) < addr[i]:
            loops.append((int(m.group(1), 16), addr[i]))
    mma = [addr[i] for i, r in enumerate(body) if re.search(r"\b(HMMA|HGMMA|UTCHMMA)", r[src])]
    if not loops or not mma:
        return
    lo, hi = max(loops, key=lambda L: sum(L[0] <= a <= L[1] for a in mma))
    parts = {"before the main loop": lambda a: a < lo, "main loop": lambda a: lo <= a <= hi,
             "after it": lambda a: a > hi}
    for name, inside in parts.items():
        rows = [r for a, r in zip(addr, body) if inside(a)]
        reasons = _by_reason(rows, col, stalls)
        share = sum(_num(r[samples]) for r in rows) / total
        top = ", ".join(f"{k[6:]} {v / total:.1%}" for k, v in reasons.most_common(4))
        print(f"{name}: {share:.1%} ({top})")


if __name__ == "__main__":
    main()
