"""Programmatic dependent launch (PDL) for the streaming kernels.

A kernel launched with the PDL attribute may start (its CTAs get scheduled) while the previous
kernel in the stream is still finishing, which hides the launch latency between back-to-back
kernels of a layer (write_kv_cache -> quantize_query -> decode), as FlashInfer's kernels do on
SM90+. Correctness rests on ``griddepcontrol.wait``: it returns only once the previous grid has
completed and its writes are visible, so it comes before any global memory access. Without the
attribute (or after a non-PDL kernel) the wait returns at once.
"""

from __future__ import annotations

import cutlass.cute as cute


@cute.jit
def wait_then_release_dependents():
    """Wait for the previous grid, then let the next PDL kernel launch. Releasing at once is right
    for a multi-wave streaming grid: the next grid can only launch when every CTA of this one has
    released (or exited), i.e. when the last wave has started, so its CTAs fill the SM slots that
    this grid's last wave frees instead of competing with waves still to come."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()
