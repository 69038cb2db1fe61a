"""Compile matrix: every registered kernel variant compiles on this (GPU-less) machine for each
target it claims, and its PTX/SASS shows the hardware path it claims to use.

The evidence regexes live with each kernel config (``KernelConfig.evidence``); this test only
enforces them, plus: the PTX ``.target`` is the requested arch, and no variant spills registers
to local memory (``STL``/``LDL`` in SASS, when nvdisasm is installed).
"""

from __future__ import annotations

import pytest

from cute_kernels.jit.compiler import COMPILE_TARGETS, nvdisasm_path
from cute_kernels.registry import compile_with_evidence, variants_for

pytestmark = pytest.mark.compile

CASES = [(arch, v) for arch in COMPILE_TARGETS for v in variants_for(arch)]


@pytest.mark.parametrize("arch,config", CASES, ids=[f"{a}-{c.label()}" for a, c in CASES])
def test_variant_compiles_with_evidence(arch, config):
    compiled, ev = compile_with_evidence(config, arch)
    assert ev.ptx_target == arch
    assert not ev.missing, f"{config.label()} on {arch}: PTX lacks {ev.missing}"
    assert all(n > 0 for n in ev.ptx.values())
    if compiled.sass is not None:
        assert "STL" not in ev.sass and "LDL" not in ev.sass, f"register spills: {ev.sass}"


def test_every_target_has_variants():
    for arch in COMPILE_TARGETS:
        assert variants_for(arch), arch


@pytest.mark.skipif(nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")
def test_sass_evidence_of_hopper_probe():
    from cute_kernels.sm90.probe import Sm90ProbeConfig

    _, ev = compile_with_evidence(Sm90ProbeConfig(), "sm_90a")
    assert ev.sass.get("HGMMA", 0) > 0 and ev.sass.get("UTMALDG", 0) > 0, ev.sass


def test_wrong_target_is_refused():
    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.sm90.probe import Sm90ProbeConfig

    with pytest.raises(ValueError, match="does not compile for sm_100a"):
        compile_config(Sm90ProbeConfig(), "sm_100a")
