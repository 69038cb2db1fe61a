"""``cute-kernels bench sm80 decode|prefill``: the portable SM80-class kernels (forced on any arch,
the H200 included) side by side with FlashInfer's FA2-based paths, one process.

- decode: ``sm80.decode`` against ``BatchDecodeWithPagedKVCacheWrapper`` (its default CUDA-core
  decode and, as ``fi_tc``, its tensor-core path), and against ``sm90.decode`` on SM90; percent
  of the read roofline (visible KV + Q + O over the measured read bandwidth); the FP8 / BF16
  time ratio per shape.
- prefill: ``sm80.prefill`` against ``BatchPrefillWithPagedKVCacheWrapper(backend="fa2")``;
  TFLOP/s count only the causal work.

Times are CUDA-graph replays. Outputs are checked against the fp32 reference (relative error).
"""

from __future__ import annotations

import math
import traceback

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops.paged_decode import tuning_override
from cute_kernels.ops.paged_prefill import tuning_override as prefill_override
from cute_kernels.plans.sm80 import PREFILL_D128_TW64, PREFILL_D128_TW64S, PREFILL_D256_W8
from cute_kernels.testing import make_paged_decode_case, make_paged_prefill_case, rel_err

from .decode import SHAPES as DECODE_SHAPES
from .harness import (
    SM80_PLUS,
    check_unused,
    choice_list,
    field_value,
    parse_fields,
    select_named,
    write_json,
    write_partial,
)
from .timing import bench_setup, time_graph

NEEDS = SM80_PLUS

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
PAGE = 16
KV_DTYPES = ("bf16", "fp8")
# tilings compared with the plan's (``sm80`` column); ``--variants name:field=value+field=value;...``
# adds more. ``m1`` / ``noxor``: the forms the plan chose before its measured defaults (at D 256
# ``m1`` is the plan's form; the ones before are ``tw64`` and ``tw16``), docs/design/sm80.md#defaults
# `lean`: the default tiling with the opt-in lean softmax (docs/design/sm80.md#the-lean-softmax-opt-in)
# `kvfirst`: the default tiling with the ring's first copies issued before Q is staged (opt-in,
# docs/design/sm80.md#kv-copies-before-the-query)
# `hfirst` / `rfirst`: the grid with the KV heads / the row tiles fastest, whichever the plan's form
# is not (docs/design/sm80.md#the-grid-order); `leanhf`: the lean softmax in the heads-first grid
PREFILL_VARIANTS = {"m1": dict(m_tiles=1), "tw64": dict(m_tiles=1, tw=64, q_regs=False),
                    "lean": dict(lean_softmax=True), "kvfirst": dict(kv_first=True),
                    "hfirst": dict(heads_first=True), "rfirst": dict(heads_first=False),
                    "leanhf": dict(lean_softmax=True, heads_first=True)}
# head dim 256 only: the plan's form on SM90 (`sm80`, `m1`) is PREFILL_D256_TW32X, `tw16` the one
# before (per-address ldmatrix); `a100` the four-warp form with its ring sized for sm_80 and `w8`
# sm_80's default (PREFILL_D256_W8; one CTA per SM on the H200 as on the A100); `w8t64` eight warps
# with two 64-token stages (192 KB: the 227 KB targets only), docs/design/sm80.md#eight-warps-at-head-dim-256
PREFILL_D256_VARIANTS = {"tw16": dict(m_tiles=1, tw=16), "a100": dict(smem_target="sm_80"), "w8": PREFILL_D256_W8,
                         "w8t64": dict(PREFILL_D256_W8, tw=64)}
# head dim 128 only: 128-row CTAs with 64-token stages (FA2's 128 x 64 tile), and the same with the
# row statistics in shared memory and the one-base gather (spill-free on the SM80-class targets),
# docs/design/sm80.md#64-token-stages-at-head-dim-128
PREFILL_D128_VARIANTS = {"m2t64": PREFILL_D128_TW64, "m2t64s": PREFILL_D128_TW64S}
# `fused`: the opt-in merge in the split launch's last CTA (the same build where the plan does not
# split), docs/design/sm80.md#the-fused-merge
DECODE_VARIANTS: dict[str, dict] = {"noxor": dict(ldsm_xor=False), "lean": dict(lean_softmax=True),
                                    "fused": dict(fused_merge=True), "kvfirst": dict(kv_first=True)}


def parse_named_variants(text: str | None) -> dict[str, dict]:
    """``"a:tw=32+stages=4;b:ldsm_xor=true"`` -> ``{"a": {"tw": 32, "stages": 4}, "b": {"ldsm_xor": True}}``
    (values: integers, ``true`` / ``false``, else the text: ``smem_target=sm_80`` sizes the ring, and
    so the CTAs per SM, for sm_80's shared memory)."""
    out: dict[str, dict] = {}
    for spec in (text or "").split(";"):
        if spec:
            name, _, fields = spec.partition(":")
            if not name.strip() or name in out:
                raise ValueError(f"--variants: {spec!r}: " + ("a name is missing before ':'" if not name.strip()
                                                               else f"{name!r} given twice"))
            try:
                out[name] = parse_fields(fields, "+", field_value)
            except ValueError as e:
                raise ValueError(f"--variants: {spec!r}: {e}") from None
    return out


def kv_of(args) -> str:
    """The ``--kv`` text of a decode run (:data:`KV_DTYPES` when not given)."""
    return ",".join(KV_DTYPES) if args.kv is None else args.kv


def check_arguments(args) -> None:
    """Every value of the command line, before the GPU check (:func:`cute_kernels.bench.main`): the
    cache dtypes, the shape names, and the ``--variants`` fields against the portable kernel's
    tuning fields (a typo would be reported on every row after its timing)."""
    from cute_kernels.jit.spec import check_override
    from cute_kernels.ops.paged_decode import check_tuning_override
    from cute_kernels.plans.sm80 import Sm80PrefillConfig

    if args.what == "decode":
        choice_list("--kv", kv_of(args), KV_DTYPES)
    else:
        check_unused("by sm80 prefill (its cache is bf16)", {"--kv": args.kv is not None})
    select_named("--shapes", args.shapes, DECODE_SHAPES if args.what == "decode" else PREFILL_SHAPES)
    builtin = DECODE_VARIANTS if args.what == "decode" else {**PREFILL_VARIANTS, **PREFILL_D256_VARIANTS,
                                                              **PREFILL_D128_VARIANTS}
    for name, fields in parse_named_variants(args.variants).items():
        if name in builtin:  # it would replace the built-in tiling under the same name
            raise ValueError(f"--variants: {name!r} is a built-in variant ({', '.join(builtin)}); name it otherwise")
        try:
            if args.what == "decode":
                check_tuning_override("sm80.decode", fields)
            else:
                check_override(Sm80PrefillConfig, fields, fixed=("target",), extra=("smem_target",))
        except (ValueError, TypeError) as e:
            raise ValueError(f"--variants: {name}: {str(e).removeprefix('tuning_override: ')}") from None


# name, Hq, Hkv, D, B, q_len, prefix (the SM90 prefill benchmark's shapes)
PREFILL_SHAPES = [
    ("B1 S4096", 32, 8, 128, 1, 4096, 0),
    ("B1 S16384", 32, 8, 128, 1, 16384, 0),
    ("B4 S8192", 32, 8, 128, 4, 8192, 0),
    ("B1 q2048 ctx32768", 32, 8, 128, 1, 2048, 32768 - 2048),
    ("B8 q512 ctx16384", 32, 8, 128, 8, 512, 16384 - 512),
    ("B16 S512", 32, 8, 128, 16, 512, 0),
    ("D64 B1 S8192", 32, 8, 64, 1, 8192, 0),
    ("D256 B1 S8192", 16, 8, 256, 1, 8192, 0),
]


def _fi_pages(case):
    """FlashInfer's paged-KV description of a case: (indptr, indices, last page lengths)."""
    lens = case.seq_lens.tolist()
    n = [math.ceil(L / PAGE) for L in lens]
    indptr = torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    indices = torch.cat([case.block_table[b, : n[b]] for b in range(len(lens))]).int()
    last = torch.tensor([L - (k - 1) * PAGE for L, k in zip(lens, n)], dtype=torch.int32, device="cuda")
    return indptr, indices, last


def _fi_decode(case, sm_scale, tensor_cores):
    import flashinfer

    indptr, indices, last = _fi_pages(case)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, case.kv_layout, use_tensor_cores=tensor_cores)
    w.plan(indptr, indices, last, case.q.shape[1], case.meta["num_kv_heads"], case.meta["head_dim"], PAGE,
           q_data_type=case.q.dtype, kv_data_type=case.kv_cache.dtype, sm_scale=sm_scale)
    out = torch.empty_like(case.q)
    return lambda: w.run(case.q, case.kv_cache, out=out, k_scale=case.k_scale, v_scale=case.v_scale), out


def decode_case(shape: tuple, kvn: str, g):
    """``(case, bytes read)`` of a decode shape (``DECODE_SHAPES`` row) with a ``kvn`` ("bf16" / "fp8")
    cache: the visible K/V plus the query read and the output written (the roofline's bytes)."""
    _, Hq, Hkv, D, B, ctx, q_len = shape
    fp8 = kvn == "fp8"
    case = make_paged_decode_case(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=PAGE,
                                  seq_lens=ctx, kv_dtype=FP8 if fp8 else BF16, q_len=q_len, generator=g,
                                  poison_tail=False, k_scale=0.0625 if fp8 else 1.0, v_scale=0.03125 if fp8 else 1.0)
    return case, case.visible_kv_bytes() + 2 * case.q.numel() * case.q.element_size()


def bench_decode(kv_dtypes=("bf16", "fp8"), shapes=None, out_json=None):
    bw, g = bench_setup()
    rows = []
    for shape in shapes or DECODE_SHAPES:
        name, Hq, Hkv, D, B, ctx, q_len = shape
        for kvn in kv_dtypes:
            case, nbytes = decode_case(shape, kvn, g)
            ref = reference.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, **case.kwargs())
            row = dict(shape=name, kv=kvn, kv_mb=case.visible_kv_bytes() / 1e6)
            out = torch.empty_like(case.q)

            def ours(backend="sm80", **fields):
                def fn():
                    with tuning_override(backend=backend, **fields):
                        cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                                  **case.kwargs())
                return fn, out

            entries = {"sm80": ours, "sm80_bits": lambda: ours(widen="bits") if kvn == "fp8" else None,
                       **{f"sm80_{k}": (lambda f=f: ours(**f)) for k, f in DECODE_VARIANTS.items()},
                       "sm90": lambda: ours(backend=None) if torch.cuda.get_device_capability() == (9, 0) else None,
                       "fi": lambda: _fi_decode(case, D ** -0.5, False) if q_len == 1 else None,
                       "fi_tc": lambda: _fi_decode(case, D ** -0.5, True) if q_len == 1 else None}
            for pname, make in entries.items():
                try:
                    made = make()
                    if made is None:
                        continue
                    fn, o = made
                    fn()
                    torch.cuda.synchronize()
                    t = time_graph(fn)
                    row[pname + "_us"] = t * 1e6
                    row[pname + "_roof"] = 100 * nbytes / bw / t
                    row[pname + "_err"] = rel_err(o.float(), ref.float())
                except Exception as e:
                    row[pname + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    if pname == "sm80":
                        traceback.print_exc()
            rows.append(row)
            write_partial(out_json, read_bw=bw, rows=rows)
            print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    for r in rows:  # FP8 time over BF16 time of the same shape
        if r["kv"] == "fp8":
            b = next((x for x in rows if x["shape"] == r["shape"] and x["kv"] == "bf16"), None)
            if b and "sm80_us" in b and "sm80_us" in r:
                r["fp8_over_bf16"] = r["sm80_us"] / b["sm80_us"]
                print(f"{r['shape']}: sm80 FP8 / BF16 time {r['fp8_over_bf16']:.2f}")
    write_json(out_json, dict(read_bw=bw, rows=rows))
    return rows


def _causal_flops(q_lens, prefixes, Hq, D):
    return sum(4 * D * Hq * (n * p + n * (n + 1) / 2) for n, p in zip(q_lens, prefixes))


def _fi_prefill(c, qsl, q_lens, Hq, Hkv, D):
    import flashinfer

    kv_indptr, indices, last = _fi_pages(c)
    ws = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, c.kv_layout, backend="fa2")
    w.plan(qsl, kv_indptr, indices, last, Hq, Hkv, D, PAGE, causal=True, q_data_type=c.q.dtype,
           kv_data_type=c.kv_cache.dtype)
    out = torch.empty_like(c.q)
    return lambda: w.run(c.q, c.kv_cache, out=out), out


def bench_prefill(shapes=None, out_json=None, check=True):
    _, g = bench_setup()
    rows = []
    for name, Hq, Hkv, D, B, q_len, prefix in shapes or PREFILL_SHAPES:
        q_lens, prefixes = [q_len] * B, [prefix] * B
        c = make_paged_prefill_case(reqs=list(zip(prefixes, q_lens)), num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                    page_size=PAGE, generator=g, poison_tail=False)
        qsl = c.query_start_loc
        flops = _causal_flops(q_lens, prefixes, Hq, D)
        row = dict(shape=name)
        out = torch.empty_like(c.q)
        def ours(**fields):
            def fn():
                with prefill_override(backend="sm80", **fields):
                    cute_kernels.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl, max_query_len=q_len,
                                               out=out)
            return fn, out

        ref = reference.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, qsl) if (
            check and B * q_len <= 4096) else None
        variants = {**PREFILL_VARIANTS, **{256: PREFILL_D256_VARIANTS, 128: PREFILL_D128_VARIANTS}.get(D, {})}
        entries = [("sm80", ours)] + [(f"sm80_{k}", lambda f=f: ours(**f)) for k, f in variants.items()]
        entries.append(("fi_fa2", lambda: _fi_prefill(c, qsl, q_lens, Hq, Hkv, D)))
        for pname, made in entries:
            try:
                fn, o = made()
                fn()
                torch.cuda.synchronize()
                t = time_graph(fn, reps=3, rounds=5)
                row[pname + "_us"] = t * 1e6
                row[pname + "_tflops"] = flops / t / 1e12
                if ref is not None:
                    row[pname + "_err"] = rel_err(o.float(), ref.float())
            except Exception as e:
                row[pname + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                if pname == "sm80":
                    traceback.print_exc()
        if "sm80_us" in row and "fi_fa2_us" in row:
            row["speedup"] = row["fi_fa2_us"] / row["sm80_us"]
        rows.append(row)
        write_partial(out_json, rows=rows)
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    write_json(out_json, dict(rows=rows))
    return rows


def add_arguments(p) -> None:
    p.add_argument("what", nargs="?", default="decode", choices=["decode", "prefill"], help="decode (default) or prefill")
    p.add_argument("--kv", default=None, help=f"decode: cache dtypes (default: {','.join(KV_DTYPES)})")
    p.add_argument("--shapes", default=None, help="comma-separated substrings selecting shapes by name")
    p.add_argument("--variants", default=None,
                   help="extra tilings: name:field=value+field=value;... (value: an integer, true or false)")


def main(args) -> None:
    (DECODE_VARIANTS if args.what == "decode" else PREFILL_VARIANTS).update(parse_named_variants(args.variants))
    if args.what == "decode":
        bench_decode(choice_list("--kv", kv_of(args), KV_DTYPES), select_named("--shapes", args.shapes, DECODE_SHAPES),
                     args.json)
    else:
        bench_prefill(select_named("--shapes", args.shapes, PREFILL_SHAPES), args.json)
