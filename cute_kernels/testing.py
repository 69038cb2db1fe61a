"""Input builders shared by the GPU tests and the benchmarks (torch only).

They build realistic serving inputs: a KV pool with more pages than used, a randomly permuted
block table, ragged sequence lengths with partial last pages, stale (even NaN) cache contents
past each sequence's end, and optionally a query that is a view of a fused QKV tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import reference

FP8 = torch.float8_e4m3fn


@dataclass
class PagedDecodeCase:
    q: torch.Tensor
    kv_cache: object  # tensor or (k, v)
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    kv_layout: str
    q_len: int
    k_scale: float | torch.Tensor
    v_scale: float | torch.Tensor
    meta: dict = field(default_factory=dict)

    def kwargs(self):
        return dict(kv_layout=self.kv_layout, q_len_per_req=self.q_len, k_scale=self.k_scale, v_scale=self.v_scale)

    def visible_kv_bytes(self) -> int:
        """Bytes of K and V the attention must read (each request's seq_len tokens)."""
        per_token = 2 * self.meta["num_kv_heads"] * self.meta["head_dim"] * self.meta["kv_bytes"]
        return int(self.seq_lens.sum().item()) * per_token


def make_paged_decode_case(
    *,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens,
    kv_dtype=FP8,
    q_dtype=torch.bfloat16,
    q_len: int = 1,
    kv_layout: str = "HND",
    container: str = "single",
    k_scale: float = 0.0625,
    v_scale: float = 0.03125,
    fused_qkv: bool = False,
    poison_tail: bool = True,
    spare_pages: int = 7,
    generator: torch.Generator | None = None,
    device: str = "cuda",
) -> PagedDecodeCase:
    """A random paged-decode problem. ``seq_lens``: an int (all equal) or a list of B ints."""
    g = generator
    lens = [int(seq_lens)] * batch if isinstance(seq_lens, int) else [int(x) for x in seq_lens]
    assert len(lens) == batch
    pages_per = [math.ceil(L / page_size) for L in lens]
    width = max(max(pages_per), 1) + 1  # one extra column of junk ids
    used = sum(pages_per)
    P = used + spare_pages
    perm = torch.randperm(P, generator=g, device="cpu" if g is None or g.device.type == "cpu" else device)
    perm = perm.to(device)
    table = torch.randint(0, P, (batch, width), dtype=torch.int32, device=device, generator=g)
    ofs = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[ofs:ofs + n].int()
        ofs += n
    D, Hkv = head_dim, num_kv_heads
    shape = (P, 2, Hkv, page_size, D) if kv_layout == "HND" else (P, 2, page_size, Hkv, D)
    if kv_dtype == FP8:
        kv = (torch.randn(shape, device=device, generator=g) * 64).clamp(-448, 448).to(FP8)
    else:
        kv = torch.randn(shape, device=device, generator=g).to(kv_dtype)
    if poison_tail:
        # stale bytes past each request's end (NaN for 16-bit caches, NaN codes for FP8):
        # kernels must never let them reach the output
        bad = torch.tensor(float("nan"), device=device).to(kv_dtype) if kv_dtype != FP8 else None
        for b, L in enumerate(lens):
            if L % page_size:
                pid = int(table[b, L // page_size])
                sl = (slice(pid, pid + 1), slice(None))
                tail = (slice(None), slice(L % page_size, None)) if kv_layout == "HND" else (slice(L % page_size, None), slice(None))
                view = kv[sl + tail]
                if bad is None:
                    view.view(torch.uint8).fill_(0x7F)
                else:
                    view.fill_(bad)
    if container == "tuple":
        k = kv[:, 0].clone()
        v = kv[:, 1].clone()
        kv_cache = (k, v)
    else:
        kv_cache = kv
    T = batch * q_len
    if fused_qkv:
        qkv = torch.randn(T, (num_q_heads + 2 * Hkv) * D, device=device, generator=g).to(q_dtype)
        q = qkv[:, : num_q_heads * D].view(T, num_q_heads, D)
    else:
        q = torch.randn(T, num_q_heads, D, device=device, generator=g).to(q_dtype)
    return PagedDecodeCase(
        q=q, kv_cache=kv_cache, block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        kv_layout=kv_layout, q_len=q_len, k_scale=k_scale, v_scale=v_scale,
        meta=dict(num_kv_heads=Hkv, head_dim=D, kv_bytes=1 if kv_dtype == FP8 else 2, page_size=page_size),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def ragged_seq_lens(gen, batch: int, page: int) -> list[int]:
    """``batch`` random lengths below 1500 with the edge cases first: an empty request (zeros and
    a -inf LSE), a page-aligned end, one shorter than a page."""
    lens = torch.randint(1, 1500, (batch,), generator=gen, device=gen.device).tolist()
    lens[0] = 0
    lens[1] = 3 * page
    lens[2] = 7
    return lens


def make_prefill_case(gen, *, q_lens, prefixes, kv, q, D, Hq, Hkv, page, layout, container):
    """A varlen paged-prefill problem: request b has ``q_lens[b]`` new tokens after a cached prefix of
    ``prefixes[b]``; returns the case (its ``q`` is ``[sum(q_lens), Hq, D]``) and ``query_start_loc``."""
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    c = make_paged_decode_case(batch=len(q_lens), num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                               seq_lens=seq_lens, kv_dtype=kv, q_dtype=q, kv_layout=layout, container=container,
                               generator=gen, device=gen.device.type)
    T = sum(q_lens)
    c.q = torch.randn(T, Hq, D, device=gen.device, generator=gen).to(q)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=gen.device)
    return c, qsl


def prefill_reference(c, qsl, causal):
    """Per request: the reference decode with q_len_per_req = the request's q_len (causal), or
    every query row as its own one-token request over the whole sequence (not causal)."""
    starts = qsl.tolist()
    lens = c.seq_lens.tolist()
    out = torch.zeros_like(c.q, dtype=torch.float32)
    lse = torch.full(c.q.shape[:2], float("-inf"), device=c.q.device)
    for b in range(len(lens)):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        if causal:
            o, l_ = reference.paged_decode(c.q[s:e], c.kv_cache, c.block_table[b:b + 1], c.seq_lens[b:b + 1],
                                           kv_layout=c.kv_layout, q_len_per_req=e - s, k_scale=c.k_scale,
                                           v_scale=c.v_scale, return_lse=True)
        else:
            n = e - s
            o, l_ = reference.paged_decode(c.q[s:e], c.kv_cache, c.block_table[b:b + 1].expand(n, -1).contiguous(),
                                           c.seq_lens[b:b + 1].expand(n).contiguous(), kv_layout=c.kv_layout,
                                           k_scale=c.k_scale, v_scale=c.v_scale, return_lse=True)
        out[s:e] = o.float()
        lse[s:e] = l_
    return out.to(c.q.dtype), lse


def check_attention(out, lse, ref, ref_lse, seed, tol: float = 5e-3):
    """The GPU tests' verdict on one call: no NaN/inf in ``out``, relative error <= ``tol``, the
    same empty (-inf LSE) rows as the reference, LSEs close elsewhere; ``seed`` in every message."""
    assert torch.isfinite(out).all(), f"seed {seed}: NaN/inf in output"
    err = rel_err(out, ref)
    assert err <= tol, f"seed {seed}: relative error {err:.2e} > {tol}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"seed {seed}: -inf LSE rows differ"
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=2e-3, rtol=1e-4, msg=lambda m: f"seed {seed}: {m}")


def capture_graph(fn):
    """``fn`` (a call whose variant is compiled and loaded) run once on a side stream, then
    captured into a CUDA graph, which is returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def check_graph_replay(case, call, eager, check, seed=None, new_scales=(0.11, 0.007)):
    """``call(out)`` writes an attention of ``case`` into ``out`` (its variant compiled), ``eager()``
    returns ``(out, lse)`` of a fresh eager call, ``check(out, lse)`` judges a result. Captured into
    a CUDA graph, the replay must equal the eager result bitwise, before and after new values are
    written into the case's k/v scale tensors (read on the device, so a replay sees them); the
    result under the new scales is checked, then the scales are restored."""
    ks, vs = case.k_scale, case.v_scale
    saved = (ks.clone(), vs.clone())
    out = torch.empty_like(case.q)
    graph = capture_graph(lambda: call(out))
    for step in range(2):
        if step:
            ks.fill_(new_scales[0])
            vs.fill_(new_scales[1])
        expected, lse = eager()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        what = "did not see the new scales" if step else "differs from eager"
        assert torch.equal(out, expected), f"seed {seed}: graph replay {what}"
    check(out, lse)
    ks.copy_(saved[0])
    vs.copy_(saved[1])
