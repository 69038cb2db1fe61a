"""The layer's warm-up covers every variant a step can reach (docs/design/layer.md#warm-up).

``AttentionLayer.warmup`` compiles :func:`dispatch.warmup.layer_variants`. These tests enumerate,
host-only, what the ops would ask for on every batch shape up to the limits (every batch size,
every block-table width, not the reduced set of widths the warm-up walks) with the functions the
ops decide with, and check that each is in the warm-up's list, that the list holds nothing no shape
reaches, and that the reserved workspace is the largest any shape asks for. The same on the GPU,
with compiles forbidden during the steps: tests/gpu/test_warmup_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from cute_kernels.ops import quantize_query as qq_op
from cute_kernels.ops import write_kv_cache as kv_op
from cute_kernels.ops.paged_decode import workspace_numel
from cute_kernels.plans import sm90_decode
from dispatch.layer import AttentionLayer
from dispatch.warmup import decode_launches, decode_workspace

# (Hq, Hkv, D, cache, page, scales as tensors, q_lens, kv_form)
LAYERS = [
    (32, 8, 128, "fp8", 16, False, (1,), "single"),
    (32, 4, 128, "bf16", 16, True, (1, 2), "pair"),
    (8, 1, 256, "fp8", 64, False, (1, 4), "single"),
    (16, 16, 64, "fp16", 32, True, (1,), "single"),
    (64, 8, 128, "fp8", 128, False, (1, 3), "pair"),
]
MAX_SEQS, MAX_LEN = 40, 3000  # every batch of 1..40 requests, every width up to 3000 tokens


def _layer(Hq, Hkv, D, cache, page, tensors):
    scale = (lambda v: torch.tensor(v)) if tensors else float  # 0-d tensors, as vLLM keeps them
    model = "fp16" if cache == "fp16" else "bf16"
    return AttentionLayer(Hq, Hkv, D, kv_cache_dtype=cache, page_size=page, arch="sm90", model_dtype=model,
                          k_scale=scale(0.5), v_scale=scale(0.25))


@pytest.mark.parametrize("Hq, Hkv, D, cache, page, tensors, q_lens, kv_form", LAYERS)
def test_warmup_lists_every_decode_variant_a_step_reaches(Hq, Hkv, D, cache, page, tensors, q_lens, kv_form):
    layer = _layer(Hq, Hkv, D, cache, page, tensors)
    listed = set(layer.warmup_variants(MAX_SEQS, MAX_LEN, q_lens=q_lens, kv_form=kv_form))
    max_pages = -(-MAX_LEN // page)
    reached = set()
    for q_len in q_lens:
        for _, _, _, cfg in decode_launches(layer, arch="sm90", max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN,
                                            q_len=q_len, kv_form=kv_form, widths=range(1, max_pages + 1)):
            reached.add(cfg)
    decode_listed = {c for c in listed if c.kernel_id == "sm90.decode"}
    assert reached <= decode_listed, sorted(c.label() for c in reached - decode_listed)
    assert decode_listed == reached  # nothing compiled that no shape reaches
    assert {c.k_scale_tensor for c in reached} == {tensors} and {c.kv_form for c in reached} == {kv_form}


def test_reduced_widths_give_every_launch_of_all_widths():
    """The warm-up walks one width per tile count up to MAX_SPLITS tiles and the largest: the
    (splits, config) of every other width is one of those, for every batch."""
    layer = _layer(32, 8, 128, "fp8", 16, False)
    max_len = 16 * 400
    tile = sm90_decode.make_decode_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=4, q_len=1,
                                          page_size=16, split=False).tile
    widths = sm90_decode.launch_widths(400, 16, tile)
    assert widths[0] == 1 and widths[-1] == 400 and len(widths) < 80
    for batch in (1, 2, 3, 5, 16, 33, 64):
        full = {(s, c) for b, _, s, c in decode_launches(layer, arch="sm90", max_num_seqs=batch, max_model_len=max_len,
                                                         widths=range(1, 401)) if b == batch}
        reduced = {(s, c) for b, _, s, c in decode_launches(layer, arch="sm90", max_num_seqs=batch,
                                                            max_model_len=max_len) if b == batch}
        assert full == reduced


def test_reserved_workspace_is_the_largest_any_step_asks_for():
    layer = _layer(32, 8, 128, "fp8", 16, False)
    numel, counters = decode_workspace(layer, MAX_SEQS, MAX_LEN)
    want_n = want_c = 0
    for b, _, s, cfg in decode_launches(layer, arch="sm90", max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN,
                                        widths=range(1, -(-MAX_LEN // 16) + 1)):
        n, c = workspace_numel(cfg, s, b, 8, b, 32, 128, False)
        want_n, want_c = max(want_n, n), max(want_c, c)
    assert (numel, counters) == (want_n, want_c) and numel > 0 and counters > 0


def test_warmup_lists_the_cache_write_and_query_quantization_the_ops_pick():
    """For 16-byte aligned inputs (a fused QKV projection's views, a cache, an allocated out) the
    ops pick exactly the cache-write and quantization variants the warm-up lists."""
    Hq, Hkv, D, page, T = 32, 8, 128, 16, 5
    layer = AttentionLayer(Hq, Hkv, D, kv_cache_dtype="fp8", page_size=page, arch="sm90", q_scale=torch.tensor(0.1))
    listed = set(layer.warmup_variants(4, 256))
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D).to(torch.bfloat16)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    cache = torch.zeros(9, 2, Hkv, page, D, dtype=torch.float8_e4m3fn)
    for dtype in (torch.int64, torch.int32):
        slots = torch.arange(T, dtype=dtype)
        assert kv_op.make_config(k, v, cache, slots, "HND", False, False) in listed
    # the layer quantizes no query on SM90 (its decode runs on the 16-bit query): nothing listed,
    # but a plan that did would get the op's variant for an aligned query
    assert not any(c.kernel_id == "common.quantize_query" for c in listed)
    from cute_kernels.plans.quantize_query import aligned_vec, make_quantize_config

    assert qq_op.make_config(q, True) == make_quantize_config(q_dtype="bf16", head_dim=D, vec=aligned_vec(D),
                                                              scale_tensor=True, num_q_heads=Hq)


def test_warmup_lists_the_merge_for_the_layer_head_dim():
    listed = _layer(32, 8, 128, "fp8", 16, False).warmup_variants(2, 64)
    merges = {(c.out_dtype, c.head_dim, c.vec) for c in listed if c.kernel_id == "common.merge_states"}
    assert merges == {("bf16", 128, 4), ("fp32", 128, 4)}


def test_warmup_refuses_bad_limits():
    from dispatch.errors import UnsupportedConfig

    layer = _layer(32, 8, 128, "fp8", 16, False)
    with pytest.raises(UnsupportedConfig, match="max_num_seqs"):
        layer.warmup_variants(0, 64)
    with pytest.raises(UnsupportedConfig, match="max_model_len"):
        layer.warmup_variants(4, 1.5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_sms=0), "num_sms must be a positive int, got 0"),  # a ZeroDivisionError in the split rule before
    (dict(num_sms=132.0), "num_sms must be a positive int"),
    (dict(q_lens=3), "q_lens must be a sequence of positive ints, got 3"),  # 'int' object is not iterable before
    (dict(q_lens=(1, 0)), "q_lens must be a positive int, got 0"),
    (dict(kv_form="triple"), "kv_form must be 'single' or 'pair', got 'triple'"),
    (dict(slot_dtypes="int32"), "slot_dtypes must be a sequence of 'int64' / 'int32', got 'int32'"),  # read as 'i', 'n'...
    (dict(slot_dtypes=("int16",)), "slot_dtypes must hold 'int64' / 'int32'"),
])
def test_warmup_refuses_bad_enumeration_arguments(kwargs, match):
    from dispatch.errors import UnsupportedConfig

    with pytest.raises(UnsupportedConfig, match=match):
        _layer(32, 8, 128, "fp8", 16, False).warmup_variants(2, 64, **kwargs)


@pytest.fixture
def fake_sm90(monkeypatch):
    """CPU tensors take the ops' SM90 path: ``is_cuda`` is True, the target sm_90a, 132 SMs, and
    every op's ``get_kernel`` records the config it asks for and returns a no-op kernel."""
    from cute_kernels.ops import merge_states, paged_decode, paged_prefill, quantize_query, write_kv_cache

    requested = []

    def get_kernel(config, target):
        requested.append(config)
        return lambda *args: None

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for mod in (paged_decode, paged_prefill, quantize_query, write_kv_cache, merge_states):
        monkeypatch.setattr(mod, "compile_target", lambda device: "sm_90a")
        monkeypatch.setattr(mod, "get_kernel", get_kernel)
        mod._launcher.launches.clear()
    monkeypatch.setattr(paged_decode, "device_sm_count", lambda index: 132)
    monkeypatch.setattr(paged_decode, "stream_id", lambda t: 0)
    monkeypatch.setattr(paged_decode, "ffi_tensor", lambda t: t)
    monkeypatch.setattr(paged_prefill, "self_check_passes", lambda config, device: True)
    monkeypatch.setattr(quantize_query, "self_check_passes", lambda config, device: True)
    quantize_query._two_launcher.launches.clear()
    yield requested
    for mod in (paged_decode, paged_prefill, quantize_query, write_kv_cache, merge_states):
        mod._launcher.launches.clear()
    quantize_query._two_launcher.launches.clear()


@pytest.mark.parametrize("cache, tensors, q_len, prefill_query", [
    ("fp8", False, 1, "auto"), ("bf16", True, 2, "auto"), ("fp8", True, 1, "fp8"), ("fp8", False, 1, "fp8"),
    ("fp8", True, 1, "fp8x2")])
def test_layer_steps_ask_only_for_listed_variants(fake_sm90, cache, tensors, q_len, prefill_query):
    """Random mixed steps of AttentionLayer (decode rows of every batch size and context up to the
    limits, prefill rows after them) through the ops' own code paths: every config the ops ask
    the compiler for is in the warm-up's list (with ``prefill_query_dtype="fp8"``: the FP8-query
    prefill and the query quantization too)."""
    import random

    from tests.cpu.test_layer_dispatch import make_step

    Hq, Hkv, D, page = 16, 4, 64, 16
    scale = (lambda v: torch.tensor(v)) if tensors else float  # noqa: E731
    layer = AttentionLayer(Hq, Hkv, D, kv_cache_dtype=cache, page_size=page, arch="sm90", k_scale=scale(0.5),
                           v_scale=scale(0.25), q_scale=scale(0.125), prefill_query_dtype=prefill_query)
    listed = set(layer.warmup_variants(MAX_SEQS, MAX_LEN, q_lens=(q_len,)))
    rng = random.Random(7)
    kv = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
    for i in range(25):
        B = rng.randint(1, MAX_SEQS)
        ctx = tuple(rng.randint(q_len, MAX_LEN - page) for _ in range(B))
        prefill = tuple((rng.randint(0, 300), rng.randint(1, 40)) for _ in range(rng.randint(0, 2)))
        step = make_step(decode_ctx=ctx, q_len_per_req=q_len, prefill=prefill, Hq=Hq, Hkv=Hkv, D=D, page=page,
                         kv_dtype=kv, slot_dtype=rng.choice((torch.int32, torch.int64)),
                         generator=torch.Generator().manual_seed(i))
        layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
    asked = set(fake_sm90)
    assert {c.kernel_id for c in asked} >= {"sm90.decode", "common.write_kv_cache", "sm90.prefill"}
    # the prefill configs' query: bf16, or (the FP8-query kernel's config, kind "fp8") FP8 after quantization
    prefill_q = {c.q_dtype for c in asked if c.kernel_id == "sm90.prefill"}
    fp8_query = prefill_query in ("fp8", "fp8x2")
    assert prefill_q == ({"fp8_e4m3"} if fp8_query else {"bf16"})
    assert any(c.kernel_id == "common.quantize_query" for c in asked) == fp8_query
    # the two-term query: the fused residual variant (one pass), not the one-term kernel and torch ops
    quantized = {c.residual for c in asked if c.kernel_id == "common.quantize_query"}
    assert quantized == ({True} if prefill_query == "fp8x2" else {False} if fp8_query else set())
    assert asked <= listed, sorted(c.label() for c in asked - listed)


@pytest.mark.parametrize("arch", ["sm86", "sm120"])
@pytest.mark.parametrize("Hq, Hkv, D, cache, page, tensors, q_lens, kv_form", LAYERS[:3])
def test_warmup_lists_every_portable_decode_variant(arch, Hq, Hkv, D, cache, page, tensors, q_lens, kv_form):
    """Where the plan takes sm80.decode: every (split or not) variant of every batch and width, the
    merges of the split ones, the portable prefill, and the largest workspace any shape asks for."""
    from dispatch.warmup import sm80_decode_launches

    scale = (lambda v: torch.tensor(v)) if tensors else float
    layer = AttentionLayer(Hq, Hkv, D, kv_cache_dtype=cache, page_size=page, arch=arch,
                           model_dtype="fp16" if cache == "fp16" else "bf16", k_scale=scale(0.5), v_scale=scale(0.25))
    listed = set(layer.warmup_variants(MAX_SEQS, MAX_LEN, q_lens=q_lens, kv_form=kv_form))
    reached, numel = set(), 0
    for q_len in q_lens:
        for b, _, s, cfg in sm80_decode_launches(layer, arch=arch, max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN,
                                                 q_len=q_len, kv_form=kv_form, widths=range(1, -(-MAX_LEN // page) + 1)):
            reached |= {cfg, cfg.merge_config()} if cfg.split else {cfg}
            numel = max(numel, workspace_numel(cfg, s, b, Hkv, b * q_len, Hq, D, False)[0])
    assert {c for c in reached if c.kernel_id == "sm80.decode"} == {c for c in listed if c.kernel_id == "sm80.decode"}
    assert reached <= listed and any(c.kernel_id == "common.merge_states" for c in reached)  # some split
    assert [c.kernel_id for c in listed if "prefill" in c.kernel_id] == ["sm80.prefill"]
    assert decode_workspace(layer, MAX_SEQS, MAX_LEN, q_lens=q_lens, kv_form=kv_form) == (numel, 0)
