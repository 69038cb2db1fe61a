"""Write new keys and values into the paged KV cache (the cache update of every attention step).

Token i goes to slot ``s = slot_mapping[i]``: page ``s // page_size``, offset ``s % page_size``.
A slot outside ``[0, P * page_size)`` (``-1`` marks padding) is skipped: the bounds check is the
only thing between a bad slot and an out-of-bounds write, so it is done on the 64-bit slot
against the cache's own page count, for every token. The cache stores ``x / scale`` (correctly
rounded fp32 division, :mod:`cute_kernels.common.fdiv`) converted with round-to-nearest-even: saturated to ±448 for
float8_e4m3fn (``cvt.rn.satfinite.e4m3x2.f32``), plain for bf16/fp16. The codes are those of
:func:`cute_kernels.reference.write_kv_cache`.

Memory-bound: a thread moves ``vec`` consecutive elements of one (token, KV head) row, of both K
and V (16 for 16-byte aligned tensors: two 16-byte loads each, and one 16-byte store each into an
FP8 cache, two into a 16-bit one); all four loads are issued before the first store. The cache is
passed as the caller's 5-D tensor (twice) or as its K and V halves and re-viewed inside the
kernel's host function, so the torch side never slices it.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..jit.compiler import ALL_TARGETS, KernelConfig
from ..jit.dtypes import DTYPE_BITS, cute_dtype
from ..jit.spec import ScalarArg, TensorArg
from .fdiv import divide_by_scale
from .pdl import wait_then_release_dependents
from .quantize import FP8_TARGETS

_THREADS = 256
VECTOR_WIDTHS = (16, 8, 4, 2, 1)  # elements per thread, widest first


class WriteKVCache:
    """Kernel: ``mKey``/``mValue [T, Hkv, D]`` -> paged cache at ``mSlots [T]`` (int32/int64)."""

    def __init__(self, head_dim: int, page_size: int, vec: int, kv_form: str, kv_layout: str, items: int = 1,
                 fp8: bool = True, pdl: bool = False):
        self.pdl = pdl
        self.items = items
        self.fp8 = fp8
        self.head_dim = head_dim
        self.page_size = page_size
        self.vec = vec
        self.kv_form = kv_form
        self.kv_layout = kv_layout
        self.lanes = head_dim // vec  # threads per (token, head) row
        self.rows_per_cta = max(1, _THREADS // self.lanes)
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


@dataclass(frozen=True)
class WriteKVCacheConfig(KernelConfig):
    """Compile key of :class:`WriteKVCache`.

    ``in_dtype``: keys/values (bf16/fp16); ``cache_dtype``: bf16, fp16 or fp8_e4m3. ``vec``:
    elements per thread (16 needs 16-byte aligned inputs and, for an FP8 cache, 16-byte aligned
    cache strides; the op picks the widest the tensors allow). ``kv_form``: one 5-D cache
    (``"single"``) or a (k, v) pair of 4-D halves (``"pair"``); ``kv_layout``: HND or NHD.
    ``k_scale_tensor`` / ``v_scale_tensor``: that scale is a 1-element fp32 device tensor (read by
    the kernel, CUDA-graph safe) rather than a float argument. ``items``: (token, head) rows per
    thread, all loaded before the first store. ``pdl``: launched as a programmatic dependent launch
    (see :mod:`cute_kernels.common.pdl`).
    """

    in_dtype: str = "bf16"
    cache_dtype: str = "fp8_e4m3"
    head_dim: int = 128
    page_size: int = 16
    vec: int = 16
    slot_dtype: str = "int64"
    kv_form: str = "single"
    kv_layout: str = "HND"
    k_scale_tensor: bool = False
    v_scale_tensor: bool = False
    items: int = 1
    pdl: bool = False

    kernel_id = "common.write_kv_cache"

    def __post_init__(self):
        if self.in_dtype not in ("bf16", "fp16"):
            raise ValueError(f"write_kv_cache input dtype must be bf16 or fp16, got {self.in_dtype}")
        if self.cache_dtype not in ("bf16", "fp16", "fp8_e4m3"):
            raise ValueError(f"write_kv_cache cache dtype must be bf16, fp16 or fp8_e4m3, got {self.cache_dtype}")
        if self.vec not in VECTOR_WIDTHS or self.head_dim % self.vec:
            raise ValueError(f"head_dim {self.head_dim} is not a multiple of vec {self.vec}")
        if self.head_dim // self.vec > _THREADS:
            raise ValueError(f"head_dim {self.head_dim} too large for vec {self.vec}")
        if self.page_size < 1 or self.slot_dtype not in ("int32", "int64"):
            raise ValueError(f"bad page_size/slot dtype {self.page_size}/{self.slot_dtype}")
        if self.kv_form not in ("single", "pair") or self.kv_layout not in ("HND", "NHD"):
            raise ValueError(f"bad kv_form/kv_layout {self.kv_form}/{self.kv_layout}")
        if self.items not in (1, 2, 4):
            raise ValueError(f"items must be 1, 2 or 4, got {self.items}")

    @property
    def targets(self):  # per instance: FP8 conversion instructions need SM89+
        return FP8_TARGETS if self.cache_dtype == "fp8_e4m3" else ALL_TARGETS

    @property
    def evidence(self):  # per instance: the conversion depends on the cache dtype
        pats = [r"ld\.global(\.\w+)*\.v4\.b32", r"div\.rn\.f32"]
        if self.cache_dtype == "fp8_e4m3":
            pats.append(r"cvt\.rn\.satfinite\.e4m3x2\.f32")
        if self.vec * DTYPE_BITS[self.cache_dtype] >= 128:
            pats.append(r"st\.global(\.\w+)*\.v4\.b32")
        return {t: tuple(pats) for t in self.targets}

    def _align(self, dtype: str) -> int:
        return min(16, self.vec * DTYPE_BITS[dtype] // 8)

    def signature(self):
        D, page = self.head_dim, self.page_size
        inner = ("Hkv", page) if self.kv_layout == "HND" else (page, "Hkv")
        cache = ("P", 2, *inner, D) if self.kv_form == "single" else ("P", *inner, D)
        ks = TensorArg("k_scale", "fp32", (1,), align=4) if self.k_scale_tensor else ScalarArg("k_scale", "fp32")
        vs = TensorArg("v_scale", "fp32", (1,), align=4) if self.v_scale_tensor else ScalarArg("v_scale", "fp32")
        return (
            TensorArg("key", self.in_dtype, ("T", "Hkv", D), align=self._align(self.in_dtype)),
            TensorArg("value", self.in_dtype, ("T", "Hkv", D), align=self._align(self.in_dtype)),
            TensorArg("k_cache", self.cache_dtype, cache, align=self._align(self.cache_dtype)),
            TensorArg("v_cache", self.cache_dtype, cache, align=self._align(self.cache_dtype)),
            TensorArg("slot_mapping", self.slot_dtype, ("T",), align=DTYPE_BITS[self.slot_dtype] // 8),
            ks,
            vs,
        )

    def build(self):
        cute_dtype(self.cache_dtype)
        return WriteKVCache(self.head_dim, self.page_size, self.vec, self.kv_form, self.kv_layout, self.items,
                            self.cache_dtype == "fp8_e4m3", self.pdl)
