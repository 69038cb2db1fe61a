"""CLI argument handling: one arch parser for every command, help text with defaults on every
option, and a reader that leaves early (``| head``) ends the command quietly."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cute_kernels.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]

SPELLINGS_OF_SM90 = ["sm_90a", "sm90", "SM_90", "90", "9.0", " sm90a "]


def _env() -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("spelling", SPELLINGS_OF_SM90)
def test_compile_takes_every_arch_spelling_that_plan_takes(spelling, capsys):
    assert main(["plan", "--arch", spelling, "--phase", "decode", "--kv-cache-dtype", "fp8", "--json"]) == 0
    assert '"arch": "sm90"' in capsys.readouterr().out
    # a filter that matches no variant: the arch is parsed (the error names its target), nothing is compiled
    assert main(["compile", "--arch", spelling, "--kernel", "no-such-variant"]) == 2
    assert capsys.readouterr().err.strip() == "error: --kernel 'no-such-variant' matches no variant of sm_90a"


@pytest.mark.parametrize("spelling,target", [("8.0", "sm_80"), ("100", "sm_100a"), ("sm_103a", "sm_103a"),
                                             ("12.1", "sm_121a")])
def test_compile_maps_other_archs_to_their_target(spelling, target, capsys):
    assert main(["compile", "--arch", spelling, "--kernel", "no-such-variant"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"matches no variant of {target}")


@pytest.mark.parametrize("spelling", ["9.5", "sm75", "hopper", "7"])
def test_compile_refuses_what_plan_refuses_with_the_same_message(spelling, capsys):
    assert main(["plan", "--arch", spelling, "--phase", "decode", "--kv-cache-dtype", "fp8"]) == 2
    plan_err = capsys.readouterr().err
    assert main(["compile", "--arch", spelling]) == 2
    compile_err = capsys.readouterr().err
    assert compile_err.startswith("error: --arch=") and "sm80, sm86, sm89, sm90" in compile_err
    assert compile_err.split("=", 1)[1] == plan_err.split("=", 1)[1]


def test_compile_refuses_a_filter_that_matches_nothing(capsys):
    """A typo in --kernel was "0/0 variants compiled" and status 0 (a CI step that checks nothing)."""
    assert main(["compile", "--arch", "sm_90a", "--ci", "--kernel", "sm90.decdoe"]) == 2
    assert capsys.readouterr().err == "error: --kernel 'sm90.decdoe' matches no variant of sm_90a in the CI set\n"


@pytest.mark.parametrize("content,match", [
    (None, "No such file or directory"),  # a traceback (FileNotFoundError) after compiling before
    ("{not json", "not a digest file \\(JSON\\)"),
    ("[1, 2]", "not a digest file \\(a JSON object"),
])
def test_compile_reads_the_digest_file_first_and_says_what_is_wrong_in_one_line(content, match, tmp_path, capsys,
                                                                                monkeypatch):
    import cute_kernels.jit.evidence as evidence

    monkeypatch.setattr(evidence, "compile_with_evidence", lambda *a: pytest.fail("compiled before the file was read"))
    path = tmp_path / "digests.json"
    if content is not None:
        path.write_text(content)
    assert main(["compile", "--arch", "sm_90a", "--kernel", "merge_states", "--check-digests", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --check-digests {path}: ") and err.count("\n") == 1
    assert re.search(match, err)


def test_every_option_has_help_that_states_its_default():
    for name, parser in _subparsers().items():
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest}: no help text"
            if action.option_strings and action.default not in (None, False):
                assert f"(default: {action.default})" in " ".join(text.split()), (name, action.dest)
    assert set(_subparsers()) == set(COMMANDS)


def test_closed_stdout_ends_quietly():
    """``cute-kernels matrix --json | head``: the reader is gone before the first write."""
    proc = subprocess.Popen([sys.executable, "-m", "cute_kernels", "matrix", "--json"], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # no reader left: every write fails with EPIPE
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 1


def test_head_of_matrix_json_has_no_traceback():
    r = subprocess.run(f"'{sys.executable}' -m cute_kernels matrix --json | head -3", shell=True, cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines()[0] == "{" and len(r.stdout.splitlines()) == 3
    assert r.stderr == "", r.stderr
