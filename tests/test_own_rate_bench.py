"""benchmarks/own_rate.py runs end to end on a tiny model: the step measured on this machine
beside the cost model's, its FLOP/s a large matmul's and the model's own, its operators'
bandwidth a large copy's and the model's own (`measure.rates`). The figures are timings, never
asserted; this checks that it runs and reports each of them."""

from __future__ import annotations

import re
import sys

import pytest
from _dist import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import own_rate  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_benchmark_reports_every_modelled_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert own_rate.main(["--smoke"]) == 0
    output = capsys.readouterr().out
    rows = [line for line in output.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 1, output
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert re.fullmatch(r"[\d.]+ ms", cells[1]), cells  # measured
    assert all(re.fullmatch(r"[\d.]+ G", c) for c in cells[2:6]), cells  # FLOP/s, bandwidths
    assert all(re.fullmatch(r"[\d.]+ ms \([+-]\d+%\)", c) for c in cells[6:9]), cells
    assert "FLOP-bound calls (" in cells[9] and "memory-bound calls (" in cells[9], cells
    assert "run forward and backward at its own shapes; " in cells[9], cells
    assert cells[9].endswith("run again at its own shapes"), cells
