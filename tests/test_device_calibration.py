"""The training GPU's throughput for the cost model (`measure.device`): measured where a process
trains on its own GPU, agreed as the slowest rank's, read by the cost model, and named in the
plan. The figures themselves are timings, never asserted; tests/test_gpu.py measures them."""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
from test_plan import AMPLE, make_inputs

import autoshard
from autoshard import Strategy
from autoshard._world import Memory, RankReport
from autoshard.decide.cost import step_seconds
from autoshard.decide.hardware import Throughput, hardware_for
from autoshard.measure.device import _fsdp_collective_time, device_throughput, with_device

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


def test_fsdp2_s_host_time_is_measured_outside_a_job_and_leaves_nothing_behind() -> None:
    # measured on CUDA only at prepare; the same code runs on any device
    state, stream = random.getstate(), torch.get_rng_state()
    for dtype in (torch.bfloat16, None):
        seconds = _fsdp_collective_time(torch.device("cpu"), dtype)
        assert math.isfinite(seconds) and seconds > 0
    assert not dist.is_initialized()  # its fake group is gone
    # the caller's random streams: torch's (the units' weights) and Python's (fake collectives)
    assert random.getstate() == state
    assert torch.equal(torch.get_rng_state(), stream)


def test_fsdp2_s_host_time_is_measured_inside_a_job_without_touching_its_group() -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        group = dist.group.WORLD
        assert _fsdp_collective_time(torch.device("cpu"), torch.bfloat16) > 0
        assert dist.group.WORLD is group and dist.get_world_size() == 1
        x = torch.ones(1)
        dist.all_reduce(x)  # the job's own group still works
        assert x.item() == 1
    finally:
        dist.destroy_process_group()


def _measured(*fsdp: float | None) -> list[RankReport]:
    """One report per rank, alike but for FSDP2's host time."""
    return [
        _report(rank, Throughput(8e14, 3e12, f"measured on cuda:{rank}", 4e-6, seconds))
        for rank, seconds in enumerate(fsdp)
    ]


def test_fsdp2_s_host_time_is_charged_per_collective_of_each_unit() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    taken = with_device(inputs, _measured(1e-4, 3e-4))
    assert taken.hardware.fsdp_collective_s == 3e-4  # the slowest rank's
    assert "FSDP2's host time per collective measured on cuda:0" in taken.hardware.source
    less = with_device(inputs, _measured(1e-4, 1e-4))
    # every unit (each block and the root) all-gathers and reduce-scatters; ZeRO-3 gathers twice
    units = len(inputs.stats.block_numel) + 1
    for strategy, collectives in ((Strategy.SHARD_GRAD_OP, 2), (Strategy.FULL_SHARD, 3)):
        added = step_seconds(taken, strategy, 0) - step_seconds(less, strategy, 0)
        assert math.isclose(added, collectives * units * 2e-4, rel_tol=1e-9)
    for strategy in (Strategy.LOCAL, Strategy.DDP):  # no FSDP2 unit
        assert step_seconds(taken, strategy, 0) == step_seconds(less, strategy, 0)


def test_fsdp2_s_host_time_missing_on_a_rank_leaves_its_constant() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    taken = with_device(inputs, _measured(3e-4, None))
    assert taken.hardware.fsdp_collective_s == GPU.fsdp_collective_s
    assert taken.hardware.kernel_launch_s == 4e-6  # the other figures still taken
    assert "FSDP2" not in taken.hardware.source.split(", otherwise")[0]
