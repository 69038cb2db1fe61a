"""``AttentionLayer``: one attention call site of a model, on top of :func:`dispatch.plan`.

A forward step (``forward(q, k, v, kv_cache, metadata)``):

1. writes the new keys/values into the paged cache (``cute_kernels.write_kv_cache``);
2. splits the batch into its decode rows (first, vLLM's order) and its prefill rows;
3. plans each phase on its own: the plan is a pure function of (arch, phase, *this layer's* cache
   dtype, shape), so a bf16 skip layer next to an FP8 layer, or a decode phase next to a prefill
   phase, can each get a different kernel and query dtype (vLLM chose the query dtype from the
   global cache dtype: anchors-features.md §3.1-3.2);
4. quantizes the query of a phase only when that phase's plan says ``quantize_query`` (its kernel
   computes QK in FP8) and passes ``q_scale`` only where the plan says ``applies_q_scale``;
5. runs the chosen kernel and returns the output in the model dtype.

Inputs are checked for the layout the kernels need, not for ``is_contiguous()``: q, k and v may
be views of a fused QKV projection (the Nemotron crash, anchors §3.3).

CUDA graphs: a step whose phases are served by CuTe kernels does no host synchronization (no
``.item()``/``.tolist()``; the metadata counts are Python ints): all prefill rows of a batch go to
one prefill launch, the decode rows to one decode launch, so the step captures once its variants
are compiled (run one eager step first). The reference fallbacks read ``query_start_loc`` and
``seq_lens`` on the host and are not capturable.

Importing this module needs neither torch nor the CuTe DSL; both are imported inside ``forward``.
"""

from __future__ import annotations

import numbers
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cute_kernels import _nvtx
from cute_kernels.ops._launch import check_scale
from cute_kernels.plans.args import fp32_note, positive_fp32
from cute_kernels.registry import KERNELS, KV_LAYOUTS

from . import warmup as _warmup
from .arch import ArchLike, parse_arch
from .dtypes import FP8_TWO_TERMS, DTypeLike, kv_dtype_name, model_dtype_name, query_dtype_name, torch_dtype
from .errors import UnsupportedConfig
from .planner import Plan, plan

if TYPE_CHECKING:  # annotations only: importing this module needs neither torch nor the DSL
    from collections.abc import Sequence

    import torch

    from cute_kernels._types import KVCache, Scale
    from cute_kernels.jit.spec import KernelConfig

_MAX_PLANS = 1024  # per layer; plans are cheap to redo, the cache only saves host time


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step batch description, vLLM's layout. Tensors live on the device of q.

    Attributes:
        query_start_loc: int32 ``[num_reqs + 1]``: request r's new tokens are rows
            ``query_start_loc[r] : query_start_loc[r + 1]`` of q/k/v (``[0] = 0``,
            ``[-1] = T``).
        seq_lens: int32 ``[num_reqs]``: each request's total KV length *including* its new
            tokens (the new tokens' K/V are written before attention reads the cache).
        block_table: int32 ``[num_reqs, max_pages]``: the physical cache pages of each request.
        slot_mapping: int32/int64 ``[T]``: the cache slot (``page * page_size + offset``) of each
            new token; ``-1`` (padding) and out-of-range slots are not written.
        num_decode_tokens: Python int: the first ``num_decode_tokens`` rows are decode rows,
            ``q_len_per_req`` per request (the first ``num_decode_tokens // q_len_per_req``
            requests); the remaining rows belong to prefill requests (vLLM's order).
        q_len_per_req: Python int: new tokens per decode request (> 1 for speculative decoding;
            query token j of a decode request sees KV positions ``< seq_len - q_len + j + 1``).
        max_query_len: optional Python int, at least every prefill request's new tokens: it sizes
            the prefill launch's grid (the prefill token count otherwise).
    """

    query_start_loc: Any
    seq_lens: Any
    block_table: Any
    slot_mapping: Any
    num_decode_tokens: int = 0
    q_len_per_req: int = 1
    max_query_len: int | None = None

    def __post_init__(self):
        for name in ("num_decode_tokens", "q_len_per_req", "max_query_len"):
            value = getattr(self, name)
            if name == "max_query_len" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be a Python int (never a device tensor), got {type(value).__name__}")
        if self.max_query_len is not None and self.max_query_len < 0:
            raise ValueError(f"max_query_len must be >= 0, got {self.max_query_len}")
        if self.q_len_per_req < 1:
            raise ValueError(f"q_len_per_req must be >= 1, got {self.q_len_per_req}")
        if self.num_decode_tokens < 0 or self.num_decode_tokens % self.q_len_per_req:
            raise ValueError(f"num_decode_tokens ({self.num_decode_tokens}) must be a non-negative multiple of "
                             f"q_len_per_req ({self.q_len_per_req})")

    @property
    def num_reqs(self) -> int:
        return self.block_table.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_decode_reqs(self) -> int:
        return self.num_decode_tokens // self.q_len_per_req


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedConfig(f"{name} must be a positive int, got {value!r}")
    return value


_CAPABILITY: dict = {}


def _device_arch(device) -> str:
    """``"sm90"`` for an H100/H200 device (cached: the query is host-only after the first call)."""
    key = (device.type, device.index)
    arch = _CAPABILITY.get(key)
    if arch is None:
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        arch = parse_arch(torch.cuda.get_device_capability(index), argument="device capability").name
        _CAPABILITY[key] = arch
    return arch


class AttentionLayer:
    """One attention layer: cache write, per-phase planning, query quantization, kernels.

    Args:
        num_q_heads, num_kv_heads, head_dim: the layer's shape (``num_q_heads % num_kv_heads == 0``).
        kv_cache_dtype: this layer's cache dtype (torch dtype or name; ``"auto"`` = model dtype,
            ``"fp8"`` = float8_e4m3fn). Each layer plans with its own, so skip layers kept in
            bf16 never get an FP8 query.
        page_size: tokens per cache page.
        kv_layout: ``"HND"`` (``[P, 2, Hkv, page, D]``) or ``"NHD"`` (``[P, 2, page, Hkv, D]``).
        q_scale: the FP8 query scale (float, 1-element fp32 tensor, or fp32 ``[Hkv]``), used only
            by phases whose plan quantizes the query; required then.
        k_scale, v_scale: cache scales (floats or 1-element fp32 device tensors): the cache stores
            ``k / k_scale`` and attention multiplies it back.
        arch: plan for this arch (any :func:`dispatch.parse_arch` spelling); None = the compute
            capability of q's device (required for CPU tensors).
        model_dtype: dtype of q, k, v and of the output (bf16 or fp16).
        sm_scale: softmax scale, default ``head_dim ** -0.5``.
        prefill_query_dtype: ``"auto"`` (default): the prefill rows take the query dtype of the
            automatically planned kernel (on SM90 with an FP8 cache: the exact model-dtype query,
            ``sm90.prefill``). ``"fp8"``: the prefill rows of this FP8-cache layer run a kernel that
            computes QK in FP8 (on SM90 the opt-in ``sm90.prefill_fp8q``) on the query quantized
            with ``q_scale``, while the decode rows keep the plan of ``"auto"``. Needs an FP8 cache
            and ``q_scale``; refused (``UnsupportedConfig``) where no FP8-QK prefill kernel
            accepts the layer: at construction when ``arch`` is given, else at the first plan.
            Faster prefill at the error of an FP8 query:
            docs/design/layer.md#fp8-query-prefill-opt-in. ``"fp8x2"``: the same with a two-term
            query (the e4m3 codes and their e4m3 residual, ``quantize_query(..., residual=True)``;
            on SM90 the opt-in ``sm90.prefill_fp8x2``): about 1.5x the FP8 MMA work of ``"fp8"``
            for a third to a sixth of its error (2e-2 against 3e-2 to 6e-2 measured), within the
            3e-2 target: docs/design/sm90-prefill.md#two-term-measured.
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *, kv_cache_dtype: DTypeLike,
                 page_size: int, kv_layout: str = "HND", q_scale: Scale | None = None, k_scale: Scale = 1.0,
                 v_scale: Scale = 1.0, arch: ArchLike | None = None, model_dtype: DTypeLike = "bf16",
                 sm_scale: float | None = None, prefill_query_dtype: DTypeLike = "auto") -> None:
        self.num_q_heads = _positive_int("num_q_heads", num_q_heads)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        if num_q_heads % num_kv_heads:
            raise UnsupportedConfig(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.head_dim = _positive_int("head_dim", head_dim)
        self.page_size = _positive_int("page_size", page_size)
        self.model_dtype = model_dtype_name(model_dtype)
        self.kv_cache_dtype = kv_dtype_name(kv_cache_dtype, self.model_dtype)
        layout = kv_layout.upper() if isinstance(kv_layout, str) else kv_layout
        if layout not in KV_LAYOUTS:
            raise UnsupportedConfig(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
        self.kv_layout = layout
        self.arch = None if arch is None else parse_arch(arch).name
        self.q_scale = self._check_host_scale("q_scale", q_scale, per_head=True) if q_scale is not None else None
        self.k_scale = self._check_host_scale("k_scale", k_scale)
        self.v_scale = self._check_host_scale("v_scale", v_scale)
        if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real)):
            raise UnsupportedConfig(f"sm_scale must be a positive finite float, got {sm_scale!r}")
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        if not positive_fp32(self.sm_scale):  # finite as the kernels' fp32 scalar too
            raise UnsupportedConfig(f"sm_scale must be a positive finite float, got {sm_scale!r}{fp32_note(self.sm_scale)}")
        self.prefill_query_dtype = query_dtype_name(prefill_query_dtype, "prefill_query_dtype")
        self._plans: dict[tuple, Plan] = {}
        if self.prefill_query_dtype != "auto":
            self._check_fp8_prefill()

    @property
    def _asked(self) -> str:
        return "prefill_query_dtype='" + ("fp8x2" if self.prefill_query_dtype == FP8_TWO_TERMS else "fp8") + "'"

    def _check_fp8_prefill(self) -> None:
        """What ``prefill_query_dtype="fp8"`` / ``"fp8x2"`` needs that the constructor knows: an FP8
        cache, a ``q_scale``, and (when ``arch`` is given) an FP8-QK prefill kernel that accepts the layer."""
        if self.kv_cache_dtype != "fp8_e4m3":
            raise UnsupportedConfig(f"{self._asked} needs an FP8 KV cache (QK runs in FP8 only "
                                    f"against FP8 K); this layer's kv_cache_dtype is {self.kv_cache_dtype}")
        if self.q_scale is None:
            raise UnsupportedConfig(f"{self._asked} quantizes the prefill rows' query with q_scale: "
                                    "pass q_scale= to AttentionLayer")
        if self.arch is not None:  # planned, not cached: the step's own plans come later
            self._plan_uncached(self.arch, "prefill", 1)

    def _check_host_scale(self, name: str, value, per_head: bool = False):
        """Host-side checks of a scale, with the ops' validator (device placement is checked by the
        ops at call time); a 1-element tensor is kept as a ``[1]`` view (one shape for every kernel
        signature; a view, so later in-place updates still apply)."""
        try:
            is_tensor = check_scale(name, value, num_q_heads=self.num_q_heads if per_head else None,
                                    num_kv_heads=self.num_kv_heads if per_head else None)
        except (TypeError, ValueError) as e:
            raise UnsupportedConfig(str(e)) from None
        if not is_tensor:
            return float(value)
        return value.view(1) if value.numel() == 1 and value.dim() != 1 else value

    def __repr__(self) -> str:
        return (f"AttentionLayer(Hq={self.num_q_heads}, Hkv={self.num_kv_heads}, D={self.head_dim}, "
                f"kv={self.kv_cache_dtype}, model={self.model_dtype}, page={self.page_size}, {self.kv_layout}, "
                f"arch={self.arch}" + (", " + self._asked.replace("'", "") if self.prefill_query_dtype != "auto" else "")
                + ")")

    # ------------------------------------------------------------------------------------------
    # planning (pure Python, cached per layer)
    # ------------------------------------------------------------------------------------------

    def resolve_arch(self, device: torch.device | None = None, arch: ArchLike | None = None) -> str:
        """``arch`` if given, else the layer's ``arch=``, else the capability of ``device``."""
        if arch is not None:
            return parse_arch(arch).name
        if self.arch is not None:
            return self.arch
        if device is not None and getattr(device, "type", None) == "cuda":
            return _device_arch(device)
        raise UnsupportedConfig(f"arch=None and the tensors are on {device}: pass arch= to the layer (or "
                                "to plan()) to say which GPU to plan for")

    def plan(self, phase: str, *, q_len: int = 1, arch: ArchLike | None = None,
             device: torch.device | None = None) -> Plan:
        """The plan of one phase of this layer (``q_len``: new tokens per request; for prefill an
        upper bound on them). Plans are cached per layer: the registry is code, and a test that
        swaps registry entries builds its layers afterwards."""
        a = self.resolve_arch(device, arch)
        key = (a, phase, q_len)
        p = self._plans.get(key)
        if p is None:
            p = self._plan_uncached(a, phase, q_len)
            if len(self._plans) >= _MAX_PLANS:  # prefill token counts vary step to step
                self._plans.clear()
            self._plans[key] = p
        return p

    def _plan_uncached(self, arch: str, phase: str, q_len: int) -> Plan:
        # prefill_query_dtype applies to the prefill phase only: decode keeps its automatic plan
        query = self.prefill_query_dtype if phase == "prefill" else "auto"
        try:
            return plan(arch=arch, phase=phase, kv_cache_dtype=self.kv_cache_dtype, model_dtype=self.model_dtype,
                        head_dim=self.head_dim, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                        page_size=self.page_size, q_len=q_len, kv_layout=self.kv_layout, query_dtype=query)
        except UnsupportedConfig as e:
            if query == "auto":
                raise
            raise UnsupportedConfig(f"{self._asked}: {e}") from None

    def plans_for(self, metadata: AttentionMetadata, *, arch: ArchLike | None = None,
                  device: torch.device | None = None) -> dict[str, Plan | None]:
        """``{"decode": Plan | None, "prefill": Plan | None}`` for a step (None: no such rows).

        The prefill plan uses the number of prefill tokens as ``q_len``: an upper bound on every
        prefill request's new tokens, known without reading device data.
        """
        device = device if device is not None else getattr(metadata.slot_mapping, "device", None)
        nd, T = metadata.num_decode_tokens, metadata.num_tokens
        return {
            "decode": self.plan("decode", q_len=metadata.q_len_per_req, arch=arch, device=device) if nd else None,
            "prefill": self.plan("prefill", q_len=T - nd, arch=arch, device=device) if T > nd else None,
        }

    # ------------------------------------------------------------------------------------------
    # warm-up
    # ------------------------------------------------------------------------------------------

    def warmup(self, max_num_seqs: int, max_model_len: int, *, device: torch.device | str | None = None,
               arch: ArchLike | None = None, q_lens: Sequence[int] = (1,), kv_form: str = "single",
               slot_dtypes: Sequence[str] = ("int64", "int32"), workers: int | None = None,
               progress: bool = False) -> list[KernelConfig]:
        """Compile and load every kernel variant a step can reach with decode batches of up to
        ``max_num_seqs`` requests of up to ``max_model_len`` tokens (``q_lens``: the draft lengths
        of decode requests; ``kv_form``: ``"single"`` cache tensor or ``"pair"``; ``slot_dtypes``:
        the slot mappings' dtypes), and size the decode workspaces of ``device``'s current stream
        (run it on the stream that will capture). A step of those shapes then compiles nothing and
        allocates no workspace. Returns the configs (:func:`dispatch.warmup.layer_variants`)."""
        return _warmup.warm_up(self, max_num_seqs, max_model_len, device=device, arch=arch, q_lens=q_lens,
                               kv_form=kv_form, slot_dtypes=slot_dtypes, workers=workers, progress=progress)

    def warmup_variants(self, max_num_seqs: int, max_model_len: int, *, arch: ArchLike | None = None,
                        q_lens: Sequence[int] = (1,), kv_form: str = "single",
                        slot_dtypes: Sequence[str] = ("int64", "int32"),
                        num_sms: int | None = None) -> list[KernelConfig]:
        """The configs :meth:`warmup` compiles, without compiling (host-only)."""
        kw: dict[str, Any] = {} if num_sms is None else dict(num_sms=num_sms)
        return _warmup.layer_variants(self, max_num_seqs, max_model_len, arch=arch, q_lens=q_lens,
                                      kv_form=kv_form, slot_dtypes=slot_dtypes, **kw)

    # ------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        """One attention step: write ``k``/``v`` at ``metadata.slot_mapping``, then attend.

        Args:
            q: ``[T, Hq, D]`` model dtype; k, v: ``[T, Hkv, D]`` model dtype. Last dims
                contiguous; other strides free (fused-QKV views work).
            kv_cache: this layer's cache, one 5-D tensor or a ``(k, v)`` tuple (see
                :mod:`cute_kernels.reference`), of this layer's ``kv_cache_dtype``.
            metadata: :class:`AttentionMetadata`.

        Returns:
            ``[T, Hq, D]`` in the model dtype.

        With a profiler attached, the step runs inside the NVTX range ``cute_kernels.layer`` (each
        op's range nested inside it), except while torch.compile traces it.
        """
        if _nvtx.ENABLED:
            import torch

            if not torch.compiler.is_compiling():
                with _nvtx.op_range("layer", q=q, kv_cache=kv_cache[0] if isinstance(kv_cache, tuple) else kv_cache):
                    return self._step(q, k, v, kv_cache, metadata)
        return self._step(q, k, v, kv_cache, metadata)

    __call__ = forward

    def _step(self, q, k, v, kv_cache, metadata: AttentionMetadata):
        import torch

        import cute_kernels

        self._check_inputs(q, k, v, kv_cache, metadata)
        arch = self.resolve_arch(q.device)
        cute_kernels.write_kv_cache(k, v, kv_cache, metadata.slot_mapping, kv_layout=self.kv_layout,
                                    k_scale=self.k_scale, v_scale=self.v_scale)
        T = q.shape[0]
        nd = metadata.num_decode_tokens
        out = torch.empty((T, self.num_q_heads, self.head_dim), dtype=q.dtype, device=q.device)
        if nd:
            p = self.plan("decode", q_len=metadata.q_len_per_req, arch=arch)
            whole = nd == T  # no views on the all-decode path (each costs host time)
            self._decode(p, q if whole else q[:nd], kv_cache, metadata, out if whole else out[:nd])
        if nd < T:
            p = self.plan("prefill", q_len=T - nd, arch=arch)
            self._prefill(p, q, kv_cache, metadata, out)
        return out

    def _query_for(self, p: Plan, q):
        """The query a phase's kernel takes, the q_scale it applies (None if it applies none) and
        the query's second term (None unless the kernel takes a two-term FP8 query)."""
        if p.quantize_query or p.applies_q_scale:
            if self.q_scale is None:
                raise UnsupportedConfig(
                    f"{p.kernel} computes QK in FP8 for this {p.kv_cache_dtype} layer on {p.arch}, so the "
                    "query must be quantized, but the layer has no q_scale: pass q_scale= to AttentionLayer"
                )
            if p.quantize_query:
                import cute_kernels

                if KERNELS[p.kernel].query_terms == 2:
                    q, lo = cute_kernels.quantize_query(q, self.q_scale, residual=True)
                    return q, self.q_scale, lo
                q = cute_kernels.quantize_query(q, self.q_scale)
        return q, (self.q_scale if p.applies_q_scale else None), None

    def _decode(self, p: Plan, q, kv_cache, metadata: AttentionMetadata, out):
        import cute_kernels
        from cute_kernels import reference

        op = KERNELS[p.kernel].op  # the registry names the op that runs a kernel
        if op not in ("paged_decode", "reference.paged_decode"):
            raise UnsupportedConfig(f"the decode plan chose {p.kernel}, which has no decode op in this build")
        B = metadata.num_decode_reqs
        bt, sl = metadata.block_table, metadata.seq_lens
        if B != metadata.num_reqs:
            bt, sl = bt[:B], sl[:B]
        q_in, q_scale, _ = self._query_for(p, q)  # no decode kernel takes a two-term query
        common = dict(kv_layout=self.kv_layout, q_len_per_req=metadata.q_len_per_req, sm_scale=self.sm_scale,
                      k_scale=self.k_scale, v_scale=self.v_scale)
        if op == "paged_decode":
            from cute_kernels.ops.paged_decode import BACKENDS, tuning_override

            # an FP8 query (sm100.decode on an FP8 cache) gives a bf16 output: copied when the model's is fp16
            direct = q_scale is None or out.dtype == torch_dtype("bf16")
            # a kernel the op can be told to run (the portable one) runs as planned, even where the op
            # would choose another (an SM100 family that passed the self-check the plan's did not)
            forced = next((name for name, kid in BACKENDS.items() if kid == p.kernel), None)
            with tuning_override(backend=forced) if forced else nullcontext():
                res = cute_kernels.paged_decode(q_in, kv_cache, bt, sl, out=out if direct else None,
                                                q_scale=q_scale, **common)
            if res is not out:  # CPU tensors run the reference, which returns a new tensor
                out.copy_(res)
        else:
            out.copy_(reference.paged_decode(q_in, kv_cache, bt, sl, q_scale=q_scale, **common))

    def _prefill(self, p: Plan, q, kv_cache, metadata: AttentionMetadata, out):
        """All prefill rows of the step in one launch: rows ``num_decode_tokens:``, requests
        ``num_decode_reqs:``, their ``query_start_loc`` shifted to start at 0 (a device op, no sync)."""
        import cute_kernels
        from cute_kernels import reference

        op = KERNELS[p.kernel].op  # the registry names the op that runs a kernel
        if op not in ("paged_prefill", "reference.paged_prefill"):
            raise UnsupportedConfig(f"the prefill plan chose {p.kernel}, which has no prefill op in this build")
        nd, first = metadata.num_decode_tokens, metadata.num_decode_reqs
        whole = nd == 0  # no views on the all-prefill path
        bt, sl, qsl = metadata.block_table, metadata.seq_lens, metadata.query_start_loc
        if not whole:
            q, out = q[nd:], out[nd:]
            bt, sl, qsl = bt[first:], sl[first:], qsl[first:] - nd
        q_in, q_scale, q_lo = self._query_for(p, q)  # the prefill rows only: decode rows keep their own query
        common = dict(max_query_len=metadata.max_query_len, kv_layout=self.kv_layout, sm_scale=self.sm_scale,
                      q_scale=q_scale, k_scale=self.k_scale, v_scale=self.v_scale,
                      **({} if q_lo is None else {"q_residual": q_lo}))
        if op == "reference.paged_prefill":
            out.copy_(reference.paged_prefill(q_in, kv_cache, bt, sl, qsl, out_dtype=out.dtype, **common))
        else:
            from cute_kernels.ops.paged_prefill import BACKENDS, tuning_override

            # a kernel the op can be told to run (the portable one) runs as planned
            forced = next((name for name, kid in BACKENDS.items() if kid == p.kernel), None)
            with tuning_override(backend=forced) if forced else nullcontext():
                res = cute_kernels.paged_prefill(q_in, kv_cache, bt, sl, qsl, out=out, **common)
            if res is not out:  # pragma: no cover - the op writes out= on every device
                out.copy_(res)

    # ------------------------------------------------------------------------------------------
    # validation (shapes, dtypes, devices only: never reads tensor data)
    # ------------------------------------------------------------------------------------------

    def _check_inputs(self, q, k, v, kv_cache, metadata: AttentionMetadata):
        import torch

        Hq, Hkv, D = self.num_q_heads, self.num_kv_heads, self.head_dim
        model = torch_dtype(self.model_dtype)
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if not q.is_cuda:  # CPU tensors run the reference; any other device is named, as the ops name it
            from cute_kernels.ops._device import served_device  # (torch-side: never imported with dispatch)

            served_device("q", q)
        if q.dtype != model:
            raise TypeError(f"q must have the layer's model dtype {self.model_dtype}, got {q.dtype}")
        if q.dim() != 3 or q.shape[1] != Hq or q.shape[2] != D:
            raise ValueError(f"q must be [T, num_q_heads={Hq}, head_dim={D}], got {list(q.shape)}")
        T = q.shape[0]
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != model:
                raise TypeError(f"{name} must have the layer's model dtype {self.model_dtype}, got {t.dtype}")
            if list(t.shape) != [T, Hkv, D]:
                raise ValueError(f"{name} must be [T={T}, num_kv_heads={Hkv}, head_dim={D}], got {list(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"{name} must be on {q.device}, got {t.device}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
        if Hq > 1 and q.stride(1) != D:  # the decode kernels read each token's heads as one block
            raise ValueError(f"q must have contiguous heads (stride(1) == head_dim {D}; the token stride is free), "
                             f"got strides {q.stride()}")
        self._check_cache(kv_cache, q.device)
        if not isinstance(metadata, AttentionMetadata):
            raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
        bt = metadata.block_table  # first: it gives the request count the others are checked against
        if isinstance(bt, torch.Tensor) and bt.dim() != 2:
            raise ValueError(f"metadata.block_table must be [num_reqs, max_pages], got {list(bt.shape)}")
        n = bt.shape[0] if isinstance(bt, torch.Tensor) else 0
        checks = (
            ("block_table", bt, None, (torch.int32,)),
            ("slot_mapping", metadata.slot_mapping, (T,), (torch.int32, torch.int64)),
            ("query_start_loc", metadata.query_start_loc, (n + 1,), (torch.int32,)),
            ("seq_lens", metadata.seq_lens, (n,), (torch.int32,)),
        )
        for name, t, shape, dtypes in checks:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"metadata.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in dtypes:
                raise TypeError(f"metadata.{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
            if shape is not None and tuple(t.shape) != shape:
                raise ValueError(f"metadata.{name} must have shape {list(shape)}, got {list(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"metadata.{name} must be on {q.device}, got {t.device}")
        nd = metadata.num_decode_tokens
        if nd > T or metadata.num_decode_reqs > n:
            raise ValueError(f"num_decode_tokens ({nd}) exceeds the batch (T={T} tokens, {n} requests of "
                             f"q_len_per_req {metadata.q_len_per_req})")
        if nd < T and metadata.num_decode_reqs == n:  # the prefill launch would get rows but no request
            raise ValueError(f"num_decode_tokens ({nd}) makes all {n} requests decode requests, but q has {T - nd} "
                             "more rows: they belong to no request")

    def _check_cache(self, kv_cache, device):
        import torch

        want = torch_dtype(self.kv_cache_dtype)
        parts = kv_cache if isinstance(kv_cache, (tuple, list)) else (kv_cache,)
        for t in parts:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_cache must be a tensor or a (k, v) tuple of tensors, got {type(t).__name__}")
            if t.dtype == torch.uint8:
                raise TypeError("kv_cache has dtype uint8, which is ambiguous: view it as float8_e4m3fn "
                                "(cache.view(torch.float8_e4m3fn))")
            if t.dtype != want:
                raise TypeError(f"kv_cache must have this layer's kv_cache_dtype {self.kv_cache_dtype} ({want}), "
                                f"got {t.dtype}")
            if t.device != device:
                raise ValueError(f"kv_cache must be on {device}, got {t.device}")
        if isinstance(kv_cache, (tuple, list)):
            if len(kv_cache) != 2 or kv_cache[0].dim() != 4 or kv_cache[0].shape != kv_cache[1].shape:
                raise ValueError("kv_cache tuple must be (k_cache, v_cache) of one 4-D shape")
            inner = tuple(kv_cache[0].shape[1:])
        else:
            if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
                raise ValueError(f"kv_cache must be [P, 2, ...] 5-D (K and V), got {list(kv_cache.shape)}")
            inner = tuple(kv_cache.shape[2:])
        Hkv, page, D = self.num_kv_heads, self.page_size, self.head_dim
        expect = (Hkv, page, D) if self.kv_layout == "HND" else (page, Hkv, D)
        if inner != expect:
            names = "[num_kv_heads, page_size, head_dim]" if self.kv_layout == "HND" else \
                "[page_size, num_kv_heads, head_dim]"
            raise ValueError(f"kv_cache ({self.kv_layout}) pages must be {names} = {list(expect)}, got {list(inner)}")
