"""The ops on a device other than the current one (docs/design/multi-gpu.md).

A compiled function launches on its tensors' device by itself: TVM-FFI ties every tensor to one
device index, takes that device's current torch stream, and the DSL's entry switches to the device
with ``cudaSetDevice`` when it is not the current one and back afterwards. That restore
initializes a primary context on the previous device when it had none (CUDA 12 semantics of
``cudaSetDevice``), hundreds of MB of another GPU's memory. So an op whose tensors are not on the
current device runs its compiled functions inside torch's device guard (:func:`on_device`), whose
restore leaves a device without a context alone; the DSL then finds its device current and
switches nothing. Whether a launch needs the guard is decided once per launch key: the ops' keys
hold :func:`current_device` (one C call) for CUDA tensors.

Also here: the device rules of the validation (:func:`served_device`, :func:`check_devices`,
errors naming the argument) and the capture test of a given device's stream (:func:`capturing`).
"""

from __future__ import annotations

from typing import Any

import torch

# The current CUDA device as an int: the C function itself (no Python frame); -1 on a torch build
# without CUDA. Call it for CUDA tensors only: on a CUDA build it would initialize CUDA otherwise.
current_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: -1)
_exchange = getattr(torch._C, "_cuda_exchangeDevice", None)  # sets the device, returns the previous
# restores a device only when it has a primary context (else records it for later): never creates one
_maybe_exchange = getattr(torch._C, "_cuda_maybeExchangeDevice", None)


def on_device(call, device):
    """``call`` itself when ``device`` is the current CUDA device (or not a CUDA device), else
    ``call`` inside torch's device guard. Built once per launch key (the key holds the current
    device), so a call on the current device pays nothing."""
    index = device.index if device.type == "cuda" else None
    if index is None or index == current_device():
        return call
    return _guarded(call, index, _exchange, _maybe_exchange)


def _guarded(call, index: int, exchange, maybe_exchange):
    def run(*args):
        previous = exchange(index)
        try:
            call(*args)
        finally:
            maybe_exchange(previous)

    guarded: Any = run  # a function carrying what it wraps, for inspection
    guarded.__wrapped__ = call
    guarded.device_index = index
    return guarded


def capturing(device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph.
    ``torch.cuda.is_current_stream_capturing()`` asks about the current device's stream, which is
    another stream when the tensors live elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if device.index is None or device.index == current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device.index):
        return torch.cuda.is_current_stream_capturing()


#: the device types an op serves: CUDA (the kernels) and the CPU (the reference)
SERVED_DEVICE_TYPES = ("cuda", "cpu")


def served_device(name: str, t) -> torch.device:
    """The device of tensor argument ``name``, one an op serves; else ``ValueError`` naming it. A
    tensor elsewhere (meta, another backend) would reach the reference and fail inside torch. Run by
    the validation only (the reference path, or a CUDA call's first keying), never a cached launch."""
    device = t.device
    if device.type not in SERVED_DEVICE_TYPES:
        raise ValueError(f"{name} must be on a CUDA device or the CPU, got {device}")
    return device


def check_devices(device, **tensors) -> None:
    """Every tensor given (None and non-tensors skipped, a tuple's parts each) is on ``device``;
    else ``ValueError`` naming the first that is not."""
    for name, t in tensors.items():
        parts = t if isinstance(t, (tuple, list)) else (t,)
        for part in parts:
            if isinstance(part, torch.Tensor) and part.device != device:
                raise ValueError(f"{name} must be on {device}, got {part.device}")
