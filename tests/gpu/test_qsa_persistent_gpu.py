"""The persistent per-row QSA launch (opt-in ``persistent``: CTAs looping over the (row, KV head,
split) work items) on the H200: against the reference and bit-equal to one CTA per item.

Its own module so that it compiles only what it runs (``test_qsa_gpu.py`` precompiles its whole
grid first); the inputs and checks are that module's.
"""

from __future__ import annotations

import pytest
import torch

from cute_kernels.ops.qsa_sparse_attention import tuning_override

from .conftest import sm90_only
from .test_qsa_gpu import BF16, FP8, _case, _check, _run

pytestmark = sm90_only()
CTAS = [5, 264]  # 5: ~10 to 30 items per CTA; 264: one item each (two CTAs per SM on an H200)


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    from cute_kernels.jit.parallel import precompile
    from cute_kernels.qsa_warmup import qsa_variants

    configs = []
    for kv in ("bf16", "fp8"):
        shape = dict(head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568, kv_cache_dtype=kv)
        configs += qsa_variants(**shape)
        configs += [c for n in CTAS for c in qsa_variants(**shape, persistent=n)]
    precompile(list(dict.fromkeys(configs)), "sm_90a")


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("ctas", CTAS)
def test_persistent(gen, kv, splits, ctas):
    """Short rows (every third), an inert row inside a CTA's item list, gated direct output and
    split partials with the merge."""
    c = _case(gen, 24, 24, 2, 1568, 6, kv, gate=splits == 1)
    c["packed_indices"][5, -1] = 0
    with tuning_override(splits=splits, persistent=ctas):
        out, ref = _run(c, False)
    _check(out, ref)
    with tuning_override(splits=splits):
        default, _ = _run(c, False)
    assert torch.equal(out, default)  # same tiles in the same order
    assert torch.equal(out[5], torch.zeros_like(out[5]))
