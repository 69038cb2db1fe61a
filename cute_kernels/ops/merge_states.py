"""``cute_kernels.merge_states``: LSE merge of split partials (CuTe-DSL kernel on CUDA).

On the shared launcher (:mod:`cute_kernels.ops._launch`): the first call with a new combination of
shapes, strides, dtypes and alignments validates everything and picks the vector width; later
calls look the prepared caller up by a tuple of cheap tensor attributes. Registered as
``torch.ops.cute_kernels.merge_states`` and ``merge_states_out`` (:mod:`cute_kernels.ops._library`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import reference
from ..jit.compiler import get_kernel
from ..plans.merge_states import MergeStatesConfig
from . import _check
from ._device import current_device, on_device, served_device
from ._launch import Launcher, TuningOverride
from ._library import compiling, custom_op
from ._torch import check_tensor, compile_target, dtype_name, overlap, widest_vector

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Launch:
    __slots__ = ("call", "reference", "out_dtype", "empty")

    def __init__(self, call, reference, out_dtype=None, empty=False):
        self.call, self.reference, self.out_dtype, self.empty = call, reference, out_dtype, empty


def _key(partial_out, partial_lse, out_dtype, out, out_lse):
    def t(x):
        return None if x is None else (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16)

    # caller outputs: whether they overlap the partials or each other (refused by _prepare) is
    # part of the key, so a cached launch never runs on an alias
    aliased = (out is not None or out_lse is not None) and _aliased(partial_out, partial_lse, out, out_lse)
    return (t(partial_out), t(partial_lse), out_dtype, t(out), t(out_lse), aliased, _launcher.override_key,
            current_device() if partial_out.is_cuda else -1)


def _aliased(partial_out, partial_lse, out, out_lse) -> bool:
    """Whether :func:`check_outputs` refuses the outputs; tensors of distinct storages share no
    byte, which ~0.5 µs tells (the full check takes ~15 µs)."""
    outs = [o.untyped_storage().data_ptr() for o in (out, out_lse) if o is not None]
    if len(set(outs)) == len(outs) and not {partial_out.untyped_storage().data_ptr(),
                                            partial_lse.untyped_storage().data_ptr()}.intersection(outs):
        return False
    try:
        check_outputs(partial_out, partial_lse, out, out_lse)
    except ValueError:
        return True
    return False


def _prepare(partial_out, partial_lse, out_dtype, out, out_lse) -> _Launch:
    """Full validation (errors name the argument) and the kernel variant for one key."""
    check_tensor("partial_out", partial_out, dtype=torch.float32, ndim=4)
    served_device("partial_out", partial_out)
    S, N, H, D = partial_out.shape
    check_tensor("partial_lse", partial_lse, dtype=torch.float32, shape=(S, N, H), device=partial_out.device)
    if out is not None:
        check_tensor("out", out, dtype=_OUT_DTYPES, shape=(N, H, D), device=partial_out.device, output=True)
        dt = out.dtype
    else:
        dt = out_dtype or torch.float32
        if dt not in _OUT_DTYPES:
            raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {dt}")
    if out_lse is not None:
        check_tensor("out_lse", out_lse, dtype=torch.float32, shape=(N, H), device=partial_out.device, output=True)
    if D == 0:
        raise ValueError(f"partial_out must have a head dim >= 1, got shape {tuple(partial_out.shape)}")
    check_outputs(partial_out, partial_lse, out, out_lse)
    if not partial_out.is_cuda:
        _config(partial_out, out, dt)  # the kernel's own limits (head dim), checked for CPU tensors too
        return _Launch(None, True, dt)
    if S == 0 or N * H == 0:
        return _Launch(None, False, dt, empty=True)
    config = _config(partial_out, out, dt)
    fn = get_kernel(config, compile_target(partial_out.device))
    return _Launch(on_device(_launcher.bind(_CALL_PARAMS, (fn, config.signature(), None, None)), partial_out.device), False, dt)


def check_outputs(partial_out, partial_lse, out, out_lse) -> None:
    """The outputs share no byte with the partials or each other: the kernel reads a row's
    partials while other threads write the row's outputs, so an alias is a race (the reference
    would merge first and then copy: the two paths would differ)."""
    if out is not None and out_lse is not None and overlap(out, out_lse):
        raise ValueError("out_lse must not overlap out (two outputs)")
    for name, o in (("out", out), ("out_lse", out_lse)):
        for src_name, src in (("partial_out", partial_out), ("partial_lse", partial_lse)):
            if o is not None and overlap(o, src):
                raise ValueError(f"{name} must not overlap {src_name} (an output over the partials it merges)")


def _config(partial_out, out, dt) -> MergeStatesConfig:
    """The kernel variant: 16-byte lanes when the partials allow it."""
    D = partial_out.shape[3]
    # 16-byte lanes when the partials allow it; the output needs vec * its element size (an
    # output the op allocates is contiguous and aligned: only its rows' length limits it)
    esize = dt.itemsize
    if out is not None:
        out_width = widest_vector([out])
    else:
        out_width = 16
        while out_width > esize and (D * esize) % out_width:
            out_width //= 2
    vec = widest_vector([partial_out]) // 4
    while vec > 1 and out_width < vec * esize:
        vec //= 2
    return MergeStatesConfig(out_dtype=dtype_name(dt), head_dim=D, vec=vec, **_launcher.override)


# forward-only, as the kernels: no autograd history, an out= that requires grad written in place
# (docs/design/inputs.md#the-classes)
@torch.no_grad()
def _reference(partial_out, partial_lse, out_dtype, out, out_lse):
    ref_out, ref_lse = reference.merge_states(partial_out, partial_lse)
    S, N, H, D = partial_out.shape
    out = out if out is not None else torch.empty((N, H, D), dtype=out_dtype or torch.float32)
    out_lse = out_lse if out_lse is not None else torch.empty((N, H), dtype=torch.float32)
    out.copy_(ref_out)
    out_lse.copy_(ref_lse)
    return out, out_lse


def _check_data(partial_out, partial_lse, out_dtype, out, out_lse) -> None:
    """Checked mode (``CUTE_KERNELS_CHECK=1``): LSEs finite or -inf (an empty split)."""
    _check.lse("partial_lse", partial_lse)


_CALL_PARAMS = ("partial_out", "partial_lse", "out", "lse")
_launcher = Launcher(_prepare, _reference, check_data=_check_data, op="merge_states")


def tuning_override(**fields: object) -> TuningOverride:
    """``with tuning_override(vec=2): ...`` forces kernel config fields (benchmarks comparing
    variants); the override is part of the launch-cache key."""
    return _launcher.tuning_override(**fields)


def merge_states(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S split partial states into one.

    Args:
        partial_out: fp32 ``[S, N, H, D]``, last dim contiguous, other strides free.
        partial_lse: fp32 ``[S, N, H]``, base-2 log-sum-exp of each split's scaled logits,
            last dim contiguous. A split with lse ``-inf`` is empty and contributes nothing
            (its partial output is not read).
        out_dtype: dtype of the merged output (fp32 default, bf16 or fp16); ignored if ``out``.
        out: optional ``[N, H, D]`` output tensor (written in place).
        out_lse: optional fp32 ``[N, H]`` for the merged base-2 LSE.

    Returns:
        ``(out, lse)``: ``out = sum_s 2^(lse_s - lse) * partial_out[s]`` and
        ``lse = log2(sum_s 2^lse_s)``; a row with every split empty gets 0 and ``-inf``.
        CPU tensors run the torch reference.
    """
    if compiling():  # torch.compile traces the registered op (the eager path never pays for it)
        return _traced(partial_out, partial_lse, out_dtype, out, out_lse)
    try:
        key = _key(partial_out, partial_lse, out_dtype, out, out_lse)
    except (AttributeError, TypeError):  # not tensors: the validation says what is wrong
        key = None
    launch = _launcher.entries.get(key)
    if launch is None or launch.reference:  # the argument tuple is built off the hot path only
        args = (partial_out, partial_lse, out_dtype, out, out_lse)
        launch = launch or _launcher.lookup(key, args)
        if launch.reference:
            return _launcher.run_reference(args)
    S, N, H, D = partial_out.shape
    if out is None:
        out = torch.empty((N, H, D), dtype=launch.out_dtype, device=partial_out.device)
    if out_lse is None:
        out_lse = torch.empty((N, H), dtype=torch.float32, device=partial_out.device)
    if launch.empty:
        out.zero_()
        out_lse.fill_(float("-inf"))
        return out, out_lse
    try:
        launch.call(partial_out, partial_lse, out, out_lse)
    except Exception:
        _launcher.refused((partial_out, partial_lse, out_dtype, out, out_lse))  # raises the error that names the argument
        raise
    return out, out_lse


# ---------------------------------------------------------------------------------------------
# torch.library: torch.ops.cute_kernels.merge_states / merge_states_out
# ---------------------------------------------------------------------------------------------


def _new_outputs(partial_out: Tensor, out_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    _, N, H, D = partial_out.shape
    return (torch.empty((N, H, D), dtype=out_dtype or torch.float32, device=partial_out.device),
            torch.empty((N, H), dtype=torch.float32, device=partial_out.device))


@custom_op("merge_states")
def _merge_states_op(partial_out: Tensor, partial_lse: Tensor, out_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    out, out_lse = _new_outputs(partial_out, out_dtype)
    return merge_states(partial_out, partial_lse, out=out, out_lse=out_lse)


@_merge_states_op.register_fake
def _(partial_out: Tensor, partial_lse: Tensor, out_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    return _new_outputs(partial_out, out_dtype)


@custom_op("merge_states_out", mutates=("out", "out_lse"))
def _merge_states_out_op(partial_out: Tensor, partial_lse: Tensor, out: Tensor, out_lse: Tensor) -> None:
    merge_states(partial_out, partial_lse, out=out, out_lse=out_lse)


@_merge_states_out_op.register_fake
def _(partial_out: Tensor, partial_lse: Tensor, out: Tensor, out_lse: Tensor) -> None:
    return None


def _traced(partial_out, partial_lse, out_dtype, out, out_lse):
    """:func:`merge_states` as torch.compile sees it: the functional op, or the out variant when
    the caller passed an output (the other one allocated here)."""
    if out is None and out_lse is None:
        return _merge_states_op(partial_out, partial_lse, out_dtype)
    new_out, new_lse = _new_outputs(partial_out, out_dtype if out is None else out.dtype)
    out = new_out if out is None else out
    out_lse = new_lse if out_lse is None else out_lse
    _merge_states_out_op(partial_out, partial_lse, out, out_lse)
    return out, out_lse
