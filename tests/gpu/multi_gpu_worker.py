"""A fresh process for tests/gpu/test_multi_gpu.py (contexts are per process, so their checks need
one that has touched nothing yet). Prints one JSON line on stdout.

``python -m tests.gpu.multi_gpu_worker MODE ...``:

- ``contexts DEVICE [--thread] [--no-guard]``: every op case on ``cuda:DEVICE`` (twice: prepared,
  then cached), the current device left at 0, in the main thread or in a fresh one; reports which
  devices hold a primary context of this process afterwards. ``--no-guard``: the ops' device guard
  replaced by the bare caller (what the DSL's own device switch does alone).
- ``tp RANK START``: one process of a tensor-parallel group: ``AttentionLayer.warmup`` on
  ``cuda:RANK`` at the time START (the others at the same time, one disk cache), then layer steps
  with compiles forbidden, checked against the reference; the current device is never set.
"""

from __future__ import annotations

import json
import sys
import threading
import time


def _contexts() -> list[bool]:
    import torch

    return [bool(torch._C._cuda_hasPrimaryContext(i)) for i in range(torch.cuda.device_count())]


def contexts(device: int, in_thread: bool, no_guard: bool) -> dict:
    import torch

    from cute_kernels.ops import (
        _paged_decode_sm100,
        merge_states,
        paged_decode,
        paged_prefill,
        qsa_sparse_attention,
        quantize_query,
        write_kv_cache,
    )
    from tests.op_cases import moved, op_cases

    if no_guard:
        for module in (_paged_decode_sm100, merge_states, paged_decode, paged_prefill, qsa_sparse_attention,
                       quantize_query, write_kv_cache):
            module.on_device = lambda call, device: call
    before = _contexts()
    cases = [moved(c, torch.device("cuda", device)) for c in op_cases()]  # torch's own work on the device
    after_inputs = _contexts()
    result: dict = {}

    def run():
        try:
            for case in cases:
                for _ in range(2):
                    case.run()
            torch.cuda.synchronize(device)
            result["current_device"] = torch.cuda.current_device()
        except Exception as exc:  # reported, the test fails on it
            result["error"] = f"{type(exc).__name__}: {exc}"

    if in_thread:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    else:
        run()
    return dict(result, before=before, after_inputs=after_inputs, after=_contexts())


def tp(rank: int, start: float) -> dict:
    import torch

    from cute_kernels.jit import compiler
    from dispatch import AttentionLayer
    from tests.cpu.test_layer_dispatch import clone_cache, make_step, reference_step
    from tests.op_cases import step_on

    device = torch.device("cuda", rank)
    layer = AttentionLayer(32, 4, 128, kv_cache_dtype=torch.float8_e4m3fn, page_size=16, k_scale=0.0625,
                           v_scale=0.03125)
    stream = torch.cuda.Stream(device)
    time.sleep(max(0.0, start - time.time()))
    t0 = time.time()
    with torch.cuda.stream(stream):
        configs = layer.warmup(2, 256, device=device, q_lens=(1,))
    warm = time.time() - t0
    errors = []
    with compiler.forbid_compiles(), torch.cuda.stream(stream):
        for i, (ctx, prefill) in enumerate((((100, 37), ((0, 20),)), ((200, 3), ()), ((), ((7, 30),)))):
            step = make_step(decode_ctx=ctx, prefill=prefill, Hq=32, Hkv=4, D=128, page=16,
                             kv_dtype=torch.float8_e4m3fn, device="cpu", generator=torch.Generator().manual_seed(i))
            step = step_on(step, device)
            expected = reference_step(step, clone_cache(step.kv_cache), k_scale=layer.k_scale, v_scale=layer.v_scale)
            out = layer.forward(step.q, step.k, step.v, step.kv_cache, step.metadata)
            err = float(((out.double() - expected.double()).norm() / expected.double().norm()).item())
            if not err <= 5e-3:
                errors.append(f"step {i}: relative error {err:.2e}")
    torch.cuda.synchronize(device)
    return {"rank": rank, "configs": len(configs), "warmup_seconds": round(warm, 1), "errors": errors,
            "stats": dict(compiler.stats), "contexts": _contexts()}


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "contexts":
        out = contexts(int(args[0]), "--thread" in args, "--no-guard" in args)
    elif mode == "tp":
        out = tp(int(args[0]), float(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(out))
