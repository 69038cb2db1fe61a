"""torch.compile and torch.library on the CPU: every public op is a ``torch.ops.cute_kernels.*``
custom op that Dynamo traces without a graph break, compiled steps equal eager bit for bit (CPU
tensors run the reference inside the ops), ``torch.library.opcheck`` accepts each op, and the
eager path never goes through the dispatcher.

A step that calls every op in every form (functional and ``out=``, one cache tensor and a
``(k, v)`` pair, float and tensor scales, RoPE, the output gate) is traced with
``fullgraph=True``; its outputs passed as ``out=`` are poisoned with NaN first, and its inputs are
fresh random tensors per seed (printed, so that a failure replays).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import cute_kernels
from cute_kernels.ops import _library
from cute_kernels.ops import merge_states as ms_op
from cute_kernels.ops import paged_decode as pd_op
from cute_kernels.ops import qsa_sparse_attention as qsa_op
from cute_kernels.ops import quantize_query as qq_op
from cute_kernels.ops import write_kv_cache as kv_op
from cute_kernels.testing import make_paged_decode_case, make_paged_prefill_case
from dispatch import AttentionLayer

from .test_layer_dispatch import clone_cache, make_step
from .test_qsa_reference import make_qsa_case

# opcheck's schema check goes through torch.jit internals that warn about their own deprecation
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
OPS = ("merge_states", "merge_states_out", "paged_decode", "paged_decode_out", "paged_prefill", "paged_prefill_out",
       "qsa_sparse_attention", "qsa_sparse_attention_out", "quantize_query", "quantize_query_out", "write_kv_cache")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_inputs(seed: int) -> SimpleNamespace:
    """Fresh random inputs of one serving-like step (CPU, small)."""
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    c = make_paged_decode_case(batch=3, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                               seq_lens=[5, 40, 17], kv_dtype=FP8, device="cpu", generator=g, poison_tail=False)
    page = 16
    slots = torch.tensor([int(c.block_table[0, 0]) * page + 4, int(c.block_table[1, 2]) * page + 7, -1])
    qsa = make_qsa_case(rows=4, num_q_heads=4, num_kv_heads=2, head_dim=64, page=16, generator=g, gate=True)
    qsa.pop("meta")
    p = make_paged_prefill_case(reqs=[(5, 3), (0, 4), (20, 2)], num_q_heads=8, num_kv_heads=2, head_dim=64,
                                page_size=16, kv_dtype=FP8, k_scale=0.5, generator=g, device="cpu", poison_tail=False)
    prefill = dict(q=p.q, kv_cache=p.kv_cache, block_table=p.block_table, seq_lens=p.seq_lens,
                   query_start_loc=p.query_start_loc)
    return SimpleNamespace(
        q=c.q, kv=c.kv_cache, block_table=c.block_table, seq_lens=c.seq_lens,
        key=torch.randn(3, 2, 64, generator=g).to(BF16), value=torch.randn(3, 2, 64, generator=g).to(BF16),
        slots=slots, k_scale=torch.tensor(0.0625) * (1 + torch.rand((), generator=g)), v_scale=0.5,
        q_scale=torch.rand(2, generator=g) * 0.1 + 0.05,
        cos_sin=torch.randn(64, 32, generator=g), positions=torch.randint(0, 64, (3,), generator=g),
        sinks=torch.randn(8, generator=g), qsa=qsa, prefill=prefill,
    )


def poisoned_outputs(x: SimpleNamespace) -> dict:
    nan = float("nan")
    return dict(
        decode_out=torch.full_like(x.q, nan), merge_out=torch.full((3, 8, 64), nan),
        merge_lse=torch.full((3, 8), nan), q8=torch.full(x.q.shape, nan).to(FP8),
        qsa_out=torch.full_like(x.qsa["q"], nan), prefill_out=torch.full_like(x.prefill["q"], nan),
    )


def step(x: SimpleNamespace, o: dict, kv: torch.Tensor) -> tuple:
    """Every public op, in every form the schema has."""
    cute_kernels.write_kv_cache(x.key, x.value, kv, x.slots, k_scale=x.k_scale, v_scale=x.v_scale)
    out, lse = cute_kernels.paged_decode(x.q, kv, x.block_table, x.seq_lens, k_scale=x.k_scale, v_scale=x.v_scale,
                                         return_lse=True)
    pair = (kv[:, 0], kv[:, 1])
    out2 = cute_kernels.paged_decode(x.q, pair, x.block_table, x.seq_lens, k_scale=0.25, v_scale=x.v_scale,
                                     out=o["decode_out"])
    parts, part_lse = torch.stack([out.float(), out2.float()]), torch.stack([lse, lse - 1.0])
    merged, merged_lse = cute_kernels.merge_states(parts, part_lse, out_dtype=BF16)
    cute_kernels.merge_states(parts, part_lse, out=o["merge_out"], out_lse=o["merge_lse"])
    q8 = cute_kernels.quantize_query(x.q, 0.25, rope=(x.cos_sin, x.positions))
    cute_kernels.quantize_query(x.q, x.q_scale, out=o["q8"])
    # an FP8 query (q_scale), sinks and a sliding window (served by the reference off SM100)
    fp8_out, fp8_lse = cute_kernels.paged_decode(q8, kv, x.block_table, x.seq_lens, q_scale=0.25, k_scale=x.k_scale,
                                                 sinks=x.sinks, window_left=8, return_lse=True)
    pre_out, pre_lse = cute_kernels.paged_prefill(**x.prefill, k_scale=0.5, return_lse=True)
    cute_kernels.paged_prefill(**x.prefill, max_query_len=4, k_scale=x.k_scale, window_left=3, sinks=x.sinks,
                               out=o["prefill_out"])
    q8p = cute_kernels.quantize_query(x.prefill["q"], x.q_scale)  # per KV head
    pre8 = cute_kernels.paged_prefill(q8p, *list(x.prefill.values())[1:], q_scale=x.q_scale, v_scale=0.5)
    gated = cute_kernels.qsa_sparse_attention(**x.qsa, prefill=False)
    ungated = {**x.qsa, "output_gate": None, "k_scale": 0.5}
    cute_kernels.qsa_sparse_attention(**ungated, prefill=True, out=o["qsa_out"])
    return (out, lse, out2, merged, merged_lse, o["merge_out"], o["merge_lse"], q8, o["q8"], fp8_out, fp8_lse,
            pre_out, pre_lse, o["prefill_out"], pre8, gated, o["qsa_out"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def assert_same(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert not torch.isnan(a.float()).any(), f"output {i} has NaN (a poisoned element was not written)"
        assert torch.equal(_bits(a), _bits(b)), f"output {i} differs from eager"


def test_every_op_is_registered_with_its_schema():
    ops = _library.registered_ops()
    assert sorted(ops) == sorted(OPS)
    schemas = {name: str(op.default._schema) for name, op in ops.items()}
    # the unions the schema cannot hold arrive split, and the mutations are declared
    assert "Tensor k_cache, Tensor? v_cache" in schemas["paged_decode"]
    assert "float k_scale, Tensor? k_scale_tensor" in schemas["paged_decode"]
    assert schemas["paged_decode"].endswith("-> (Tensor, Tensor)")
    assert "float? q_scale, Tensor? q_scale_tensor, SymInt window_left, Tensor? sinks" in schemas["paged_decode"]
    assert "Tensor(a19!)? workspace, Tensor(a20!) out) -> Tensor" in schemas["paged_decode_out"]
    assert "SymInt window_left, Tensor? sinks, Tensor? q_residual) -> (Tensor, Tensor)" in schemas["paged_prefill"]
    assert "Tensor(a2!) k_cache, Tensor(a3!)? v_cache" in schemas["write_kv_cache"]
    assert "Tensor? cos_sin_cache, Tensor? positions" in schemas["quantize_query"]
    assert "Tensor(a2!) out, Tensor(a3!) out_lse" in schemas["merge_states_out"]
    assert "float k_scale, Tensor? k_scale_tensor" in schemas["qsa_sparse_attention"]
    assert "Tensor(a12!) out" in schemas["qsa_sparse_attention_out"]


def test_registered_functions_annotate_optionals_as_optional():
    """Schema inference reads the annotations as strings; older torch releases (the GPU host's
    2.11) accept ``Optional[X]`` but not ``X | None``."""
    import inspect

    _library.registered_ops()
    assert sorted(_library._DEFS) == sorted(OPS)
    for name, definition in _library._DEFS.items():
        for p in inspect.signature(definition._init_fn).parameters.values():
            assert "|" not in str(p.annotation), (name, p.name, p.annotation)


def test_step_traces_as_one_graph_without_breaks():
    x = make_inputs(11)
    explained = torch._dynamo.explain(step)(x, poisoned_outputs(x), x.kv.clone())
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    targets = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    for name in OPS:
        assert f"cute_kernels.{name}.default" in targets, name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("seed", [21, 22])
def test_compiled_step_equals_eager(backend, seed):
    x = make_inputs(seed)
    eager_kv = x.kv.clone()
    want = step(x, poisoned_outputs(x), eager_kv)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    kv = x.kv.clone()
    got = compiled(x, poisoned_outputs(x), kv)
    assert_same(got, want)
    assert torch.equal(_bits(kv), _bits(eager_kv)), "the cache written under compile differs"
    assert not torch.equal(_bits(kv), _bits(x.kv)), "write_kv_cache wrote nothing"
    # fresh inputs of the same shapes: the compiled function runs again, no stale constants
    y = make_inputs(seed + 100)
    eager_kv = y.kv.clone()
    want = step(y, poisoned_outputs(y), eager_kv)
    kv = y.kv.clone()
    assert_same(compiled(y, poisoned_outputs(y), kv), want)
    assert torch.equal(_bits(kv), _bits(eager_kv))


@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_layer_step_compiles_whole(batch):
    """An AttentionLayer step (write, then attend) is one graph, equal to eager: a decode-only step
    from the first call; a step with prefill rows once an eager step has made the layer's plans
    (planning is host work Dynamo does not trace: a compile-verified kernel's plan reads the
    self-check records)."""
    rows = dict(decode_ctx=(20, 33, 1, 16)) if batch == "decode" else dict(decode_ctx=(20, 40),
                                                                           prefill=((0, 6), (9, 4)))
    st = make_step(**rows, generator=torch.Generator().manual_seed(31))
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype="fp8", page_size=16, arch="sm90", k_scale=0.5,
                           v_scale=torch.tensor(0.25))

    def forward(q, k, v, kv, md):
        return layer(q, k, v, kv, md)

    if batch == "mixed":
        forward(st.q, st.k, st.v, clone_cache(st.kv_cache), st.metadata)  # the warm-up step: plans cached
    explained = torch._dynamo.explain(forward)(st.q, st.k, st.v, clone_cache(st.kv_cache), st.metadata)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    eager_kv, kv = clone_cache(st.kv_cache), clone_cache(st.kv_cache)
    want = forward(st.q, st.k, st.v, eager_kv, st.metadata)
    got = torch.compile(forward, backend="aot_eager", fullgraph=True)(st.q, st.k, st.v, kv, st.metadata)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    assert torch.equal(_bits(kv), _bits(eager_kv))


def test_trtllm_calls_trace_through_the_registered_ops():
    """cute_kernels.trtllm's decode and context calls are argument adapters over paged_decode and
    paged_prefill: traced, they are one graph of the registered ops (after one eager call, which
    resolves which kernels serve them), equal to eager."""
    from cute_kernels import trtllm

    x = make_inputs(91)
    pre = x.prefill
    workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    kv_lens = torch.tensor([0, 8, 12, 34], dtype=torch.int32)

    def calls(q, kv, bt, sl, pq, pkv, pbt, psl, qsl):
        out, lse = trtllm.batch_decode_with_kv_cache(q, kv, workspace, bt, sl, 64, bmm1_scale=0.1, bmm2_scale=0.5,
                                                     sinks=x.sinks, window_left=8, return_lse=True)
        ctx = trtllm.batch_context_with_kv_cache(pq, pkv, workspace, pbt, psl, 4, 64, 0.1, 0.5, 3, qsl, kv_lens)
        return out, lse, ctx

    args = (x.q, x.kv, x.block_table, x.seq_lens, *pre.values())
    want = calls(*args)
    explained = torch._dynamo.explain(calls)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    targets = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"cute_kernels.paged_decode.default", "cute_kernels.paged_prefill.default"} <= targets
    assert_same(torch.compile(calls, backend="aot_eager", fullgraph=True)(*args), want)


@pytest.mark.parametrize("container", ["single", "tuple"])
def test_inductor_writes_the_cache_in_place(container):
    """The cache write stays a mutation of the caller's cache in inductor's code (reinplaced), not
    a functional copy of a whole cache per step; the decode writes into the step's output buffer."""
    from torch._inductor.utils import run_and_get_code

    st = make_step(decode_ctx=(20, 33), generator=torch.Generator().manual_seed(33), container=container)
    layer = AttentionLayer(8, 2, 64, kv_cache_dtype="fp8", page_size=16, arch="sm90", k_scale=0.5, v_scale=0.25)

    def forward(q, k, v, kv, md):
        return layer(q, k, v, kv, md)

    _, (code,) = run_and_get_code(torch.compile(forward, fullgraph=True), st.q, st.k, st.v,
                                  clone_cache(st.kv_cache), st.metadata)
    calls = [line.strip() for line in code.splitlines() if "torch.ops.cute_kernels." in line]
    assert len(calls) == 2, calls
    assert "write_kv_cache.default(" in calls[0] and "paged_decode_out.default(" in calls[1]
    assert "clone" not in code and ".copy_(" not in code


def _opcheck_cases(x: SimpleNamespace) -> dict:
    # 16-bit caches: opcheck's schema check compares tensors with allclose, which CPU torch does not
    # implement for float8 (the compiled-step tests above cover FP8 caches)
    kv = x.kv.to(BF16)
    pair = (kv[:, 0].clone(), kv[:, 1].clone())
    decode = (x.q, kv, None, x.block_table, x.seq_lens, "HND", 1, None, 1.0, x.k_scale, 0.5, None)
    q8 = x.q.to(FP8)
    parts = torch.randn(2, 3, 8, 64)
    part_lse = torch.randn(2, 3, 8)
    pre = x.prefill
    pre_args = (pre["q"], pre["kv_cache"].to(BF16), None, pre["block_table"], pre["seq_lens"], pre["query_start_loc"])
    qsa = x.qsa
    qsa_args = (qsa["q"], qsa["k_cache"], qsa["v_cache"], qsa["packed_indices"], qsa["block_table"],
                qsa["token_to_req"], False, 1.0, x.k_scale, 0.5, None, qsa["output_gate"])
    return {
        "merge_states": (parts, part_lse, torch.bfloat16),
        "merge_states_out": (parts, part_lse, torch.empty(3, 8, 64), torch.empty(3, 8)),
        "paged_decode": (*decode, True, None, True, None, None, -1, None, None),
        "paged_decode_out": (x.q, *pair, x.block_table, x.seq_lens, "HND", 1, 0.1, 0.25, None, 0.5, None, False,
                             None, True, None, None, 4, x.sinks, None, torch.empty_like(x.q)),
        "paged_decode_fp8_query": (q8, x.kv.clone(), None, x.block_table, x.seq_lens, "HND", 1, None, 1.0, None, 1.0,
                                   None, True, None, True, 1.0, x.q_scale[:1].clone(), -1, x.sinks, None),
        "paged_prefill": (*pre_args, None, "HND", True, None, None, None, 1.0, None, 1.0, None, True, -1, None, None),
        "paged_prefill_out": (*pre_args, 4, "HND", False, 0.2, None, None, 0.5, x.k_scale, 1.0,
                              None, False, 8, x.sinks, None, torch.empty_like(pre["q"])),
        "qsa_sparse_attention": qsa_args,
        "qsa_sparse_attention_out": (*qsa_args, torch.empty_like(qsa["q"])),
        "quantize_query": (x.q, 0.25, None, x.cos_sin, x.positions),
        "quantize_query_out": (x.q, 1.0, x.q_scale, None, None, torch.empty(x.q.shape, dtype=FP8)),
        "write_kv_cache": (x.key, x.value, *pair, x.slots, "HND", 1.0, x.k_scale, 0.5, None),
    }


@pytest.mark.parametrize("name", OPS + ("paged_decode_fp8_query",))
def test_opcheck(name):
    """Schema (declared mutations, no aliasing), fake implementation, autograd registration and
    AOT dispatch with dynamic shapes, as torch.library.opcheck checks them."""
    x = make_inputs(41)
    op = _library.registered_ops()[name.removesuffix("_fp8_query")]
    args = _opcheck_cases(x)[name]
    if name not in ("quantize_query_out", "paged_decode_fp8_query"):
        torch.library.opcheck(op.default, args)
        return
    # float8 tensors, which the schema check's allclose cannot compare on the CPU: the other checks
    # run (and the out variant's declared mutation is checked by hand)
    torch.library.opcheck(op.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    if name == "paged_decode_fp8_query":
        return
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = args[-1].view(torch.uint8).fill_(0x7F)  # NaN codes
    op(*args)
    for a, b in zip(args[:-1], before[:-1]):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), "an argument not declared mutated was written"
    assert not (out == 0x7F).any(), "out was not written"


def test_fake_outputs_match_the_real_ones():
    """The fake implementations build exactly the outputs the real ones return (shape, dtype,
    strides), for the return_lse forms too."""
    x = make_inputs(51)
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = _opcheck_cases(x)
    for name in ("merge_states", "paged_decode", "paged_decode_fp8_query", "paged_prefill", "qsa_sparse_attention",
                 "quantize_query"):
        args = cases[name]
        if name.startswith("paged_decode"):  # with and without the LSE
            args = [(*args[:12], flag, *args[13:]) for flag in (True, False)]
        elif name == "paged_prefill":
            args = [(*args[:16], flag, *args[17:]) for flag in (True, False)]
        else:
            args = [args]
        for a in args:
            real = _library.registered_ops()[name.removesuffix("_fp8_query")](*a)
            with FakeTensorMode(allow_non_fake_inputs=True):
                fake = _library.registered_ops()[name.removesuffix("_fp8_query")](*a)
            real = real if isinstance(real, tuple) else (real,)
            fake = fake if isinstance(fake, tuple) else (fake,)
            for r, f in zip(real, fake):
                assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), name


@pytest.mark.parametrize("module,attr,call", [
    (pd_op, "_paged_decode_op", lambda x: cute_kernels.paged_decode(x.q, x.kv, x.block_table, x.seq_lens)),
    (pd_op, "_paged_decode_out_op",
     lambda x: cute_kernels.paged_decode(x.q, x.kv, x.block_table, x.seq_lens, out=torch.empty_like(x.q))),
    (ms_op, "_merge_states_op", lambda x: cute_kernels.merge_states(torch.randn(2, 3, 8, 64), torch.randn(2, 3, 8))),
    (qq_op, "_quantize_query_op", lambda x: cute_kernels.quantize_query(x.q, 0.5)),
    (kv_op, "_write_kv_cache_op", lambda x: cute_kernels.write_kv_cache(x.key, x.value, x.kv, x.slots)),
    (qsa_op, "_qsa_op", lambda x: cute_kernels.qsa_sparse_attention(**x.qsa, prefill=False)),
])
def test_eager_calls_never_go_through_the_dispatcher(monkeypatch, module, attr, call):
    def dispatcher(*args, **kwargs):
        raise AssertionError(f"eager call went through torch.ops ({attr})")

    monkeypatch.setattr(module, attr, dispatcher)
    call(make_inputs(61))


def test_traced_calls_keep_the_argument_checks():
    """A malformed kv_cache tuple or rope is refused while tracing too, naming the argument."""
    x = make_inputs(71)

    def bad_cache(q):
        return cute_kernels.paged_decode(q, (x.kv[:, 0],), x.block_table, x.seq_lens)

    def bad_rope(q):
        return cute_kernels.quantize_query(q, 0.5, rope=x.cos_sin)

    for fn, match in ((bad_cache, "kv_cache tuple"), (bad_rope, "rope must be")):
        with pytest.raises(Exception, match=match):
            torch.compile(fn, backend="aot_eager", fullgraph=True)(x.q)
        torch._dynamo.reset()


def test_scale_and_cache_parts_round_trip():
    t = torch.ones(1)
    assert _library.scale_parts(0.5) == (0.5, None)
    assert _library.scale_parts(t) == (1.0, t)
    assert _library.scale_of(*_library.scale_parts(t)) is t
    assert _library.scale_of(*_library.scale_parts(2)) == 2.0
    kv = torch.empty(2, 2, 1, 16, 8)
    assert _library.cache_of(*_library.cache_parts(kv)) is kv
    k, v = kv[:, 0], kv[:, 1]
    assert _library.cache_of(*_library.cache_parts((k, v))) == (k, v)
    assert _library.cache_parts([k, v]) == (k, v)
    with pytest.raises(ValueError, match="kv_cache tuple"):
        _library.cache_parts((k,))
