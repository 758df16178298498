"""`prepare` simulates the fastest strategies first (`measure.simulated`): a strategy slower than a
candidate already found to fit cannot be chosen, and is neither simulated nor shown. The choice
and its estimate must be those of simulating every strategy, as a what-if `plan` does.

`prepare` shares the simulations out among its ranks, as many strategies at once as there are
ranks; here one process stands for a one-rank job (`with_simulation(every=False)`), in which each
strategy is its own wave. The two-rank jobs of test_distributed.py run the same path with waves
of two.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_plan import Tower

import autoshard
import autoshard.pipeline as pipeline
from autoshard.measure import simulated as simulated_module
from autoshard.measure.fake import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

OPTIONS: dict[str, Any] = dict(world_size=8, device="cuda", device_memory="80GiB")


@pytest.fixture(scope="module")
def job() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    with torch.device("meta"):
        model = Tower(width=1024, depth=4)
        batch = torch.randn(4096, 8)
    return model, torch.optim.AdamW(model.parameters()), batch


def _planned(job: Any, fastest_first: bool, **options: Any) -> tuple[Any, list[tuple]]:
    """The plan, and the runs each simulation round was asked for."""
    asked: list[tuple] = []
    simulate_all = simulated_module.simulate_all
    with_simulation = simulated_module.with_simulation

    def counted(*args: Any, **kwargs: Any) -> Any:
        asked.append((args[2], kwargs.get("checkpointed", ())))
        return simulate_all(*args, **kwargs)

    def first(*args: Any) -> Any:
        return with_simulation(*args[:6], every=False) if fastest_first else with_simulation(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulated_module, "simulate_all", counted)
        patch.setattr(pipeline, "with_simulation", first)
        plan = autoshard.plan(*job, **(OPTIONS | options))
    return plan, asked


def test_a_fast_candidate_that_fits_leaves_the_slower_ones_unsimulated(job: Any) -> None:
    every, _ = _planned(job, fastest_first=False)
    plan, asked = _planned(job, fastest_first=True)
    assert (plan.strategy, plan.activation_checkpointing) == (
        every.strategy,
        every.activation_checkpointing,
    )
    assert plan.estimated_peak_bytes == every.estimated_peak_bytes
    # one strategy, one round: the fastest (DDP: a small model over 8 ranks) fits
    assert asked == [((plan.strategy,), ())], asked
    assert {c.strategy for c in plan.candidates} == {plan.strategy}
    others = {c.strategy for c in every.candidates} - {plan.strategy}
    assert others  # the what-if plan shows them
    note = next(r for r in plan.reasons if "not simulated nor shown" in r)
    assert all(str(s) in note for s in others), note


def test_where_the_fastest_does_not_fit_the_next_is_simulated(job: Any) -> None:
    every, _ = _planned(job, fastest_first=False)
    by = {c.strategy: c for c in every.candidates if c.activation_checkpointing == 0}
    fastest = min(by.values(), key=lambda c: c.step_seconds)
    # below the fastest unchecked candidate's need, above another's
    fitting = [
        c.estimated_peak_bytes + c.reserve_bytes
        for c in by.values()
        if c.estimated_peak_bytes < fastest.estimated_peak_bytes
    ]
    assert fitting, by
    limit = (max(fitting) + fastest.estimated_peak_bytes) // 2
    every, _ = _planned(job, fastest_first=False, memory_limit=limit)
    plan, asked = _planned(job, fastest_first=True, memory_limit=limit)
    assert (plan.strategy, plan.activation_checkpointing) == (
        every.strategy,
        every.activation_checkpointing,
    )
    assert plan.estimated_peak_bytes == every.estimated_peak_bytes
    assert plan.strategy != fastest.strategy or plan.activation_checkpointing > 0
    assert asked[0] == ((fastest.strategy,), ()), asked  # the fastest alone first
    assert len(asked) > 1
    shown = {c.strategy for c in plan.candidates}
    assert fastest.strategy in shown and plan.strategy in shown


def test_forced_checkpointing_simulates_each_strategy_s_two_runs_together(job: Any) -> None:
    every, _ = _planned(job, fastest_first=False, activation_checkpointing=True)
    plan, asked = _planned(job, fastest_first=True, activation_checkpointing=True)
    assert (plan.strategy, plan.estimated_peak_bytes) == (
        every.strategy,
        every.estimated_peak_bytes,
    )
    assert asked == [((plan.strategy,), (plan.strategy,))], asked
