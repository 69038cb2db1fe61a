"""``cute-kernels bench`` runs end to end on the GPU through the same entry point as the CLI and
writes well-formed JSON (small selections of shapes; the full tables are the benchmark runs)."""

from __future__ import annotations

import json

from cute_kernels.bench import main as bench_main

from .conftest import sm90_only


def test_bench_merge_writes_json(tmp_path):
    path = tmp_path / "merge.json"
    assert bench_main("merge", ["--json", str(path), "--nvtx"]) == 0
    result = json.loads(path.read_text())
    assert result["read_bw"] > 1e11
    assert len(result["rows"]) == 6
    for r in result["rows"]:
        assert r["us"] > 0 and 0 < r["roofline_pct"] < 150, r
        assert r["rel_err"] < 1e-2, r


@sm90_only()
def test_bench_decode_one_shape_with_sdpa(tmp_path):
    path = tmp_path / "decode.json"
    assert bench_main("decode", ["--shapes", "B1 ctx", "--kv", "fp8", "--peers", "sdpa,global",
                                 "--json", str(path), "--nvtx"]) == 0
    result = json.loads(path.read_text())
    (row,) = result["rows"]
    assert row["shape"] == "llama3-8b B1 ctx1000" and row["kv"] == "fp8"
    for name in ("ours", "sdpa", "global"):
        assert row[f"{name}_us"] > 0, row
        assert row[f"{name}_err"] < 5e-2, row
    assert row["ours_err"] < 5e-3, row
    assert result["host_overhead_us"] > 0
