"""Write new keys and values into the paged KV cache (the cache update of every attention step).

Token i goes to slot ``s = slot_mapping[i]``: page ``s // page_size``, offset ``s % page_size``.
A slot outside ``[0, P * page_size)`` (``-1`` marks padding) is skipped: the bounds check is the
only thing between a bad slot and an out-of-bounds write, so it is done on the 64-bit slot
against the cache's own page count, for every token. The cache stores ``x / scale`` (correctly
rounded fp32 division, :mod:`cute_kernels.roles.fdiv`) converted with round-to-nearest-even: saturated to ±448 for
float8_e4m3fn (``cvt.rn.satfinite.e4m3x2.f32``), plain for bf16/fp16. The codes are those of
:func:`cute_kernels.reference.write_kv_cache`.

Memory-bound: a thread moves ``vec`` consecutive elements of one (token, KV head) row, of both K
and V (16 for 16-byte aligned tensors: two 16-byte loads each, and one 16-byte store each into an
FP8 cache, two into a 16-bit one); all four loads are issued before the first store. The cache is
passed as the caller's 5-D tensor (twice) or as its K and V halves and re-viewed inside the
kernel's host function, so the torch side never slices it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..roles.fdiv import divide_by_scale
from ..roles.pdl import wait_then_release_dependents


class WriteKVCache:
    """Kernel: ``mKey``/``mValue [T, Hkv, D]`` -> paged cache at ``mSlots [T]`` (int32/int64)."""

    def __init__(self, cfg):
        self.pdl = cfg.pdl
        self.items = cfg.items
        self.fp8 = cfg.cache_dtype == "fp8_e4m3"
        self.head_dim = cfg.head_dim
        self.page_size = cfg.page_size
        self.vec = cfg.vec
        self.kv_form = cfg.kv_form
        self.kv_layout = cfg.kv_layout
        self.lanes = cfg.head_dim // cfg.vec  # threads per (token, head) row
        self.rows_per_cta = max(1, cfg.num_threads // self.lanes)
        self.num_threads = self.rows_per_cta * self.lanes

    @cute.jit
    def __call__(
        self,
        mKey: cute.Tensor,  # [T, Hkv, D]
        mValue: cute.Tensor,  # [T, Hkv, D]
        mKc: cute.Tensor,  # "single": the 5-D cache [P, 2, ...] (passed twice); "pair": K and V halves
        mVc: cute.Tensor,
        mSlots: cute.Tensor,  # [T] int32/int64
        k_scale,  # Float32 or [1] fp32 tensor
        v_scale,
        stream,
    ):
        if const_expr(self.kv_form == "single"):
            mK4 = mKc[None, 0, None, None, None]
            mV4 = mVc[None, 1, None, None, None]
        else:
            mK4, mV4 = mKc, mVc
        # (page, head, offset, d) views whatever the layout
        order = [0, 1, 2, 3] if const_expr(self.kv_layout == "HND") else [0, 2, 1, 3]
        mK = cute.make_tensor(mK4.iterator, cute.select(mK4.layout, mode=order))
        mV = cute.make_tensor(mV4.iterator, cute.select(mV4.layout, mode=order))
        num_rows = mKey.shape[0] * mKey.shape[1]
        per_cta = self.rows_per_cta * self.items
        grid_x = (num_rows + per_cta - 1) // per_cta
        self.kernel(mKey, mValue, mK, mV, mSlots, k_scale, v_scale).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mKey: cute.Tensor, mValue: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mSlots: cute.Tensor,
               k_scale, v_scale):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if const_expr(self.pdl):
            wait_then_release_dependents()
        num_heads = mKey.shape[1]
        num_rows = mKey.shape[0] * num_heads
        lane = tidx % self.lanes
        num_slots = Int64(mK.shape[0]) * self.page_size
        # every item's loads (slot, key and value chunks) are issued before the first store: the
        # compiler cannot move a load above a store that may alias it, and 2 x items rows in
        # flight per thread hide more latency. Rows past the end load the last row, store nothing.
        rows, hs, slots, keys, values = [], [], [], [], []
        for i in cutlass.range_constexpr(self.items):
            row = (bidx * self.items + i) * self.rows_per_cta + tidx // self.lanes
            r = cutlass.min(row, num_rows - 1)
            t = r // num_heads
            h = r - t * num_heads
            tKrK = cute.make_rmem_tensor((self.vec,), mKey.element_type)
            tVrV = cute.make_rmem_tensor((self.vec,), mValue.element_type)
            tKrK.store(cute.local_tile(mKey[t, h, None], (self.vec,), (lane,)).load())
            tVrV.store(cute.local_tile(mValue[t, h, None], (self.vec,), (lane,)).load())
            rows.append(row)
            hs.append(h)
            slots.append(Int64(mSlots[t]))
            keys.append(tKrK)
            values.append(tVrV)
        ks, vs = self.scale_value(k_scale), self.scale_value(v_scale)
        for i in cutlass.range_constexpr(self.items):
            slot = slots[i]
            if rows[i] < num_rows and slot >= Int64(0) and slot < num_slots:
                page = Int32(slot // self.page_size)
                offset = Int32(slot - Int64(page) * self.page_size)
                self.store_row(keys[i], mK, ks, page, hs[i], offset, lane)
                self.store_row(values[i], mV, vs, page, hs[i], offset, lane)

    @cute.jit
    def scale_value(self, scale):
        if const_expr(isinstance(scale, cute.Tensor)):
            return scale[0]
        return Float32(scale)

    @cute.jit
    def store_row(self, raw, mCache, s, page, h, offset, lane):
        """``mCache[page, h, offset, chunk lane] = convert(raw / s)``."""
        tXrX = cute.make_rmem_tensor((self.vec,), Float32)
        tXrX.store(raw.load().to(Float32))
        # correctly rounded, like the reference's division (16-bit caches keep subnormal quotients)
        divide_by_scale(tXrX, s, exact_subnormals=not self.fp8)
        gC = cute.local_tile(mCache[page, h, offset, None], (self.vec,), (lane,))
        gC.store(tXrX.load().to(mCache.element_type))
