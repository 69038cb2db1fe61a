"""PTX every SM80-class kernel is built from (SM80 ... SM121, and SM90/SM100 too): ``ldmatrix``,
16-byte ``cp.async`` with zero fill, and shared-memory addressing with the 128-byte XOR swizzle.

Addresses are 32-bit shared-window addresses (``smem_ptr.toint()``), so a kernel computes them
with plain integer arithmetic and no layout algebra in the inner loops.
"""

from __future__ import annotations

from cutlass import Int32, Int64
from cutlass.cutlass_dsl import T, dsl_user_op

from ..jit.asm import asm


def swizzle(byte_offset):
    """(Traced or int.) The 128-byte XOR swizzle of a byte offset from a 1024-byte aligned base:
    the 16-byte chunk within each 128-byte line is XORed with the line index mod 8. Eight rows
    read at the same column (ldmatrix) then hit eight different bank groups, whatever the row
    length (64, 128, 256 or 512 bytes)."""
    return byte_offset ^ (((byte_offset >> 7) & 7) << 4)


@dsl_user_op
def ldmatrix_x4(smem_addr: Int32, transpose: bool, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: lane l gives the address of row l % 8
    of matrix l // 8; register j holds this lane's two 16-bit elements of matrix j (row l / 4,
    columns 2 (l % 4) + {0, 1}; with ``.trans`` the transposed matrix). Volatile: it reads data
    that ``cp.async`` wrote, so it must stay behind the wait and barrier that publish it."""
    trans = ".trans" if transpose else ""
    regs = asm([T.i32()] * 4, [Int32(smem_addr)],
               f"ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 {{$0, $1, $2, $3}}, [$4];", "=r,=r,=r,=r,r",
               side_effects=True, loc=loc, ip=ip)
    return tuple(Int32(r) for r in regs)


@dsl_user_op
def cp_async_16_zfill(smem_addr: Int32, gmem_addr: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.cg.shared.global [smem], [gmem], 16, src_bytes``: 16 bytes from L2 into shared
    memory; with ``src_bytes`` 0 the destination is zero-filled and nothing is read (pages past a
    sequence's end or outside the cache)."""
    asm([], [Int32(smem_addr), Int64(gmem_addr), Int32(src_bytes)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_shared_v4(smem_addr: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """``st.shared.v4.b32``: 16 bytes at a 16-byte aligned shared address."""
    asm([], [Int32(smem_addr), Int32(a), Int32(b), Int32(c), Int32(d)],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_shared_v2(smem_addr: Int32, a: Int32, b: Int32, *, loc=None, ip=None) -> None:
    """``st.shared.v2.b32``: 8 bytes at an 8-byte aligned shared address."""
    asm([], [Int32(smem_addr), Int32(a), Int32(b)], "st.shared.v2.b32 [$0], {$1, $2};", "r,r,r",
        side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def load_shared_v4(smem_addr: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """``ld.shared.v4.b32``: 16 bytes at a 16-byte aligned shared address (volatile: behind the
    barrier that publishes them)."""
    regs = asm([T.i32()] * 4, [Int32(smem_addr)], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
               side_effects=True, loc=loc, ip=ip)
    return tuple(Int32(r) for r in regs)


@dsl_user_op
def load_global_v4(gmem_addr: Int64, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """``ld.global.v4.b32``: 16 bytes at a 16-byte aligned global address."""
    regs = asm([T.i32()] * 4, [Int64(gmem_addr)], "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
               side_effects=True, loc=loc, ip=ip)
    return tuple(Int32(r) for r in regs)


@dsl_user_op
def store_global_v4(gmem_addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """``st.global.v4.b32``: 16 bytes at a 16-byte aligned global address."""
    asm([], [Int64(gmem_addr), Int32(a), Int32(b), Int32(c), Int32(d)],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_global_v2(gmem_addr: Int64, a: Int32, b: Int32, *, loc=None, ip=None) -> None:
    """``st.global.v2.b32``: 8 bytes at an 8-byte aligned global address."""
    asm([], [Int64(gmem_addr), Int32(a), Int32(b)], "st.global.v2.b32 [$0], {$1, $2};", "l,r,r",
        side_effects=True, loc=loc, ip=ip)
