"""Plan of the paged KV-cache write (``common.write_kv_cache``).

Host-only. The kernel is :mod:`cute_kernels.common.kv_write`; design: docs/design/layer.md#the-design-as-it-stands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..jit.spec import ALL_TARGETS, DTYPE_BITS, KernelConfig, ScalarArg, TensorArg
from .quantize_query import FP8_TARGETS, ITEMS

NUM_THREADS = 256
VECTOR_WIDTHS = (16, 8, 4, 2, 1)  # elements per thread, widest first

# (token, head) rows per thread (docs/design/layer.md#rows-per-thread-and-pdl)
DEFAULT_ITEMS = 1
DEFAULT_PDL = True  # programmatic dependent launch: the launch overlaps the previous kernel's tail


@dataclass(frozen=True)
class WriteKVCacheConfig(KernelConfig):
    """Compile key of :class:`cute_kernels.common.kv_write.WriteKVCache`.

    ``in_dtype``: keys/values (bf16/fp16); ``cache_dtype``: bf16, fp16 or fp8_e4m3. ``vec``:
    elements per thread (16 needs 16-byte aligned inputs and, for an FP8 cache, 16-byte aligned
    cache strides; the op picks the widest the tensors allow). ``kv_form``: one 5-D cache
    (``"single"``) or a (k, v) pair of 4-D halves (``"pair"``); ``kv_layout``: HND or NHD.
    ``k_scale_tensor`` / ``v_scale_tensor``: that scale is a 1-element fp32 device tensor (read by
    the kernel, CUDA-graph safe) rather than a float argument. ``items``: (token, head) rows per
    thread, all loaded before the first store. ``pdl``: launched as a programmatic dependent launch
    (see :mod:`cute_kernels.roles.pdl`).
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
    num_threads: ClassVar[int] = NUM_THREADS

    def __post_init__(self):
        if self.in_dtype not in ("bf16", "fp16"):
            raise ValueError(f"write_kv_cache input dtype must be bf16 or fp16, got {self.in_dtype}")
        if self.cache_dtype not in ("bf16", "fp16", "fp8_e4m3"):
            raise ValueError(f"write_kv_cache cache dtype must be bf16, fp16 or fp8_e4m3, got {self.cache_dtype}")
        if self.vec not in VECTOR_WIDTHS or self.head_dim % self.vec:
            raise ValueError(f"head_dim {self.head_dim} is not a multiple of vec {self.vec}")
        if self.head_dim // self.vec > NUM_THREADS:
            raise ValueError(f"head_dim {self.head_dim} too large for vec {self.vec}")
        if self.page_size < 1 or self.slot_dtype not in ("int32", "int64"):
            raise ValueError(f"bad page_size/slot dtype {self.page_size}/{self.slot_dtype}")
        if self.kv_form not in ("single", "pair") or self.kv_layout not in ("HND", "NHD"):
            raise ValueError(f"bad kv_form/kv_layout {self.kv_form}/{self.kv_layout}")
        if self.items not in ITEMS:
            raise ValueError(f"items must be 1, 2 or 4, got {self.items}")

    @property  # per instance (the base: a class constant): FP8 conversion instructions need SM89+
    def targets(self) -> tuple[str, ...]:  # type: ignore[override]
        return FP8_TARGETS if self.cache_dtype == "fp8_e4m3" else ALL_TARGETS

    @property  # per instance (the base: a class constant): the conversion depends on the cache dtype
    def evidence(self) -> dict[str, tuple[tuple[str, str], ...]]:  # type: ignore[override]
        pats = [("16-byte loads", r"ld\.global(\.\w+)*\.v4\.b32"), ("div.rn.f32", r"div\.rn\.f32")]
        if self.cache_dtype == "fp8_e4m3":
            pats.append(("cvt.rn.satfinite.e4m3x2", r"cvt\.rn\.satfinite\.e4m3x2\.f32"))
        if self.vec * DTYPE_BITS[self.cache_dtype] >= 128:
            pats.append(("16-byte stores", r"st\.global(\.\w+)*\.v4\.b32"))
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
        from ..common.kv_write import WriteKVCache  # the kernel module imports the DSL: only here

        return WriteKVCache(self)


def aligned_vec(head_dim: int) -> int:
    """The elements per thread the op picks when every tensor is 16-byte aligned (the usual case:
    a cache, and keys/values that are views of a fused QKV projection of 16-byte rows)."""
    return next(v for v in VECTOR_WIDTHS if head_dim % v == 0 and head_dim // v <= NUM_THREADS)


def make_write_config(*, in_dtype: str, cache_dtype: str, head_dim: int, page_size: int, vec: int, slot_dtype: str,
                      kv_form: str, kv_layout: str, k_scale_tensor: bool, v_scale_tensor: bool,
                      override: dict | None = None) -> WriteKVCacheConfig:
    """The config the op uses for validated arguments (and the warm-up enumerates): the tuning
    defaults filled in here; ``override`` replaces fields (benchmarks)."""
    return WriteKVCacheConfig(in_dtype=in_dtype, cache_dtype=cache_dtype, head_dim=head_dim, page_size=page_size,
                              vec=vec, slot_dtype=slot_dtype, kv_form=kv_form, kv_layout=kv_layout,
                              k_scale_tensor=k_scale_tensor, v_scale_tensor=v_scale_tensor,
                              **{"items": DEFAULT_ITEMS, "pdl": DEFAULT_PDL, **(override or {})})


def compile_variants() -> list[WriteKVCacheConfig]:
    """FP8 and 16-bit caches, both layouts and containers, int32 and int64 slots, tensor scales."""
    return [
        WriteKVCacheConfig(in_dtype="bf16", cache_dtype="fp8_e4m3", head_dim=128, vec=16, pdl=True),
        WriteKVCacheConfig(in_dtype="bf16", cache_dtype="fp8_e4m3", head_dim=128, vec=16, slot_dtype="int32",
                           kv_form="pair", kv_layout="NHD", k_scale_tensor=True, v_scale_tensor=True),
        WriteKVCacheConfig(in_dtype="bf16", cache_dtype="bf16", head_dim=128, vec=16),
        WriteKVCacheConfig(in_dtype="fp16", cache_dtype="fp16", head_dim=256, page_size=32, vec=16,
                           slot_dtype="int32", kv_layout="NHD"),
        WriteKVCacheConfig(in_dtype="bf16", cache_dtype="fp8_e4m3", head_dim=64, vec=16, slot_dtype="int32"),
    ]
