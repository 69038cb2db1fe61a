"""Per-stage "full" mbarriers of a ``cp.async`` ring (``ring_release``,
docs/design/sm80.md#ping-pong-warps): every thread copies its share of a stage, then
``cp.async.mbarrier.arrive.noinc`` makes the stage's barrier count that thread once its copies have
landed, so a reader waits for the stage it reads and nothing else (no commit groups, no CTA-wide
``bar.sync`` per tile).

Inline PTX on every target: the DSL's mbarrier helpers are SM90-only, and these forms exist from
SM80 on (``mbarrier.test_wait`` polls; ``mbarrier.try_wait``, which may suspend the thread, from
SM90 on). Addresses are 32-bit shared-window addresses, as the gather's.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from ..jit.asm import asm


@dsl_user_op
def mbarrier_init_at(addr: Int32, count: int, *, loc=None, ip=None) -> None:
    """``mbarrier.init.shared.b64``: the barrier at ``addr`` expects ``count`` arrivals per phase."""
    asm([], [Int32(addr)], f"mbarrier.init.shared.b64 [$0], {int(count)};", "r,~{memory}", side_effects=True,
        loc=loc, ip=ip)


@dsl_user_op
def cp_async_arrive_noinc_at(addr: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.mbarrier.arrive.noinc.shared.b64``: one arrival on the barrier at ``addr`` once
    every ``cp.async`` this thread issued before it has completed (counted in the barrier's
    expected arrivals, not added to them)."""
    asm([], [Int32(addr)], "cp.async.mbarrier.arrive.noinc.shared.b64 [$0];", "r,~{memory}", side_effects=True,
        loc=loc, ip=ip)


@dsl_user_op
def mbarrier_wait_parity_at(addr: Int32, parity: Int32, suspend: bool, *, loc=None, ip=None) -> None:
    """Wait until the phase of parity ``parity`` of the barrier at ``addr`` has completed (acquire:
    the copies it counted are visible after it). ``suspend``: ``try_wait`` (SM90+), else a
    ``test_wait`` loop."""
    op = "try_wait" if suspend else "test_wait"
    text = ("{\n\t.reg .pred done;\n\tLAB_WAIT:\n\t"
            f"mbarrier.{op}.parity.shared.b64 done, [$0], $1;\n\t"
            "@!done bra LAB_WAIT;\n\t}")
    asm([], [Int32(addr), Int32(parity)], text, "r,r,~{memory}", side_effects=True, loc=loc, ip=ip)


class StageBarriers:
    """One full barrier per stage of a ``stages``-deep ring at the 8-byte aligned shared address
    ``base``, each expecting one arrival of each of ``threads`` threads per fill. Fill ``k`` of
    stage ``s`` (the ring's tile ``k * stages + s``) completes phase ``k``: a reader of that tile
    waits for parity ``k % 2``. A barrier cannot run a phase ahead of a waiting thread, since that
    thread's own arrival for the next fill comes after its wait."""

    BYTES = 8  # one b64 per stage

    def __init__(self, stages: int, threads: int, suspend: bool):
        self.stages, self.threads, self.suspend = stages, threads, suspend

    @cute.jit
    def init(self, base, tidx):
        """(Traced.) One thread initializes every stage's barrier; a CTA barrier must follow before
        any thread arrives (``bar.sync`` orders the initialization on every target)."""
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                mbarrier_init_at(base + s * self.BYTES, self.threads)

    @cute.jit
    def arrive(self, base, stage):
        """(Traced.) This thread's copies into ``stage`` so far, counted on its barrier."""
        cp_async_arrive_noinc_at(base + stage * self.BYTES)

    @cute.jit
    def wait(self, base, tile):
        """(Traced.) Until the ring's tile ``tile`` (stage ``tile % stages``) has landed."""
        stage = tile % self.stages
        mbarrier_wait_parity_at(base + stage * self.BYTES, (tile // self.stages) % 2, self.suspend)
