"""The compile matrix of the portable SM80-class kernels: the variants ``cute-kernels compile``
builds per target (the plan's defaults and the forms the overrides still select), the
representative set the CPU suite compiles and the prefill variants a model shape reaches (the
warm-up's list). Host-only; the limits and forms are the plan's
(:mod:`.sm80`). Design: docs/design/sm80.md.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Any

from ..jit.spec import KernelConfig
from .sm80 import (
    _D128_MARGIN,
    CVT_TARGETS,
    DECODE_XOR_16BIT_D128_SPILL_TARGETS,
    HEAD_DIMS,
    KV_DTYPES,
    PREFILL_D128_TW64,
    PREFILL_D128_TW64_TARGETS,
    PREFILL_D128_TW64S,
    PREFILL_D128_TW64S_TARGETS,
    PREFILL_D256_TW32X,
    PREFILL_M2_MAX_HEAD_DIM,
    TARGETS,
    Sm80DecodeConfig,
    Sm80PrefillConfig,
    make_decode_config,
    make_prefill_config,
    prefill_d128_lean_softmax,
    prefill_d128_tw64s,
    prefill_tiling,
)


def _q_for(kv: str) -> str:
    return "fp16" if kv == "fp16" else "bf16"


def prefill_variants(*, target: str, head_dim: int, num_q_heads: int, num_kv_heads: int, page_size: int,
                     kv_dtypes=("fp8_e4m3",), q_dtype: str = "bf16", scale_tensors=(False, True),
                     kv_layouts=("HND",), kv_forms=("single",), causal=(True,), return_lse=(False,)) -> list:
    """The ``sm80.prefill`` configs that a model shape reaches on ``target`` (the warm-up's list):
    per cache dtype, scale form, layout, container, mask and LSE output."""
    return [make_prefill_config(target=target, q_dtype=q_dtype, kv_dtype={"fp8": "fp8_e4m3"}.get(kv, kv),
                                head_dim=head_dim, group=num_q_heads // num_kv_heads, page_size=page_size,
                                causal=mask, write_lse=lse, kv_form=form, kv_layout=layout, k_scale_tensor=st,
                                v_scale_tensor=st)
            for kv, st, layout, form, mask, lse in product(kv_dtypes, scale_tensors, kv_layouts, kv_forms, causal,
                                                            return_lse)]


def old_form(config: KernelConfig) -> KernelConfig:
    """The form an explicit override still selects where the plan's default moved on
    (docs/design/sm80.md#defaults): the decode with per-address ``ldmatrix`` (``ldsm_xor=False``) and
    a split's merge as a second launch (``fused_merge=False``), the prefill's 64-row CTA with its
    32-token stages, 16 at D 256 (``m_tiles=1, tw=...``)."""
    if isinstance(config, Sm80DecodeConfig):
        return replace(config, ldsm_xor=False, fused_merge=False)
    assert isinstance(config, Sm80PrefillConfig)
    return replace(config, **prefill_tiling(config.target, config.kv_dtype, config.head_dim, 1,
                                            16 if config.head_dim == 256 else 32))


def rows128_form(config: Sm80PrefillConfig) -> Sm80PrefillConfig:
    """The 128-row prefill that ``m_tiles=2`` selects for ``config``'s variant (up to D 128): with
    32-token stages the default where measured (at D 128 the default before ``PREFILL_D128_TW64S``
    on sm_80 / sm_86), else an override with 16-token stages at D 128 (docs/design/sm80.md#defaults)."""
    return replace(config, **prefill_tiling(config.target, config.kv_dtype, config.head_dim, 2, None, config.lean))


def d256_tw32x_form(config: Sm80PrefillConfig) -> Sm80PrefillConfig:
    """The head-dim-256 prefill that ``PREFILL_D256_TW32X`` selects for ``config``'s variant (its
    ring the deepest that fits, two CTAs per SM where they fit): the default where
    :func:`prefill_d256_tw32x`, an override elsewhere."""
    assert config.head_dim == 256
    tiling = prefill_tiling(config.target, config.kv_dtype, 256, PREFILL_D256_TW32X["m_tiles"],
                            PREFILL_D256_TW32X["tw"])
    return replace(config, **{**tiling, "ldsm_xor": bool(PREFILL_D256_TW32X["ldsm_xor"])})


def d128_tw64_form(config: Sm80PrefillConfig) -> Sm80PrefillConfig:
    """The head-dim-128 prefill that the ``PREFILL_D128_TW64`` override selects for ``config``'s
    variant (128-row CTAs, 64-token stages, the deepest ring that fits: two stages and two CTAs per
    SM on sm_90a)."""
    assert config.head_dim == 128
    tiling = prefill_tiling(config.target, config.kv_dtype, 128, PREFILL_D128_TW64["m_tiles"],
                            PREFILL_D128_TW64["tw"])
    return replace(config, **tiling)


def d128_tw64s_form(config: Sm80PrefillConfig) -> Sm80PrefillConfig:
    """The head-dim-128 prefill that ``PREFILL_D128_TW64S`` selects for ``config``'s variant: the
    ``PREFILL_D128_TW64`` tiling and ring with the row statistics in shared memory and the
    one-base gather."""
    return replace(d128_tw64_form(config), **_D128_MARGIN)


def four_warp_form(config: Sm80PrefillConfig) -> Sm80PrefillConfig:
    """The default before ``PREFILL_D128_PINGPONG`` / ``PREFILL_D128_PINGPONG16`` of a ``pingpong``
    default: the plan's D 128 tiling with the ping-pong forms left out (``PREFILL_D128_TW64S`` in
    four warps where it is the default, its softmax and ring as that default has them; on sm_80 the
    32-token CTA with the lean softmax; on sm_120a / sm_121a the 64-row CTA). The ring is sized as
    the ping-pong default's was: a 128-row ping-pong default on sm_90a exists only with a ring sized
    for a 99 KB target."""
    smem = "sm_86" if config.target == "sm_90a" and config.m_tiles == 1 else config.target
    lean = config.lean
    tiling = prefill_tiling(smem, config.kv_dtype, 128, lean=lean,
                            d128_s=prefill_d128_tw64s(config.target, config.kv_dtype, lean),
                            d128_lean=prefill_d128_lean_softmax(config.target, lean, config.kv_dtype, config.page_size))
    return replace(config, **tiling)


def _d128_tw64s_registered(config: KernelConfig) -> bool:
    """The lean GQA-4 page-16 builds of ``PREFILL_D128_TW64S`` that ptxas keeps without spills
    (``PREFILL_D128_TW64S_TARGETS``; the default on ``PREFILL_D128_TW64S_DEFAULT_TARGETS``)."""
    if not (isinstance(config, Sm80PrefillConfig) and config.head_dim == 128 and config.group == 4
            and config.page_size == 16 and config.kv_layout == "HND"):
        return False
    return config.lean and config.target in PREFILL_D128_TW64S_TARGETS[config.kv_dtype]


def _d128_tw64_registered(config: KernelConfig) -> bool:
    """The builds of the ``PREFILL_D128_TW64`` override that ptxas keeps without spills."""
    return (isinstance(config, Sm80PrefillConfig) and config.head_dim == 128 and config.kv_dtype == "bf16"
            and config.q_dtype == "bf16" and config.group == 4 and config.page_size == 16
            and config.target in PREFILL_D128_TW64_TARGETS and config.kv_form == "single"
            and not (config.k_scale_tensor or config.v_scale_tensor))


def fused_merge_registered(config: Sm80DecodeConfig) -> bool:
    """Whether the compile matrix registers the opt-in fused merge of ``config`` (a split decode):
    everywhere but 16-bit caches at D 128 on ``DECODE_XOR_16BIT_D128_SPILL_TARGETS``, whose ptxas
    needs the per-address ``ldmatrix`` there already and spills the fused build (1-5 ``STL``)."""
    return not (config.head_dim == 128 and not config.fp8 and config.target in DECODE_XOR_16BIT_D128_SPILL_TARGETS)


def compile_variants(kernel_id: str | None = None) -> list[KernelConfig]:
    """The variants of ``kernel_id`` (both kernels: None) in every target's full set
    (``cute-kernels compile --arch <target> --kernel sm80.``), each in the plan's default form and
    in the forms the overrides select where they differ from it (``ldsm_xor=False`` for the decode
    from D 128 on; ``m_tiles=1`` with the old stage and ``m_tiles=2`` for the prefill,
    :func:`d256_tw32x_form` for each prefill at D 256,
    :func:`d128_tw64_form` for the BF16 D 128
    prefill, lean and with the LSE, and :func:`d128_tw64s_form` for the lean one, where they build
    without spills, :func:`four_warp_form` for each ``pingpong`` default and the ``ring_release`` ones
    without it, the decode without ``page_prefetch`` where it is the default, each default prefill, and its
    derived forms, without ``q_loads_first`` and without ``one_cta_bound``; the opt-in ``warp_store`` on
    the default prefill of each cache dtype and head dim, and through the CI set's sm_90a one on that
    default's derived forms): decode for
    each cache dtype x head dim, split and not, at GQA 8 (one warp row) and at 64 query rows
    (four), each split one also with the opt-in fused merge (``fused_merge=True``) where it builds
    without spills (:func:`fused_merge_registered`); an fp16 cache with a bf16 query; the bit-trick widening where ``cvt`` is the default;
    prefill for each cache dtype x head dim, and a (K, V) pair in NHD with the LSE and no causal
    mask. Plus :func:`ci_variants` (on SM90: a 99 KB ring)."""
    out: list[KernelConfig] = []
    for t in TARGETS:
        for kv in KV_DTYPES:
            for d in HEAD_DIMS:
                shape: dict[str, Any] = dict(target=t, q_dtype=_q_for(kv), kv_dtype=kv, head_dim=d, page_size=16)
                out += [make_decode_config(group=8, q_len=1, split=s, **shape) for s in (False, True)]
                out.append(make_prefill_config(group=4, **shape))
            out.append(make_decode_config(target=t, q_dtype=_q_for(kv), kv_dtype=kv, head_dim=128, group=16, q_len=4,
                                          page_size=16, split=True))
        out.append(make_decode_config(target=t, q_dtype="bf16", kv_dtype="fp16", head_dim=128, group=8, q_len=1,
                                      page_size=16, split=False))
        if t in CVT_TARGETS:
            out.append(make_decode_config(target=t, q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8,
                                          q_len=1, page_size=16, split=True, widen="bits"))
        out.append(make_prefill_config(target=t, q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=8, page_size=64,
                                       causal=False, write_lse=True, kv_form="pair", kv_layout="NHD"))
    out += ci_variants()
    # the prefill's query staged one load round trip per item, the form before q_loads_first, beside
    # each default prefill (its derived forms below with it)
    out += [replace(c, q_loads_first=False) for c in out if isinstance(c, Sm80PrefillConfig) and c.q_loads_first]
    # and the launch without the one-CTA bound where the plan sets it
    out += [replace(c, one_cta_bound=False) for c in out if isinstance(c, Sm80PrefillConfig) and c.one_cta_bound]
    rows128: list[KernelConfig] = [rows128_form(c) for c in out
                                   if isinstance(c, Sm80PrefillConfig) and c.head_dim <= PREFILL_M2_MAX_HEAD_DIM]
    d256: list[KernelConfig] = [d256_tw32x_form(c) for c in out
                                if isinstance(c, Sm80PrefillConfig) and c.head_dim == 256]
    d128: list[KernelConfig] = [d128_tw64_form(v) for c in out
                                if isinstance(c, Sm80PrefillConfig) and _d128_tw64_registered(c)
                                for v in (c, replace(c, write_lse=True))]
    d128 += [d128_tw64s_form(c) for c in out if isinstance(c, Sm80PrefillConfig) and _d128_tw64s_registered(c)]
    fused: list[KernelConfig] = [replace(c, fused_merge=True) for c in out
                                 if isinstance(c, Sm80DecodeConfig) and c.split and fused_merge_registered(c)]
    four: list[KernelConfig] = [four_warp_form(c) for c in out if isinstance(c, Sm80PrefillConfig) and c.pingpong]
    four += [replace(c, ring_release=False) for c in out if isinstance(c, Sm80PrefillConfig) and c.ring_release]
    # the decode's page ids read with the copies of their own tile, the form before page_prefetch
    old: list[KernelConfig] = [old_form(c) for c in out]
    nopf: list[KernelConfig] = [replace(c, page_prefetch=False) for c in out + old + fused
                                if isinstance(c, Sm80DecodeConfig) and c.page_prefetch]
    # the opt-in output per warp on each target's default prefill of every cache dtype and head dim
    per_warp: list[KernelConfig] = [make_prefill_config(target=t, q_dtype=_q_for(kv), kv_dtype=kv, head_dim=d, group=4,
                                                        page_size=16, warp_store=True)
                                    for t in TARGETS for kv in KV_DTYPES for d in HEAD_DIMS]
    return [c for c in dict.fromkeys(out + old + rows128 + d256 + d128 + fused + four + nopf + per_warp)
            if kernel_id in (None, c.kernel_id)]


def ci_variants(kernel_id: str | None = None) -> list[KernelConfig]:
    """The variants of ``kernel_id`` (both: None) in the representative set the CPU test suite
    compiles per target (the full set is one command away), in the plan's default forms: decode
    with a BF16 cache (split and not, the second as a (K, V) pair in NHD) and with an FP8 cache (the
    target's widening, scale tensors), prefill with an FP8 cache and the LSE (the 64-row default)
    and its 128-row override (16-token stages, unmeasured: asserted spill-free on every target);
    on SM80 also the bit-trick decode at D 64 / 256, a BF16 D 256 prefill and the lean BF16 D 128
    prefill (its default: the ping-pong form); on SM90 the shapes
    SM90 sends here (an fp16 cache with a bf16 query), the bit-trick widening with a ring sized for
    99 KB (run on the H200 as the SM86 build's stand-in), an fp16 D 64 prefill, and old forms (the
    FP8 decode without ``ldsm_xor``, its split with the opt-in fused merge and with the opt-in
    ``kv_first`` (and the lean BF16 D 128 prefill with it, and with the opt-in ``warp_store``), the 64-row BF16
    prefill, the 16-token D 256 prefill); the lean
    prefill with a BF16 cache on SM90 (``PREFILL_D128_TW64S`` in the ping-pong form, the default there) and its
    32-token form (the default before ``PREFILL_D128_TW64S``) with an FP8 cache on SM86; the
    head-dim-256 decode on SM120 (a BF16 split: 28 ``STL`` without ``ldsm_xor``); the lean BF16
    D 256 prefill on SM80 (``PREFILL_D256_W8``), SM90 (``PREFILL_D256_TW32X``, two CTAs per SM),
    SM86 and SM120 (99 KB; 255 registers there); the ``PREFILL_D128_TW64`` override of the lean BF16 D 128 prefill on sm_90a;
    ``PREFILL_D128_TW64S`` (four warps; an override there) of the lean D 128 prefill with a BF16 cache on SM80
    and an FP8 cache on SM86; the lean BF16 D 128 prefill on SM86 and on SM90 with a ring sized for
    sm_86 (``PREFILL_D128_PINGPONG16``, the 99 KB targets' default, and the H200's stand-in for it)."""
    shape: dict[str, Any] = dict(q_dtype="bf16", head_dim=128, page_size=16)
    out: list[KernelConfig] = []
    for t in TARGETS:
        out += [
            make_decode_config(target=t, kv_dtype="bf16", group=8, q_len=1, split=False, **shape),
            make_decode_config(target=t, kv_dtype="bf16", group=4, q_len=2, split=True, kv_form="pair",
                               kv_layout="NHD", **shape),
            make_decode_config(target=t, kv_dtype="fp8_e4m3", group=8, q_len=1, split=True, k_scale_tensor=True,
                               v_scale_tensor=True, **shape),
            make_prefill_config(target=t, kv_dtype="fp8_e4m3", group=4, write_lse=True, **shape),
            make_prefill_config(target=t, kv_dtype="fp8_e4m3", group=4, write_lse=True, m_tiles=2, **shape),
        ]
    sm80: dict[str, Any] = dict(target="sm_80", q_dtype="bf16", kv_dtype="fp8_e4m3", page_size=16, split=False)
    out += [make_decode_config(head_dim=64, group=8, q_len=1, **sm80),
            make_decode_config(head_dim=256, group=16, q_len=4, **sm80),
            make_prefill_config(target="sm_80", q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=8,
                                page_size=64, causal=False),
            make_prefill_config(target="sm_80", q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=4,
                                page_size=16)]
    out += [make_prefill_config(target="sm_90a", kv_dtype="bf16", group=4, **shape),
            make_prefill_config(target="sm_86", kv_dtype="fp8_e4m3", group=4, m_tiles=2, **shape),
            make_prefill_config(target="sm_86", kv_dtype="bf16", group=4, **shape),
            make_prefill_config(target="sm_90a", kv_dtype="bf16", group=4, smem_target="sm_86", **shape)]
    out.append(make_decode_config(target="sm_120a", q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=8, q_len=1,
                                  page_size=16, split=True))
    out += [make_decode_config(target="sm_90a", kv_dtype="fp16", group=4, q_len=1, split=False, **shape),
            make_decode_config(target="sm_90a", kv_dtype="fp8_e4m3", group=8, q_len=1, split=False, widen="bits",
                               smem_target="sm_86", **shape),
            make_prefill_config(target="sm_90a", q_dtype="fp16", kv_dtype="fp16", head_dim=64, group=1,
                                page_size=32),
            make_prefill_config(target="sm_90a", q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=8,
                                page_size=16, tw=16),
            make_decode_config(target="sm_90a", kv_dtype="fp8_e4m3", group=8, q_len=1, split=False, ldsm_xor=False,
                               **shape),
            make_decode_config(target="sm_90a", kv_dtype="fp8_e4m3", group=8, q_len=1, split=True, fused_merge=True,
                               **shape),
            make_decode_config(target="sm_90a", kv_dtype="fp8_e4m3", group=8, q_len=1, split=True, kv_first=True,
                               **shape),
            make_prefill_config(target="sm_90a", kv_dtype="bf16", group=4, kv_first=True, **shape),
            make_prefill_config(target="sm_90a", kv_dtype="bf16", group=4, warp_store=True, **shape),
            make_prefill_config(target="sm_90a", kv_dtype="bf16", group=4, m_tiles=1, **shape)]
    d256: dict[str, Any] = dict(q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=2, page_size=16)
    out += [make_prefill_config(target=t, **d256) for t in ("sm_80", "sm_90a", "sm_86")]
    out.append(make_prefill_config(target="sm_120a", **dict(d256, group=4)))
    out += [make_prefill_config(target=t, kv_dtype="bf16", group=4, **shape, **PREFILL_D128_TW64)
            for t in PREFILL_D128_TW64_TARGETS]
    out += [make_prefill_config(target=t, kv_dtype=kv, group=4, **shape, **PREFILL_D128_TW64S)
            for t, kv in (("sm_80", "bf16"), ("sm_86", "fp8_e4m3"))]
    return [c for c in out if kernel_id in (None, c.kernel_id)]
