"""Smoke test of benchmarks/compare.py: run it for real under torchrun (2 gloo ranks) on the
smallest zoo model with two budgets, two rounds and one timed step, and check the shape of its
JSON. No
figure is asserted: the numbers depend on the machine."""

from __future__ import annotations

import json

import pytest
from _dist import REPO, SLOW_MACHINE, plans_kept, run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STRATEGIES = {"ddp", "shard_grad_op", "full_shard", "auto"}
BUDGETS = ["generous", "no_zero2"]
# About 50 s on 2 idle cores; the limit turns a hang into a failure (see _dist.SLOW_MACHINE).
TIMEOUT_S = 90 * SLOW_MACHINE

RUN_FIELDS = {
    "model",
    "budget",
    "budget_bytes",
    "strategy",
    "fits",
    "oom_stage",
    "samples_per_s",
    "step_s",
    "prepare_s",
    "trial_s",
    "prepare_overhead_s",
    "plan",
    "measured_peak_bytes",
    "peak_bytes_per_rank",
    "peak_bytes_max",
}
PLAN_FIELDS = {"strategy", "activation_checkpointing", "mixed_precision", "attempts"}
DERIVED_FIELDS = {
    "model",
    "budget",
    "best_manual",
    "auto_plan",
    "regret",
    "same_plan",
    "samples_per_s_ratio",
    "auto_oom",
    "auto_fell_back_in_trial",
    "auto_prepare_s",
    "auto_trial_s",
    "auto_prepare_overhead_s",
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("compare")
    returncode, output, timed_out = run_torchrun(
        REPO / "benchmarks" / "compare.py",
        "--models",
        "gpt",
        "--budgets",
        ",".join(BUDGETS),
        "--steps",
        "1",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--out",
        str(out),
        timeout=TIMEOUT_S,
        # autoshard's cache on, of its own: auto is planned again each round (its figures, not its
        # prepare time, are what is tested here)
        environment=plans_kept(out / "plans_kept"),
    )
    if timed_out:
        pytest.fail(f"compare.py timed out after {TIMEOUT_S}s:\n{output[-4000:]}", pytrace=False)
    if returncode != 0:
        pytest.fail(f"compare.py exited with {returncode}:\n{output[-4000:]}", pytrace=False)
    data = json.loads((out / "compare.json").read_text())
    data["stdout"] = output
    return data


def test_a_row_per_strategy_per_budget(result: dict) -> None:
    runs = result["runs"]
    seen = sorted((r["budget"], r["strategy"]) for r in runs)
    assert seen == sorted((b, s) for b in BUDGETS for s in STRATEGIES)


def test_rounds_are_merged(result: dict) -> None:
    by_round = sorted((r["budget"], r["strategy"], r["round"]) for r in result["runs_by_round"])
    assert by_round == sorted((b, s, i) for b in BUDGETS for s in STRATEGIES for i in (0, 1))
    for run in result["runs"]:
        assert run["rounds"] == 2
        rounds = [
            r
            for r in result["runs_by_round"]
            if (r["budget"], r["strategy"]) == (run["budget"], run["strategy"])
        ]
        assert run["fits"] == all(r["fits"] for r in rounds)
        if run["fits"]:  # the timed steps of both rounds, pooled
            assert run["step_times_s"] == [t for r in rounds for t in r["step_times_s"]]


def test_every_run_has_every_field(result: dict) -> None:
    for run in result["runs"]:
        assert RUN_FIELDS <= run.keys(), RUN_FIELDS - run.keys()
        assert isinstance(run["fits"], bool)
        assert run["prepare_s"] > 0
        if run["fits"]:
            assert run["samples_per_s"] > 0 and run["step_s"] > 0
            assert len(run["peak_bytes_per_rank"]) == 2
            assert run["peak_bytes_max"] == max(run["peak_bytes_per_rank"])
            assert PLAN_FIELDS <= run["plan"].keys()
        else:
            assert run["oom_stage"] in {"prepare", "steps", "over_budget"}


def test_derived_per_grid_point(result: dict) -> None:
    derived = result["derived"]
    assert sorted(d["budget"] for d in derived) == sorted(BUDGETS)
    for d in derived:
        assert DERIVED_FIELDS <= d.keys(), DERIVED_FIELDS - d.keys()


def test_stdout_has_the_tables(result: dict) -> None:
    assert "| model | budget | strategy |" in result["stdout"]
    assert "regret" in result["stdout"]
