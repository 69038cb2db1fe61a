"""Every kernel variant this package compiles, for the compile matrix and ``cute-kernels compile``.

A variant is a kernel config instance; the matrix compiles each for every target it names and
checks its instruction evidence (``KernelConfig.evidence``: regexes that must match the PTX).
Later kernels add their variants here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .jit.compiler import CompiledKernel, KernelConfig, compile_config, normalize_target

# SASS mnemonics worth reporting per family (the PTX evidence is what tests assert)
SASS_FAMILIES = ("HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "UTCHMMA", "UTCQMMA", "LDSM", "LDG.E.128", "STL", "LDL")


def variants() -> list[KernelConfig]:
    from .common.merge import MergeStatesConfig
    from .sm90.probe import Sm90ProbeConfig
    from .sm100.probe import Sm100ProbeConfig

    out: list[KernelConfig] = [
        MergeStatesConfig(out_dtype=dt, head_dim=d, vec=4)
        for dt in ("fp32", "bf16", "fp16")
        for d in (64, 128, 256)
    ]
    out += [Sm90ProbeConfig(), Sm100ProbeConfig()]
    out += decode_matrix()
    out += qsa_matrix()
    out += prefill_matrix()

    # layer glue: query quantization (per-tensor / per-KV-head scales, full and partial RoPE with
    # both cache dtypes) and KV-cache writes (FP8 and 16-bit caches, both layouts and containers)
    from .common.kv_write import WriteKVCacheConfig
    from .common.quantize import QuantizeQueryConfig

    out += [
        # the ops' defaults (2 rows per thread for the query, PDL) and the plain variants
        QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=16, items=2, pdl=True),
        QuantizeQueryConfig(q_dtype="fp16", head_dim=128, vec=16, scale_tensor=True),
        QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=8, scale_tensor=True, rot_dim=128, pdl=True),
        QuantizeQueryConfig(q_dtype="bf16", head_dim=64, vec=8, rot_dim=32, cos_sin_dtype="bf16",
                            pos_dtype="int32"),
        WriteKVCacheConfig(in_dtype="bf16", cache_dtype="fp8_e4m3", head_dim=128, vec=16, pdl=True),
        WriteKVCacheConfig(in_dtype="bf16", cache_dtype="fp8_e4m3", head_dim=128, vec=16, slot_dtype="int32",
                           kv_form="pair", kv_layout="NHD", k_scale_tensor=True, v_scale_tensor=True),
        WriteKVCacheConfig(in_dtype="bf16", cache_dtype="bf16", head_dim=128, vec=16),
        WriteKVCacheConfig(in_dtype="fp16", cache_dtype="fp16", head_dim=256, page_size=32, vec=16,
                           slot_dtype="int32", kv_layout="NHD"),
        WriteKVCacheConfig(in_dtype="bf16", cache_dtype="fp8_e4m3", head_dim=64, vec=16, slot_dtype="int32"),
    ]
    return out


def decode_matrix() -> list[KernelConfig]:
    """SM90 decode: each head dim x KV dtype x (split / no split), GQA 8, page 16; the alternative
    FP8 widening; the cluster merge."""
    from .sm90.decode import make_decode_config

    out = []
    for kv in ("fp8_e4m3", "bf16", "fp16"):
        for d in (64, 128, 256):
            for split in (False, True):
                out.append(make_decode_config(q_dtype="fp16" if kv == "fp16" else "bf16", kv_dtype=kv, head_dim=d,
                                              group=8, q_len=1, page_size=16, split=split))
    # the alternative FP8 widening, kept compiling and tested
    out.append(make_decode_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1,
                                  page_size=16, split=False, widen="bits"))
    # the cluster merge (DSMEM) of splits of up to 16 CTAs: FP8 at the Qwen3 B8 sizing, BF16
    for kv, occ in (("fp8_e4m3", 3), ("bf16", None)):
        out.append(make_decode_config(q_dtype="bf16", kv_dtype=kv, head_dim=128, group=8, q_len=1, page_size=16,
                                      split=True, cluster=True, **({"occupancy": occ} if occ else {})))
    return out


def prefill_matrix() -> list:
    """SM90 paged prefill: each head dim of each kind (16-bit K/V; FP8 K/V widened for a bf16 query,
    narrowed to fp16, and for an fp16 one; FP8 query and K/V) with every scale form, both layouts
    and containers, causal and not, with and without LSE; the serial consumer schedule once."""
    from .plans.sm90_prefill import make_prefill_config

    def cfg(q, kv, d, g, page, **kw):
        return make_prefill_config(q_dtype=q, kv_dtype=kv, head_dim=d, group=g, page_size=page, **kw)

    return [
        cfg("bf16", "bf16", 128, 8, 16),
        cfg("fp16", "fp16", 64, 4, 32, kv_form="pair", kv_layout="NHD", causal=False),
        cfg("bf16", "bf16", 256, 1, 128, write_lse=False),
        cfg("bf16", "bf16", 128, 8, 16, overlap=False, pingpong=False),
        cfg("bf16", "fp8_e4m3", 128, 8, 16),
        cfg("fp16", "fp8_e4m3", 64, 16, 64, kv_layout="NHD", k_scale_tensor=True, v_scale_tensor=True),
        cfg("bf16", "fp8_e4m3", 256, 4, 32, kv_form="pair", causal=False),
        cfg("fp8_e4m3", "fp8_e4m3", 128, 8, 16, q_scale="scalar"),
        cfg("fp8_e4m3", "fp8_e4m3", 64, 8, 128, q_scale="tensor", kv_form="pair", kv_layout="NHD"),
        cfg("fp8_e4m3", "fp8_e4m3", 256, 4, 16, q_scale="per_head", out_dtype="fp16", write_lse=False),
    ]


def qsa_matrix() -> list[KernelConfig]:
    """SM90 QSA: the Qwen3.8 layer (D 256, GQA 12 and 6, page 1568/784) in BF16 and FP8, direct
    (gated) and split-K, plus the fused merges; D 64/128 and GQA 16/1 once each; the prefill's
    row-tile kernel (both cache dtypes x both groups, gated, at the rows per CTA the op uses) and
    its union pre-pass (5 rows, 16K-token bitmap; 8 rows, the largest bitmap); the FP8 prefill's
    widening pre-pass (bf16 and fp16 copies)."""
    from .sm90.qsa import make_qsa_config
    from .sm90.qsa_merge import QsaMergeConfig, merge_shape
    from .sm90.qsa_tile import make_qsa_tile_config
    from .sm90.qsa_union import QsaUnionConfig
    from .sm90.qsa_widen import QsaWidenConfig

    out: list[KernelConfig] = []
    for kv in ("bf16", "fp8_e4m3"):
        for group, page in ((12, 1568), (6, 784)):
            for split in (False, True):
                out.append(make_qsa_config(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=group, page_size=page,
                                           split=split, gate=not split))
    out.append(make_qsa_config(q_dtype="fp16", kv_dtype="fp16", head_dim=128, group=16, page_size=800, split=True,
                               gate=False))
    out.append(make_qsa_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=64, group=1, page_size=16,
                               split=False, gate=False))
    # the merge shapes of the decode table's split counts: N 4 (11), N 16 (4), S 2, N 1 (33: lanes)
    out += [QsaMergeConfig(out_dtype="bf16", head_dim=256, vec=4, gate=g, pdl=True, group=m, lanes=lanes)
            for g, splits in ((True, 11), (False, 11), (True, 4), (False, 2), (True, 33))
            for m, lanes in (merge_shape(splits),)]
    out += [make_qsa_tile_config(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=group, page_size=page, gate=True)
            for kv in ("bf16", "fp8_e4m3") for group, page in ((12, 1568), (6, 784))]
    out += [QsaUnionConfig(rows_per_tile=5, page_size=1568, max_tokens=16384, union_cap=4160),
            QsaUnionConfig(rows_per_tile=8, page_size=784, max_tokens=524288, union_cap=4160)]
    out += [QsaWidenConfig(out_dtype="bf16", head_dim=256, page_size=1568),
            QsaWidenConfig(out_dtype="fp16", head_dim=128, page_size=800)]
    return out


def variants_for(arch: str) -> list[KernelConfig]:
    target = normalize_target(arch)
    return [v for v in variants() if target in v.targets]


@dataclass
class Evidence:
    """What one compile proved: each PTX pattern's match count and a SASS mnemonic summary."""

    ptx_target: str | None
    ptx: dict[str, int] = field(default_factory=dict)
    sass: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


def evidence_of(compiled: CompiledKernel) -> Evidence:
    ptx = compiled.ptx or ""
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    ev = Evidence(ptx_target=target.group(1) if target else None)
    for pattern in compiled.config.evidence.get(compiled.arch, ()):
        n = len(re.findall(pattern, ptx))
        ev.ptx[pattern] = n
        if n == 0:
            ev.missing.append(pattern)
    if compiled.sass:
        for fam in SASS_FAMILIES:
            n = len(re.findall(r"\b" + re.escape(fam), compiled.sass))
            if n:
                ev.sass[fam] = n
    return ev


def compile_with_evidence(config: KernelConfig, arch: str) -> tuple[CompiledKernel, Evidence]:
    compiled = compile_config(config, arch, artifacts=True)
    return compiled, evidence_of(compiled)
