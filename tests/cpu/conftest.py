"""The CPU tests plan and run as on a fresh machine: a compile-verified kernel's runtime self-check
records (:mod:`cute_kernels.plans.selfcheck_records`, read by the dispatcher) and compiled
variants on disk go to each test's own folder, never to the user's cache, and no record outlives
its test in the process.

``sm90_compile_verified``: the SM90 prefill kernels, the window / sink variants of the SM90
prefill and decode, the decode's balanced schedule and the prefill's persistent schedule and
shared-memory epilogue are available (verified by the GPU suite on the H200), so their ops run no
self-check; a test of the self-check machinery itself lists them as compile-verified again, with
the families they had, so that the check, its records and the dispatcher's reasons run for real.
"""

from __future__ import annotations

import dataclasses

import pytest

from cute_kernels.plans import selfcheck_records, sm90_decode, sm90_prefill
from cute_kernels.registry import KERNELS


@pytest.fixture(autouse=True)
def _fresh_machine_records(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path / "cute_kernels"))
    selfcheck_records.forget()
    yield
    selfcheck_records.forget()


def _prefill_features_family(q_dtype: str, kv_dtype: str, head_dim: int) -> str:
    return f"{sm90_prefill.family(q_dtype, kv_dtype, head_dim)}/window+sinks"


def _decode_features_family(q_dtype: str, kv_dtype: str, head_dim: int) -> str:
    return f"sm90.decode/window+sinks/{sm90_decode._mma_path(kv_dtype)}"


def _decode_balanced_family(q_dtype: str, kv_dtype: str, head_dim: int) -> str:
    return f"sm90.decode/balanced/{sm90_decode._mma_path(kv_dtype)}"


def _prefill_persistent_family(q_dtype: str, kv_dtype: str, head_dim: int) -> str:
    return f"{sm90_prefill.family(q_dtype, kv_dtype, head_dim)}/persistent"


def _prefill_epilogue_family(q_dtype: str, kv_dtype: str, head_dim: int) -> str:
    return f"{sm90_prefill.family(q_dtype, kv_dtype, head_dim)}/smem_epilogue"


def _prefill_vt_words_family(q_dtype: str, kv_dtype: str, head_dim: int) -> str:
    return f"{sm90_prefill.family(q_dtype, kv_dtype, head_dim)}/vt_words"


# the registry families the SM90 entries take when listed as compile-verified (what the dispatcher asks)
SM90_FAMILIES = {
    "sm90.prefill": sm90_prefill.family,
    "sm90.prefill_fp8q": sm90_prefill.family,
    sm90_prefill.FEATURES_ID: _prefill_features_family,
    sm90_decode.FEATURES_ID: _decode_features_family,
    sm90_decode.BALANCED_ID: _decode_balanced_family,
    sm90_prefill.PERSISTENT_ID: _prefill_persistent_family,
    sm90_prefill.EPILOGUE_ID: _prefill_epilogue_family,
    sm90_prefill.VT_WORDS_ID: _prefill_vt_words_family,
}


@pytest.fixture
def sm90_compile_verified(monkeypatch):
    """Lists the SM90 entries of :data:`SM90_FAMILIES` as compile-verified for the test (their
    self-checks run before the first launch)."""
    for kid, family in SM90_FAMILIES.items():
        assert KERNELS[kid].status == "available", kid
        monkeypatch.setitem(KERNELS, kid, dataclasses.replace(KERNELS[kid], status="compile-verified", family=family))
