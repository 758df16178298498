"""The host's throughput for CPU offload (`measure.host`): measured where a process trains on its
own GPU, agreed as the slowest rank's, and read by the cost model. The figures themselves are
timings, never asserted; what is tested is what they are made of and where they go."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from test_plan import AMPLE, make_inputs

from autoshard import Strategy
from autoshard._world import Memory, RankReport
from autoshard.decide.cost import step_seconds
from autoshard.decide.hardware import hardware_for
from autoshard.measure.host import HostThroughput, host_throughput, measure_host, with_host

GPU = hardware_for("cuda", (9, 0), True)


def test_the_step_is_timed_with_the_caller_s_optimizer_class_and_defaults() -> None:
    model = torch.nn.Linear(4, 4)
    figures = measure_host(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert math.isfinite(figures.step_bytes_per_s) and figures.step_bytes_per_s > 0
    assert figures.link_bytes_per_s is None  # no GPU given: no link to time
    assert "SGD's step on the CPU" in figures.note, figures.note


def test_adamw_is_timed_as_the_caller_made_it() -> None:
    """AdamW's defaults hold `decoupled_weight_decay`, which its constructor does not take: the
    step timed is still the caller's AdamW, foreach or fused as they chose."""
    model = torch.nn.Linear(4, 4)
    for chosen in ({}, {"foreach": True}, {"fused": True}):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **chosen)  # type: ignore[arg-type]
        figures = measure_host(optimizer)
        assert "AdamW's step on the CPU" in figures.note, (chosen, figures.note)


class NeedsMore(torch.optim.AdamW):
    """An optimizer whose constructor needs more than its defaults."""

    def __init__(self, params: object, schedule: object, **kwargs: object) -> None:
        super().__init__(params, **kwargs)  # type: ignore[arg-type]


def test_an_optimizer_that_cannot_be_built_from_its_defaults_is_stood_in_for_by_adamw() -> None:
    model = torch.nn.Linear(4, 4)
    figures = measure_host(NeedsMore(model.parameters(), schedule=None))
    assert "AdamW's (standing in for NeedsMore) step" in figures.note, figures.note


def test_nothing_is_measured_off_a_gpu() -> None:
    optimizer = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    assert host_throughput(torch.device("cpu"), optimizer) is None


def _report(rank: int, figures: HostThroughput | None) -> RankReport:
    return RankReport(rank, "h", Memory(1, 1, ""), (), None, None, offload_throughput=figures)


def test_the_slowest_rank_s_figures_are_the_plan_s_and_slow_the_offload_rung() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    fast = HostThroughput(4e10, 2e10, "fast host")
    slow = HostThroughput(1e9, 5e9, "slow host")
    taken = with_host(inputs, [_report(0, fast), _report(1, slow)])
    assert taken.hardware.host_memory_bytes_per_s == 1e9
    assert taken.hardware.host_link_bytes_per_s == 5e9
    assert "the host's optimizer step and pinned link measured" in taken.hardware.source
    assert taken.reasons[-1] == "slow host (the slowest of 2 ranks)"
    # the cost model reads them: offload is slower on the slow host, DDP does not change
    before, after = (step_seconds(i, Strategy.CPU_OFFLOAD, 0) for i in (inputs, taken))
    assert after > before
    assert step_seconds(taken, Strategy.DDP, 0) == step_seconds(inputs, Strategy.DDP, 0)


def test_figures_missing_on_a_rank_leave_the_constants() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    fast = HostThroughput(4e10, 2e10, "fast host")
    assert with_host(inputs, [_report(0, fast), _report(1, None)]) == inputs
    # a rank without a link figure (no GPU) keeps the link's constant, takes the step's
    no_link = replace(fast, link_bytes_per_s=None)
    taken = with_host(inputs, [_report(0, fast), _report(1, no_link)])
    assert taken.hardware.host_link_bytes_per_s == inputs.hardware.host_link_bytes_per_s
    assert taken.hardware.host_memory_bytes_per_s == 4e10
