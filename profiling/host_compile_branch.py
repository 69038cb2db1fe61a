"""What the torch.compile branch costs an eager op call (lab script; runs on the CPU).

Each public op starts with ``if compiling(): ...`` (docs/design/architecture.md#torchcompile).
This measures the eager hot path of each op as it is and as it would be without that branch (the
same function, recompiled from its source with the branch removed), in alternating bursts in one
process, so that a loaded machine slows both alike. A dummy stands in for the compiled kernel: a
launch bound by the launcher from the kernel's real signature is planted in the op's cache for CPU
tensors, so the op takes its CUDA hot path (key, lookup, bound caller) without a GPU. Reads the
ops' internals, so it follows them when they move.

For scale, it also times a do-nothing custom op (one mutated tensor, as the ``*_out`` ops) called
through the dispatcher against the same Python function called directly: the cost an eager call
would pay if the public functions always went through ``torch.ops``.

``python -m profiling.host_compile_branch [--rounds N] [--calls N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import ast
import inspect
import textwrap
import time
from typing import Optional

import torch

from cute_kernels.bench.harness import write_json
from cute_kernels.ops import merge_states as ms
from cute_kernels.ops import paged_decode as pd
from cute_kernels.ops import paged_prefill as pp
from cute_kernels.ops import qsa_sparse_attention as qs
from cute_kernels.ops import quantize_query as qq
from cute_kernels.ops import write_kv_cache as kw
from cute_kernels.ops._launch import bind
from cute_kernels.plans.merge_states import MergeStatesConfig
from cute_kernels.plans.quantize_query import QuantizeQueryConfig
from cute_kernels.plans.sm90_decode import make_decode_config
from cute_kernels.plans.sm90_qsa import make_qsa_config
from cute_kernels.plans.write_kv_cache import WriteKVCacheConfig


def _dummy(*args) -> None:
    pass


def without_compile_branch(fn):
    """``fn`` recompiled from its source without its leading ``if compiling(): ...`` statement."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    (func,) = tree.body
    func.decorator_list = []
    body = [s for s in func.body if not (isinstance(s, ast.If) and isinstance(s.test, ast.Call)
                                         and getattr(s.test.func, "id", None) == "compiling")]
    assert len(body) == len(func.body) - 1, f"{fn.__name__}: no compile branch found"
    func.body = body
    env = dict(fn.__globals__)
    exec(compile(tree, inspect.getsourcefile(fn), "exec"), env)  # noqa: S102 - the op's own source
    return env[fn.__name__]


def cases() -> dict:
    """name -> (module, public function name, zero-argument call of a given function)."""
    q = torch.randn(1, 32, 128, dtype=torch.bfloat16)  # Llama-3-8B batch of one
    kv = torch.zeros(64, 2, 8, 16, 128, dtype=torch.float8_e4m3fn)
    bt = torch.zeros(1, 64, dtype=torch.int32)
    sl = torch.full((1,), 1000, dtype=torch.int32)
    out = torch.empty_like(q)
    src = {"kv_cache": "k", "k_cache": "k", "v_cache": "v"}
    cfg = make_decode_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=4, q_len=1, page_size=16,
                             split=False)
    key = pd._key(q, kv, kv, False, bt, "HND", 1, None, 1.0, 1.0, out, False, None, True)
    pd._launcher.put(key, pd._Launch(bind(pd._CALL_PARAMS, (_dummy, cfg.signature(), src, dict(sm_scale=0.088))),
                                     None, (1, 32, 128)))

    qo = torch.empty(1, 32, 128, dtype=torch.float8_e4m3fn)
    qcfg = QuantizeQueryConfig(q_dtype="bf16", head_dim=128, vec=16, items=2, pdl=True)
    qq._launcher.put(qq._key(q, 0.5, qo, None),
                     qq._Launch(bind(qq._CALL_PARAMS, (_dummy, qcfg.signature(), None, None)), False))

    k = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.int64)
    wcfg = WriteKVCacheConfig(in_dtype="bf16", cache_dtype="fp8_e4m3", head_dim=128, vec=16, pdl=True)
    kw._launcher.put(kw._key(k, v, kv, slots, "HND", 1.0, 1.0),
                     kw._Launch(bind(kw._CALL_PARAMS, (_dummy, wcfg.signature(), None, None)), False, False))

    po, pl = torch.randn(4, 1, 32, 128), torch.randn(4, 1, 32)
    mo, ml = torch.empty(1, 32, 128), torch.empty(1, 32)
    mcfg = MergeStatesConfig(out_dtype="fp32", head_dim=128, vec=4)
    ms._launcher.put(ms._key(po, pl, None, mo, ml),
                     ms._Launch(bind(ms._CALL_PARAMS, (_dummy, mcfg.signature(), None, None)), False, torch.float32))

    # prefill: 4 requests of 64 new tokens (the launch's caller is the dummy itself)
    pq = torch.randn(256, 32, 128, dtype=torch.bfloat16)
    pbt = torch.zeros(4, 64, dtype=torch.int32)
    psl = torch.full((4,), 1000, dtype=torch.int32)
    qsl = torch.arange(0, 257, 64, dtype=torch.int32)
    po2 = torch.empty_like(pq)
    pkey = pp._key(pq, kv, False, pbt, qsl, "HND", True, None, None, 1.0, 1.0, po2, False)
    pp._launcher.put(pkey, pp._Launch(_dummy, (256, 32, 128), torch.bfloat16))

    qn = torch.randn(4, 24, 256, dtype=torch.bfloat16)
    kc = torch.zeros(8, 1568, 2, 256, dtype=torch.bfloat16)
    idx = torch.zeros(4, 2052, dtype=torch.int32)
    bt2 = torch.zeros(1, 8, dtype=torch.int32)
    t2r = torch.zeros(4, dtype=torch.int32)
    o2 = torch.empty_like(qn)
    scfg = make_qsa_config(q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=12, page_size=1568, split=False,
                           gate=False)
    call = bind(qs._CALL_PARAMS, (_dummy, scfg.signature(), {"gate": "q"}, dict(lse=None)))
    qs._launcher.put(qs._key(qn, kc, kc, idx, bt2, t2r, False, 1.0, 1.0, o2, None),
                     qs._Launch(call, _dummy, None, None, None, None, 1, False))
    return {
        "paged_decode B1 (out=)": (pd, "paged_decode", lambda f: lambda: f(q, kv, bt, sl, out=out)),
        "paged_prefill 4x64 (out=)": (pp, "paged_prefill", lambda f: lambda: f(pq, kv, pbt, psl, qsl, out=po2)),
        "quantize_query (out=)": (qq, "quantize_query", lambda f: lambda: f(q, 0.5, out=qo)),
        "write_kv_cache": (kw, "write_kv_cache", lambda f: lambda: f(k, v, kv, slots)),
        "merge_states (out=)": (ms, "merge_states", lambda f: lambda: f(po, pl, out=mo, out_lse=ml)),
        "qsa_sparse_attention N4 (out=)": (qs, "qsa_sparse_attention",
                                           lambda f: lambda: f(qn, kc, kc, idx, bt2, t2r, prefill=False, out=o2)),
    }


def _burst(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e9


def measure(rounds: int = 30, calls: int = 5000) -> list[dict]:
    """Per op: the best ns/call over ``rounds`` alternating bursts, with and without the branch."""
    rows = []
    for name, (module, attr, make) in cases().items():
        with_branch = make(getattr(module, attr))
        without = make(without_compile_branch(getattr(module, attr)))
        for fn in (with_branch, without):
            _burst(fn, calls)  # warm
        a, b = [], []
        for _ in range(rounds):
            a.append(_burst(with_branch, calls))
            b.append(_burst(without, calls))
        rows.append(dict(op=name, with_branch_ns=round(min(a)), without_ns=round(min(b)),
                         delta_ns=round(min(a) - min(b))))
    return rows


def dispatcher_cost(rounds: int = 30, calls: int = 5000) -> dict:
    """Best ns/call of a do-nothing function called directly and as a registered custom op."""

    def nothing(x: torch.Tensor, scale: float, scale_tensor: Optional[torch.Tensor]) -> None:  # noqa: UP045
        pass

    op = torch.library.custom_op("cute_kernels_lab::nothing", mutates_args=("x",))(nothing)
    op.register_fake(lambda x, scale, scale_tensor: None)
    x = torch.empty(4)
    direct, through = (lambda: nothing(x, 1.0, None)), (lambda: op(x, 1.0, None))
    a, b = [], []
    for _ in range(rounds):
        a.append(_burst(direct, calls))
        b.append(_burst(through, calls))
    return dict(direct_ns=round(min(a)), dispatcher_ns=round(min(b)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30, help="alternating bursts per op")
    p.add_argument("--calls", type=int, default=5000, help="calls per burst")
    p.add_argument("--json", default=None, help="write the rows to this file")
    a = p.parse_args(argv)
    rows = measure(a.rounds, a.calls)
    for r in rows:
        print(f"{r['op']:34s} {r['with_branch_ns']:6d} ns with the branch, {r['without_ns']:6d} without "
              f"({r['delta_ns']:+d} ns)")
    dispatcher = dispatcher_cost(a.rounds, a.calls)
    print(f"do-nothing custom op: {dispatcher['dispatcher_ns']} ns through the dispatcher, "
          f"{dispatcher['direct_ns']} ns called directly")
    write_json(a.json, dict(torch=torch.__version__, rows=rows, dispatcher=dispatcher))


if __name__ == "__main__":
    main()
