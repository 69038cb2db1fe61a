"""The public ops as ``torch.ops.cute_kernels.*`` custom ops, for ``torch.compile``.

Dynamo cannot look into a TVM-FFI call or the launcher's generated caller, and the reference
paths read device data (``nonzero``, ``.item()``), so each op module registers its op with
:func:`custom_op`: an implementation (the eager op itself, which runs the reference for CPU
tensors), a fake implementation that only builds empty outputs, and the mutated arguments
(``out`` of the ``*_out`` variants, the caches ``write_kv_cache`` writes).

The Python functions stay the public API. They call the registered op only while a graph is being
traced (:func:`compiling`, one flag read; Dynamo folds it to True), so the eager path never goes
through the dispatcher. The schema cannot hold the public arguments' unions, so a traced call
passes them split (:func:`scale_parts`, :func:`cache_parts`): ``kv_cache`` as ``k_cache`` and an
optional ``v_cache``, a scale as a float and an optional tensor, ``rope`` as two optional tensors.
An op whose public form may return the LSE always returns ``(out, lse)`` (an empty ``lse`` when it
was not asked for) and the wrapper drops what the caller did not ask for.

Annotations of registered functions are written with ``Optional[...]``: the schema inference of
older torch releases does not read ``X | None``. Design: docs/design/architecture.md#torchcompile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch
from torch import Tensor

NAMESPACE = "cute_kernels"
_DEFS: dict[str, Any] = {}  # name -> its torch.library CustomOpDef, in registration order

#: True while Dynamo (or export) traces: the public ops then call their registered op
compiling: Callable[[], bool] = torch.compiler.is_compiling


def custom_op(name: str, *, mutates: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op("cute_kernels::<name>")`` for every device: the implementation is
    the eager op, which serves CPU tensors with the reference and CUDA tensors with the kernels."""
    register = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=tuple(mutates), device_types=None)

    def define(fn: Callable[..., Any]) -> Any:
        _DEFS[name] = register(fn)
        return _DEFS[name]

    return define


def scale_parts(scale: Union[float, Tensor]) -> tuple[float, Optional[Tensor]]:
    """A public scale as the schema's ``(float, Optional[Tensor])`` pair."""
    if isinstance(scale, Tensor):
        return 1.0, scale
    return float(scale), None


def scale_of(value: float, tensor: Optional[Tensor]) -> Union[float, Tensor]:
    """The inverse of :func:`scale_parts`."""
    return value if tensor is None else tensor


def cache_parts(kv_cache: Union[Tensor, tuple[Tensor, Tensor], list[Tensor]]) -> tuple[Tensor, Optional[Tensor]]:
    """A public ``kv_cache`` (one tensor or ``(k_cache, v_cache)``) as ``(k_cache, v_cache or None)``."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError("kv_cache tuple must be (k_cache, v_cache)")
        return kv_cache[0], kv_cache[1]
    return kv_cache, None


def cache_of(k_cache: Tensor, v_cache: Optional[Tensor]) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """The inverse of :func:`cache_parts`."""
    return k_cache if v_cache is None else (k_cache, v_cache)


def no_lse(like: Tensor) -> Tensor:
    """The empty fp32 ``lse`` an op returns when the caller did not ask for it."""
    return torch.empty((0,), dtype=torch.float32, device=like.device)


def attention_out(q: Tensor) -> Tensor:
    """The output an attention op allocates: the query's dtype, bf16 for an FP8 query."""
    return torch.empty(q.shape, dtype=torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype, device=q.device)


def attention_lse(q: Tensor, return_lse: bool) -> Tensor:
    """The ``lse`` an attention op returns: ``[T, Hq]`` fp32 when asked for, else empty."""
    return torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else no_lse(q)


def registered_ops() -> dict[str, Any]:
    """Every op this package registers (``name -> torch.ops.cute_kernels.<name>``), importing the
    public op modules first: an op module registers its ops when it is imported. Their
    definitions (``torch.library.CustomOpDef``) are in :data:`_DEFS`."""
    import importlib

    from ..registry import OPS

    for module, _ in OPS.values():
        importlib.import_module(module)
    namespace = getattr(torch.ops, NAMESPACE)
    return {name: getattr(namespace, name) for name in _DEFS}
