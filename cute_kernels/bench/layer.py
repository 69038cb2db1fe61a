"""``cute-kernels bench layer``: the attention-layer glue against bandwidth, torch, and the bare kernel.

1. ``quantize_query`` (Hq 32, D 128, bf16 -> FP8, per-tensor scale; also with fused NeoX RoPE) and
   ``write_kv_cache`` (Hkv 8, D 128, bf16 -> FP8 cache, page 16, HND) at T in {1, 64, 4096, 65536}:
   CUDA-graph time, % of the read bandwidth measured in this process (bytes read + written /
   bandwidth: the roofline of a streaming kernel; also against the measured device-to-device copy
   bandwidth, the fairer roofline for a kernel that writes a third of its bytes), and the speedup
   over the torch expression
   doing the same thing (``(q.float() / s).clamp(-448, 448).to(fp8)``, an index_put for the cache).
   Each kernel's codes are also compared with the reference (``mismatch`` = differing bytes).
2. One decode step of :class:`dispatch.AttentionLayer` (write the new K/V, then attend) for the
   Qwen3-30B shape (Hq 32, Hkv 4, D 128, B=8, ctx 32000, FP8 cache, page 16), captured in a CUDA
   graph, against the bare ``cute_kernels.paged_decode`` in the same graph setup.

Targets (docs/design/layer.md): >= 80 % of the read bandwidth at T >= 4096, never slower than
torch, and the layer step at most 10 % slower than the bare decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops import quantize_query as qq_op
from cute_kernels.ops import write_kv_cache as kv_op
from cute_kernels.testing import make_paged_decode_case

from .harness import SM90, NvtxRanges, int_list, parse_variants, write_json
from .timing import copy_bandwidth, read_bandwidth, time_eager, time_graph

NEEDS = SM90

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
TOKENS = (1, 64, 4096, 65536)
HQ, HKV, D, PAGE = 32, 8, 128, 16


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    """Differing FP8 bytes, NaN codes counted equal to each other."""
    nan = a.float().isnan() & b.float().isnan()
    return int(((a.view(torch.uint8) != b.view(torch.uint8)) & ~nan).sum())


def _label(var: dict) -> str:
    return ",".join(f"{k}={int(v)}" for k, v in var.items()) or "default"


def bench_quantize(T: int, bw: float, cbw: float, g: torch.Generator, rope: bool, variants,
                   ranges: NvtxRanges) -> list:
    q = (torch.randn(T, HQ, D, device="cuda", generator=g) * 3).to(BF16)
    scale = 0.0625
    s_dev = torch.tensor(scale, device="cuda")
    out = torch.empty(T, HQ, D, dtype=FP8, device="cuda")
    rope_args = None
    if rope:
        rot, max_pos = D, 1 << 17
        cos_sin = torch.randn(max_pos, rot, device="cuda", generator=g)
        pos = torch.randint(0, max_pos, (T,), device="cuda", generator=g)
        rope_args = (cos_sin, pos)
        half = rot // 2

        def torch_fn():
            cs = cos_sin[pos]
            c, s = cs[:, None, :half], cs[:, None, half:]
            x = q.float()
            x1, x2 = x[..., :half], x[..., half:]
            y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
            return (y / s_dev).clamp(-448, 448).to(FP8)
    else:
        def torch_fn():
            return (q.float() / s_dev).clamp(-448, 448).to(FP8)

    tt = time_graph(ranges.wrap("bench.torch", torch_fn))
    nbytes = q.numel() * 3 + (T * (D * 4 + 8) if rope else 0)
    rows = []
    for var in variants:
        with qq_op.tuning_override(**var):
            fn = ranges.wrap("cute_kernels.quantize_query",
                             lambda: cute_kernels.quantize_query(q, scale, out=out, rope=rope_args))

            out.view(torch.uint8).fill_(0x7F)  # poison: NaN codes
            fn()
            mism = _mismatch(out, reference.quantize_query(q, scale, rope=rope_args))
            t = time_graph(fn)
        rows.append(dict(op="quantize_query" + ("+rope" if rope else ""), T=T, variant=_label(var), us=t * 1e6,
                         torch_us=tt * 1e6, bytes=nbytes, roofline_pct=100 * nbytes / bw / t,
                         copy_pct=100 * nbytes / cbw / t, speedup=tt / t, mismatch=mism))
    return rows


def bench_write(T: int, bw: float, cbw: float, g: torch.Generator, variants, ranges: NvtxRanges) -> list:
    pages = (T + PAGE - 1) // PAGE + 3
    kv = torch.zeros(pages, 2, HKV, PAGE, D, dtype=FP8, device="cuda")
    # each token its own slot, pages in random order (as a block allocator hands them out)
    perm = torch.randperm(pages, device="cuda", generator=g)
    tok = torch.arange(T, device="cuda")
    slot = perm[tok // PAGE] * PAGE + tok % PAGE
    kv_in = (torch.randn(T, 2 * HKV, D, device="cuda", generator=g) * 8).to(BF16)  # fused K|V rows
    k, v = kv_in[:, :HKV], kv_in[:, HKV:]
    ks, vs = 0.0625, 0.03125
    ks_dev, vs_dev = torch.tensor(ks, device="cuda"), torch.tensor(vs, device="cuda")
    kc, vc = kv[:, 0], kv[:, 1]

    def torch_fn():
        pg, off = slot // PAGE, slot % PAGE
        kc[pg, :, off] = (k.float() / ks_dev).clamp(-448, 448).to(FP8)
        vc[pg, :, off] = (v.float() / vs_dev).clamp(-448, 448).to(FP8)

    tt = time_graph(ranges.wrap("bench.torch", torch_fn))
    ref = torch.zeros_like(kv)
    reference.write_kv_cache(k, v, ref, slot, k_scale=ks, v_scale=vs)
    nbytes = 2 * T * HKV * D * 3 + T * 8
    rows = []
    for var in variants:
        with kv_op.tuning_override(**var):
            fn = ranges.wrap("cute_kernels.write_kv_cache",
                             lambda: cute_kernels.write_kv_cache(k, v, kv, slot, k_scale=ks, v_scale=vs))

            kv.zero_()
            fn()
            mism = _mismatch(kv, ref)
            t = time_graph(fn)
        rows.append(dict(op="write_kv_cache", T=T, variant=_label(var), us=t * 1e6, torch_us=tt * 1e6, bytes=nbytes,
                         roofline_pct=100 * nbytes / bw / t, copy_pct=100 * nbytes / cbw / t, speedup=tt / t,
                         mismatch=mism))
    return rows


@dataclass
class LayerStep:
    """One decode step of an AttentionLayer: its inputs, and the bare decode call's."""

    layer: Any
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    metadata: Any
    case: Any  # the paged-decode case (cute_kernels.testing) the step reads

    def forward(self) -> torch.Tensor:
        return self.layer.forward(self.q, self.k, self.v, self.kv_cache, self.metadata)


def layer_step(g: torch.Generator, *, Hq: int = 32, Hkv: int = 4, D: int = 128, B: int = 8, ctx: int = 32000,
               page: int = PAGE, kv: str = "fp8") -> LayerStep:
    """A decode step of B requests at context ``ctx`` (default: Qwen3-30B B8 ctx32000, FP8 cache):
    fused-QKV query views, the new token the last of each sequence."""
    from dispatch import AttentionLayer, AttentionMetadata

    ks, vs = (0.0625, 0.03125) if kv == "fp8" else (1.0, 1.0)
    kv_dtype = FP8 if kv == "fp8" else BF16
    case = make_paged_decode_case(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                                  seq_lens=ctx, kv_dtype=kv_dtype, generator=g, poison_tail=False, k_scale=ks,
                                  v_scale=vs, fused_qkv=True)
    qkv_new = (torch.randn(B, 2 * Hkv, D, device="cuda", generator=g) * 8).to(BF16)
    k, v = qkv_new[:, :Hkv], qkv_new[:, Hkv:]
    pos = case.seq_lens.long() - 1  # the new token is the last of each sequence
    slot = case.block_table.long().gather(1, (pos // page).view(B, 1)).view(B) * page + pos % page
    md = AttentionMetadata(
        query_start_loc=torch.arange(B + 1, dtype=torch.int32, device="cuda"), seq_lens=case.seq_lens,
        block_table=case.block_table, slot_mapping=slot, num_decode_tokens=B, q_len_per_req=1,
    )
    layer = AttentionLayer(Hq, Hkv, D, kv_cache_dtype=kv_dtype, page_size=page, k_scale=ks, v_scale=vs)
    return LayerStep(layer, case.q, k, v, case.kv_cache, md, case)


def bench_layer_step(g: torch.Generator, ranges: NvtxRanges) -> dict:
    """Qwen3-30B decode step: the layer (write + attend) vs the bare decode, both in CUDA graphs."""
    s = layer_step(g)
    layer, case, k, v, md = s.layer, s.case, s.k, s.v, s.metadata
    ks, vs, B, ctx = case.k_scale, case.v_scale, case.q.shape[0], int(case.seq_lens[0])
    p = layer.plans_for(md)["decode"]
    row = dict(shape=f"qwen3-30b B{B} ctx{ctx} fp8", plan=p.kernel)
    out = torch.empty_like(case.q)

    def bare():
        cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                  k_scale=ks, v_scale=vs)

    def step():
        return layer.forward(case.q, k, v, case.kv_cache, md)

    bare, step = ranges.wrap("cute_kernels.paged_decode", bare), ranges.wrap("bench.layer_step", step)

    res = step()  # writes the new K/V: the bare decode below then reads the same cache
    bare_res = cute_kernels.paged_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out=out,
                                         k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    row["max_abs_diff_vs_bare"] = float((res.float() - bare_res.float()).abs().max())
    row["bare_us"] = time_graph(bare) * 1e6
    row["bare_eager_us"] = time_eager(bare) * 1e6
    if p.is_fallback:
        row["note"] = f"decode plan is the reference fallback ({p.reason}); not capturable, eager only"
        row["layer_eager_us"] = time_eager(step, warmup=1, reps=3, rounds=3) * 1e6
        return row
    row["layer_us"] = time_graph(step) * 1e6
    row["layer_eager_us"] = time_eager(step) * 1e6
    row["overhead_pct"] = 100 * (row["layer_us"] / row["bare_us"] - 1)
    return row


def run(tokens=TOKENS, out_json: str | None = None, variants=None, nvtx: bool = False) -> dict:
    ranges = NvtxRanges(nvtx)
    bw, cbw = read_bandwidth(), copy_bandwidth()
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    rows = []
    for T in tokens:
        rows += bench_quantize(T, bw, cbw, g, False, variants or ({},), ranges)
        rows += bench_quantize(T, bw, cbw, g, True, variants or ({},), ranges)
        rows += bench_write(T, bw, cbw, g, variants or ({},), ranges)
    print(f"read bandwidth: {bw / 1e12:.2f} TB/s, copy bandwidth (read + write): {cbw / 1e12:.2f} TB/s")
    print(f"{'op':<20} {'T':>6} {'variant':>14} {'us':>9} {'%read':>6} {'%copy':>6} {'torch us':>9} {'speedup':>8} {'mismatch':>9}")
    for r in rows:
        print(f"{r['op']:<20} {r['T']:>6} {r['variant']:>14} {r['us']:>9.2f} {r['roofline_pct']:>6.1f} {r['copy_pct']:>6.1f} "
              f"{r['torch_us']:>9.2f} {r['speedup']:>7.2f}x {r['mismatch']:>9}")
    step = bench_layer_step(g, ranges)
    print(f"\ndecode step {step['shape']} (plan: {step['plan']})")
    print(f"  bare paged_decode   graph {step['bare_us']:8.2f} us   eager {step['bare_eager_us']:8.2f} us")
    if "layer_us" in step:
        print(f"  layer (write+attn)  graph {step['layer_us']:8.2f} us   eager {step['layer_eager_us']:8.2f} us   "
              f"overhead {step['overhead_pct']:+.1f} % (target <= 10 %)")
    else:
        print(f"  layer eager {step['layer_eager_us']:.2f} us; {step['note']}")
    print(f"  max |layer - bare| = {step['max_abs_diff_vs_bare']:.3g}")
    result = dict(read_bw=bw, copy_bw=cbw, rows=rows, layer_step=step)
    write_json(out_json, result)
    return result


def add_arguments(p) -> None:
    p.add_argument("--tokens", default=",".join(str(t) for t in TOKENS),
                   help="comma-separated token counts (default: %(default)s)")
    p.add_argument("--variants", default=None,
                   help="config overrides to compare, e.g. 'items=1;items=2,pdl=0' (default: the ops' own)")


def check_arguments(a) -> tuple[tuple[int, ...], list[dict] | None]:
    """``(tokens, variants)`` of the command line, each value checked: ``ValueError`` naming the
    flag, before the GPU check."""
    tokens = int_list("--tokens", a.tokens)
    if not a.variants:
        return tokens, None
    try:
        variants = [{k: bool(v) if k == "pdl" else v for k, v in var.items()} for var in parse_variants(a.variants)]
        for var in variants:  # each variant applies to both ops: its fields must be tuning fields of both
            qq_op.check_tuning_override(var)
            kv_op.check_tuning_override(var)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--variants: {str(e).removeprefix('tuning_override: ')}") from None
    return tokens, variants


def main(a) -> None:
    tokens, variants = check_arguments(a)
    run(tokens, a.json, variants, nvtx=a.nvtx)
