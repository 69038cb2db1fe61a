"""GPU tier: skipped without CUDA; run on the H200 (see README). Every test draws fresh random
inputs (seeded per test for reproducibility of failures, different across tests) and poisons
outputs with NaN before the call so that unwritten elements fail."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.gpu)


@pytest.fixture
def gen(request):
    g = torch.Generator(device="cuda")
    g.manual_seed(abs(hash(request.node.nodeid)) % (2**31))
    return g


def sm90_only():
    major, minor = torch.cuda.get_device_capability()
    return pytest.mark.skipif((major, minor) != (9, 0), reason="needs an SM90 GPU")


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture
def prefill_kernel_only(monkeypatch):
    """``paged_prefill`` still runs its one-time runtime self-check, but a family that fails it fails
    the test instead of being served by the reference: the prefill GPU tests verify the kernel."""
    from cute_kernels.ops import paged_prefill as op
    from cute_kernels.plans import selfcheck_records, sm90_prefill

    checked = op.self_check_passes

    def strict(config, device):
        if not checked(config, device):
            fam = sm90_prefill.family(config.q_dtype, config.kv_dtype, config.head_dim)
            pytest.fail(f"the kernel, not the reference, is under test: {selfcheck_records.describe(fam)}")
        return True

    monkeypatch.setattr(op, "self_check_passes", strict)
