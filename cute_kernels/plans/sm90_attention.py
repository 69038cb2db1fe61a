"""What the SM90 attention kernels (paged decode and prefill, QSA) accept in common: the query and
cache dtypes and head dims of their shared Q staging, FP8 widening and WGMMA shapes; and what the
paged TMA kernels (decode, prefill) share: page sizes, cache layouts and containers. Host-only."""

from __future__ import annotations

Q_DTYPES = ("bf16", "fp16")
KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")  # a 16-bit cache must have the query's dtype
HEAD_DIMS = (64, 128, 256)

# the paged TMA kernels: one box is min(page, tile) tokens of one page
PAGE_SIZES = (16, 32, 64, 128)
KV_LAYOUTS = ("HND", "NHD")
KV_FORMS = ("single", "pair")  # one [P, 2, ...] cache tensor, or a (K, V) pair


def check_qkv(q_dtype: str, kv_dtype: str, head_dim: int) -> None:
    """Raise ``ValueError`` for a query dtype, cache dtype or head dim the kernels do not take."""
    if q_dtype not in Q_DTYPES:
        raise ValueError(f"q dtype must be bf16 or fp16, got {q_dtype}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype must be bf16, fp16 or fp8_e4m3, got {kv_dtype}")
    if kv_dtype != "fp8_e4m3" and kv_dtype != q_dtype:
        raise ValueError("a 16-bit KV cache must have the query's dtype")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim}")
