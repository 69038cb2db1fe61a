"""The SM90 paged prefill kernel (``sm90.prefill``) called directly, against a float64 reference
written here from the contract (no op, no dispatch: those are tested with the op).

Each case is a varlen batch with cached prefixes (chunked prefill), ``q_len = 0`` requests, a
request whose new tokens outnumber its KV (rows that see nothing), permuted block tables with
junk ids past each sequence, stale NaN bytes past each sequence's end, padding rows after the
last request (never written), and outputs poisoned with NaN. Tolerances: ‖out − ref‖/‖ref‖
against the reference on the same (dequantized) values; the LSE within 2e-3 absolute (base 2),
plus 4e-3 |LSE| for an FP8 query (SM90's FP8 MMA accumulates in fewer bits than fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from cute_kernels.plans.sm90_prefill import CONSUMER_SCHEDULES, make_prefill_config, persistent_ctas

from .conftest import sm90_only

pytestmark = sm90_only()
FP8 = torch.float8_e4m3fn
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": FP8}
# ‖out − ref‖/‖ref‖: 16-bit P and output rounding; FP8 query: e4m3 P (the query's own
# quantization is in the reference)
TOL = {"16": 8e-3, "widen": 8e-3, "fp8": 4e-2}


@dataclass
class PrefillCase:
    q: torch.Tensor
    kv: object  # [P, 2, ...] tensor or (k, v)
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    qsl: torch.Tensor
    q_lens: list
    k_scale: float
    v_scale: float
    q_scale: object  # None, float or tensor
    sm_scale: float


def make_case(*, q_lens, prefixes, Hq, Hkv, D, page, q_dtype, kv_dtype, layout="HND", form="single", pad_rows=3,
              q_scale_kind="none", gen=None, dev="cuda"):
    # dequantized K/V of order 1 (FP8 codes of order 48)
    k_scale, v_scale = (1 / 32, 1 / 64) if kv_dtype == "fp8_e4m3" else (0.5, 0.25)
    B = len(q_lens)
    lens = [p + q for p, q in zip(prefixes, q_lens)]
    lens[0] = max(lens[0], 0)
    pages_per = [max(1, math.ceil(max(L, 0) / page)) for L in lens]
    W = max(pages_per) + 2
    P = sum(pages_per) + 5
    perm = torch.randperm(P, device=dev, generator=gen).int()
    table = torch.randint(-3, P + 3, (B, W), dtype=torch.int32, device=dev, generator=gen)  # junk past the end
    ofs = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[ofs:ofs + n]
        ofs += n
    shape = (P, 2, Hkv, page, D) if layout == "HND" else (P, 2, page, Hkv, D)
    if kv_dtype == "fp8_e4m3":
        kv = (torch.randn(shape, device=dev, generator=gen) * 48).clamp(-448, 448).to(FP8)
    else:
        kv = torch.randn(shape, device=dev, generator=gen).to(DT[kv_dtype])
    for b, L in enumerate(lens):  # stale NaN past each sequence's end, in its last page
        if L > 0 and L % page:
            pid = int(table[b, L // page])
            tail = (pid, slice(None)) + ((slice(None), slice(L % page, None)) if layout == "HND"
                                         else (slice(L % page, None), slice(None)))
            if kv_dtype == "fp8_e4m3":
                kv[tail].view(torch.uint8).fill_(0x7F)
            else:
                kv[tail] = float("nan")
    if form == "pair":
        kv = (kv[:, 0].clone(), kv[:, 1].clone())
    T = sum(q_lens) + pad_rows
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
    qf = torch.randn(T, Hq, D, device=dev, generator=gen) * 2
    q_scale = None
    if q_dtype == "fp8_e4m3":
        if q_scale_kind == "per_head":
            q_scale = torch.rand(Hkv, device=dev, generator=gen) * 0.05 + 0.01
            s = q_scale.repeat_interleave(Hq // Hkv).view(1, Hq, 1)
        elif q_scale_kind == "tensor":
            q_scale = torch.tensor([0.03], device=dev)
            s = q_scale
        else:
            q_scale = 0.03
            s = q_scale
        q = (qf / s).clamp(-448, 448).to(FP8)
    else:
        q = qf.to(DT[q_dtype])
    return PrefillCase(q, kv, table, torch.tensor(lens, dtype=torch.int32, device=dev), qsl, list(q_lens), k_scale,
                       v_scale, q_scale, D ** -0.5)


def reference(case: PrefillCase, layout: str, causal: bool):
    """float64 out [T, Hq, D] and base-2 LSE [T, Hq]; rows of no request stay NaN."""
    if isinstance(case.kv, tuple):
        k_all, v_all = case.kv
    else:
        k_all, v_all = case.kv[:, 0], case.kv[:, 1]
    if layout == "NHD":
        k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)  # [P, Hkv, page, D]
    P, Hkv, page, D = k_all.shape
    T, Hq, _ = case.q.shape
    dev = case.q.device
    G = Hq // Hkv
    W = case.block_table.shape[1]
    out = torch.full((T, Hq, D), float("nan"), dtype=torch.float64, device=dev)
    lse = torch.full((T, Hq), float("nan"), dtype=torch.float64, device=dev)
    qs = case.q_scale
    if qs is None:
        qmul = 1.0
    elif isinstance(qs, torch.Tensor):
        qmul = qs.double().repeat_interleave(Hq // qs.numel()).view(1, Hq, 1) if qs.numel() > 1 else qs.double()
    else:
        qmul = qs
    qsl = case.qsl.tolist()
    for b, ql in enumerate(case.q_lens):
        if ql == 0:
            continue
        L = int(case.seq_lens[b])
        cap = max(0, min(L, W * page))
        rows = case.q[qsl[b]:qsl[b] + ql].double() * qmul  # [ql, Hq, D]
        n_pages = math.ceil(cap / page)
        ids = case.block_table[b, :n_pages].long()
        valid = (ids >= 0) & (ids < P)
        ids = ids.clamp(0, P - 1)

        def gather(x, ids=ids, valid=valid, n_pages=n_pages, cap=cap):
            g = x[ids].double()  # [n, Hkv, page, D]
            g = torch.where(valid.view(-1, 1, 1, 1), g, torch.zeros((), dtype=torch.float64, device=dev))
            return g.permute(1, 0, 2, 3).reshape(Hkv, n_pages * page, D)[:, :cap].repeat_interleave(G, dim=0)

        k = gather(k_all) * case.k_scale
        v = gather(v_all) * case.v_scale
        logits = torch.einsum("jhd,hld->jhl", rows, k) * case.sm_scale
        pos = torch.arange(cap, device=dev).view(1, 1, -1)
        j = torch.arange(ql, device=dev).view(-1, 1, 1)
        vis = (pos < L - ql + j + 1) if causal else torch.ones_like(pos, dtype=torch.bool).expand(ql, 1, cap)
        vis = vis.expand(ql, Hq, cap)
        logits = logits.masked_fill(~vis, float("-inf"))
        m = logits.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
        p = torch.exp(logits - m)
        s = p.sum(-1, keepdim=True)
        o = torch.einsum("jhl,hld->jhd", p / s.clamp_min(1e-300), v)
        anyv = vis.any(-1)
        out[qsl[b]:qsl[b] + ql] = torch.where(anyv.unsqueeze(-1), o, 0.0)
        lse[qsl[b]:qsl[b] + ql] = torch.where(anyv, (m.squeeze(-1) + s.squeeze(-1).log()) / math.log(2),
                                              float("-inf"))
    return out, lse


def run_kernel(cfg, case: PrefillCase, max_query_len=None, out=None, lse=None, num_ctas=None):
    """``num_ctas``: a persistent variant's grid (default: one CTA per SM of this GPU)."""
    from cute_kernels.jit.compiler import get_kernel

    fn = get_kernel(cfg, "sm_90a")
    T, Hq, D = case.q.shape
    out = torch.full((T, Hq, D), float("nan"), dtype=DT[cfg.out_dtype], device="cuda") if out is None else out
    if lse is None and cfg.write_lse:
        lse = torch.full((T, Hq), float("nan"), dtype=torch.float32, device="cuda")
    kv = list(case.kv) if isinstance(case.kv, tuple) else [case.kv]
    args = [case.q, *kv, case.block_table, case.seq_lens, case.qsl, out]
    if cfg.write_lse:
        args.append(lse)
    args += [case.k_scale, case.v_scale]
    if cfg.q_scale != "none":
        args.append(case.q_scale)
    args += [case.sm_scale, max(case.q_lens) if max_query_len is None else max_query_len]
    if cfg.persistent:
        args.append(persistent_ctas(torch.cuda.get_device_properties(0).multi_processor_count)
                    if num_ctas is None else num_ctas)
    fn(*args)
    return out, lse


def check(cfg, case, layout, label="", num_ctas=None):
    out, lse = run_kernel(cfg, case, num_ctas=num_ctas)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(case, layout, cfg.causal)
    real = ~torch.isnan(ref_lse[:, 0])  # rows of some request
    assert torch.isnan(out[~real].float()).all(), f"{label}: a padding row was written"
    o = out[real].double()
    assert torch.isfinite(o).all(), f"{label}: non-finite output"
    err = ((o - ref_out[real]).norm() / ref_out[real].norm().clamp_min(1e-30)).item()
    print(f"{label}: rel err {err:.2e}", flush=True)
    assert err <= TOL[cfg.kind], f"{label}: rel err {err:.3e} > {TOL[cfg.kind]}"
    if cfg.write_lse:
        got, want = lse[real].double(), ref_lse[real]
        assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{label}: LSE -inf rows differ"
        fin = torch.isfinite(want)
        assert torch.isfinite(got[fin]).all()
        # an FP8 QK product accumulates in fewer bits than fp32 on SM90 (docs/design/sm90-prefill.md):
        # its LSE error grows with the logits, hence a relative term for the FP8 query
        rtol = 4e-3 if cfg.kind == "fp8" else 0.0
        excess = (got[fin] - want[fin]).abs() - rtol * want[fin].abs()
        lse_err = excess.max().item() if fin.any() else 0.0
        assert lse_err <= 2e-3, f"{label}: LSE err {lse_err:.3e} beyond 2e-3 + {rtol} |lse|"
    return err


# varlen batch: q_len 0, a single row, rows that see nothing (q_len > seq_len), a block boundary,
# a long chunk after a long prefix
Q_LENS = [0, 1, 130, 300, 64, 200]
PREFIXES = [5, 0, 300, 1000, -20, 17]

# (q, kv, D, Hq, Hkv, page, layout, form, causal, lse, q_scale)
CASES = [
    ("bf16", "bf16", 128, 8, 2, 16, "HND", "single", True, True, "none"),
    ("bf16", "bf16", 64, 6, 1, 32, "NHD", "single", False, True, "none"),
    ("bf16", "bf16", 256, 4, 4, 128, "HND", "pair", True, False, "none"),
    ("fp16", "fp16", 128, 16, 1, 64, "NHD", "pair", True, True, "none"),
    ("bf16", "fp8_e4m3", 128, 8, 2, 16, "HND", "single", True, True, "none"),
    ("fp16", "fp8_e4m3", 64, 4, 2, 32, "NHD", "single", False, True, "none"),
    ("bf16", "fp8_e4m3", 256, 8, 1, 64, "HND", "pair", True, True, "none"),
    ("fp8_e4m3", "fp8_e4m3", 128, 8, 2, 16, "HND", "single", True, True, "scalar"),
    ("fp8_e4m3", "fp8_e4m3", 64, 8, 4, 128, "NHD", "pair", False, True, "tensor"),
    ("fp8_e4m3", "fp8_e4m3", 256, 16, 2, 32, "HND", "single", True, True, "per_head"),
]


def case_config(c, **override):
    q, kv, D, Hq, Hkv, page, layout, form, causal, lse, qs = c
    return make_prefill_config(q_dtype=q, kv_dtype=kv, head_dim=D, group=Hq // Hkv, page_size=page, kv_form=form,
                               kv_layout=layout, causal=causal, write_lse=lse, q_scale=qs, **override)


def case_problem(c, gen):
    """The packed batch (Q_LENS new tokens after PREFIXES) in the shapes and dtypes of case ``c``."""
    q, kv, D, Hq, Hkv, page, layout, form, causal, lse, qs = c
    return make_case(q_lens=Q_LENS, prefixes=PREFIXES, Hq=Hq, Hkv=Hkv, D=D, page=page, q_dtype=q, kv_dtype=kv,
                     layout=layout, form=form, q_scale_kind=qs, gen=gen)


CASE_IDS = [f"{c[0]}-{c[1]}-d{c[2]}-g{c[3] // c[4]}-p{c[5]}-{c[6]}-{c[7]}-{'causal' if c[8] else 'full'}"
            for c in CASES]
# how O leaves the consumers: the default, and the opt-in tile through shared memory in 16-byte chunks
EPILOGUES = ["registers", "smem"]


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_prefill_kernel_matches_reference(c, epilogue, gen):
    layout = c[6]
    cfg = case_config(c, epilogue=epilogue)
    case = case_problem(c, gen)
    check(cfg, case, layout, cfg.label())


# every consumer schedule (each kind's default among them: the plan's table)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("schedule", list(CONSUMER_SCHEDULES))
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_consumer_schedules(schedule, kv, epilogue, gen):
    c = ("bf16", kv, 128, 8, 2, 16, "HND", "single", True, True, "none")
    cfg = case_config(c, epilogue=epilogue, **CONSUMER_SCHEDULES[schedule])
    case = make_case(q_lens=Q_LENS, prefixes=PREFIXES, Hq=8, Hkv=2, D=128, page=16, q_dtype="bf16", kv_dtype=kv,
                     gen=gen)
    check(cfg, case, "HND", cfg.label())


def test_lying_max_query_len_leaves_rows_unwritten(gen):
    """Rows past ``max_query_len`` query blocks stay as they were; nothing else is touched."""
    c = CASES[0]
    cfg = case_config(c)
    case = make_case(q_lens=[300, 10], prefixes=[0, 5], Hq=8, Hkv=2, D=128, page=16, q_dtype="bf16",
                     kv_dtype="bf16", gen=gen)
    out, lse = run_kernel(cfg, case, max_query_len=100)  # one 128-row block of the 300
    torch.cuda.synchronize()
    assert torch.isnan(out[128:300].float()).all() and torch.isfinite(out[:128].float()).all()
    assert torch.isfinite(out[300:310].float()).all()


@pytest.mark.parametrize("override", [{}, {"persistent": True}, {"epilogue": "smem"}],
                         ids=["default", "persistent", "smem_epilogue"])
def test_cuda_graph_replay_reads_lengths_on_the_device(override, gen):
    """Captured once, replayed with other lengths and start offsets in the same tensors: the
    kernel reads them on the device, so the replay equals an eager call on the new values (the
    persistent schedule too: its grid is fixed by the SM count)."""
    c = CASES[4]
    cfg = case_config(c, **override)
    case = make_case(q_lens=[100, 200, 50], prefixes=[10, 400, 0], Hq=8, Hkv=2, D=128, page=16, q_dtype="bf16",
                     kv_dtype="fp8_e4m3", gen=gen, pad_rows=0)
    out = torch.full(case.q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full(case.q.shape[:2], float("nan"), dtype=torch.float32, device="cuda")
    run_kernel(cfg, case, max_query_len=256, out=out, lse=lse)  # compile + warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(cfg, case, max_query_len=256, out=out, lse=lse)
    case.qsl.copy_(torch.tensor([0, 150, 300, 350], dtype=torch.int32))
    # no longer than before: the stale NaN tails stay outside every sequence
    case.seq_lens.copy_(torch.tensor([100, 580, 50], dtype=torch.int32))
    case.q_lens = [150, 150, 50]
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, _ = reference(case, "HND", True)
    err = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    assert err <= TOL["widen"], err


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("c", [CASES[i] for i in (0, 1, 6, 7)], ids=[CASE_IDS[i] for i in (0, 1, 6, 7)])
def test_neighbour_rows_stay_untouched(c, epilogue, gen):
    """A launch over the first four requests of a packed batch: the 300-row request's last query
    block (rows 256..383 of it) reaches 84 rows into the next requests' rows, which this launch
    does not own; they, like the padding, must stay NaN while its own rows match the reference."""
    layout = c[6]
    cfg = case_config(c, epilogue=epilogue)
    case = case_problem(c, gen)
    n = 4
    assert sum(Q_LENS[:n]) % 128 and Q_LENS[n - 1] % 128  # the last owned block is partial
    head = PrefillCase(case.q, case.kv, case.block_table[:n].contiguous(), case.seq_lens[:n].contiguous(),
                       case.qsl[:n + 1].contiguous(), case.q_lens[:n], case.k_scale, case.v_scale, case.q_scale,
                       case.sm_scale)
    check(cfg, head, layout, f"{cfg.label()} first {n} requests")


# the persistent schedule (opt-in): the same cases on one wave of CTAs, and on a few CTAs that each
# walk many tiles (the pipeline's stages and the query buffer carried from tile to tile)
@pytest.mark.parametrize("num_ctas", [None, 1, 5])
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_persistent_matches_reference(c, num_ctas, gen):
    layout = c[6]
    cfg = case_config(c, persistent=True)
    case = case_problem(c, gen)
    check(cfg, case, layout, f"{cfg.label()} ctas={num_ctas}", num_ctas=num_ctas)


@pytest.mark.parametrize("schedule", list(CONSUMER_SCHEDULES))
def test_persistent_consumer_schedules(schedule, gen):
    c = ("bf16", "fp8_e4m3", 128, 8, 2, 16, "HND", "single", True, True, "none")
    cfg = case_config(c, persistent=True, **CONSUMER_SCHEDULES[schedule])
    case = make_case(q_lens=Q_LENS, prefixes=PREFIXES, Hq=8, Hkv=2, D=128, page=16, q_dtype="bf16",
                     kv_dtype="fp8_e4m3", gen=gen)
    check(cfg, case, "HND", cfg.label(), num_ctas=3)

