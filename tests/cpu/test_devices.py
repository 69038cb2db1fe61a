"""The ops on a device other than the current one, host side (docs/design/multi-gpu.md); the GPU
half is tests/gpu/test_multi_gpu.py.

- every tensor argument of every op on another device than the query's is refused with an error
  naming it, on the reference path too (here: the meta device next to CPU tensors);
- every op (and the trtllm API, and ``AttentionLayer``) with all its tensors on a device that is
  neither CUDA nor the CPU (meta) names its first tensor and that device (these reached the
  reference and failed inside torch, or returned meta tensors);
- a launch prepared off the current device runs inside torch's device guard (exchange, call,
  restore without creating a context, also when the call raises); one on it runs bare;
- every op's launch key holds the current device (so the guard is decided once per key);
- the capture test and the device rule on CPU tensors; zeroed workspace chunks carved by two
  threads at once never overlap.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from cute_kernels.ops import _device, _torch
from cute_kernels.ops import merge_states as merge_op
from cute_kernels.ops import paged_decode as decode_op
from cute_kernels.ops import paged_prefill as prefill_op
from cute_kernels.ops import qsa_sparse_attention as qsa_op
from cute_kernels.ops import quantize_query as quantize_op
from cute_kernels.ops import write_kv_cache as write_op
from tests.op_cases import move, moved, op_cases

CASES = op_cases()
ARGS = [(case, name) for case in CASES for name in case.args]


@pytest.mark.parametrize("case, name", ARGS, ids=[f"{c.name}:{n}" for c, n in ARGS])
def test_an_argument_on_another_device_is_named(case, name):
    kwargs = case.with_arg(name, move(case.tensor(name), "meta"))
    with pytest.raises((ValueError, TypeError), match=rf"\b{name} must be on cpu( \(the query's device\))?, got meta"):
        case.fn(**kwargs)


# the argument each op's validation checks first (the one whose device the others must share)
_FIRST = {"merge_states": "partial_out", "write_kv_cache": "key", "trtllm": "query"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_tensor_on_a_device_the_ops_do_not_serve_is_named(case):
    first = next((arg for prefix, arg in _FIRST.items() if case.name.startswith(prefix)), "q")
    with pytest.raises(ValueError, match=rf"^{first} must be on a CUDA device or the CPU, got meta$"):
        moved(case, "meta").run()


def test_the_layer_names_a_query_on_a_device_it_does_not_serve():
    from dispatch import AttentionLayer
    from tests.cpu.test_layer_dispatch import make_step
    from tests.op_cases import step_on

    step = step_on(make_step(decode_ctx=(20, 7), prefill=((3, 5),), generator=torch.Generator().manual_seed(4)),
                   "meta")
    for arch in ("sm90", None):  # without arch= it was "the tensors are on meta: pass arch="
        layer = AttentionLayer(8, 2, 64, kv_cache_dtype=torch.float8_e4m3fn, page_size=16, arch=arch)
        with pytest.raises(ValueError, match=r"^q must be on a CUDA device or the CPU, got meta$"):
            layer(step.q, step.k, step.v, step.kv_cache, step.metadata)


def test_the_served_device_rule():
    assert _device.served_device("x", torch.zeros(1)) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^x must be on a CUDA device or the CPU, got meta$"):
        _device.served_device("x", torch.zeros(1, device="meta"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_case_runs_on_the_cpu(case):
    """The cases the device tests move are valid calls (so an error there is the device's)."""
    outputs = case.run()
    assert outputs and all(isinstance(t, torch.Tensor) and t.numel() for t in outputs)


# ---------------------------------------------------------------------------------------------
# the device guard
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def devices(monkeypatch):
    """Current device 0; the guard's exchanges recorded."""
    log = []
    state = {"current": 0}

    def exchange(index):
        log.append(("exchange", index))
        previous, state["current"] = state["current"], index
        return previous

    def maybe_exchange(index):
        log.append(("restore", index))
        previous, state["current"] = state["current"], index
        return previous

    monkeypatch.setattr(_device, "current_device", lambda: state["current"])
    monkeypatch.setattr(_device, "_exchange", exchange)
    monkeypatch.setattr(_device, "_maybe_exchange", maybe_exchange)
    return log, state


def test_a_launch_on_the_current_device_runs_bare(devices):
    def call(*args):
        pass

    assert _device.on_device(call, torch.device("cuda", 0)) is call
    assert _device.on_device(call, torch.device("cpu")) is call
    assert devices[0] == []


def test_a_launch_off_the_current_device_runs_in_the_guard(devices):
    log, state = devices
    seen = []

    def call(*args):
        seen.append((args, state["current"]))
        log.append(("call", args))

    guarded = _device.on_device(call, torch.device("cuda", 1))
    assert guarded is not call and guarded.__wrapped__ is call
    guarded(1, "a")
    assert seen == [((1, "a"), 1)], "the compiled functions must find the tensors' device current"
    assert log == [("exchange", 1), ("call", (1, "a")), ("restore", 0)]
    assert state["current"] == 0


def test_the_guard_restores_when_the_call_raises(devices):
    log, state = devices

    def call(*args):
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        _device.on_device(call, torch.device("cuda", 1))()
    assert log == [("exchange", 1), ("restore", 0)] and state["current"] == 0


class _CudaLike(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the keys' current-device branch, without a GPU."""

    @property
    def is_cuda(self):
        return True


def _key_args(case):
    """``(op module, key arguments)`` of a case, its first tensor viewed as :class:`_CudaLike`."""
    kw = case.kwargs
    if case.fn.__name__ == "paged_decode":
        kv = kw["kv_cache"]
        pair = isinstance(kv, tuple)
        k, v = kv if pair else (kv, kv)
        return decode_op, (kw["q"].as_subclass(_CudaLike), k, v, pair, kw["block_table"], kw["kv_layout"], 1, None,
                           kw["k_scale"], kw["v_scale"], kw["out"], True, kw["num_splits"], True)
    if case.fn.__name__ == "paged_prefill":
        kv = kw["kv_cache"]
        pair = isinstance(kv, tuple)
        return prefill_op, (kw["q"].as_subclass(_CudaLike), kv[0] if pair else kv, pair, kw["block_table"],
                            kw["query_start_loc"], kw["kv_layout"], True, None, None, kw["k_scale"], kw["v_scale"],
                            kw["out"], True)
    if case.fn.__name__ == "merge_states":
        return merge_op, (kw["partial_out"].as_subclass(_CudaLike), kw["partial_lse"], None, kw["out"], kw["out_lse"])
    if case.fn.__name__ == "quantize_query":
        return quantize_op, (kw["q"].as_subclass(_CudaLike), kw["q_scale"], kw["out"], kw["rope"])
    if case.fn.__name__ == "write_kv_cache":
        return write_op, (kw["key"].as_subclass(_CudaLike), kw["value"], kw["kv_cache"], kw["slot_mapping"],
                          kw["kv_layout"], kw["k_scale"], kw["v_scale"])
    return qsa_op, (kw["q"].as_subclass(_CudaLike), kw["k_cache"], kw["v_cache"], kw["packed_indices"],
                    kw["block_table"], kw["token_to_req"], kw["prefill"], kw["k_scale"], kw["v_scale"], kw["out"],
                    kw["output_gate"])


# the ops' own calls (the trtllm calls and the FP8-query decode reach the same keys)
@pytest.mark.parametrize("case", [c for c in CASES if "fp8-query" not in c.name and "trtllm" not in c.name],
                         ids=lambda c: c.name)
def test_every_launch_key_holds_the_current_device(case, monkeypatch):
    module, args = _key_args(case)
    current = {"index": 0}
    monkeypatch.setattr(module, "current_device", lambda: current["index"])
    if hasattr(module, "stream_id"):
        monkeypatch.setattr(module, "stream_id", lambda t: 7)  # no CUDA build here: a fixed stream
    on_0 = module._key(*args)
    current["index"] = 1
    on_1 = module._key(*args)
    assert on_0 != on_1 and module._key(*args) == on_1
    plain = (args[0].as_subclass(torch.Tensor),) + args[1:]  # a CPU tensor: no current-device read
    assert module._key(*plain) == module._key(*plain)


# ---------------------------------------------------------------------------------------------
# the capture test, the device rule, workspaces carved by two threads
# ---------------------------------------------------------------------------------------------


def test_cpu_tensors_are_never_capturing():
    assert _device.capturing(torch.device("cpu")) is False
    assert _device.capturing("meta") is False


def test_the_device_rule_names_a_part_of_a_pair():
    a, b = torch.zeros(2), torch.zeros(2, device="meta")
    _device.check_devices(torch.device("cpu"), x=a, y=None, z=1.0, pair=(a, a))
    with pytest.raises(ValueError, match=re.escape("pair must be on cpu, got meta")):
        _device.check_devices(torch.device("cpu"), x=a, pair=(a, b))


class _YieldingArena(list):
    """A zeroed chunk and its offset that hands the interpreter to the other thread whenever the
    offset is read, so that an unlocked read-then-advance of it interleaves."""

    def __getitem__(self, i):
        value = super().__getitem__(i)
        if i == 1:
            time.sleep(0)
        return value


def test_two_threads_carving_zeroed_workspaces_never_overlap(monkeypatch):
    n = 2000
    arena = _YieldingArena([torch.zeros(2 * n * 64, dtype=torch.int32), 0])
    monkeypatch.setattr(_torch, "_ARENAS", {(torch.device("cpu"), torch.int32): arena})
    views: list[list] = [[], []]

    def carve(k):
        for i in range(n):
            views[k].append(_torch._zeroed(torch.device("cpu"), 1 + (i * 7 + k) % 61, torch.int32, "test"))

    threads = [threading.Thread(target=carve, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = sorted((v.data_ptr(), v.data_ptr() + 4 * v.numel()) for vs in views for v in vs)
    assert len(spans) == 2 * n
    overlaps = [(a, b) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    assert not overlaps, f"{len(overlaps)} workspace views shared between threads"
