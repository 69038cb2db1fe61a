"""The SM100 tcgen05 probe compiles for sm_100a on a GPU-less machine and uses the hardware it claims.

PTX evidence comes from the config itself (tcgen05.mma, tcgen05.alloc, TMA); the SASS check
(needs nvdisasm) confirms that ptxas kept them as tensor-core MMAs (UTCHMMA, or UTCQMMA for
fp8 kinds) and TMA loads (UTMALDG).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

from cute_kernels.jit.compiler import compile_config  # noqa: E402
from cute_kernels.plans.probes import Sm100ProbeConfig  # noqa: E402

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def compiled():
    return compile_config(Sm100ProbeConfig(), "sm_100a", artifacts=True)


def test_ptx_targets_sm100a_with_evidence(compiled):
    ptx = compiled.ptx
    assert ptx, "PTX was not kept"
    assert re.search(r"^\s*\.target\s+sm_100a\b", ptx, re.M), "PTX is not for sm_100a"
    for _, pattern in Sm100ProbeConfig.evidence["sm_100a"]:
        assert re.search(pattern, ptx), f"PTX lacks {pattern!r}"


def test_sass_has_tensor_core_mma_and_tma(compiled):
    if compiled.sass is None:
        pytest.skip("no nvdisasm: SASS not available")
    assert re.search(r"\bUTC[HQ]MMA\b", compiled.sass), "no tcgen05 MMA (UTCHMMA/UTCQMMA) in SASS"
    assert re.search(r"\bUTMALDG\b", compiled.sass), "no TMA load (UTMALDG) in SASS"


def test_rejects_non_target_arch():
    with pytest.raises(ValueError):
        compile_config(Sm100ProbeConfig(), "sm_90a")


@pytest.mark.parametrize("kwargs", [{"n": 48}, {"n": 512}, {"k": 32}, {"k": 0}])
def test_rejects_bad_shapes(kwargs):
    with pytest.raises(ValueError):
        Sm100ProbeConfig(**kwargs)
