"""benchmarks/one_gpu_ladder.py on the CPU: its dry run end to end as a plain checkout runs it on
the GPU machine (autoshard not installed, no PYTHONPATH, started from another directory), for one
of its families, and the pure parts that order the forced rungs and derive the regret.

Nothing here depends on timing: the dry run's step times are a busy CPU's, so only the report's
structure and the plumbing are checked (on the CPU CPU_OFFLOAD is unavailable, so the ladder has
only LOCAL rungs and 35% of the need fits nothing). The dry run is marked slow: CI runs it
(`--full`), and `compat`: on the oldest torch too, the GPU machines'."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from _dist import REPO, SLOW_MACHINE, plans_kept
from test_gpu_suite import _clean_env, plain_python

sys.path.insert(0, str(REPO / "benchmarks"))
import one_gpu_ladder as ladder  # noqa: E402

# One family: each is built and run by the same code (a child process per survey, auto run and
# forced rung), so a second one doubled the run and tested nothing more. The decoder with
# grouped-query attention, whose trace torch 2.11 once lost.
FAMILIES = ("qwen_gqa",)
# About 45 s on 2 idle cores; the limit turns a hang into a failure (see _dist.SLOW_MACHINE).
TIMEOUT_S = 150 * SLOW_MACHINE
OUTCOMES = {"ok", "oom", "oom_in_prepare", "does_not_fit", "error", "crashed", "skipped"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("ladder")
    python, _ = plain_python(tmp_path_factory.mktemp("plain_venv"))
    script = REPO / "benchmarks" / "one_gpu_ladder.py"
    command = [
        python,
        str(script),
        "--dry-run",
        "--out",
        str(out),
        "--families",
        ",".join(FAMILIES),
    ]
    # autoshard's cache on, in a directory of the run's own: each child plans the family again
    # (the survey at each limit, auto and each forced rung), and reads back the fake steps an
    # earlier child made, as a restarted job does (the GPU run plans each one cold)
    kept = plans_kept(out / "plans_kept")
    completed = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**_clean_env(), **kept},
        cwd=out,
    )
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((out / "logs").glob("*.log")))
    assert completed.returncode == 0, completed.stdout + completed.stderr + logs
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


@pytest.mark.slow  # the dry run: about 45 s on 2 idle cores
@pytest.mark.compat
def test_dry_run_surveys_each_family_and_runs_auto_at_each_fraction_and_launcher(
    dry_run: tuple[dict[str, Any], str],
) -> None:
    report, _ = dry_run
    assert report["dry_run"] is True
    assert list(report["families"]) == list(FAMILIES)
    for name, family in report["families"].items():
        survey = family["survey"]
        assert survey["outcome"] == "ok", (name, survey)
        need = survey["need_bytes"]
        assert need > 0 and survey["num_blocks"] > 0
        # the reference is the LOCAL rung with no block checkpointed
        local0 = [r for r in survey["rungs"] if (r["strategy"], r["checkpointed"]) == ("local", 0)]
        assert [r["need_bytes"] for r in local0] == [need]
        for fraction in ladder.FRACTIONS:
            limits = survey["limits"][f"{fraction:.2f}"]
            assert limits["limit_bytes"] == int(fraction * need)
            # on the CPU every rung is LOCAL: offload moves GPU memory to the host
            assert {r["strategy"] for r in limits["rungs"]} == {"local"}
            fitting = [[r["strategy"], r["checkpointed"]] for r in limits["rungs"] if r["fits"]]
            assert limits["fitting"] == fitting
        seen = [(run["fraction"], run["launcher"]) for run in family["auto"]]
        assert seen == [(f, launcher) for f in ladder.FRACTIONS for launcher in ladder.LAUNCHERS]
        assert len(family["rows"]) == len(family["auto"])


@pytest.mark.slow  # the dry run: about 45 s on 2 idle cores
@pytest.mark.compat
def test_dry_run_auto_chooses_as_its_plan_predicted_and_reports_each_measurement(
    dry_run: tuple[dict[str, Any], str],
) -> None:
    for family in dry_run[0]["families"].values():
        trained = 0
        for run, row in zip(family["auto"], family["rows"], strict=True):
            assert run["outcome"] in OUTCOMES - {"error", "crashed"}, run
            predicted = row["predicted"]
            if run["outcome"] == "does_not_fit":
                assert isinstance(predicted, str) and "does not fit" in predicted, row
                assert "no strategy fits" in run["error"]
                continue
            assert run["outcome"] == "ok", run
            trained += 1
            assert row["chosen"] == predicted == [run["chosen_strategy"], run["checkpointed"]]
            assert run["checkpointed"] > 0  # below the need, checkpointing is what fits here
            assert len(run["step_times_s"]) == ladder.STEPS and run["step_s"] > 0
            assert run["peak_allocated_bytes"] > 0 and run["estimated_peak_bytes"] > 0
            assert isinstance(run["within_limit"], bool)
            assert run["process_group"] == (None if run["launcher"] == "python" else "gloo")
        assert trained >= 2  # 60% of the need, under both launchers


@pytest.mark.slow  # the dry run: about 45 s on 2 idle cores
@pytest.mark.compat
def test_dry_run_times_the_fitting_rungs_and_derives_the_regret(
    dry_run: tuple[dict[str, Any], str],
) -> None:
    for name, family in dry_run[0]["families"].items():
        expected = ladder.forced_order(family["survey"])
        forced = family["forced"]
        assert [(f["strategy"], f["checkpointing"], f["fraction"]) for f in forced] == expected
        assert expected, name  # 60% of the need fits some checkpointed rung
        for run in forced:
            assert run["outcome"] == "ok", run
            assert [run["chosen_strategy"], run["checkpointed"]] == [
                run["strategy"],
                run["checkpointing"],
            ]
        for row in family["rows"]:
            if row["outcome"] != "ok":
                assert row["regret"] is None and not row["passed"]
                continue
            assert row["forced_timed"] == row["forced_fitting"] > 0
            assert row["regret"] > 0 and row["fastest_forced_step_s"] > 0


@pytest.mark.slow  # the dry run: about 45 s on 2 idle cores
@pytest.mark.compat
def test_dry_run_writes_a_table_per_family_and_says_what_it_checks(
    dry_run: tuple[dict[str, Any], str],
) -> None:
    report, markdown = dry_run
    assert "CPU_OFFLOAD is unavailable" in markdown and "plumbing" in markdown
    assert report["need_reference"] in markdown
    header = "| fraction | launcher | outcome | chosen (predicted) | est | peak | limit |"
    assert markdown.count(header) == len(FAMILIES)
    for name in FAMILIES:
        assert f"## {name} (" in markdown
    summary = report["summary"]
    assert summary["rows"] == len(FAMILIES) * len(ladder.FRACTIONS) * len(ladder.LAUNCHERS)


def _survey(fitting: dict[float, list[list[Any]]]) -> dict[str, Any]:
    limits = {
        f"{f:.2f}": {"limit_bytes": 100, "fitting": rungs, "predicted": None}
        for f, rungs in fitting.items()
    }
    return {"limits": limits}


def test_forced_rungs_go_fewest_checkpointed_first_once_each_at_the_tightest_fraction() -> None:
    survey = _survey(
        {
            0.60: [["local", 3], ["local", 4], ["cpu_offload", 0], ["cpu_offload", 1]],
            0.35: [["cpu_offload", 1], ["cpu_offload", 2]],
        }
    )
    assert ladder.forced_order(survey) == [
        ("cpu_offload", 0, 0.60),
        ("local", 3, 0.60),
        ("cpu_offload", 1, 0.35),  # fits both: timed once, at the tightest
        ("local", 4, 0.60),
        ("cpu_offload", 2, 0.35),
    ]


def test_regret_is_the_fastest_fitting_forced_step_over_auto_s() -> None:
    survey = _survey({0.60: [["local", 2], ["local", 3]], 0.35: []})
    survey["limits"]["0.60"]["predicted"] = ["local", 2]

    def run(strategy: str, k: int, step: float, **more: Any) -> dict[str, Any]:
        return dict(outcome="ok", chosen_strategy=strategy, checkpointed=k, step_s=step, **more)

    autos = [
        run("local", 2, 2.0, fraction=0.60, launcher="python", within_limit=True),
        run("local", 3, 4.0, fraction=0.60, launcher="torchrun", within_limit=True),
        {"outcome": "does_not_fit", "fraction": 0.35, "launcher": "python"},
    ]
    # local 1 was timed but does not fit 60%: it is no reference
    forced = [run("local", 1, 1.0), run("local", 2, 2.1), run("local", 3, 3.0)]
    rows = ladder.rows(survey, autos, forced)
    assert [r["fastest_forced"] for r in rows] == [["local", 2], ["local", 2], None]
    assert rows[0]["regret"] == pytest.approx(2.1 / 2.0) and rows[0]["passed"]
    assert rows[1]["regret"] == pytest.approx(2.1 / 4.0) and not rows[1]["passed"]
    assert rows[2]["regret"] is None and not rows[2]["passed"]
