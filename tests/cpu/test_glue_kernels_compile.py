"""The glue kernels' fallback variants compile on the CPU with the instructions they rely on.

The registry variants (16-element vectors, the common shapes) are covered by the compile matrix.
These are the variants the ops pick for less aligned inputs or odd shapes: narrower vectors
(8/4/2/1 elements), page sizes that are not powers of two, partial RoPE whose half is not a
multiple of 16. Each must still divide exactly (``div.rn.f32``), convert with saturation
(``cvt.rn.satfinite``), keep RoPE free of FMA contraction, and not spill to local memory.
"""

from __future__ import annotations

import re

import pytest

from cute_kernels.jit.compiler import compile_config
from cute_kernels.plans.quantize_query import QuantizeQueryConfig
from cute_kernels.plans.write_kv_cache import WriteKVCacheConfig

pytestmark = pytest.mark.compile

CONFIGS = [
    QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=4, scale_tensor=True),
    QuantizeQueryConfig(q_dtype="fp16", head_dim=72, vec=8),
    QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=4, rot_dim=24),
    # the op's SM90 RoPE default: 2 rows (of one token) per thread, PDL
    QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=8, rot_dim=128, items=2, pdl=True),
    QuantizeQueryConfig(q_dtype="bf16", head_dim=64, vec=1, scale_tensor=True, rot_dim=2, cos_sin_dtype="bf16",
                        pos_dtype="int32"),
    WriteKVCacheConfig(in_dtype="bf16", cache_dtype="fp8_e4m3", head_dim=256, page_size=1, vec=4,
                       kv_layout="NHD"),
    WriteKVCacheConfig(in_dtype="fp16", cache_dtype="fp16", head_dim=128, page_size=7, vec=4, slot_dtype="int32",
                       kv_layout="NHD", k_scale_tensor=True, v_scale_tensor=True),
    WriteKVCacheConfig(in_dtype="bf16", cache_dtype="fp8_e4m3", head_dim=64, page_size=5, vec=2, kv_form="pair"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.label() for c in CONFIGS])
def test_fallback_variant_compiles_exactly(config):
    compiled = compile_config(config, "sm_90a", artifacts=True)
    ptx = compiled.ptx
    assert re.search(r"^\.target\s+sm_90a", ptx, re.M)
    assert "div.rn.f32" in ptx and not re.search(r"div\.(approx|full)", ptx)
    # the division's fast path (common/fdiv.py): one multiply and four FMAs per element, its own
    # registers, copysign for signed zeros
    assert len(re.findall(r"mul\.rn\.f32\s+quo,", ptx)) > 0 and "copysign.f32" in ptx
    assert all(re.match(r"fma\.rn\.f32\s+(quo|rem),", m) for m in re.findall(r"fma\.rn\.f32[^;]*", ptx))
    fp8_out = isinstance(config, QuantizeQueryConfig) or config.cache_dtype == "fp8_e4m3"
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == fp8_out
    if isinstance(config, QuantizeQueryConfig) and config.rot_dim:
        # the rotation is three separately rounded ops per element of the thread's two chunks;
        # nothing is contracted to FMA (the only FMAs are the division's, checked above)
        assert len(re.findall(r"mul\.rn\.f32\s+[pq],", ptx)) == 4 * config.vec * config.items
        assert ptx.count("add.rn.f32") == 2 * config.vec * config.items
    if compiled.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", compiled.sass), "local memory (spills)"


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=lambda c: c.kernel_id)
def test_fp8_variants_are_refused_on_sm80(config):
    with pytest.raises(ValueError, match="does not compile for sm_80"):
        compile_config(config, "sm_80")
