"""What every benchmark shares on the host side: the common flags (``--json``, ``--nvtx``), the
checks made before anything is timed (a GPU of the arch the benchmark needs, the optional peer
libraries), NVTX ranges around timed op calls, the ``field=int`` variant lists and the JSON writer.

Nothing here imports torch at module level: ``cute-kernels bench ...`` parses its arguments and
refuses a machine without a GPU in one line before any kernel module is loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cute_kernels.plans.args import check_positive_ints

INSTALL_HINT = 'pip install "cute-kernels[bench]"'


def self_check_state(kernel_id: str, q_dtype: str, kv_dtype: str, head_dim: int) -> tuple[bool, str]:
    """``(ok, text)`` for the kernel serving a (query, cache) dtype pair and head dim: an available
    kernel is ``(True, "")``; a compile-verified one reports its family's self-check in this
    process or on this machine (``ok`` False only when it failed: the reference served its calls)."""
    from cute_kernels.plans import selfcheck_records
    from cute_kernels.registry import KERNELS

    info = KERNELS[kernel_id]
    if info.status != "compile-verified":
        return True, ""
    fam = info.family(q_dtype, kv_dtype, head_dim)
    rec = selfcheck_records.lookup(fam)
    if rec is None:
        return True, f"{fam}: self-check not run"
    if not rec.ok:
        return False, f"{fam} FAILED its self-check ({rec.reason}): the reference served its calls"
    return True, f"{fam}: self-check passed on {rec.device}"


@dataclass(frozen=True)
class GpuNeed:
    """The GPUs a benchmark runs on: compute capability ``min_major`` up to ``max_major``."""

    label: str  # how the refusal names them, e.g. "an SM90 GPU (H100/H200)"
    min_major: int
    max_major: int


SM90 = GpuNeed("an SM90 GPU (H100/H200)", 9, 9)
SM80_PLUS = GpuNeed("a GPU of SM80 or newer", 8, 99)


@dataclass(frozen=True)
class Peer:
    """An optional library a benchmark compares against: the module it imports and the
    distribution that provides it (one of the ``bench`` extra's)."""

    module: str
    distribution: str


# ``bench decode|prefill --kernel K`` runs ``bench K decode|prefill`` (``bench.route``); sm90 is theirs
KERNEL_BENCHMARKS = ("sm80",)


def add_kernel_argument(p: argparse.ArgumentParser, what: str, peer: str) -> None:
    """``--kernel`` of ``bench decode`` / ``bench prefill``: what the portable benchmark is named by
    (``bench.route`` hands the call to it before this parser sees it; a bad value is named here)."""
    p.add_argument("--kernel", default="sm90", choices=("sm90", *KERNEL_BENCHMARKS),
                   help=f"sm90: this benchmark; sm80: the portable sm80.{what} against {peer} (the same as "
                        f"cute-kernels bench sm80 {what}; its own flags then apply)")


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--nvtx", action="store_true",
                   help="wrap each timed op call in an NVTX range named cute_kernels.<op> (peers: bench.<peer>), "
                        "so that a profiler can select one op (default: off)")


def ab_parser(doc: str, shapes_help: str) -> argparse.ArgumentParser:
    """The A/B tools' common arguments (``profiling.ab_sm80_*``): the named variants, the shapes,
    the JSON path."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--variants", required=True, help="name:field=value+...;... (the first is the baseline)")
    p.add_argument("--shapes", default=None, help=shapes_help)
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    return p


def gpu_problem(need: GpuNeed, cuda_available: Callable[[], bool] | None = None,
                capability: Callable[[], tuple[int, int]] | None = None,
                device_name: Callable[[], str] | None = None) -> str | None:
    """Why this machine cannot run a benchmark that needs ``need`` (None when it can). The
    callables default to torch's; tests pass their own."""
    if cuda_available is None:
        import torch

        cuda_available, capability, device_name = (torch.cuda.is_available, torch.cuda.get_device_capability,
                                                   torch.cuda.get_device_name)
    if not cuda_available():
        return f"needs {need.label}, and no CUDA GPU is visible here"
    major, minor = capability()
    if not need.min_major <= major <= need.max_major:
        return f"needs {need.label}; this machine has {device_name()} (sm_{major}{minor})"
    return None


def module_available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (a parent package that is
    missing or broken counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_peers(requested: list[str], peers: dict[str, Peer], *,
                    available: Callable[[str], bool] = module_available) -> tuple[list[str], list[str]]:
    """``(peers to run, one line per peer skipped)``: a peer whose library is not installed is
    skipped with a line naming the distribution; names not in ``peers`` (our own variants) pass."""
    run, skipped = [], []
    for name in requested:
        peer = peers.get(name)
        if peer is not None and not available(peer.module):
            skipped.append(f"peer {name} skipped: {peer.module} is not installed ({peer.distribution}; "
                           f"{INSTALL_HINT})")
        else:
            run.append(name)
    return run, skipped


def runnable(requested: list[str], peers: dict[str, Peer], png: str | None, *,
             available: Callable[[str], bool] = module_available) -> tuple[list[str], str | None]:
    """``(entries to run, PNG path or None)``: :func:`available_peers` of ``requested``, and the
    ``--png`` path unless matplotlib is missing; one line on stderr per thing skipped."""
    import sys

    run, skipped = available_peers(requested, peers, available=available)
    if png and not available("matplotlib"):
        skipped.append(f"--png skipped: matplotlib is not installed ({INSTALL_HINT})")
        png = None
    for line in skipped:
        print(line, file=sys.stderr)
    return run, png


class NvtxRanges:
    """``wrap(name, fn)``: ``fn`` itself when ranges are off, else ``fn`` inside an NVTX push/pop
    range called exactly ``name`` (the op's shapes are in the benchmark's output, not the name,
    so ``ncu --nvtx --nvtx-include "cute_kernels.paged_decode/"`` selects it)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._nvtx = None
        if enabled:
            import nvtx

            self._nvtx = nvtx

    def wrap(self, name: str, fn: Callable):
        if not self.enabled:
            return fn
        push, pop = self._nvtx.push_range, self._nvtx.pop_range

        def ranged(*args, **kwargs):
            push(message=name)
            try:
                return fn(*args, **kwargs)
            finally:
                pop()

        return ranged


def field_value(text: str) -> int | bool | str:
    """A tuning field's value on a command line: an integer, ``true`` / ``false`` (any case), else
    the text (e.g. ``backend=sm80``, ``smem_target=sm_80``); surrounding spaces are ignored."""
    text = text.strip()
    flags = {"true": True, "false": False}
    if text.lower() in flags:
        return flags[text.lower()]
    return int(text) if text.lstrip("-").isdigit() else text


def parse_fields(spec: str, sep: str = ",", value: Callable[[str], Any] = int) -> dict[str, Any]:
    """``'a=1,b=2'`` -> ``{'a': 1, 'b': 2}``: ``sep``-separated ``FIELD=VALUE`` items, each value
    read by ``value`` (default: an integer). ``ValueError`` naming an item that is not
    ``FIELD=VALUE``, a value ``value`` refuses, or a field given twice."""
    fields: dict[str, Any] = {}
    for item in filter(None, spec.split(sep)):
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier():
            raise ValueError(f"{item!r} is not FIELD={'INTEGER' if value is int else 'VALUE'}")
        if name in fields:
            raise ValueError(f"{name} given twice in {spec!r}")
        try:
            fields[name] = value(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {text!r}") from None
    return fields


def parse_variants(text: str, sep: str = ",") -> list[dict[str, int]]:
    """``'a=1,b=2;c=3;'`` -> ``[{'a': 1, 'b': 2}, {'c': 3}, {}]``: ``;``-separated variants of
    ``sep``-separated integer fields (an empty variant is the default config). ``ValueError``
    naming a field that is not ``name=integer`` or is given twice in one variant, or a variant
    given twice."""
    variants: list[dict[str, int]] = []
    for spec in text.split(";"):
        fields = parse_fields(spec, sep)
        if fields and fields in variants:  # it would be timed twice
            raise ValueError(f"variant {spec!r} given twice")
        variants.append(fields)
    return variants


# ----------------------------------------------------------------------------------------------
# argument checks, made before the GPU check and before anything is timed: a bad value is one
# line naming the flag (docs/design/inputs.md#the-classes)
# ----------------------------------------------------------------------------------------------


def comma_list(flag: str, text: str, *, allow_empty: bool = False) -> list[str]:
    """The non-empty items of a comma list; ``ValueError`` naming ``flag`` when there is none
    (unless ``allow_empty``: ``--peers ''`` times ours alone) or an item is given twice (it would
    be timed twice)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items and not allow_empty:
        raise ValueError(f"{flag}: nothing in {text!r}")
    twice = next((x for i, x in enumerate(items) if x in items[:i]), None)
    if twice is not None:
        raise ValueError(f"{flag}: {twice!r} given twice")
    return items


def choice_list(flag: str, text: str, allowed, *, allow_empty: bool = False) -> tuple[str, ...]:
    """A comma list of members of ``allowed`` (a typo is refused, not mapped to a default)."""
    items = comma_list(flag, text, allow_empty=allow_empty)
    bad = next((x for x in items if x not in allowed), None)
    if bad is not None:
        raise ValueError(f"{flag}: {bad!r} is not one of {', '.join(allowed)}")
    return tuple(items)


def int_list(flag: str, text: str) -> tuple[int, ...]:
    """A comma list of positive integers (``plans.args.check_positive_ints`` names the flag)."""
    out = []
    for x in comma_list(flag, text):
        try:
            value = int(x)
        except ValueError:
            raise ValueError(f"{flag}: {x!r} is not an integer") from None
        check_positive_ints(**{flag: value})
        out.append(value)
    return tuple(out)


def select_named(flag: str, text: str | None, table: list[tuple]) -> list[tuple]:
    """The rows of ``table`` (name first) whose name contains one of the comma-separated keys of
    ``text`` (all when None); a key that matches no name is refused (it would time nothing, or
    everything)."""
    if text is None:
        return list(table)
    keys = comma_list(flag, text)
    for key in keys:
        if not any(key in row[0] for row in table):
            raise ValueError(f"{flag}: {key!r} matches no shape; the shapes: {'; '.join(r[0] for r in table)}")
    return [row for row in table if any(k in row[0] for k in keys)]


def check_unused(why: str, given: dict[str, bool]) -> None:
    """Refuse the first flag of ``given`` (flag -> whether the command line set it) that the
    chosen mode does not read: it would be ignored without a word."""
    flag = next((f for f, was_given in given.items() if was_given), None)
    if flag is not None:
        raise ValueError(f"{flag}: not taken {why}")


def check_output_path(flag: str, path: str | None) -> None:
    """``path`` (None: not asked for) a file this process can write: not empty, not a directory,
    in a directory that exists and is writable. Checked first, so that a run does not end in a
    traceback after it measured everything."""
    if path is None:
        return
    if not path.strip():
        raise ValueError(f"{flag}: empty path")
    if os.path.isdir(path):
        raise ValueError(f"{flag}: {path!r} is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag}: {path!r}: directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag}: {path!r} is not writable")


def write_json(path: str | None, result) -> None:
    """Write ``result`` to ``path`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def write_partial(path: str | None, **result) -> None:
    """The rows so far, marked ``"partial": true``, rewritten after each row: a run cut short (a
    time limit, a crash) keeps what it measured; the final :func:`write_json` replaces it."""
    write_json(path, dict(result, partial=True))


def bar_chart(path: str, rows: list[dict], names, key: str, ylabel: str, title: str, *, row_width: float = 1.2,
              hline: float | None = None) -> None:
    """One group of bars per row (labelled ``shape`` / ``kv``), one bar per entry of ``names`` with the
    row's ``<name><key>`` value (0 when absent), written as a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\n{r['kv']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * row_width), 5))
    width = 0.8 / len(names)
    for i, p in enumerate(names):
        ax.bar([x + i * width for x in range(len(rows))], [r.get(p + key, 0.0) for r in rows], width, label=p)
    if hline is not None:
        ax.axhline(hline, color="k", ls="--", lw=0.8)
    ax.set_ylabel(ylabel)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
