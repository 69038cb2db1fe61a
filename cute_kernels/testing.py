"""Input builders shared by the GPU tests and the benchmarks (torch only).

They build realistic serving inputs: a KV pool with more pages than used, a randomly permuted
block table, ragged sequence lengths with partial last pages, stale (even NaN) cache contents
past each sequence's end, and optionally a query that is a view of a fused QKV tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

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
    table_tokens: int | None = None,
    generator: torch.Generator | None = None,
    device: str = "cuda",
) -> PagedDecodeCase:
    """A random paged-decode problem. ``seq_lens``: an int (all equal) or a list of B ints.
    ``table_tokens``: the block table's width in tokens (e.g. a serving engine's max model length;
    its unused columns hold random page ids); default: one page past the longest request."""
    g = generator
    lens = [int(seq_lens)] * batch if isinstance(seq_lens, int) else [int(x) for x in seq_lens]
    assert len(lens) == batch
    width = None if table_tokens is None else math.ceil(table_tokens / page_size)
    table, P = _block_table(lens, page_size, spare_pages, g, device, width)
    kv = _kv_pool(P, num_kv_heads, head_dim, page_size, kv_dtype, kv_layout, g, device)
    if poison_tail:
        _poison_tails(kv, table, lens, page_size, kv_layout)
    D, Hkv = head_dim, num_kv_heads
    kv_cache = (kv[:, 0].clone(), kv[:, 1].clone()) if container == "tuple" else kv
    q = _query(batch * q_len, num_q_heads, Hkv, D, q_dtype, fused_qkv, g, device)
    return PagedDecodeCase(
        q=q, kv_cache=kv_cache, block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        kv_layout=kv_layout, q_len=q_len, k_scale=k_scale, v_scale=v_scale,
        meta=dict(num_kv_heads=Hkv, head_dim=D, kv_bytes=1 if kv_dtype == FP8 else 2, page_size=page_size),
    )


def _draw(fn, *args, g, device, **kw):
    """``fn(*args)`` drawn on the generator's device, then moved to ``device``: a CPU generator gives
    the same case on any GPU (and keeps torch's random kernels off the GPU)."""
    return fn(*args, **kw, generator=g, device=device if g is None else g.device).to(device)


def _block_table(lens, page_size, spare_pages, g, device, width=None):
    """``(table, P)``: a randomly permuted block table over a pool of ``P = sum(pages) +
    spare_pages`` pages, ``width`` columns (default: one column of junk ids past the longest
    request; junk ids in every unused column)."""
    pages_per = [math.ceil(L / page_size) for L in lens]
    if width is None:
        width = max(pages_per + [1]) + 1  # one extra column of junk ids
    elif width < max(pages_per + [1]):
        raise ValueError(f"a block table of {width} pages cannot hold a request of {max(pages_per)} pages")
    P = sum(pages_per) + spare_pages
    perm = _draw(torch.randperm, P, g=g, device=device if g is not None else "cpu").to(device)
    table = _draw(torch.randint, 0, P, (len(lens), width), dtype=torch.int32, g=g, device=device)
    ofs = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[ofs:ofs + n].int()
        ofs += n
    return table, P


def _query(T, Hq, Hkv, D, q_dtype, fused_qkv, g, device):
    """``[T, Hq, D]``, or with ``fused_qkv`` a view of a fused QKV projection (token stride
    ``(Hq + 2 Hkv) D``)."""
    if fused_qkv:
        qkv = _draw(torch.randn, T, (Hq + 2 * Hkv) * D, g=g, device=device).to(q_dtype)
        return qkv[:, : Hq * D].view(T, Hq, D)
    return _draw(torch.randn, T, Hq, D, g=g, device=device).to(q_dtype)


def _kv_pool(P, Hkv, D, page_size, kv_dtype, kv_layout, g, device):
    shape = (P, 2, Hkv, page_size, D) if kv_layout == "HND" else (P, 2, page_size, Hkv, D)
    if kv_dtype == FP8:
        return (_draw(torch.randn, shape, g=g, device=device) * 64).clamp(-448, 448).to(FP8)
    return _draw(torch.randn, shape, g=g, device=device).to(kv_dtype)


def _poison_tails(kv, table, lens, page_size, kv_layout):
    """Stale bytes past each request's end (NaN for 16-bit caches, NaN codes for FP8): kernels must
    never let them reach the output."""
    bad = torch.tensor(float("nan"), device=kv.device).to(kv.dtype) if kv.dtype != FP8 else None
    for b, L in enumerate(lens):
        if L % page_size:
            pid = int(table[b, L // page_size])
            tail = (slice(None), slice(L % page_size, None)) if kv_layout == "HND" else (slice(L % page_size, None),)
            view = kv[(slice(pid, pid + 1), slice(None)) + tail]
            if bad is None:
                view.view(torch.uint8).fill_(0x7F)
            else:
                view.fill_(bad)


@dataclass
class PagedPrefillCase:
    q: torch.Tensor
    kv_cache: object  # tensor or (k, v)
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_layout: str
    k_scale: float | torch.Tensor
    v_scale: float | torch.Tensor
    reqs: list  # (prefix, q_len) per request
    meta: dict = field(default_factory=dict)

    def kwargs(self):
        return dict(kv_layout=self.kv_layout, k_scale=self.k_scale, v_scale=self.v_scale)

    @property
    def max_query_len(self) -> int:
        return max([n for _, n in self.reqs] + [0])

    def attended_pairs(self, causal: bool = True) -> int:
        """(query row, KV position) pairs the attention visits: prefix x q_len plus the causal
        triangle of each request (all seq_len positions per row without ``causal``)."""
        if not causal:
            return sum(n * (p + n) for p, n in self.reqs)
        return sum(n * p + n * (n + 1) // 2 for p, n in self.reqs)

    def flops(self, causal: bool = True) -> int:
        """QK and PV multiply-adds of the attended pairs, 2 flops each (causal work only)."""
        return 4 * self.meta["head_dim"] * self.q.shape[1] * self.attended_pairs(causal)


def make_paged_prefill_case(
    *,
    reqs,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    kv_dtype=torch.bfloat16,
    q_dtype=torch.bfloat16,
    kv_layout: str = "HND",
    container: str = "single",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fused_qkv: bool = False,
    poison_tail: bool = True,
    invalid_pages: int = 0,
    spare_pages: int = 7,
    generator: torch.Generator | None = None,
    device: str = "cuda",
) -> PagedPrefillCase:
    """A random varlen paged-prefill problem: ``reqs`` = ``(cached prefix, new tokens)`` per
    request (0 new tokens allowed). ``invalid_pages`` entries of the used block-table range become
    -1 or a page id past the pool (they read as zeros). ``q_dtype`` is 16-bit (quantize it with
    :func:`cute_kernels.quantize_query` for an FP8 query)."""
    g = generator
    reqs = [(int(p), int(n)) for p, n in reqs]
    lens = [p + n for p, n in reqs]
    table, P = _block_table(lens, page_size, spare_pages, g, device)
    kv = _kv_pool(P, num_kv_heads, head_dim, page_size, kv_dtype, kv_layout, g, device)
    if poison_tail:
        _poison_tails(kv, table, lens, page_size, kv_layout)
    used = [(b, c) for b, L in enumerate(lens) for c in range(math.ceil(L / page_size))]
    for i in range(min(invalid_pages, len(used))):
        b, c = used[int(_draw(torch.randint, 0, len(used), (1,), g=g, device=table.device))]
        table[b, c] = -1 if i % 2 == 0 else P + 3
    kv_cache = (kv[:, 0].clone(), kv[:, 1].clone()) if container == "tuple" else kv
    D, Hkv = head_dim, num_kv_heads
    q = _query(sum(n for _, n in reqs), num_q_heads, Hkv, D, q_dtype, fused_qkv, g, device)
    starts = [0]
    for _, n in reqs:
        starts.append(starts[-1] + n)
    return PagedPrefillCase(
        q=q, kv_cache=kv_cache, block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device), kv_layout=kv_layout,
        k_scale=k_scale, v_scale=v_scale, reqs=reqs,
        meta=dict(num_kv_heads=Hkv, head_dim=D, kv_bytes=1 if kv_dtype == FP8 else 2, page_size=page_size),
    )


def per_tensor_q_scale(q: torch.Tensor) -> float:
    """The per-tensor ``q_scale`` that maps ``q``'s largest magnitude onto e4m3's largest (448):
    how the benchmarks quantize a query for the FP8-query kinds. Reads ``q`` (a host sync)."""
    from .reference import FP8_MAX

    return float(q.float().abs().amax()) / FP8_MAX


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


def check_attention(out, lse, ref, ref_lse, seed=None, tol: float = 5e-3, lse_atol: float = 2e-3,
                    lse_rtol: float = 1e-4):
    """The GPU tests' verdict on one call: no NaN/inf in ``out``, relative error <= ``tol``, the
    same empty (-inf LSE) rows as the reference, LSEs close elsewhere; ``seed`` (when given) in
    every message."""
    at = "" if seed is None else f"seed {seed}: "
    assert torch.isfinite(out).all(), f"{at}NaN/inf in output (unwritten or poisoned values leaked)"
    err = rel_err(out, ref)
    assert err <= tol, f"{at}relative error {err:.2e} > {tol}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{at}-inf LSE rows differ"
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=lse_atol, rtol=lse_rtol, msg=lambda m: f"{at}{m}")


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
