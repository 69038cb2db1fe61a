"""Bad command-line values: one line naming the flag and the value, exit code 2, no traceback,
decided before the GPU check and before anything compiles (docs/design/inputs.md#the-classes).
A typo used to be mapped to a default (``--kv fp16`` ran BF16), to match nothing (``--shapes B7``
timed every shape, ``--kinds decoding`` nothing), or to fail after the timing (``--json`` into a
missing directory) or inside each row (``--peers ocupancy=3``)."""

from __future__ import annotations

import pytest

import cute_kernels.bench as bench
from cute_kernels.bench import BENCHMARKS, build_parser
from cute_kernels.bench import profile as prof
from cute_kernels.cli import main as cli_main
from cute_kernels.plans.sm90_qsa import MAX_SPLITS


@pytest.fixture
def no_gpu_check(monkeypatch):
    """The GPU check fails the test: every refusal below must come before it."""
    monkeypatch.setattr(bench, "gpu_problem", lambda need: pytest.fail("the GPU was checked before the values"))
    monkeypatch.setattr(prof, "gpu_problem", lambda need: pytest.fail("the GPU was checked before the values"))


def _one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# (benchmark, arguments, the flag the line names, a text it holds: the bad value or the rule)
BENCH_BAD = [
    ("decode", ["--kv", "fp16"], "--kv", "'fp16' is not one of fp8, bf16"),
    ("decode", ["--kv", "fp8,fp8"], "--kv", "'fp8' given twice"),
    ("decode", ["--shapes", "B7"], "--shapes", "'B7' matches no shape"),
    ("decode", ["--shapes", ","], "--shapes", "nothing in ','"),
    ("decode", ["--peers", "xqa,fii"], "--peers", "'fii' is not a peer"),
    ("decode", ["--peers", "ocupancy=3"], "--peers", "'ocupancy' is not a tuning field of sm90.decode"),
    ("decode", ["--peers", "occupancy=three"], "--peers", "occupancy must be an integer, got 'three'"),
    ("decode", ["--peers", "pdl=0"], "--peers", "pdl must be a bool"),
    ("decode", ["--peers", "tile=128+num_splits=0"], "--peers", "num_splits must be a positive int, got 0"),
    ("decode", ["--api", "trtllm", "--shapes", "ragged"], "--shapes", "'ragged' matches no shape"),
    ("decode", ["--api", "trtllm", "--kv", "e4m3"], "--kv", "'e4m3'"),
    ("prefill", ["--peers", "fa5"], "--peers", "'fa5' is not one of"),
    ("prefill", ["--peers", "ours"], "--peers", "'ours' is not one of"),  # ours is always timed
    ("prefill", ["--kv", "bf16,fp8,bf16"], "--kv", "'bf16' given twice"),
    ("prefill", ["--shapes", "S99"], "--shapes", "'S99'"),
    ("prefill", ["--api", "trtllm", "--shapes", "B1 S4096"], "--shapes", "'B1 S4096'"),
    ("qsa", ["--kinds", "decoding"], "--kinds", "'decoding' is not one of decode, prefill"),
    ("qsa", ["--kv", "e4m3"], "--kv", "'e4m3'"),
    ("qsa", ["--decode-n", "4,x"], "--decode-n", "'x' is not an integer"),
    ("qsa", ["--prefill-t", "0"], "--prefill-t", "got 0"),
    ("qsa", ["--splits", "-2"], "--splits", "got -2"),
    ("qsa", ["--splits", f"2,{MAX_SPLITS + 1}"], "--splits", f"at most {MAX_SPLITS}, got {MAX_SPLITS + 1}"),
    ("qsa", ["--tile", "96"], "--tile", "must be one of 64, 128, got 96"),
    ("qsa", ["--tile-rows", "2,x"], "--tile-rows", "'x'"),
    ("qsa", ["--decode-counts", "0"], "--decode-counts", "got 0"),
    ("qsa", ["--selection", "random"], "--selection", "'random' is not one of independent, correlated"),
    ("qsa", ["--tuning", "producers:2"], "--tuning", "'producers:2' is not FIELD=INTEGER"),
    ("layer", ["--tokens", "64,-1"], "--tokens", "got -1"),
    ("layer", ["--variants", "items=2,items=3"], "--variants", "items given twice"),
    ("layer", ["--variants", "pdl"], "--variants", "'pdl' is not FIELD=INTEGER"),
    ("layer", ["--variants", "items=2;items=2"], "--variants", "variant 'items=2' given twice"),
    ("qsa", ["--tuning", "producers=1;stages=2;producers=1"], "--tuning", "variant 'producers=1' given twice"),
    # a QSA tuning field checked by the op's own check: a typo failed each row after its timing
    ("qsa", ["--tuning", "producers=2;prodcers=4"], "--tuning", "'prodcers' is not a tuning field of sm90.qsa / sm90.qsa_tile"),
    ("qsa", ["--tuning", "head_dim=128"], "--tuning", "'head_dim' is not a tuning field of sm90.qsa"),
    ("qsa", ["--tuning", "evict_first=2"], "--tuning", "evict_first must be a bool, got 2"),
    ("sm80", ["--variants", "noxor:tw=32"], "--variants", "'noxor' is a built-in variant"),
    ("sm80", ["prefill", "--variants", "m2t64:tw=32"], "--variants", "'m2t64' is a built-in variant"),
    ("layer", ["--variants", "items=2;itemz=2"], "--variants", "'itemz' is not a tuning field of common.quantize_query"),
    ("layer", ["--variants", "vec=8"], "--variants", "'vec' is not a tuning field of common.write_kv_cache"),
    ("sm80", ["--kv", "fp16"], "--kv", "'fp16'"),
    ("sm80", ["prefill", "--shapes", "ctx32000"], "--shapes", "'ctx32000'"),  # a decode shape's name
    ("sm80", ["--variants", "a:tw=32;a:tw=64"], "--variants", "'a' given twice"),
    ("sm80", ["--variants", ":tw=32"], "--variants", "a name is missing"),
    ("sm80", ["--variants", "a:tw"], "--variants", "'tw' is not FIELD=VALUE"),
    ("sm80", ["--variants", "a:twe=32"], "--variants", "'twe' is not a tuning field of sm80.decode"),
    ("sm80", ["prefill", "--variants", "a:tw=x"], "--variants", "tw must be an int, got 'x'"),
    ("serve", ["--workloads", "long"], "--workloads", "'long' is not one of long-fp8"),
    ("serve", ["--configs", "ours,fi"], "--configs", "'fi' is not one of"),
    ("serve", ["--configs", ""], "--configs", "nothing in ''"),
    ("serve", ["--layers", "0"], "--layers", "got 0"),
    ("serve", ["--concurrency", "-1"], "--concurrency", "got -1"),
    ("serve", ["--decode-stride", "0"], "--decode-stride", "got 0"),
    ("serve", ["--graph-reps", "0"], "--graph-reps", "got 0"),
    ("serve", ["--eager-reps", "0"], "--eager-reps", "got 0"),
    ("serve", ["--output-len", "100000"], "--workloads long-fp8 with --output-len 100000", "past the block table"),
    ("merge", ["--json", ""], "--json", "empty path"),
    # a flag the chosen mode does not read: it was ignored without a word
    ("decode", ["--api", "trtllm", "--peers", "xqa"], "--peers", "not taken with --api trtllm"),
    ("decode", ["--api", "trtllm", "--png", "x.png"], "--png", "not taken with --api trtllm"),
    ("decode", ["--api", "trtllm", "--no-balanced"], "--no-balanced", "not taken with --api trtllm"),
    ("prefill", ["--api", "trtllm", "--peers", ""], "--peers", "not taken with --api trtllm"),
    ("sm80", ["prefill", "--kv", "fp8"], "--kv", "not taken by sm80 prefill"),
    ("qsa", ["--kinds", "prefill", "--decode-counts", "64"], "--decode-counts", "not taken without the decode kind"),
    ("qsa", ["--kinds", "prefill", "--decode-shared"], "--decode-shared", "not taken without the decode kind"),
    ("qsa", ["--kinds", "decode", "--tile-rows", "4"], "--tile-rows", "not taken without the prefill kind"),
    ("qsa", ["--kinds", "decode", "--selection", "independent"], "--selection", "not taken without the prefill kind"),
    ("serve", ["--configs", "ours,fa4", "--fi-prefill-query", "bf16"], "--fi-prefill-query",
     "not taken without a FlashInfer configuration"),
    ("serve", ["--workloads", "short-bf16", "--fi-prefill-query", "bf16"], "--fi-prefill-query",
     "not taken without an FP8-cache workload"),
    ("latency", ["--eager-study", "--quick"], "--quick", "not taken with --eager-study"),
    ("decode", ["--png", "/no/such/dir/x.png"], "--png", "directory '/no/such/dir' does not exist"),
]


@pytest.mark.parametrize("what,argv,flag,text", BENCH_BAD, ids=[f"{w}{' '.join(a)}" for w, a, _, _ in BENCH_BAD])
def test_bench_refuses_a_bad_value_in_one_line_before_the_gpu_check(what, argv, flag, text, no_gpu_check, capsys):
    assert cli_main(["bench", what, *argv]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"error: cute-kernels bench {what} {flag}"), line
    assert text in line, line


OUTPUT_FLAGS = [(what, flag) for what in sorted(BENCHMARKS) for flag in ("--json", "--png")
                if flag in build_parser(what)[0].format_help()]


@pytest.mark.parametrize("what,flag", OUTPUT_FLAGS)
def test_bench_refuses_an_output_path_it_could_not_write(what, flag, tmp_path, no_gpu_check, capsys):
    assert cli_main(["bench", what, flag, str(tmp_path)]) == 2  # a directory: the run ended in a traceback
    assert _one_line(capsys) == f"error: cute-kernels bench {what} {flag}: {str(tmp_path)!r} is a directory"


# the command lines of the GPU suite and of profiling/run.sh: every value they pass is taken
GOOD = [
    ("decode", []), ("decode", ["--shapes", "B1 ctx", "--kv", "fp8", "--peers", "sdpa,global"]),
    ("decode", ["--shapes", "ragged,70b", "--kv", "fp8,bf16", "--peers", "xqa,fi,fa4"]),
    ("decode", ["--peers", "", "--shapes", "ctx"]), ("decode", ["--peers", "occupancy=3+tile=128+num_splits=4,occ3"]),
    ("decode", ["--api", "trtllm", "--shapes", "win4096"]), ("prefill", []), ("prefill", ["--peers", "fa4,fi"]),
    ("prefill", ["--peers", ""]), ("sm80", ["--kv", "fp8"]), ("sm80", ["prefill"]),
    ("prefill", ["--kv", "fp8", "--peers", "ours_fp8q,ours_fp8x2,fi"]), ("prefill", ["--api", "trtllm"]),
    ("qsa", ["--tuning", "splits=2,evict_first=0;consumers=2,tile_rows=5,widen=1", "--selection", "independent"]),
    ("serve", ["--configs", "ours,fi_xqa", "--fi-prefill-query", "bf16"]),
    ("qsa", []), ("qsa", ["--kinds", "decode", "--decode-n", "4,16", "--tuning", ";producers=1", "--tile", "128",
                          "--splits", "1,2,4", "--decode-counts", "64,2051"]),
    ("layer", []), ("layer", ["--tokens", "64", "--variants", "items=1;items=2,pdl=0"]), ("merge", []),
    ("latency", []), ("latency", ["--eager-study"]), ("qsa", ["--kinds", "prefill", "--tile-rows", "1,5"]),
    ("qsa", ["--kinds", "decode", "--decode-shared", "--decode-counts", "64"]), ("sm80", []), ("sm80", ["prefill", "--variants", "x:tw=32+smem_target=sm_80", "--shapes", "B1"]),
    ("sm80", ["--variants", "y:ldsm_xor=false"]),
    ("serve", []), ("serve", ["--quick", "--workloads", "long-fp8,short-bf16", "--layers", "2", "--output-len", "8"]),
]


@pytest.mark.parametrize("what,argv", GOOD, ids=[f"{w}{' '.join(a)}" for w, a in GOOD])
def test_bench_takes_good_values(what, argv, tmp_path):
    parser, module = build_parser(what)
    bench.check_arguments(module, parser.parse_args([*argv, "--json", str(tmp_path / "out.json")]))


@pytest.mark.parametrize("what,shape,text", [
    ("decode", "B=0", "B must be >= 1, got 0"),
    ("decode", "ctx=-5", "ctx must be >= 1, got -5"),
    ("decode", "Hq=33", "Hq (33) must be a multiple of Hkv (4)"),
    ("prefill", "prefix=-1", "prefix must be >= 0, got -1"),
    ("qsa", "gate=2", "gate must be one of 0, 1, got 2"),
    ("qsa", "selection=random", "selection must be one of independent, correlated, got 'random'"),
    ("merge", "S=0", "S must be >= 1, got 0"),
    ("merge", "S=4,N=8,S=2", "S given twice"),
])
def test_profile_refuses_a_bad_shape_before_the_gpu_check(what, shape, text, no_gpu_check, capsys):
    assert cli_main(["profile", what, "--shape", shape]) == 2
    assert _one_line(capsys) == f"error: cute-kernels profile {what} --shape: {text}"


@pytest.mark.parametrize("what,shape,text", [
    ("decode", "D=100", "need head_dim 64/128/256 (got 100)"),
    ("decode", "q_len=32", "need GQA ratio x q_len up to 64 (got 8 x 32)"),
    ("prefill", "page=7", "need page_size 16/32/64/128 (got 7)"),
    ("layer", "Hq=128,Hkv=1", "need GQA ratio x q_len up to 64 (got 128 x 1)"),
])
def test_profile_refuses_a_shape_no_kernel_takes_before_ncu_starts(what, shape, text, no_gpu_check, capsys):
    """The op refused it inside the profiled process, after ncu had started and the warm-up had run."""
    assert cli_main(["profile", what, "--shape", shape]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"error: cute-kernels profile {what} --shape: ") and text in line, line


@pytest.mark.parametrize("what,shape", [(w, "") for w in sorted(prof.NEEDS)] + [
    ("decode", "q_len=4,D=64"), ("prefill", "kv=fp8,q=fp8x2,D=256,Hq=16"), ("layer", "kv=bf16,page=64")])
def test_profile_plans_the_default_and_good_shapes(what, shape):
    from cute_kernels.bench import ncu

    prof.check_planned(what, ncu.parse_shape(what, shape))


def test_profile_refuses_unbalanced_quotes_in_ncu_args(no_gpu_check, capsys):
    """``--ncu-args`` was split on blanks: a quote reached ncu as part of an argument."""
    assert prof.ncu_arguments("--set full --nvtx-exclude 'a b'") == ["--set", "full", "--nvtx-exclude", "a b"]
    assert cli_main(["profile", "merge", "--ncu-args", "--set 'full"]) == 2
    assert _one_line(capsys) == "error: cute-kernels profile merge --ncu-args: No closing quotation in \"--set 'full\""


def test_profile_refuses_ncu_args_it_sets_itself(no_gpu_check, capsys):
    """``--ncu-args '--export x'`` reached ncu next to the command's own ``--export``."""
    assert cli_main(["profile", "prefill", "--ncu-args", "--export x"]) == 2
    assert _one_line(capsys) == ("error: cute-kernels profile prefill --ncu-args: --export is set by "
                                 "cute-kernels profile (use --out)")


@pytest.mark.parametrize("stem,text", [("", "empty path"), ("/no/such/dir/m", "does not exist"),
                                       (None, "is a directory")])
def test_profile_refuses_an_out_stem_it_could_not_write(stem, text, tmp_path, no_gpu_check, capsys):
    stem = str(tmp_path) if stem is None else stem
    assert cli_main(["profile", "merge", "--out", stem]) == 2
    line = _one_line(capsys)
    assert line.startswith("error: cute-kernels profile merge --out: ") and text in line, line


def test_profile_takes_a_cached_prefix_of_zero_and_an_ungated_call():
    from cute_kernels.bench import ncu

    assert ncu.parse_shape("prefill", "prefix=0")["prefix"] == 0
    assert ncu.parse_shape("qsa", "gate=0")["gate"] == 0


@pytest.fixture
def no_compile(monkeypatch):
    import cute_kernels.jit.evidence as evidence

    monkeypatch.setattr(evidence, "compile_with_evidence", lambda *a: pytest.fail("compiled before the check"))


@pytest.mark.parametrize("kernel", ["", "  "])
def test_compile_refuses_an_empty_kernel_filter(kernel, no_compile, capsys):
    """``--kernel ""`` is in every label: it compiled every variant of the arch."""
    assert cli_main(["compile", "--arch", "sm_90a", "--kernel", kernel]) == 2
    assert _one_line(capsys) == f"error: --kernel {kernel!r}: empty text (leave --kernel out for every variant)"


@pytest.mark.parametrize("where,text", [("missing", "does not exist"), ("dir", "is a directory")])
def test_compile_checks_the_digest_file_it_writes_before_compiling(where, text, tmp_path, no_compile, capsys):
    """The write failed with a traceback after every variant had compiled."""
    path = tmp_path / "no" / "d.json" if where == "missing" else tmp_path
    assert cli_main(["compile", "--arch", "sm_90a", "--kernel", "merge_states", "--digests", str(path)]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"error: --digests: {str(path)!r}") and text in line, line


def test_write_kv_cache_names_a_field_its_override_does_not_take():
    """A field the call decides (``vec``) or a typo was a TypeError from the config's constructor."""
    import torch

    from cute_kernels.ops import write_kv_cache as kv_op

    g = torch.Generator().manual_seed(0)
    key = torch.randn(4, 2, 64, generator=g).to(torch.bfloat16)
    cache = torch.zeros(2, 2, 2, 16, 64, dtype=torch.bfloat16)
    slots = torch.arange(4)
    with kv_op.tuning_override(items=2):
        assert kv_op.make_config(key, key, cache, slots, "HND", False, False).items == 2
    for fields, error, match in [(dict(vec=8), ValueError, "'vec' is not a tuning field of common.write_kv_cache "
                                                           "\\(the call's arguments decide it\\); its fields: items, pdl"),
                                 (dict(itemz=2), ValueError, "'itemz' is not a tuning field"),
                                 (dict(pdl=1), TypeError, "pdl must be a bool, got 1")]:
        with kv_op.tuning_override(**fields), pytest.raises(error, match=match):
            kv_op.make_config(key, key, cache, slots, "HND", False, False)


_PLAN = ["plan", "--arch", "sm90", "--phase", "decode", "--kv-cache-dtype", "fp8"]


@pytest.mark.parametrize("argv,line", [
    (_PLAN + ["--head-dim", "0"], "--head-dim must be a positive int (>= 1), got 0"),
    (_PLAN + ["--q-len", "-1"], "--q-len must be a positive int (>= 1), got -1"),
    (_PLAN + ["--num-q-heads", "33"], "--num-q-heads (33) must be a multiple of --num-kv-heads (8)"),
    (_PLAN + ["--kv-layout", "XYZ"], "--kv-layout must be 'HND' or 'NHD', got 'XYZ'"),
    (_PLAN + ["--model-dtype", "fp32"], "--model-dtype='fp32' is not supported"),
    (_PLAN + ["--query-dtype", "fp4"], "--query-dtype='fp4' is not supported"),
    (["plan", "--arch", "sm80", "--phase", "decode", "--kv-cache-dtype", "bf16", "--query-dtype", "fp8"],
     "--query-dtype='fp8' needs an FP8 KV cache (QK runs in FP8 only against FP8 K), got --kv-cache-dtype bf16"),
    (["plan", "--arch", "sm90", "--phase", "decoding", "--kv-cache-dtype", "fp8"], "--phase must be 'prefill' or"),
    (["plan", "--arch", "sm90", "--phase", "decode", "--kv-cache-dtype", "fp9"], "--kv-cache-dtype='fp9' is not"),
    (["matrix", "--page-size", "0"], "--page-size must be a positive int (>= 1), got 0"),
    (["matrix", "--num-kv-heads", "3"], "--num-q-heads (32) must be a multiple of --num-kv-heads (3)"),
])
def test_plan_and_matrix_errors_name_the_flag(argv, line, capsys):
    """The planner's limits and wording, with the command line's names (it said ``head_dim must``)."""
    assert cli_main(argv) == 2
    assert _one_line(capsys).startswith(f"error: {line}")
