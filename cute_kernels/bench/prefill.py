"""``cute-kernels bench prefill``: SM90 paged prefill side by side with its peers, one process.

Entries (a peer whose library is missing, or that refuses a shape, is reported on one line and
skipped):
- ``ours``: :func:`cute_kernels.paged_prefill` with the model-dtype query (FP8 caches: widened on
  chip); ``ours_fp8q``: the FP8-query kernel on a query quantized with a per-tensor ``q_scale``
  (FP8 caches only; the quantization is outside the timing, as a layer does it once per step);
  ``ours_fp8x2``: the two-term FP8 query (``q_residual``: the residual of the same quantization,
  ``sm90.prefill_fp8x2``), likewise; ``ours_fp8q_words``: ``ours_fp8q`` with V^T written in 4-byte
  words instead of its default ``ldmatrix.trans`` + ``stmatrix`` (``tuning_override(vt_transpose="words")``,
  ``sm90.prefill_fp8q_words``: the A/B of the transpose); ``ours_scaled`` / ``ours_fp8q_scaled``: ``ours`` /
  ``ours_fp8q`` with the former scaled-score softmax instead of the lean default
  (``tuning_override(lean_softmax=False)``, ``sm90.prefill_scaled_softmax``: the A/B of the softmax);
- ``fa4``: ``flash_attn.cute.flash_attn_varlen_func`` on contiguous K/V (non-paged); ``fa4_paged``:
  the same with a page table over a page-128 NHD copy of the cache (16-bit caches only: FA4 has no
  FP8 K/V on SM90);
- ``fi``: FlashInfer ``BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`` on our page-16 cache;
  for an FP8 cache with an FP8 query (``q_scale``) and ``o_data_type=bfloat16``;
- ``sdpa``: torch SDPA on contiguous K/V with the heads repeated (bottom-right causal mask for a
  chunk on a cached prefix; 16-bit caches, FP8 ones on their dequantized copy).

TFLOP/s count only the attended (causal) work: 4 D Hq per (query row, visible KV position).
Times are medians of CUDA-graph replays (an entry that cannot be captured is timed eagerly with
events, and says so). The error column is ‖out − ref‖/‖ref‖ against the fp32 reference on the
same dequantized cache and the unquantized query (``--quick`` skips it). Prints a table; writes
JSON (``--json``) and a bar chart (``--png``).
"""

from __future__ import annotations

import argparse
import math
import traceback
from contextlib import nullcontext
from functools import partial

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops.paged_prefill import tuning_override
from cute_kernels.testing import make_paged_prefill_case, per_tensor_q_scale, rel_err

from .harness import (
    SM90,
    NvtxRanges,
    Peer,
    add_kernel_argument,
    bar_chart,
    check_unused,
    choice_list,
    runnable,
    select_named,
    self_check_state,
    write_json,
    write_partial,
)
from .timing import bench_setup, time_eager, time_graph

NEEDS = SM90
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
PAGE = 16

# name, B, cached prefix, new tokens per request, Hq, Hkv, D
SHAPES = [
    ("causal B1 S4096", 1, 0, 4096, 32, 8, 128),
    ("causal B1 S16384", 1, 0, 16384, 32, 8, 128),
    ("causal B4 S8192", 4, 0, 8192, 32, 8, 128),
    ("chunked B1 q2048 ctx32768", 1, 32768 - 2048, 2048, 32, 8, 128),
    ("chunked B8 q512 ctx16384", 8, 16384 - 512, 512, 32, 8, 128),
    ("short B16 S512", 16, 0, 512, 32, 8, 128),
    ("d64 B1 S8192", 1, 0, 8192, 32, 8, 64),
    ("d256 B1 S8192", 1, 0, 8192, 32, 8, 256),
]
PEERS = ("ours_scaled", "ours_fp8q", "ours_fp8q_scaled", "ours_fp8q_words", "ours_fp8x2", "fa4", "fa4_paged", "fi", "sdpa")
_FA4 = Peer("flash_attn", "flash-attn-4")
# the library each peer needs (SDPA is torch's own; ours_fp8q is ours)
PEER_LIBS = {"fa4": _FA4, "fa4_paged": _FA4, "fi": Peer("flashinfer", "flashinfer-python")}
KV_DTYPES = ("bf16", "fp8")


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


class Problem:
    """One shape and cache dtype: the paged case, its reference and what the peers share."""

    def __init__(self, shape, kvn, g, quick):
        name, B, prefix, n, Hq, Hkv, D = shape
        self.name, self.kvn, self.causal = name, kvn, True
        fp8 = kvn == "fp8"
        self.case = make_paged_prefill_case(reqs=[(prefix, n)] * B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                            page_size=PAGE, kv_dtype=FP8 if fp8 else BF16, q_dtype=BF16,
                                            k_scale=0.0625 if fp8 else 1.0, v_scale=0.03125 if fp8 else 1.0,
                                            poison_tail=False, generator=g)
        c = self.case
        self.B, self.prefix, self.n, self.L = B, prefix, n, prefix + n
        self.sm_scale = D ** -0.5
        self.q_scale = per_tensor_q_scale(c.q)
        self.q8, self.q8_lo = cute_kernels.quantize_query(c.q, self.q_scale, residual=True) if fp8 else (None, None)
        self.ref = None if quick else reference.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens,
                                                              c.query_start_loc, **c.kwargs())
        self._dense = None

    def dense(self):
        """``(k, v)`` ``[B, L, Hkv, D]`` bf16, scales applied (for the non-paged peers)."""
        if self._dense is None:
            k_cache, v_cache = reference.split_kv_cache(self.case.kv_cache, self.case.kv_layout)  # [P, Hkv, page, D]
            n_pages = math.ceil(self.L / PAGE)
            ids = self.case.block_table[:, :n_pages].long()

            def gather(cache, scale):
                x = cache[ids].to(torch.float32) * scale  # [B, n_pages, Hkv, page, D]
                x = x.permute(0, 1, 3, 2, 4).reshape(self.B, n_pages * PAGE, -1, x.shape[-1])[:, :self.L]
                return x.to(BF16).contiguous()

            self._dense = gather(k_cache, self.case.k_scale), gather(v_cache, self.case.v_scale)
        return self._dense


# ----------------------------------------------------------------------------------------------
# entries: each returns (call, output tensor or None when the call returns it)
# ----------------------------------------------------------------------------------------------


def ours(pb: Problem, **tuning):
    """The 16-bit-query kernel (an FP8 cache widened on chip); ``tuning``: fields forced with
    ``tuning_override`` (``lean_softmax=False``)."""
    c = pb.case
    out = torch.empty_like(c.q)

    def fn():
        with tuning_override(**tuning) if tuning else nullcontext():
            return cute_kernels.paged_prefill(c.q, c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc,
                                              max_query_len=pb.n, out=out, **c.kwargs())

    return fn, out


def ours_fp8q(pb: Problem, two_terms: bool = False, **tuning):
    """The FP8-query kernel; ``two_terms``: with the query's residual (``sm90.prefill_fp8x2``);
    ``tuning``: fields forced with ``tuning_override`` (``vt_transpose="words"``)."""
    if pb.q8 is None:
        raise NotImplementedError("the FP8-query path needs an FP8 cache")
    c = pb.case
    out = torch.empty_like(c.q)
    residual = dict(q_residual=pb.q8_lo) if two_terms else {}

    def fn():
        with tuning_override(**tuning) if tuning else nullcontext():
            return cute_kernels.paged_prefill(pb.q8, c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc,
                                              max_query_len=pb.n, q_scale=pb.q_scale, out=out, **residual,
                                              **c.kwargs())

    return fn, out


def peer_fa4(pb: Problem):
    from flash_attn.cute import flash_attn_varlen_func

    k, v = pb.dense()
    k, v = k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
    dev = k.device
    cu_q = torch.arange(0, pb.B + 1, device=dev, dtype=torch.int32) * pb.n
    cu_k = torch.arange(0, pb.B + 1, device=dev, dtype=torch.int32) * pb.L

    def fn():
        return flash_attn_varlen_func(pb.case.q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=pb.n,
                                      max_seqlen_k=pb.L, softmax_scale=pb.sm_scale, causal=True)

    return fn, None


def peer_fa4_paged(pb: Problem, page: int = 128):
    from flash_attn.cute import flash_attn_varlen_func

    if pb.kvn != "bf16":
        raise NotImplementedError("FA4 has no FP8 K/V on SM90")
    k, v = pb.dense()  # [B, L, Hkv, D] -> pages of 128 tokens, NHD, one request after another
    n_pages = math.ceil(pb.L / page)
    pad = n_pages * page - pb.L

    def paged(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(pb.B * n_pages, page, *x.shape[2:]).contiguous()

    kp, vp = paged(k), paged(v)
    table = torch.arange(pb.B * n_pages, device=k.device, dtype=torch.int32).view(pb.B, n_pages)
    cu_q = torch.arange(0, pb.B + 1, device=k.device, dtype=torch.int32) * pb.n

    def fn():
        return flash_attn_varlen_func(pb.case.q, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=pb.n,
                                      seqused_k=pb.case.seq_lens, page_table=table, softmax_scale=pb.sm_scale,
                                      causal=True)

    return fn, None


def peer_fi(pb: Problem):
    import flashinfer

    c = pb.case
    dev = c.q.device
    n_pages = math.ceil(pb.L / PAGE)
    indptr = torch.arange(0, pb.B + 1, device=dev, dtype=torch.int32) * n_pages
    indices = c.block_table[:, :n_pages].reshape(-1).contiguous()
    last = torch.full((pb.B,), pb.L - (n_pages - 1) * PAGE, device=dev, dtype=torch.int32)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, c.kv_layout, backend="fa3")
    fp8 = pb.kvn == "fp8"
    q = pb.q8 if fp8 else c.q
    wrapper.plan(c.query_start_loc, indptr, indices, last, c.q.shape[1], pb.case.meta["num_kv_heads"],
                 pb.case.meta["head_dim"], PAGE, causal=True, sm_scale=pb.sm_scale, q_data_type=q.dtype,
                 kv_data_type=c.kv_cache.dtype, o_data_type=BF16)
    out = torch.empty(c.q.shape, dtype=BF16, device=dev)
    scales = dict(q_scale=pb.q_scale, k_scale=c.k_scale, v_scale=c.v_scale) if fp8 else {}
    return (lambda: wrapper.run(q, c.kv_cache, out=out, **scales)), out


def peer_sdpa(pb: Problem):
    from torch.nn.attention.bias import causal_lower_right

    k, v = pb.dense()
    G = pb.case.q.shape[1] // k.shape[2]
    k = k.repeat_interleave(G, dim=2).transpose(1, 2).contiguous()  # [B, Hq, L, D]
    v = v.repeat_interleave(G, dim=2).transpose(1, 2).contiguous()
    q = pb.case.q.view(pb.B, pb.n, -1, k.shape[-1]).transpose(1, 2)
    mask = None if pb.n == pb.L else causal_lower_right(pb.n, pb.L)
    F = torch.nn.functional

    def fn():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=pb.sm_scale)
        return o.transpose(1, 2)  # [B, n, Hq, D]

    return fn, None


ENTRIES = {"ours": ours, "ours_scaled": partial(ours, lean_softmax=False), "ours_fp8q": ours_fp8q,
           "ours_fp8q_scaled": partial(ours_fp8q, lean_softmax=False),
           "ours_fp8q_words": partial(ours_fp8q, vt_transpose="words"),
           "ours_fp8x2": partial(ours_fp8q, two_terms=True), "fa4": peer_fa4, "fa4_paged": peer_fa4_paged, "fi": peer_fi,
           "sdpa": peer_sdpa}


# ----------------------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------------------


def _self_check(pb: Problem, name: str) -> str:
    """The self-check state of the kernel behind an ``ours*`` entry; raises
    (the entry is reported as skipped) when its family failed it: the reference served the call."""
    kernel, q = {"ours_fp8q": ("sm90.prefill_fp8q", "fp8_e4m3"), "ours_fp8x2": ("sm90.prefill_fp8x2", "fp8_e4m3"),
                 "ours_fp8q_words": ("sm90.prefill_fp8q_words", "fp8_e4m3"),
                 "ours_scaled": ("sm90.prefill_scaled_softmax", "bf16"),
                 "ours_fp8q_scaled": ("sm90.prefill_scaled_softmax", "fp8_e4m3")}.get(name, ("sm90.prefill", "bf16"))
    ok, text = self_check_state(kernel, q, "fp8_e4m3" if pb.kvn == "fp8" else "bf16", pb.case.meta["head_dim"])
    if not ok:
        raise RuntimeError(text)
    return text


def _time(fn) -> tuple[float, str]:
    try:
        return time_graph(fn), "graph"
    except Exception:  # not capturable (a peer that allocates or syncs): eager, with events
        torch.cuda.synchronize()
        return time_eager(fn), "eager"


def run(peers=PEERS, kv_dtypes=KV_DTYPES, shapes=None, out_json=None, out_png=None, quick=False, nvtx=False):
    ranges = NvtxRanges(nvtx)
    bw, g = bench_setup()
    rows = []
    for kvn in kv_dtypes:
        for shape in shapes or SHAPES:
            pb = Problem(shape, kvn, g, quick)
            flops = pb.case.flops(causal=True)
            row = dict(shape=pb.name, kv=kvn, B=pb.B, prefix=pb.prefix, q_len=pb.n, Hq=shape[4], Hkv=shape[5],
                       D=shape[6], page=PAGE, causal_tflop=flops / 1e12)
            for name in ("ours", *peers):
                try:
                    fn, o = ENTRIES[name](pb)
                    fn = ranges.wrap("cute_kernels.paged_prefill" if name.startswith("ours") else f"bench.{name}", fn)
                    res = fn()
                    torch.cuda.synchronize()
                    if name.startswith("ours"):  # a compile-verified kernel's first call ran its self-check
                        row[name + "_self_check"] = _self_check(pb, name)
                    res = o if o is not None else (res[0] if isinstance(res, tuple) else res)
                    t, how = _time(fn)
                    row[name + "_us"] = t * 1e6
                    row[name + "_tflops"] = flops / t / 1e12
                    row[name + "_timing"] = how
                    if pb.ref is not None:
                        row[name + "_err"] = rel_err(res.reshape(pb.ref.shape).float(), pb.ref.float())
                except Exception as e:  # a peer that cannot run this shape is reported, not fatal
                    row[name + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    if name == "ours":
                        traceback.print_exc()
            rows.append(row)
            write_partial(out_json, read_bw=bw, rows=rows)
            _print_row(row, ("ours", *peers))
            del pb
            torch.cuda.empty_cache()
    result = dict(read_bw=bw, rows=rows)
    write_json(out_json, result)
    if out_png:
        _plot(rows, ("ours", *peers), out_png)
    return result


def _print_row(r, names):
    print(f"{r['shape']:<28} {r['kv']:<4} ({r['causal_tflop']:.2f} TFLOP causal)", flush=True)
    for p in names:
        if p + "_us" in r:
            e = r.get(p + "_err")
            err = f" err {e:.1e}" if e is not None else ""
            print(f"    {p:<10} {r[p + '_us']:9.1f} us {r[p + '_tflops']:7.1f} TFLOP/s{err} ({r[p + '_timing']})",
                  flush=True)
        else:
            print(f"    {p:<10} skipped: {r.get(p + '_error', 'n/a')}", flush=True)


def _plot(rows, names, path):
    bar_chart(path, rows, names, "_tflops", "TFLOP/s (causal work only)",
              f"SM90 paged prefill ({torch.cuda.get_device_name()}, page {PAGE})", row_width=1.4)


def select_shapes(keys: str | None) -> list[tuple]:
    """The :data:`SHAPES` whose name contains one of the comma-separated ``keys`` (all: None);
    ``ValueError`` for a key that matches no shape."""
    return select_named("--shapes", keys, SHAPES)


def requested_peers(args) -> tuple[str, ...]:
    """The ``--peers`` entries (all of :data:`PEERS` when not given; ``''``: ours alone)."""
    return choice_list("--peers", ",".join(PEERS) if args.peers is None else args.peers, PEERS, allow_empty=True)


def check_arguments(args) -> None:
    """Every value of the command line, before the GPU check (:func:`cute_kernels.bench.main`)."""
    if args.api == "trtllm":
        from . import trtllm

        check_unused("with --api trtllm", {"--peers": args.peers is not None, "--png": args.png is not None})
        trtllm.check_arguments(args, trtllm.PREFILL_SHAPES)
        return
    requested_peers(args)
    choice_list("--kv", args.kv, KV_DTYPES)
    select_shapes(args.shapes)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_kernel_argument(p, "prefill", "FlashInfer's fa2 prefill")
    p.add_argument("--peers", default=None,
                   help="comma-separated entries besides ours: " + ", ".join(PEERS) + " (default: all)")
    p.add_argument("--kv", default=",".join(KV_DTYPES), help="cache dtypes: bf16,fp8")
    p.add_argument("--shapes", default=None, help="comma-separated substrings selecting shapes by name")
    p.add_argument("--quick", action="store_true", help="skip the reference (no error column)")
    p.add_argument("--png", default=None, metavar="PATH", help="write a bar chart to PATH")
    p.add_argument("--api", default="ops", choices=("ops", "trtllm"),
                   help="ops: paged_prefill against its peers; trtllm: the cute_kernels.trtllm context call next to "
                        "FlashInfer's trtllm_batch_context_with_kv_cache, windows and sinks (default: %(default)s)")


def main(args) -> None:
    if args.api == "trtllm":
        from . import trtllm

        trtllm.main_prefill(args)
        return
    peers, png = runnable(list(requested_peers(args)), PEER_LIBS, args.png)
    run(peers=tuple(peers), kv_dtypes=choice_list("--kv", args.kv, KV_DTYPES), shapes=select_shapes(args.shapes),
        out_json=args.json, out_png=png, quick=args.quick, nvtx=args.nvtx)
