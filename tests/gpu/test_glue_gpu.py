"""quantize_query and write_kv_cache kernels on the GPU: FP8 codes bit-exact against the reference.

Bit-exactness is checked byte for byte (``.view(torch.uint8)``); NaN codes are compared as "both
NaN" because the sign of a NaN produced by arithmetic is not specified. Inputs include every bf16
and fp16 bit pattern (so every rounding case, subnormals, ±inf and NaN), with scales for which a
multiply-by-reciprocal would give different codes (asserted, so the test can tell the two apart).
Cache writes start from a sentinel byte pattern and check every byte of the cache and of guard
regions around it (an out-of-bounds write fails).

Case lists cover each axis value at least once without the full product: every case is a
compiled variant, and all of them are compiled in parallel before the tests run.
"""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.ops import quantize_query as qq_op
from cute_kernels.ops import write_kv_cache as kv_op

FP8, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
SENTINEL = 0xA5


def codes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def assert_same_codes(out: torch.Tensor, ref: torch.Tensor):
    """Equal bytes, except that NaN equals NaN whatever its sign/payload bits."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    nan_o, nan_r = out.float().isnan(), ref.float().isnan()
    assert torch.equal(nan_o, nan_r), f"NaN positions differ: {int((nan_o != nan_r).sum())}"
    diff = (codes(out) != codes(ref)) & ~nan_r
    assert not diff.any(), f"{int(diff.sum())} codes differ, first at {diff.nonzero()[0].tolist()}"


# ----------------------------------------------------------------------------------------------
# inputs (built the same way by the precompile fixture and by the tests)
# ----------------------------------------------------------------------------------------------


def q_view(kind: str, T: int, Hq: int, D: int, dtype, gen=None, Hkv: int = 2):
    """``contiguous``; ``fused`` (a slice of a fused QKV row); ``shifted`` (8-byte aligned)."""
    if kind == "contiguous":
        return torch.randn(T, Hq, D, device="cuda", generator=gen).to(dtype)
    width = (Hq + 2 * Hkv) * D + 8
    qkv = torch.randn(T, width, device="cuda", generator=gen).to(dtype)
    start = 0 if kind == "fused" else 4
    return qkv[:, start:start + Hq * D].view(T, Hq, D)


def all_bit_patterns(dtype, Hq=8, D=128):
    """Every 16-bit pattern once, as a [65536 / (Hq D), Hq, D] query (NaN, ±inf, subnormals, -0)."""
    x = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    return x.view(-1, Hq, D)


def make_scale(kind: str, Hkv: int, gen=None):
    if kind == "float":
        return 0.3
    if kind == "tensor":
        return torch.tensor([1.7], device="cuda")
    if kind == "scalar0d":
        return torch.tensor(0.3, device="cuda")
    return (torch.rand(Hkv, device="cuda", generator=gen) + 0.05) * 2  # per KV head


def make_rope(T, rot, dtype, pos_dtype, max_pos=97, gen=None, invalid=False):
    cs = torch.randn(max_pos, rot, device="cuda", generator=gen).to(dtype)
    pos = torch.randint(0, max_pos, (T,), device="cuda", generator=gen)
    if invalid and T >= 3:
        pos[0], pos[1] = -1, max_pos  # never read; rotated dims NaN
    return cs, pos.to(pos_dtype)


# (q dtype, layout, T, Hq, Hkv, D, scale kind)
QUANT_CASES = [
    (BF16, "contiguous", 1, 32, 8, 128, "float"),
    (BF16, "fused", 37, 32, 8, 128, "per_head"),
    (FP16, "fused", 200, 16, 2, 64, "tensor"),
    (BF16, "shifted", 19, 8, 2, 128, "scalar0d"),
    (FP16, "contiguous", 5, 4, 1, 256, "per_head"),
    (BF16, "contiguous", 11, 8, 4, 72, "float"),
]
# (q dtype, layout, T, Hq, D, rot_dim, cos_sin dtype, positions dtype, scale kind)
ROPE_CASES = [
    (BF16, "fused", 33, 32, 128, 128, torch.float32, torch.int64, "float"),
    (BF16, "contiguous", 9, 8, 128, 64, BF16, torch.int32, "per_head"),
    (FP16, "fused", 64, 16, 64, 32, torch.float32, torch.int32, "tensor"),
    (BF16, "shifted", 7, 8, 128, 24, torch.float32, torch.int64, "float"),
]


def _quant_configs() -> list:
    configs = []
    for dt, kind, T, Hq, Hkv, D, sk in QUANT_CASES:
        configs.append(qq_op.make_config(q_view(kind, T, Hq, D, dt, Hkv=Hkv), sk != "float"))
    for dt in (BF16, FP16):
        for st in (False, True):
            configs.append(qq_op.make_config(all_bit_patterns(dt), st))
    for dt, kind, T, Hq, D, rot, csd, pd, sk in ROPE_CASES:
        q = q_view(kind, T, Hq, D, dt)
        configs.append(qq_op.make_config(q, sk != "float", None, make_rope(T, rot, csd, pd)))
    return configs


# (cache dtype, layout, container, slot dtype, page, Hkv, D, input layout, scale kind)
WRITE_CASES = [
    (FP8, "HND", "single", torch.int64, 16, 8, 128, "fused", "float"),
    (FP8, "NHD", "tuple", torch.int32, 16, 4, 128, "contiguous", "tensor"),
    (FP8, "HND", "tuple", torch.int32, 5, 2, 64, "fused", "tensor"),
    (FP8, "NHD", "single", torch.int64, 1, 1, 256, "shifted", "float"),
    (BF16, "HND", "single", torch.int32, 16, 8, 128, "fused", "float"),
    (BF16, "NHD", "tuple", torch.int64, 32, 2, 64, "contiguous", "tensor"),
    (FP16, "HND", "tuple", torch.int64, 16, 4, 96, "fused", "float"),
    (FP16, "NHD", "single", torch.int32, 7, 2, 128, "shifted", "tensor"),
    (FP8, "HND", "single", torch.int32, 16, 8, 128, "fused", "float"),
]


def _in_dtype(cache_dtype):
    return FP16 if cache_dtype == FP16 else BF16


def make_write_case(case, T, gen=None, guard=4096):
    """Inputs of one write case; the cache is carved out of a buffer with sentinel guard bytes."""
    kvd, layout, container, sd, page, Hkv, D, kind, sk = case
    P = max(2, (T + page - 1) // page + 2)
    shape = (P, 2, Hkv, page, D) if layout == "HND" else (P, 2, page, Hkv, D)
    esize = 1 if kvd == FP8 else 2
    numel = 1
    for s in shape:
        numel *= s
    halves = 2 if container == "tuple" else 1
    raw = torch.full((halves * numel * esize + 2 * guard,), SENTINEL, dtype=torch.uint8, device="cuda")
    if container == "tuple":
        half = numel // 2
        k4 = raw[guard:guard + half * esize].view(kvd).view(shape[:1] + shape[2:])
        v4 = raw[guard + half * esize:guard + 2 * half * esize].view(kvd).view(shape[:1] + shape[2:])
        cache = (k4, v4)
    else:
        cache = raw[guard:guard + numel * esize].view(kvd).view(shape)
    in_dt = _in_dtype(kvd)
    if kind == "contiguous":
        key = torch.randn(T, Hkv, D, device="cuda", generator=gen).to(in_dt)
        value = torch.randn(T, Hkv, D, device="cuda", generator=gen).to(in_dt)
    else:
        start = 0 if kind == "fused" else 4
        qkv = torch.randn(T, (4 + 2 * Hkv) * D + 8, device="cuda", generator=gen).to(in_dt)
        key = qkv[:, start + 4 * D:start + (4 + Hkv) * D].view(T, Hkv, D)
        value = qkv[:, start + (4 + Hkv) * D:start + (4 + 2 * Hkv) * D].view(T, Hkv, D)
    return raw, cache, key, value


def make_slots(T, P, page, dtype, gen=None):
    """Distinct valid slots (partial pages included) mixed with -1 and out-of-range slots."""
    n = P * page
    slots = torch.randperm(n, device="cuda", generator=gen)[:T].to(torch.int64)
    if T >= 8:
        big = 2**40 if dtype == torch.int64 else 2**31 - 1
        slots[1], slots[3], slots[5], slots[6], slots[7] = -1, n, n + 3, -5, big
    return slots.to(dtype)


def make_kv_scales(kind):
    if kind == "float":
        return 0.0625, 0.3
    return torch.tensor([0.0625], device="cuda"), torch.tensor(1.7, device="cuda")


def _write_configs() -> list:
    configs = []
    for case in WRITE_CASES:
        T = 40
        _, cache, key, value = make_write_case(case, T)
        slots = make_slots(T, (cache[0] if isinstance(cache, tuple) else cache).shape[0], case[4], case[3])
        ks, vs = make_kv_scales(case[8])
        configs.append(kv_op.make_config(key, value, cache, slots, case[1], isinstance(ks, torch.Tensor),
                                         isinstance(vs, torch.Tensor)))
    return configs


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    from cute_kernels.jit.parallel import precompile
    from cute_kernels.ops._torch import compile_target

    target = compile_target(torch.device("cuda"))
    configs = [c for c in _quant_configs() + _write_configs() if target in c.targets]
    precompile(configs, target, progress=False)


def _ids(case):
    return "-".join(str(x).replace("torch.", "") for x in case)


# ----------------------------------------------------------------------------------------------
# quantize_query
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", QUANT_CASES, ids=[_ids(c) for c in QUANT_CASES])
def test_quantize_matches_reference_bitwise(case, gen):
    dt, kind, T, Hq, Hkv, D, sk = case
    q = q_view(kind, T, Hq, D, dt, gen, Hkv=Hkv)
    q.mul_(40)  # wide range: saturation at ±448 * scale included
    q[0, 0, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-30])
    scale = make_scale(sk, Hkv, gen)
    out = torch.full((T, Hq, D), float("nan"), device="cuda").to(FP8)
    res = cute_kernels.quantize_query(q, scale, out=out)
    assert res is out
    assert_same_codes(out, reference.quantize_query(q, scale))


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_quantize_every_16bit_value(dtype, scale_kind):
    """Every bf16/fp16 bit pattern; 0.3 and 1.7 are scales for which x * (1 / s) rounds some
    values to other codes than x / s (checked here), so only a true division passes."""
    q = all_bit_patterns(dtype)
    for s in (0.3, 1.7):
        s32 = torch.tensor(s, dtype=torch.float32, device="cuda")
        scale = s if scale_kind == "float" else s32.reshape(1)
        ref = reference.quantize_query(q, scale)
        recip = (q.float() * (1 / s32)).clamp(-448, 448).to(FP8)
        assert ((codes(recip) != codes(ref)) & ~ref.float().isnan()).any()
        assert_same_codes(cute_kernels.quantize_query(q, scale), ref)


# Scales for the division's fast-path edges (cute_kernels/common/fdiv.py: 2^-30 <= s <= 2^30 takes
# the reciprocal + two corrections, anything else a true division) and a log-uniform spread of
# non-power-of-two scales between them; non-positive ones only reach the kernel as device tensors.
EDGE_SCALES = (2.0**-30, 2.0**30, 2.0**-30 * 0.999, 2.0**30 * 1.001, 1e-37, 3e37, 1.0, 0.5, 448.0, 1 / 448)
ODD_SCALES = (0.0, -0.7, float("inf"), float("nan"))


def spread_scales(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return [float(2.0 ** (torch.rand((), generator=g) * 60 - 30) * (1 + torch.rand((), generator=g)))
            for _ in range(n)]


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_quantize_every_16bit_value_many_scales(dtype):
    """The division without a per-element ``div.rn``: every input value x every scale of a spread
    (edges of the fast path included) gives the reference's codes."""
    q = all_bit_patterns(dtype)
    scales = list(EDGE_SCALES) + spread_scales(40, seed=1) + list(ODD_SCALES)
    for s in scales:
        st = torch.tensor([s], dtype=torch.float32, device="cuda")
        assert_same_codes(cute_kernels.quantize_query(q, st), reference.quantize_query(q, st))
    for s in EDGE_SCALES[:6]:  # a float argument takes the same path
        assert_same_codes(cute_kernels.quantize_query(q, s), reference.quantize_query(q, s))


@pytest.mark.parametrize("cache_dtype", [FP8, BF16])
def test_write_every_16bit_value_many_scales(cache_dtype):
    """write_kv_cache's division, every bf16 value x a spread of scales, FP8 and 16-bit caches."""
    Hkv, D, page = 8, 128, 16
    key = all_bit_patterns(BF16, Hkv, D)
    value = key.flip(0)
    T = key.shape[0]
    slots = torch.arange(T, device="cuda")
    for s in list(EDGE_SCALES) + spread_scales(12, seed=2) + list(ODD_SCALES):
        st = torch.tensor([s], dtype=torch.float32, device="cuda")
        vt = torch.tensor([s * 0.75], dtype=torch.float32, device="cuda")
        cache = torch.zeros(T // page, 2, Hkv, page, D, dtype=cache_dtype, device="cuda")
        ref = torch.zeros_like(cache)
        cute_kernels.write_kv_cache(key, value, cache, slots, k_scale=st, v_scale=vt)
        reference.write_kv_cache(key, value, ref, slots, k_scale=st, v_scale=vt)
        if cache_dtype == FP8:
            assert_same_codes(cache, ref)
        else:
            same = (cache.view(torch.int16) == ref.view(torch.int16)) | (cache.isnan() & ref.isnan())
            assert same.all(), f"scale {s}: {int((~same).sum())} values differ"


def test_quantize_per_kv_head_scale_mapping(gen):
    T, Hq, Hkv, D = 16, 32, 8, 128
    q = (torch.randn(T, Hq, D, device="cuda", generator=gen) * 10).to(BF16)
    scale = torch.tensor([0.05 * (i + 1) for i in range(Hkv)], device="cuda")
    out = cute_kernels.quantize_query(q, scale)
    for h in range(Hq):  # query head h uses q_scale[h // (Hq // Hkv)]
        assert_same_codes(out[:, h], reference.quantize_fp8(q[:, h], scale[h // (Hq // Hkv)].reshape(1)))


@pytest.mark.parametrize("case", ROPE_CASES, ids=[_ids(c) for c in ROPE_CASES])
def test_quantize_with_rope_matches_reference_bitwise(case, gen):
    dt, kind, T, Hq, D, rot, csd, pd, sk = case
    q = q_view(kind, T, Hq, D, dt, gen)
    q.mul_(8)
    rope = make_rope(T, rot, csd, pd, gen=gen, invalid=True)
    scale = make_scale(sk, 2, gen)
    out = cute_kernels.quantize_query(q, scale, rope=rope)
    ref = reference.quantize_query(q, scale, rope=rope)
    assert_same_codes(out, ref)
    half = rot // 2
    assert out[:2, :, :rot].float().isnan().all()  # invalid positions: rotated dims NaN
    assert not out[:2, :, rot:].float().isnan().any()  # pass-through dims untouched
    assert not out[2:].float().isnan().any()
    # the rotation really happened (a kernel ignoring RoPE would match the plain quantization)
    plain = reference.quantize_query(q, scale)
    assert not torch.equal(codes(out[2:, :, :half]), codes(plain[2:, :, :half]))


def test_quantize_empty_and_out_strided(gen):
    q = torch.randn(0, 8, 128, device="cuda").to(BF16)
    assert cute_kernels.quantize_query(q, 0.5).shape == (0, 8, 128)
    q = (torch.randn(6, 8, 128, device="cuda", generator=gen) * 30).to(BF16)
    buf = torch.full((6, 8, 160), 0x5A, dtype=torch.uint8, device="cuda")
    out = buf[:, :, 16:144].view(FP8)  # strided, 16-byte aligned
    cute_kernels.quantize_query(q, 0.5, out=out)
    assert_same_codes(out, reference.quantize_query(q, 0.5))
    assert (buf[:, :, :16] == 0x5A).all() and (buf[:, :, 144:] == 0x5A).all()


def test_quantize_scale_tensor_is_read_at_replay(gen):
    """CUDA graph: a device q_scale is read by the kernel, so a new value takes effect on replay."""
    q = (torch.randn(64, 32, 128, device="cuda", generator=gen) * 10).to(BF16)
    scale = torch.tensor([0.5], device="cuda")
    out = torch.empty(64, 32, 128, dtype=FP8, device="cuda")
    cute_kernels.quantize_query(q, scale, out=out)  # compile / cache outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_kernels.quantize_query(q, scale, out=out)
    for s in (0.25, 3.0):
        scale.fill_(s)
        out.view(torch.uint8).zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_same_codes(out, reference.quantize_query(q, scale))


# ----------------------------------------------------------------------------------------------
# write_kv_cache
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", WRITE_CASES, ids=[_ids(c) for c in WRITE_CASES])
def test_write_matches_reference_every_byte(case, gen):
    kvd, layout, container, sd, page, Hkv, D, kind, sk = case
    T = 40
    raw, cache, key, value = make_write_case(case, T, gen)
    key.mul_(50)  # FP8: values beyond ±448 * scale saturate
    key[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), 1e-30, -0.0])
    value[2, 0, 1] = float("nan")
    P = (cache[0] if container == "tuple" else cache).shape[0]
    slots = make_slots(T, P, page, sd, gen)
    ks, vs = make_kv_scales(sk)
    expected = raw.clone()
    exp_cache = _same_view(cache, raw, expected)
    reference.write_kv_cache(key, value, exp_cache, slots, kv_layout=layout, k_scale=ks, v_scale=vs)
    cute_kernels.write_kv_cache(key, value, cache, slots, kv_layout=layout, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    # every byte: written slots equal the reference, everything else (guards included) the sentinel
    nan = _nan_bytes(expected, exp_cache) | _nan_bytes(raw, cache)
    assert torch.equal(_nan_bytes(expected, exp_cache), _nan_bytes(raw, cache))
    diff = (raw != expected) & ~nan
    assert not diff.any(), f"{int(diff.sum())} bytes differ, first at byte {int(diff.nonzero()[0])}"
    assert (raw != SENTINEL).any()


def _same_view(cache, raw, other):
    """``cache``'s view of ``raw``, rebuilt over ``other`` (same offsets, shapes, strides)."""
    def rebuild(t):
        esize = t.element_size()
        offset = (t.data_ptr() - raw.data_ptr()) // esize
        return other.view(t.dtype).as_strided(t.shape, t.stride(), offset)

    return tuple(rebuild(t) for t in cache) if isinstance(cache, tuple) else rebuild(cache)


def _nan_bytes(raw, cache):
    """Byte mask of ``raw`` covering the NaN elements of ``cache`` (contiguous views of ``raw``)."""
    mask = torch.zeros_like(raw, dtype=torch.bool)
    for t in cache if isinstance(cache, tuple) else (cache,):
        esize = t.element_size()
        start = t.data_ptr() - raw.data_ptr()
        mask[start:start + t.numel() * esize].view(-1, esize)[t.float().isnan().flatten()] = True
    return mask


def test_write_int32_slot_extremes_and_empty(gen):
    raw, cache, key, value = make_write_case(WRITE_CASES[-1], 8, gen)
    before = raw.clone()
    bad = torch.tensor([-1, -2**31, 2**31 - 1, cache.shape[0] * 16, -16, -1, 10**9, -(10**9)],
                       dtype=torch.int32, device="cuda")
    cute_kernels.write_kv_cache(key, value, cache, bad)
    cute_kernels.write_kv_cache(key[:0], value[:0], cache, bad[:0])
    torch.cuda.synchronize()
    assert torch.equal(raw, before)  # nothing written anywhere


def test_write_scale_tensors_are_read_at_replay(gen):
    case = (FP8, "NHD", "tuple", torch.int32, 16, 4, 128, "contiguous", "tensor")
    T = 40
    raw, cache, key, value = make_write_case(case, T, gen)
    key.mul_(10)
    slots = make_slots(T, cache[0].shape[0], 16, torch.int32, gen)
    ks, vs = make_kv_scales("tensor")
    cute_kernels.write_kv_cache(key, value, cache, slots, kv_layout="NHD", k_scale=ks, v_scale=vs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_kernels.write_kv_cache(key, value, cache, slots, kv_layout="NHD", k_scale=ks, v_scale=vs)
    ks.fill_(0.5)
    vs.fill_(0.125)
    graph.replay()
    expected = raw.clone()
    exp_cache = _same_view(cache, raw, expected)
    reference.write_kv_cache(key, value, exp_cache, slots, kv_layout="NHD", k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    assert torch.equal(raw, expected)


# ----------------------------------------------------------------------------------------------
# bad inputs on the device
# ----------------------------------------------------------------------------------------------


def test_quantize_bad_inputs_raise():
    q = torch.randn(4, 8, 128, device="cuda").to(BF16)
    with pytest.raises(TypeError, match="q must have dtype bfloat16 or float16"):
        cute_kernels.quantize_query(q.float(), 0.5)
    with pytest.raises(ValueError, match="q must have a contiguous last dim"):
        cute_kernels.quantize_query(q.transpose(1, 2), 0.5)
    with pytest.raises(ValueError, match="q_scale must be on cuda"):
        cute_kernels.quantize_query(q, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="per-KV-head"):
        cute_kernels.quantize_query(q, torch.ones(3, device="cuda"))
    with pytest.raises(ValueError, match="out must be on cuda"):
        cute_kernels.quantize_query(q, 0.5, out=torch.empty(4, 8, 128, dtype=FP8))
    with pytest.raises(ValueError, match="positions must be on cuda"):
        cute_kernels.quantize_query(q, 0.5, rope=(torch.ones(8, 128, device="cuda"), torch.zeros(4).long()))
    with pytest.raises(ValueError, match="q_scale must be a positive finite float"):
        cute_kernels.quantize_query(q, -1.0)
    cute_kernels.quantize_query(q, 0.5)  # cached launch: a bad float is still refused
    with pytest.raises(ValueError, match="q_scale must be a positive finite float"):
        cute_kernels.quantize_query(q, float("nan"))


def test_write_bad_inputs_raise():
    key = torch.randn(4, 8, 128, device="cuda").to(BF16)  # the variant of WRITE_CASES[0]
    cache = torch.zeros(3, 2, 8, 16, 128, dtype=FP8, device="cuda")
    slots = torch.arange(4, device="cuda")
    with pytest.raises(ValueError, match="slot_mapping must be on cuda"):
        cute_kernels.write_kv_cache(key, key, cache, slots.cpu())
    with pytest.raises(ValueError, match="kv_cache must be on cuda"):
        cute_kernels.write_kv_cache(key, key, cache.cpu(), slots)
    with pytest.raises(TypeError, match="view it as float8_e4m3fn"):
        cute_kernels.write_kv_cache(key, key, cache.view(torch.uint8), slots)
    with pytest.raises(ValueError, match="num kv heads mismatch"):
        cute_kernels.write_kv_cache(key[:, :1], key[:, :1], cache, slots)
    with pytest.raises(ValueError, match="k_scale must be on cuda"):
        cute_kernels.write_kv_cache(key, key, cache, slots, k_scale=torch.tensor([1.0]))
    cute_kernels.write_kv_cache(key, key, cache, slots)  # cached launch: a bad float is still refused
    with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
        cute_kernels.write_kv_cache(key, key, cache, slots, v_scale=0.0)


# ----------------------------------------------------------------------------------------------
# rows per thread (``items``): the same checks with 2 and 4 rows in flight per thread, on cases
# whose row count is not a multiple of a CTA's rows (the clamped tail loads, stores nothing)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("items", [2, 4])
def test_items_variants_match_reference(items, gen):
    with qq_op.tuning_override(items=items):
        for case in (QUANT_CASES[1], QUANT_CASES[2], QUANT_CASES[5]):
            test_quantize_matches_reference_bitwise(case, gen)
        for case in (ROPE_CASES[0], ROPE_CASES[2]):
            test_quantize_with_rope_matches_reference_bitwise(case, gen)
    with kv_op.tuning_override(items=items):
        for case in (WRITE_CASES[0], WRITE_CASES[2], WRITE_CASES[4]):
            test_write_matches_reference_every_byte(case, gen)
