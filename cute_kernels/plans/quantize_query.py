"""Plan of the query quantization to FP8 with optional fused NeoX RoPE (``common.quantize_query``).

Host-only. The kernel is :mod:`cute_kernels.common.quantize`; design: docs/design/layer.md#the-design-as-it-stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..jit.spec import DTYPE_BITS, LABEL_IF_SET, Arg, KernelConfig, ScalarArg, TensorArg
from .hw import FP8_CVT_TARGETS, PDL_TARGETS

NUM_THREADS = 256
VECTOR_WIDTHS = (16, 8, 4, 2, 1)  # elements per thread, widest first
ROPE_MAX_VEC = 8  # with RoPE a thread owns two chunks (a rotation pair): 2 x 8 elements
FP8_TARGETS = FP8_CVT_TARGETS  # the conversion instructions the kernel is built from
ITEMS = (1, 2, 4)

# head rows per thread (docs/design/layer.md#rows-per-thread-and-pdl)
DEFAULT_ITEMS = 2
# RoPE: 2 rows per thread when 2 divides Hq (a thread's rows share one token's cos/sin), measured
# on SM90 only; other targets keep 1 (on sm_100a the 2-row RoPE kernel spills a register)
DEFAULT_ITEMS_ROPE = {"sm_90a": 2}
# programmatic dependent launch: the launch overlaps the previous kernel's tail (griddepcontrol:
# from SM90 on, so SM89 launches plainly)
DEFAULT_PDL = True

# the residual variant (``residual=True``: the two-term query's second term in the same pass) has
# its own registry entry (docs/design/sm90-prefill.md#two-term-fp8-query-opt-in-q_terms2)
RESIDUAL_ID = "common.quantize_query_residual"


@dataclass(frozen=True)
class QuantizeQueryConfig(KernelConfig):
    """Compile key of :class:`cute_kernels.common.quantize.QuantizeQuery`.

    ``vec``: elements per thread (16 needs 16-byte aligned q/out pointers and strides; the op
    picks the widest the tensors allow). ``scale_tensor``: q_scale is an fp32 device tensor
    (``[1]`` or ``[Hkv]``, read by the kernel so CUDA-graph replays see new values) rather than a
    float argument. ``rot_dim`` > 0 fuses NeoX RoPE over the first ``rot_dim`` dims, with a
    ``cos_sin_dtype`` cache and ``pos_dtype`` positions. ``items``: consecutive head rows per thread
    (their loads are all in flight before the first conversion); with RoPE it must divide Hq (the
    thread's rows then share one token's position and cos/sin). ``pdl``: launched as a programmatic
    dependent launch (see :mod:`cute_kernels.roles.pdl`). ``residual``: also write the two-term
    query's second term ``e4m3(x - float(hi))`` into ``residual_out`` (one more e4m3 store per
    chunk; left out of the label when False, so the one-term variants keep their labels).
    """

    q_dtype: str = "bf16"
    head_dim: int = 128
    vec: int = 16
    scale_tensor: bool = False
    rot_dim: int = 0
    cos_sin_dtype: str = "fp32"
    pos_dtype: str = "int64"
    items: int = 1
    pdl: bool = False
    residual: bool = field(default=False, metadata=LABEL_IF_SET)

    kernel_id = "common.quantize_query"
    targets = FP8_TARGETS
    num_threads: ClassVar[int] = NUM_THREADS

    @property  # per instance (the base: a class constant)
    def evidence(self) -> dict[str, tuple[tuple[str, str], ...]]:  # type: ignore[override]
        """16-byte loads of q, the saturating RNE conversion and the exact division; with
        ``residual``, the codes widened back exactly (e4m3 -> f16x2) and the uncontracted
        ``sub.rn.f32`` of ``x - float(hi)``."""
        residual = ((("e4m3 -> f16x2 (hi back to float)", r"cvt\.rn\.f16x2\.e4m3x2"),
                     ("sub.rn.f32 (x - hi)", r"sub\.rn\.f32")) if self.residual else ())
        return {t: (("16-byte loads", r"ld\.global(\.\w+)*\.v4\.b32"),
                    ("cvt.rn.satfinite.e4m3x2", r"cvt\.rn\.satfinite\.e4m3x2\.f32"),
                    ("div.rn.f32", r"div\.rn\.f32"), *residual) for t in FP8_TARGETS}

    def __post_init__(self):
        if self.q_dtype not in ("bf16", "fp16"):
            raise ValueError(f"quantize_query input dtype must be bf16 or fp16, got {self.q_dtype}")
        if self.vec not in VECTOR_WIDTHS or self.head_dim % self.vec:
            raise ValueError(f"head_dim {self.head_dim} is not a multiple of vec {self.vec}")
        if self.head_dim // self.vec > NUM_THREADS:
            raise ValueError(f"head_dim {self.head_dim} too large for vec {self.vec}")
        if self.items not in ITEMS:
            raise ValueError(f"items must be 1, 2 or 4, got {self.items}")
        if self.rot_dim:
            if self.vec > ROPE_MAX_VEC:
                raise ValueError(f"rot_dim > 0 (RoPE) needs vec <= {ROPE_MAX_VEC} (a thread owns two chunks), got vec {self.vec}")
            if self.rot_dim % 2 or self.rot_dim > self.head_dim or (self.rot_dim // 2) % self.vec:
                raise ValueError(f"rot_dim {self.rot_dim} must be even, <= head_dim {self.head_dim}, "
                                 f"with rot_dim/2 a multiple of vec {self.vec}")
            if self.cos_sin_dtype not in ("fp32", "bf16", "fp16") or self.pos_dtype not in ("int32", "int64"):
                raise ValueError(f"bad cos_sin/pos dtypes {self.cos_sin_dtype}/{self.pos_dtype}")

    def _align(self, dtype: str) -> int:
        return min(16, self.vec * DTYPE_BITS[dtype] // 8)

    def signature(self):
        D = self.head_dim
        scale = (TensorArg("q_scale", "fp32", ("S",), align=4) if self.scale_tensor
                 else ScalarArg("q_scale", "fp32"))
        args: tuple[Arg, ...] = (
            TensorArg("q", self.q_dtype, ("T", "Hq", D), align=self._align(self.q_dtype)),
            TensorArg("out", "fp8_e4m3", ("T", "Hq", D), align=self._align("fp8_e4m3")),
            scale,
        )
        if self.rot_dim:
            args += (
                TensorArg("cos_sin_cache", self.cos_sin_dtype, ("M", self.rot_dim),
                          align=self._align(self.cos_sin_dtype)),
                TensorArg("positions", self.pos_dtype, ("T",), align=DTYPE_BITS[self.pos_dtype] // 8),
            )
        if self.residual:  # last: the one-term variants' argument lists stay as they were
            args += (TensorArg("residual_out", "fp8_e4m3", ("T", "Hq", D), align=self._align("fp8_e4m3")),)
        return args

    def build(self):
        from ..common.quantize import QuantizeQuery  # the kernel module imports the DSL: only here

        return QuantizeQuery(self)


def aligned_vec(head_dim: int) -> int:
    """The elements per thread the op picks without RoPE when q and out are 16-byte aligned."""
    return next(v for v in VECTOR_WIDTHS if head_dim % v == 0 and head_dim // v <= NUM_THREADS)


def make_quantize_config(*, q_dtype: str, head_dim: int, vec: int, scale_tensor: bool, num_q_heads: int,
                         target: str = "sm_90a", rope: tuple | None = None,
                         override: dict | None = None, residual: bool = False) -> QuantizeQueryConfig:
    """The config the op uses for validated arguments (and the warm-up enumerates): the tuning
    defaults filled in here. ``rope``: ``(rot_dim, cos_sin_dtype, pos_dtype)`` of a fused RoPE;
    ``residual``: the two-term query's residual written too."""
    fields: dict[str, Any] = dict(q_dtype=q_dtype, head_dim=head_dim, vec=vec, scale_tensor=scale_tensor,
                                  residual=residual)
    if rope is not None:
        fields.update(rot_dim=rope[0], cos_sin_dtype=rope[1], pos_dtype=rope[2])
    fields = {**fields, "items": DEFAULT_ITEMS_ROPE.get(target, 1) if rope is not None else DEFAULT_ITEMS,
              "pdl": DEFAULT_PDL and target in PDL_TARGETS, **(override or {})}
    if rope is not None and num_q_heads % fields["items"]:
        fields["items"] = 1  # a thread's RoPE rows must be heads of one token
    return QuantizeQueryConfig(**fields)


def compile_variants() -> list[QuantizeQueryConfig]:
    """The ops' defaults (2 rows per thread for the query, PDL) and the plain variants: per-tensor
    and per-KV-head scales, full and partial RoPE."""
    return [
        QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=16, items=2, pdl=True),
        QuantizeQueryConfig(q_dtype="fp16", head_dim=128, vec=16, scale_tensor=True),
        QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=8, scale_tensor=True, rot_dim=128, pdl=True),
        QuantizeQueryConfig(q_dtype="bf16", head_dim=64, vec=8, rot_dim=32, cos_sin_dtype="bf16", pos_dtype="int32"),
    ]


def residual_variants() -> list[QuantizeQueryConfig]:
    """The residual variants (:data:`RESIDUAL_ID`): the op's defaults for the layer's two-term query
    (per-tensor float and tensor scales), a per-KV-head fp16 one, and full and partial RoPE."""
    return [
        QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=16, items=2, pdl=True, residual=True),
        QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=16, scale_tensor=True, items=2, pdl=True, residual=True),
        QuantizeQueryConfig(q_dtype="fp16", head_dim=64, vec=16, scale_tensor=True, residual=True),
        QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=8, scale_tensor=True, rot_dim=128, items=2, pdl=True,
                            residual=True),
        QuantizeQueryConfig(q_dtype="bf16", head_dim=64, vec=8, rot_dim=32, cos_sin_dtype="bf16", pos_dtype="int32",
                            residual=True),
    ]


def residual_family(config: QuantizeQueryConfig) -> str:
    """The runtime self-check family of a residual variant: its input dtype, head dim and whether
    RoPE is fused (``"common.quantize_query_residual/bf16/d128/rope"``); the check runs the variant
    itself, so every variant of a family it passes was compiled from the same code path."""
    return f"{RESIDUAL_ID}/{config.q_dtype}/d{config.head_dim}" + ("/rope" if config.rot_dim else "")
