"""Instruction evidence of a compiled variant: what ``cute-kernels compile`` prints and the compile
matrix asserts.

A config names, per target, ``(display name, PTX regex)`` pairs (``KernelConfig.evidence``); the
evidence of a compile is each name with its match count in the PTX, plus a count of the SASS
mnemonics worth reporting (when nvdisasm is installed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .compiler import CompiledKernel, compile_config
from .cubin import resources
from .spec import KernelConfig

# SASS mnemonics worth reporting per family (the PTX evidence is what tests assert)
SASS_FAMILIES = ("HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "UTCHMMA", "UTCQMMA", "HMMA", "LDSM", "LDGSTS", "LDG.E.128",
                 "STL", "LDL")


@dataclass
class Evidence:
    """What one compile proved: each PTX evidence name's match count and a SASS mnemonic summary."""

    ptx_target: str | None
    ptx: dict[str, int] = field(default_factory=dict)
    sass: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    registers: int | None = None  # per thread at launch (from the cubin)

    def summary(self) -> str:
        """``wgmma.mma_async ×24, TMA load ×16 | SASS HGMMA ×24 ...`` (one line)."""
        ptx = ", ".join(f"{k} ×{v}" for k, v in self.ptx.items())
        if self.registers:
            ptx += f", {self.registers} registers"
        sass = " ".join(f"{k} ×{v}" for k, v in self.sass.items())
        return f"{ptx} | SASS {sass}" if sass else ptx


def evidence_of(compiled: CompiledKernel) -> Evidence:
    ptx = compiled.ptx or ""
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    ev = Evidence(ptx_target=target.group(1) if target else None)
    for name, pattern in compiled.config.evidence.get(compiled.arch, ()):
        n = len(re.findall(pattern, ptx))
        ev.ptx[name] = n
        if n == 0:
            ev.missing.append(name)
    if compiled.cubin:
        ev.registers = resources(compiled.cubin)["registers"]
    if compiled.sass:
        for fam in SASS_FAMILIES:
            n = len(re.findall(r"\b" + re.escape(fam), compiled.sass))
            if n:
                ev.sass[fam] = n
    return ev


def compile_with_evidence(config: KernelConfig, arch: str) -> tuple[CompiledKernel, Evidence]:
    compiled = compile_config(config, arch, artifacts=True)
    return compiled, evidence_of(compiled)
