"""The cluster probe's launches (profiling/cluster_probe.py) read their peers' buffers correctly on
the H200, 8- and 16-CTA clusters alike (docs/design/sm90-decode.md#cluster-merge-exit)."""

from __future__ import annotations

import pytest

from profiling import cluster_probe as cp

from .conftest import sm90_only


@sm90_only()
@pytest.mark.parametrize("name", list(cp.CASES))
def test_cluster_probe_case(name, capsys):
    cp.run_case(name)  # raises on any row that differs from its peer's
    assert capsys.readouterr().out.rstrip().endswith(f"case {name}: ok")
