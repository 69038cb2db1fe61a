"""The FP8-query prefill's register and byte bookkeeping, emulated on the CPU: the V^T transpose
(``prmt`` selectors and block mapping) stores exactly the token order in which P's accumulator
registers feed the e4m3 A fragment, so O = P V needs no shuffles."""

from __future__ import annotations

import random

import pytest

from cute_kernels.roles.smem_fp8 import PRMT_BYTES, PRMT_HALVES, p_token, transpose_block


def prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode): result byte i = byte ``sel`` nibble i of {b, a}."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def transpose_4x4(w):
    a = prmt(w[0], w[1], PRMT_BYTES[0])
    b = prmt(w[0], w[1], PRMT_BYTES[1])
    c = prmt(w[2], w[3], PRMT_BYTES[0])
    d = prmt(w[2], w[3], PRMT_BYTES[1])
    return [prmt(a, c, PRMT_HALVES[0]), prmt(a, c, PRMT_HALVES[1]), prmt(b, d, PRMT_HALVES[0]),
            prmt(b, d, PRMT_HALVES[1])]


def test_byte_transpose():
    rng = random.Random(0)
    for _ in range(100):
        m = [[rng.randrange(256) for _ in range(4)] for _ in range(4)]  # m[word][byte]
        words = [sum(m[j][i] << (8 * i) for i in range(4)) for j in range(4)]
        out = transpose_4x4(words)
        for i in range(4):
            assert [(out[i] >> (8 * j)) & 0xFF for j in range(4)] == [m[j][i] for j in range(4)]


@pytest.mark.parametrize("tile_n,D", [(64, 64), (128, 128), (64, 256), (128, 64)])
def test_vt_transpose_stores_the_p_register_order(tile_n, D):
    rng = random.Random(tile_n * D)
    V = [[rng.randrange(256) for _ in range(D)] for _ in range(tile_n)]  # V[token][d], one byte each
    Vt = [[None] * tile_n for _ in range(D)]
    groups = tile_n // 4
    for b in range(groups * D // 4):
        q, d0, toks = transpose_block(b, groups)
        words = [sum(V[t][d0 + i] << (8 * i) for i in range(4)) for t in toks]
        for i, w in enumerate(transpose_4x4(words)):
            for j in range(4):
                assert Vt[d0 + i][4 * q + j] is None, "written twice"
                Vt[d0 + i][4 * q + j] = (w >> (8 * j)) & 0xFF
    for d in range(D):
        for k in range(tile_n):
            assert Vt[d][k] == V[32 * (k // 32) + p_token(k % 32)][d]


def test_p_token_matches_register_ownership():
    """e4m3 A fragment (k32): thread t holds K indices 16 h + 4 (t % 4) + {0..3}; its QK accumulator
    holds columns 8 j + 2 (t % 4) + {0, 1} (same rows): each A value's token is one of its own."""
    assert sorted(p_token(k) for k in range(32)) == list(range(32))
    for t in range(4):
        acc_cols = {8 * j + 2 * t + c for j in range(4) for c in range(2)}
        a_idx = [16 * h + 4 * t + c for h in range(2) for c in range(4)]
        assert {p_token(k) for k in a_idx} == acc_cols
