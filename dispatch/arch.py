"""GPU architectures the dispatch layer knows, and one parser for every common spelling.

The arch is always passed explicitly (never read from a device here) so that planning works on a
machine without a GPU and a plan can be made for a target other than the local one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeAlias, Union

from .errors import UnsupportedConfig

# Compute capabilities this package plans for: Ampere, Ada, Hopper, datacenter and consumer
# Blackwell. Anything else (Volta, Turing, unknown future chips) is refused rather than guessed.
_SUPPORTED = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1))
SUPPORTED_ARCHS = tuple(f"sm{major}{minor}" for major, minor in _SUPPORTED)

# "sm_90a", "sm90", "SM_100f", "90", "121": optional sm prefix, digits, optional a/f suffix.
_SM_RE = re.compile(r"^(?:sm_?)?(\d{2,3})[af]?$")
# "9.0", "12.1": a compute capability written as major.minor.
_CC_RE = re.compile(r"^(\d{1,2})\.(\d)$")


@dataclass(frozen=True, order=True)
class Arch:
    """A compute capability, e.g. ``Arch(9, 0)``; ``.name`` is the canonical ``"sm90"``."""

    major: int
    minor: int

    @property
    def name(self) -> str:
        return f"sm{self.major}{self.minor}"

    def __str__(self) -> str:
        return self.name


#: what :func:`parse_arch` accepts: ``"sm_90a"``, ``"9.0"``, ``90``, ``(9, 0)`` or an :class:`Arch`
ArchLike: TypeAlias = Union[str, int, tuple[int, int], Arch]


def _from_number(n: int) -> tuple[int, int]:
    """``90 -> (9, 0)``, ``121 -> (12, 1)``: the last digit is the minor version."""
    return n // 10, n % 10


def parse_arch(arch: ArchLike, *, argument: str = "arch") -> Arch:
    """Parse ``"sm_90"``, ``"sm90"``, ``"sm_90a"``, ``90``, ``(9, 0)``, ``"9.0"`` or an ``Arch``.

    Raises:
        UnsupportedConfig: the value is not an arch spelling, or names an arch outside
            ``SUPPORTED_ARCHS``; the message names ``argument`` and lists the supported archs.
    """
    cc = None
    if isinstance(arch, Arch):
        cc = (arch.major, arch.minor)
    elif isinstance(arch, bool):  # bool is an int subclass; True is not an arch
        cc = None
    elif isinstance(arch, int):
        cc = _from_number(arch)
    elif isinstance(arch, (tuple, list)) and len(arch) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in arch
    ):
        cc = (arch[0], arch[1])
    elif isinstance(arch, str):
        text = arch.strip().lower()
        if m := _SM_RE.match(text):
            cc = _from_number(int(m.group(1)))
        elif m := _CC_RE.match(text):
            cc = (int(m.group(1)), int(m.group(2)))
    supported = ", ".join(SUPPORTED_ARCHS)
    if cc is None:
        raise UnsupportedConfig(
            f"{argument}={arch!r} is not an arch; expected e.g. 'sm90', 'sm_90a', 90, (9, 0) or '9.0' "
            f"naming one of {supported}"
        )
    if cc not in _SUPPORTED:
        raise UnsupportedConfig(
            f"{argument}={arch!r} (sm{cc[0]}{cc[1]}) is not supported; supported archs: {supported}"
        )
    return Arch(*cc)
