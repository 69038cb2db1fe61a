"""Reading racecheck's reports (profiling/sanitizer_reports.py): both report forms, and the QSA
union pre-pass's write-write hazards (benign, docs/design/qsa.md#racecheck-of-the-union-pre-pass)
told apart from every other hazard; the count a tool's summary line reports."""

from __future__ import annotations

from profiling.sanitizer_reports import benign_union_races, hazards, reported_errors


def _hazard(kind="WAW", space="__shared__", a="Write", b="Write", fa="cute_kernels_sm90_qsa_union_0",
            fb="cute_kernels_sm90_qsa_union_0") -> str:
    return (f"========= Error: Potential {kind} hazard detected at {space} 0x69a0 in block (4,0,0) :\n"
            f"=========     {a} Thread (29,0,0) at {fa}+0x23d0\n"
            f"=========     {b} Thread (220,0,0) at {fb}+0x3c90\n"
            "=========     Current Value : 5, Incoming Value : 255\n"
            "=========     Saved host backtrace up to driver entry point at kernel launch time\n"
            "=========         Host Frame: qsa_sparse_attention in qsa_sparse_attention.py:365\n"
            "========= \n")


HEAD = "========= COMPUTE-SANITIZER\n"
TAIL = "========= RACECHECK SUMMARY: 48 hazards displayed (48 errors, 0 warnings)\n"


def test_hazard_form_is_parsed():
    (h,) = hazards(HEAD + _hazard() + TAIL)
    assert (h.kind, h.space) == ("WAW", "__shared__")
    assert [(a.op, a.function, a.pc) for a in h.accesses] == [
        ("Write", "cute_kernels_sm90_qsa_union_0", "0x23d0"), ("Write", "cute_kernels_sm90_qsa_union_0", "0x3c90")]


def test_union_write_write_hazards_are_benign():
    assert benign_union_races(HEAD + _hazard() * 48 + TAIL)


def test_other_hazards_are_not():
    assert not benign_union_races(HEAD + TAIL)  # nothing reported: not "benign races"
    for bad in (_hazard(kind="RAW", a="Read"), _hazard(space="__global__"),
                _hazard(fa="cute_kernels_sm90_decode_split_0", fb="cute_kernels_sm90_decode_split_0"),
                _hazard(fb="cute_kernels_sm90_qsa_tile_0")):
        assert not benign_union_races(HEAD + _hazard() + bad + TAIL), bad


def test_race_form_is_parsed():
    log = (HEAD + "========= Error: Race reported between Write access at cute_kernels_sm90_qsa_union_0+0x23d0 in "
           "x.py:1\n=========     and Write access at cute_kernels_sm90_qsa_union_0+0x3c90 in x.py:2 [12 hazards]\n")
    (h,) = hazards(log)
    assert h.kind == "race" and [a.pc for a in h.accesses] == ["0x23d0", "0x3c90"]
    assert benign_union_races(log)
    assert not benign_union_races(log.replace("Write access at cute_kernels_sm90_qsa_union_0+0x3c90",
                                              "Read access at cute_kernels_sm90_qsa_union_0+0x3c90"))


def test_summary_counts():
    assert reported_errors(HEAD + "========= ERROR SUMMARY: 0 errors\n") == 0
    assert reported_errors(HEAD + "========= ERROR SUMMARY: 1 error\n") == 1
    assert reported_errors(HEAD + _hazard() * 48 + TAIL) == 48
    # the process died (an illegal address) with nothing reported: 0, the exit status tells the rest
    assert reported_errors(HEAD + "torch.AcceleratorError: CUDA error: an illegal memory access was encountered\n"
                           "========= Target application returned an error\n========= ERROR SUMMARY: 0 errors\n") == 0
    assert reported_errors(HEAD + "Traceback (most recent call last):\n") is None  # no summary: not finished
