"""Torch-side helpers shared by the ops: dtype maps, device arch, argument validation.

Validation never reads tensor data and never synchronizes: it looks at dtype, shape, strides,
device and data-pointer alignment only, and raises ``ValueError``/``TypeError`` naming the
argument and what was expected.
"""

from __future__ import annotations

import threading
from functools import cache
from typing import Any

import torch

from ._device import capturing

TORCH_TO_NAME = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}
NAME_TO_TORCH = {v: k for k, v in TORCH_TO_NAME.items()}


def dtype_name(dt: torch.dtype) -> str:
    try:
        return TORCH_TO_NAME[dt]
    except KeyError:
        raise TypeError(f"unsupported dtype {dt}") from None


@cache
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@cache
def device_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_capability(device: torch.device) -> tuple[int, int]:
    return _device_capability(device.index if device.index is not None else torch.cuda.current_device())


def compile_target(device: torch.device) -> str:
    """The compile target of a CUDA device (``sm_90a`` for an H100/H200...)."""
    from ..jit.compiler import normalize_target

    return normalize_target(device_capability(device))


def check_tensor(
    name: str,
    t,
    *,
    dtype=None,
    ndim: int | None = None,
    shape: tuple | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
    align_bytes: int = 0,
    output: bool = False,
):
    """Validate one tensor argument; ``shape`` entries may be None (any extent). ``output``: the
    op writes it, so no two of its elements may share memory (:func:`self_overlapping`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        if t.dtype not in allowed:
            exp = " or ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(f"{name} must have dtype {exp}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, t.shape)):
            exp = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{name} must have shape {exp}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    if output and self_overlapping(t):
        raise ValueError(f"{name} must not overlap itself (an output whose elements share memory, e.g. an expand()ed "
                         f"or stride-0 view: parallel writes to one address race), got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    if align_bytes:
        esize = t.element_size()
        if t.data_ptr() % align_bytes:
            raise ValueError(f"{name} data pointer must be {align_bytes}-byte aligned")
        for d in range(t.dim() - 1):
            if t.shape[d] > 1 and (t.stride(d) * esize) % align_bytes:
                raise ValueError(
                    f"{name} stride of dim {d} ({t.stride(d)} elements) must be a multiple of "
                    f"{align_bytes} bytes"
                )
    return t


def _offset_reachable(dims: list[tuple[int, int]], target: int, *, nonzero: bool = False) -> bool:
    """Whether ``target == sum_d j_d * stride_d`` for integers ``|j_d| < extent_d`` (``dims``:
    ``(stride, extent)`` pairs, strides positive, largest first); ``nonzero``: with some ``j_d != 0``.
    Answered conservatively (True) past a search budget: a layout with many representations."""
    reach = [0] * (len(dims) + 1)  # reach[i]: the largest |offset| the dims from i on can span
    for i in range(len(dims) - 1, -1, -1):
        reach[i] = reach[i + 1] + (dims[i][1] - 1) * dims[i][0]
    budget = [4096]

    def hit(i: int, rest: int, moved: bool) -> bool:
        if i == len(dims):
            return rest == 0 and (moved or not nonzero)
        budget[0] -= 1
        if budget[0] < 0:
            return True
        st, n = dims[i]
        # for a zero target the first nonzero j may be taken positive (j and -j give the same pair)
        lo = max(0 if nonzero and target == 0 and not moved else -(n - 1), -((reach[i + 1] - rest) // st))
        hi = min(n - 1, (rest + reach[i + 1]) // st)
        return any(hit(i + 1, rest - j * st, moved or j != 0) for j in range(lo, hi + 1))

    return hit(0, target, False)


def self_overlapping(t) -> bool:
    """Whether two elements of ``t`` share memory (a stride-0 dim of extent > 1, an as_strided
    view folding onto itself). Exact: a layout whose strides each exceed the span of the smaller
    ones (every dense or sliced view) answers at once; others search for a nonzero index offset
    ``sum_d j_d * stride_d == 0`` (:func:`_offset_reachable`)."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    if not dims:
        return False
    if dims[0][0] == 0:
        return True
    reach = 0  # the largest offset the smaller dims span
    for st, n in dims:
        if st <= reach:
            break
        reach += (n - 1) * st
    else:
        return False
    return _offset_reachable(dims[::-1], 0, nonzero=True)


def overlap(a, b) -> bool:
    """Whether two tensors share a byte (views of one storage included). Exact for two views of
    one layout (same shape, strides and dtype: the halves of a ``[P, 2, ...]`` cache do not
    overlap, one plane passed twice does); otherwise their byte ranges are compared, which may
    call interleaved but disjoint views overlapping."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.device != b.device:
        return False
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    if not (a0 < b1 and b0 < a1):
        return False
    esize = a.element_size()
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype or (b0 - a0) % esize:
        return True
    # one layout: they share an element iff the offset is sum_d j_d * stride_d with |j_d| < extent_d
    dims = sorted(((st, n) for n, st in zip(a.shape, a.stride()) if n > 1 and st != 0), reverse=True)
    return _offset_reachable(dims, (b0 - a0) // esize)


def check_page_size(name: str, t, page: int, layout: str = "") -> None:
    """A cache whose pages hold at least one token; ``ValueError`` naming the cache otherwise (a
    page size of 0 would divide slots and positions by zero)."""
    if page < 1:
        raise ValueError(f"{name} has a page size of 0 ({layout + ' ' if layout else ''}shape {tuple(t.shape)}): "
                         "a page holds at least one token")


def check_kv_cache(k, v, pair: bool, kv_layout: str, head_dim: int) -> tuple[int, int, int]:
    """Validate a paged cache (one ``[P, 2, ...]`` tensor ``k`` is ``v``, or a ``(k, v)`` pair
    of 4-D halves) in ``kv_layout`` against the query's head dim; ``(P, Hkv, page)``."""
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    if pair:
        check_tensor("k_cache", k, ndim=4)
        check_tensor("v_cache", v, ndim=4)
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(f"k_cache and v_cache must match, got {tuple(k.shape)} {k.dtype} / {tuple(v.shape)} {v.dtype}")
        k4 = k
    else:
        check_tensor("kv_cache", k, ndim=5)
        if k.shape[1] != 2:
            raise ValueError(f"kv_cache must be [P, 2, ...] (K and V), got shape {tuple(k.shape)}")
        k4 = k[:, 0]
    P, Hkv, page, D = k4.shape if kv_layout == "HND" else (k4.shape[0], k4.shape[2], k4.shape[1], k4.shape[3])
    if D != head_dim:
        raise ValueError(f"head dim mismatch: q has {head_dim}, kv_cache has {D}")
    return P, Hkv, page


def check_paged_tensors(q, k, v, pair: bool, block_table, seq_lens, q_len: int, cache_dtypes=None) -> int:
    """The device-side tensors of a paged attention call on q's device: q and the caches 16-byte
    aligned (TMA: base and strides), an FP8 or q-dtype cache (or one of ``cache_dtypes``, what the
    caller's kernel takes), an int32 block table and ``[B]`` lengths, ``B * q_len`` query rows.
    Returns B."""
    device = q.device
    check_tensor("q", q, device=device, align_bytes=16)
    if k.dtype not in (cache_dtypes or (torch.float8_e4m3fn, q.dtype)):
        raise TypeError(f"kv_cache dtype must be float8_e4m3fn or the query's dtype {q.dtype}, got {k.dtype}")
    for name, t in ((("k_cache", k), ("v_cache", v)) if pair else (("kv_cache", k),)):
        check_tensor(name, t, device=device, align_bytes=16)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
    B = block_table.shape[0]
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(B,), device=device)
    if q.shape[0] != B * q_len:
        raise ValueError(f"q has {q.shape[0]} rows; expected batch {B} x q_len_per_req {q_len}")
    return B


def ffi_tensor(t):
    """``t`` as a ``tvm_ffi.Tensor`` over the same memory (None stays None), for an argument that
    a launch binds once (a workspace view): TVM-FFI converts a torch tensor at every call, ~0.1-0.2
    µs each, and passes its own tensors as they are. The TVM-FFI tensor keeps ``t``'s storage
    alive. The launch stream still comes from the torch tensors of the call (the query's)."""
    if t is None:
        return None
    import tvm_ffi

    return tvm_ffi.from_dlpack(t)


def widest_vector(tensors_and_bytes, max_bytes: int = 16) -> int:
    """Largest power-of-two byte width (≤ max_bytes) that divides every pointer and stride given."""
    width = max_bytes
    for t in tensors_and_bytes:
        esize = t.element_size()
        while width > esize:
            ok = t.data_ptr() % width == 0 and all(
                (t.stride(d) * esize) % width == 0 for d in range(t.dim() - 1) if t.shape[d] > 1
            ) and (t.shape[-1] * esize) % width == 0
            if ok:
                break
            width //= 2
    return width


_raw_stream: Any  # torch's current-raw-stream getter; None in a build without CUDA
try:  # the current stream of a device as an int, without building a torch.cuda.Stream (~0.1 us)
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - a torch build without CUDA
    _raw_stream = None


def stream_id(t) -> int:
    """The current CUDA stream of ``t``'s device as an int (0 for a CPU tensor): what the compiled
    functions launch on, and what keys a launch's workspaces."""
    return _raw_stream(t.get_device()) if t.is_cuda else 0


def device_stream_id(device) -> int:
    """:func:`stream_id` of a device (0 for the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())


_BUFFERS: list = []  # every DeviceBuffer, for reserve / release
_ARENAS: dict = {}  # (device, dtype) -> [zeroed chunk, elements handed out]
_ARENA_NUMEL = 1 << 16  # elements of one zeroed chunk (16 streams' arrival counters at the minimum size)
_ARENA_LOCK = threading.Lock()  # two threads (two streams of a device) never get the same zeros


_SIDE_STREAMS: dict[int, Any] = {}  # device index -> the stream persistent buffers are allocated on


def _outside_pools(device: torch.device, make, *, wait: bool = False):
    """``make()``, a buffer kept across calls, allocated so that no CUDA-graph memory pool owns it.
    torch.compile's CUDA-graph trees route every allocation of the thread that runs a warm-up to the
    graph's pool (whatever the stream) and refuse a pool tensor that outlives the call; so the
    buffer is allocated by a worker thread, on a side stream. With ``wait`` the host waits for the
    side stream (a zeroed chunk's memset: every stream that gets a part of it sees zeros); the
    buffer is recorded on the caller's stream, so releasing it waits for the work that used it.
    Only growth allocates. Inside a capture the buffer comes from the graph's pool as before
    (docs/design/inputs.md#workspaces)."""
    if device.type != "cuda" or capturing(device):
        return make()
    index = device.index if device.index is not None else torch.cuda.current_device()
    caller = torch.cuda.current_stream(index)

    def allocate():
        with torch.cuda.device(index):
            side = _SIDE_STREAMS.get(index)
            if side is None:
                side = _SIDE_STREAMS.setdefault(index, torch.cuda.Stream(index))
            with torch.cuda.stream(side):
                buf = make()
            if wait:
                side.synchronize()
            return buf

    made: list = []

    def run():
        try:
            made.append(allocate())
        except BaseException as e:  # re-raised on the caller's thread
            made.append(e)

    worker = threading.Thread(target=run, name="cute_kernels_alloc")  # growth only: a thread per growth
    worker.start()
    worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    buf = made[0]
    buf.record_stream(caller)
    return buf


def _zeroed(device: torch.device, numel: int, dtype: torch.dtype, owner: str) -> torch.Tensor:
    """``numel`` zeros that no other caller gets, carved from a chunk zeroed when it was allocated.
    A new chunk is allocated (and zeroed) only outside a CUDA-graph capture: a buffer allocated
    inside one would be zeroed only when the graph first replays, and another graph or an eager
    call on that stream could use it before (docs/design/inputs.md#workspaces)."""
    with _ARENA_LOCK:
        arena = _ARENAS.get((device, dtype))
        if arena is None or arena[0].numel() - arena[1] < numel:
            if capturing(device):  # the capture on that device's stream (the current device may be another)
                raise RuntimeError(
                    f"{owner} needs {numel} zeroed workspace elements for a new stream or a larger shape while a "
                    "CUDA graph is being captured, more than were reserved: run one eager call with this shape "
                    "first (or AttentionLayer.warmup on the capturing stream)")
            chunk = max(numel, _ARENA_NUMEL)
            arena = [_outside_pools(device, lambda: torch.zeros(chunk, dtype=dtype, device=device), wait=True), 0]
            _ARENAS[(device, dtype)] = arena  # a replaced chunk stays alive through the views handed out
        view = arena[0][arena[1]:arena[1] + numel]
        arena[1] += numel
    return view


class DeviceBuffer:
    """A scratch tensor per (device, stream) shared by the calls of one op on that stream: it grows
    to the largest request seen there and never shrinks, so steady-state calls allocate nothing
    and capture in CUDA graphs.

    Per stream: two launches on two streams at once (dual-batch overlap, two graphs replayed on
    two streams) never share partials or arrival counters. A captured graph uses the buffers of
    the stream it was captured on, so graphs that may replay at the same time are captured on
    different streams. Lifetime: a buffer replaced by a larger one is kept (``retired``), because
    a captured graph may still address it; :func:`release_workspaces` drops the retired ones when
    the caller knows no such graph is alive. Growing during a capture is allowed (the new buffer
    comes from the graph's memory pool and is kept like any other); a ``zero`` buffer (arrival
    counters, which must be zero before a launch) is carved from memory zeroed eagerly, so inside
    a capture it needs what an earlier eager allocation left over (:func:`_zeroed`). Design:
    docs/design/inputs.md#workspaces."""

    def __init__(self, owner: str, dtype: torch.dtype, *, zero: bool = False, min_numel: int = 1 << 20):
        self.owner, self.dtype, self.zero, self.min_numel = owner, dtype, zero, min_numel
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []
        _BUFFERS.append(self)

    def get(self, device: torch.device, numel: int, stream: int = 0) -> torch.Tensor:
        key = (device, stream)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            size = max(numel, self.min_numel)
            if self.zero:
                new = _zeroed(device, size, self.dtype, self.owner)
            else:
                new = _outside_pools(device, lambda: torch.empty(size, dtype=self.dtype, device=device))
            if buf is not None:
                self.retired.append(buf)
            buf = self.buffers[key] = new
        return buf

    def release(self) -> int:
        """Drop the retired buffers; returns the bytes released."""
        freed = sum(b.numel() * b.element_size() for b in self.retired)
        self.retired.clear()
        return freed

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.buffers.values(), *self.retired))


def release_workspaces() -> int:
    """Release the workspaces that larger ones replaced (they are kept because a captured CUDA
    graph may still write to them). Call it only when no graph captured before the last growth is
    alive; returns the bytes released."""
    return sum(b.release() for b in _BUFFERS)
