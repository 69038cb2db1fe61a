"""``cute-kernels bench decode``: SM90 paged decode side by side with its peers, one process.

Peers (a peer whose library is not installed is skipped with one line; one that refuses a shape
is reported in that shape's row):
- ``xqa``: FlashInfer ``trtllm_batch_decode_with_kv_cache(backend="xqa")`` (its own zeroed
  workspace per configuration: a dirty one gives wrong results); ``xqa_nopdl`` without PDL;
- ``fi``: FlashInfer ``BatchDecodeWithPagedKVCacheWrapper`` (q_len 1);
- ``fa4``: ``flash_attn.cute.flash_attn_varlen_func`` with a page table (BF16 cache only on SM90);
- ``sdpa``: torch SDPA on contiguous BF16 K/V (q_len 1; for an FP8 cache, on its dequantized copy).

Any other ``--peers`` entry is a tuning variant of ours (:data:`VARIANTS`, or ``field=int+...``).
Every row also times ours under the balanced split schedule (``balanced``, opt-in in the op:
docs/design/sm90-decode.md#balanced-schedule-opt-in; ``--no-balanced`` skips it), and a ragged
row times it on its uniform twin as well: the columns the rule deciding its default reads.
Shapes: uniform batches (:data:`SHAPES`: every request the same context, a block table as wide as
it) and ragged ones (:data:`RAGGED_SHAPES`: contexts drawn uniformly from [1, max] with a fixed
seed, a block table :data:`TABLE_TOKENS` wide as a serving engine's; each is reported next to
ours on its "uniform twin", the same batch size, total tokens and table with equal contexts).
Times are CUDA-graph replays (launch gaps removed). Roofline = bytes that must be read
(the K/V of the tokens present, sum(seq_lens) x bytes per token, + Q + O) / the read bandwidth
measured in this process. Each output is also
compared with the fp32 reference (relative error; ``--quick`` skips it). Prints a table; writes
JSON (``--json``) and a bar chart (``--png``).
"""

from __future__ import annotations

import math
import random
import traceback

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.plans.args import check_positive_ints
from cute_kernels.testing import make_paged_decode_case, rel_err

from .harness import (
    SM90,
    NvtxRanges,
    Peer,
    add_kernel_argument,
    bar_chart,
    check_unused,
    choice_list,
    comma_list,
    parse_variants,
    runnable,
    select_named,
    self_check_state,
    write_json,
    write_partial,
)
from .timing import bench_setup, host_overhead, time_eager, time_graph, time_graph_fresh

NEEDS = SM90
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16

# name, Hq, Hkv, D, B, ctx, q_len
SHAPES = [
    ("qwen3-30b B8 ctx32000", 32, 4, 128, 8, 32000, 1),
    ("qwen3-30b B128 ctx2048", 32, 4, 128, 128, 2048, 1),
    ("llama3-8b B1 ctx1000", 32, 8, 128, 1, 1000, 1),
    ("llama3-8b B64 ctx8192", 32, 8, 128, 64, 8192, 1),
    ("d64 h32/8 B32 ctx8192", 32, 8, 64, 32, 8192, 1),
    ("d256 h16/8 B32 ctx8192", 16, 8, 256, 32, 8192, 1),
    ("llama3-8b B64 ctx8192 q2", 32, 8, 128, 64, 8192, 2),
    ("llama3-8b B64 ctx8192 q4", 32, 8, 128, 64, 8192, 4),
    ("llama3-70b-tp8 B64 ctx4096", 8, 1, 128, 64, 4096, 1),  # Hq 64 / Hkv 8 over 8-way tensor parallelism
]
# name, Hq, Hkv, D, B, max context, q_len: contexts uniform in [1, max] (ragged_lens), table TABLE_TOKENS wide
RAGGED_SHAPES = [
    *[(f"qwen3-30b ragged B{b} max{m}", 32, 4, 128, b, m, 1) for b in (8, 32, 128) for m in (4000, 32000)],
    ("llama3-70b-tp8 ragged B64 max8192", 8, 1, 128, 64, 8192, 1),
    ("llama3-70b-tp8 ragged B32 max32000", 8, 1, 128, 32, 32000, 1),
]
TABLE_TOKENS = 32768  # a serving engine's block table spans its max model length (vLLM)
PAGE = 16
KV_DTYPES = ("fp8", "bf16")


def ragged_lens(batch: int, max_ctx: int) -> list[int]:
    """The contexts of a ragged shape: ``batch`` draws uniform in [1, max_ctx], seeded by the
    shape, so every run (and every peer) sees the same batch."""
    rng = random.Random(batch * 1_000_003 + max_ctx)
    return [rng.randint(1, max_ctx) for _ in range(batch)]


def twin_ctx(lens: list[int]) -> int:
    """The context of the uniform batch with the same tokens (to rounding) as ``lens``."""
    return max(1, round(sum(lens) / len(lens)))


def is_ragged(shape) -> bool:
    return shape in RAGGED_SHAPES


def _dequant_contiguous(case, dtype=BF16):
    """[B, Hkv, ctx, D] K and V in ``dtype`` (scales applied) for SDPA."""
    k_cache, v_cache = reference.split_kv_cache(case.kv_cache, case.kv_layout)
    B = case.block_table.shape[0]
    ctx = int(case.seq_lens.max())
    P, Hkv, page, D = k_cache.shape
    n = math.ceil(ctx / page)
    ids = case.block_table[:, :n].long()
    k = k_cache[ids].to(dtype).permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * page, D)[:, :, :ctx]
    v = v_cache[ids].to(dtype).permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * page, D)[:, :, :ctx]
    return (k * case.k_scale).contiguous(), (v * case.v_scale).contiguous()


def peer_xqa(case, sm_scale, q_len, enable_pdl=None):
    """XQA as FlashInfer runs it (``enable_pdl=None``: programmatic dependent launch on SM90+)."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    ctx = int(case.seq_lens.max())
    mask = None
    if q_len > 1:
        B = case.block_table.shape[0]
        words = (q_len + 31) // 32
        bits = torch.zeros(q_len, words * 32, dtype=torch.int64)
        for j in range(q_len):
            bits[j, : j + 1] = 1
        packed = torch.zeros(q_len, words * 2, dtype=torch.int64)
        for w in range(words * 2):
            for b in range(16):
                packed[:, w] |= bits[:, w * 16 + b] << b
        mask = packed.to(torch.int32).to(torch.uint16).unsqueeze(0).expand(B, -1, -1).contiguous().cuda()
    kw = dict(query=case.q, kv_cache=case.kv_cache, workspace_buffer=ws, block_tables=case.block_table,
              seq_lens=case.seq_lens, max_seq_len=ctx, bmm1_scale=sm_scale * case.k_scale,
              bmm2_scale=case.v_scale, backend="xqa", kv_layout=case.kv_layout, q_len_per_req=q_len,
              enable_pdl=enable_pdl)
    if mask is not None:
        kw["mask"] = mask
    out = torch.empty_like(case.q)
    return lambda: trtllm_batch_decode_with_kv_cache(out=out, **kw), out


def peer_fi(case, sm_scale, q_len):
    import flashinfer

    if q_len != 1:
        raise NotImplementedError("q_len > 1 not benchmarked for the FI wrapper")
    B = case.block_table.shape[0]
    page = case.meta["page_size"]
    lens = case.seq_lens.tolist()
    n = [math.ceil(L / page) for L in lens]
    indptr = torch.tensor([0] + list(torch.tensor(n).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    indices = torch.cat([case.block_table[b, : n[b]] for b in range(B)]).int()
    last = torch.tensor([L - (k - 1) * page for L, k in zip(lens, n)], dtype=torch.int32, device="cuda")
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    kv_dtype = case.kv_cache.dtype
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, case.kv_layout, use_tensor_cores=True)
    wrapper.plan(indptr, indices, last, case.q.shape[1], case.meta["num_kv_heads"], case.meta["head_dim"], page,
                 q_data_type=case.q.dtype, kv_data_type=kv_dtype, sm_scale=sm_scale)
    out = torch.empty_like(case.q)
    return lambda: wrapper.run(case.q, case.kv_cache, out=out, k_scale=case.k_scale, v_scale=case.v_scale), out


def peer_fa4(case, sm_scale, q_len):
    from flash_attn.cute import flash_attn_varlen_func

    if case.kv_cache.dtype != BF16:
        raise NotImplementedError("FA4 on SM90 has no FP8 KV")
    kv = case.kv_cache
    if case.kv_layout == "HND":
        kv = kv.permute(0, 1, 3, 2, 4).contiguous()  # FA4 takes (pages, page_size, Hkv, D)
    k, v = kv[:, 0], kv[:, 1]
    B = case.block_table.shape[0]
    q = case.q.view(B, q_len, case.q.shape[1], case.q.shape[2])
    ks, vs = float(case.k_scale), float(case.v_scale)
    if ks != 1.0 or vs != 1.0:
        k, v = (k.float() * ks).to(BF16), (v.float() * vs).to(BF16)

    def fn():
        return flash_attn_varlen_func(q, k, v, page_table=case.block_table, seqused_k=case.seq_lens,
                                      softmax_scale=sm_scale, causal=True)

    return fn, None


def peer_sdpa(case, sm_scale, q_len):
    if q_len != 1:
        raise NotImplementedError("SDPA peer only for q_len 1")
    if int(case.seq_lens.min()) != int(case.seq_lens.max()):
        raise NotImplementedError("SDPA peer only for equal contexts")
    k, v = _dequant_contiguous(case)
    B, Hq, D = case.q.shape[0], case.q.shape[1], case.q.shape[2]
    q = case.q.view(B, Hq, 1, D)
    F = torch.nn.functional

    def fn():
        return F.scaled_dot_product_attention(q, k, v, scale=sm_scale, enable_gqa=True)

    return fn, None


def peer_xqa_nopdl(case, sm_scale, q_len):
    return peer_xqa(case, sm_scale, q_len, enable_pdl=False)


PEERS = {"xqa": peer_xqa, "xqa_nopdl": peer_xqa_nopdl, "fi": peer_fi, "fa4": peer_fa4, "sdpa": peer_sdpa}
_FLASHINFER = Peer("flashinfer", "flashinfer-python")
# the library each peer needs (SDPA is torch's own)
PEER_LIBS = {"xqa": _FLASHINFER, "xqa_nopdl": _FLASHINFER, "fi": _FLASHINFER, "fa4": Peer("flash_attn", "flash-attn-4")}
DEFAULT_PEERS = ("xqa", "fi", "fa4", "sdpa")

# our tuning variants (cute_kernels.ops.paged_decode.tuning_override); "ours" is the default
VARIANTS = {"bits": dict(widen="bits"), "cvt": dict(widen="cvt"), "t128": dict(tile=128),
            "bits128": dict(widen="bits", tile=128), "occ3": dict(occupancy=3), "occ4": dict(occupancy=4),
            "occ5": dict(occupancy=5), "occ6": dict(occupancy=6), "t128occ4": dict(tile=128, occupancy=4),
            "occ2": dict(occupancy=2), "t128occ2": dict(tile=128, occupancy=2), "t128occ3": dict(tile=128, occupancy=3),
            "nopdl": dict(pdl=False), "dynamic": dict(dynamic=True), "strided": dict(strided=True),
            "contiguous": dict(strided=False), "global": dict(cluster=False), "balanced": dict(balanced=True),
            "initsync": dict(cluster_init_sync=True)}


def variant_fields(name: str) -> dict:
    """A named variant, or ad-hoc fields ``field=int[+field=int...]`` (e.g. ``occupancy=3+tile=128``;
    ``num_splits=N`` is passed to the op)."""
    if name in VARIANTS:
        return VARIANTS[name]
    return parse_variants(name, sep="+")[0]


def variant(name, ranges: NvtxRanges):
    from cute_kernels.ops.paged_decode import tuning_override

    fields = dict(variant_fields(name))
    splits = fields.pop("num_splits", None)  # an op argument, not a kernel field

    def make(case, sm_scale, q_len):
        out = torch.empty_like(case.q)

        def fn():
            with tuning_override(**fields):
                return cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                                 num_splits=splits, **case.kwargs())
        return ranges.wrap("cute_kernels.paged_decode", fn), out

    return make


def peer(name, ranges: NvtxRanges):
    """The maker of peer ``name``, its timed call inside an NVTX range ``bench.<name>``."""

    def make(case, sm_scale, q_len):
        fn, out = PEERS[name](case, sm_scale, q_len)
        return ranges.wrap(f"bench.{name}", fn), out

    return make


def select_shapes(keys: str | None) -> list[tuple]:
    """The :data:`SHAPES` and :data:`RAGGED_SHAPES` whose name contains one of the comma-separated
    ``keys`` (all: None); ``ValueError`` for a key that matches no shape."""
    return select_named("--shapes", keys, SHAPES + RAGGED_SHAPES)


def check_peer(name: str) -> None:
    """``name`` a peer, a named variant or ``field=int+...`` of ``sm90.decode``'s tuning fields
    (:func:`cute_kernels.ops.paged_decode.check_tuning_override`); ``ValueError`` naming
    ``--peers`` otherwise (each row would report the same error after its timing)."""
    from cute_kernels.ops.paged_decode import check_tuning_override

    if name in PEERS or name in VARIANTS:
        return
    if "=" not in name:
        raise ValueError(f"--peers: {name!r} is not a peer ({', '.join(PEERS)}), a variant ({', '.join(VARIANTS)}) "
                         "or FIELD=INTEGER+...")
    try:
        fields = dict(variant_fields(name))
        check_positive_ints(num_splits=fields.pop("num_splits", 1))
        check_tuning_override("sm90.decode", fields)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--peers: {name!r}: {str(e).removeprefix('tuning_override: ')}") from None


def requested_peers(args) -> list[str]:
    """The ``--peers`` entries (:data:`DEFAULT_PEERS` when not given; ``''``: ours alone)."""
    return comma_list("--peers", ",".join(DEFAULT_PEERS) if args.peers is None else args.peers, allow_empty=True)


def check_arguments(args) -> None:
    """Every value of the command line, before the GPU check (:func:`cute_kernels.bench.main`)."""
    if args.api == "trtllm":
        from . import trtllm

        check_unused("with --api trtllm", {"--peers": args.peers is not None, "--png": args.png is not None,
                                           "--no-balanced": not args.balanced})
        trtllm.check_arguments(args, trtllm.DECODE_SHAPES)
        return
    for name in requested_peers(args):
        check_peer(name)
    choice_list("--kv", args.kv, KV_DTYPES)
    select_shapes(args.shapes)


def run(peers=DEFAULT_PEERS, kv_dtypes=KV_DTYPES, shapes=None, out_json=None, out_png=None, quick=False,
        nvtx=False, balanced=True):
    ranges = NvtxRanges(nvtx)
    bw, g = bench_setup()
    rows = []
    columns = [*peers, *(["balanced"] if balanced and "balanced" not in peers else [])]
    for kvn in kv_dtypes:
        kv_dtype = FP8 if kvn == "fp8" else BF16
        for shape in shapes or SHAPES:
            name, Hq, Hkv, D, B, ctx, q_len = shape
            ragged = is_ragged(shape)
            lens = ragged_lens(B, ctx) if ragged else ctx
            table_tokens = TABLE_TOKENS if ragged else None

            def make_case(lens):
                return make_paged_decode_case(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=PAGE,
                                              seq_lens=lens, kv_dtype=kv_dtype, q_len=q_len, generator=g,
                                              poison_tail=False, table_tokens=table_tokens,
                                              k_scale=0.0625 if kvn == "fp8" else 1.0,
                                              v_scale=0.03125 if kvn == "fp8" else 1.0)

            case = make_case(lens)
            sm_scale = D ** -0.5
            nbytes = _bytes(case)
            ref = reference.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, **case.kwargs()) \
                if not quick else None
            row = dict(shape=name, kv=kvn, B=B, ctx=ctx, Hq=Hq, Hkv=Hkv, D=D, q_len=q_len, bytes=nbytes,
                       ragged=ragged, tokens=B * ctx if not ragged else sum(lens),
                       table_tokens=case.block_table.shape[1] * PAGE)
            out = torch.empty_like(case.q)

            def ours():
                return cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                                 **case.kwargs())

            ours = ranges.wrap("cute_kernels.paged_decode", ours)
            makers = {p: peer(p, ranges) if p in PEERS else variant(p, ranges) for p in columns}
            entries = [("ours", lambda: (ours, out))] + [(p, (lambda p=p: makers[p](case, sm_scale, q_len)))
                                                         for p in columns]
            for pname, make in entries:
                try:
                    fn, o = make()
                    res = fn()
                    torch.cuda.synchronize()
                    res = o if o is not None else res
                    if isinstance(res, tuple):
                        res = res[0]
                    # "ours" is the problem's first timing: run twice (timing.time_graph_fresh)
                    if pname == "ours":
                        t, t_first = time_graph_fresh(fn)
                        row["ours_first_timing_us"] = t_first * 1e6  # discarded
                    else:
                        t = time_graph(fn)
                    row[pname + "_us"] = t * 1e6
                    row[pname + "_roof"] = 100 * nbytes / bw / t
                    if ref is not None:
                        row[pname + "_err"] = rel_err(res.reshape(ref.shape).float(), ref.float())
                    if pname == "ours":
                        row["ours_eager_us"] = time_eager(fn) * 1e6
                    if pname == "balanced":
                        row["balanced_self_check"] = _balanced_check(case)
                except Exception as e:  # a peer that cannot run this shape is reported, not fatal
                    row[pname + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    if pname == "ours":
                        traceback.print_exc()
            if ragged:
                _time_twin(row, make_case(twin_ctx(lens)), bw, ranges, "balanced" in columns)
            for name in ("ours", "balanced"):
                if "xqa_us" in row and f"{name}_us" in row:
                    row["speedup_vs_xqa" if name == "ours" else "balanced_vs_xqa"] = row["xqa_us"] / row[f"{name}_us"]
            rows.append(row)
            write_partial(out_json, read_bw=bw, rows=rows)
            _print_row(row, columns)
    # host overhead of one eager call on a tiny problem (graph-free serving path)
    small = make_paged_decode_case(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                   seq_lens=64, generator=g, poison_tail=False)
    o = torch.empty_like(small.q)
    ov = host_overhead(lambda: cute_kernels.paged_decode(small.q, small.kv_cache, small.block_table,
                                                         small.seq_lens, out=o, num_splits=1, **small.kwargs()))
    print(f"host overhead per eager call: {ov * 1e6:.1f} us")
    result = dict(read_bw=bw, host_overhead_us=ov * 1e6, rows=rows)
    if out_json:
        write_json(out_json, result)
    if out_png:
        _plot(rows, columns, out_png, torch.cuda.get_device_name())
    return result


def _bytes(case) -> int:
    """Bytes a decode must move: the K/V of the tokens present, Q and O."""
    return case.visible_kv_bytes() + 2 * case.q.numel() * case.q.element_size()


def _time_twin(row: dict, twin, bw: float, ranges: NvtxRanges, balanced: bool = False) -> None:
    """Ours on the ragged row's uniform twin (same B, tokens and table, equal contexts), and with
    ``balanced`` the balanced schedule on it too (``twin_balanced_*``)."""
    from cute_kernels.ops.paged_decode import tuning_override

    out = torch.empty_like(twin.q)
    for name, fields in (("twin", {}), *((("twin_balanced", dict(balanced=True)),) if balanced else ())):
        def call(fields=fields):
            with tuning_override(**fields):
                return cute_kernels.paged_decode(twin.q, twin.kv_cache, twin.block_table, twin.seq_lens, out=out,
                                                 **twin.kwargs())

        fn = ranges.wrap("cute_kernels.paged_decode", call)
        try:
            fn()
            t = time_graph(fn)
            row.update({"twin_ctx": int(twin.seq_lens[0]), f"{name}_us": t * 1e6,
                        f"{name}_roof": 100 * _bytes(twin) / bw / t})
        except Exception as e:  # reported in the row, as a peer's failure
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    for name in ("ours", "balanced"):
        if f"{name}_us" in row and "twin_us" in row:
            row[f"{name}_minus_twin_us"] = row[f"{name}_us"] - row["twin_us"]


def _balanced_check(case) -> str:
    """The balanced family's self-check state for ``case`` (empty while the registry lists the
    schedule as available: no check runs); raises (the column is reported as not run) when it
    failed: the default schedule served those calls."""
    kv = "fp8_e4m3" if case.kv_cache.dtype == FP8 else "bf16"
    ok, text = self_check_state("sm90.decode_balanced", "bf16", kv, case.meta["head_dim"])
    if not ok:
        raise RuntimeError(text.replace("the reference served", "the default schedule served"))
    return text


def _print_row(r, peers):
    def f(p):
        if p + "_us" in r:
            e = r.get(p + "_err")
            return f"{r[p + '_us']:8.1f}us {r[p + '_roof']:5.1f}%" + (f" e={e:.1e}" if e is not None else "")
        return f"{'-':>8} ({r.get(p + '_error', 'n/a')[:40]})"

    sp = f"x{r['speedup_vs_xqa']:.2f}" if "speedup_vs_xqa" in r else ""
    print(f"{r['shape']:<26} {r['kv']:<4} ours {f('ours')} {sp}", flush=True)
    if "twin_us" in r:
        bal = f", balanced {r['twin_balanced_us']:.1f}us" if "twin_balanced_us" in r else ""
        print(f"{'':<31} twin {r['twin_us']:8.1f}us {r['twin_roof']:5.1f}% (uniform ctx {r['twin_ctx']}, same tokens "
              f"and table{bal})", flush=True)
    for p in peers:
        print(f"{'':<31} {p:<4} {f(p)}", flush=True)


def _plot(rows, peers, path, device):
    bar_chart(path, rows, ["ours", *peers], "_roof", "% of measured read-bandwidth roofline",
              f"SM90 paged decode ({device}, page {PAGE})", hline=85)


def add_arguments(p) -> None:
    add_kernel_argument(p, "decode", "FlashInfer's decode wrapper")
    p.add_argument("--peers", default=None,
                   help=f"comma list of peers ({', '.join(PEERS)}) and our tuning variants (default: "
                        f"{','.join(DEFAULT_PEERS)})")
    p.add_argument("--kv", default=",".join(KV_DTYPES), help="KV-cache dtypes (default: %(default)s)")
    p.add_argument("--png", default=None, metavar="PATH", help="also draw the %% of roofline per shape to PATH")
    p.add_argument("--quick", action="store_true", help="skip the accuracy check against the reference")
    p.add_argument("--shapes", default=None,
                   help="comma-separated substrings selecting shapes by name, e.g. 'ragged' (default: every "
                        "uniform and ragged shape)")
    p.add_argument("--no-balanced", dest="balanced", action="store_false",
                   help="skip the balanced split schedule's column (timed on every row by default)")
    p.add_argument("--api", default="ops", choices=("ops", "trtllm"),
                   help="ops: paged_decode against its peers; trtllm: the cute_kernels.trtllm call next to "
                        "FlashInfer's trtllm_batch_decode_with_kv_cache, windows and sinks (default: %(default)s)")


def main(args) -> None:
    if args.api == "trtllm":
        from . import trtllm

        trtllm.main_decode(args)
        return
    peers, png = runnable(requested_peers(args), PEER_LIBS, args.png)
    run(peers=tuple(peers), kv_dtypes=choice_list("--kv", args.kv, KV_DTYPES), shapes=select_shapes(args.shapes),
        out_json=args.json, out_png=png, quick=args.quick, nvtx=args.nvtx, balanced=args.balanced)
