"""Dtype names shared by configs, the compiler and the torch ops.

Configs carry dtypes as short strings so that they stay hashable, picklable and torch-free;
this module maps those names to CuTe numeric types (compile side; the bits per element, which
host-side plans need, are in :mod:`cute_kernels.jit.spec`). The torch side of the map
lives in :mod:`cute_kernels.ops._torch` so that kernel code never imports torch.
"""

from __future__ import annotations

import cutlass

# name -> CuTe numeric type
CUTE_DTYPES = {
    "bf16": cutlass.BFloat16,
    "fp16": cutlass.Float16,
    "fp32": cutlass.Float32,
    "fp8_e4m3": cutlass.Float8E4M3FN,
    "int32": cutlass.Int32,
    "int64": cutlass.Int64,
    "uint8": cutlass.Uint8,
}



def cute_dtype(name: str):
    try:
        return CUTE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; expected one of {sorted(CUTE_DTYPES)}") from None
