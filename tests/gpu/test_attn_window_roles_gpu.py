"""The arch-neutral device roles the SM100 kernels use for windows, splits and sinks
(``roles/attn_window.py``, ``roles/sinks.py``), run on the H200 against Python formulas written
here: no Blackwell GPU exists for this project, but these pieces run anywhere, so their device code
is proven where it can be (thousands of random inputs, edge cases included)."""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import sm90_only

pytestmark = sm90_only()
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402

from cute_kernels.roles.attn_window import (  # noqa: E402
    box_visible,
    decode_key_range,
    key_visible,
    prefill_key_range,
    split_tiles,
)
from cute_kernels.roles.sinks import LOG2E, fold_sink  # noqa: E402

TILE = 128
N_INT_IN, N_INT_OUT = 9, 12


class RoleProbe:
    """One thread per input row: every role function on that row's integers and floats."""

    @cute.jit
    def __call__(self, mI: cute.Tensor, mO: cute.Tensor, mF: cute.Tensor, mG: cute.Tensor):
        n = mI.shape[0]
        self.kernel(mI, mO, mF, mG).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1])

    @cute.kernel
    def kernel(self, mI: cute.Tensor, mO: cute.Tensor, mF: cute.Tensor, mG: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < mI.shape[0]:
            seq_len, q_len, window = mI[i, 0], mI[i, 1], mI[i, 2]
            split, num_splits, k_pos, q_pos, row = mI[i, 3], mI[i, 4], mI[i, 5], mI[i, 6], mI[i, 7]
            kv_end = mI[i, 8]  # the length clamped to the block table's capacity
            lo, hi = decode_key_range(seq_len, q_len, window, kv_end)
            first, step, count = split_tiles(lo, hi, TILE, split, num_splits)
            plo, phi = prefill_key_range(seq_len, q_len, row, q_len - 1, True, window, kv_end)
            nlo, nhi = prefill_key_range(seq_len, q_len, row, q_len - 1, False, window, kv_end)
            mO[i, 0], mO[i, 1], mO[i, 2], mO[i, 3], mO[i, 4] = lo, hi, first, step, count
            mO[i, 5] = Int32(key_visible(k_pos, q_pos, kv_end, True, window))
            mO[i, 6] = Int32(key_visible(k_pos, q_pos, kv_end, True, Int32(-1)))
            mO[i, 7] = Int32(key_visible(k_pos, q_pos, kv_end, False, window))
            mO[i, 8] = Int32(box_visible(k_pos, 16, lo, hi))
            mO[i, 9], mO[i, 10], mO[i, 11] = plo, phi, nhi - nlo
            big, total, keep = fold_sink(mF[i, 0], mF[i, 1], mF[i, 2] * Float32(LOG2E))
            mG[i, 0], mG[i, 1], mG[i, 2] = big, total, keep


def _python(row_i, row_f):
    seq_len, q_len, w, split, S, k, qp, row, kv_end = row_i
    def start(p):
        return max(p - w, 0) if w >= 0 else 0
    lo, hi = start(seq_len - q_len), kv_end
    first_t, end_t = lo // TILE, (hi + TILE - 1) // TILE
    total = max(end_t - first_t, 0)
    count = (total - split + S - 1) // S if split < total else 0
    vis_c = k < kv_end and k <= qp and (w < 0 or k >= qp - w)
    vis_n = k < kv_end and (w < 0 or k >= qp - w)
    plo = start(seq_len - q_len + row)
    phi = min(seq_len - q_len + (q_len - 1) + 1, kv_end)
    vis_all = k < kv_end and k <= qp  # no window
    out_i = [lo, hi, first_t + split, S, count, int(vis_c), int(vis_all), int(vis_n), int(k < hi and k + 16 > lo),
             plo, phi, kv_end - plo]
    m, row_sum, s = row_f
    sl = s * math.log2(math.e)
    big = max(m, sl)
    keep = 0.0 if m == -math.inf else 2.0 ** (m - big)
    extra = 0.0 if sl == -math.inf else 2.0 ** (sl - big)
    return out_i, [big, row_sum * keep + extra, keep]


def test_roles_match_python():
    from cutlass.cute.runtime import from_dlpack

    g = torch.Generator().manual_seed(123)
    n = 4096
    seq = torch.randint(1, 5000, (n,), generator=g)
    q_len = torch.minimum(torch.randint(1, 9, (n,), generator=g), seq)
    window = torch.where(torch.rand(n, generator=g) < 0.3, -1, torch.randint(0, 3000, (n,), generator=g))
    splits = torch.randint(1, 17, (n,), generator=g)
    split = torch.minimum(torch.randint(0, 20, (n,), generator=g), splits - 1)
    k_pos = torch.randint(-5, 5005, (n,), generator=g)
    q_pos = seq - q_len + torch.randint(0, 8, (n,), generator=g) % q_len
    row = torch.randint(0, 8, (n,), generator=g) % q_len
    # a block table's capacity below the length for a third of the rows (docs/design/inputs.md#lengths)
    capacity = torch.where(torch.rand(n, generator=g) < 0.33, torch.randint(0, 5000, (n,), generator=g), seq)
    kv_end = torch.clamp(torch.minimum(seq, capacity), min=0)
    ints = torch.stack([seq, q_len, window, split, splits, k_pos, q_pos, row, kv_end], dim=1).to(torch.int32)
    m = torch.randn(n, generator=g) * 20
    m[::7] = -math.inf
    s = torch.randn(n, generator=g) * 5
    s[::11] = -math.inf
    floats = torch.stack([m, torch.rand(n, generator=g) * 100, s], dim=1).float()
    out_i = torch.full((n, N_INT_OUT), -12345, dtype=torch.int32, device="cuda")
    out_f = torch.full((n, 3), float("nan"), device="cuda")
    args = [from_dlpack(t) for t in (ints.cuda(), out_i, floats.cuda(), out_f)]
    fn = cute.compile(RoleProbe(), *args, options="--gpu-arch sm_90a")
    fn(*args)
    torch.cuda.synchronize()
    got_i, got_f = out_i.cpu().tolist(), out_f.cpu().double()
    for r in range(n):
        want_i, want_f = _python(ints[r].tolist(), floats[r].tolist())
        assert got_i[r] == want_i, (r, ints[r].tolist(), got_i[r], want_i)
        for j in range(3):
            a, b = float(got_f[r, j]), want_f[j]
            assert (a == b) if math.isinf(b) else abs(a - b) <= 1e-5 * max(1.0, abs(b)), (r, j, a, b)
