"""Query quantization to FP8 e4m3, optionally fused with NeoX-style rotary embedding.

``out = saturate(RNE(rope(q) / q_scale))`` per element, bit-exact with
:func:`cute_kernels.reference.quantize_query`:

- **Division.** Correctly rounded fp32 division, as ``div.rn.f32`` would give, not a multiply by
  the reciprocal (one ulp off for a large share of inputs, which flips some FP8 roundings);
  computed from one reciprocal per thread and two FMA corrections per element
  (:mod:`cute_kernels.roles.fdiv`) because a ``div.rn.f32`` per element made the kernel
  issue-bound.
- **Conversion.** The vector ``.to(Float8E4M3FN)`` lowers to ``cvt.rn.satfinite.e4m3x2.f32``:
  round to nearest even, ±inf and anything beyond ±448 saturate to ±448, NaN stays NaN; the same
  codes as the reference's ``clamp(-448, 448).to(float8_e4m3fn)``.
- **RoPE.** For ``i < rot/2`` (NeoX pairs ``(i, i + rot/2)``), ``o_i = x_i cos_i - x_j sin_i`` and
  ``o_j = x_j cos_i + x_i sin_i``, each product and the sum rounded to fp32 separately, as torch's
  elementwise ops do. The DSL lets LLVM contract ``a * b + c`` into one FMA (a different
  rounding), so the rotation is written in inline PTX with ``.rn`` operations, which are never
  contracted. A position outside ``[0, max_pos)`` is never dereferenced: its rotated dims become
  NaN (as in the reference) so the misuse is visible.

- **Residual** (``residual`` variants, the two-term query of
  docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2): the same fp32 ``x`` (the
  rotated value divided by the scale, never re-read) minus the float value of its code, converted
  again: ``lo = saturate(RNE(x - float(hi)))``, the reference's ``query_residual`` bit for bit.
  ``float(hi)`` is exact (``cvt.rn.f16x2.e4m3x2``, then f16 -> f32), and so is the subtraction
  for ``|x| <= 448``: ``hi`` is a round-to-nearest of ``x`` to a coarser format, so it is a
  multiple of ``ulp32(x)`` (RN never leaves ``x``'s binade downwards: its lower bound is an e4m3
  value, or ``hi`` is a subnormal code or 0, multiples of ``2^-9``) and ``|x - hi| <= |x|`` (0 is a
  candidate), so ``x - hi`` is an integer multiple of ``ulp32(x)`` no larger than ``x``: 24 bits.
  Beyond 448 ``hi`` saturates and both compute the same RN ``sub`` (``lo`` saturates too). It is
  written as inline ``sub.rn.f32``, which is never contracted or flushed.

Memory-bound: every thread handles ``vec`` consecutive elements of one head (16 for 16-byte
aligned tensors: two 16-byte loads of q, one 16-byte store of the FP8 codes). One head row is
``head_dim / vec`` consecutive threads. With RoPE one thread owns both chunks of a rotation pair
(``vec`` elements at ``i`` and at ``i + rot/2``) and reads ``vec`` cos and ``vec`` sin values of its
token once for both (every head of the token re-reads them from cache).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float8E4M3FN, Float32, Int32, Int64, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op

from ..jit.asm import asm
from ..jit.spec import bind_arguments
from ..roles.fdiv import divide_by_scale
from ..roles.pdl import wait_then_release_dependents


@dsl_user_op
def mul_add_rn(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Float32:
    """``RN(RN(a * b) + RN(c * d))``: three separately rounded fp32 operations, no FMA."""
    res = asm([T.f32()], [Float32(x) for x in (a, b, c, d)],
              "{\n\t.reg .f32 p, q;\n\tmul.rn.f32 p, $1, $2;\n\tmul.rn.f32 q, $3, $4;\n\tadd.rn.f32 $0, p, q;\n\t}",
              "=f,f,f,f,f", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def sub_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """``RN(a - b)`` as ``sub.rn.f32``: never contracted with a neighbouring multiply, no flush."""
    return Float32(asm([T.f32()], [Float32(a), Float32(b)], "sub.rn.f32 $0, $1, $2;", "=f,f,f", loc=loc, ip=ip))


class QuantizeQuery:
    """Kernel: ``mQ [T, Hq, D]`` (bf16/fp16) -> ``mOut [T, Hq, D]`` float8_e4m3fn, with fused NeoX
    RoPE when the config has a ``rot_dim``: ``mCosSin [max_pos, rot_dim]`` (cos in the first half
    of each row, sin in the second) and ``mPos [T]`` (int32/int64).

    ``q_scale`` is a Float32 or an fp32 tensor ``[S]`` (S = 1 or Hkv; head h reads
    ``q_scale[h * S // Hq]``, i.e. ``h // (Hq // S)``). With ``residual`` in the config, ``mLo
    [T, Hq, D]`` float8_e4m3fn receives the second term ``e4m3(x - float(hi))``.
    """

    def __init__(self, cfg):
        self.arg_names = cfg.arg_names()
        self.pdl = cfg.pdl
        self.head_dim = head_dim = cfg.head_dim
        self.vec = vec = cfg.vec
        self.rot_dim = rot_dim = cfg.rot_dim
        self.items = cfg.items
        self.residual = cfg.residual
        # chunks of vec elements per head row; with RoPE one thread owns both chunks of a
        # rotation pair (i, i + rot/2), so the partner half is loaded once and cos/sin serve two
        # outputs
        self.pair_lanes = rot_dim // 2 // vec
        self.lanes = head_dim // vec - self.pair_lanes  # threads per head row
        self.rows_per_cta = max(1, cfg.num_threads // self.lanes)  # per item
        self.num_threads = self.rows_per_cta * self.lanes

    @cute.jit
    def __call__(self, *args):
        """The config's arguments (``q, out, q_scale`` and, with RoPE, ``cos_sin_cache, positions``)
        and the stream."""
        a = bind_arguments(self.arg_names, args)
        self.launch(a["q"], a["out"], a["q_scale"], a.get("cos_sin_cache"), a.get("positions"), a.get("residual_out"),
                    a["stream"])

    @cute.jit
    def launch(self, mQ, mOut, q_scale, mCosSin, mPos, mLo, stream):
        num_rows = mQ.shape[0] * mQ.shape[1]
        per_cta = self.rows_per_cta * self.items
        grid_x = (num_rows + per_cta - 1) // per_cta
        self.kernel(mQ, mOut, q_scale, mCosSin, mPos, mLo).launch(
            grid=[grid_x, 1, 1], block=[self.num_threads, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mOut: cute.Tensor, q_scale, mCosSin, mPos, mLo):
        """A thread owns one chunk (or rotation pair) of ``items`` consecutive head rows. Every
        item's loads are issued before any item is converted, so a thread keeps ``items`` rows in
        flight; rows past the end are clamped to the last row for the loads and not stored. With
        RoPE the op only picks ``items`` dividing Hq, so a thread's rows are heads of one token
        and share its position and cos/sin values (loaded once)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if const_expr(self.pdl):
            wait_then_release_dependents()
        num_heads = mQ.shape[1]
        num_rows = mQ.shape[0] * num_heads
        lane = tidx % self.lanes
        base = (bidx * self.rows_per_cta + tidx // self.lanes) * self.items
        rope_lane = const_expr(self.rot_dim > 0) and lane < self.pair_lanes
        # dims past rot_dim pass through unrotated
        chunk = lane + self.pair_lanes if const_expr(self.rot_dim > 0) else lane
        first = cutlass.min(base, num_rows - 1)
        t0 = first // num_heads
        h0 = first - t0 * num_heads
        if const_expr(self.rot_dim > 0):
            # position first: it heads the longest dependent chain (position -> cos/sin)
            pos = Int64(mPos[t0])
        ts, hs, raw_x, raw_y = [], [], [], []
        for i in cutlass.range_constexpr(self.items):
            if const_expr(self.rot_dim > 0):
                t, h = t0, cutlass.min(h0 + i, num_heads - 1)
            else:
                r = cutlass.min(base + i, num_rows - 1)
                t = r // num_heads
                h = r - t * num_heads
            ts.append(t)
            hs.append(h)
            gQ = mQ[t, h, None]
            x = cute.make_rmem_tensor((self.vec,), mQ.element_type)
            if const_expr(self.rot_dim > 0):
                y = cute.make_rmem_tensor((self.vec,), mQ.element_type)
                if rope_lane:
                    x.store(cute.local_tile(gQ, (self.vec,), (lane,)).load())
                    y.store(cute.local_tile(gQ, (self.vec,), (lane + self.pair_lanes,)).load())
                else:
                    x.store(cute.local_tile(gQ, (self.vec,), (chunk,)).load())
                raw_y.append(y)
            else:
                x.store(cute.local_tile(gQ, (self.vec,), (chunk,)).load())
            raw_x.append(x)
        if const_expr(self.rot_dim > 0):
            tCrC = cute.make_rmem_tensor((self.vec,), Float32)
            tCrS = cute.make_rmem_tensor((self.vec,), Float32)
            valid = pos >= Int64(0) and pos < Int64(mCosSin.shape[0])
            if rope_lane:
                p = Int32(pos) if valid else Int32(0)  # never dereference an out-of-range position
                tCrC.store(cute.local_tile(mCosSin[p, None], (self.vec,), (lane,)).load().to(Float32))
                tCrS.store(cute.local_tile(mCosSin[p, None], (self.vec,), (lane + self.pair_lanes,)).load()
                           .to(Float32))
        for i in cutlass.range_constexpr(self.items):
            t, h = ts[i], hs[i]
            if const_expr(isinstance(q_scale, cute.Tensor)):
                scale = q_scale[h * q_scale.shape[0] // num_heads]
            else:
                scale = Float32(q_scale)
            gOut = mOut[t, h, None]
            gLo = mLo[t, h, None] if const_expr(self.residual) else None
            if base + i < num_rows:
                if const_expr(self.rot_dim > 0):
                    if rope_lane:
                        self.rotate_pair(raw_x[i], raw_y[i], gOut, gLo, scale, tCrC, tCrS, valid, lane)
                    else:
                        self.quantize_chunk(raw_x[i], gOut, gLo, scale, chunk)
                else:
                    self.quantize_chunk(raw_x[i], gOut, gLo, scale, chunk)

    @cute.jit
    def quantize_chunk(self, raw, gOut, gLo, scale, chunk):
        tQrQ = cute.make_rmem_tensor((self.vec,), Float32)
        tQrQ.store(raw.load().to(Float32))
        divide_by_scale(tQrQ, scale, exact_subnormals=False)  # FP8 codes: see fdiv.py
        self.store_terms(tQrQ, gOut, gLo, chunk)

    @cute.jit
    def store_terms(self, tXrX, gOut, gLo, chunk):
        """The codes of ``x`` (``tXrX``, fp32) into chunk ``chunk`` of ``gOut``; with ``residual``,
        ``e4m3(x - float(hi))`` into ``gLo`` (exact subtraction: see the module docstring)."""
        if const_expr(not self.residual):
            cute.local_tile(gOut, (self.vec,), (chunk,)).store(tXrX.load().to(gOut.element_type))
        else:
            hi = tXrX.load().to(gOut.element_type)
            cute.local_tile(gOut, (self.vec,), (chunk,)).store(hi)
            tLrL = cute.make_rmem_tensor((self.vec,), Float32)
            tLrL.store(hi.to(Float32))  # exact: e4m3 -> f16x2 -> f32
            for e in cutlass.range_constexpr(self.vec):
                tLrL[e] = sub_rn(tXrX[e], tLrL[e])
            cute.local_tile(gLo, (self.vec,), (chunk,)).store(tLrL.load().to(Float8E4M3FN))

    @cute.jit
    def rotate_pair(self, raw_x, raw_y, gOut, gLo, scale, tCrC, tCrS, valid, pair):
        """NeoX rotation of chunks ``pair`` (x, first half) and ``pair + rot/2`` (y), quantized;
        an out-of-range position makes the rotated dims NaN (as in the reference)."""
        other = pair + self.pair_lanes
        tQrX = cute.make_rmem_tensor((self.vec,), Float32)
        tQrY = cute.make_rmem_tensor((self.vec,), Float32)
        tQrX.store(raw_x.load().to(Float32))
        tQrY.store(raw_y.load().to(Float32))
        for e in cutlass.range_constexpr(self.vec):
            c, s = tCrC[e], tCrS[e]
            x, y = tQrX[e], tQrY[e]
            tQrX[e] = mul_add_rn(x, c, y, -s)  # x c - y s = RN(x c) + RN(y (-s))
            tQrY[e] = mul_add_rn(y, c, x, s)  # y c + x s
        if not valid:
            tQrX.fill(float("nan"))
            tQrY.fill(float("nan"))
        divide_by_scale(tQrX, scale, exact_subnormals=False)
        divide_by_scale(tQrY, scale, exact_subnormals=False)
        self.store_terms(tQrX, gOut, gLo, pair)
        self.store_terms(tQrY, gOut, gLo, other)
