"""``cute-kernels profile decode|prefill|qsa|merge|layer [--shape k=v,...]``: Nsight Compute on one
op call, selected by its NVTX range, with a short report (markdown and JSON) next to the
``.ncu-rep``.

Two halves: :func:`main` (the command) checks the machine, runs ncu on this module's ``target``
sub-command and turns the raw page of the report into the summary (:mod:`cute_kernels.bench.ncu`);
:func:`target` (the profiled process) builds the shape with the benchmarks' builders, warms the op
up (compiles, sizes its workspaces), then between ``cudaProfilerStart``/``Stop`` runs the roofline
copy and one call. Design: docs/design/benchmarks.md#profiling-one-op.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from dispatch import UnsupportedConfig, plan

from . import ncu
from .harness import SM80_PLUS, SM90, GpuNeed, check_output_path, gpu_problem

NEEDS: dict[str, GpuNeed] = {"decode": SM90, "prefill": SM90, "qsa": SM90, "merge": SM80_PLUS, "layer": SM90}
# the planned phase of each WHAT that calls an attention op (on the SM90 GPU NEEDS names): a shape
# no kernel takes is refused before ncu starts (the op would refuse it inside the profiled process)
PHASES = {"decode": "decode", "prefill": "prefill", "layer": "decode"}
# the ops whose ``tuning_override`` --tuning forces (e.g. backend=sm80: the portable kernel on this
# GPU; lean_softmax=false: the prefill's opt-out), docs/design/benchmarks.md#profiling-one-op
TUNABLE = ("decode", "prefill")
WARMUP_CALLS = 3  # before the profiled call: compiles, sizes workspaces, loads modules
COPY_BYTES = 256 << 20  # the roofline copy: 256 MiB read, 256 MiB written


# ---------------------------------------------------------------------------------------------
# the profiled process
# ---------------------------------------------------------------------------------------------


def _decode(shape: dict, g) -> Callable[[], Any]:
    import torch

    import cute_kernels
    from cute_kernels.testing import make_paged_decode_case

    kv = torch.float8_e4m3fn if shape["kv"] == "fp8" else torch.bfloat16
    scales = dict(k_scale=0.0625, v_scale=0.03125) if shape["kv"] == "fp8" else {}
    case = make_paged_decode_case(batch=shape["B"], num_q_heads=shape["Hq"], num_kv_heads=shape["Hkv"],
                                  head_dim=shape["D"], page_size=shape["page"], seq_lens=shape["ctx"], kv_dtype=kv,
                                  q_len=shape["q_len"], generator=g, poison_tail=False, **scales)
    out = torch.empty_like(case.q)
    return lambda: cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                             **case.kwargs())


def _qsa(shape: dict, g) -> Callable[[], Any]:
    import torch

    from .qsa import Problem, problem_geometry

    kv = torch.float8_e4m3fn if shape["kv"] == "fp8" else torch.bfloat16
    prefill = shape["kind"] == "prefill"  # parse_shape took kind from ncu.CHOICES
    problem = Problem(**problem_geometry(shape["kind"], shape["n"]), kv_dtype=kv, copies=1, seed=shape["n"],
                      selection=shape["selection"] if prefill else "independent", use_gate=bool(shape["gate"]))
    return lambda: problem.call(0, prefill)


def _merge(shape: dict, g) -> Callable[[], Any]:
    import torch

    import cute_kernels

    S, N, H, D = shape["S"], shape["N"], shape["H"], shape["D"]
    po = torch.randn(S, N, H, D, device="cuda", generator=g)
    pl = torch.randn(S, N, H, device="cuda", generator=g) * 4
    out = torch.empty(N, H, D, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(N, H, device="cuda")
    return lambda: cute_kernels.merge_states(po, pl, out=out, out_lse=lse)


def _layer(shape: dict, g) -> Callable[[], Any]:
    from .layer import layer_step

    step = layer_step(g, Hq=shape["Hq"], Hkv=shape["Hkv"], D=shape["D"], B=shape["B"], ctx=shape["ctx"],
                      page=shape["page"], kv=shape["kv"])
    return step.forward


def _prefill(shape: dict, g) -> Callable[[], Any]:
    import torch

    import cute_kernels
    from cute_kernels.testing import make_paged_prefill_case, per_tensor_q_scale

    kv = torch.float8_e4m3fn if shape["kv"] == "fp8" else torch.bfloat16
    scales = dict(k_scale=0.0625, v_scale=0.03125) if shape["kv"] == "fp8" else {}
    case = make_paged_prefill_case(reqs=[(shape["prefix"], shape["new"])] * shape["B"], num_q_heads=shape["Hq"],
                                   num_kv_heads=shape["Hkv"], head_dim=shape["D"], page_size=shape["page"],
                                   kv_dtype=kv, generator=g, poison_tail=False, **scales)
    q, extra = case.q, {}
    if shape["q"] != "bf16":  # the FP8-query kinds, quantized as bench prefill's ours_fp8q / ours_fp8x2
        q_scale = per_tensor_q_scale(case.q)
        q, q_lo = cute_kernels.quantize_query(case.q, q_scale, residual=True)
        extra = dict(q_scale=q_scale, **(dict(q_residual=q_lo) if shape["q"] == "fp8x2" else {}))
    out = torch.empty_like(case.q)
    return lambda: cute_kernels.paged_prefill(q, case.kv_cache, case.block_table, case.seq_lens,
                                              case.query_start_loc, max_query_len=case.max_query_len, out=out,
                                              **extra, **case.kwargs())


BUILDERS: dict[str, Callable[[dict, Any], Callable[[], Any]]] = {
    "decode": _decode, "prefill": _prefill, "qsa": _qsa, "merge": _merge, "layer": _layer}


def _override(what: str, tuning: dict):
    """The op's ``tuning_override`` context for ``tuning`` (a null context without fields)."""
    if not tuning:
        return contextlib.nullcontext()
    if what == "decode":
        from cute_kernels.ops.paged_decode import tuning_override
    else:
        from cute_kernels.ops.paged_prefill import tuning_override
    return tuning_override(**tuning)


def target(what: str, shape: dict, tuning: dict | None = None) -> None:
    """Build ``what`` at ``shape``, warm it up, then profile the roofline copy and one call, every
    call under ``tuning`` (the op's ``tuning_override`` fields)."""
    with _override(what, tuning or {}):
        _profiled(what, shape)


def _profiled(what: str, shape: dict) -> None:
    import nvtx
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    call = BUILDERS[what](shape, g)
    src = torch.randn(COPY_BYTES // 2, device="cuda", generator=g).to(torch.bfloat16)
    dst = torch.empty(src.shape, dtype=torch.float16, device="cuda")  # a cast: a copy kernel, not a memcpy
    for _ in range(WARMUP_CALLS):
        call()
    dst.copy_(src)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    # the copy inside a range of the op's name, so that the op's one include filter selects it too
    nvtx.push_range(message=f"cute_kernels.{ncu.OPS[what]}")
    nvtx.push_range(message=ncu.ROOFLINE_RANGE)
    dst.copy_(src)
    nvtx.pop_range()
    nvtx.pop_range()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def build_parser(what: str) -> argparse.ArgumentParser:
    defaults = ncu.shape_text(ncu.SHAPES[what])
    p = argparse.ArgumentParser(prog=f"cute-kernels profile {what}",
                                description=f"Nsight Compute on one cute_kernels.{ncu.OPS[what]} call")
    p.add_argument("--shape", default="", metavar="K=V,...",
                   help=f"shape keys over the defaults {defaults} (default: the defaults)")
    p.add_argument("--out", default=f"cute-kernels-profile-{what}", metavar="STEM",
                   help="writes STEM.ncu-rep, STEM.csv (ncu's raw page), STEM.json and STEM.md "
                        "(default: %(default)s)")
    p.add_argument("--ncu", default="ncu", help="the Nsight Compute command (default: %(default)s)")
    p.add_argument("--ncu-args", default="", metavar="ARGS",
                   help="more ncu arguments, e.g. '--set full' or '--import-source yes' (default: none)")
    if what in TUNABLE:
        p.add_argument("--tuning", default="", metavar="K=V,...",
                       help=f"fields of cute_kernels.{ncu.OPS[what]}'s tuning_override for the profiled call, e.g. "
                            "backend=sm80 (the portable kernel on this GPU)"
                            + (" or lean_softmax=false (the scaled-score softmax)" if what == "prefill" else "")
                            + " (default: none)")
    return p


def tuning_fields(what: str, text: str, shape: dict) -> dict[str, Any]:
    """``--tuning`` as the op's ``tuning_override`` fields (integers, true / false, else text),
    checked against the kernel the profiled call runs on an SM90 GPU; ``ValueError`` naming
    ``--tuning`` otherwise."""
    from .harness import field_value, parse_fields

    try:
        fields = parse_fields(text, ",", field_value)
        backend = fields.get("backend")
        kv = "fp8_e4m3" if shape["kv"] == "fp8" else "bf16"
        if what == "decode":  # the ops' own kernel selection, for the GPU the command needs
            from cute_kernels.ops import paged_decode

            kernel = paged_decode.decode_kernel("sm_90a", "bf16", kv, backend)
            paged_decode.check_tuning_override(kernel.id, fields)
        elif fields:
            from cute_kernels.ops import paged_prefill

            q = "bf16" if shape["q"] == "bf16" else "fp8_e4m3"
            kernel = paged_prefill.prefill_kernel("sm_90a", q, kv, shape["Hq"] // shape["Hkv"], backend)
            paged_prefill.check_tuning_override(kernel.id, fields)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--tuning: {str(e).removeprefix('tuning_override: ')}") from None
    return fields


def check_planned(what: str, shape: dict) -> None:
    """``ValueError`` "--shape: <the planner's reason>" when no kernel of an SM90 GPU serves the
    shape (a head dim, page size or GQA ratio x q_len outside the kernels' limits)."""
    if what not in PHASES:
        return
    q = shape.get("q", "bf16")
    p = plan(arch="sm90", phase=PHASES[what], kv_cache_dtype=shape["kv"], model_dtype="bf16", head_dim=shape["D"],
             num_q_heads=shape["Hq"], num_kv_heads=shape["Hkv"], page_size=shape["page"],
             q_len=shape.get("q_len", 1), query_dtype="auto" if q == "bf16" else q)
    if p.is_fallback:
        raise ValueError(f"--shape: {p.reason.removeprefix('reference fallback: ')}")


def ncu_arguments(text: str) -> list[str]:
    """``--ncu-args`` split as a shell splits it (a quoted value stays one argument);
    ``ValueError`` naming the flag for unbalanced quotes, an option the ncu command line sets
    itself (``--export``, the NVTX filter, ...) or a ``--metrics`` without names."""
    try:
        args = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"--ncu-args: {e} in {text!r}") from None
    ncu.split_extra(args)  # an option the command sets itself, a --metrics without names
    return args


def _refuse(what: str, why: str) -> int:
    print(f"error: cute-kernels profile {what} {why}", file=sys.stderr)
    return 2


def main(what: str, argv: list[str], *, run: Callable[..., Any] = subprocess.run) -> int:
    """``cute-kernels profile WHAT ...``: 0 with the report written, 2 when this machine cannot
    profile (one line on stderr), 1 when ncu fails."""
    args = build_parser(what).parse_args(argv)
    try:  # the values first: a bad one is named on any machine, before the GPU check
        shape = ncu.parse_shape(what, args.shape)
        if what == "qsa":
            from .qsa_selection import SELECTIONS

            if shape["selection"] not in SELECTIONS:
                raise ValueError(f"--shape: selection must be one of {', '.join(SELECTIONS)}, "
                                 f"got {shape['selection']!r}")
        tuning = tuning_fields(what, args.tuning, shape) if what in TUNABLE else {}
        if "backend" not in tuning:  # a forced backend has its own limits: the op checks them
            check_planned(what, shape)
        check_output_path("--out", args.out)
        extra = ncu_arguments(args.ncu_args)
    except (ValueError, UnsupportedConfig) as e:
        return _refuse(what, str(e))
    problem = gpu_problem(SM80_PLUS if "backend" in tuning else NEEDS[what])  # the portable kernel: any SM80+
    if problem is not None:
        return _refuse(what, problem)
    if what == "prefill":
        from cute_kernels.registry import OPS

        if "paged_prefill" not in OPS:
            return _refuse(what, "needs the paged_prefill op, which this build does not have")
    exe = shutil.which(args.ncu)
    if exe is None:
        return _refuse(what, f"needs Nsight Compute: {args.ncu!r} is not on PATH (install it, or pass --ncu PATH)")
    stem = args.out
    cmd = ncu.ncu_command(what, ncu.shape_text(shape), stem, ncu=exe, python=sys.executable,
                          extra=extra, tuning=args.tuning if tuning else "")
    print(" ".join(cmd), file=sys.stderr, flush=True)
    if run(cmd).returncode != 0:
        print("error: ncu failed: its command and output are above", file=sys.stderr)
        return 1
    raw = run(ncu.import_command(f"{stem}.ncu-rep", ncu=exe), capture_output=True, text=True)
    if raw.returncode != 0:
        print(f"error: ncu --import failed: {raw.stderr.strip()[-500:]}", file=sys.stderr)
        return 1
    with open(f"{stem}.csv", "w") as f:
        f.write(raw.stdout)
    import torch

    report = ncu.build_report(ncu.parse_raw_csv(raw.stdout), what=what, shape=shape, tuning=tuning,
                              device=torch.cuda.get_device_name(), ncu_report=f"{stem}.ncu-rep")
    with open(f"{stem}.json", "w") as f:
        json.dump(report, f, indent=1)
    text = ncu.render_markdown(report)
    with open(f"{stem}.md", "w") as f:
        f.write(text)
    print(text)
    return 0


def _target_main(argv: list[str]) -> None:
    import os

    os.environ.setdefault("CUTE_KERNELS_NVTX", "1")  # the op ranges, whatever way ncu injects itself
    p = argparse.ArgumentParser(prog="python -m cute_kernels.bench.profile target")
    p.add_argument("what", choices=sorted(ncu.OPS))
    p.add_argument("--shape", default="")
    p.add_argument("--tuning", default="")
    a = p.parse_args(argv)
    shape = ncu.parse_shape(a.what, a.shape)
    target(a.what, shape, tuning_fields(a.what, a.tuning, shape) if a.tuning else None)


if __name__ == "__main__":
    if sys.argv[1:2] != ["target"]:
        sys.exit("usage: python -m cute_kernels.bench.profile target WHAT --shape K=V,... (run by cute-kernels "
                 "profile under ncu)")
    _target_main(sys.argv[2:])
