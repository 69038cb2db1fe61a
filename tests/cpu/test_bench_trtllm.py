"""``cute-kernels bench decode --api trtllm`` on a machine without a GPU: the flag parses, the
shapes are the issue's (Llama-shaped B 64 / ctx 32768 with sinks and a 4096-token window), and
the window requirement (>= 6x faster than the full context) is judged from the rows as stated."""

from __future__ import annotations

from cute_kernels.bench import build_parser
from cute_kernels.bench import trtllm as bench_trtllm


def test_api_flag_parses():
    parser, _ = build_parser("decode")
    assert parser.parse_args([]).api == "ops"
    args = parser.parse_args(["--api", "trtllm", "--shapes", "win4096", "--kv", "fp8"])
    assert args.api == "trtllm" and args.shapes == "win4096"


def test_shapes_hold_the_window_requirement_pairs():
    names = {s[0]: s for s in bench_trtllm.DECODE_SHAPES}
    for sinks in (False, True):
        full = [s for s in names.values() if s[4:6] == (64, 32768) and s[7] == -1 and s[8] == sinks]
        window = [s for s in names.values() if s[4:6] == (64, 32768) and s[7] == 4095 and s[8] == sinks]
        assert len(full) == 1 and len(window) == 1
        assert full[0][1:4] == (32, 8, 128)  # Llama-shaped


def _row(kv, window, sinks, us, ctx=32768):
    return dict(kv=kv, window_left=window, sinks=sinks, ctx=ctx, B=64, api_us=us)


def test_window_checks_judge_the_ratio():
    rows = [_row("fp8", -1, True, 700.0), _row("fp8", 4095, True, 100.0), _row("bf16", -1, False, 1200.0),
            _row("bf16", 4095, False, 300.0), _row("bf16", 4095, True, 1.0)]  # no full twin: no verdict
    lines = bench_trtllm.window_checks(rows)
    assert lines == ["window 4096 vs ctx 32768 (fp8, sinks True): x7.00 (need >= 6) PASS",
                     "window 4096 vs ctx 32768 (bf16, sinks False): x4.00 (need >= 6) FAIL"]


def test_prefill_api_flag_parses_and_its_shapes_have_windows_and_sinks():
    parser, _ = build_parser("prefill")
    assert parser.parse_args([]).api == "ops"
    assert parser.parse_args(["--api", "trtllm"]).api == "trtllm"
    shapes = bench_trtllm.PREFILL_SHAPES
    assert any(s[7] == -1 for s in shapes) and any(s[7] >= 0 and s[8] for s in shapes)
    assert any(s[2] > 0 for s in shapes)  # a chunked prefill after a cached prefix


def test_rows_print_without_a_roofline(capsys):
    bench_trtllm._print_row(dict(shape="x", kv="bf16", api_us=10.0, api_err=1e-3, op_error="E: no"), ("api", "op"))
    out = capsys.readouterr().out
    assert "10.0us e=1.0e-03" in out and "(E: no)" in out
