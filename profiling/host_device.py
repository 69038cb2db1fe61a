"""Host cost of the multi-GPU device handling (docs/design/multi-gpu.md#the-device-guard): what the
launch keys pay to hold the current device, against the whole key, and what a launch off the
current device pays for torch's device guard.

Per call, best and median of interleaved rounds (so a noisy host slows every item alike):
``floor`` (an empty lambda: the loop), ``is_cuda``, ``current_device`` (the C function the keys
call; on a torch build without CUDA a no-argument ``torch._C`` function of the same binding kind
stands in, without the ``cudaGetDevice`` inside), ``key_read`` (the key's whole expression),
``decode_key`` (``paged_decode``'s launch key on a tiny problem). With two GPUs also
``guard`` (a no-op caller wrapped by ``on_device`` for the other device) against ``bare`` (the
same caller unwrapped) and torch's ``with torch.cuda.device(i)``.

``python -m profiling.host_device [--json PATH] [--rounds 15] [--calls 50000]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from cute_kernels.ops import _device
from cute_kernels.ops.paged_decode import _key


def _timer(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(rounds: int, calls: int) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    q = torch.randn(1, 32, 128, device=device).to(torch.bfloat16)
    kv = torch.zeros(20, 2, 8, 16, 128, dtype=torch.bfloat16, device=device)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    key_args = (q, kv, kv, False, bt, "HND", 1, None, 1.0, 1.0, out, False, 1, True)
    read = _device.current_device if cuda else torch._C._get_cudnn_enabled
    items = {
        "floor": lambda: None,
        "is_cuda": lambda: q.is_cuda,
        "current_device": read,
        "key_read": lambda: read() if q.is_cuda or not cuda else -1,
        "decode_key": lambda: _key(*key_args),
    }
    if cuda and torch.cuda.device_count() > 1:
        other = (device.index + 1) % torch.cuda.device_count()
        torch.empty(1, device=f"cuda:{other}")  # its context exists (a guard into it then costs no setup)

        def bare(*args):
            return None

        guarded = _device.on_device(bare, torch.device("cuda", other))

        def torch_guard():
            with torch.cuda.device(other):
                pass

        items.update(bare=lambda: bare(1, 2), guard=lambda: guarded(1, 2), torch_device_guard=torch_guard)
    samples: dict[str, list[float]] = {k: [] for k in items}
    for _ in range(rounds):
        for name, fn in items.items():
            samples[name].append(_timer(fn, calls))
    return {
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": cuda, "devices": torch.cuda.device_count() if cuda else 0, "rounds": rounds, "calls": calls,
        "current_device_is": "torch._C._cuda_getDevice" if cuda else "torch._C._get_cudnn_enabled (stand-in)",
        "us": {k: {"best": round(min(v), 4), "median": round(statistics.median(v), 4)} for k, v in samples.items()},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=50000)
    args = ap.parse_args(argv)
    res = measure(args.rounds, args.calls)
    for name, v in res["us"].items():
        print(f"{name:20s} best {v['best']:.4f} us   median {v['median']:.4f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
