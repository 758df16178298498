"""benchmarks/planner.py runs end to end on a small Llama-shaped model: the plan printed cold, the
cache written and read back by a restart, and the in-process count of fake steps and operators
with the time of each phase (issue 24). Figures are the benchmark's; this checks that it runs and
reports them."""

from __future__ import annotations

import os
import re
import sys

import pytest
from _dist import REPO, run_tree

pytestmark = pytest.mark.slow


def test_planner_reports_cold_warm_and_phases() -> None:
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "planner.py"),
        "--factory",
        "benchmarks.planner:tiny_llama",
        "--world-size",
        "16",
        "--nodes",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--phases",
        "--warm",
    ]
    code, output, timed_out = run_tree(command, REPO, _env(), timeout=600)
    assert code == 0 and not timed_out, output[-3000:]
    assert "planner: benchmarks.planner:tiny_llama, world size 16 (2 nodes)" in output, output
    # the restart's plan read its trace and every run back
    assert "read from autoshard's cache" in output, output
    assert re.search(r"planner, cache on: [\d.]+ s wall writing it, [\d.]+ s wall", output)
    phases = re.search(r"planner, in-process: (\d+) fake steps, ([\d,]+) fake operators", output)
    assert phases is not None, output
    # the trace, and the strategies simulated at 3, 4 and 5 of the 16 blocks
    assert int(phases[1]) >= 4 and int(phases[2].replace(",", "")) > 0


def test_parallel_simulation_reports_the_same_plan_with_workers() -> None:
    """benchmarks/parallel_simulation.py: a plan without workers and with one, compared."""
    output = _benchmark("parallel_simulation.py", "--cases", "tiny_llama", "--workers", "1")
    row = re.search(r"\| tiny_llama \| [\d.]+ \| [\d.]+ \| (\d+) \| (\w+) \|", output)
    assert row is not None and row[2] == "yes", output[-3000:]


def test_depth_cost_counts_a_plan() -> None:
    """benchmarks/depth_cost.py: the fake steps and operators of one plan, with its choice."""
    output = _benchmark("depth_cost.py", "--depths", "16", "--device-memory", "1000GiB")
    row = re.search(r"\| 1000GiB \| 16 \| (\d+) \| ([\d,]+) \| 1\.00 \| (\w+), AC 0 \|", output)
    assert row is not None and int(row[1]) >= 3, output[-3000:]


def test_prepare_cost_counts_the_decision_as_prepare_makes_it() -> None:
    """benchmarks/prepare_cost.py: the trace and the simulated runs of one model at world 1."""
    output = _benchmark("prepare_cost.py", "--dry-run", "--models", "enc_dec", "--worlds", "1")
    row = re.search(
        r"\| enc_dec \| 1 \| (\d+) \| ([\d,]+) \| ([\d,]+) \| [\d.]+ \| [\d.]+ \| (\w+), AC", output
    )
    assert row is not None, output[-3000:]
    # the trace and at least one simulated run; prim.device is part of the operators, not all
    assert int(row[1]) >= 2 and 0 < int(row[3].replace(",", "")) < int(row[2].replace(",", ""))


def _benchmark(script: str, *args: str) -> str:
    """What benchmarks/`script` printed, run with `args`; fails the test unless it exits 0."""
    command = [sys.executable, str(REPO / "benchmarks" / script), *args]
    code, output, timed_out = run_tree(command, REPO, _env(), timeout=600)
    assert code == 0 and not timed_out, output[-3000:]
    return output


def _env() -> dict[str, str]:
    """This checkout importable, no launcher's variables, no GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env
