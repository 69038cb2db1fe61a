"""Nsight Compute for ``cute-kernels profile``: the command line, the raw CSV it exports, and the
short report made from it (host-only: neither torch nor the DSL).

The profiled process (:mod:`cute_kernels.bench.profile`) makes one op call between
``cudaProfilerStart``/``Stop``, and ncu runs with ``--profile-from-start off`` and the op's NVTX
range as its only include filter (``--nvtx-include "cute_kernels.<op>/"``: the range is named
exactly that, shapes ride in a range nested inside it), so the report holds that call's kernels
and nothing of the warm-up. Before the call, the process runs a device-to-device copy in a range
``cute_kernels.roofline`` nested inside a ``cute_kernels.<op>`` range of its own, so that the same
filter selects it: it is the first profiled kernel, and its DRAM bandwidth under the same clocks
and cache flushes is the roofline each kernel's bandwidth is compared with.

Report per kernel: duration, DRAM and SM throughput (% of peak), DRAM bytes and bandwidth as a
share of the copy's, achieved occupancy, registers per thread, shared memory per CTA (static +
dynamic), local-memory traffic (spills) and the three largest warp-stall reasons. Design:
docs/design/benchmarks.md#profiling-one-op.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from typing import Any

#: what ``cute-kernels profile WHAT`` profiles: WHAT -> the op whose NVTX range selects the call
OPS = {"decode": "paged_decode", "prefill": "paged_prefill", "qsa": "qsa_sparse_attention",
       "merge": "merge_states", "layer": "layer"}
ROOFLINE_RANGE = "cute_kernels.roofline"

#: each WHAT's shape keys and defaults (``--shape k=v,...`` overrides them): the benchmarks' shapes
SHAPES: dict[str, dict[str, Any]] = {
    # cute-kernels bench decode's first shape (Qwen3-30B B8 at 32000 tokens, FP8 cache)
    "decode": dict(B=8, ctx=32000, Hq=32, Hkv=4, D=128, page=16, kv="fp8", q_len=1),
    # cute-kernels bench prefill's first shape: B requests of `new` tokens after a cached `prefix`
    # q: the query's dtype: bf16, or fp8 / fp8x2 (one / two e4m3 terms, per-tensor q_scale; FP8 cache only)
    "prefill": dict(B=1, prefix=0, new=4096, Hq=32, Hkv=8, D=128, page=16, kv="bf16", q="bf16"),
    # cute-kernels bench qsa: Hq 24, Hkv 2, D 256, page 1568; decode rows or 1 x n prefill tokens
    "qsa": dict(kind="decode", n=64, kv="bf16", selection="correlated", gate=1),
    # cute-kernels bench merge: S splits of N rows x H heads x D
    "merge": dict(S=8, N=64, H=32, D=128),
    # cute-kernels bench layer's decode step (Qwen3-30B B8 at 32000 tokens, FP8 cache)
    "layer": dict(B=8, ctx=32000, Hq=32, Hkv=4, D=128, page=16, kv="fp8"),
}
#: the values a key takes, where it has a fixed set
CHOICES: dict[str, tuple[str | int, ...]] = {"kv": ("bf16", "fp8"), "q": ("bf16", "fp8", "fp8x2"),
                                             "kind": ("decode", "prefill"), "gate": (0, 1)}
#: the least value of an integer key without a fixed set: 1 (a size or count), a cached prefix 0
MINIMUM: dict[str, int] = {"prefix": 0}


def parse_shape(what: str, text: str | None) -> dict[str, Any]:
    """``"B=8,ctx=4096"`` over WHAT's defaults; a value takes its default's type. Raises
    ``ValueError`` naming an unknown key or a bad value."""
    shape = dict(SHAPES[what])
    given: set[str] = set()
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in shape:
            raise ValueError(f"--shape: {item!r} is not KEY=VALUE with KEY one of {', '.join(shape)}")
        if key in given:  # the last would win without a word
            raise ValueError(f"--shape: {key} given twice")
        given.add(key)
        if isinstance(shape[key], int):
            try:
                shape[key] = int(value)
            except ValueError:
                raise ValueError(f"--shape: {key} must be an integer, got {value!r}") from None
            least = MINIMUM.get(key, 1)
            if key not in CHOICES and shape[key] < least:
                raise ValueError(f"--shape: {key} must be >= {least}, got {shape[key]}")
        else:
            shape[key] = value.strip()
        if key in CHOICES and shape[key] not in CHOICES[key]:
            raise ValueError(f"--shape: {key} must be one of {', '.join(map(str, CHOICES[key]))}, got {shape[key]!r}")
    if shape.get("q", "bf16") != "bf16" and shape.get("kv") != "fp8":
        raise ValueError(f"--shape: q={shape['q']} (an FP8 query) needs kv=fp8")
    if "Hkv" in shape and shape["Hq"] % shape["Hkv"]:
        raise ValueError(f"--shape: Hq ({shape['Hq']}) must be a multiple of Hkv ({shape['Hkv']})")
    return shape


def shape_text(shape: dict[str, Any]) -> str:
    """The inverse of :func:`parse_shape`: ``"B=8,ctx=4096,..."``."""
    return ",".join(f"{k}={v}" for k, v in shape.items())

# the sections behind the report (and the GUI's pages of the .ncu-rep)
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "MemoryWorkloadAnalysis")
DURATION = "gpu__time_duration.sum"
DRAM_PCT = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
DRAM_READ, DRAM_WRITE = "dram__bytes_read.sum", "dram__bytes_write.sum"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
REGISTERS = "launch__registers_per_thread"
SMEM_STATIC, SMEM_DYNAMIC = "launch__shared_mem_per_block_static", "launch__shared_mem_per_block_dynamic"
LOCAL_LD, LOCAL_ST = "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum", "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"
# what bounds a compute-bound kernel: the pipes' busy time and the issue slots (percent of peak,
# elapsed), and the resident warps per SM
TENSOR_PCT = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"
ISSUE_PCT = "sm__issue_active.avg.pct_of_peak_sustained_elapsed"
XU_PCT = "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_elapsed"  # exp2, the special functions
ALU_PCT = "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed"
FMA_PCT = "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed"
WARPS = "sm__warps_active.avg.per_cycle_active"
METRICS = (DURATION, DRAM_PCT, SM_PCT, DRAM_READ, DRAM_WRITE, OCCUPANCY, REGISTERS, SMEM_STATIC, SMEM_DYNAMIC,
           LOCAL_LD, LOCAL_ST, TENSOR_PCT, ISSUE_PCT, XU_PCT, ALU_PCT, FMA_PCT, WARPS)
# ncu options the command line sets itself: given again in --ncu-args, ncu refuses the run
# ("cannot be specified more than once") or the report loses the call it is made of
OWNED_OPTIONS = {"--nvtx": "", "--nvtx-include": "", "--profile-from-start": "", "--target-processes": "",
                 "--export": " (use --out)", "-o": " (use --out)", "--force-overwrite": "", "-f": ""}
# warp-state metrics of the WarpStateStats section: cycles per issued instruction spent stalled
# for each reason ("selected" is the issuing warp itself, not a stall)
_STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(?P<reason>[a-z0-9_]+?)"
                    r"(?:_per_issue_active)?\.ratio$")
_NOT_STALLS = {"selected"}

_SCALE = {"": 1.0, "n": 1e-9, "u": 1e-6, "m": 1e-3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
# ncu spells units long ("nsecond", "Kbyte") or short ("ns", "KB"), depending on its version
_UNIT = re.compile(r"^(?P<prefix>[numKMGT]?)(?P<base>seconds?|sec|s|bytes?|B|bytes?/seconds?|B/s)$")
_TIME = re.compile(r"^[num]?(?:seconds?|sec|s)$")


def split_extra(extra: Sequence[str]) -> tuple[list[str], list[str]]:
    """``--ncu-args`` as (the metrics it names, every other argument): ncu takes one ``--metrics``,
    so the caller's join the report's. ``ValueError`` naming ``--ncu-args`` for an option the
    command line sets itself, or a ``--metrics`` without a value."""
    metrics: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        name = arg.split("=", 1)[0]
        if name in OWNED_OPTIONS:
            raise ValueError(f"--ncu-args: {name} is set by cute-kernels profile{OWNED_OPTIONS[name]}")
        if name == "--metrics":
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(extra):
                value = extra[i + 1]
                i += 1
            else:
                value = ""
            names = [m.strip() for m in value.split(",") if m.strip()]
            if not names:
                raise ValueError("--ncu-args: --metrics needs a comma-separated list of metric names")
            metrics += names
        else:
            rest.append(arg)
        i += 1
    return metrics, rest


def ncu_command(what: str, shape: str, stem: str, *, ncu: str = "ncu", python: str = "python3",
                extra: Sequence[str] = (), tuning: str = "") -> list[str]:
    """The ncu command line that profiles one ``WHAT`` call of ``shape`` into ``stem.ncu-rep``
    (``extra``: more ncu arguments; metrics they name join the report's one ``--metrics``;
    ``tuning``: the op's ``tuning_override`` fields, ``K=V,...``, for the profiled process)."""
    op = OPS[what]
    more_metrics, rest = split_extra(extra)
    metrics = list(METRICS) + [m for m in dict.fromkeys(more_metrics) if m not in METRICS]
    argv = [ncu, "--nvtx", "--nvtx-include", f"cute_kernels.{op}/", "--profile-from-start", "off",
            "--target-processes", "all"]
    for section in SECTIONS:
        argv += ["--section", section]
    argv += ["--metrics", ",".join(metrics), "--export", stem, "--force-overwrite", *rest]
    target = [python, "-m", "cute_kernels.bench.profile", "target", what, "--shape", shape]
    return argv + target + (["--tuning", tuning] if tuning else [])


def import_command(report: str, *, ncu: str = "ncu") -> list[str]:
    """The ncu command line that prints a report's raw page as CSV, values in base units."""
    return [ncu, "--import", report, "--csv", "--page", "raw", "--print-units", "base"]


def _number(text: str, unit: str, column: str = "") -> float | None:
    text = text.strip().replace(",", "")
    if text in ("", "n/a", "N/A"):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    unit = unit.strip()
    if column == DURATION and not _TIME.match(unit):
        return value * 1e-9  # no (readable) unit: ncu's base unit of time is the nanosecond
    m = _UNIT.match(unit)
    return value * _SCALE[m.group("prefix")] if m else value


def parse_raw_csv(text: str) -> list[dict[str, Any]]:
    """The rows of ``ncu --import R --csv --page raw``: one dict per profiled kernel, in profiling
    order, holding ``ID``, ``Kernel Name``, ``Block Size``, ``Grid Size`` and every metric column
    as a number in base units (seconds, bytes; percentages stay percentages). The header row names
    the columns and the row after it, when there is one, gives their units; durations without a
    readable unit are nanoseconds (ncu's base unit)."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "ID" in r), None)
    if start is None:
        raise ValueError("not an ncu raw-page CSV: no header row with 'ID' and 'Kernel Name'")
    header = rows[start]
    body = rows[start + 1:]
    units = [""] * len(header)
    if body and body[0] and not body[0][header.index("ID")].strip().isdigit():  # a kernel row's ID is a number
        units, body = body[0], body[1:]
    text_columns = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
                    "Block Size", "Grid Size", "Device", "CC"}
    out = []
    for r in body:
        if len(r) != len(header):
            continue  # ncu's trailing notes, a truncated line
        kernel: dict[str, Any] = {}
        for name, unit, cell in zip(header, units, r):
            kernel[name] = cell if name in text_columns else _number(cell, unit, name)
        out.append(kernel)
    return out


def _stalls(kernel: dict[str, Any], top: int = 3) -> list[dict[str, Any]]:
    found = []
    for name, value in kernel.items():
        m = _STALL.match(name)
        if m and value is not None and m.group("reason") not in _NOT_STALLS:
            found.append(dict(reason=m.group("reason"), cycles_per_instruction=round(value, 3)))
    return sorted(found, key=lambda s: -s["cycles_per_instruction"])[:top]


def _bytes(kernel: dict[str, Any], *names: str) -> float | None:
    values = [kernel.get(n) for n in names]
    return None if any(v is None for v in values) else float(sum(v for v in values if v is not None))


def kernel_summary(kernel: dict[str, Any], roofline_bw: float | None) -> dict[str, Any]:
    """The report's line for one profiled kernel (``roofline_bw``: the copy's bytes/second)."""
    seconds = kernel.get(DURATION)
    dram = _bytes(kernel, DRAM_READ, DRAM_WRITE)
    bw = dram / seconds if dram is not None and seconds else None
    smem = _bytes(kernel, SMEM_STATIC, SMEM_DYNAMIC)
    spills = _bytes(kernel, LOCAL_LD, LOCAL_ST)
    return dict(
        id=kernel.get("ID"), name=kernel.get("Kernel Name"), grid=kernel.get("Grid Size"),
        block=kernel.get("Block Size"),
        duration_us=None if seconds is None else seconds * 1e6,
        dram_bytes=dram, dram_gbps=None if bw is None else bw / 1e9,
        roofline_pct=None if bw is None or not roofline_bw else 100 * bw / roofline_bw,
        dram_throughput_pct=kernel.get(DRAM_PCT), sm_throughput_pct=kernel.get(SM_PCT),
        achieved_occupancy_pct=kernel.get(OCCUPANCY), registers_per_thread=kernel.get(REGISTERS),
        smem_per_cta_bytes=smem, smem_static_bytes=kernel.get(SMEM_STATIC),
        smem_dynamic_bytes=kernel.get(SMEM_DYNAMIC), local_memory_bytes=spills, top_stalls=_stalls(kernel),
        tensor_pipe_pct=kernel.get(TENSOR_PCT), issue_active_pct=kernel.get(ISSUE_PCT),
        xu_pipe_pct=kernel.get(XU_PCT), alu_pipe_pct=kernel.get(ALU_PCT), fma_pipe_pct=kernel.get(FMA_PCT),
        warps_per_sm=kernel.get(WARPS),
    )


def build_report(rows: list[dict[str, Any]], *, what: str, shape: dict[str, Any], device: str = "",
                 ncu_report: str = "", tuning: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of one profiled call: the first row is the roofline copy, the others the op's
    kernels in launch order, with their total (``tuning``: the fields the call was forced with)."""
    if len(rows) < 2:
        raise ValueError(f"the profile holds {len(rows)} kernel(s): expected the roofline copy and the "
                         f"kernels of one cute_kernels.{OPS[what]} call (is the op's NVTX range open?)")
    copy, kernels = rows[0], rows[1:]
    copy_s, copy_bytes = copy.get(DURATION), _bytes(copy, DRAM_READ, DRAM_WRITE)
    roofline_bw = copy_bytes / copy_s if copy_bytes and copy_s else None
    lines = [kernel_summary(k, roofline_bw) for k in kernels]
    seconds = sum(k.get(DURATION) or 0.0 for k in kernels)
    dram = sum(line["dram_bytes"] or 0.0 for line in lines)
    total_bw = dram / seconds if seconds else None
    return dict(
        what=what, op=OPS[what], shape=shape, tuning=dict(tuning or {}), device=device, ncu_report=ncu_report,
        roofline=dict(kernel=copy.get("Kernel Name"), duration_us=None if copy_s is None else copy_s * 1e6,
                      dram_bytes=copy_bytes, dram_gbps=None if roofline_bw is None else roofline_bw / 1e9),
        kernels=lines,
        total=dict(duration_us=seconds * 1e6, dram_bytes=dram,
                   dram_gbps=None if total_bw is None else total_bw / 1e9,
                   roofline_pct=None if total_bw is None or not roofline_bw else 100 * total_bw / roofline_bw),
    )


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a short markdown page."""
    shape = ", ".join(f"{k}={v}" for k, v in report["shape"].items())
    roof = report["roofline"]
    out = [f"# cute-kernels profile {report['what']} (`cute_kernels.{report['op']}`)", "",
           f"shape: {shape}  ",
           *([f"tuning_override: {', '.join(f'{k}={v}' for k, v in report['tuning'].items())}  "]
             if report.get("tuning") else []),
           f"device: {report['device'] or 'unknown'}  ",
           f"Nsight Compute report: `{report['ncu_report']}`  ",
           f"roofline: device-to-device copy `{roof['kernel']}`, {_fmt(roof['dram_bytes'], 0)} DRAM bytes in "
           f"{_fmt(roof['duration_us'], 2)} µs = {_fmt(roof['dram_gbps'], 0)} GB/s (same run, same clocks)", "",
           "| kernel | µs | DRAM GB/s | % roofline | DRAM % peak | SM % peak | occupancy % | regs/thread | "
           "smem/CTA KiB | local B (spills) | top stalls (cycles/instr) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for k in report["kernels"]:
        stalls = ", ".join(f"{s['reason']} {s['cycles_per_instruction']:.2f}" for s in k["top_stalls"]) or "–"
        smem = None if k["smem_per_cta_bytes"] is None else k["smem_per_cta_bytes"] / 1024
        out.append(f"| `{k['name']}` | {_fmt(k['duration_us'], 2)} | {_fmt(k['dram_gbps'], 0)} | "
                   f"{_fmt(k['roofline_pct'])} | {_fmt(k['dram_throughput_pct'])} | {_fmt(k['sm_throughput_pct'])} | "
                   f"{_fmt(k['achieved_occupancy_pct'])} | {_fmt(k['registers_per_thread'], 0)} | {_fmt(smem)} | "
                   f"{_fmt(k['local_memory_bytes'], 0)} | {stalls} |")
    t = report["total"]
    out.append(f"| **total** | {_fmt(t['duration_us'], 2)} | {_fmt(t['dram_gbps'], 0)} | {_fmt(t['roofline_pct'])} "
               "| | | | | | | |")
    # the pipes: a kernel far from the DRAM roofline is bound by one of these, or by latency
    # when none is near its peak
    out += ["", "| kernel | tensor pipe % | issue active % | XU (exp2) % | ALU % | FMA % | warps / SM |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for k in report["kernels"]:
        out.append(f"| `{k['name']}` | {_fmt(k.get('tensor_pipe_pct'))} | {_fmt(k.get('issue_active_pct'))} | "
                   f"{_fmt(k.get('xu_pipe_pct'))} | {_fmt(k.get('alu_pipe_pct'))} | {_fmt(k.get('fma_pipe_pct'))} | "
                   f"{_fmt(k.get('warps_per_sm'))} |")
    out += ["", "Durations are Nsight Compute's (locked clocks, caches flushed before each kernel), so they are "
            "longer than the CUDA-graph times of `cute-kernels bench`; the roofline copy runs under the same "
            "conditions.", ""]
    return "\n".join(out)
