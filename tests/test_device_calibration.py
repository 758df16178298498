"""The training GPU's throughput for the cost model (`measure.device`): measured where a process
trains on its own GPU, agreed as the slowest rank's, read by the cost model, and named in the
plan. The figures themselves are timings, never asserted; tests/test_gpu.py measures them."""

from __future__ import annotations

import torch
from test_plan import AMPLE, make_inputs

import autoshard
from autoshard import Strategy
from autoshard._world import Memory, RankReport
from autoshard.decide.cost import step_seconds
from autoshard.decide.hardware import Throughput, hardware_for
from autoshard.measure.device import device_throughput, with_device

GPU = hardware_for("cuda", (9, 0), True)


def _report(rank: int, figures: Throughput | None) -> RankReport:
    return RankReport(rank, "h", Memory(1, 1, ""), (), None, None, device_throughput=figures)


def test_nothing_is_measured_off_a_gpu() -> None:
    assert device_throughput(torch.device("cpu"), torch.bfloat16) is None


def test_the_slowest_rank_s_figures_replace_the_constants_and_say_so() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    fast = Throughput(8e14, 3e12, "measured on cuda:0 (fast)", 4e-6)
    slow = Throughput(6e14, 2.5e12, "measured on cuda:0 (slow)", 3e-6)
    taken = with_device(inputs, [_report(0, fast), _report(1, slow)])
    assert taken.hardware.flops_per_s == 6e14
    assert taken.hardware.memory_bytes_per_s == 2.5e12
    assert taken.hardware.kernel_launch_s == 4e-6  # each figure the slowest rank's
    source = taken.hardware.source
    expected = "FLOP/s, memory bandwidth and operator launch time measured on cuda:0 (slow)"
    assert source.startswith(expected), source
    assert "the slowest of 2 ranks" in source and "otherwise constants" in source
    # the cost model reads them: compute-bound steps are faster than on the constants (4e14)
    for strategy in (Strategy.DDP, Strategy.FULL_SHARD):
        assert step_seconds(taken, strategy, 0) < step_seconds(inputs, strategy, 0)


def test_figures_missing_on_a_rank_leave_the_constants() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    fast = Throughput(8e14, 3e12, "measured")
    assert with_device(inputs, [_report(0, fast), _report(1, None)]) == inputs


def test_the_plan_names_the_figures_its_step_times_come_from() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    plan = autoshard.plan(model, optimizer, torch.randn(4, 8), device="cpu", device_memory="1GiB")
    chose = plan.reasons[-1]
    assert "step times modelled from constants for the device class" in chose, chose
