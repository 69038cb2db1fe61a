"""Property tier: every op against its reference over many random shapes and inputs (200 per op
by default, ``CUTE_KERNELS_PROPERTY_CASES=N`` for more or fewer).

Case ``i`` of op ``name`` is drawn from a generator seeded with ``stable_seed(name, i)``
(``zlib.crc32``, plus ``CUTE_KERNELS_SEED``): every failing case is collected and the test fails
listing each seed with the command that replays that case alone
(``CUTE_KERNELS_PROPERTY_REPLAY=name:seed``).

What varies: the axes that select a compiled variant (head dim, page size, dtypes, GQA, layout,
container, scale form, q_len, gate) are drawn from a few families per op, so that a run compiles a
few dozen variants (disk-cached afterwards); everything else is free: batch sizes, ragged lengths
with 0, 1, page boundaries, the table's capacity, beyond it and 2^31 - 1; block tables with -1 and
out-of-range pages; strided views (fused QKV projections); split counts; scales as floats, 0-d,
[1] and [1, 1] tensors of random values; LSEs of any finite value with empty splits; QSA entries
of every invalid kind; prefill batches with cached prefixes, empty requests and lengths past the
table. Expected runtime on an H200: ~1-2 s per 100 cases of an op once compiled (the float64
references dominate); the first run compiles ~45 variants (~4 minutes on 16 cores, in parallel:
see ``_precompile``).
"""

from __future__ import annotations

import contextlib
import itertools
import os

import numpy as np
import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.testing import rel_err

from .conftest import SEED_OFFSET, sm90_only, stable_seed

pytestmark = sm90_only()
FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
CASES = int(os.environ.get("CUTE_KERNELS_PROPERTY_CASES", "200"))
REPLAY = os.environ.get("CUTE_KERNELS_PROPERTY_REPLAY")  # "name:seed": run that one case only


def _seeds(name: str) -> list[int]:
    if REPLAY:
        op, seed = REPLAY.split(":")
        return [int(seed)] if op == name else []
    return [stable_seed(name, i) for i in range(CASES)]


def _run_cases(name: str, one_case) -> None:
    """Run every case of ``name``; fail with the list of failing seeds and how to replay each."""
    failures = []
    for seed in _seeds(name):
        rng = np.random.default_rng(seed)
        try:
            one_case(rng, torch.Generator().manual_seed(seed))
        except Exception as e:  # collected: one failing case must not hide the others
            failures.append(f"seed {seed}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        torch.cuda.synchronize()  # a device fault surfaces at its case
    if failures:
        replay = (f"CUTE_KERNELS_SEED={SEED_OFFSET} CUTE_KERNELS_PROPERTY_REPLAY={name}:<seed> python -m pytest "
                  f"tests/gpu/test_properties_gpu.py -k {name}")
        pytest.fail(f"{len(failures)} failing {name} cases (replay one: {replay}):\n" + "\n".join(failures))


def _scale(rng, tensor: bool, lo=0.05, hi=2.0):
    """A random positive scale: a float, or (tensor) a 0-d, [1] or [1, 1] fp32 CUDA tensor."""
    v = float(rng.uniform(lo, hi))
    if not tensor:
        return v
    shape = [(), (1,), (1, 1)][int(rng.integers(3))]
    return torch.full(shape, v, device="cuda")


# the portable kernels' compile axes the sm80 cases draw: either FP8 widening (the bit trick is
# SM80 / SM86's; cvt the others'), and the ring of the default target or one sized for 99 KB
SM80_WIDEN = ("cvt", "bits")
SM80_SMEM = (None, "sm_86")


def _sm80_fields(kv, widen: str, smem: str | None) -> dict:
    """The portable kernel's tuning fields of a case: the widening (FP8 caches only) and the ring."""
    return (dict(widen=widen) if kv == FP8 else {}) | (dict(smem_target=smem) if smem else {})


def _sm80_override(rng, kv) -> dict:
    """The tuning fields of one portable-kernel case (drawn even where unused: a case's draws do
    not depend on its family)."""
    return _sm80_fields(kv, SM80_WIDEN[int(rng.integers(2))], SM80_SMEM[int(rng.integers(2))])


def _backend(rng, kv, sm80: bool, decode: bool):
    """The op's own dispatch, or (``sm80``) the portable kernel forced with drawn tuning fields."""
    if not sm80:
        return contextlib.nullcontext()
    from cute_kernels.ops.paged_decode import tuning_override as decode_override
    from cute_kernels.ops.paged_prefill import tuning_override as prefill_override

    return (decode_override if decode else prefill_override)(backend="sm80", **_sm80_override(rng, kv))


def _check_attention(out, lse, ref, ref_lse, tol):
    if out.numel() == 0:
        return
    assert torch.isfinite(out).all(), "NaN/inf in the output (an unwritten or poisoned value leaked)"
    scale = ref.double().abs().max().item()
    if scale > 0:
        err = rel_err(out, ref)
        assert err <= tol or (out.double() - ref.double()).abs().max().item() <= tol * scale, f"rel err {err:.2e}"
    else:
        assert torch.all(out == 0)
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "-inf LSE rows differ"
        fin = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[fin], ref_lse[fin].float(), atol=2e-3, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# paged_decode
# ----------------------------------------------------------------------------------------------

# (kv, q, D, Hq, Hkv, page, q_len, layout, container, tensor scales)
DECODE_FAMILIES = [
    (FP8, BF16, 128, 32, 8, 16, 1, "HND", "single", False),
    (BF16, BF16, 64, 8, 1, 32, 2, "NHD", "tuple", True),
    (FP8, FP16, 256, 16, 4, 64, 1, "HND", "tuple", True),
    (FP16, FP16, 128, 16, 2, 128, 3, "NHD", "single", False),
]


def _decode_lengths(rng, B, W, page, q_len):
    cap = W * page
    pool = [0, 1, q_len, page - 1, page, page + 1, cap - 1, cap, cap + int(rng.integers(1, 100)), 2**31 - 1]
    lens = []
    for _ in range(B):
        lens.append(int(rng.integers(1, cap + 1)) if rng.random() < 0.5 else int(rng.choice(pool)))
    return [max(0, x) for x in lens]


def _decode_case(family, rng, g):
    kv, qd, D, Hq, Hkv, page, q_len, layout, container, tensors = family
    B = int(rng.integers(1, 10))
    W = int(rng.integers(1, 13)) if rng.random() < 0.7 else int(rng.integers(13, 80))  # up to 10 K tokens
    lens = _decode_lengths(rng, B, W, page, q_len)
    used = [min(-(-min(L, W * page) // page), W) for L in lens]
    P = sum(used) + int(rng.integers(1, 6))
    table = torch.randint(0, P, (B, W), generator=g, dtype=torch.int32)
    perm = torch.randperm(P, generator=g)
    ofs = 0
    for b, n in enumerate(used):
        table[b, :n] = perm[ofs:ofs + n].int()
        ofs += n
    for _ in range(int(rng.integers(0, 3))):  # invalid pages: read as zeros
        table[int(rng.integers(B)), int(rng.integers(W))] = int(rng.choice([-1, P, P + 1000, -77]))
    shape = (P, 2, Hkv, page, D) if layout == "HND" else (P, 2, page, Hkv, D)
    raw = torch.randn(shape, generator=g)
    cache = (raw * 64).clamp(-448, 448).to(kv) if kv == FP8 else raw.to(kv)
    cache = cache.cuda()
    T = B * q_len
    if rng.random() < 0.5:  # a fused QKV projection's view
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(qd).cuda()
        q = qkv[:, :Hq * D].view(T, Hq, D)
    else:
        q = torch.randn(T, Hq, D, generator=g).to(qd).cuda()
    kv_cache = (cache[:, 0], cache[:, 1]) if container == "tuple" else cache
    ks = _scale(rng, tensors, 0.01 if kv == FP8 else 0.5, 0.03 if kv == FP8 else 1.5)
    vs = _scale(rng, tensors, 0.01 if kv == FP8 else 0.5, 0.03 if kv == FP8 else 1.5)
    splits = int(rng.integers(1, 17))  # forced: the kernel is sized for its maximum occupancy
    return q, kv_cache, table.cuda(), torch.tensor(lens, dtype=torch.int32).cuda(), dict(
        kv_layout=layout, q_len_per_req=q_len, k_scale=ks, v_scale=vs), splits


def _decode_one(rng, g, sm80: bool) -> None:
    family = DECODE_FAMILIES[int(rng.integers(len(DECODE_FAMILIES)))]
    q, kv_cache, table, lens, kw, splits = _decode_case(family, rng, g)
    out = torch.full_like(q, float("nan"))
    with _backend(rng, family[0], sm80, decode=True):
        res, lse = cute_kernels.paged_decode(q, kv_cache, table, lens, out=out, return_lse=True, num_splits=splits,
                                             **kw)
    assert res is out
    ref, ref_lse = reference.paged_decode(q, kv_cache, table, lens, return_lse=True, float64=True, **kw)
    _check_attention(out, lse, ref.to(out.dtype), ref_lse, 5e-3)


@pytest.mark.parametrize("name", ["paged_decode"])
def test_paged_decode_properties(name):
    _run_cases(name, lambda rng, g: _decode_one(rng, g, sm80=False))


@pytest.mark.parametrize("name", ["paged_decode_sm80"])
def test_sm80_paged_decode_properties(name):
    """The same cases on the portable ``sm80.decode`` (the kernel of SM80 / 86 / 89 / 120 / 121),
    forced on this GPU, with either FP8 widening and rings sized for 99 KB."""
    _run_cases(name, lambda rng, g: _decode_one(rng, g, sm80=True))


# ----------------------------------------------------------------------------------------------
# merge_states
# ----------------------------------------------------------------------------------------------


def _lses(rng, S, N, H):
    """Finite LSEs of any magnitude, clustered (outputs that mix splits) or spread (up to 1e4, mixed
    signs), with empty splits and all-empty rows."""
    kind = int(rng.integers(3))
    if kind == 0:
        lse = rng.uniform(-1e4, 1e4, (S, N, H))
    elif kind == 1:
        lse = rng.uniform(-1e4, 1e4) + rng.normal(0, 20, (S, N, H))
    else:
        lse = rng.choice([-1e4, -300.0, -129.0, 0.0, 127.0, 300.0, 1e4]) + rng.normal(0, 5, (S, N, H))
    lse[rng.random((S, N, H)) < 0.25] = -np.inf
    lse[:, rng.random(N) < 0.1] = -np.inf
    return torch.tensor(lse, dtype=torch.float32)


@pytest.mark.parametrize("name", ["merge_states"])
def test_merge_states_properties(name):
    def one(rng, g):
        S, N, H = int(rng.integers(1, 41)), int(rng.integers(1, 40)), int(rng.integers(1, 17))
        D = int(rng.choice([64, 128, 256]))
        out_dtype = [torch.float32, BF16, FP16][int(rng.integers(3))]
        pl = _lses(rng, S, N, H).cuda()
        if rng.random() < 0.3:  # strided partials, still 16-byte aligned
            po = torch.randn(S, N, H, D + 32, generator=g).cuda()[..., 16:16 + D]
        else:
            po = torch.randn(S, N, H, D, generator=g).cuda()
        po[torch.isneginf(pl)] = float("nan")  # an empty split's partial is never read
        out = torch.full((N, H, D), float("nan"), dtype=out_dtype, device="cuda")
        lse = torch.full((N, H), float("nan"), device="cuda")
        cute_kernels.merge_states(po, pl, out=out, out_lse=lse)
        ref, ref_lse = reference.merge_states(po, pl, float64=True)
        assert torch.isfinite(out).all(), "NaN/inf in the merged output"
        tol = 1e-5 if out_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        fin = torch.isfinite(ref_lse)
        assert not torch.isnan(lse).any() and not torch.isposinf(lse).any()
        torch.testing.assert_close(lse[fin], ref_lse[fin].float(), atol=1e-5, rtol=2e-7)

    _run_cases(name, one)


# ----------------------------------------------------------------------------------------------
# quantize_query and write_kv_cache (codes bit-exact)
# ----------------------------------------------------------------------------------------------

# (q dtype, D, Hq, Hkv, scale form, rope)
QUANT_FAMILIES = [
    (BF16, 128, 32, 8, "float", None),
    (FP16, 64, 16, 2, "per_head", None),
    (BF16, 128, 8, 2, "tensor", (128, torch.float32, torch.int64)),
]


def _same_codes(out, ref):
    nan_o, nan_r = out.float().isnan(), ref.float().isnan()
    assert torch.equal(nan_o, nan_r), "NaN positions differ"
    bits = {1: torch.uint8, 2: torch.int16}[out.element_size()]
    diff = (out.view(bits) != ref.view(bits)) & ~nan_r
    assert not diff.any(), f"{int(diff.sum())} codes differ, first at {diff.nonzero()[0].tolist()}"


@pytest.mark.parametrize("name", ["quantize_query"])
def test_quantize_query_properties(name):
    def one(rng, g):
        qd, D, Hq, Hkv, form, rope = QUANT_FAMILIES[int(rng.integers(len(QUANT_FAMILIES)))]
        T = int(rng.integers(0, 60))
        qkv = (torch.randn(T, (Hq + 2 * Hkv) * D, generator=g) * float(rng.choice([1.0, 30.0, 1000.0]))).to(qd)
        q = qkv.cuda()[:, :Hq * D].view(T, Hq, D)
        if form == "per_head":
            s = torch.tensor(rng.uniform(0.01, 3.0, Hkv), dtype=torch.float32, device="cuda")
        else:
            s = _scale(rng, form == "tensor", 0.01, 3.0)
        rope_args = None
        if rope is not None:
            rot, csd, pd = rope
            cs = torch.randn(97, rot, generator=g).to(csd).cuda()
            pos = torch.randint(0, 97, (T,), generator=g).to(pd).cuda()
            rope_args = (cs, pos)
        out = torch.empty(T, Hq, D, dtype=FP8, device="cuda")
        out.view(torch.uint8).fill_(0x7F)
        cute_kernels.quantize_query(q, s, out=out, rope=rope_args)
        _same_codes(out, reference.quantize_query(q, s, rope=rope_args))

    _run_cases(name, one)


# (cache dtype, layout, container, slot dtype, page, Hkv, D, tensor scales)
WRITE_FAMILIES = [
    (FP8, "HND", "single", torch.int64, 16, 8, 128, False),
    (FP8, "NHD", "tuple", torch.int32, 32, 2, 64, True),
    (BF16, "HND", "tuple", torch.int64, 16, 4, 128, True),
]


@pytest.mark.parametrize("name", ["write_kv_cache"])
def test_write_kv_cache_properties(name):
    def one(rng, g):
        kvd, layout, container, sd, page, Hkv, D, tensors = WRITE_FAMILIES[int(rng.integers(len(WRITE_FAMILIES)))]
        T = int(rng.integers(0, 50))
        P = int(rng.integers(1, 8))
        shape = (P, 2, Hkv, page, D) if layout == "HND" else (P, 2, page, Hkv, D)
        base = torch.randn(shape, generator=g)
        cache = ((base * 64).clamp(-448, 448).to(kvd) if kvd == FP8 else base.to(kvd)).cuda()
        n = P * page
        slots = torch.randperm(max(n, T), generator=g)[:T].to(torch.int64)
        for i in range(T):
            if rng.random() < 0.15:
                slots[i] = int(rng.choice([-1, n, n + 7, -9, 2**31 - 1]))
        slots = slots.to(sd).cuda()
        qkv = torch.randn(T, (4 + 2 * Hkv) * D, generator=g).to(BF16).cuda()
        key = qkv[:, 4 * D:(4 + Hkv) * D].view(T, Hkv, D)
        value = qkv[:, (4 + Hkv) * D:].view(T, Hkv, D)
        ks = _scale(rng, tensors, 0.01, 2.0)
        vs = _scale(rng, tensors, 0.01, 2.0)
        got = cache.clone()
        want = cache.clone()
        args = lambda c: (c[:, 0], c[:, 1]) if container == "tuple" else c  # noqa: E731
        cute_kernels.write_kv_cache(key, value, args(got), slots, kv_layout=layout, k_scale=ks, v_scale=vs)
        reference.write_kv_cache(key, value, args(want), slots, kv_layout=layout, k_scale=ks, v_scale=vs)
        _same_codes(got, want)

    _run_cases(name, one)


# ----------------------------------------------------------------------------------------------
# qsa_sparse_attention
# ----------------------------------------------------------------------------------------------

# (kv, q, D, Hq, Hkv, page, gate, tensor scales)
QSA_FAMILIES = [
    (BF16, BF16, 256, 24, 2, 1568, True, False),
    (FP8, BF16, 256, 12, 1, 800, False, True),
    (FP16, FP16, 128, 16, 1, 96, True, True),
]


@pytest.mark.parametrize("name", ["qsa_sparse_attention"])
def test_qsa_sparse_attention_properties(name):
    from tests.cpu.test_qsa_reference import make_qsa_case

    def one(rng, g):
        kv, qd, D, Hq, Hkv, page, gate, tensors = QSA_FAMILIES[int(rng.integers(len(QSA_FAMILIES)))]
        rows = int(rng.integers(1, 48))
        reqs = int(rng.integers(1, min(rows, 6) + 1))
        ctx = int(rng.integers(rows, 4 * page))
        width = int(rng.choice([16, 64, 257]))  # TOPK + 1: a row selects at most (TOPK - 3) / 4 blocks
        c = make_qsa_case(rows=rows, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page=page, kv_dtype=kv, q_dtype=qd,
                          num_reqs=reqs, ctx=ctx, block_budget=int(rng.integers(0, (width - 4) // 4 + 1)),
                          width=width, gate=gate, generator=g, device="cuda", holes=float(rng.uniform(0, 0.3)))
        args = {k: v for k, v in c.items() if k not in ("meta", "k_scale", "v_scale")}
        idx, bt, t2r = args["packed_indices"], args["block_table"], args["token_to_req"]
        topk = idx.shape[1] - 1
        for _ in range(int(rng.integers(0, 4))):  # invalid entries of every kind
            r = int(rng.integers(rows))
            kind = int(rng.integers(5))
            if kind == 0:
                idx[r, int(rng.integers(topk))] = int(rng.choice([-1, -5, bt.shape[1] * page + 3]))
            elif kind == 1:
                idx[r, topk] = int(rng.choice([-3, 0, topk + 5, 2**31 - 1]))
            elif kind == 2 and 0 <= int(t2r[r]) < bt.shape[0]:
                bt[int(t2r[r]), int(rng.integers(bt.shape[1]))] = int(rng.choice([-1, args["k_cache"].shape[0] + 9]))
            elif kind == 3:
                t2r[r] = int(rng.choice([-1, bt.shape[0], 99]))
        ks = _scale(rng, tensors, 0.005, 0.02) if kv == FP8 else _scale(rng, tensors, 0.5, 1.5)
        vs = _scale(rng, tensors, 0.005, 0.02) if kv == FP8 else _scale(rng, tensors, 0.5, 1.5)
        out = torch.full_like(args["q"], float("nan"))
        cute_kernels.qsa_sparse_attention(**args, prefill=bool(rng.random() < 0.5), k_scale=ks, v_scale=vs, out=out)
        ref = reference.qsa_sparse_attention(**args, k_scale=ks, v_scale=vs)
        assert not torch.isnan(out).any(), "unwritten or NaN outputs"
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)

    _run_cases(name, one)


# ----------------------------------------------------------------------------------------------
# paged_prefill
# ----------------------------------------------------------------------------------------------

# (kv, query: "16" or "fp8" (quantized by quantize_query), D, Hq, Hkv, page, layout, container,
# tensor scales, q_scale form, causal, LSE)
PREFILL_FAMILIES = [
    (BF16, "16", 128, 16, 4, 16, "HND", "single", False, None, True, False),
    (FP8, "16", 64, 8, 2, 32, "NHD", "tuple", True, None, True, True),
    (FP8, "fp8", 128, 32, 8, 64, "HND", "single", False, "per_head", True, False),
    (FP16, "16", 256, 8, 8, 16, "HND", "single", True, None, False, True),
]


def _prefill_config(family):
    from cute_kernels.plans.sm90_prefill import make_prefill_config

    kv, qk, D, Hq, Hkv, page, layout, container, tensors, qs, causal, lse = family
    names = {FP8: "fp8_e4m3", BF16: "bf16", FP16: "fp16"}
    qd = "fp8_e4m3" if qk == "fp8" else ("fp16" if kv == FP16 else "bf16")
    return make_prefill_config(q_dtype=qd, kv_dtype=names[kv], head_dim=D, group=Hq // Hkv, page_size=page,
                               out_dtype="bf16" if qk == "fp8" else None, kv_form=container.replace("tuple", "pair"),
                               kv_layout=layout, causal=causal, write_lse=lse, k_scale_tensor=tensors,
                               v_scale_tensor=tensors, q_scale="per_head" if qs == "per_head" else None)


@pytest.mark.parametrize("name", ["paged_prefill"])
def test_paged_prefill_properties(name):
    from cute_kernels.ops import _selfcheck
    from cute_kernels.ops.paged_prefill import self_check_cases
    from cute_kernels.plans.sm90_prefill import config_family

    for family in PREFILL_FAMILIES:  # each family's self-check cases, run now on the kernel
        config = _prefill_config(family)
        rec = _selfcheck.run_check(config_family(config), torch.device("cuda"),
                                   self_check_cases(config, torch.device("cuda")))
        assert rec.ok, f"{family}: {rec.reason}"

    _run_cases(name, lambda rng, _cpu_generator: _prefill_one(rng, PREFILL_FAMILIES, sm80=False))


# the portable kernel's: the 16-bit-query families (no SM80-class kernel takes an FP8 query), the
# D 256 lean default at page 32 (where its 32-token form spills, so the form before runs) and the
# D 128 FP8 lean default at page 64
SM80_PREFILL_FAMILIES = [f for f in PREFILL_FAMILIES if f[1] == "16"] + [
    (BF16, "16", 256, 16, 8, 32, "NHD", "single", False, None, True, False),
    (FP8, "16", 128, 32, 8, 64, "HND", "single", False, None, True, False),
]


@pytest.mark.parametrize("name", ["paged_prefill_sm80"])
def test_sm80_paged_prefill_properties(name):
    """The same kind of cases on the portable ``sm80.prefill``, forced on this GPU, with either FP8
    widening and rings sized for 99 KB."""
    _run_cases(name, lambda rng, _cpu_generator: _prefill_one(rng, SM80_PREFILL_FAMILIES, sm80=True))


def _prefill_one(rng, families, sm80: bool) -> None:
    from cute_kernels.testing import make_paged_prefill_case

    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))  # the builder draws on the GPU
    kv, qk, D, Hq, Hkv, page, layout, container, tensors, qs, causal, lse = families[int(rng.integers(len(families)))]
    B = int(rng.integers(1, 7))
    reqs = []
    for _ in range(B):
        prefix = int(rng.choice([0, int(rng.integers(1, 64)), int(rng.integers(64, 2500))]))
        n = int(rng.choice([0, 1, int(rng.integers(2, 200)), page, page + 1]))
        reqs.append((prefix, n))
    past = rng.random() < 0.2  # a length past the block table (its positions there are not attended)
    c = make_paged_prefill_case(reqs=reqs, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                                kv_dtype=kv, q_dtype=FP16 if kv == FP16 else BF16, kv_layout=layout,
                                container=container, fused_qkv=bool(rng.random() < 0.5),
                                invalid_pages=int(rng.integers(0, 3)), generator=g, device="cuda",
                                k_scale=0.02 if kv == FP8 else 0.9, v_scale=0.03 if kv == FP8 else 1.1,
                                poison_tail=not past)  # the longer length makes the stale tail visible
    if past:
        b = int(rng.integers(B))
        c.seq_lens[b] = c.block_table.shape[1] * page + int(rng.integers(1, 3 * page))
    kw = dict(c.kwargs(), causal=causal)
    if tensors:
        kw.update(k_scale=_scale_of(rng, c.k_scale), v_scale=_scale_of(rng, c.v_scale))
    q = c.q
    if qk == "fp8":
        q_scale = torch.tensor(rng.uniform(0.02, 0.1, Hkv), dtype=torch.float32, device="cuda")
        q = cute_kernels.quantize_query(c.q, q_scale)
        kw["q_scale"] = q_scale
    max_q = c.max_query_len if rng.random() < 0.5 else None
    out = torch.full(q.shape, float("nan"), dtype=BF16 if qk == "fp8" else q.dtype, device="cuda")
    with _backend(rng, kv, sm80, decode=False):
        res = cute_kernels.paged_prefill(q, c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc, out=out,
                                         return_lse=lse, max_query_len=max_q, **kw)
    got, got_lse = res if lse else (res, None)
    ref = reference.paged_prefill(q, c.kv_cache, c.block_table, c.seq_lens, c.query_start_loc, return_lse=lse,
                                  out_dtype=out.dtype, float64=True, **kw)
    ref, ref_lse = ref if lse else (ref, None)
    _check_attention(got, got_lse, ref.to(got.dtype), ref_lse, 2e-2 if qk == "fp8" else 5e-3)


def _scale_of(rng, value: float):
    """``value`` as a 0-d, [1] or [1, 1] fp32 CUDA tensor."""
    return torch.full([(), (1,), (1, 1)][int(rng.integers(3))], float(value), device="cuda")


@pytest.fixture(scope="module", autouse=True)
def _precompile(request):
    """The variants the selected tests reach, compiled in parallel before their cases run: the
    decode families' with forced split counts (unsplit, split, cluster merge, each at the maximum
    occupancy), the QSA families' (the split table of TOPK up to 256 and their merges), the merges,
    the prefill families' and the portable kernels' (:func:`_sm80_configs`)."""
    from cute_kernels.jit.parallel import precompile

    selected = {item.name.split("[")[0] for item in request.session.items}
    names = {FP8: "fp8_e4m3", BF16: "bf16", FP16: "fp16"}
    configs = []
    if "test_paged_decode_properties" in selected:
        configs += _sm90_decode_configs(names)
    if "test_qsa_sparse_attention_properties" in selected:
        from cute_kernels.qsa_warmup import qsa_variants

        for kv, qd, D, Hq, Hkv, page, gate, tensors in QSA_FAMILIES:
            configs += qsa_variants(head_dim=D, num_q_heads=Hq, num_kv_heads=Hkv, page_size=page,
                                    kv_cache_dtype=names[kv], q_dtype=names[qd], topk=256, gates=(gate,),
                                    scale_tensors=(tensors,))
    if selected & {"test_merge_states_properties", "test_paged_decode_properties", "test_sm80_paged_decode_properties",
                   "test_qsa_sparse_attention_properties"}:
        from cute_kernels.plans.merge_states import MergeStatesConfig

        configs += [MergeStatesConfig(out_dtype=dt, head_dim=D, vec=4) for dt in ("fp32", "bf16", "fp16")
                    for D in (64, 128, 256)]
    if "test_paged_prefill_properties" in selected:
        configs += [_prefill_config(family) for family in PREFILL_FAMILIES]
    configs += _sm80_configs(names, decode="test_sm80_paged_decode_properties" in selected,
                             prefill="test_sm80_paged_prefill_properties" in selected)
    precompile(configs, "sm_90a", progress=False)


def _sm90_decode_configs(names) -> list:
    from cute_kernels.plans.sm90_decode import launch_config

    configs = set()
    for kv, qd, D, Hq, Hkv, page, q_len, layout, container, tensors in DECODE_FAMILIES:
        for B in range(1, 10):
            for splits in range(1, 17):
                configs.add(launch_config(q_dtype=names[qd], kv_dtype=names[kv], head_dim=D, group=Hq // Hkv,
                                          q_len=q_len, page_size=page, k_scale_tensor=tensors, v_scale_tensor=tensors,
                                          kv_form="pair" if container == "tuple" else "single", kv_layout=layout,
                                          items=B * Hkv, max_context=80 * page,
                                          num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                                          num_splits=splits)[1])
    return sorted(configs, key=lambda c: c.label())


def _sm80_configs(names, decode: bool = True, prefill: bool = True) -> list:
    """The portable kernels' variants the sm80 families reach (unsplit and split decode, every
    drawn widening and ring), as the ops build them on this GPU."""
    from cute_kernels.plans import sm80

    configs = set()
    for kv, qd, D, Hq, Hkv, page, q_len, layout, container, tensors in DECODE_FAMILIES if decode else ():
        for widen, smem, split in itertools.product(SM80_WIDEN, SM80_SMEM, (False, True)):
            fields = _sm80_fields(kv, widen, smem)
            configs.add(sm80.make_decode_config(
                target="sm_90a", q_dtype=names[qd], kv_dtype=names[kv], head_dim=D, group=Hq // Hkv, q_len=q_len,
                page_size=page, split=split, kv_form="pair" if container == "tuple" else "single", kv_layout=layout,
                k_scale_tensor=tensors, v_scale_tensor=tensors, **fields))
    for kv, _qk, D, Hq, Hkv, page, layout, container, tensors, _qs, causal, lse in (
            SM80_PREFILL_FAMILIES if prefill else ()):
        for widen, smem in itertools.product(SM80_WIDEN, SM80_SMEM):
            fields = _sm80_fields(kv, widen, smem)
            configs.add(sm80.make_prefill_config(
                target="sm_90a", q_dtype="fp16" if kv == FP16 else "bf16", kv_dtype=names[kv], head_dim=D,
                group=Hq // Hkv, page_size=page, causal=causal, write_lse=lse,
                kv_form="pair" if container == "tuple" else "single", kv_layout=layout, k_scale_tensor=tensors,
                v_scale_tensor=tensors, **fields))
    return sorted(configs, key=lambda c: c.label())
