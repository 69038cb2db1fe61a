"""The portable prefill's grid order, modelled on the CPU: how long a grid of CTAs takes when the
hardware hands them out in grid order to a fixed number of resident slots, each CTA costing a
fixed part plus one unit per KV tile it visits (causal: up to its last packed row's token).

For every ``cute-kernels bench sm80 prefill`` shape it prints the model's time of the grid with
the row tiles fastest (``(row tiles, KV heads, requests)``, each head's longest tiles first) and
with the KV heads fastest (``heads_first``), and their ratio: the prediction written before the
H200 runs of docs/design/sm80.md#the-grid-order. The model has no L2 cache and no sharing of an SM
between CTAs, so it says where the tail is, not what the order costs in memory traffic.

    python -m profiling.sm80_grid_order [--sms 132] [--fixed 1.0]

Resident CTAs per SM: what the build's registers (compiled here, on the CPU) and its shared
memory allow on sm_90a.
"""

from __future__ import annotations

import argparse
import heapq

from cute_kernels.bench.sm80 import PREFILL_SHAPES
from cute_kernels.jit.evidence import compile_with_evidence
from cute_kernels.plans import hw
from cute_kernels.plans.sm80 import make_prefill_config


def cta_tiles(q_len: int, prefix: int, group: int, rows: int, tile: int) -> list[int]:
    """KV tiles of ``tile`` tokens each row tile of one request and KV head visits (causal; packed
    row p is token p // group), row tile 0 first."""
    m_blocks = -(-q_len * group // rows)
    return [-(-(prefix + (min((m + 1) * rows, q_len * group) - 1) // group + 1) // tile) for m in range(m_blocks)]


def makespan(costs: list[float], slots: int) -> float:
    """Time until the last CTA ends when each CTA starts on the first free slot, in order."""
    free = [0.0] * slots
    end = 0.0
    for c in costs:
        t = heapq.heappop(free) + c
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def orders(tiles: list[int], heads: int, batch: int, fixed: float) -> tuple[list[float], list[float]]:
    """The CTAs' costs in the order of the grid with the row tiles fastest and with the heads fastest."""
    cost = [fixed + n for n in reversed(tiles)]  # the longest row tiles first in both
    rows_first = [c for _ in range(batch) for _ in range(heads) for c in cost]
    heads_first = [c for _ in range(batch) for c in cost for _ in range(heads)]
    return rows_first, heads_first


def ctas_per_sm(cfg) -> int:
    """Resident CTAs of ``cfg``'s build per SM: its registers (rounded up to 8 per thread) and its
    shared memory."""
    _, ev = compile_with_evidence(cfg, cfg.target)
    by_regs = hw.REGISTERS_PER_SM // (-(-ev.registers // 8) * 8 * cfg.threads)
    return max(n for n in range(1, by_regs + 1) if n == 1 or hw.smem_fits(cfg.smem_bytes(), n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sms", type=int, default=hw.H200_SMS, help="SMs of the modelled GPU")
    p.add_argument("--fixed", type=float, default=1.0, help="a CTA's fixed cost in KV-tile units")
    args = p.parse_args()
    print(f"{'shape':22s} {'slots':>5s} {'rows first':>11s} {'heads first':>12s} {'ratio':>6s}")
    for name, Hq, Hkv, D, B, q_len, prefix in PREFILL_SHAPES:
        cfg = make_prefill_config(target="sm_90a", q_dtype="bf16", kv_dtype="bf16", head_dim=D, group=Hq // Hkv,
                                  page_size=16)
        slots = args.sms * ctas_per_sm(cfg)
        tiles = cta_tiles(q_len, prefix, Hq // Hkv, cfg.rows, cfg.tile)
        rf, hf = orders(tiles, Hkv, B, args.fixed)
        a, b = makespan(rf, slots), makespan(hf, slots)
        print(f"{name:22s} {slots:5d} {a:11.1f} {b:12.1f} {a / b:6.3f}")


if __name__ == "__main__":
    main()
