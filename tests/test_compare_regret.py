"""benchmarks/compare.py's verdict per grid point, from rows made up here (no run): an auto plan
identical to the best manual one has regret 1 by construction, whatever the timing said."""

from __future__ import annotations

import sys
from typing import Any

from _dist import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import compare  # noqa: E402


def row(strategy: str, plan: tuple[str, int], samples_per_s: float, **extra: Any) -> dict:
    return {
        "model": "gpt",
        "budget": "generous",
        "budget_bytes": 2**30,
        "strategy": strategy,
        "fits": True,
        "oom_stage": None,
        "samples_per_s": samples_per_s,
        "plan": {
            "strategy": plan[0],
            "activation_checkpointing": plan[1],
            "num_blocks": 4,
            "attempts": [{}],
        },
        "plans_differ": False,
        "prepare_s": 1.0,
        "trial_s": 0.2,
        "prepare_overhead_s": 0.8,
        "step_s": 0.1,
        **extra,
    }


def point(auto_plan: tuple[str, int], **auto_extra: Any) -> dict:
    rows = [
        row("ddp", ("ddp", 0), 100.0),
        row("shard_grad_op", ("shard_grad_op", 0), 80.0),
        row("full_shard", ("full_shard", 0), 70.0),
        row("auto", auto_plan, 62.0, **auto_extra),  # timed at 0.62 of the best
    ]
    (derived,) = compare.derive(rows)
    return derived


def test_the_same_plan_as_the_best_manual_one_is_regret_1_and_says_so() -> None:
    d = point(("ddp", 0))
    assert d["same_plan"] and d["regret"] == 1.0
    assert d["samples_per_s_ratio"] == 0.62  # the timing, kept for what it shows: noise
    table = compare.derived_table([d])
    assert "| 1 (same plan; timed 0.620) |" in table


def test_another_plan_is_judged_by_its_timing() -> None:
    d = point(("ddp", 1))  # one block checkpointed: not what the best manual run did
    assert not d["same_plan"] and d["regret"] == 0.62
    assert "| 0.620 |" in compare.derived_table([d])


def test_a_plan_that_changed_between_rounds_is_not_called_the_same() -> None:
    d = point(("ddp", 0), plans_differ=True)
    assert not d["same_plan"] and d["regret"] == 0.62


def test_rounds_default_to_three_interleaved() -> None:
    assert compare.parse_args(["--models", "gpt"]).rounds == 3
