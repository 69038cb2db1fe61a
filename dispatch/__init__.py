"""Arch- and phase-aware dispatch: which kernel serves an attention call, with which query dtype.

Pure Python, no torch or CuTe DSL at import, so ``cute-kernels matrix`` and planning run
anywhere, instantly. Entry point: :func:`plan`; the tables behind it are :data:`KERNELS` (the
kernel registry, :mod:`cute_kernels.registry`: what each kernel accepts) and
:func:`capability_table` (what each arch tries, in order).
QSA sparse attention is its own call site: :func:`plan_qsa` and :func:`qsa_capability_table`.
"""

from __future__ import annotations

from cute_kernels.registry import KERNELS, KernelInfo

from .arch import SUPPORTED_ARCHS, Arch, parse_arch
from .capabilities import capability_table
from .errors import UnsupportedConfig
from .layer import AttentionLayer, AttentionMetadata
from .planner import Plan, plan
from .qsa import QsaPlan, plan_qsa, qsa_capability_table

__all__ = [
    "KERNELS",
    "SUPPORTED_ARCHS",
    "Arch",
    "AttentionLayer",
    "AttentionMetadata",
    "KernelInfo",
    "Plan",
    "QsaPlan",
    "UnsupportedConfig",
    "capability_table",
    "parse_arch",
    "plan",
    "plan_qsa",
    "qsa_capability_table",
]
