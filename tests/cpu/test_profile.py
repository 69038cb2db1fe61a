"""``cute-kernels profile``: the exact ncu command lines, the parsing of ncu's raw CSV page (a
fixture written in the format ``ncu --import R --csv --page raw --print-units base`` prints: a
header row, a units row, one row per profiled kernel), the report made from it, and the one-line
refusals on a machine without a GPU or without ncu."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cute_kernels.bench import ncu
from cute_kernels.bench import profile as prof
from cute_kernels.cli import main as cli_main

FIXTURE = Path(__file__).parent / "data" / "ncu_raw_qsa.csv"
COPY_BYTES = 268_435_456 + 268_509_184
COPY_SECONDS = 131_072e-9


def test_ncu_command_is_exact():
    cmd = ncu.ncu_command("decode", "B=8,ctx=4096", "out/p", ncu="/opt/ncu", python="/venv/bin/python")
    assert cmd == [
        "/opt/ncu", "--nvtx", "--nvtx-include", "cute_kernels.paged_decode/", "--profile-from-start", "off",
        "--target-processes", "all",
        "--section", "SpeedOfLight", "--section", "LaunchStats", "--section", "Occupancy",
        "--section", "WarpStateStats", "--section", "MemoryWorkloadAnalysis",
        "--metrics", "gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,"
                     "sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,"
                     "sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,"
                     "launch__shared_mem_per_block_static,launch__shared_mem_per_block_dynamic,"
                     "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,"
                     "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,"
                     "sm__issue_active.avg.pct_of_peak_sustained_elapsed,"
                     "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_elapsed,"
                     "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed,"
                     "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed,"
                     "sm__warps_active.avg.per_cycle_active",
        "--export", "out/p", "--force-overwrite",
        "/venv/bin/python", "-m", "cute_kernels.bench.profile", "target", "decode", "--shape", "B=8,ctx=4096",
    ]
    assert ncu.import_command("out/p.ncu-rep", ncu="/opt/ncu") == [
        "/opt/ncu", "--import", "out/p.ncu-rep", "--csv", "--page", "raw", "--print-units", "base"]


@pytest.mark.parametrize("what,range_name", [
    ("decode", "cute_kernels.paged_decode/"), ("prefill", "cute_kernels.paged_prefill/"),
    ("qsa", "cute_kernels.qsa_sparse_attention/"), ("merge", "cute_kernels.merge_states/"),
    ("layer", "cute_kernels.layer/"),
])
def test_each_op_is_selected_by_its_range(what, range_name):
    cmd = ncu.ncu_command(what, "", "p", extra=["--set", "full"])
    assert cmd[cmd.index("--nvtx-include") + 1] == range_name
    assert cmd.count("--nvtx-include") == 1
    assert cmd[cmd.index("--force-overwrite") + 1:][:2] == ["--set", "full"]


@pytest.mark.parametrize("extra", [
    ["--metrics", "smsp__inst_executed.sum,sm__issue_active.avg.pct_of_peak_sustained_elapsed", "--set", "full"],
    ["--set", "full", "--metrics=smsp__inst_executed.sum", "--metrics", "smsp__inst_executed.sum"],
])
def test_metrics_in_ncu_args_join_the_one_metrics_list(extra):
    """ncu refuses a second ``--metrics`` ("cannot be specified more than once"): the caller's
    names join the report's list, once each; the other arguments pass through in order."""
    cmd = ncu.ncu_command("prefill", "", "p", extra=extra)
    assert cmd.count("--metrics") == 1
    metrics = cmd[cmd.index("--metrics") + 1].split(",")
    assert metrics[:len(ncu.METRICS)] == list(ncu.METRICS)
    assert metrics[len(ncu.METRICS):] == ["smsp__inst_executed.sum"]
    assert cmd[cmd.index("--force-overwrite") + 1:][:2] == ["--set", "full"]


@pytest.mark.parametrize("extra,text", [
    (["--export", "x"], "--export is set by cute-kernels profile (use --out)"),
    (["-o", "x"], "-o is set by cute-kernels profile (use --out)"),
    (["--nvtx-include=foo/"], "--nvtx-include is set by cute-kernels profile"),
    (["--profile-from-start", "on"], "--profile-from-start is set by cute-kernels profile"),
    (["--metrics"], "--metrics needs a comma-separated list"),
    (["--metrics=,"], "--metrics needs a comma-separated list"),
])
def test_ncu_args_the_command_sets_itself_are_refused(extra, text):
    with pytest.raises(ValueError, match="^--ncu-args: " + text.replace("(", r"\(").replace(")", r"\)")):
        ncu.ncu_command("decode", "", "p", extra=extra)


def test_the_pipe_table_reads_the_pipe_metrics():
    """A kernel far from the DRAM roofline: the report names its pipes' busy time."""
    header = ["ID", "Kernel Name", ncu.DURATION, ncu.DRAM_READ, ncu.DRAM_WRITE, ncu.TENSOR_PCT, ncu.ISSUE_PCT,
              ncu.XU_PCT, ncu.ALU_PCT, ncu.FMA_PCT, ncu.WARPS]
    text = ",".join(f'"{h}"' for h in header) + "\n"
    text += '"0","copy","1000","1,000,000","1,000,000","0","5","0","1","1","40"\n'
    text += '"1","prefill","2000","10","10","34.43","51.25","35.53","30.1","23.28","11.87"\n'
    report = ncu.build_report(ncu.parse_raw_csv(text), what="prefill", shape={})
    (k,) = report["kernels"]
    assert (k["tensor_pipe_pct"], k["issue_active_pct"], k["xu_pipe_pct"]) == (34.43, 51.25, 35.53)
    assert (k["alu_pipe_pct"], k["fma_pipe_pct"], k["warps_per_sm"]) == (30.1, 23.28, 11.87)
    md = ncu.render_markdown(report)
    assert "| kernel | tensor pipe % | issue active % | XU (exp2) % | ALU % | FMA % | warps / SM |" in md
    assert "| `prefill` | 34.4 | 51.2 | 35.5 | 30.1 | 23.3 | 11.9 |" in md


def test_parse_raw_csv_fixture():
    rows = ncu.parse_raw_csv(FIXTURE.read_text())
    assert [r["ID"] for r in rows] == ["0", "1", "2"]
    copy, split, merge = rows
    assert "direct_copy_kernel_cuda" in copy["Kernel Name"]
    assert split["Kernel Name"] == "cute_kernels_sm90_qsa_split_gate_0"
    assert split["Grid Size"] == "(132, 2, 4)" and split["Block Size"] == "(256, 1, 1)"
    # thousands separators go, base units are applied (nanoseconds -> seconds), n/a is None
    assert split[ncu.DRAM_READ] == 98_566_144.0
    assert split[ncu.DURATION] == pytest.approx(29_184.5e-9)
    assert split[ncu.SMEM_DYNAMIC] == 196_608.0 and split[ncu.REGISTERS] == 168.0
    assert split["smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio"] is None
    assert copy[ncu.DURATION] == pytest.approx(COPY_SECONDS)


def test_units_other_than_base_are_scaled():
    text = ('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__throughput.avg.pct"\n'
            '"","","usecond","Mbyte","%"\n'
            '"0","k","1.5","2,000","93.1"\n')
    (row,) = ncu.parse_raw_csv(text)
    assert row[ncu.DURATION] == pytest.approx(1.5e-6)
    assert row[ncu.DRAM_READ] == pytest.approx(2e9)
    assert row["dram__throughput.avg.pct"] == pytest.approx(93.1)


@pytest.mark.parametrize("units_row", [
    None,  # no units row: base units
    '"-","","ns","B","%"',  # short spellings, a units row whose ID cell is not empty
    '"","","nsecond","byte","%"',
])
def test_durations_are_seconds_whatever_the_units_row(units_row):
    """A merge of 13.28 us must not read as 13,280 s (a units row missed or spelled short)."""
    text = '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__throughput.avg.pct"\n'
    if units_row is not None:
        text += units_row + "\n"
    text += '"0","k","13,280","33,554,432","68.3"\n'
    (row,) = ncu.parse_raw_csv(text)
    assert row["ID"] == "0"
    assert row[ncu.DURATION] == pytest.approx(13_280e-9)
    assert row[ncu.DRAM_READ] == pytest.approx(33_554_432)
    assert row["dram__throughput.avg.pct"] == pytest.approx(68.3)


def test_not_a_raw_page_is_refused():
    with pytest.raises(ValueError, match="no header row"):
        ncu.parse_raw_csv("==ERROR== the application returned an error\n")


def test_report_from_the_fixture():
    rows = ncu.parse_raw_csv(FIXTURE.read_text())
    report = ncu.build_report(rows, what="qsa", shape=ncu.SHAPES["qsa"], device="NVIDIA H200",
                              ncu_report="p.ncu-rep")
    roof_bw = COPY_BYTES / COPY_SECONDS
    assert report["roofline"]["dram_gbps"] == pytest.approx(roof_bw / 1e9)
    split, merge = report["kernels"]
    assert split["name"] == "cute_kernels_sm90_qsa_split_gate_0"
    split_bytes = 98_566_144 + 1_310_720
    assert split["duration_us"] == pytest.approx(29.1845)
    assert split["dram_bytes"] == split_bytes
    assert split["roofline_pct"] == pytest.approx(100 * split_bytes / 29_184.5e-9 / roof_bw)
    assert split["dram_throughput_pct"] == 78.3 and split["sm_throughput_pct"] == 34.5
    assert split["achieved_occupancy_pct"] == 24.9 and split["registers_per_thread"] == 168
    assert split["smem_per_cta_bytes"] == 196_608 + 1_024
    assert split["local_memory_bytes"] == 0
    # the three largest stall reasons, "selected" (the issuing warp) and n/a left out
    assert split["top_stalls"] == [dict(reason="long_scoreboard", cycles_per_instruction=11.36),
                                   dict(reason="barrier", cycles_per_instruction=2.05),
                                   dict(reason="wait", cycles_per_instruction=0.93)]
    assert [s["reason"] for s in merge["top_stalls"]] == ["long_scoreboard", "wait", "lg_throttle"]
    total_s = (29_184.5 + 3_712) * 1e-9
    total_bytes = split_bytes + 1_703_936 + 393_216
    assert report["total"]["duration_us"] == pytest.approx(total_s * 1e6)
    assert report["total"]["roofline_pct"] == pytest.approx(100 * total_bytes / total_s / roof_bw)
    json.dumps(report)  # the JSON file holds it as is
    md = ncu.render_markdown(report)
    assert md.startswith("# cute-kernels profile qsa (`cute_kernels.qsa_sparse_attention`)")
    assert "| `cute_kernels_sm90_qsa_split_gate_0` | 29.18 |" in md
    assert "long_scoreboard 11.36, barrier 2.05, wait 0.93" in md
    assert "| **total** |" in md and "NVIDIA H200" in md and "`p.ncu-rep`" in md
    # a profile taken without the pipe metrics (an older report): the pipe table says "–"
    assert split["tensor_pipe_pct"] is None
    assert "| `cute_kernels_sm90_qsa_split_gate_0` | – | – | – | – | – | – |" in md


def test_a_profile_without_the_op_kernels_says_why():
    rows = ncu.parse_raw_csv(FIXTURE.read_text())[:1]
    with pytest.raises(ValueError, match=r"1 kernel\(s\).*cute_kernels.merge_states"):
        ncu.build_report(rows, what="merge", shape={})


def test_parse_shape():
    assert ncu.parse_shape("decode", "B=2,kv=bf16") == {**ncu.SHAPES["decode"], "B": 2, "kv": "bf16"}
    assert ncu.parse_shape("merge", None) == ncu.SHAPES["merge"]
    assert ncu.shape_text(ncu.parse_shape("merge", "S=4")) == "S=4,N=64,H=32,D=128"
    with pytest.raises(ValueError, match="KEY one of S, N, H, D"):
        ncu.parse_shape("merge", "X=1")
    with pytest.raises(ValueError, match="N must be an integer"):
        ncu.parse_shape("merge", "N=lots")
    assert set(ncu.SHAPES) == set(ncu.OPS) == set(prof.NEEDS) == set(prof.BUILDERS)


def test_parse_shape_text_keys_take_their_choices():
    assert ncu.parse_shape("prefill", "kv=fp8,q=fp8x2")["q"] == "fp8x2"
    with pytest.raises(ValueError, match="kv must be one of bf16, fp8, got 'fp16'"):
        ncu.parse_shape("decode", "kv=fp16")
    with pytest.raises(ValueError, match="q must be one of bf16, fp8, fp8x2"):
        ncu.parse_shape("prefill", "kv=fp8,q=e5m2")
    with pytest.raises(ValueError, match="q=fp8 .* needs kv=fp8"):
        ncu.parse_shape("prefill", "q=fp8")
    with pytest.raises(ValueError, match="kind must be one of decode, prefill"):
        ncu.parse_shape("qsa", "kind=both")


def _one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("what", sorted(ncu.OPS))
def test_no_gpu_is_one_line_and_exit_code_2(what, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["profile", what]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"error: cute-kernels profile {what} needs ") and "no CUDA GPU" in line


def test_missing_ncu_is_one_line_and_exit_code_2(capsys, monkeypatch):
    monkeypatch.setattr(prof, "gpu_problem", lambda need: None)
    monkeypatch.setattr(prof.shutil, "which", lambda name: None)
    assert cli_main(["profile", "merge", "--ncu", "/nowhere/ncu"]) == 2
    line = _one_line(capsys)
    assert line == ("error: cute-kernels profile merge needs Nsight Compute: '/nowhere/ncu' is not on PATH "
                    "(install it, or pass --ncu PATH)")


def test_bad_shape_is_one_line_and_exit_code_2(capsys):
    assert cli_main(["profile", "decode", "--shape", "B=8,batch=2"]) == 2
    assert "'batch=2' is not KEY=VALUE" in _one_line(capsys)


def test_prefill_without_its_op_is_refused(capsys, monkeypatch):
    from cute_kernels import registry

    monkeypatch.setattr(prof, "gpu_problem", lambda need: None)
    monkeypatch.delitem(registry.OPS, "paged_prefill", raising=False)
    assert cli_main(["profile", "prefill"]) == 2
    assert "needs the paged_prefill op" in _one_line(capsys)


def test_profile_runs_ncu_then_writes_the_report(tmp_path, monkeypatch, capsys):
    """The whole command with ncu replaced: the profile command line, then the import, then the
    four files next to the report."""
    import torch

    monkeypatch.setattr(prof, "gpu_problem", lambda need: None)
    monkeypatch.setattr(prof.shutil, "which", lambda name: "/opt/nsight/ncu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    calls = []

    def run(cmd, **kw):
        calls.append((cmd, kw))
        if "--import" in cmd:
            return subprocess.CompletedProcess(cmd, 0, stdout=FIXTURE.read_text(), stderr="")
        Path(f"{stem}.ncu-rep").write_bytes(b"report")
        return subprocess.CompletedProcess(cmd, 0)

    stem = str(tmp_path / "qsa")
    assert prof.main("qsa", ["--shape", "n=16", "--out", stem, "--ncu-args", "--set full"], run=run) == 0
    (profile_cmd, _), (import_cmd, import_kw) = calls
    shape = ncu.shape_text({**ncu.SHAPES["qsa"], "n": 16})
    assert profile_cmd == ncu.ncu_command("qsa", shape, stem, ncu="/opt/nsight/ncu", python=prof.sys.executable,
                                          extra=["--set", "full"])
    assert import_cmd == ncu.import_command(f"{stem}.ncu-rep", ncu="/opt/nsight/ncu")
    assert import_kw == dict(capture_output=True, text=True)
    report = json.loads(Path(f"{stem}.json").read_text())
    assert report["shape"]["n"] == 16 and report["device"] == "NVIDIA H200"
    assert [k["name"] for k in report["kernels"]] == ["cute_kernels_sm90_qsa_split_gate_0",
                                                      "cute_kernels_sm90_qsa_merge_gate_0"]
    assert Path(f"{stem}.csv").read_text() == FIXTURE.read_text()
    assert Path(f"{stem}.md").read_text() in capsys.readouterr().out


def test_a_failing_ncu_returns_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prof, "gpu_problem", lambda need: None)
    monkeypatch.setattr(prof.shutil, "which", lambda name: "/opt/ncu")
    assert prof.main("merge", ["--out", str(tmp_path / "m")],
                     run=lambda cmd, **kw: subprocess.CompletedProcess(cmd, 9)) == 1
    assert "ncu failed" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


# --tuning: the op's tuning_override for the profiled call (decode and prefill)


def test_tuning_reaches_the_profiled_process():
    cmd = ncu.ncu_command("prefill", "B=1", "p", tuning="backend=sm80,lean_softmax=true")
    assert cmd[-6:] == ["target", "prefill", "--shape", "B=1", "--tuning", "backend=sm80,lean_softmax=true"]
    assert "--tuning" not in ncu.ncu_command("prefill", "B=1", "p")


@pytest.mark.parametrize("what,shape,text,want", [
    ("prefill", "", "lean_softmax=false", {"lean_softmax": False}),
    ("prefill", "", " backend = sm80 , tw=64, lean_softmax=TRUE ", {"backend": "sm80", "tw": 64, "lean_softmax": True}),
    ("prefill", "kv=fp8,q=fp8", "vt_transpose=words,lean_softmax=false", {"vt_transpose": "words", "lean_softmax": False}),
    ("prefill", "", "backend=sm80,smem_target=sm_86", {"backend": "sm80", "smem_target": "sm_86"}),
    ("decode", "", "backend=sm80,lean_softmax=true", {"backend": "sm80", "lean_softmax": True}),
    ("decode", "", "", {}),
])
def test_tuning_fields_are_read_and_checked(what, shape, text, want):
    assert prof.tuning_fields(what, text, ncu.parse_shape(what, shape)) == want


@pytest.mark.parametrize("what,shape,text,match", [
    ("prefill", "", "tile=64", "'tile' is not a tuning field of sm90.prefill"),
    ("prefill", "", "lean_softmax=2", "lean_softmax must be a bool, got 2"),
    ("prefill", "", "backend=sm70", "backend must be one of"),
    ("prefill", "", "backend=sm80,q_dtype=fp16", "'q_dtype' is not a tuning field of sm80.prefill"),
    ("prefill", "kv=fp8,q=fp8", "backend=sm80", "takes no FP8 query"),
    ("prefill", "", "stages=3,stages=2", "stages given twice"),
    ("prefill", "", "lean_softmax", "is not FIELD=VALUE"),
    ("decode", "", "tile=3x", "tile must be an int"),
])
def test_bad_tuning_is_named(what, shape, text, match):
    with pytest.raises(ValueError, match=match) as e:
        prof.tuning_fields(what, text, ncu.parse_shape(what, shape))
    assert str(e.value).startswith("--tuning: ")


def test_bad_tuning_is_one_line_and_exit_code_2_before_the_gpu_check(capsys, monkeypatch):
    monkeypatch.setattr(prof, "gpu_problem", lambda need: pytest.fail("the values come before the GPU check"))
    assert cli_main(["profile", "prefill", "--tuning", "tile_n=big"]) == 2
    assert "--tuning: sm90.prefill's tile_n must be an int" in _one_line(capsys)


def test_a_forced_portable_backend_needs_sm80_not_sm90(monkeypatch):
    """``backend=sm80`` runs on any SM80-class GPU: the GPU check asks for that, not for SM90."""
    needs = []
    monkeypatch.setattr(prof, "gpu_problem", lambda need: needs.append(need) or "no GPU here")
    assert cli_main(["profile", "prefill", "--tuning", "backend=sm80"]) == 2
    assert cli_main(["profile", "prefill"]) == 2
    assert needs == [prof.SM80_PLUS, prof.NEEDS["prefill"]]


def test_the_report_names_the_tuning(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(prof, "gpu_problem", lambda need: None)
    monkeypatch.setattr(prof.shutil, "which", lambda name: "/opt/ncu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    cmds = []

    def run(cmd, **kw):
        cmds.append(cmd)
        if "--import" in cmd:
            return subprocess.CompletedProcess(cmd, 0, stdout=FIXTURE.read_text(), stderr="")
        return subprocess.CompletedProcess(cmd, 0)

    stem = str(tmp_path / "p")
    assert prof.main("prefill", ["--out", stem, "--tuning", "backend=sm80,lean_softmax=true"], run=run) == 0
    assert cmds[0][-2:] == ["--tuning", "backend=sm80,lean_softmax=true"]
    report = json.loads(Path(f"{stem}.json").read_text())
    assert report["tuning"] == {"backend": "sm80", "lean_softmax": True}
    assert "tuning_override: backend=sm80, lean_softmax=True  " in Path(f"{stem}.md").read_text()
    plain = ncu.build_report(ncu.parse_raw_csv(FIXTURE.read_text()), what="qsa", shape={})
    assert plain["tuning"] == {} and "tuning_override" not in ncu.render_markdown(plain)


def test_the_target_runs_every_call_under_the_override(monkeypatch):
    """The warm-up and the profiled call both run inside the op's tuning_override."""
    from cute_kernels.ops import paged_prefill

    seen = []
    monkeypatch.setattr(prof, "_profiled", lambda what, shape: seen.append(dict(paged_prefill._launcher.override)))
    prof.target("prefill", ncu.SHAPES["prefill"], {"lean_softmax": False})
    prof.target("prefill", ncu.SHAPES["prefill"])
    assert seen == [{"lean_softmax": False}, {}]
