"""Reading compute-sanitizer's racecheck reports (tests/gpu/test_sanitize_gpu.py,
docs/design/testing.md#sanitizer).

racecheck prints a hazard in one of two forms, depending on ``--racecheck-report``:

    Error: Potential WAW hazard detected at __shared__ 0x69a0 in block (4,0,0) :
        Write Thread (29,0,0) at cute_kernels_sm90_qsa_union_0+0x23d0
        Write Thread (220,0,0) at cute_kernels_sm90_qsa_union_0+0x3c90

or ``Error: Race reported between Write access at <fn>+<pc> ... and Write access at <fn>+<pc>``. The
only hazards the package accepts are the QSA union pre-pass's shared-memory write-write ones, proven
benign in docs/design/qsa.md#racecheck-of-the-union-pre-pass. Every tool ends with a summary line
(``ERROR SUMMARY: 0 errors``, racecheck's ``RACECHECK SUMMARY: 48 hazards displayed (...)``):

    python3 -m profiling.sanitizer_reports LOG    # prints the count the summary reports ("none": no summary)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

_PREFIX = r"^=*\s*"
_HAZARD = re.compile(_PREFIX + r"(?:Error|Warning): Potential (?P<kind>[A-Z]{3}) hazard detected at (?P<space>\S+) "
                     r"(?P<addr>0x[0-9a-fA-F]+)[^\n]*\n(?P<a>[^\n]*)\n(?P<b>[^\n]*)", re.M)
_THREAD = re.compile(r"(?P<op>Read|Write) Thread \([^)]*\) at (?P<fn>[\w$.:]+)\+(?P<pc>0x[0-9a-fA-F]+)")
_RACE = re.compile(_PREFIX + r"(?:Error|Warning): Race reported between (?P<a>(?:Read|Write) access at [^\n]*?)"
                   r"\s*(?:\n=*)?\s*and\s+(?P<b>(?:Read|Write) access at [^\n]*)", re.M | re.I)
# "at <function>+<pc>", or "at <pc> in <file:line:function>"
_SUMMARY = re.compile(_PREFIX + r"(?:ERROR SUMMARY: (\d+) errors?|RACECHECK SUMMARY: (\d+) hazards?)", re.M)
_ACCESS = re.compile(r"(?P<op>Read|Write) access at (?:(?P<fn>[\w$.:]+)\+)?(?P<pc>0x[0-9a-fA-F]+)"
                     r"(?: in (?P<where>\S+))?", re.I)


@dataclass(frozen=True)
class Access:
    op: str  # "Read" or "Write"
    function: str
    pc: str


@dataclass(frozen=True)
class Hazard:
    kind: str  # "WAW", "RAW", "WAR"; "race" for the other report form
    space: str  # "__shared__", ... ("" when the report does not say)
    accesses: tuple[Access, ...]


def hazards(log: str) -> list[Hazard]:
    """Every hazard racecheck reported in ``log``, in order."""
    found = []
    for m in _HAZARD.finditer(log):
        acc = tuple(Access(t["op"], t["fn"], t["pc"]) for t in (_THREAD.search(m["a"]), _THREAD.search(m["b"])) if t)
        found.append(Hazard(m["kind"], m["space"], acc))
    for m in _RACE.finditer(log):
        acc = tuple(Access(t["op"].capitalize(), t["fn"] or t["where"] or "", t["pc"])
                    for t in (_ACCESS.search(m["a"]), _ACCESS.search(m["b"])) if t)
        found.append(Hazard("race", "", acc))
    return found


def benign_union_races(log: str) -> bool:
    """True when ``log`` reports hazards and every one is a write-write pair inside the QSA union
    pre-pass (shared memory where the report names the space)."""
    found = hazards(log)
    return bool(found) and all(
        h.kind in ("WAW", "race") and h.space in ("__shared__", "") and len(h.accesses) == 2
        and all(a.op == "Write" and re.search(r"qsa_?union", a.function, re.I) for a in h.accesses)
        for h in found)


def reported_errors(log: str) -> int | None:
    """The errors (racecheck: hazards) the tool's summary lines report, the largest where there are
    several; None without a summary (the tool did not finish)."""
    counts = [int(a or b) for a, b in _SUMMARY.findall(log)]
    return max(counts) if counts else None


if __name__ == "__main__":
    n = reported_errors(open(sys.argv[1], errors="replace").read())
    print("none" if n is None else n)
