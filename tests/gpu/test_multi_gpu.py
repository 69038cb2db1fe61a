"""The ops on a device other than the current one, and two GPUs at once (docs/design/multi-gpu.md).

Two GPUs (skipped with fewer, saying so):

- every public op and the trtllm API's calls (tests/op_cases.py) with all tensors on ``cuda:1``
  while ``cuda:0`` is current:
  the same bits as the call on ``cuda:0`` (within the last bits for the reference-served case),
  the launch prepared in the device guard, nothing allocated on ``cuda:0``, the workspaces on
  ``cuda:1``, the current device unchanged; then the cached call, and the call from ``cuda:1``;
- a fresh process that only uses ``cuda:1`` (main thread, or a fresh thread) holds no context on
  ``cuda:0`` after every op ran there twice;
- a capture on ``cuda:1``'s stream is seen from ``cuda:0`` as that device's;
- two threads, one per GPU, each replaying CUDA graphs of layer steps (decode + prefill + cache
  write) and running eager steps, a few hundred iterations with different shapes: every output
  equals the step run alone on ``cuda:0``;
- ``AttentionLayer.warmup`` on both devices of one process, then steps on each compile nothing and
  allocate no workspace; a tensor-parallel group of two processes warming up at once on one disk
  cache.

One GPU: an argument on another device than the query's (the CPU here) is refused naming it,
prepared or cached; the two-thread test with both threads on ``cuda:0`` (two streams). Tensors on
a device other than the current one need a second device: with one GPU there is none.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cute_kernels.jit import compiler
from cute_kernels.ops import _device, _selfcheck
from cute_kernels.ops import paged_decode as decode_op
from cute_kernels.ops import qsa_sparse_attention as qsa_op
from cute_kernels.plans import selfcheck_records
from dispatch import AttentionLayer
from tests.cpu.test_layer_dispatch import clone_cache, make_step, reference_step
from tests.op_cases import FP8, move, moved, op_cases, step_on

from .conftest import rel_err, sm90_only

ROOT = Path(__file__).resolve().parents[2]
NGPU = torch.cuda.device_count()
pytestmark = sm90_only()
two_gpus = pytest.mark.skipif(
    NGPU < 2, reason=f"needs two GPUs (this machine has {NGPU}): tensors on cuda:1 while cuda:0 is current; with "
                     "one GPU no device other than the current one exists")
CASES = op_cases(seed=11)
BF16 = torch.bfloat16


def _ops_launchers():
    from cute_kernels.ops import merge_states, paged_prefill, quantize_query, write_kv_cache

    return [m._launcher for m in (decode_op, paged_prefill, merge_states, quantize_query, write_kv_cache, qsa_op)]


def _guarded_launches(index: int) -> int:
    """How many prepared launches run their compiled functions in the guard of ``cuda:index``."""
    n = 0
    for launcher in _ops_launchers():
        for launch in launcher.launches.values():
            for attr in ("fn", "call", "sm100"):
                caller = getattr(launch, attr, None)
                caller = getattr(caller, "fn", caller) if attr == "sm100" else caller
                n += getattr(caller, "device_index", None) == index
    return n


def _equal(case, got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.device == torch.device("cuda", 1), f"{case.name}: output {i} on {g.device}"
        g, w = g.cpu(), w.cpu()
        if case.exact:
            assert torch.equal(g, w), f"{case.name}: output {i} differs from the call on cuda:0"
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"{case.name}: output {i}")


@two_gpus
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_an_op_on_cuda1_while_cuda0_is_current(case, prefill_kernel_only):
    torch.cuda.set_device(0)
    for launcher in _ops_launchers():  # every key prepared here (the workspaces stay)
        launcher.clear()
    want = moved(case, "cuda:0").run()
    torch.cuda.synchronize(0)
    on1 = moved(case, "cuda:1")
    torch.cuda.synchronize(1)
    workspaces = {id(b): dict(b.buffers) for b in _workspace_owners()}
    allocated0 = torch.cuda.memory_allocated(0)
    guarded = _guarded_launches(1)
    got = on1.run()  # prepared: validation, variant, workspaces, the guarded caller
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert torch.cuda.memory_allocated(0) == allocated0, "the call on cuda:1 allocated on cuda:0"
    _equal(case, got, want)
    launched = "fp8-query" not in case.name  # the reference serves an FP8 query on SM90: no compiled launch
    if launched:
        assert _guarded_launches(1) > guarded, "the launch prepared off the current device runs without the guard"
    for buf in _workspace_owners():  # every workspace a cuda:1 call added lives on cuda:1
        for key, tensor in buf.buffers.items():
            if key not in workspaces[id(buf)]:
                assert key[0] == torch.device("cuda", 1) and tensor.device == key[0], (buf.owner, key)
                assert key[1] == torch.cuda.current_stream(1).cuda_stream, "keyed by another stream than cuda:1's"
    again = moved(case, "cuda:1")  # the same key: the cached launch
    _equal(case, again.run(), want)
    with torch.cuda.device(1):  # from cuda:1 itself: another key, the bare caller
        _equal(case, moved(case, "cuda:1").run(), want)
    torch.cuda.synchronize(1)
    assert torch.cuda.memory_allocated(0) == allocated0


def _workspace_owners():
    from cute_kernels.ops import _paged_decode_sm100

    return [decode_op._workspace, decode_op._counters, qsa_op._workspace, qsa_op._tile_workspace,
            qsa_op._wide_workspace, _paged_decode_sm100._workspace]


def _worker(*args, env=None, timeout=900) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **(env or {})}
    r = subprocess.run([sys.executable, "-m", "tests.gpu.multi_gpu_worker", *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@two_gpus
@pytest.mark.parametrize("thread", [False, True], ids=["main-thread", "fresh-thread"])
def test_a_process_using_cuda1_creates_no_context_on_cuda0(thread):
    """Every op twice on cuda:1 in a fresh process whose current device stays 0 (the variants are
    in the disk cache from the test above): no primary context on cuda:0, whose memory is another
    process's in a tensor-parallel group."""
    res = _worker("contexts", 1, *(["--thread"] if thread else []))
    assert "error" not in res, res["error"]
    assert res["before"] == [False] * NGPU, res
    assert not res["after_inputs"][0], f"torch itself created a context on cuda:0 moving the inputs: {res}"
    assert res["after"][1], res
    assert not res["after"][0], f"a context was created on cuda:0: {res}"


@two_gpus
def test_a_capture_on_cuda1_is_seen_from_cuda0():
    stream = torch.cuda.Stream(1)
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda:1")
    with torch.cuda.graph(graph, stream=stream):
        x.add_(1)
        with torch.cuda.device(0):
            seen = (_device.capturing(torch.device("cuda", 1)), torch.cuda.is_current_stream_capturing())
    assert seen == (True, False), "capturing(cuda:1) must ask cuda:1's stream, not the current device's"


# ---------------------------------------------------------------------------------------------
# an argument on another device (one GPU: the CPU)
# ---------------------------------------------------------------------------------------------

_OTHER = "cuda:0" if NGPU > 1 else "cpu"
_HOME = "cuda:1" if NGPU > 1 else "cuda:0"
_ARGS = [(c, n) for c in CASES for n in c.args]


@pytest.mark.parametrize("case, name", _ARGS, ids=[f"{c.name}:{n}" for c, n in _ARGS])
def test_an_argument_on_another_device_is_named(case, name, prefill_kernel_only):
    on = moved(case, _HOME)
    bad = on.with_arg(name, move(on.tensor(name), _OTHER))
    pattern = rf"\b{name} must be on {re.escape(_HOME)}( \(the query's device\))?, got {re.escape(_OTHER)}"
    with pytest.raises((ValueError, TypeError), match=pattern):
        case.fn(**bad)  # a new key: prepared, validated in full
    on.run()  # the good call caches its launch
    with pytest.raises((ValueError, TypeError), match=pattern):
        case.fn(**on.with_arg(name, move(on.tensor(name), _OTHER)))  # the cached launch refuses it, named


# ---------------------------------------------------------------------------------------------
# two devices at once: a thread per device replaying captured layer steps
# ---------------------------------------------------------------------------------------------

ITERS = 300
# per thread: (layer kwargs, its step shapes): FP8 HND cache on one device, BF16 NHD pair on the other
THREADS = [
    (dict(num_q_heads=32, num_kv_heads=4, head_dim=128, kv_cache_dtype=FP8, page_size=16, k_scale=0.0625,
          v_scale=0.03125),
     dict(Hq=32, Hkv=4, D=128, page=16, kv_dtype=FP8),
     [dict(decode_ctx=(1000, 37, 3), prefill=((0, 50), (200, 17))), dict(decode_ctx=(90, 600), prefill=((31, 1),))]),
    (dict(num_q_heads=16, num_kv_heads=2, head_dim=64, kv_cache_dtype=BF16, page_size=32, kv_layout="NHD"),
     dict(Hq=16, Hkv=2, D=64, page=32, kv_dtype=BF16, kv_layout="NHD", container="tuple"),
     [dict(decode_ctx=(400, 90, 7, 33), prefill=((0, 40),)), dict(decode_ctx=(2000,), prefill=((64, 64), (0, 3)))]),
]
INPUTS = 3  # different q, k, v per step shape, copied into the captured buffers before each replay


def _layer(kw):
    kw = dict(kw)
    return AttentionLayer(kw.pop("num_q_heads"), kw.pop("num_kv_heads"), kw.pop("head_dim"), **kw)


def _thread_setup(k: int, device: str):
    """The thread's layer, its step shapes on ``device`` (each its own cache) and their inputs."""
    layer_kw, shape_kw, shapes = THREADS[k]
    layer = _layer(layer_kw)
    steps, inputs = [], []
    for s, shape in enumerate(shapes):
        step = make_step(**shape, **shape_kw, device="cpu", generator=torch.Generator().manual_seed(100 * k + s))
        steps.append(step_on(step, device))
        g = torch.Generator().manual_seed(1000 * k + s)
        inputs.append([tuple(move((torch.randn(t.shape, generator=g) * 2).to(t.dtype), device)
                             for t in (step.q, step.k, step.v)) for _ in range(INPUTS)])
    return layer, steps, inputs


def _expected(k: int):
    """Each (shape, input) run eagerly on cuda:0 alone, current device 0 (the single-GPU result)."""
    layer, steps, inputs = _thread_setup(k, "cuda:0")
    out = []
    for step, ins in zip(steps, inputs):
        row = []
        for q, kk, v in ins:
            for dst, src in zip((step.q, step.k, step.v), (q, kk, v)):
                dst.copy_(src)
            row.append(layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata).clone())
        out.append(row)
        # the eager result is the layer's: close to the float64 reference
        ref = reference_step(step, clone_cache(step.kv_cache), k_scale=layer.k_scale, v_scale=layer.v_scale)
        assert rel_err(row[-1], ref) <= 5e-3
    torch.cuda.synchronize(0)
    return out


def _two_devices_at_once(devices: tuple[str, str]):
    torch.cuda.set_device(0)
    expected = [_expected(k) for k in range(2)]
    setups, graphs, outs, streams = [], [], [], []
    for k, device in enumerate(devices):
        layer, steps, inputs = _thread_setup(k, device)
        stream = torch.cuda.Stream(torch.device(device))
        kgraphs, kouts = [], []
        for step in steps:  # an eager step on the capturing stream (variants, self-checks, workspaces), then the capture
            with torch.cuda.stream(stream):
                layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                kouts.append(layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata))
            kgraphs.append(graph)
        setups.append((layer, steps, inputs))
        graphs.append(kgraphs)
        outs.append(kouts)
        streams.append(stream)
    failures: list[str] = []

    def run(k: int):
        layer, steps, inputs = setups[k]
        device = torch.device(devices[k])
        want = [[w.to(device) for w in row] for row in expected[k]]
        side, own = streams[k], torch.cuda.current_stream(device)
        try:
            assert torch.cuda.current_device() == 0  # a fresh thread: cuda:0 is current, whatever it runs on
            for it in range(ITERS):
                s, i = it % len(steps), (it // len(steps)) % INPUTS
                step = steps[s]
                if it % 7 == 6:
                    # now and then an eager step on the device's current stream from this thread, whose
                    # current device is cuda:0: on cuda:1 the launches run in the device guard
                    own.wait_stream(side)
                    for dst, src in zip((step.q, step.k, step.v), inputs[s][i]):
                        dst.copy_(src)
                    got = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
                    ok = torch.equal(got, want[s][i])
                    side.wait_stream(own)
                else:  # a replay on the capturing stream (its context makes the stream's device current)
                    with torch.cuda.stream(side):
                        for dst, src in zip((step.q, step.k, step.v), inputs[s][i]):
                            dst.copy_(src)
                        outs[k][s].fill_(float("nan"))
                        graphs[k][s].replay()
                        ok = torch.equal(outs[k][s], want[s][i])
                if not ok:
                    failures.append(f"thread {k} ({device}), iteration {it}, shape {s}, input {i}")
                    return
        except Exception as exc:
            failures.append(f"thread {k} ({device}): {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize(0)
    if NGPU > 1:
        torch.cuda.synchronize(1)
    assert not failures, failures


@two_gpus
def test_two_gpus_at_once_replay_layer_steps(prefill_kernel_only):
    _two_devices_at_once(("cuda:0", "cuda:1"))


def test_two_threads_on_one_gpu_replay_layer_steps(prefill_kernel_only):
    """The single-GPU part of the test above: both threads on cuda:0, each on its own stream."""
    _two_devices_at_once(("cuda:0", "cuda:0"))


# ---------------------------------------------------------------------------------------------
# warm-up per device of a tensor-parallel group
# ---------------------------------------------------------------------------------------------


@two_gpus
def test_layer_warmup_on_each_device_of_one_process(prefill_kernel_only, monkeypatch):
    import dataclasses

    from cute_kernels.plans import sm90_prefill
    from cute_kernels.registry import KERNELS

    # sm90.prefill is available (verified on the H200): listed compile-verified again here, the
    # warm-up runs its self-check, which must run and be recorded on each device
    monkeypatch.setitem(KERNELS, "sm90.prefill", dataclasses.replace(KERNELS["sm90.prefill"],
                                                                     status="compile-verified",
                                                                     family=sm90_prefill.family))
    torch.cuda.set_device(0)
    layer = _layer(THREADS[0][0])
    streams = {d: torch.cuda.Stream(d) for d in (0, 1)}
    for d, stream in streams.items():  # on the stream that will run the steps (its context makes d current)
        with torch.cuda.stream(stream):
            configs = layer.warmup(4, 512, device=torch.device("cuda", d), q_lens=(1,))
    assert any(c.kernel_id == "sm90.prefill" for c in configs)
    fam = next(c for c in configs if c.kernel_id == "sm90.prefill")
    family = sm90_prefill.family(fam.q_dtype, fam.kv_dtype, fam.head_dim)
    for d in (0, 1):  # the prefill self-check ran on each device, recorded per device
        rec = selfcheck_records.in_process(family, _selfcheck.device_name(torch.device("cuda", d)))
        assert rec is not None and rec.ok, (d, rec)
    reserved = {k: (b.data_ptr(), b.numel()) for buf in (decode_op._workspace, decode_op._counters)
                for k, b in buf.buffers.items()}
    for d, stream in streams.items():
        key = (torch.device("cuda", d), stream.cuda_stream)
        assert key in reserved and decode_op._workspace.buffers[key].device == key[0]
    with compiler.forbid_compiles():
        for d, stream in streams.items():
            with torch.cuda.stream(stream):
                for i, ctx in enumerate(((100, 37), (480, 3, 16, 90))):  # the step adds a column: <= 512 - 16
                    step = step_on(make_step(decode_ctx=ctx, prefill=((0, 20),), Hq=32, Hkv=4, D=128, page=16,
                                             kv_dtype=FP8, device="cpu", generator=torch.Generator().manual_seed(i)),
                                   f"cuda:{d}")
                    expected = reference_step(step, clone_cache(step.kv_cache), k_scale=layer.k_scale,
                                              v_scale=layer.v_scale)
                    out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
                    assert rel_err(out, expected) <= 5e-3, (d, i)
    after = {k: (b.data_ptr(), b.numel()) for buf in (decode_op._workspace, decode_op._counters)
             for k, b in buf.buffers.items()}
    assert after == reserved, "a step allocated a decode workspace its device's warm-up should have reserved"


@two_gpus
def test_tensor_parallel_group_warms_up_at_once_on_one_disk_cache(tmp_path):
    """Two processes, one per GPU, warm the same layer at the same time from an empty disk cache:
    both serve correct steps, every variant is one whole object file."""
    start = time.time() + 20.0  # both processes imported and waiting
    env = {"CUTE_KERNELS_CACHE_DIR": str(tmp_path)}
    results: list = [None, None]

    def run(rank):
        results[rank] = _worker("tp", rank, start, env=env, timeout=1800)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results), results
    for r in results:
        assert not r["errors"], r
    assert results[0]["configs"] == results[1]["configs"]
    objects = list(tmp_path.rglob("*.o"))
    assert len(objects) == results[0]["configs"], (len(objects), results)
    assert not list(tmp_path.rglob("*.tmp")), "a temporary file was left"
