"""The warm-up of one attention layer: every kernel variant its steps can reach, compiled and
loaded before the first request, and its workspaces sized (docs/design/layer.md#warm-up).

A step of :class:`~dispatch.layer.AttentionLayer` writes the new K/V (``write_kv_cache``),
quantizes the query where a phase's plan says so (``quantize_query``) and runs each phase's
kernel. The variants of a kernel depend on the batch (the decode's split count, its sizing and
merge form come from the requests x KV heads and the block table's width), so they are enumerated
with the very functions the ops decide with, over every batch up to ``max_num_seqs`` requests and
every block-table width up to ``max_model_len`` (the widths that decide differently: see
:func:`cute_kernels.plans.sm90_decode.launch_widths`). ``merge_states`` is included for the
layer's head dim (an engine merging this layer's outputs, e.g. a cascade's prefix and suffix).

The SM90 prefill is one variant for the layer (its grid comes from shapes, its schedule does not
vary), and so is the portable ``sm80.prefill``; on SM100 / SM103 the tcgen05 decode; where the plan
takes the portable ``sm80.decode``, its launches (split ones that merge in a second launch with their
``merge_states``). The compile-verified kernels' runtime self-checks run
in :func:`warm_up` too. Host-only until :func:`warm_up`: the enumeration imports neither torch nor
the DSL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cute_kernels.jit.spec import KernelConfig, normalize_target
from cute_kernels.plans import hw, sm80, sm90_decode, sm100
from cute_kernels.plans import quantize_query as qq_plan
from cute_kernels.plans import write_kv_cache as kv_plan
from cute_kernels.plans.args import check_flags, check_positive_ints, check_sequence, check_workers
from cute_kernels.plans.merge_states import MergeStatesConfig
from cute_kernels.plans.sm90_prefill import TWO_TERM_ID
from cute_kernels.plans.sm100 import Sm100DecodeConfig

from .errors import UnsupportedConfig


def _is_tensor(x) -> bool:
    return hasattr(x, "numel") and hasattr(x, "dtype")


def decode_launches(layer, *, arch: str, max_num_seqs: int, max_model_len: int, q_len: int = 1,
                    kv_form: str = "single", num_sms: int = hw.H200_SMS, widths=None):
    """Yield ``(batch, width, num_splits, config)`` of the SM90 decode for every decode batch of
    1..max_num_seqs requests and every block-table width in ``widths`` (default: the widths that
    stand for all up to ``ceil(max_model_len / page)``), as :func:`paged_decode` would launch them
    (deterministic, the layer's scales)."""
    D, Hkv, page = layer.head_dim, layer.num_kv_heads, layer.page_size
    fields = dict(q_dtype=layer.model_dtype, kv_dtype=layer.kv_cache_dtype, head_dim=D,
                  group=layer.num_q_heads // Hkv, q_len=q_len, page_size=page,
                  k_scale_tensor=_is_tensor(layer.k_scale), v_scale_tensor=_is_tensor(layer.v_scale),
                  kv_form=kv_form, kv_layout=layer.kv_layout)
    max_pages = -(-max_model_len // page)
    if widths is None:
        tile = sm90_decode.make_decode_config(**fields, split=False).tile
        widths = sm90_decode.launch_widths(max_pages, page, tile)
    for batch in range(1, max_num_seqs + 1):
        for width in widths:
            splits, config = sm90_decode.launch_config(**fields, items=batch * Hkv, max_context=width * page,
                                                       num_sms=num_sms)
            yield batch, width, splits, config


def sm80_decode_launches(layer, *, arch: str, max_num_seqs: int, max_model_len: int, q_len: int = 1,
                         kv_form: str = "single", num_sms: int = hw.H200_SMS, widths=None):
    """Yield ``(batch, width, num_splits, config)`` of the portable decode on ``arch``'s target for
    every decode batch of 1..max_num_seqs requests and every block-table width in ``widths`` (default:
    the widths that stand for all, as for the SM90 decode: its split rule reads the width the same
    way), as :func:`paged_decode` would launch them."""
    page, Hkv = layer.page_size, layer.num_kv_heads
    fields = dict(target=normalize_target(arch), q_dtype=layer.model_dtype, kv_dtype=layer.kv_cache_dtype,
                  head_dim=layer.head_dim, group=layer.num_q_heads // Hkv, q_len=q_len, page_size=page,
                  k_scale_tensor=_is_tensor(layer.k_scale), v_scale_tensor=_is_tensor(layer.v_scale), kv_form=kv_form,
                  kv_layout=layer.kv_layout)

    def config_for(split):
        return sm80.make_decode_config(**fields, split=split)

    if widths is None:
        widths = sm90_decode.launch_widths(-(-max_model_len // page), page, config_for(False).tile)
    for batch in range(1, max_num_seqs + 1):
        for width in widths:
            splits, config = sm80.plan_decode(config_for, batch * Hkv, width * page, num_sms, None)
            yield batch, width, splits, config


def sm100_decode_launches(layer, p, *, max_num_seqs: int, max_model_len: int, q_len: int = 1,
                          kv_form: str = "single", num_sms: int = hw.H200_SMS) -> list[Sm100DecodeConfig]:
    """The SM100 decode configs (split or not) of every batch up to ``max_num_seqs`` and width up
    to ``max_model_len``, for the plan ``p`` (its query dtype: FP8 when the plan quantizes)."""
    page = layer.page_size
    fields = dict(q_dtype=p.q_dtype, kv_dtype=layer.kv_cache_dtype, head_dim=layer.head_dim,
                  group=layer.num_q_heads // layer.num_kv_heads, q_len=q_len, page_size=page, sinks=False,
                  kv_form=kv_form, kv_layout=layer.kv_layout, k_scale_tensor=_is_tensor(layer.k_scale),
                  v_scale_tensor=_is_tensor(layer.v_scale),
                  q_scale_tensor=p.applies_q_scale and _is_tensor(layer.q_scale))
    max_pages = -(-max_model_len // page)
    widths = sm90_decode.launch_widths(max_pages, page, sm100.KV_TILE)
    out = [sm100.decode_launch_config(**fields, batch=b, num_kv_heads=layer.num_kv_heads, max_context=w * page,
                                      num_sms=num_sms)[1] for b in range(1, max_num_seqs + 1) for w in widths]
    # the runtime self-check of the kernel's MMA family runs it unsplit and split, whatever the batches
    out += [sm100.decode_launch_config(**fields, batch=1, num_kv_heads=1, max_context=1, num_sms=1,
                                       num_splits=s)[1] for s in (1, 2)]
    return list(dict.fromkeys(out))


def q_scale_per_head(layer, p) -> bool:
    """Whether the plan's FP8 query comes with the layer's per-KV-head ``q_scale``."""
    qs = layer.q_scale
    return p.q_dtype == "fp8_e4m3" and _is_tensor(qs) and qs.numel() > 1


def prefill_config(layer, p, kv_form: str = "single") -> KernelConfig:
    """The prefill config the layer's prefill launch selects for the plan ``p`` (SM90's or the
    portable one; ``out=`` in the model dtype, causal, no LSE, the layer's scales), as
    :func:`cute_kernels.ops.paged_prefill` derives it."""
    from cute_kernels.plans.sm90_prefill import make_prefill_config

    q_scale = "none"
    if p.q_dtype == "fp8_e4m3":
        qs = layer.q_scale
        q_scale = "scalar" if not _is_tensor(qs) else "tensor" if qs.numel() == 1 else "per_head"
    if p.kernel == "sm100.prefill":  # the query arrives quantized when the cache is FP8 (the plan's q_scale)
        return sm100.Sm100PrefillConfig(
            q_dtype=p.q_dtype, kv_dtype=layer.kv_cache_dtype, out_dtype=layer.model_dtype, head_dim=layer.head_dim,
            group=layer.num_q_heads // layer.num_kv_heads, page_size=layer.page_size, kv_form=kv_form,
            kv_layout=layer.kv_layout, causal=True, write_lse=False, k_scale_tensor=_is_tensor(layer.k_scale),
            v_scale_tensor=_is_tensor(layer.v_scale), q_scale_tensor=q_scale == "tensor")
    if p.kernel == "sm80.prefill":  # the portable kernel, built for the plan's arch
        return sm80.make_prefill_config(
            target=normalize_target(p.arch), q_dtype=p.q_dtype, kv_dtype=layer.kv_cache_dtype, head_dim=layer.head_dim,
            group=layer.num_q_heads // layer.num_kv_heads, page_size=layer.page_size, kv_form=kv_form,
            kv_layout=layer.kv_layout, causal=True, write_lse=False, k_scale_tensor=_is_tensor(layer.k_scale),
            v_scale_tensor=_is_tensor(layer.v_scale))
    return make_prefill_config(q_dtype=p.q_dtype, kv_dtype=layer.kv_cache_dtype, out_dtype=layer.model_dtype,
                               head_dim=layer.head_dim, group=layer.num_q_heads // layer.num_kv_heads,
                               page_size=layer.page_size, kv_form=kv_form, kv_layout=layer.kv_layout, causal=True,
                               write_lse=False, k_scale_tensor=_is_tensor(layer.k_scale),
                               v_scale_tensor=_is_tensor(layer.v_scale), q_scale=q_scale,
                               **({"q_terms": 2} if p.kernel == TWO_TERM_ID else {}))


def check_sizes(**sizes) -> None:
    """Each of ``sizes`` a positive Python int (``UnsupportedConfig`` naming it)."""
    try:
        check_positive_ints(**sizes)
    except (TypeError, ValueError) as e:
        raise UnsupportedConfig(str(e)) from None


def check_variant_args(q_lens, kv_form, slot_dtypes) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The warm-up's enumeration arguments, named when wrong (``UnsupportedConfig``): ``q_lens`` a
    sequence of positive ints, ``kv_form`` ``"single"`` / ``"pair"``, ``slot_dtypes`` a sequence of
    ``"int64"`` / ``"int32"`` (a bare string would be read letter by letter)."""
    if kv_form not in ("single", "pair"):
        raise UnsupportedConfig(f"kv_form must be 'single' or 'pair', got {kv_form!r}")
    try:
        q_lens = check_sequence("q_lens", q_lens, "positive ints")
        for q_len in q_lens:
            check_positive_ints(q_lens=q_len)
        slot_dtypes = check_sequence("slot_dtypes", slot_dtypes, "'int64' / 'int32'")
    except (TypeError, ValueError) as e:
        raise UnsupportedConfig(str(e)) from None
    if any(dt not in ("int64", "int32") for dt in slot_dtypes):
        raise UnsupportedConfig(f"slot_dtypes must hold 'int64' / 'int32', got {slot_dtypes!r}")
    return q_lens, slot_dtypes


def layer_variants(layer, max_num_seqs: int, max_model_len: int, *, q_lens=(1,), kv_form: str = "single",
                   slot_dtypes=("int64", "int32"), arch=None, num_sms: int = hw.H200_SMS,
                   merge_states: bool = True) -> list[KernelConfig]:
    """Every compile variant a step of ``layer`` reaches with decode batches of up to
    ``max_num_seqs`` requests of up to ``max_model_len`` tokens (``q_lens``: the draft lengths of
    its decode requests), the cache in ``kv_form`` (``"single"`` tensor or ``"pair"``), slot
    mappings of ``slot_dtypes``, inputs 16-byte aligned (fused-QKV views of 16-byte rows are)."""
    check_sizes(max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_sms=num_sms)
    q_lens, slot_dtypes = check_variant_args(q_lens, kv_form, slot_dtypes)
    a = layer.resolve_arch(None, arch)
    target = normalize_target(a)
    out: list[KernelConfig] = []
    quantize = False
    for q_len in q_lens:
        p = layer.plan("decode", q_len=q_len, arch=a)
        quantize |= p.quantize_query
        if p.kernel == "sm90.decode":
            out += [cfg for *_, cfg in decode_launches(layer, arch=a, max_num_seqs=max_num_seqs,
                                                       max_model_len=max_model_len, q_len=q_len, kv_form=kv_form,
                                                       num_sms=num_sms)]
        elif p.kernel == "sm80.decode":
            configs = [cfg for *_, cfg in sm80_decode_launches(layer, arch=a, max_num_seqs=max_num_seqs,
                                                               max_model_len=max_model_len, q_len=q_len,
                                                               kv_form=kv_form, num_sms=num_sms)]
            out += configs + [c.merge_config() for c in configs if c.split and not c.fused_merge]
        elif p.kernel == "sm100.decode":
            configs = sm100_decode_launches(layer, p, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                            q_len=q_len, kv_form=kv_form, num_sms=num_sms)
            out += configs
            if any(c.split for c in configs):  # split partials merge with merge_states into the output
                out.append(MergeStatesConfig(out_dtype="bf16" if p.q_dtype == "fp8_e4m3" else layer.model_dtype,
                                             head_dim=layer.head_dim, vec=4))
    prefill_kernels = set()
    two_terms = False  # a two-term FP8 query: quantize_query's residual variant
    for q_len in (1, max_model_len):  # the prefill plan's q_len: the step's prefill token count
        p = layer.plan("prefill", q_len=q_len, arch=a)
        quantize |= p.quantize_query
        two_terms |= p.quantize_query and p.kernel == TWO_TERM_ID
        if q_scale_per_head(layer, p) and p.kernel == "sm100.prefill":  # no variant: the op runs the reference
            continue
        if p.kernel in ("sm90.prefill", "sm90.prefill_fp8q", TWO_TERM_ID, "sm80.prefill", "sm100.prefill") and \
                p.kernel not in prefill_kernels:
            prefill_kernels.add(p.kernel)
            out.append(prefill_config(layer, p, kv_form))
    D = layer.head_dim
    cfg: KernelConfig
    # the one-term variant also serves the two-term query's torch-ops fallback
    for residual in ((False, True) if two_terms else (False,)) if quantize else ():
        cfg = qq_plan.make_quantize_config(q_dtype=layer.model_dtype, head_dim=D, vec=qq_plan.aligned_vec(D),
                                           scale_tensor=_is_tensor(layer.q_scale), num_q_heads=layer.num_q_heads,
                                           target=target, residual=residual)
        if target in cfg.targets:
            out.append(cfg)
    for slot_dtype in slot_dtypes:
        cfg = kv_plan.make_write_config(
            in_dtype=layer.model_dtype, cache_dtype=layer.kv_cache_dtype, head_dim=D, page_size=layer.page_size,
            vec=kv_plan.aligned_vec(D), slot_dtype=slot_dtype, kv_form=kv_form, kv_layout=layer.kv_layout,
            k_scale_tensor=_is_tensor(layer.k_scale), v_scale_tensor=_is_tensor(layer.v_scale))
        if target in cfg.targets:  # an FP8 cache before SM89 is written by the torch path
            out.append(cfg)
    if merge_states and D % 4 == 0:
        out += [MergeStatesConfig(out_dtype=dt, head_dim=D, vec=4) for dt in (layer.model_dtype, "fp32")]
    return list(dict.fromkeys(c for c in out if target in c.targets))


def decode_workspace(layer, max_num_seqs: int, max_model_len: int, *, q_lens=(1,), kv_form: str = "single",
                     arch=None, num_sms: int = hw.H200_SMS) -> tuple[int, int]:
    """The largest (fp32 elements, int32 counters) a decode launch of these batches asks for
    (:func:`cute_kernels.ops.paged_decode.workspace_numel`, without a returned LSE, as the layer calls it)."""
    from cute_kernels.ops.paged_decode import workspace_numel

    a = layer.resolve_arch(None, arch)
    numel = counters = 0
    Hq, Hkv, D = layer.num_q_heads, layer.num_kv_heads, layer.head_dim
    for q_len in q_lens:
        kernel = layer.plan("decode", q_len=q_len, arch=a).kernel
        launches = {"sm90.decode": decode_launches, "sm80.decode": sm80_decode_launches}.get(kernel)
        if launches is None:
            continue
        for batch, _, splits, cfg in launches(layer, arch=a, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                              q_len=q_len, kv_form=kv_form, num_sms=num_sms):
            n, c = workspace_numel(cfg, splits, batch, Hkv, batch * q_len, Hq, D, False)
            numel, counters = max(numel, n), max(counters, c)
    return numel, counters


def warm_up(layer, max_num_seqs: int, max_model_len: int, *, device=None, arch=None, q_lens=(1,),
            kv_form: str = "single", slot_dtypes=("int64", "int32"), workers: int | None = None,
            progress: bool = False) -> list[KernelConfig]:
    """Compile (in parallel, into the disk cache) and load every variant of
    :func:`layer_variants`, and size the decode workspaces of ``device``'s current stream for the
    largest batch (so that neither a step nor a graph capture on that stream compiles or
    allocates). Returns the configs."""
    from cute_kernels.jit.parallel import precompile

    try:  # the pool's options, named before anything is enumerated (as cute_kernels.warmup)
        check_flags(progress=progress)
        check_workers(workers)
    except (TypeError, ValueError) as e:
        raise UnsupportedConfig(str(e)) from None
    num_sms = hw.H200_SMS
    if device is not None:
        import torch

        device = torch.device(device)
        if device.type == "cuda":
            from cute_kernels.ops._torch import device_sm_count

            num_sms = device_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    a = layer.resolve_arch(device, arch)
    configs = layer_variants(layer, max_num_seqs, max_model_len, q_lens=q_lens, kv_form=kv_form,
                             slot_dtypes=slot_dtypes, arch=a, num_sms=num_sms)
    precompile(configs, normalize_target(a), workers=workers, progress=progress)
    if device is not None and device.type == "cuda":
        _self_checks(configs, device)
        from cute_kernels.ops.paged_decode import reserve

        reserve(device, *decode_workspace(layer, max_num_seqs, max_model_len, q_lens=q_lens, kv_form=kv_form,
                                          arch=a, num_sms=num_sms))
    return configs


def _self_checks(configs: list[KernelConfig], device) -> None:
    """The one-time runtime self-checks of the compile-verified kernels among ``configs`` (they
    synchronize: a first step, or a graph capture, must not be where they run)."""
    for config in configs:
        check: Callable[[Any, Any], bool]
        if config.kernel_id in ("sm90.prefill", "sm90.prefill_fp8q"):
            from cute_kernels.ops.paged_prefill import self_check_passes as check
        elif config.kernel_id == "sm100.decode":
            from cute_kernels.ops._paged_decode_sm100 import self_check_passes as check
        elif config.kernel_id == "sm100.prefill":
            from cute_kernels.ops._paged_prefill_sm100 import self_check_passes as check
        elif config.kernel_id == "common.quantize_query" and getattr(config, "residual", False):
            from cute_kernels.ops._quantize_residual import self_check_passes as check
        else:
            continue
        check(config, device)
