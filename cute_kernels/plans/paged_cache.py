"""Arguments every paged attention kernel's signature shares (host-only): the paged cache, one
``[P, 2, ...]`` tensor or a K and a V tensor in HND ``[P, Hkv, page, D]`` or NHD
``[P, page, Hkv, D]`` pages, and the dequantization scales (a float, or a 1-element fp32 tensor
read on the device). Written once for the SM90 and SM100 plans."""

from __future__ import annotations

from ..jit.spec import ScalarArg, TensorArg


def kv_cache_args(kv_form: str, kv_layout: str, kv_dtype: str, page_size: int, head_dim: int) -> tuple[TensorArg, ...]:
    """``kv_cache``, or ``k_cache`` and ``v_cache`` (``kv_form`` "single" / "pair"), of ``kv_layout``."""
    inner = ("Hkv", page_size) if kv_layout == "HND" else (page_size, "Hkv")
    if kv_form == "single":
        return (TensorArg("kv_cache", kv_dtype, ("P", 2, *inner, head_dim)),)
    return (TensorArg("k_cache", kv_dtype, ("P", *inner, head_dim)),
            TensorArg("v_cache", kv_dtype, ("P", *inner, head_dim)))


def scale_arg(name: str, tensor: bool) -> TensorArg | ScalarArg:
    """A dequantization scale: a 1-element fp32 tensor (read on the device) or a float."""
    return TensorArg(name, "fp32", (1,), align=4) if tensor else ScalarArg(name, "fp32")
