"""PTX digests of compiled variants: proof that a refactor changed no generated code.

A kernel's PTX names its entry after the Python module and class that define it
(``kernel_cutlass_kernel_cute_kernelssm90decode_SplitSingle_object_at_...``), so moving a class
between modules renames the entry without changing one instruction. :func:`normalized_ptx`
replaces every entry name by its position (``KERNEL0``...), and drops comment lines (they carry
the compiler's banner); everything else, instructions, registers, parameters and shared-memory
sizes, enters the digest unchanged.

``cute-kernels compile --arch sm_90a --digests FILE`` writes one digest per variant label;
``--check-digests FILE`` compares against such a file and fails on any difference.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(")


def normalized_ptx(ptx: str) -> str:
    names = _ENTRY.findall(ptx)
    for i, name in enumerate(sorted(set(names), key=names.index)):
        ptx = ptx.replace(name, f"KERNEL{i}")
    return "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))


def ptx_digest(ptx: str) -> str:
    return hashlib.sha256(normalized_ptx(ptx).encode()).hexdigest()[:20]


def read_digests(path: str | Path) -> dict[str, str]:
    return json.loads(Path(path).read_text())


def write_digests(path: str | Path, digests: dict[str, str]) -> None:
    """One variant per line, sorted, so that a diff shows which variants changed."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(digests.items())]
    Path(path).write_text("{\n" + ",\n".join(lines) + "\n}\n")


def compare_digests(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Lines describing every difference (changed, missing or new variants); empty if equal."""
    out = []
    for label in sorted(set(expected) | set(actual)):
        e, a = expected.get(label), actual.get(label)
        if e is None:
            out.append(f"new      {label}")
        elif a is None:
            out.append(f"missing  {label}")
        elif e != a:
            out.append(f"changed  {label}: {e} -> {a}")
    return out
