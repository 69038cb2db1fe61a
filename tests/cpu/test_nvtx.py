"""NVTX ranges: the name is exactly ``cute_kernels.<op>`` (what ``ncu --nvtx-include`` matches),
the shapes ride in a range nested inside it, and nothing is pushed when ranges are off."""

from __future__ import annotations

import re

import pytest
import torch

import cute_kernels
import cute_kernels._nvtx as nv


class FakeNvtx:
    """Records push/pop calls and keeps the per-thread stack the way Nsight tools see it."""

    def __init__(self):
        self.events: list[tuple[str, str | None]] = []
        self.stack: list[str] = []
        self.stacks_seen: list[tuple[str, ...]] = []

    def push_range(self, message=None, color=None, domain=None, category=None, payload=None):
        assert domain is None, "ranges live in the default domain: --nvtx-include needs no 'domain@'"
        self.events.append(("push", message))
        self.stack.append(message)
        self.stacks_seen.append(tuple(self.stack))

    def pop_range(self, domain=None):
        self.events.append(("pop", None))
        self.stack.pop()


def matches_push_pop_include(pattern: str, stack: tuple[str, ...]) -> bool:
    """Nsight Compute's ``--nvtx-include "A/"`` rule for one push/pop range of the default domain:
    a kernel matches when a range of the thread's stack is named exactly ``A``."""
    assert pattern.endswith("/") and "@" not in pattern and "/" not in pattern[:-1]
    return pattern[:-1] in stack


@pytest.fixture
def fake_nvtx(monkeypatch):
    fake = FakeNvtx()
    monkeypatch.setattr(nv, "_nvtx", fake)
    monkeypatch.setattr(nv, "ENABLED", True)
    return fake


def test_range_name_is_exactly_the_op(fake_nvtx):
    q = torch.empty(8, 32, 128, dtype=torch.bfloat16)
    with nv.op_range("paged_decode", q=q, out=None, num_splits=4):
        assert fake_nvtx.stack == ["cute_kernels.paged_decode", "q=bfloat16[8,32,128] num_splits=4"]
    assert fake_nvtx.stack == []
    assert fake_nvtx.events[-2:] == [("pop", None), ("pop", None)]
    assert nv.range_name("paged_decode") == "cute_kernels.paged_decode"


def test_include_pattern_selects_the_op_and_no_other(fake_nvtx):
    with nv.op_range("paged_decode", q=torch.empty(2, 4, 64)):
        pass
    with nv.op_range("merge_states", partial_out=torch.empty(3, 2, 4, 64)):
        pass
    innermost = [s for s in fake_nvtx.stacks_seen if len(s) == 2]
    assert len(innermost) == 2
    decode, merge = innermost
    assert matches_push_pop_include("cute_kernels.paged_decode/", decode)
    assert not matches_push_pop_include("cute_kernels.paged_decode/", merge)
    assert matches_push_pop_include("cute_kernels.merge_states/", merge)
    # the previous form put shapes into the name: only a regex could select it
    assert not re.search(r"\s", decode[0])


def test_ranges_stay_balanced_when_the_call_raises(fake_nvtx):
    with pytest.raises(RuntimeError), nv.op_range("write_kv_cache", key=torch.empty(1, 2, 64)):
        raise RuntimeError("refused")
    assert fake_nvtx.stack == []


def test_public_op_opens_its_range(fake_nvtx):
    """merge_states on CPU tensors runs the reference inside its range."""
    g = torch.Generator().manual_seed(7)
    part_out = torch.randn(3, 2, 4, 64, generator=g)
    part_lse = torch.randn(3, 2, 4, generator=g)
    cute_kernels.merge_states(part_out, part_lse)
    assert fake_nvtx.stacks_seen[0] == ("cute_kernels.merge_states",)
    assert fake_nvtx.stacks_seen[1][0] == "cute_kernels.merge_states"
    assert "partial_out=float32[3,2,4,64]" in fake_nvtx.stacks_seen[1][1]
    assert fake_nvtx.stack == []


def test_nothing_is_pushed_when_off(monkeypatch):
    fake = FakeNvtx()
    monkeypatch.setattr(nv, "_nvtx", fake)
    monkeypatch.setattr(nv, "ENABLED", False)
    assert nv.op_range("paged_decode", q=torch.empty(1)) is nv.NULL_RANGE
    with nv.op_range("paged_decode", q=torch.empty(1)):
        pass
    assert fake.events == []


def test_real_nvtx_module_accepts_the_calls(monkeypatch):
    """The installed nvtx package takes the keyword form used here (a no-op without a profiler)."""
    nvtx = pytest.importorskip("nvtx")
    monkeypatch.setattr(nv, "_nvtx", nvtx)
    monkeypatch.setattr(nv, "ENABLED", True)
    with nv.op_range("quantize_query", q=torch.empty(4, 8, 128, dtype=torch.float16)):
        pass


def test_bound_caller_opens_the_range_around_its_steps(fake_nvtx):
    """The launcher puts the range into the caller it generates: the steps run inside
    ``cute_kernels.<op>``, the call's parameters described in the nested range."""
    from cute_kernels.jit.spec import ScalarArg, TensorArg
    from cute_kernels.ops._launch import Launcher, bind

    seen = []

    def kernel(*args):
        seen.append((tuple(fake_nvtx.stack), args))

    signature = (TensorArg("x", "fp32", ("N",)), ScalarArg("alpha", "fp32"))
    launcher = Launcher(lambda x, alpha: None, lambda x, alpha: None, op="merge_states")
    call = launcher.bind(("x", "alpha"), (kernel, signature, None, None))
    x = torch.empty(5)
    call(x, 0.5)
    (stack, args), = seen
    assert stack == ("cute_kernels.merge_states", "x=float32[5] alpha=0.5")
    assert args == (x, 0.5) and fake_nvtx.stack == []
    # no op name (or ranges off): the same caller without a range
    seen.clear()
    bind(("x", "alpha"), (kernel, signature, None, None))(x, 0.5)
    assert seen[0][0] == ()


def test_refused_call_leaves_the_ranges_balanced(fake_nvtx):
    from cute_kernels.jit.spec import TensorArg
    from cute_kernels.ops._launch import bind

    def kernel(x):
        raise ValueError("refused")

    call = bind(("x",), (kernel, (TensorArg("x", "fp32", ("N",)),), None, None), op="paged_decode")
    with pytest.raises(ValueError):
        call(torch.empty(2))
    assert fake_nvtx.stack == []


def test_every_op_launcher_is_named_after_its_op():
    import importlib

    from cute_kernels.registry import OPS

    for name, (module, _) in OPS.items():
        if module.startswith("cute_kernels.ops."):
            assert importlib.import_module(module)._launcher.op == name


def test_layer_step_is_one_range_with_the_ops_inside(fake_nvtx):
    """AttentionLayer.forward: ``cute_kernels.layer`` around the step, each op's range inside it."""
    from dispatch import AttentionLayer

    from .test_layer_dispatch import make_step

    st = make_step(decode_ctx=(20, 3), generator=torch.Generator().manual_seed(5))
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype="fp8", page_size=16, arch="sm90")
    layer(st.q, st.k, st.v, st.kv_cache, st.metadata)
    assert fake_nvtx.stack == []
    assert fake_nvtx.stacks_seen[0] == ("cute_kernels.layer",)
    inner = {s[2] for s in fake_nvtx.stacks_seen if len(s) >= 3}
    assert {"cute_kernels.write_kv_cache", "cute_kernels.paged_decode"} <= inner
    assert all(s[0] == "cute_kernels.layer" for s in fake_nvtx.stacks_seen)


def test_every_op_launch_is_bound_by_its_launcher():
    """Each launch an op prepares (the portable ``sm80.*`` routes and a split launch's merge step
    included) is generated by the op's launcher, so it runs in ``cute_kernels.<op>``; the SM100
    decode helper binds without an op because paged_decode wraps its run in the launcher's range."""
    import re
    from pathlib import Path

    import cute_kernels.ops as ops_pkg

    bare = re.compile(r"(?<![\w.])bind\(")
    wrapped_by_caller = {"_paged_decode_sm100.py", "_launch.py"}
    for path in sorted(Path(ops_pkg.__file__).parent.glob("*.py")):
        if path.name in wrapped_by_caller:
            continue
        lines = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if bare.search(line)]
        assert lines == [], f"{path.name}: bind() without the op's launcher at lines {lines}"
    decode = (Path(ops_pkg.__file__).parent / "paged_decode.py").read_text()
    assert "with _launcher.range(" in decode  # the SM100 run, in the op's range
