"""Decode and merge calls for compute-sanitizer's memcheck, racecheck, synccheck and initcheck
(``profiling/run.sh sanitize``, ``profiling/sanitize_cases.sh``, tests/gpu/test_sanitize_gpu.py;
docs/design/testing.md#sanitizer), as named cases:

    python3 -m profiling.sanitize_decode --list
    compute-sanitizer --tool synccheck --report-api-errors no --error-exitcode 9 python3 -m profiling.sanitize_decode
    compute-sanitizer --tool synccheck ... python3 -m profiling.sanitize_decode --case fp8-b1-ctx1000-schedule

Without ``--case`` every case runs, in the table's order. Shapes include out-of-range page ids, a
partial last page, an empty request, lengths past the block table (and 2^31 - 1), split and no
split, HND and NHD, FP8 and BF16 caches, q_len 2, tensor scales, the cluster merge (DSMEM; 2, 3, 8
and 16 CTAs, and the one-request FP8 launch the schedule merges in 16-CTA clusters: B 1, context
1000, Hq 32 / Hkv 8, D 128; the 16-CTA ones also with the cluster-wide sync after the mbarrier
initialization, ``cluster_init_sync``) and the global fused merge (3 splits: staged in shared
memory; 40: more than the stages hold, merged from L2), the balanced schedule (a ragged batch in a wide table, 7 chunks
per KV head cutting requests into merged partials and 1 chunk walking every request; FP8 and BF16,
q_len 2); then the portable ``sm80.decode`` (forced) with the same bad page ids and lengths past
the table, both FP8 widenings, a ring sized for 99 KB, split and not, ``sm80.prefill`` on varlen
chunks against cached prefixes (with the LSE and scale tensors; causal without them in the tilings
the plan gives that call, D 128 and D 256, and sm_80's D 128 and D 256 defaults), and ``merge_states``: any out-of-bounds access or barrier misuse
fails the run.

Inputs are drawn on the CPU (only copies and the package's kernels run on the GPU), each case from
its own generator seeded from its name (printed), so a case draws the same inputs alone or after
others. The ``driver-first*`` cases replay the first call of the earlier single-function driver
exactly (its generator, its first CUDA work, the op modules loaded before it, the override around
the call), each variant leaving out one of those: run one per process, as a case's import order and
first CUDA work are what they vary. Every launch is announced on its own line first
(``case NAME: CALL``), so a sanitizer's log places a failure. ``--device cpu`` runs every call on
CPU tensors, through the float64 reference: it checks the cases themselves without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

import cute_kernels
from cute_kernels.plans.sm80 import PREFILL_D128_TW64S, PREFILL_D256_W8
from cute_kernels.testing import make_paged_decode_case, make_paged_prefill_case

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DTYPE = {FP8: "FP8", BF16: "BF16"}


@dataclass
class Ctx:
    """What a case runs with: its name (each launch line names it), the device of its tensors and
    its generator (CPU, seeded from the name)."""

    name: str
    device: str
    g: torch.Generator

    def call(self, what: str) -> None:
        print(f"case {self.name}: {what}", flush=True)

    def sync(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())  # stable across processes (str hashes are salted)


def _override(op: str, **fields: object) -> Any:
    # loaded here, not at the top: when the op modules (and the DSL with them) load relative to the
    # first CUDA work is one of the things the driver-first cases vary
    return importlib.import_module(f"cute_kernels.ops.{op}").tuning_override(**fields)


def _decode(ctx: Ctx, c, what: str, **kw) -> None:
    ctx.call(f"paged_decode {what}")
    cute_kernels.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **dict(c.kwargs(), **kw))


def _bad_pages(c) -> None:
    c.block_table[2, 3] = 10**6  # out-of-range page ids must be zero-filled, never read
    c.block_table[3, 5] = -5


def _four_requests(ctx: Ctx, g: torch.Generator, kv, layout: str):
    """B 4 (an empty request, a partial page, 300, 1000), Hq 32 / Hkv 8, D 128, page 16, two bad ids."""
    c = make_paged_decode_case(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=[0, 17, 300, 1000], kv_dtype=kv, kv_layout=layout, generator=g,
                               device=ctx.device)
    _bad_pages(c)
    return c


def driver_first(ctx: Ctx, *, early_import: bool = True, preamble: bool = True, override: bool = True,
                 fresh_draws: bool = False) -> None:
    """The earlier driver's first call as it ran: the prefill op module (and the DSL) loaded before
    any CUDA work, one trivial CUDA op and a pageable copy of ``randperm(50)`` drawn from the
    generator seeded 1, the decode op module loaded, then FP8 HND, num_splits 1 under
    ``tuning_override()`` (no fields) with the next draws of that generator. Each keyword leaves one
    of those out (``early_import=False``: no op module loads before the inputs are built;
    ``fresh_draws``: the ``randperm(50)`` comes from a second generator seeded 1, so the case's
    inputs are those of a generator seeded 1 with no draw before, as in stand-alone runs)."""
    if early_import:
        importlib.import_module("cute_kernels.ops.paged_prefill")
    g = ctx.g
    g.manual_seed(1)
    ctx.call("inputs from the generator reseeded 1 (the earlier driver's), not the name's")
    g_perm = torch.Generator().manual_seed(1) if fresh_draws else g
    if preamble:
        ctx.call("first CUDA work: ones(1).add_(1), synchronize")
        torch.ones(1, device=ctx.device).add_(1)
        ctx.sync()
        ctx.call("pageable host-to-device copy of randperm(50)")
        assert int(torch.randperm(50, generator=g_perm).to(ctx.device).sum()) == 1225
    else:
        torch.randperm(50, generator=g_perm)  # the same generator state, no CUDA work
    if early_import:
        importlib.import_module("cute_kernels.ops.paged_decode")  # where the earlier driver loaded it
    c = _four_requests(ctx, g, FP8, "HND")
    with _override("paged_decode") if override else contextlib.nullcontext():
        _decode(ctx, c, f"FP8 HND num_splits=1{' under tuning_override()' if override else ''}", num_splits=1)


def bad_pages(ctx: Ctx, kv, layout: str, splits: int, cluster: bool | None, **extra: object) -> None:
    """The four requests with bad page ids; ``cluster`` None leaves the merge to the plan;
    ``extra``: more override fields."""
    c = _four_requests(ctx, ctx.g, kv, layout)
    with _override("paged_decode", **({} if cluster is None else {"cluster": cluster}), **extra):
        _decode(ctx, c, f"{DTYPE[kv]} {layout} num_splits={splits} cluster={cluster}{_fields(extra)}",
                num_splits=splits)


def schedule_b1(ctx: Ctx, **extra: object) -> None:
    """The schedule's own choice for one FP8 request of 1000 tokens (Hq 32 / Hkv 8, D 128): a
    cluster merge of 16 CTAs; ``extra``: override fields."""
    c = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, seq_lens=1000,
                               generator=ctx.g, device=ctx.device)
    with _override("paged_decode", **extra) if extra else contextlib.nullcontext():
        _decode(ctx, c, f"FP8 B1 ctx1000, the schedule's split and merge{_fields(extra)}")


def _fields(extra: dict) -> str:
    return "".join(f" {k}={v}" for k, v in extra.items())


def past_table(ctx: Ctx, cluster: bool) -> None:
    """Lengths past the block table (2^31 - 1 too), q_len 2, tensor scales, 4 splits merged in a
    cluster or globally."""
    c = make_paged_decode_case(batch=3, num_q_heads=16, num_kv_heads=8, head_dim=128, page_size=16,
                               seq_lens=[200, 40, 90], q_len=2, generator=ctx.g, device=ctx.device)
    W = c.block_table.shape[1]
    c.seq_lens.copy_(torch.tensor([W * 16 + 3, 2**31 - 1, 90], dtype=torch.int32))
    scales = dict(k_scale=torch.tensor(0.0625, device=ctx.device), v_scale=torch.tensor([0.03125], device=ctx.device))
    with _override("paged_decode", cluster=cluster):
        _decode(ctx, c, f"lengths past the table, q_len 2, tensor scales, num_splits=4 cluster={cluster}",
                num_splits=4, **scales)


def balanced(ctx: Ctx, kv, q_len: int) -> None:
    """The balanced schedule on a ragged batch in a wide table: 7 chunks per KV head (requests cut
    and merged), then 1 chunk walking every request."""
    c = make_paged_decode_case(batch=9, num_q_heads=32, num_kv_heads=4, head_dim=128, page_size=16,
                               seq_lens=[0, 1, 700, 33, 1500, 2, 64, 5000, 17], kv_dtype=kv, q_len=q_len,
                               table_tokens=8192, generator=ctx.g, device=ctx.device)
    c.block_table[2, 3] = 10**6
    with _override("paged_decode", balanced=True):
        for chunks in (7, 1):
            _decode(ctx, c, f"balanced {DTYPE[kv]} q_len {q_len} chunks={chunks}", num_splits=chunks)


def sm80_decode(ctx: Ctx, kv, layout: str, splits: int, extra: dict) -> None:
    """The portable decode, forced, on the four requests with bad page ids and the empty one's
    length past the table."""
    c = _four_requests(ctx, ctx.g, kv, layout)
    c.seq_lens[0] = 2**31 - 1  # past the table: the positions past its capacity are not attended
    with _override("paged_decode", backend="sm80", **extra):
        _decode(ctx, c, f"sm80 {DTYPE[kv]} {layout} num_splits={splits} {extra}", num_splits=splits)


def sm80_prefill(ctx: Ctx, kv) -> None:
    """The portable prefill, forced, on varlen chunks against cached prefixes (an empty chunk
    included) with bad page ids."""
    c = make_paged_prefill_case(reqs=[(0, 37), (50, 0), (33, 130), (1000, 5)], num_q_heads=32, num_kv_heads=8,
                                head_dim=128, page_size=16, kv_dtype=kv, k_scale=0.5, v_scale=0.25, generator=ctx.g,
                                device=ctx.device)
    _bad_pages(c)
    with _override("paged_prefill", backend="sm80"):
        ctx.call(f"paged_prefill sm80 {DTYPE[kv]} varlen, return_lse")
        kv_cache: Any = c.kv_cache  # a tensor here (typed object in the case: a tensor or a pair)
        cute_kernels.paged_prefill(c.q, kv_cache, c.block_table, c.seq_lens, c.query_start_loc, max_query_len=130,
                                   k_scale=c.k_scale, v_scale=c.v_scale, return_lse=True)


def sm80_prefill_causal(ctx: Ctx, kv, head_dim: int, extra: dict) -> None:
    """The portable prefill's causal call without the LSE (the tilings the plan gives that call:
    128-row CTAs up to D 128, 512-byte rows at D 256), forced, varlen with bad page ids; ``extra``
    tuning fields select another arch's default (the D 128 margin form of sm_86 / sm_89 / sm_90a,
    sm_80's 32-token form with the lean softmax, sm_80's eight-warp D 256 form)."""
    c = make_paged_prefill_case(reqs=[(0, 37), (50, 0), (33, 130), (1000, 5)], num_q_heads=16,
                                num_kv_heads=8 if head_dim == 256 else 4, head_dim=head_dim, page_size=16,
                                kv_dtype=kv, generator=ctx.g, device=ctx.device)
    _bad_pages(c)
    with _override("paged_prefill", backend="sm80", **extra):
        ctx.call(f"paged_prefill sm80 {DTYPE[kv]} D {head_dim} causal varlen {extra}")
        kv_cache: Any = c.kv_cache
        cute_kernels.paged_prefill(c.q, kv_cache, c.block_table, c.seq_lens, c.query_start_loc, max_query_len=130)


def merge(ctx: Ctx) -> None:
    """merge_states of 5 splits, 4 heads, D 128 into BF16."""
    po = torch.randn(3, 5, 4, 128, generator=ctx.g).to(ctx.device)
    pl = torch.randn(3, 5, 4, generator=ctx.g).to(ctx.device)
    ctx.call("merge_states 5 splits -> bf16")
    cute_kernels.merge_states(po, pl, out_dtype=BF16)


# name -> case, in the order a full run takes them; the first is the earlier driver's first call
CASES: dict[str, Callable[[Ctx], None]] = {
    "driver-first": driver_first,
    "driver-first-no-override": partial(driver_first, override=False),
    "driver-first-late-import": partial(driver_first, early_import=False),
    "driver-first-no-preamble": partial(driver_first, preamble=False),
    "driver-first-fresh-draws": partial(driver_first, fresh_draws=True),
    "fp8-hnd-split1": partial(bad_pages, kv=FP8, layout="HND", splits=1, cluster=None),
    "fp8-nhd-split3": partial(bad_pages, kv=FP8, layout="NHD", splits=3, cluster=None),
    "bf16-hnd-split2": partial(bad_pages, kv=BF16, layout="HND", splits=2, cluster=None),
    "fp8-cluster8": partial(bad_pages, kv=FP8, layout="HND", splits=8, cluster=True),
    "fp8-cluster16": partial(bad_pages, kv=FP8, layout="HND", splits=16, cluster=True),
    # the cluster-wide sync after the mbarrier initialization (docs/design/sm90-decode.md#cluster-merge-exit)
    "fp8-cluster16-initsync": partial(bad_pages, kv=FP8, layout="HND", splits=16, cluster=True,
                                      cluster_init_sync=True),
    "fp8-global3": partial(bad_pages, kv=FP8, layout="HND", splits=3, cluster=False),
    "fp8-global40": partial(bad_pages, kv=FP8, layout="HND", splits=40, cluster=False),
    "fp8-b1-ctx1000-schedule": schedule_b1,
    "fp8-b1-ctx1000-initsync": partial(schedule_b1, cluster_init_sync=True),
    "past-table-cluster": partial(past_table, cluster=True),
    "past-table-global": partial(past_table, cluster=False),
    "balanced-fp8": partial(balanced, kv=FP8, q_len=1),
    "balanced-bf16-q2": partial(balanced, kv=BF16, q_len=2),
    "sm80-fp8-bits-split1": partial(sm80_decode, kv=FP8, layout="HND", splits=1, extra={"widen": "bits"}),
    "sm80-fp8-nhd-split5": partial(sm80_decode, kv=FP8, layout="NHD", splits=5, extra={}),
    "sm80-bf16-sm86-split3": partial(sm80_decode, kv=BF16, layout="HND", splits=3, extra={"smem_target": "sm_86"}),
    # the opt-in fused merge: partials, fence, arrival atomic, the last CTA's merge through L2
    "sm80-fused-fp8-nhd-split5": partial(sm80_decode, kv=FP8, layout="NHD", splits=5, extra={"fused_merge": True}),
    "sm80-fused-bf16-sm86-split3": partial(sm80_decode, kv=BF16, layout="HND", splits=3,
                                           extra={"smem_target": "sm_86", "fused_merge": True}),
    # page ids read a tile ahead (the default at D 64 / 256) over the bad page ids and the length past the table
    "sm80-prefetch-fp8-nhd-split5": partial(sm80_decode, kv=FP8, layout="NHD", splits=5,
                                            extra={"page_prefetch": True}),
    "sm80-prefetch-bf16-split1": partial(sm80_decode, kv=BF16, layout="HND", splits=1, extra={"page_prefetch": True}),
    "sm80-prefill-fp8": partial(sm80_prefill, kv=FP8),
    "sm80-prefill-bf16": partial(sm80_prefill, kv=BF16),
    "sm80-prefill-causal-bf16": partial(sm80_prefill_causal, kv=BF16, head_dim=128, extra={}),
    "sm80-prefill-causal-tw64s-bf16": partial(sm80_prefill_causal, kv=BF16, head_dim=128, extra=PREFILL_D128_TW64S),
    "sm80-prefill-causal-sm80-bf16": partial(sm80_prefill_causal, kv=BF16, head_dim=128,
                                             extra=dict(m_tiles=2, lean_softmax=True, smem_target="sm_80")),
    "sm80-prefill-causal-d256-bf16": partial(sm80_prefill_causal, kv=BF16, head_dim=256, extra={}),
    "sm80-prefill-causal-d256-fp8": partial(sm80_prefill_causal, kv=FP8, head_dim=256, extra={}),
    "sm80-prefill-causal-d256-w8-bf16": partial(sm80_prefill_causal, kv=BF16, head_dim=256, extra=PREFILL_D256_W8),
    # the opt-in kv_first: the ring's first copies in flight while Q is staged
    "sm80-kvfirst-fp8-nhd-split5": partial(sm80_decode, kv=FP8, layout="NHD", splits=5, extra={"kv_first": True}),
    "sm80-prefill-causal-kvfirst-bf16": partial(sm80_prefill_causal, kv=BF16, head_dim=128,
                                                extra={"kv_first": True}),
    "merge-states": merge,
}
# the cases that merge in 16-CTA (non-portable) clusters: synccheck cannot check their TMA + mbarrier
# pipelines, as profiling/cluster_probe.py's smallest such launch shows
# (docs/design/sm90-decode.md#cluster-merge-exit); memcheck, racecheck and the GPU tests cover them
SYNCCHECK_TOOL_LIMIT = frozenset({"fp8-cluster16", "fp8-cluster16-initsync", "fp8-b1-ctx1000-schedule",
                                  "fp8-b1-ctx1000-initsync"})


def run_case(name: str, device: str = "cuda") -> None:
    g = torch.Generator()
    g.manual_seed(seed_of(name))
    ctx = Ctx(name, device, g)
    print(f"case {name}: start (inputs seed {seed_of(name)})", flush=True)
    CASES[name](ctx)
    ctx.sync()  # a fault surfaces inside its case
    print(f"case {name}: ok", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m profiling.sanitize_decode",
                                description="decode and merge calls for compute-sanitizer, as named cases")
    p.add_argument("--list", action="store_true", help="print the case names, one a line, and exit")
    p.add_argument("--case", default=None, help="NAME[,NAME...]: run only these (default: every case, in order)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: every call on CPU tensors, through the float64 reference (checks the cases)")
    args = p.parse_args(argv)
    names = list(CASES) if args.case is None else [n.strip() for n in args.case.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        p.error(f"unknown case(s) {unknown or args.case!r}; --list prints the names")
    args.names = names
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    for name in args.names:
        run_case(name, args.device)
    print("sanitize run finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
