"""``cute-kernels bench <what>``: the benchmarks shipped with the package (they need a GPU).

Each benchmark is a module of this package with ``NEEDS`` (the GPUs it runs on),
``add_arguments(parser)`` and ``main(args)``; :func:`main` parses its flags (plus the common
``--json PATH`` and ``--nvtx``), refuses in one line a bad value (``check_arguments(args)``, on
any machine) and then a machine that cannot run it, and runs it.
The method (CUDA-graph medians, read bandwidth measured in the same process, peers) is described
in docs/design/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .harness import KERNEL_BENCHMARKS, add_common_arguments, check_output_path, gpu_problem

# name -> what it measures (the module cute_kernels.bench.<name> runs it)
BENCHMARKS = {
    "decode": "SM90 paged decode side by side with FlashInfer XQA, the FlashInfer wrapper, FA4 and SDPA",
    "merge": "merge_states against the read bandwidth",
    "qsa": "QSA sparse attention, decode rows and prefill row tiles, against the gathered-bytes roofline",
    "layer": "quantize_query, write_kv_cache and one AttentionLayer decode step",
    "latency": "small-batch paged decode: graph and eager time per split count and launch form",
    "sm80": "the portable sm80.decode / sm80.prefill (forced on any arch) against FlashInfer's FA2 paths",
    "prefill": "SM90 paged prefill (both FP8 query paths) side by side with FA4, FlashInfer fa3 and SDPA",
    "serve": "a vLLM serving run replayed at the attention level (chunked prefill + decode steps, all layers): "
             "total, TTFT and TPOT attention time of AttentionLayer, FlashInfer + XQA, FlashInfer, FA4",
}


def build_parser(what: str):
    """``(parser, module)`` of benchmark ``what``."""
    module = importlib.import_module(f"{__name__}.{what}")
    p = argparse.ArgumentParser(prog=f"cute-kernels bench {what}", description=BENCHMARKS[what])
    module.add_arguments(p)
    add_common_arguments(p)
    return p, module


def check_arguments(module, args: argparse.Namespace) -> None:
    """The output paths (``--json``, ``--png``) and the benchmark's own values
    (``module.check_arguments``); ``ValueError`` naming the flag."""
    check_output_path("--json", args.json)
    check_output_path("--png", getattr(args, "png", None))
    check = getattr(module, "check_arguments", None)
    if check is not None:
        check(args)


def route(what: str, argv: list[str]) -> tuple[str, list[str]]:
    """``bench decode --kernel sm80 ARGS`` is ``bench sm80 decode ARGS`` (likewise prefill): the
    portable kernels against FlashInfer's FA2 paths. ``--kernel sm90`` (the default) or a value
    not routed stays with ``what``, whose parser names a bad value."""
    if what not in ("decode", "prefill"):
        return what, argv
    rest: list[str] = []
    kernel, i = None, 0
    while i < len(argv):
        if argv[i] == "--kernel" and i + 1 < len(argv):
            kernel, i = argv[i + 1], i + 2
        elif argv[i].startswith("--kernel="):
            kernel, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    if kernel in KERNEL_BENCHMARKS:
        return kernel, [what, *rest]
    return what, argv


def main(what: str, argv: list[str]) -> int:
    """Run benchmark ``what`` with its command-line arguments ``argv``; 2 when this machine
    cannot run it (the reason on one line of stderr)."""
    what, argv = route(what, argv)
    parser, module = build_parser(what)
    args = parser.parse_args(argv)
    try:  # the values first: a bad one is named on any machine, before the GPU check
        check_arguments(module, args)
    except ValueError as e:
        print(f"error: cute-kernels bench {what} {e}", file=sys.stderr)
        return 2
    problem = gpu_problem(module.NEEDS)
    if problem is not None:
        print(f"error: cute-kernels bench {what} {problem}", file=sys.stderr)
        return 2
    module.main(args)
    return 0
