"""``cute-kernels bench prefill`` without a GPU: the shapes it times, the causal work it counts
(checked against a brute-force count of the reference's visible positions) and its refusal."""

from __future__ import annotations

import pytest
import torch

from cute_kernels.bench import prefill as bench
from cute_kernels.cli import main as cli_main
from cute_kernels.testing import make_paged_prefill_case


@pytest.mark.parametrize("reqs", [[(0, 7)], [(5, 3), (0, 1), (16, 0), (2, 9)]])
@pytest.mark.parametrize("causal", [True, False])
def test_flops_count_the_visible_positions(reqs, causal):
    case = make_paged_prefill_case(reqs=reqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                   generator=torch.Generator().manual_seed(0), device="cpu")
    pairs = 0
    for prefix, n in reqs:
        L = prefix + n
        for j in range(n):
            pairs += sum(1 for t in range(L) if not causal or t < L - n + j + 1)
    assert case.attended_pairs(causal) == pairs
    assert case.flops(causal) == 4 * 64 * 4 * pairs


def test_shapes_are_the_agreed_table():
    named = {s[0]: s[1:] for s in bench.SHAPES}
    assert named["causal B1 S16384"] == (1, 0, 16384, 32, 8, 128)
    assert named["chunked B1 q2048 ctx32768"] == (1, 30720, 2048, 32, 8, 128)
    assert named["chunked B8 q512 ctx16384"] == (8, 15872, 512, 32, 8, 128)
    assert named["short B16 S512"] == (16, 0, 512, 32, 8, 128)
    assert {s[6] for s in bench.SHAPES} == {64, 128, 256} and bench.PAGE == 16
    assert set(bench.PEERS) | {"ours"} == set(bench.ENTRIES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_an_sm90_gpu(capsys):
    assert cli_main(["bench", "prefill", "--quick"]) == 2
    assert "needs an SM90 GPU" in capsys.readouterr().err


def test_per_tensor_q_scale_maps_the_largest_magnitude_onto_e4m3s_largest():
    from cute_kernels.testing import per_tensor_q_scale

    q = torch.tensor([[[0.5, -896.0, 3.0]]], dtype=torch.bfloat16)
    assert per_tensor_q_scale(q) == 2.0
    q8 = (q.float() / per_tensor_q_scale(q)).to(torch.float8_e4m3fn)
    assert q8.float().abs().max().item() == 448.0
