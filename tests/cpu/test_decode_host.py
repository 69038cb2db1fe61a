"""Host side of the SM90 decode op, without a GPU: split heuristic, tuning, config/signature
derivation, the argument order of the generated caller, and CPU-side validation."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from cute_kernels import reference
from cute_kernels.ops import paged_decode as op
from cute_kernels.plans import sm90_decode as plan
from cute_kernels.plans.sm90_decode import Sm90DecodeConfig, decode_tuning, make_decode_config


def test_schedule_fills_one_wave_with_the_measured_ctas_per_sm():
    sms = 132
    # Qwen3-30B B=8 ctx 32000, FP8 D=128: 32 (request, head) pairs -> 12 splits, 3 CTAs/SM (4 stages)
    assert plan.choose_schedule(32, 32016, sms, 4, 64, 3) == (12, 3)
    # 512 pairs fill the GPU: no split, 4 CTAs/SM
    assert plan.choose_schedule(512, 8208, sms, 4, 64, 3) == (1, 4)
    # FP8 D=64: small tiles want more chains: 2 splits, 4 CTAs/SM
    assert plan.choose_schedule(256, 8208, sms, 4, 64, 4) == (2, 4)
    # FP8 D=256: the split count aims at 2 CTAs/SM (launch_schedule then sizes the kernel for 3)
    assert plan.choose_schedule(256, 8208, sms, 3, 64, 2) == (1, 2)
    # one request, short context: split down to single tiles, never more splits than tiles
    assert plan.choose_schedule(8, 1024, sms, 4, 64, 3)[0] == 16
    assert plan.choose_schedule(1, 64, sms, 4, 64, 3)[0] == 1
    # BF16 (no FP8 target): aim for the occupancy the kernel allows
    assert plan.choose_schedule(32, 32016, sms, 3) == (12, 3)


def test_launch_schedule_sizes_fp8_d64_and_d256_for_three_ctas():
    sms = 132
    # D=256 and D=64, B=32 x 8 heads: unsplit, ~2 CTAs per SM land, the kernel is sized for 3
    # (measured faster than sizing for the 2 that land: docs/design/sm90-decode.md#split-count-and-sizing)
    assert plan.launch_schedule(256, 8208, sms, 3, 64, 256, True) == (1, 3)
    assert plan.launch_schedule(256, 8208, sms, 4, 128, 64, True) == (1, 3)
    # BF16 D=256 keeps the sizing of the CTAs that land
    assert plan.launch_schedule(256, 8208, sms, 3, 64, 256, False) == (1, 2)
    # Qwen3 B=8 FP8 D=128: 12 splits, 3 CTAs/SM
    assert plan.launch_schedule(32, 32016, sms, 4, 64, 128, True) == (12, 3)
    # a caller's split count is kept and the kernel sized for its maximum occupancy
    assert plan.launch_schedule(32, 32016, sms, 4, 64, 128, True, num_splits=5) == (5, 4)
    # one request, short context
    assert plan.launch_schedule(8, 1024, sms, 4, 64, 128, True) == (16, 1)


def test_tuning_fits_shared_memory_and_registers():
    for kv_bytes in (1, 2):
        for d in (64, 128, 256):
            for n in (8, 16, 32, 64):
                stages, occ = decode_tuning(kv_bytes, d, n)
                stage = 2 * 64 * d * kv_bytes
                assert stages >= 2 and 1 <= occ <= 4
                assert occ * (stages * stage + n * d * 2) <= 227 * 1024


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("form", ["single", "pair"])
def test_signature_and_bound_caller_order(split, form):
    """The launcher's caller passes the op's per-call values and the launch's bound constants in
    the kernel signature's order (one binder for every op: ``ops._launch.bind``)."""
    from cute_kernels.ops._launch import bind

    cfg = make_decode_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1, page_size=16,
                             split=split, kv_form=form)
    names = [a.name for a in cfg.signature()]
    assert names[0] == "q" and names[-3:] == ["k_scale", "v_scale", "sm_scale"]
    assert ("kv_cache" in names) == (form == "single")
    assert ("counters" in names) == split
    seen = []
    caller = bind(op._CALL_PARAMS, (lambda *a: seen.append(a), cfg.signature(),
                                    {"kv_cache": "k", "k_cache": "k", "v_cache": "v"},
                                    dict(part_out="PO", part_lse="PL", counters="C", sm_scale=0.5)))
    caller("Q", "K", "V", "BT", "SL", "O", "L", 1.5, 2.5, "SI", -1)  # (sinks, window_left: unused here)
    src = {"q": "Q", "kv_cache": "K", "k_cache": "K", "v_cache": "V", "block_table": "BT", "seq_lens": "SL",
           "out": "O", "lse": "L", "part_out": "PO", "part_lse": "PL", "counters": "C", "k_scale": 1.5,
           "v_scale": 2.5, "sm_scale": 0.5}
    assert seen == [tuple(src[n] for n in names)]
    # float scales are checked on the way: an int becomes a float, a bad value names the argument
    caller("Q", "K", "V", "BT", "SL", "O", "L", 2, 2.5, None, -1)
    assert seen[-1][names.index("k_scale")] == 2.0 and type(seen[-1][names.index("k_scale")]) is float
    with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
        caller("Q", "K", "V", "BT", "SL", "O", "L", 1.5, float("nan"), None, -1)


def test_bind_views_a_0d_scale_and_refuses_an_unbound_argument():
    from cute_kernels.jit.spec import ScalarArg, TensorArg
    from cute_kernels.ops._launch import bind

    class Scale:
        ndim = 0

        def view(self, *shape):
            return ("view", shape)

    sig = (TensorArg("x", "fp32", (4,)), TensorArg("k_scale", "fp32", (1,), align=4), ScalarArg("n", "int32"))
    seen = []
    bind(("x", "k_scale"), (lambda *a: seen.append(a), sig, {"k_scale": "k_scale.view(1)"}, {"n": 3}))("X", Scale())
    assert seen == [("X", ("view", (1,)), 3)]
    # a rank the key leaves open: viewed only when not 1-D already
    caller = bind(("x", "k_scale"), (lambda *a: seen.append(a), sig, {"k_scale": "k_scale.view(1)?"}, {"n": 3}))
    one_d, zero_d = torch.ones(1), torch.tensor(2.0)
    caller("X", one_d)
    assert seen[-1][1] is one_d
    caller("X", zero_d)
    assert seen[-1][1].shape == (1,) and seen[-1][1].data_ptr() == zero_d.data_ptr()
    with pytest.raises(KeyError, match="'n' is neither a call parameter nor a bound constant"):
        bind(("x", "k_scale"), (print, sig, None, None))


def test_config_rejects_unsupported():
    with pytest.raises(ValueError, match="head_dim"):
        Sm90DecodeConfig(head_dim=96)
    with pytest.raises(ValueError, match="16-bit KV cache must have the query's dtype"):
        Sm90DecodeConfig(q_dtype="bf16", kv_dtype="fp16")
    with pytest.raises(ValueError, match="group \\* q_len"):
        Sm90DecodeConfig(group=32, q_len=4)


def test_cpu_tensors_run_the_reference_and_validate():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 64, generator=g).bfloat16()
    kv = torch.randn(6, 2, 2, 16, 64, generator=g).bfloat16()
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    sl = torch.tensor([40, 7], dtype=torch.int32)
    out = op.paged_decode(q, kv, bt, sl)
    torch.testing.assert_close(out, reference.paged_decode(q, kv, bt, sl), atol=0, rtol=0)
    with pytest.raises(TypeError, match="q must have dtype"):
        op.paged_decode(q.float(), kv, bt, sl)
    with pytest.raises(ValueError, match="kv_cache must be"):
        op.paged_decode(q, kv[:, :1], bt, sl)
    with pytest.raises(ValueError, match="kv_layout"):
        op.paged_decode(q, kv, bt, sl, kv_layout="XYZ")
    # the launch is cached by now: float scales are checked on the fast path
    for bad in (-1.0, 0.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="k_scale must be a positive"):
            op.paged_decode(q, kv, bt, sl, k_scale=bad)
        with pytest.raises(ValueError, match="v_scale must be a positive"):
            op.paged_decode(q, kv, bt, sl, v_scale=bad)
    torch.testing.assert_close(op.paged_decode(q, kv, bt, sl, k_scale=2, v_scale=0.5),
                               reference.paged_decode(q, kv, bt, sl, k_scale=2.0, v_scale=0.5), atol=0, rtol=0)
    with pytest.raises(ValueError, match="head dim mismatch"):
        op.paged_decode(q[..., :32], kv, bt, sl)


def test_device_buffer_grows_and_is_reused():
    from cute_kernels.ops._torch import DeviceBuffer

    buf = DeviceBuffer("test", torch.int32, zero=True, min_numel=16)
    dev = torch.device("cpu")
    a = buf.get(dev, 10)
    assert a.numel() == 16 and int(a.abs().sum()) == 0
    assert buf.get(dev, 16).data_ptr() == a.data_ptr()  # no reallocation for a request that fits
    b = buf.get(dev, 100)
    assert b.numel() == 100 and b.data_ptr() != a.data_ptr()
    assert buf.get(dev, 50).data_ptr() == b.data_ptr()  # never shrinks


def test_tuning_override_is_part_of_the_key_and_nests():
    from cute_kernels.ops._launch import LaunchCache

    cache = LaunchCache(max_entries=2)
    assert cache.override_key == ()
    with cache.tuning_override(tile=128):
        assert cache.override == {"tile": 128}
        with cache.tuning_override(widen="bits"):
            assert cache.override_key == (("tile", 128), ("widen", "bits"))
        assert cache.override_key == (("tile", 128),)
    assert cache.override == {} and cache.override_key == ()
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)  # full: starts over instead of growing without bound
    assert cache.get("a") is None and cache.get("c") == 3
    with op.tuning_override(tile=128):  # the op's public override feeds its launch key
        assert op._launcher.override_key == (("tile", 128),)


def test_public_ops_are_bound_on_first_access():
    """``cute_kernels.paged_decode`` resolves through the package's lazy ``__getattr__`` once;
    after that it is a plain module attribute (the hook's import round trip cost ~0.5 us per call)."""
    import cute_kernels

    fn = cute_kernels.paged_decode
    assert vars(cute_kernels)["paged_decode"] is fn is op.paged_decode


def test_warmup_lists_the_cluster_merge_variants():
    """Every split config a shape can reach at the cluster sizing (>= 2 CTAs per SM) comes with its
    cluster-merge form (the op takes it for splits of at most MAX_CLUSTER CTAs), unless the
    warm-up is told ``cluster=False``."""
    from cute_kernels.plans.sm90_decode import CLUSTER_MIN_SIZING
    from cute_kernels.warmup import decode_variants

    shape = dict(head_dim=128, num_q_heads=32, num_kv_heads=8, page_size=16, scale_tensors=(False,))
    configs = decode_variants(**shape)
    split = [c for c in configs if c.split and not c.cluster and c.occupancy >= CLUSTER_MIN_SIZING]
    clustered = {c for c in configs if c.cluster}
    assert split and all(c.split and not c.dynamic for c in clustered)
    assert {dataclasses.replace(c, cluster=True) for c in split} == clustered
    assert not any(c.cluster for c in decode_variants(**shape, cluster=False))


def test_cluster_launch_takes_no_merge_workspace():
    """A cluster-merged launch keeps its partials in shared memory: its compiled function takes the
    split count as a scalar instead of the global merge's partials and arrival counters."""
    cfg = make_decode_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=4, q_len=1, page_size=16,
                             split=True, occupancy=2)
    names = [a.name for a in cfg.signature()]
    assert {"part_out", "part_lse", "counters"} <= set(names) and "num_splits" not in names
    names = [a.name for a in dataclasses.replace(cfg, cluster=True).signature()]
    assert "num_splits" in names and not {"part_out", "part_lse", "counters"} & set(names)


def test_plan_config_drops_a_cluster_whose_partials_do_not_fit():
    """The op's config: the cluster form where the plan asks for it and the partials fit the K
    stages (Llama B1 FP8); where they do not (BF16 D 128, 64 rows: two stages at 2 CTAs/SM), the
    launch is planned again without the cluster, so its sizing is the global merge's (1 CTA/SM),
    not the one raised for the cluster."""
    def config_for(kv, **shape):
        return lambda split, **tuning: make_decode_config(q_dtype="bf16", kv_dtype=kv, split=split, page_size=16,
                                                          **shape, **tuning)

    llama = config_for("fp8_e4m3", head_dim=128, group=4, q_len=1)
    n, cfg = plan.plan_config(llama, 8, 1008, 132, None, True, None)
    assert n == 16 and cfg.cluster and cfg.occupancy >= plan.CLUSTER_MIN_SIZING

    wide = config_for("bf16", head_dim=128, group=16, q_len=4)
    probe = wide(False)
    assert plan.plan_launch(1, 1008, 132, probe.occupancy, probe.tile, 128, False, None, True, None)[2]  # wanted
    assert not wide(True, occupancy=plan.CLUSTER_MIN_SIZING).cluster_fits()
    n, cfg = plan.plan_config(wide, 1, 1008, 132, None, True, None)
    n_global, tuning, _ = plan.plan_launch(1, 1008, 132, probe.occupancy, probe.tile, 128, False, None, True, False)
    assert n == n_global == 16 and not cfg.cluster
    assert cfg == wide(True, **tuning) and cfg.occupancy == 1


def test_cluster_init_sync_reaches_the_cluster_launches_only():
    """``tuning_override(cluster_init_sync=True)`` (docs/design/sm90-decode.md#cluster-merge-exit):
    the cluster-merged launches take it, a launch of the global merge or no split does not (the
    config refuses it without a cluster), and the variants without it keep their labels (so their
    PTX digests)."""
    llama = dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=4, q_len=1, page_size=16,
                 k_scale_tensor=False, v_scale_tensor=False, kv_form="single", kv_layout="HND", items=8,
                 max_context=1008, num_sms=132)
    n, cfg = plan.launch_config(**llama, override=dict(cluster_init_sync=True))
    n_plain, plain = plan.launch_config(**llama)
    assert n == n_plain == 16 and cfg.cluster and cfg.cluster_init_sync
    assert cfg == dataclasses.replace(plain, cluster_init_sync=True)
    assert "cluster_init_sync" not in plain.label() and cfg.label().endswith(",cluster_init_sync=True]")
    for override in (dict(cluster=False), dict(cluster=True), {}):
        _, global_cfg = plan.launch_config(**{**llama, "items": 64}, override=dict(override, cluster_init_sync=True))
        assert global_cfg.cluster_init_sync == global_cfg.cluster
    _, unsplit = plan.launch_config(**llama, num_splits=1, override=dict(cluster_init_sync=True))
    assert not unsplit.split and not unsplit.cluster_init_sync
    with pytest.raises(ValueError, match="cluster_init_sync"):
        dataclasses.replace(plain, cluster=False, cluster_init_sync=True)
    shape = dict(head_dim=128, num_q_heads=32, num_kv_heads=8, page_size=16)
    warm = plan.decode_variants(**shape, cluster_init_sync=True)
    assert {c for c in warm if c.cluster_init_sync} == {c for c in warm if c.cluster} != set()
    synced = [c for c in plan.compile_variants() if c.cluster_init_sync]
    assert len(synced) == 1 and dataclasses.replace(synced[0], cluster_init_sync=False) in plan.compile_variants()


def test_cluster_merge_only_for_small_split_grids():
    """The cluster merge serves split launches of at most 16 CTAs per (request, KV head) that put at
    most one CTA on each SM (latency-bound); fuller grids keep the global merge."""
    sms = 132
    assert plan.use_cluster_merge(8, 16, sms)  # Llama B1 ctx 1000: 8 heads x 16 splits
    assert plan.use_cluster_merge(4, 2, sms)
    assert not plan.use_cluster_merge(32, 12, sms)  # Qwen3 B8 ctx 32000: 384 CTAs
    assert not plan.use_cluster_merge(8, 1, sms)  # no split
    assert not plan.use_cluster_merge(2, 32, sms)  # more splits than a cluster holds
    assert plan.CLUSTER_MIN_SIZING >= 2


def test_cluster_decision_precedes_the_sizing():
    """A small static split clusters and is sized for at least CLUSTER_MIN_SIZING CTAs per SM; a
    dynamic split (``deterministic=False`` with enough tiles per split, or forced) never
    clusters, so it keeps the schedule's sizing; ``force_cluster`` False never clusters."""
    sms = 132
    # Llama B1 ctx 1000 FP8: 16 splits x 8 heads, one CTA per SM -> cluster, sized for 2
    n, tuning, cluster = plan.plan_launch(8, 1008, sms, 4, 64, 128, True, None, True, None)
    assert (n, cluster) == (16, True) and tuning == dict(occupancy=plan.CLUSTER_MIN_SIZING)
    assert plan.plan_launch(8, 1008, sms, 4, 64, 128, True, None, True, False) == (16, dict(occupancy=1), False)
    # Qwen3 B8 ctx 32000: 12 x 32 CTAs -> global merge at 3 CTAs/SM
    assert plan.plan_launch(32, 32016, sms, 4, 64, 128, True, None, True, None) == (12, dict(occupancy=3), False)
    # one request, long context, deterministic=False: dynamic chunks, no cluster, no raised sizing
    n, tuning, cluster = plan.plan_launch(4, 8192, sms, 4, 64, 128, True, 4, False, None)
    assert tuning.get("dynamic") and not cluster
    assert not plan.plan_launch(8, 1008, sms, 4, 64, 128, True, None, True, True, force_dynamic=True)[2]
    # a kernel that fits only one CTA per SM cannot be sized for the cluster: the rule keeps the
    # global merge (forcing still clusters)
    assert not plan.plan_launch(8, 1008, sms, 1, 64, 128, True, None, True, None)[2]
    assert plan.plan_launch(8, 1008, sms, 1, 64, 128, True, None, True, True)[2]


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_scale_tensors_of_one_element_any_rank(shape):
    """The one scale validator accepts a 1-element fp32 tensor of any rank (a 0-d one included; the
    launcher passes it to the kernel's ``[1]`` argument as a view) and names the argument otherwise."""
    from cute_kernels.ops._launch import check_scale

    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 8, 64, generator=gen).bfloat16()
    kv = (torch.randn(6, 2, 2, 16, 64, generator=gen) * 8).to(torch.float8_e4m3fn)
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    sl = torch.tensor([40, 17], dtype=torch.int32)
    ks, vs = torch.full(shape, 0.5), torch.full(shape, 2.0)
    assert check_scale("k_scale", ks) is True and check_scale("k_scale", 0.5) is False
    torch.testing.assert_close(op.paged_decode(q, kv, bt, sl, k_scale=ks, v_scale=vs),
                               reference.paged_decode(q, kv, bt, sl, k_scale=0.5, v_scale=2.0), atol=0, rtol=0)
    with pytest.raises(ValueError, match="k_scale must be a float or a 1-element tensor, got shape"):
        check_scale("k_scale", torch.ones(2))
    with pytest.raises(TypeError, match="k_scale must be a float or a float32 tensor, got dtype float16"):
        check_scale("k_scale", torch.ones(shape, dtype=torch.float16))
    with pytest.raises(ValueError, match="k_scale must be a positive finite float, got a tensor"):
        check_scale("k_scale", ks, tensors=False)
    with pytest.raises(ValueError, match="k_scale must be a positive finite float or a float32 tensor"):
        check_scale("k_scale", True)


def test_warmups_read_the_registry(monkeypatch):
    """The warm-ups build the variants of the kernel the registry runs on the arch (as the op
    chooses it) and refuse an arch where none runs."""
    # (the functions by their modules, from sys.modules: the package attribute cute_kernels.warmup
    # is the module or the function of the same name, whichever was bound last)
    import dataclasses
    import importlib

    warmup_module = importlib.import_module("cute_kernels.warmup")
    from cute_kernels.qsa_warmup import qsa_warmup
    from cute_kernels.registry import KERNELS

    monkeypatch.setattr(warmup_module, "precompile", lambda configs, target, **kw: None)
    shape = dict(head_dim=128, num_q_heads=32, num_kv_heads=8, page_size=16)
    assert {c.kernel_id for c in warmup_module.warmup(arch="sm_90a", **shape)} == {"sm90.decode", "sm90.prefill"}
    assert {c.kernel_id for c in warmup_module.warmup(arch="sm_90a", prefill=False, **shape)} == {"sm90.decode"}
    for arch in ("sm_120a", "sm_86"):
        configs = warmup_module.warmup(arch=arch, **shape)
        assert {c.kernel_id for c in configs} == {"sm80.decode", "common.merge_states", "sm80.prefill"}
        assert all(c.target == arch for c in configs if c.kernel_id.startswith("sm80."))
        assert all(c.causal and not c.write_lse for c in configs if c.kernel_id == "sm80.prefill")  # the layer's
    mixed = warmup_module.warmup(arch="sm_90a", kv_dtypes=("fp16", "fp8"), **shape)  # bf16 query
    assert {(c.kernel_id, c.kv_dtype) for c in mixed if "merge" not in c.kernel_id} == {
        ("sm80.decode", "fp16"), ("sm90.decode", "fp8_e4m3"), ("sm80.prefill", "fp16"), ("sm90.prefill", "fp8_e4m3")}
    fp16 = warmup_module.warmup(arch="sm_100a", kv_dtypes=("fp16",), **shape)  # sm100.decode refuses it
    assert {c.target for c in fp16 if c.kernel_id.startswith("sm80.")} == {"sm_100a"}
    with pytest.raises(ValueError, match="sm100.decode has no warm-up list: nothing to warm up for sm_100a"):
        warmup_module.warmup(arch="sm_100a", **shape)
    monkeypatch.setitem(KERNELS, "sm80.decode", dataclasses.replace(KERNELS["sm80.decode"], status="planned"))
    with pytest.raises(ValueError, match="paged_decode has no kernel for a bf16 query and a bf16 cache on sm_86"):
        warmup_module.warmup(arch="sm_86", kv_dtypes=("bf16",), **shape)
    with pytest.raises(ValueError, match="sm90.qsa runs on sm90: nothing to warm up for sm_80"):
        qsa_warmup(arch="sm_80", head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568)


# ---------------------------------------------------------------------------------------------
# the tuning override, checked against the kernel a call selects (docs/design/inputs.md)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors take the CUDA path (target ``sm_90a`` unless ``state["target"]`` says otherwise,
    132 SMs); ``get_kernel`` records the configs it is asked for and returns a no-op kernel; the
    runtime self-checks pass."""
    from cute_kernels.ops import _decode_features as features

    state: dict = dict(target="sm_90a", compiled=[])

    def get_kernel(config, target):
        state["compiled"].append(config)
        return lambda *args: None

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(op, "compile_target", lambda device: state["target"])
    monkeypatch.setattr(op, "get_kernel", get_kernel)
    monkeypatch.setattr(op, "device_sm_count", lambda index: 132)
    monkeypatch.setattr(op, "stream_id", lambda t: 0)
    monkeypatch.setattr(op, "ffi_tensor", lambda t: t)
    monkeypatch.setattr(features, "self_check_passes", lambda config, device, runner: True)
    op._launcher.launches.clear()
    yield state
    op._launcher.launches.clear()


def _decode_problem(seed, *, kv=torch.float8_e4m3fn, q=torch.bfloat16, D=128, Hq=8, Hkv=2, page=16, q_len=1,
                    layout="HND", container="single", lens=(100, 37, 300)):
    from cute_kernels.testing import make_paged_decode_case

    print(f"seed {seed}")
    return make_paged_decode_case(batch=len(lens), num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page,
                                  seq_lens=list(lens), kv_dtype=kv, q_dtype=q, q_len=q_len, kv_layout=layout,
                                  container=container, generator=torch.Generator().manual_seed(seed), device="cpu")


def _call(c, **kw):
    return op.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **c.kwargs(), **kw)


_SM90_TUNABLE = ("balanced, cluster, cluster_init_sync, dynamic, evict_first, occupancy, pdl, prefetch_desc, "
                 "smem_merge, stages, strided, tile, widen")
BAD_DECODE_OVERRIDES = [
    # before (GPU): TypeError "Sm90DecodeConfig.__init__() got an unexpected keyword argument 'bogus'";
    # before (CPU): nothing checked at all
    (dict(bogus=1), ValueError, f"'bogus' is not a tuning field of sm90.decode; its fields: {_SM90_TUNABLE}$"),
    (dict(num_splits=4), ValueError, "'num_splits' is not a tuning field of sm90.decode"),  # an op argument
    (dict(smem_target="sm_80"), ValueError, "'smem_target' is not a tuning field of sm90.decode"),  # sm80's
    (dict(ldsm_xor=False), ValueError, "'ldsm_xor' is not a tuning field of sm90.decode"),
    # before: "make_decode_config() got multiple values for keyword argument ..."
    *[(dict([(name, value)]), ValueError, f"'{name}' is not a tuning field of sm90.decode \\(the call's arguments")
      for name, value in (("head_dim", 64), ("q_dtype", "fp16"), ("kv_dtype", "bf16"), ("group", 4), ("q_len", 2),
                          ("page_size", 32), ("kv_layout", "NHD"), ("kv_form", "pair"), ("k_scale_tensor", True),
                          ("v_scale_tensor", True), ("split", True))],
    # before: a window / sink variant for a call without them (an argument left unbound)
    (dict(window=True), ValueError, "'window' is not a tuning field of sm90.decode \\(the call's"),
    (dict(sinks=True), ValueError, "'sinks' is not a tuning field of sm90.decode \\(the call's"),
    # before: "'<=' not supported between instances of 'int' and 'str'"
    (dict(stages="3"), TypeError, "tuning_override: sm90.decode's stages must be an int, got '3'"),
    (dict(occupancy=2.0), TypeError, "sm90.decode's occupancy must be an int, got 2.0"),
    (dict(tile="128"), TypeError, "sm90.decode's tile must be an int, got '128'"),
    (dict(widen=1), TypeError, "sm90.decode's widen must be a str, got 1"),
    # before: silently true ("yes", "no", 1 are truthy)
    (dict(cluster_init_sync="yes"), TypeError, "sm90.decode's cluster_init_sync must be a bool, got 'yes'"),
    (dict(cluster="no"), TypeError, "sm90.decode's cluster must be a bool, got 'no'"),
    (dict(balanced=1), TypeError, "sm90.decode's balanced must be a bool, got 1"),
    (dict(dynamic="no"), TypeError, "sm90.decode's dynamic must be a bool, got 'no'"),
    (dict(pdl=0), TypeError, "sm90.decode's pdl must be a bool, got 0"),
    # before: ZeroDivisionError; a negative count sized the stages for no SM
    (dict(occupancy=0), ValueError, "occupancy must be >= 1 CTAs per SM, got 0"),
    (dict(occupancy=-1), ValueError, "occupancy must be >= 1 CTAs per SM, got -1"),
    # before: a config of no pipeline stages handed to the compiler
    (dict(stages=0), ValueError, "stages must be >= 2, got 0"),
    # the config's own checks (on the CPU path too now)
    (dict(tile=96), ValueError, "bad widen/tile cvt/96"),
    (dict(widen="fast"), ValueError, "bad widen/tile fast/64"),
    # the portable kernel, against its own config (backend="sm80")
    (dict(backend="sm80", cluster=True), ValueError, "'cluster' is not a tuning field of sm80.decode; its fields: "
     "balanced, fused_merge, gather_one_base, kv_first, ldsm_xor, lean_softmax, m_tiles, page_prefetch, pdl, q_regs, smem_target, "
     "stages, stats_smem, tw, "
     "warps_m, warps_n, widen$"),
    (dict(backend="sm80", tile=128), ValueError, "'tile' is not a tuning field of sm80.decode"),
    (dict(backend="sm80", target="sm_80"), ValueError, "'target' is not a tuning field of sm80.decode \\(the call's"),
    (dict(backend="sm80", split=False), ValueError, "'split' is not a tuning field of sm80.decode \\(the call's"),
    (dict(backend="sm80", stages="x"), TypeError, "sm80.decode's stages must be an int, got 'x'"),
    (dict(backend="sm80", ldsm_xor="no"), TypeError, "sm80.decode's ldsm_xor must be a bool, got 'no'"),
    (dict(backend="sm80", stages=0), ValueError, "bad tiling: tw 32, warps 1x4, stages 0"),
    (dict(backend="sm80", warps_n=0), ValueError, "bad tiling: tw 32, warps 1x0, stages 3"),  # ZeroDivisionError
    (dict(backend="sm80", smem_target="sm_99"), ValueError, "smem_target must be one of"),  # before: KeyError
    (dict(backend="sm80", stats_smem=True), ValueError, "stats_smem is a prefill field"),
]


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("override,exc,match", BAD_DECODE_OVERRIDES, ids=[str(b[0]) for b in BAD_DECODE_OVERRIDES])
def test_a_bad_decode_tuning_override_names_the_field(override, exc, match, path, request):
    """A tuning override is checked against the config of the kernel the call selects (CPU
    tensors: the one an SM90 GPU runs): a name that is no tuning field of it (or one the call's
    arguments decide), a value of the wrong type, an out-of-range count are refused naming the
    field, before any variant is compiled."""
    state = request.getfixturevalue("fake_gpu") if path == "gpu" else None
    c = _decode_problem(41)
    with op.tuning_override(**override), pytest.raises(exc, match=match):
        _call(c)
    if state is not None:
        assert state["compiled"] == []


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_the_override_is_checked_for_every_call_form(path, request):
    """Calls the reference serves on SM90 (an FP8 query) check the override as the target's 16-bit
    call does; a cached launch does not outlive a bad override (the override is in the key); an
    SM100 GPU's sm100.decode takes no tuning field (backend='sm80' forces the portable kernel)."""
    state = request.getfixturevalue("fake_gpu") if path == "gpu" else None
    c = _decode_problem(42)
    q8 = c.q.to(torch.float8_e4m3fn)
    with op.tuning_override(bogus=1), pytest.raises(ValueError, match="'bogus' is not a tuning field of sm90.decode"):
        op.paged_decode(q8, c.kv_cache, c.block_table, c.seq_lens, q_scale=0.5, **c.kwargs())
    _call(c)  # a launch cached without an override ...
    with op.tuning_override(stages="3"), pytest.raises(TypeError, match="stages must be an int"):
        _call(c)  # ... is not this call's
    if state is not None:
        state["target"] = "sm_100a"
        op._launcher.launches.clear()
        with op.tuning_override(widen="bits"), pytest.raises(
                ValueError, match="'widen' is not a tuning field of sm100.decode, which has none"):
            _call(c)
        with op.tuning_override(backend="sm80", widen="bits"):
            _call(c)
        assert {cfg.kernel_id for cfg in state["compiled"]} <= {"sm90.decode", "sm80.decode", "common.merge_states"}
        assert state["compiled"][-1].kernel_id != "sm90.decode"


def _gpu_table(module: str, name: str):
    """Table ``name`` of a GPU test module, without importing it (it skips itself without CUDA):
    its module-level assignments to ``name``, run on their own."""
    path = Path(__file__).parents[1] / "gpu" / f"{module}.py"
    ns: dict = dict(FP8=torch.float8_e4m3fn, BF16=torch.bfloat16, FP16=torch.float16)
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        if any(getattr(t, "id", None) == name for t in targets):
            exec(compile(ast.Module([node], []), str(path), "exec"), ns)
    assert ns.get(name), f"{module}.{name} not found"
    return ns[name]


def _repository_overrides() -> list[dict]:
    """Every paged_decode tuning override the repository uses: the tables (read from their
    modules) and the literal ones (listed with the file that uses them)."""
    from cute_kernels.bench import decode as bench_decode
    from cute_kernels.bench import sm80 as bench_sm80
    from profiling import sanitize_decode

    out = [dict(v) for v in _gpu_table("test_decode_gpu", "VARIANTS")] + [dict(v) for v in bench_decode.VARIANTS.values()]
    out += [dict(backend="sm80", **v) for v in bench_sm80.DECODE_VARIANTS.values()]
    for case in sanitize_decode.CASES.values():  # (functools.partial: their override keywords)
        kw = dict(getattr(case, "keywords", {}))
        fields = {k: v for k, v in kw.items() if k in ("cluster", "cluster_init_sync") and v is not None}
        if getattr(case, "func", None) is sanitize_decode.sm80_decode:
            fields = dict(backend="sm80", **kw["extra"])
        elif getattr(case, "func", None) is sanitize_decode.balanced:
            fields = dict(balanced=True)
        out.append(fields)
    out += [
        dict(strided=s, cluster=c) for s in (True, False) for c in (True, False)]  # tests/gpu/test_decode_gpu.py
    out += [dict(cluster=False, smem_merge=s) for s in (True, False)]  # tests/gpu/test_decode_gpu.py (staging)
    out += [dict(cluster=True), dict(cluster=False)]  # tests/gpu/test_trtllm_gpu.py, test_streams_gpu.py
    out += [dict(balanced=True), dict(balanced=True, backend="sm80")]  # tests/gpu/test_decode_balanced_gpu.py
    out += [dict(pdl=False), dict(cluster=False)]  # cute_kernels/bench/latency.py
    out += [dict(backend="sm80"), dict(backend="sm80", widen="bits"), dict(backend=None)]  # cute_kernels/bench/sm80.py
    out += [dict(dynamic=False), dict(dynamic=True)]  # profiling/split_schedule.py
    out += [dict(backend="sm80", widen=w) for w in ("bits", "cvt")]  # tests/gpu/test_sm80_decode_gpu.py
    # the runtime self-checks' calls (cute_kernels/ops/_decode_features.py)
    out += [dict(widen="cvt", cluster=True), dict(widen="bits", cluster=False), dict(balanced=True, widen="bits")]
    return out


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_every_override_the_repository_uses_passes_the_check(path, request):
    """The override tables and literals of the benchmarks, the lab scripts and the GPU tests pass
    the check (CPU tensors: the reference's result, bit for bit; the fake GPU: the config the
    kernel is compiled with holds the forced fields)."""
    state = request.getfixturevalue("fake_gpu") if path == "gpu" else None
    c = _decode_problem(43)
    want = reference.paged_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, **c.kwargs())
    for override in _repository_overrides():
        if state is not None:  # (an override listed twice: its launch is prepared again)
            state["compiled"].clear()
            op._launcher.launches.clear()
        with op.tuning_override(**override):
            got = _call(c)
        if state is None:
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            continue
        kernel = state["compiled"][0]
        assert kernel.kernel_id == ("sm80.decode" if override.get("backend") else "sm90.decode"), override
        for name in ("widen", "tile", "occupancy", "pdl", "evict_first", "prefetch_desc", "ldsm_xor"):
            if name in override:
                assert getattr(kernel, name) == override[name], (override, kernel)


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_the_portable_gpu_cases_overrides_pass_on_their_shapes(path, request):
    """tests/gpu/test_sm80_decode_gpu.py's cases (shapes and overrides, ``smem_target`` rings
    included) pass the check and plan on the CPU and the (fake) GPU alike."""
    state = request.getfixturevalue("fake_gpu") if path == "gpu" else None
    cases = _gpu_table("test_sm80_decode_gpu", "CASES")
    assert any("smem_target" in c[-1] for c in cases) and any("ldsm_xor" in c[-1] for c in cases)
    for i, (kv, q, D, Hq, Hkv, page, q_len, layout, container, splits, override) in enumerate(cases):
        c = _decode_problem(100 + i, kv=kv, q=q, D=D, Hq=Hq, Hkv=Hkv, page=page, q_len=q_len, layout=layout,
                            container=container, lens=(page + q_len, 3 * page))
        with op.tuning_override(backend="sm80", **override):
            _call(c, num_splits=splits)
        if state is not None:
            assert state["compiled"][-1].kernel_id in ("sm80.decode", "common.merge_states")
