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
