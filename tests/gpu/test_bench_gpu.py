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
        # partials that fit in L2 are re-read from it across the graph's replays, so only a problem
        # larger than the H200's 60 MB L2 is bound by DRAM (docs/design/merge.md#measurements)
        assert r["us"] > 0 and r["roofline_pct"] > 0, r
        assert r["bytes"] < 64e6 or r["roofline_pct"] < 105, r
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


@sm90_only()
def test_bench_decode_ragged_row_with_its_twin(tmp_path):
    from cute_kernels.bench.decode import ragged_lens, twin_ctx

    path = tmp_path / "ragged.json"
    assert bench_main("decode", ["--shapes", "ragged B8 max4000", "--kv", "fp8", "--peers", "sdpa",
                                 "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    lens = ragged_lens(8, 4000)
    assert row["ragged"] and row["tokens"] == sum(lens) and row["table_tokens"] == 32768
    assert row["bytes"] == sum(lens) * 2 * 4 * 128 + 2 * 8 * 32 * 128 * 2  # K/V present + Q + O
    assert row["ours_us"] > 0 and row["ours_err"] < 5e-3, row
    assert row["twin_ctx"] == twin_ctx(lens) and row["twin_us"] > 0 and "ours_minus_twin_us" in row
    assert "equal contexts" in row["sdpa_error"]
    # the balanced schedule's column, on the row and on its twin; available, it runs no self-check,
    # so its state has nothing to say
    assert row["balanced_us"] > 0 and row["balanced_err"] < 5e-3, row
    assert row["twin_balanced_us"] > 0 and "balanced_minus_twin_us" in row
    assert row["balanced_self_check"] == "", row


@sm90_only()
def test_bench_serve_quick_writes_json(tmp_path):
    """``bench serve --quick``, cut further (one workload per cache dtype, 2 layers, 8 output tokens):
    every step timed, the latencies summarized, and each configuration's layer 0 checked against the
    reference on its first prefill, mixed and decode step (``ours_fp8q`` on the FP8 workload only)."""
    from cute_kernels.bench.serve_schedule import WORKLOADS, quick, schedule

    path = tmp_path / "serve.json"
    assert bench_main("serve", ["--quick", "--workloads", "long-fp8,short-bf16", "--layers", "2", "--output-len", "8",
                                "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert [e["workload"]["kv"] for e in result["workloads"]] == ["fp8", "bf16"]
    for e, name in zip(result["workloads"], ("long-fp8", "short-bf16")):
        w = quick(WORKLOADS[name]).scaled(layers=2, output_len=8)
        n_steps = len(schedule(w).steps)
        assert e["workload"]["steps"] == n_steps and e["workload"]["layers"] == 2
        ours = e["configs"]["ours"]
        assert "error" not in ours, ours
        assert len(ours["step_s"]) == n_steps and all(t > 0 for t in ours["step_s"])
        assert all(ours["timed"])
        assert {h for h in ours["how"]} == {"graph", "eager"}
        s = ours["summary"]
        assert s["total"] > 0 and 0 < s["ttft"]["median"] <= s["total"] and 0 < s["tpot"]["median"] < s["total"]
        for kind in ("prefill_prefill", "mixed_decode", "mixed_prefill", "decode_decode"):
            assert ours[f"{kind}_err"] < 5e-3, (name, kind, ours[f"{kind}_err"])
        for peer in ("fi_xqa", "fi_native", "fa4"):
            r = e["configs"].get(peer)
            if r is None or "error" in r:  # not installed, or refused (FA4 on FP8): said in the row
                continue
            assert len(r["step_s"]) == n_steps and r["summary"]["total"] > 0, peer
            for k, v in r.items():
                if k.endswith("_err"):
                    assert v < 5e-2, (name, peer, k, v)
    fp8, bf16 = (e["configs"] for e in result["workloads"])
    assert fp8["fa4"]["error"].startswith("FA4 has no FP8 KV")
    # ours_fp8q: the FP8-query prefill on the FP8 workload (its error is the FP8 query's, about 6e-2
    # against the unquantized one: docs/design/sm90-prefill.md), the decode rows as ours; skipped on BF16
    fp8q = fp8["ours_fp8q"]
    assert "error" not in fp8q, fp8q
    assert "prefill: sm90.prefill_fp8q" in fp8q["plans"] and "decode: sm90.decode" in fp8q["plans"], fp8q["plans"]
    assert all(t > 0 for t in fp8q["step_s"]) and fp8q["summary"]["total"] > 0
    for kind in ("mixed_decode", "decode_decode"):
        assert fp8q[f"{kind}_err"] < 5e-3, (kind, fp8q[f"{kind}_err"])
    for kind in ("prefill_prefill", "mixed_prefill"):
        assert fp8q[f"{kind}_err"] < 1e-1, (kind, fp8q[f"{kind}_err"])
    assert bf16["ours_fp8q"]["error"].startswith("an FP8 prefill query needs an FP8 KV cache")
