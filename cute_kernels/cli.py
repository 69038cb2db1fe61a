"""Command line: ``cute-kernels <command>`` (or ``python -m cute_kernels <command>``).

Commands live in :data:`COMMANDS` and are registered with :func:`command`. Each one imports what
it needs inside its run function: ``matrix`` and ``plan`` use only the pure-Python ``dispatch``
package, so they run instantly on a machine without a GPU, torch or the CuTe DSL. Commands that
compile or launch kernels must import ``cutlass``/``torch`` inside ``run`` for the same reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from dispatch import SUPPORTED_ARCHS, UnsupportedConfig, capability_table, parse_arch, plan

from .registry import PHASES

MATRIX_KV_DTYPES = ("bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Command:
    """One subcommand: ``add_arguments(parser)`` declares its flags, ``run(args)`` returns the exit code."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    flag_errors: bool = False  # its flags are the planner's arguments: errors name them as flags (flag_names)


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None], *,
            flag_errors: bool = False):
    """Decorator registering ``run`` as subcommand ``name``."""

    def register(run: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = Command(help, add_arguments, run, flag_errors)
        return run

    return register


def flag_names(message: str, add_arguments: Callable[[argparse.ArgumentParser], None]) -> str:
    """``message`` with each argument name of the planner's errors that is a flag of the command
    (``head_dim must``, ``kv_cache_dtype='fp9'``, ``num_kv_heads (8)``, ``got kv_cache_dtype bf16``) spelled as that flag
    (``--head-dim must``, ``--kv-cache-dtype='fp9'``, as ``compile --arch`` says it): the limits and their wording stay in
    dispatch/ and plans/, the command line's names here."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    for action in parser._actions:
        if action.option_strings:
            flag = action.option_strings[0]
            name = re.escape(action.dest)
            message = re.sub(rf"(?<![\w-]){name}(?=[=]| must\b| \()|(?<=\bgot ){name}(?= )", flag, message)
    return message


# ----------------------------------------------------------------------------------------------
# shared flags and formatting
# ----------------------------------------------------------------------------------------------


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default; unset options (None) and off flags say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) \
                and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


_ARCH_SPELLINGS = "sm_90a, sm90, 90, 9.0"


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dtype", default="bf16", help="the model's activation dtype: bf16 or fp16")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension D")
    p.add_argument("--num-q-heads", type=int, default=32, help="query heads")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _shape_kwargs(args: argparse.Namespace) -> dict:
    return dict(model_dtype=args.model_dtype, head_dim=args.head_dim, num_q_heads=args.num_q_heads,
                num_kv_heads=args.num_kv_heads, page_size=args.page_size)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]

    def line(cells):
        return "  ".join([c.ljust(w) for c, w in zip(cells, widths)] + [cells[-1]]).rstrip()

    return "\n".join([line(header), line(["-" * len(h) for h in header]), *map(line, rows)])


# ----------------------------------------------------------------------------------------------
# matrix
# ----------------------------------------------------------------------------------------------


@command("matrix", "arch x phase x KV-dtype table of the planned kernel and query dtype", _shape_args, flag_errors=True)
def run_matrix(args: argparse.Namespace) -> int:
    plans = [
        plan(arch=arch, phase=phase, kv_cache_dtype=kv, **_shape_kwargs(args))
        for arch in SUPPORTED_ARCHS for phase in PHASES for kv in MATRIX_KV_DTYPES
    ]
    if args.json:
        out = {"inputs": _shape_kwargs(args), "rows": [p.to_dict() for p in plans],
               "capabilities": capability_table()}
        print(json.dumps(out, indent=2))
        return 0
    p0 = plans[0]
    print(f"model {p0.model_dtype}, head_dim {p0.head_dim}, {p0.num_q_heads} q / {p0.num_kv_heads} kv heads "
          f"(GQA {p0.gqa_ratio}), page {p0.page_size}, q_len {p0.q_len}, {p0.kv_layout}\n")
    header = ["arch", "phase", "kv cache", "kernel", "query dtype", "q_scale applied", "reason"]
    rows = [[p.arch, p.phase, p.kv_cache_dtype, p.kernel, p.q_dtype, _yes(p.applies_q_scale), p.reason]
            for p in plans]
    print(format_table(header, rows))
    print("\narchs:")
    seen = set()
    for row in capability_table():
        if row["arch"] not in seen:
            seen.add(row["arch"])
            print(f"  {row['arch']:<6} {row['summary']}")
    return 0


# ----------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", required=True,
                   help=f"one of {' '.join(SUPPORTED_ARCHS)}, in any spelling ({_ARCH_SPELLINGS})")
    p.add_argument("--phase", required=True, help="prefill or decode")
    p.add_argument("--kv-cache-dtype", required=True, help="auto, bf16, fp16 or fp8")
    _shape_args(p)
    p.add_argument("--q-len", type=int, default=1, help="query tokens per request")
    p.add_argument("--kv-layout", default="HND", help="HND or NHD")
    p.add_argument("--backend", default=None, help="a kernel id or 'reference' (default: planned automatically)")
    p.add_argument("--query-dtype", default="auto",
                   help="auto, fp8: a kernel that computes QK in FP8, opt-in ones included, or fp8x2: the same on a "
                        "two-term query (codes and residual) (default: auto)")


@command("plan", "plan one attention call and explain the choice", _plan_args, flag_errors=True)
def run_plan(args: argparse.Namespace) -> int:
    p = plan(arch=args.arch, phase=args.phase, kv_cache_dtype=args.kv_cache_dtype, q_len=args.q_len,
             kv_layout=args.kv_layout, backend=args.backend, query_dtype=args.query_dtype, **_shape_kwargs(args))
    if args.json:
        print(json.dumps(p.to_dict(), indent=2))
        return 0
    kernel = f"{p.kernel} (reference fallback)" if p.is_fallback else p.kernel
    print(f"{p.arch} {p.phase}: kv cache {p.kv_cache_dtype}, model {p.model_dtype}, head_dim {p.head_dim}, "
          f"{p.num_q_heads} q / {p.num_kv_heads} kv heads, page {p.page_size}, q_len {p.q_len}, "
          f"{p.kv_layout}")
    print(f"kernel           {kernel}")
    print(f"query dtype      {p.q_dtype}")
    print(f"quantize query   {_yes(p.quantize_query)}")
    print(f"q_scale applied  {_yes(p.applies_q_scale)}")
    print(f"reason           {p.reason}")
    return 0


# ----------------------------------------------------------------------------------------------
# compile / bench: they import cutlass/torch inside run(), so `matrix` and `plan` never load them
# ----------------------------------------------------------------------------------------------


def _compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="sm_90a",
                   help=f"compile target, no GPU needed, in any spelling `plan` takes: {_ARCH_SPELLINGS}")
    p.add_argument("--kernel", default=None, help="only variants whose label contains this text (default: all)")
    p.add_argument("--ci", action="store_true", help="only the representative set the CPU test suite compiles")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--digests", default=None, metavar="FILE",
                   help="write the normalized-PTX digest of every compiled variant to FILE (JSON; entries of other archs kept)")
    p.add_argument("--check-digests", default=None, metavar="FILE",
                   help="compare every variant's normalized-PTX digest with FILE; fail on any difference")


@command("compile", "compile the registered kernel variants of an arch (the compile matrix) and show the "
         "instruction evidence", _compile_args)
def run_compile(args: argparse.Namespace) -> int:
    from .bench.harness import check_output_path
    from .jit.evidence import compile_with_evidence
    from .jit.ptx_digest import compare_digests, ptx_digest, read_digests, write_digests
    from .jit.spec import normalize_target
    from .registry import compile_matrix

    cc = parse_arch(args.arch, argument="--arch")  # the one arch parser, as in `plan`
    arch = normalize_target((cc.major, cc.minor))
    if args.kernel is not None and not args.kernel.strip():  # "" is in every label: it would compile them all
        raise UnsupportedConfig(f"--kernel {args.kernel!r}: empty text (leave --kernel out for every variant)")
    if args.digests is not None:  # before the compiles, not after them
        try:
            check_output_path("--digests", args.digests)
        except ValueError as e:
            raise UnsupportedConfig(str(e)) from None
    results, failed = [], 0
    digests: dict[str, str] = {}
    selection = [c for t, c in compile_matrix(ci=args.ci) if t == arch and (not args.kernel or args.kernel in c.label())]
    if args.kernel and not selection:  # a typo would otherwise report 0/0 variants compiled and pass
        raise UnsupportedConfig(f"--kernel {args.kernel!r} matches no variant of {arch}"
                                + (" in the CI set" if args.ci else ""))
    expected_digests = _digest_file(args.check_digests, read_digests) if args.check_digests else None
    # the digest-file entries this run speaks for: the selection when filtered, else all of the arch's
    ours = {f"{arch}:{c.label()}" for c in selection}
    owned = (lambda k: k in ours) if args.kernel or args.ci else (lambda k: k.startswith(f"{arch}:"))
    for config in selection:
        try:
            compiled, ev = compile_with_evidence(config, arch)
            # the compile matrix's rule: the evidence, the requested target, no register spills
            spills = "STL" in ev.sass or "LDL" in ev.sass
            ok = not ev.missing and ev.ptx_target == arch and not spills
            digests[f"{arch}:{config.label()}"] = ptx_digest(compiled.ptx or "")
            results.append(dict(kernel=config.label(), seconds=round(compiled.seconds, 2), ok=ok,
                                ptx=ev.ptx, sass=ev.sass, missing=ev.missing, registers=ev.registers, spills=spills))
        except Exception as e:  # report and go on: one broken variant must not hide the rest
            ok = False
            results.append(dict(kernel=config.label(), seconds=None, ok=False, error=f"{type(e).__name__}: {e}"))
        failed += not ok
        if not args.json:
            r = results[-1]
            status = "ok" if ok else "SPILL" if r.get("spills") else "FAIL"
            secs = f"{r['seconds']:6.2f}s" if r.get("seconds") is not None else "   -   "
            detail = r.get("error") or ev.summary()
            print(f"{status:5} {secs} {r['kernel']}\n            {detail}", flush=True)
    if args.json:
        print(json.dumps(dict(arch=arch, results=results), indent=1))
    else:
        print(f"{len(results) - failed}/{len(results)} variants compiled with their evidence and no spills for {arch}")
    if args.digests:  # update this arch's entries of an existing file, keep the others
        kept = read_digests(args.digests) if os.path.exists(args.digests) else {}
        write_digests(args.digests, {**{k: v for k, v in kept.items() if not owned(k)}, **digests})
    if args.check_digests:
        expected = {k: v for k, v in (expected_digests or {}).items() if owned(k)}
        diff = compare_digests(expected, digests)
        print("\n".join(diff) if diff else f"PTX digests of {len(digests)} variants match {args.check_digests}")
        failed += bool(diff)
    return 1 if failed else 0


def _digest_file(path: str, read) -> dict[str, str]:
    """The digests of ``--check-digests FILE``, read before anything compiles: a missing or
    malformed file is a one-line error (``UnsupportedConfig``), not a traceback after the run."""
    try:
        digests = read(path)
    except OSError as e:
        raise UnsupportedConfig(f"--check-digests {path}: {e.strerror or e}") from None
    except ValueError as e:  # json.JSONDecodeError
        raise UnsupportedConfig(f"--check-digests {path}: not a digest file (JSON): {e}") from None
    if not isinstance(digests, dict):
        raise UnsupportedConfig(f"--check-digests {path}: not a digest file (a JSON object of label: digest)")
    return digests


def _bench_args(p: argparse.ArgumentParser) -> None:
    from .bench import BENCHMARKS

    p.add_argument("what", choices=list(BENCHMARKS), help="which benchmark: " + "; ".join(
        f"{name}: {text}" for name, text in BENCHMARKS.items()))
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="the benchmark's own arguments (cute-kernels bench WHAT --help lists them)")


@command("bench", "run a benchmark (needs a GPU; the peers come with the bench extra)", _bench_args)
def run_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args.what, args.rest)


def _profile_args(p: argparse.ArgumentParser) -> None:
    from .bench.ncu import OPS

    p.add_argument("what", choices=list(OPS), help="which op: " + "; ".join(
        f"{name}: cute_kernels.{op}" for name, op in OPS.items()))
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="--shape K=V,..., --out STEM, --ncu PATH, --ncu-args ARGS (cute-kernels profile WHAT --help)")


@command("profile", "Nsight Compute on one op call selected by its NVTX range, with a short report (needs a GPU "
                    "and ncu)", _profile_args)
def run_profile(args: argparse.Namespace) -> int:
    from .bench.profile import main as profile_main

    return profile_main(args.what, args.rest)


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cute-kernels", description="cute-kernels: attention kernels for LLM serving.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help, formatter_class=HelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; an unsupported configuration prints ``error: ...`` and returns 2."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except UnsupportedConfig as e:
        cmd = COMMANDS[args.command]
        print(f"error: {flag_names(str(e), cmd.add_arguments) if cmd.flag_errors else e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader left early (`cute-kernels matrix --json | head`): stop quietly; point stdout
        # at devnull so that the interpreter's final flush does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
