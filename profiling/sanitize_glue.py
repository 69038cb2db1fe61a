"""The layer glue and the merge under compute-sanitizer (memcheck, racecheck, synccheck,
initcheck: tests/gpu/test_sanitize_gpu.py; docs/design/testing.md#sanitizer):

    compute-sanitizer --tool initcheck --report-api-errors no --error-exitcode 9 python3 -m profiling.sanitize_glue

``quantize_query`` (per-tensor, per-KV-head and 0-d scales, fused-QKV views, RoPE with positions
outside the cos/sin cache), ``write_kv_cache`` into an exact-size cache (slots -1, past the cache,
2^31 - 1; FP8 and BF16, both layouts and containers) and ``merge_states`` (LSEs up to 1e4 with
empty splits and all-empty rows, strided partials, every output dtype): any out-of-bounds access,
uninitialized read or barrier misuse fails the run.
"""

from __future__ import annotations

import torch

import cute_kernels

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def main():
    g = torch.Generator(device="cuda").manual_seed(3)
    T, Hq, Hkv, D = 37, 32, 8, 128
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device="cuda", generator=g).to(BF16)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    for scale in (0.5, torch.tensor(0.25, device="cuda"), torch.rand(Hkv, device="cuda", generator=g) + 0.1):
        cute_kernels.quantize_query(q, scale)
    cos_sin = torch.randn(50, D, device="cuda", generator=g)
    pos = torch.randint(0, 50, (T,), device="cuda", generator=g)
    pos[0], pos[1] = -1, 50  # never read: those tokens' rotated dims are NaN
    cute_kernels.quantize_query(q, 0.5, rope=(cos_sin, pos))
    for cache_dtype in (FP8, BF16):
        for layout in ("HND", "NHD"):
            P, page = 3, 16
            shape = (P, 2, Hkv, page, D) if layout == "HND" else (P, 2, page, Hkv, D)
            cache = torch.zeros(shape, device="cuda", dtype=cache_dtype)  # exact size: no slack to hide in
            slots = torch.randperm(P * page, device="cuda", generator=g)[:T].to(torch.int64)
            slots[2], slots[5], slots[7] = -1, P * page, 2**31 - 1
            cute_kernels.write_kv_cache(k, v, cache, slots, kv_layout=layout, k_scale=0.0625, v_scale=0.5)
            cute_kernels.write_kv_cache(k, v, (cache[:, 0], cache[:, 1]), slots.int(), kv_layout=layout,
                                        k_scale=torch.tensor(0.0625, device="cuda"), v_scale=0.5)
    for out_dtype in (torch.float32, BF16, torch.float16):
        po = torch.randn(11, 9, 4, D + 32, device="cuda", generator=g)[..., 16:16 + D]
        pl = torch.randn(11, 9, 4, device="cuda", generator=g) * 5000
        pl[torch.rand(11, 9, 4, device="cuda", generator=g) < 0.3] = float("-inf")
        pl[:, 3] = float("-inf")
        cute_kernels.merge_states(po, pl, out_dtype=out_dtype)
    torch.cuda.synchronize()
    print("sanitize run finished")


if __name__ == "__main__":
    main()
