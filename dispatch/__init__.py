"""Arch- and phase-aware dispatch: which kernel serves an attention call, with which query dtype.

Pure Python, no torch or CuTe DSL at import, so ``cute-kernels matrix`` and planning run
anywhere, instantly. Entry point: :func:`plan`; the tables behind it are :data:`KERNELS`
(what each kernel accepts) and :func:`capability_table` (what each arch tries, in order).
"""

from __future__ import annotations

from .arch import SUPPORTED_ARCHS, Arch, parse_arch
from .capabilities import capability_table
from .errors import UnsupportedConfig
from .kernels import KERNELS, KernelInfo
from .planner import Plan, plan

__all__ = [
    "KERNELS",
    "SUPPORTED_ARCHS",
    "Arch",
    "KernelInfo",
    "Plan",
    "UnsupportedConfig",
    "capability_table",
    "parse_arch",
    "plan",
]
