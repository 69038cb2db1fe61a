"""The SM90 prefill's opt-in shared-memory epilogue (``epilogue="smem"``) on the host: the config
field leaves every default label (and so its PTX digest key) unchanged, refuses what the kernel
does not compile, names its self-check family and registry entry (available: verified by the GPU
suite on the H200), and the op reaches it through ``tuning_override``.
Design: docs/design/sm90-prefill.md#epilogue-through-shared-memory-opt-in-epiloguesmem."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cute_kernels.plans import sm90_prefill as plan

from .conftest import SM90_FAMILIES
from .test_prefill_host import fake_gpu  # noqa: F401  (the fixture)

KW = dict(q_dtype="bf16", kv_dtype="bf16", head_dim=128, group=8, page_size=16)


def test_field_default_keeps_labels_and_evidence():
    default = plan.make_prefill_config(**KW)
    smem = plan.make_prefill_config(**KW, epilogue="smem")
    assert default.epilogue == "registers" and "epilogue" not in default.label()
    assert smem.label().endswith(",epilogue=smem]")
    assert smem.signature() == default.signature()  # same call arguments
    names = [n for n, _ in smem.evidence["sm_90a"]]
    assert "O in 16-byte stores" in names and "O in 16-byte stores" not in [n for n, _ in default.evidence["sm_90a"]]


def test_family_and_registry_id():
    smem = plan.make_prefill_config(**KW, epilogue="smem")
    assert plan.check_registry_id(smem) == plan.EPILOGUE_ID
    assert plan.config_family(smem) == SM90_FAMILIES[plan.EPILOGUE_ID]("bf16", "bf16", 128) == \
        "sm90.prefill/16/d128/smem_epilogue"
    both = plan.make_prefill_config(**KW, epilogue="smem", window=True, sinks=True)
    assert plan.check_registry_id(both) == plan.EPILOGUE_ID  # the epilogue's entry decides on a check
    assert plan.config_family(both) == "sm90.prefill/16/d128/window+sinks+smem_epilogue"


def test_refusals():
    with pytest.raises(ValueError, match="epilogue must be one of"):
        plan.make_prefill_config(**KW, epilogue="tma")
    with pytest.raises(ValueError, match="persistent"):
        plan.make_prefill_config(**KW, epilogue="smem", persistent=True)
    # an FP8 query's O tile (64 x D x 2 bytes) takes a K or V stage buffer of stages x tile_n x D bytes
    fp8 = dict(q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", head_dim=128, group=8, page_size=16)
    with pytest.raises(ValueError, match="stages \\* tile_n"):
        plan.make_prefill_config(**fp8, epilogue="smem", stages=1, tile_n=64)
    assert plan.make_prefill_config(**fp8, epilogue="smem", stages=1, tile_n=128).epilogue == "smem"


def test_shared_memory_unchanged():
    """The O tiles reuse buffers that are free by the epilogue: no shared memory is added."""
    for v in plan.epilogue_variants():
        assert plan.smem_bytes(v) == plan.smem_bytes(replace(v, epilogue="registers"))
        if v.kind == "fp8":  # K and V stage buffers each hold one warpgroup's 64 x D 16-bit tile
            assert v.stages * v.tile_n * v.head_dim >= plan.hw.WGMMA_M * v.head_dim * 2
        else:  # a 16-bit (or narrowed fp16) query half holds the warpgroup's 64 x D tile
            assert v.mma_dtype in ("bf16", "fp16")


def test_registry_lists_the_epilogue_variants_available():
    from cute_kernels.registry import KERNELS

    info = KERNELS[plan.EPILOGUE_ID]
    assert info.status == "available" and info.call_site is None and info.op == "paged_prefill"
    assert info.family is None and not info.verified  # run on its own hardware: no self-check family, no note
    variants = info.variants()
    assert variants and all(v.epilogue == "smem" for v in variants)
    assert {v.kind for v in variants} == {"16", "widen", "fp8"}
    assert {v.head_dim for v in variants} == {64, 128, 256}
    for v in variants:  # each at the default tiling of its kind and head dim
        base = plan.make_prefill_config(q_dtype=v.q_dtype, kv_dtype=v.kv_dtype, head_dim=v.head_dim, group=v.group,
                                        page_size=v.page_size)
        assert (v.tile_n, v.stages, v.staging, v.producer_regs, v.consumer_regs) == (
            base.tile_n, base.stages, base.staging, base.producer_regs, base.consumer_regs)
    assert all(plan.check_registry_id(v) == info.id for v in variants)


def test_the_op_reaches_it_through_tuning_override(fake_gpu, monkeypatch):  # noqa: F811  (the fixture)
    """``tuning_override(epilogue="smem")`` launches the variant past the op's self-check gate
    (stubbed here; the gate itself: tests/cpu/test_prefill_selfcheck.py); a family that fails the
    check keeps the register epilogue."""
    from cute_kernels.ops import paged_prefill as op

    from .test_prefill_host import _args, _kw, _problem

    calls, _ = fake_gpu
    p = _problem(("epilogue",), kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16)
    with op.tuning_override(epilogue="smem"):
        op.paged_prefill(*_args(p), **_kw(p))
    assert calls[-1][0].epilogue == "smem"
    checked = []

    def fails_smem(config, device):
        checked.append(plan.config_family(config))
        return config.epilogue != "smem"

    monkeypatch.setattr(op, "self_check_passes", fails_smem)
    op._cache.entries.clear()
    with op.tuning_override(epilogue="smem"):
        op.paged_prefill(*_args(p), **_kw(p))
    assert calls[-1][0].epilogue == "registers"
    assert checked[0] == "sm90.prefill/16/d64/smem_epilogue"
    with pytest.raises(ValueError, match="epilogue must be one of"):
        with op.tuning_override(epilogue="tma"):
            op.paged_prefill(*_args(p), **_kw(p))
