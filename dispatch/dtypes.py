"""Dtype names for planning: torch dtypes or strings in, canonical short names out.

Plans carry dtypes as the short names used across the package (``"bf16"``, ``"fp16"``,
``"fp8_e4m3"``, as in ``cute_kernels.jit.dtypes``) so they stay hashable, printable and
torch-free. A torch dtype is recognised by its module and ``str()`` without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias, Union

from .errors import UnsupportedConfig

if TYPE_CHECKING:
    import torch

#: a torch dtype or a name (``"bf16"``, ``"bfloat16"``, ``"fp8"``, ``"auto"`` for a cache...)
DTypeLike: TypeAlias = Union[str, "torch.dtype"]

MODEL_DTYPES = ("bf16", "fp16")
KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")

_MODEL_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}
_KV_NAMES = {**_MODEL_NAMES, "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3"}

# vLLM stores FP8 caches as uint8 bytes; FlashInfer then read them as NVFP4 (anchors §2.5, §3.5).
# A byte-typed cache is ambiguous, so it is refused and the caller views it as e4m3 explicitly.
_UINT8_MSG = (
    "kv_cache_dtype=uint8 is ambiguous (FP8 bytes or another packed format); view the cache as "
    "float8_e4m3fn (cache.view(torch.float8_e4m3fn)) and pass that dtype"
)


def _is_torch_dtype(x) -> bool:
    return type(x).__module__ == "torch" and type(x).__name__ == "dtype"


def _spelling(x, argument: str) -> str:
    """The lower-case name of a string or torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    if isinstance(x, str):
        return x.strip().lower()
    if _is_torch_dtype(x):
        return str(x).removeprefix("torch.")
    raise UnsupportedConfig(f"{argument} must be a torch dtype or a dtype name, got {type(x).__name__} {x!r}")


def model_dtype_name(x: DTypeLike) -> str:
    """``torch.bfloat16``, ``"bf16"``, ``"bfloat16"``, ``"fp16"``, ``"half"``... -> ``"bf16"``/``"fp16"``."""
    name = _MODEL_NAMES.get(_spelling(x, "model_dtype"))
    if name is None:
        raise UnsupportedConfig(
            f"model_dtype={x!r} is not supported; expected bf16 or fp16 (torch dtype or name)"
        )
    return name


def kv_dtype_name(x: DTypeLike, model_dtype: str) -> str:
    """A KV-cache dtype as ``"bf16"``/``"fp16"``/``"fp8_e4m3"``; ``"auto"`` means the model dtype."""
    s = _spelling(x, "kv_cache_dtype")
    if s == "auto":
        return model_dtype
    if s == "uint8":
        raise UnsupportedConfig(_UINT8_MSG)
    name = _KV_NAMES.get(s)
    if name is None:
        raise UnsupportedConfig(
            f"kv_cache_dtype={x!r} is not supported; expected 'auto', bf16, fp16 or fp8 (float8_e4m3fn), "
            "as a torch dtype or a name"
        )
    return name


FP8_TWO_TERMS = "fp8_e4m3x2"  # a two-term FP8 query: its e4m3 codes and their e4m3 residual


def query_dtype_name(x: DTypeLike, argument: str = "query_dtype") -> str:
    """A requested query dtype: ``"auto"`` (the one the chosen kernel takes), ``"fp8_e4m3"``
    (``"fp8"``, ``torch.float8_e4m3fn``...: a kernel that computes QK in FP8) or
    :data:`FP8_TWO_TERMS` (``"fp8x2"``: QK in FP8 on the query's codes and their residual)."""
    s = _spelling(x, argument)
    if s == "auto":
        return "auto"
    if s in ("fp8x2", FP8_TWO_TERMS):
        return FP8_TWO_TERMS
    if _KV_NAMES.get(s) == "fp8_e4m3":
        return "fp8_e4m3"
    raise UnsupportedConfig(f"{argument}={x!r} is not supported; expected 'auto' or 'fp8' (float8_e4m3fn), or 'fp8x2' "
                            "(a two-term FP8 query)")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical name; imports torch lazily (planning never needs it)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}[name]
