"""Resource usage recorded in a CUDA ELF (cubin), read without a GPU: registers per thread and the
local-memory frame (spills) of each kernel, from the ``.nv.info`` attribute sections."""

from __future__ import annotations

import struct

_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11
_EIFMT_SVAL = 0x04


def _sections(cubin: bytes):
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, strndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names = heads[strndx]

    def name(off: int) -> str:
        raw = cubin[names[4] + off:]
        return raw[:raw.index(b"\0")].decode()

    return [(name(h[0]), cubin[h[4]:h[4] + h[5]]) for h in heads]


def _attributes(data: bytes):
    """(attribute, payload) pairs of one ``.nv.info`` section."""
    i = 0
    while i + 4 <= len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", data, i + 2)
            yield attr, data[i + 4:i + 4 + size]
            i += 4 + size
        else:  # fixed 2-byte payload
            yield attr, data[i + 2:i + 4]
            i += 4


def resources(cubin: bytes) -> dict[str, int]:
    """``{"registers": max over kernels, "frame_bytes": max local-memory frame}``."""
    regs = frame = 0
    for name, data in _sections(cubin):
        if name != ".nv.info":
            continue
        for attr, payload in _attributes(data):
            if attr == _EIATTR_REGCOUNT and len(payload) >= 8:
                regs = max(regs, struct.unpack_from("<II", payload)[1])
            elif attr == _EIATTR_FRAME_SIZE and len(payload) >= 8:
                frame = max(frame, struct.unpack_from("<II", payload)[1])
    return {"registers": regs, "frame_bytes": frame}
