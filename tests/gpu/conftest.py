"""GPU tier: skipped without CUDA; run on the H200 (see README). Every test draws fresh random
inputs and poisons outputs with NaN before the call so that unwritten elements fail.

Seeds are stable across processes: the ``gen`` fixture seeds from ``zlib.crc32`` of the test's
node id (``hash()`` of a string changes with every process, so a failure could not be replayed),
and a failing test's report names its seed. ``CUTE_KERNELS_SEED=N`` adds N to every seed (a fresh
draw that still replays)."""

from __future__ import annotations

import os
import zlib

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

SEED_OFFSET = int(os.environ.get("CUTE_KERNELS_SEED", "0"))


def pytest_collection_modifyitems(config, items):
    wants_sanitize = "sanitize" in (config.getoption("markexpr") or "")
    for item in items:
        item.add_marker(pytest.mark.gpu)
        if "sanitize" in item.keywords and not wants_sanitize:  # minutes per run: opt in with -m sanitize
            item.add_marker(pytest.mark.skip(reason="sanitizer tier: run with -m sanitize"))


def stable_seed(*key) -> int:
    """A seed from ``key`` that every process derives alike (plus ``CUTE_KERNELS_SEED``)."""
    return (zlib.crc32(repr(key).encode()) + SEED_OFFSET) % (2**31)


@pytest.fixture
def gen(request):
    seed = stable_seed(request.node.nodeid)
    request.node.user_properties.append(("seed", seed))
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seeds = [v for k, v in item.user_properties if k == "seed"]
    if report.failed and seeds:
        report.sections.append(("seed", f"generator seed {seeds[0]} (zlib.crc32 of the node id + CUTE_KERNELS_SEED="
                                        f"{SEED_OFFSET}): the same command replays it"))


def sm90_only():
    major, minor = torch.cuda.get_device_capability()
    return pytest.mark.skipif((major, minor) != (9, 0), reason="needs an SM90 GPU")


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture
def prefill_kernel_only(monkeypatch):
    """Where ``paged_prefill`` runs its one-time runtime self-check (a kernel the registry lists as
    compile-verified), a family that fails it fails the test instead of being served by the
    reference: the prefill GPU tests verify the kernel."""
    from cute_kernels.ops import paged_prefill as op
    from cute_kernels.plans import selfcheck_records, sm90_prefill

    checked = op.self_check_passes

    def strict(config, device):
        if not checked(config, device):
            fam = sm90_prefill.config_family(config)
            pytest.fail(f"the kernel, not the reference, is under test: {selfcheck_records.describe(fam)}")
        return True

    monkeypatch.setattr(op, "self_check_passes", strict)
