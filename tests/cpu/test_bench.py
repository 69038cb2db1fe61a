"""The benchmark tool shipped in the package (``cute-kernels bench``), on a machine without a GPU:
every benchmark's command line parses, a machine that cannot run it is refused in one line
(exit code 2, no traceback), missing peer libraries are reported one line each, NVTX ranges
carry exactly the op's name, and the shape tables are well formed. Timing needs a GPU:
tests/gpu/test_bench_gpu.py."""

from __future__ import annotations

import json
import math

import pytest

from cute_kernels.bench import BENCHMARKS, build_parser
from cute_kernels.bench import decode as bench_decode
from cute_kernels.bench import layer as bench_layer
from cute_kernels.bench import merge as bench_merge
from cute_kernels.bench import qsa as bench_qsa
from cute_kernels.bench.harness import (
    SM80_PLUS,
    SM90,
    NvtxRanges,
    Peer,
    available_peers,
    gpu_problem,
    module_available,
    parse_variants,
    write_json,
    write_partial,
)
from cute_kernels.cli import main as cli_main

# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", sorted(BENCHMARKS))
def test_every_benchmark_parses_its_defaults_and_common_flags(what):
    parser, module = build_parser(what)
    args = parser.parse_args([])
    assert args.json is None and args.nvtx is False
    args = parser.parse_args(["--json", "out.json", "--nvtx"])
    assert args.json == "out.json" and args.nvtx is True
    assert module.NEEDS in (SM90, SM80_PLUS)
    assert callable(module.main) and callable(module.add_arguments)


def test_benchmark_specific_flags():
    p, _ = build_parser("decode")
    a = p.parse_args(["--peers", "xqa,occ3", "--kv", "fp8", "--png", "x.png", "--quick", "--shapes", "B1,B8"])
    assert (a.peers, a.kv, a.png, a.quick, a.shapes) == ("xqa,occ3", "fp8", "x.png", True, "B1,B8")
    p, _ = build_parser("qsa")
    a = p.parse_args(["--kinds", "decode", "--decode-n", "4,16", "--check", "--tuning", ";producers=1"])
    assert (a.kinds, a.decode_n, a.check, a.tuning) == ("decode", "4,16", True, ";producers=1")
    p, _ = build_parser("layer")
    assert p.parse_args(["--tokens", "64", "--variants", "items=2"]).variants == "items=2"
    p, _ = build_parser("latency")
    a = p.parse_args(["--quick"])
    assert a.quick and not a.eager_study
    with pytest.raises(SystemExit):  # an unknown flag is an argparse error, not a traceback
        build_parser("merge")[0].parse_args(["--no-such-flag"])


@pytest.mark.parametrize("what", sorted(BENCHMARKS))
def test_no_gpu_is_one_line_and_exit_code_2(what, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", what]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: cute-kernels bench {what} needs ") and "no CUDA GPU" in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("what", ["decode", "prefill"])
def test_kernel_sm80_runs_the_portable_benchmark(what, capsys, monkeypatch):
    """``bench decode|prefill --kernel sm80`` is ``bench sm80 decode|prefill`` with the other flags
    (either spelling of the flag); ``--kernel sm90`` or none stays with the SM90 benchmark, and a
    bad value is an argparse error naming the flag."""
    import torch

    from cute_kernels.bench import route

    assert route(what, ["--kernel", "sm80", "--shapes", "B1"]) == ("sm80", [what, "--shapes", "B1"])
    assert route(what, ["--shapes", "B1", "--kernel=sm80"]) == ("sm80", [what, "--shapes", "B1"])
    assert route(what, ["--kernel", "sm90", "--quick"]) == (what, ["--kernel", "sm90", "--quick"])
    assert route("merge", ["--kernel", "sm80"]) == ("merge", ["--kernel", "sm80"])
    assert build_parser(what)[0].parse_args(["--kernel", "sm90"]).kernel == "sm90"
    args = build_parser("sm80")[0].parse_args(route(what, ["--kernel", "sm80", "--variants", "a:tw=16"])[1])
    assert (args.what, args.variants) == (what, "a:tw=16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", what, "--kernel", "sm80"]) == 2  # the portable benchmark refuses a machine without a GPU
    assert capsys.readouterr().err.startswith("error: cute-kernels bench sm80 needs ")
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", what, "--kernel", "sm70"])
    assert e.value.code == 2 and "--kernel" in capsys.readouterr().err


def test_bench_help_needs_no_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "decode", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--nvtx" in out and "--peers" in out and "--json" in out


def test_wrong_arch_names_the_device():
    msg = gpu_problem(SM90, cuda_available=lambda: True, capability=lambda: (8, 0), device_name=lambda: "NVIDIA A100")
    assert msg == "needs an SM90 GPU (H100/H200); this machine has NVIDIA A100 (sm_80)"
    assert gpu_problem(SM90, cuda_available=lambda: True, capability=lambda: (9, 0), device_name=lambda: "H200") is None
    assert gpu_problem(SM80_PLUS, cuda_available=lambda: True, capability=lambda: (10, 0),
                       device_name=lambda: "B200") is None
    assert "no CUDA GPU" in gpu_problem(SM80_PLUS, cuda_available=lambda: False)


# ----------------------------------------------------------------------------------------------
# peers
# ----------------------------------------------------------------------------------------------


def test_missing_peers_are_reported_one_line_each():
    requested = ["xqa", "fi", "fa4", "sdpa", "occ3", "num_splits=8"]
    run, skipped = available_peers(requested, bench_decode.PEER_LIBS, available=lambda m: m == "flash_attn")
    assert run == ["fa4", "sdpa", "occ3", "num_splits=8"]  # SDPA is torch's; variants are ours
    assert len(skipped) == 2
    for name, line in zip(("xqa", "fi"), skipped):
        assert line.startswith(f"peer {name} skipped: flashinfer is not installed (flashinfer-python; ")
        assert 'pip install "cute-kernels[bench]"' in line and "\n" not in line
    run, skipped = available_peers(requested, bench_decode.PEER_LIBS, available=lambda m: True)
    assert run == requested and skipped == []


def test_every_peer_is_known_and_every_library_is_in_the_bench_extra():
    from pathlib import Path

    import tomllib

    extra = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    bench_extra = " ".join(extra["project"]["optional-dependencies"]["bench"])
    assert set(bench_decode.PEER_LIBS) <= set(bench_decode.PEERS)
    assert set(bench_decode.PEERS) - set(bench_decode.PEER_LIBS) == {"sdpa"}
    assert set(bench_decode.DEFAULT_PEERS) <= set(bench_decode.PEERS)
    for peer in bench_decode.PEER_LIBS.values():
        assert peer.distribution in bench_extra, peer


def test_module_available():
    assert module_available("json")
    assert not module_available("no_such_module_for_the_bench")
    assert not module_available("no_such_parent.child")  # a missing parent is a missing module
    run, skipped = available_peers(["x"], {"x": Peer("no_such_module_for_the_bench", "nothing")})
    assert run == [] and len(skipped) == 1


# ----------------------------------------------------------------------------------------------
# NVTX ranges
# ----------------------------------------------------------------------------------------------


def test_nvtx_off_returns_the_call_itself():
    def fn():
        return 7

    assert NvtxRanges(False).wrap("cute_kernels.paged_decode", fn) is fn


def test_nvtx_range_is_named_exactly_the_op(monkeypatch):
    import nvtx

    events = []
    monkeypatch.setattr(nvtx, "push_range", lambda message=None, **kw: events.append(("push", message)))
    monkeypatch.setattr(nvtx, "pop_range", lambda **kw: events.append(("pop", None)))
    wrapped = NvtxRanges(True).wrap("cute_kernels.merge_states", lambda a, b=0: a + b)
    assert wrapped(2, b=3) == 5
    assert events == [("push", "cute_kernels.merge_states"), ("pop", None)]

    def boom():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        NvtxRanges(True).wrap("cute_kernels.paged_decode", boom)()
    assert events[-1] == ("pop", None)  # the range closes on an error too


# ----------------------------------------------------------------------------------------------
# shape tables
# ----------------------------------------------------------------------------------------------


def test_decode_shapes_are_well_formed():
    names = [s[0] for s in bench_decode.SHAPES]
    assert len(set(names)) == len(names)
    for name, hq, hkv, d, b, ctx, q_len in bench_decode.SHAPES:
        assert hq % hkv == 0 and d in (64, 128, 256), name
        assert 1 <= (hq // hkv) * q_len <= 64, name  # the KV group's query rows: one WGMMA N
        assert b >= 1 and ctx >= 1 and q_len >= 1, name
        assert f"B{b} " in name + " " and f"ctx{ctx}" in name, name  # the name says what it is
    assert bench_decode.select_shapes(None) == list(bench_decode.SHAPES) + list(bench_decode.RAGGED_SHAPES)
    assert [s[0] for s in bench_decode.select_shapes("B1 ctx,d256")] == ["llama3-8b B1 ctx1000", "d256 h16/8 B32 ctx8192"]
    assert bench_decode.select_shapes("ragged") == list(bench_decode.RAGGED_SHAPES)
    with pytest.raises(ValueError, match="--shapes: 'nothing' matches no shape"):  # it timed every shape
        bench_decode.select_shapes("nothing")
    named = {s[0]: s[1:] for s in bench_decode.SHAPES}
    assert named["llama3-70b-tp8 B64 ctx4096"] == (8, 1, 128, 64, 4096, 1)  # 70B under 8-way TP


def test_ragged_shapes_are_the_agreed_table():
    ragged = bench_decode.RAGGED_SHAPES
    names = [s[0] for s in ragged]
    assert len(set(names)) == len(names) and not set(names) & {s[0] for s in bench_decode.SHAPES}
    qwen = {(b, m) for _, hq, hkv, d, b, m, _ in ragged if (hq, hkv, d) == (32, 4, 128)}
    assert qwen == {(b, m) for b in (8, 32, 128) for m in (4000, 32000)}
    assert any((hq, hkv) == (8, 1) for _, hq, hkv, *_ in ragged)
    assert bench_decode.TABLE_TOKENS == 32768
    for shape in ragged:
        name, hq, hkv, d, b, m, q_len = shape
        assert bench_decode.is_ragged(shape) and "ragged" in name and f"B{b} " in name and f"max{m}" in name
        assert hq % hkv == 0 and 1 <= (hq // hkv) * q_len <= 64 and m <= bench_decode.TABLE_TOKENS
    assert not any(bench_decode.is_ragged(s) for s in bench_decode.SHAPES)


@pytest.mark.parametrize("batch, max_ctx", [(8, 4000), (32, 32000), (128, 32000), (64, 8192)])
def test_ragged_lens_are_seeded_uniform_draws(batch, max_ctx):
    lens = bench_decode.ragged_lens(batch, max_ctx)
    assert lens == bench_decode.ragged_lens(batch, max_ctx)  # the same batch in every run
    assert len(lens) == batch and all(1 <= x <= max_ctx for x in lens)
    assert len(set(lens)) > batch // 2  # ragged, not a constant
    assert lens != bench_decode.ragged_lens(batch, max_ctx - 1)
    twin = bench_decode.twin_ctx(lens)
    assert abs(twin * batch - sum(lens)) <= batch / 2  # the same tokens, to rounding
    if batch >= 32:  # a uniform draw: mean near max / 2
        assert 0.3 * max_ctx < sum(lens) / batch < 0.7 * max_ctx


def test_wide_block_table_and_present_tokens():
    import torch

    from cute_kernels.testing import make_paged_decode_case

    lens = [5, 40, 1]
    case = make_paged_decode_case(batch=3, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, seq_lens=lens,
                                  table_tokens=320, generator=torch.Generator().manual_seed(0), device="cpu")
    assert tuple(case.block_table.shape) == (3, 20)
    P = case.kv_cache.shape[0]
    assert int(case.block_table.min()) >= 0 and int(case.block_table.max()) < P
    # the pages the requests own are distinct: a permuted pool, as a serving engine's allocator leaves it
    owned = [int(p) for b, L in enumerate(lens) for p in case.block_table[b, :-(-L // 16)]]
    assert len(owned) == len(set(owned)) == 1 + 3 + 1
    assert case.visible_kv_bytes() == sum(lens) * 2 * 1 * 64 * 1  # FP8: tokens present x K,V x Hkv x D bytes
    with pytest.raises(ValueError, match="cannot hold"):
        make_paged_decode_case(batch=3, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, seq_lens=lens,
                               table_tokens=16, generator=torch.Generator().manual_seed(0), device="cpu")


def test_decode_variants_are_tuning_fields():
    assert bench_decode.variant_fields("balanced") == {"balanced": True}  # the balanced schedule's column
    p, _ = build_parser("decode")
    assert p.parse_args([]).balanced and not p.parse_args(["--no-balanced"]).balanced
    assert bench_decode.variant_fields("occ3") == {"occupancy": 3}
    assert bench_decode.variant_fields("occupancy=3+tile=128") == {"occupancy": 3, "tile": 128}
    assert not set(bench_decode.VARIANTS) & set(bench_decode.PEERS)


def test_merge_qsa_layer_tables_are_well_formed():
    assert len(set(bench_merge.SHAPES)) == len(bench_merge.SHAPES)
    for s, n, h, d in bench_merge.SHAPES:
        assert s >= 2 and n >= 1 and h >= 1 and d % 8 == 0
    assert bench_qsa.HQ % bench_qsa.HKV == 0 and bench_qsa.D in (64, 128, 256)
    assert list(bench_qsa.DECODE_N) == sorted(set(bench_qsa.DECODE_N)) and min(bench_qsa.DECODE_N) >= 1
    assert list(bench_qsa.PREFILL_T) == sorted(set(bench_qsa.PREFILL_T))
    assert set(bench_qsa.PREFILL_SELECTIONS) <= set(bench_qsa.SELECTIONS)
    assert bench_qsa.DECODE_CTX > bench_qsa.TOPK  # every decode row selects a full budget
    assert math.ceil(bench_qsa.DECODE_CTX / bench_qsa.PAGE) >= 1
    assert list(bench_layer.TOKENS) == sorted(set(bench_layer.TOKENS)) and bench_layer.HQ % bench_layer.HKV == 0


# ----------------------------------------------------------------------------------------------
# variant lists and JSON
# ----------------------------------------------------------------------------------------------


def test_parse_variants():
    # an empty variant is the default config (bench qsa --tuning ";producers=1")
    assert parse_variants(";producers=1,stages=4;") == [{}, {"producers": 1, "stages": 4}, {}]
    assert parse_variants("occupancy=3+tile=128", sep="+") == [{"occupancy": 3, "tile": 128}]
    assert parse_variants("items=2,pdl=0") == [{"items": 2, "pdl": 0}]


def test_write_json(tmp_path):
    path = tmp_path / "out.json"
    write_json(str(path), {"rows": [1.5]})
    assert json.loads(path.read_text()) == {"rows": [1.5]}
    write_json(None, {"rows": []})  # no path: nothing written, no error


def test_write_partial_marks_the_rows_so_far(tmp_path):
    """A run cut short keeps the rows it measured, marked partial; the final write replaces them."""
    path = tmp_path / "out.json"
    write_partial(str(path), read_bw=4e12, rows=[{"shape": "a"}])
    assert json.loads(path.read_text()) == {"read_bw": 4e12, "rows": [{"shape": "a"}], "partial": True}
    write_json(str(path), {"rows": [{"shape": "a"}, {"shape": "b"}]})
    assert "partial" not in json.loads(path.read_text())
    write_partial(None, rows=[])  # no path: nothing written


def test_self_check_state_of_compile_verified_kernels():
    """What ``bench prefill`` / ``bench serve`` report next to a compile-verified kernel's times: its
    family's self-check, and a failure (the reference served the calls: never the kernel's times)."""
    import time

    from cute_kernels.bench.harness import self_check_state
    from cute_kernels.plans import selfcheck_records as records

    for kid, q in (("sm90.decode", "bf16"), ("sm90.decode_balanced", "bf16"), ("sm90.prefill", "bf16"),
                   ("sm90.prefill_fp8q", "fp8_e4m3")):
        assert self_check_state(kid, q, "fp8_e4m3", 128) == (True, "")  # available: nothing to say
    assert self_check_state("sm100.decode", "fp8_e4m3", "fp8_e4m3", 128) == (
        True, "sm100.decode/f8: self-check not run")
    records.store(records.CheckRecord("sm100.decode/f8", "gpu0", True, "", 0.1, time.time()))
    assert self_check_state("sm100.decode", "fp8_e4m3", "fp8_e4m3", 128) == (
        True, "sm100.decode/f8: self-check passed on gpu0")
    records.store(records.CheckRecord("sm100.prefill/f8", "gpu0", False, "case 0: NaN", 0.1, time.time()))
    ok, text = self_check_state("sm100.prefill", "fp8_e4m3", "fp8_e4m3", 64)
    assert not ok and "FAILED its self-check (case 0: NaN): the reference served its calls" in text
