"""A caller-owned workspace (FlashInfer's ``workspace_buffer``): the ops' split partials, unused
LSE targets and merge counters carved out of the caller's memory instead of the ops' own buffers.

The buffer is any contiguous CUDA tensor (FlashInfer's callers pass ``uint8``/``int8``); it is read
as raw bytes: the int32 counters first (zeroed once when a launch is prepared; the kernels leave
them zero after every launch, as FlashInfer's trtllm-gen kernels do with theirs), then the fp32
area, each at a 256-byte boundary. A launch binds its views once, keyed by the buffer's address
and size, so a caller keeps one buffer for all its calls (as with FlashInfer) and must not write
into it between them. Design: docs/design/trtllm.md#workspace.
"""

from __future__ import annotations

import torch

ALIGN = 256  # bytes: every carved area starts at a multiple (16-byte vector loads need 16)


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def workspace_key(workspace):
    """What a launch key holds of a caller's workspace: its address and size (None: the op's own)."""
    if workspace is None:
        return None
    return workspace.data_ptr(), workspace.numel() * workspace.element_size()


def required_bytes(fp32_numel: int, int32_numel: int) -> int:
    """Bytes a caller's workspace needs for ``int32_numel`` counters and ``fp32_numel`` floats."""
    return _round_up(4 * int32_numel) + 4 * fp32_numel


def check_workspace(workspace, device: torch.device, name: str = "workspace_buffer") -> int:
    """Validate the buffer itself (no data read); returns its size in bytes."""
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(workspace).__name__}")
    if workspace.device != device:
        raise ValueError(f"{name} must be on {device} (the query's device), got {workspace.device}")
    if not workspace.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {workspace.stride()}")
    # while torch.compile traces there is no pointer; the op checks the real one when it runs
    if not torch.compiler.is_compiling() and workspace.data_ptr() % 16:
        raise ValueError(f"{name} data pointer must be 16-byte aligned")
    return workspace.numel() * workspace.element_size()


def check_size(workspace, device: torch.device, fp32_numel: int, int32_numel: int = 0,
               name: str = "workspace_buffer") -> None:
    """:func:`check_workspace`, and room for ``int32_numel`` counters and ``fp32_numel`` floats
    (CPU tensors: the sizes an H200 launch would carve, so that a buffer too small fails there too)."""
    nbytes = check_workspace(workspace, device, name)
    need = required_bytes(fp32_numel, int32_numel)
    if need > nbytes:
        raise ValueError(f"{name} holds {nbytes} bytes; this call needs {need} ({int32_numel} int32 counters and "
                         f"{fp32_numel} fp32 split partials / LSEs)")


def carve(workspace, device: torch.device, fp32_numel: int, int32_numel: int = 0, name: str = "workspace_buffer"):
    """``(fp32 [fp32_numel], int32 [int32_numel] or None)`` views of the caller's buffer; the counters
    are zeroed here (at prepare time, stream-ordered). Raises naming ``name`` when the buffer is
    too small."""
    check_size(workspace, device, fp32_numel, int32_numel, name)
    raw = workspace.reshape(-1).view(torch.uint8)
    counters = None
    if int32_numel:
        counters = raw[:4 * int32_numel].view(torch.int32)
        counters.zero_()
    base = _round_up(4 * int32_numel)
    fp32 = raw[base:base + 4 * fp32_numel].view(torch.float32)
    return fp32, counters
