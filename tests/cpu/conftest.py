"""The CPU tests plan and run as on a fresh machine: a compile-verified kernel's runtime self-check
records (:mod:`cute_kernels.plans.selfcheck_records`, read by the dispatcher) and compiled
variants on disk go to each test's own folder, never to the user's cache, and no record outlives
its test in the process."""

from __future__ import annotations

import pytest

from cute_kernels.plans import selfcheck_records


@pytest.fixture(autouse=True)
def _fresh_machine_records(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path / "cute_kernels"))
    selfcheck_records.forget()
    yield
    selfcheck_records.forget()
