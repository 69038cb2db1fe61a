"""CPU emulation (float64 torch) of the FP8-query prefill's numerics: where its error against the
exact attention comes from, and what each design choice would change
(docs/design/sm90-prefill.md#the-fp8-querys-error).

The emulated kernel (``sm90.prefill_fp8q``, kind ``"fp8"``; ``cute_kernels/sm90/prefill.py``,
``roles/online_softmax.py``, ``roles/smem_fp8.py``):

- the query is the e4m3 code ``rne(q / q_scale)`` (``cute_kernels.quantize_query``: per tensor, or
  per KV head), K and V the cache's e4m3 codes; QK is exact on the codes (the MMA's narrow
  accumulator is a separate, optional model: ``--acc-bits``);
- KV tiles of ``tile_n`` keys are walked from the last down; each row's running max is updated per
  tile, ``P = exp2(s - running max)`` in fp32, the row sum takes the unrounded P, and the PV MMA
  reads ``e4m3(P * 2^8)``; O is rescaled by ``exp2(old max - new max)`` and divided by the sum.

Each variant changes one of those choices (table in ``VARIANTS``). The error is
``cute_kernels.testing.rel_err`` against the float64 attention on the unquantized (bf16) query
and the dequantized cache, as ``cute-kernels bench prefill`` measures it.

    python -m profiling.fp8_query_error [--dist bench,serve,heads] [--seeds 3] [--rows 1024]
        [--variants NAME,...] [--acc-bits 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
LOG2E = 1.0 / math.log(2.0)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round ``x``'s fp32 value (the kernels convert from fp32) to the nearest e4m3 value (ties to
    even, saturating at ±448), in float64 arithmetic: 3 fraction bits, subnormals below 2^-6 spaced
    2^-9 (equal to torch's conversion: ``tests/cpu/test_fp8_query_error.py``)."""
    x = x.float().double()
    _, e = torch.frexp(x)  # x = m 2^e, 0.5 <= |m| < 1: the leading bit is 2^(e-1)
    quantum = torch.ldexp(torch.ones_like(x), (e.clamp_min(-5) - 4))
    return (torch.round(x / quantum) * quantum).clamp(-E4M3_MAX, E4M3_MAX)


def round_to(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "exact":
        return x
    if kind == "e4m3":
        return e4m3(x)
    return x.to({"bf16": torch.bfloat16, "fp16": torch.float16}[kind]).double()


def truncate_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` with its significand truncated (toward zero) to ``bits`` bits: a model of an
    accumulator that keeps fewer bits than fp32."""
    m, e = torch.frexp(x)
    scale = 2.0 ** bits
    return torch.ldexp(torch.trunc(m * scale) / scale, e)


@dataclass(frozen=True)
class Variant:
    """One set of numerics choices.

    ``q``: ``"bf16"`` (the exact query), ``"e4m3"`` or ``"e4m3x2"`` (the query as two e4m3 terms,
    ``hi = e4m3(q / s)``, ``lo = e4m3(q / s - hi)``: two QK MMAs into one accumulator);
    ``q_scale``: ``"tensor"`` (``amax / 448`` over the batch), ``"head"`` (per query head),
    ``"kv_head"`` (per KV head: the op's ``[Hkv]`` tensor), ``"token_head"`` (per row and head);
    ``p``: the rounding of P for the PV MMA (``"e4m3"``, ``"bf16"``, ``"fp16"``, ``"exact"``);
    ``p_mul``: P is rounded as ``round(P * p_mul) / p_mul`` (the kernel: 2^8; FlashInfer: 448);
    ``sum_rounded``: the row sum takes the rounded P (the same weights as the numerator)."""

    q: str = "e4m3"
    q_scale: str = "tensor"
    p: str = "e4m3"
    p_mul: float = 256.0
    sum_rounded: bool = False
    note: str = ""


VARIANTS = {
    "ours": Variant(note="sm90.prefill_fp8q as built: per-tensor q scale, e4m3(P*2^8), fp32 row sum"),
    "q_per_kv_head": Variant(q_scale="kv_head", note="q_scale per KV head (the op's [Hkv] tensor)"),
    "q_per_head": Variant(q_scale="head", note="q_scale per query head"),
    "q_per_token_head": Variant(q_scale="token_head", note="q_scale per row and head (dynamic)"),
    "p_mul_448": Variant(p_mul=448.0, note="e4m3(P*448) (FlashInfer fa3's FP8 variant)"),
    "p_mul_1": Variant(p_mul=1.0, note="e4m3(P) unscaled: P < 2^-6 subnormal"),
    "p_mul_16": Variant(p_mul=16.0, note="e4m3(P*2^4)"),
    "sum_rounded": Variant(sum_rounded=True, note="row sum of the rounded P"),
    "flashinfer_fa3": Variant(q_scale="tensor", p_mul=448.0,
                              note="FlashInfer fa3 FP8 prefill as its public code reads: q_scale per tensor "
                                   "(the serve bench's) or per head, e4m3(P*448), row sum of the fp32 P"),
    "p_bf16": Variant(p="bf16", p_mul=1.0, note="FP8 QK, P kept bf16 (PV in 16 bits on widened V)"),
    "p_fp16": Variant(p="fp16", p_mul=1.0, note="FP8 QK, P kept fp16 (PV in 16 bits on widened V)"),
    "p_exact": Variant(p="exact", p_mul=1.0, note="FP8 QK, P exact: the query's share alone"),
    "q_exact_p_e4m3": Variant(q="bf16", note="exact query, e4m3(P*2^8): P's share alone"),
    "q_x2": Variant(q="e4m3x2", note="query as two e4m3 terms (2 QK MMAs), e4m3(P*2^8)"),
    "q_x2_p_fp16": Variant(q="e4m3x2", p="fp16", p_mul=1.0, note="two-term query, P fp16"),
    "bf16_query_kernel": Variant(q="bf16", p="fp16", p_mul=1.0,
                                 note="the widen kind (bf16 query narrowed per row to fp16 exactly, fp16 P)"),
}


# ----------------------------------------------------------------------------------------------
# problems
# ----------------------------------------------------------------------------------------------


@dataclass
class Problem:
    """Requests of one distribution: per request ``q`` [M, Hq, D] (float64 of the bf16 query),
    ``k8``/``v8`` [L, Hkv, D] (float64 of the e4m3 codes), the scales and the prefix length."""

    name: str
    reqs: list  # (q, k8, v8, prefix)
    k_scale: float
    v_scale: float
    sm_scale: float
    tile_n: int


def _bench_request(g, prefix, n, Hq, Hkv, D):
    """One request of ``cute-kernels bench prefill``'s distribution (``make_paged_prefill_case``
    with an FP8 cache: codes ``e4m3(64 N(0,1))``, k_scale 1/16, v_scale 1/32; bf16 N(0,1) query)."""
    L = prefix + n
    k8 = e4m3(torch.randn(L, Hkv, D, generator=g, dtype=torch.float64) * 64)
    v8 = e4m3(torch.randn(L, Hkv, D, generator=g, dtype=torch.float64) * 64)
    q = torch.randn(n, Hq, D, generator=g).to(torch.bfloat16).double()
    return q, k8, v8, prefix


def _serve_request(g, prefix, n, Hq, Hkv, D, k_scale, v_scale):
    """One request of ``cute-kernels bench serve``'s distribution: bf16 N(0,1) q, k, v; the cache
    holds ``e4m3(k / k_scale)`` (``write_kv_cache``)."""
    L = prefix + n
    k = torch.randn(L, Hkv, D, generator=g).to(torch.bfloat16).double()
    v = torch.randn(L, Hkv, D, generator=g).to(torch.bfloat16).double()
    q = torch.randn(n, Hq, D, generator=g).to(torch.bfloat16).double()
    return q, e4m3(k / k_scale), e4m3(v / v_scale), prefix


def bench_problems(g, rows, Hq=8, Hkv=2):
    """The bench prefill shapes' kinds at CPU sizes: causal from 0, a chunk on a long prefix,
    a short batch, D 64 and D 256 (GQA 4 like the bench's 32/8)."""
    out = []
    for name, B, prefix, n, D in [
        (f"causal S{rows}", 1, 0, rows, 128),
        (f"causal S{2 * rows}", 1, 0, 2 * rows, 128),
        (f"chunked q{rows // 2} ctx{4 * rows}", 1, 4 * rows - rows // 2, rows // 2, 128),
        ("short B4 S512", 4, 0, 512, 128),
        (f"d64 S{rows}", 1, 0, rows, 64),
        (f"d256 S{rows}", 1, 0, rows, 256),
    ]:
        reqs = [_bench_request(g, prefix, n, Hq, Hkv, D) for _ in range(B)]
        out.append(Problem(name, reqs, 1 / 16, 1 / 32, D ** -0.5, 64 if D == 256 else 128))
    return out


def serve_problems(g, rows, Hq=8, Hkv=1):
    """The serve bench's inputs (Qwen3-30B-A3B's layer: GQA 8, D 128; k/v scales 1/16, 1/32):
    a first chunk, a chunk after a long prefix, a short prompt."""
    out = []
    for name, prefix, n in [(f"first chunk S{rows}", 0, rows), (f"chunk q{rows // 2} ctx{8 * rows}", 8 * rows - rows // 2, rows // 2),
                            ("short S2000", 0, 2000)]:
        out.append(Problem(name, [_serve_request(g, prefix, n, Hq, Hkv, 128, 1 / 16, 1 / 32)], 1 / 16, 1 / 32,
                           128 ** -0.5, 128))
    return out


def heads_problems(g, rows, Hq=8, Hkv=2):
    """The bench distribution with query heads of very different magnitudes (head h scaled by
    2^-(2h)): where a per-tensor q scale pushes small heads toward e4m3's subnormals."""
    q, k8, v8, prefix = _bench_request(g, 0, rows, Hq, Hkv, 128)
    q = (q * (2.0 ** (-2.0 * torch.arange(Hq, dtype=torch.float64))).view(1, Hq, 1)).to(torch.bfloat16).double()
    return [Problem(f"causal S{rows}, head h x 2^-2h", [(q, k8, v8, prefix)], 1 / 16, 1 / 32, 128 ** -0.5, 128)]


# ----------------------------------------------------------------------------------------------
# the emulation
# ----------------------------------------------------------------------------------------------


def quantize_q(q_all, var: Variant, Hkv):
    """``(codes, scale)`` per request: the query's e4m3 codes (summed terms for ``e4m3x2``) and the
    scale that multiplies them back, broadcastable to [M, Hq, 1]. The per-tensor scale is taken
    over the whole batch (all requests), as the benches take it."""
    if var.q == "bf16":
        return [(q, torch.ones(1, 1, 1, dtype=torch.float64)) for q in q_all]
    Hq = q_all[0].shape[1]
    if var.q_scale == "tensor":
        amax = max(float(q.abs().amax()) for q in q_all)
        scales = [torch.full((1, 1, 1), amax / E4M3_MAX, dtype=torch.float64)] * len(q_all)
    elif var.q_scale in ("head", "kv_head"):
        amax = torch.stack([q.abs().amax(dim=(0, 2)) for q in q_all]).amax(0)  # [Hq]
        if var.q_scale == "kv_head":
            amax = amax.view(Hkv, -1).amax(1).repeat_interleave(Hq // Hkv)
        scales = [(amax / E4M3_MAX).view(1, Hq, 1)] * len(q_all)
    else:  # token_head
        scales = [(q.abs().amax(dim=2, keepdim=True) / E4M3_MAX).clamp_min(1e-30) for q in q_all]
    # the op divides in fp32 (div.rn.f32): the fp32 quotient, then RNE to e4m3
    out = []
    for q, s in zip(q_all, scales):
        x = (q.float() / s.float()).double()
        hi = e4m3(x)
        codes = hi + e4m3(x - hi) if var.q == "e4m3x2" else hi
        out.append((codes, s.float().double()))
    return out


def attend(qc, qs, k8, v8, prefix, pb: Problem, var: Variant, acc_bits: int = 0):
    """The emulated kernel's output [M, Hq, D] for one request (float64)."""
    M, Hq, D = qc.shape
    L, Hkv = k8.shape[0], k8.shape[1]
    G = Hq // Hkv
    tn = pb.tile_n
    nT = math.ceil(L / tn)
    pad = nT * tn - L
    rows = torch.arange(M).view(M, 1)
    cols = torch.arange(nT * tn).view(1, -1)
    visible = cols <= prefix + rows  # causal; padding columns lie past every row's limit
    out = torch.empty(M, Hq, D, dtype=torch.float64)
    for h in range(Hq):
        kh = k8[:, h // G]
        vh = torch.nn.functional.pad(v8[:, h // G] * pb.v_scale, (0, 0, 0, pad)).view(nT, tn, D)
        if acc_bits:
            # QK accumulated k-block by k-block (32 deep, one e4m3 WGMMA instruction), the running
            # sum truncated to acc_bits significant bits after each block
            acc = torch.zeros(M, L, dtype=torch.float64)
            for k0 in range(0, D, 32):
                acc = truncate_bits(acc + qc[:, h, k0:k0 + 32] @ kh[:, k0:k0 + 32].T, acc_bits)
            raw = acc
        else:
            raw = qc[:, h] @ kh.T
        c = float(pb.sm_scale * pb.k_scale * LOG2E)
        s = raw * qs[:, h if qs.shape[1] > 1 else 0] * c  # [M or 1, 1]: the row's or the tensor's scale
        s = torch.nn.functional.pad(s, (0, pad), value=-math.inf)
        s = torch.where(visible, s, -math.inf).view(M, nT, tn)
        tile_max = s.amax(-1)  # [M, nT]
        run = torch.flip(torch.cummax(torch.flip(tile_max, [1]), 1).values, [1])  # tiles walked last->first
        shift = torch.where(torch.isinf(run), torch.zeros_like(run), run)
        p = torch.exp2(s - shift.unsqueeze(-1))  # the kernel's fp32 P, in [0, 1]
        p = p.float().double()
        pr = round_to(p * var.p_mul, var.p) / var.p_mul
        final = run[:, 0:1]
        w = torch.exp2(shift - torch.where(torch.isinf(final), torch.zeros_like(final), final))  # rescale to the final max
        denom = ((pr if var.sum_rounded else p) * w.unsqueeze(-1)).sum((1, 2))
        num = (pr * w.unsqueeze(-1)).view(M, nT * tn) @ vh.view(nT * tn, D)
        out[:, h] = num / denom.clamp_min(1e-300).view(M, 1)
    return out.to(torch.bfloat16).double()  # the kernel writes bf16


def exact(q, k8, v8, prefix, pb: Problem):
    """float64 attention on the unquantized query and the dequantized cache."""
    M, Hq, D = q.shape
    L, Hkv = k8.shape[0], k8.shape[1]
    G = Hq // Hkv
    k = (k8 * pb.k_scale).repeat_interleave(G, 1)
    v = (v8 * pb.v_scale).repeat_interleave(G, 1)
    s = torch.einsum("mhd,lhd->hml", q, k) * pb.sm_scale
    vis = torch.arange(L).view(1, L) <= prefix + torch.arange(M).view(M, 1)
    s = torch.where(vis, s, -math.inf)
    return torch.einsum("hml,lhd->mhd", torch.softmax(s, -1), v).to(torch.bfloat16).double()  # as the bench's reference


def rel_err(out, ref):
    return float((out - ref).norm() / ref.norm())


def logit_sigma(pb: Problem) -> float:
    q, k8, _, _ = pb.reqs[0]
    G = q.shape[1] // k8.shape[1]
    s = torch.einsum("mhd,lhd->hml", q[:256], (k8[:512] * pb.k_scale).repeat_interleave(G, 1)) * pb.sm_scale
    return float(s.std())


def run(dists, seeds, rows, variants, acc_bits, log=print):
    makers = {"bench": bench_problems, "serve": serve_problems, "heads": heads_problems}
    results = {}  # (dist, problem) -> {variant: [err per seed]}
    sigmas = {}
    for dist in dists:
        for seed in range(seeds):
            g = torch.Generator().manual_seed(1000 + seed)
            for pb in makers[dist](g, rows):
                key = f"{dist}: {pb.name}"
                sigmas.setdefault(key, logit_sigma(pb))
                Hkv = pb.reqs[0][1].shape[1]
                refs = [exact(q, k8, v8, p, pb) for q, k8, v8, p in pb.reqs]
                for name in variants:
                    var = VARIANTS[name]
                    qq = quantize_q([r[0] for r in pb.reqs], var, Hkv)
                    outs = [attend(qc, qs, k8, v8, p, pb, var, acc_bits) for (qc, qs), (_, k8, v8, p) in zip(qq, pb.reqs)]
                    err = rel_err(torch.cat(outs), torch.cat(refs))
                    results.setdefault(key, {}).setdefault(name, []).append(err)
                log(f"seed {seed} {key}: " + " ".join(f"{n}={results[key][n][-1]:.2e}" for n in variants))
    return results, sigmas


def table(results, sigmas, variants):
    lines = ["| inputs | logit σ | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    for key, per in results.items():
        lines.append(f"| {key} | {sigmas[key]:.1f} | " + " | ".join(f"{statistics.median(per[v]):.1e}" for v in variants) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dist", default="bench,serve,heads")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--acc-bits", type=int, default=0, help="model a QK accumulator of this many significant bits (0: exact)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    variants = a.variants.split(",")
    t0 = time.time()
    results, sigmas = run(a.dist.split(","), a.seeds, a.rows, variants, a.acc_bits)
    print(table(results, sigmas, variants))
    print(f"({time.time() - t0:.0f} s, medians over {a.seeds} seeds)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), logit_sigma=sigmas, errors=results,
                           variants={n: VARIANTS[n].note for n in variants}), f, indent=1)


if __name__ == "__main__":
    main()
