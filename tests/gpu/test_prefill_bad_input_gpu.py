"""Bad input to ``cute_kernels.paged_prefill`` on CUDA tensors (the CPU-runnable half is
tests/cpu/test_prefill_host.py, with the same list): every argument error is raised before any
launch and names the argument, on the first call and on the cached path where TVM-FFI refuses
first; malformed data the host cannot see (a decreasing ``query_start_loc``, a huge ``seq_len``,
pages out of range, a ``max_query_len`` below a request) never kills the context, and
``CUTE_KERNELS_CHECK=1`` names the first bad entry."""

from __future__ import annotations

import pytest
import torch

import cute_kernels
from cute_kernels import reference
from cute_kernels.testing import make_paged_prefill_case, rel_err

from ..cpu.test_prefill_host import BAD
from .conftest import sm90_only

pytestmark = [sm90_only(), pytest.mark.usefixtures("prefill_kernel_only")]


def _problem(seed=0, poison_tail=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    c = make_paged_prefill_case(reqs=[(0, 5), (12, 3), (0, 0), (30, 1)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                page_size=16, poison_tail=poison_tail, generator=g)
    return dict(q=c.q, kv_cache=c.kv_cache, block_table=c.block_table, seq_lens=c.seq_lens,
                query_start_loc=c.query_start_loc, kv_layout="HND", k_scale=1.0, v_scale=1.0)


def _call(p, **extra):
    args = (p["q"], p["kv_cache"], p["block_table"], p["seq_lens"], p["query_start_loc"])
    kw = {k: p[k] for k in ("kv_layout", "k_scale", "v_scale", "q_scale", "sm_scale", "causal", "max_query_len",
                            "out") if k in p}
    return cute_kernels.paged_prefill(*args, **kw, **extra)


def _good_call_still_works():
    p = _problem(1)
    out = _call(p)
    ref = reference.paged_prefill(p["q"], p["kv_cache"], p["block_table"], p["seq_lens"], p["query_start_loc"])
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("name,mutate,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument_on_cuda(name, mutate, exc, match):
    p = _problem()
    _call(dict(p))  # a cached launch of the good shapes first
    mutate(p)
    for k in ("q", "kv_cache", "out"):  # the mutations build CPU tensors: move them over
        if isinstance(p.get(k), torch.Tensor) and not p[k].is_cuda:
            p[k] = p[k].cuda() if name != "misaligned q" else \
                torch.zeros(p[k].numel() + 1, dtype=p[k].dtype, device="cuda")[1:].view(p[k].shape)
    with pytest.raises(exc, match=match):
        _call(p)


def test_tensors_on_other_devices_are_named():
    p = _problem()
    for name in ("block_table", "seq_lens", "query_start_loc"):
        bad = dict(p, **{name: p[name].cpu()})
        with pytest.raises(ValueError, match=f"{name} must be on cuda"):
            _call(bad)
    with pytest.raises(ValueError, match="k_scale must be on cuda"):
        _call(dict(p, k_scale=torch.tensor([1.0])))


@pytest.mark.parametrize("corrupt", ["qsl_decreasing", "qsl_past_T", "huge_seq_len", "negative_seq_len",
                                     "pages_out_of_range", "max_query_len_too_small"])
def test_malformed_data_never_kills_the_context(corrupt):
    p = _problem(poison_tail=corrupt != "huge_seq_len")  # a longer length makes the stale tail visible
    extra = {}
    if corrupt == "qsl_decreasing":
        p["query_start_loc"] = torch.tensor([0, 5, 2, 8, 9], dtype=torch.int32, device="cuda")
    elif corrupt == "qsl_past_T":
        p["query_start_loc"] = torch.tensor([0, 5, 2**30, -7, 2**31 - 1], dtype=torch.int32, device="cuda")
    elif corrupt == "huge_seq_len":
        p["seq_lens"][0] = 2**31 - 1  # bounded by the block table: runs as fast as its capacity
    elif corrupt == "negative_seq_len":
        p["seq_lens"][1] = -100
    elif corrupt == "pages_out_of_range":
        p["block_table"].fill_(-(2**31))
        p["block_table"][0, 0] = 2**31 - 1
    else:
        extra["max_query_len"] = 3  # request 0 has 5 rows: its rows past 3 are unspecified
    out = _call(p, **extra)
    torch.cuda.synchronize()
    assert out.shape == p["q"].shape
    if corrupt in ("huge_seq_len", "negative_seq_len", "pages_out_of_range"):  # defined results
        ref = reference.paged_prefill(p["q"], p["kv_cache"], p["block_table"], p["seq_lens"], p["query_start_loc"])
        assert rel_err(out, ref) <= 1e-2 and torch.isfinite(out).all()
    _good_call_still_works()


@pytest.fixture
def checked():
    """Checked mode (CUTE_KERNELS_CHECK=1) for one test: every op validates its data."""
    from cute_kernels.ops import _launch

    previous = _launch.set_checked(True)
    yield
    _launch.set_checked(previous)


def test_checked_mode_names_the_first_bad_entry(checked):
    p = _problem()
    _call(p)
    p["block_table"][1, 0] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -1 is outside"):
        _call(p)
    p = _problem()
    p["query_start_loc"] = torch.tensor([0, 5, 2, 8, 9], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="non-decreasing"):
        _call(p)
