"""The benchmarks' command-line variant lists and JSON output (``profiling/bench_utils.py``)."""

from __future__ import annotations

import json

from profiling.bench_utils import parse_variants, write_json


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


def test_probe_clocks_summary():
    # nvidia-smi rows "clocks.sm, power.draw, temperature.gpu, clock-event mask"; a truncated row
    # (the sampler killed mid-line) is skipped, not parsed
    from profiling.probe_clocks import summarize

    rows = [["1980", "200.5", "40", "0x0"], ["1770", "695.0", "60", "0x4"], ["1830", "690.0", "58", "0x4"],
            ["1845"]]
    s = summarize(rows)
    assert s == dict(samples=3, sm_mhz=1830.0, sm_mhz_min=1770.0, power_w=690.0, reasons=["0x0", "0x4"])
    assert summarize([]) == dict(samples=0, sm_mhz=None, sm_mhz_min=None, power_w=None, reasons=[])
