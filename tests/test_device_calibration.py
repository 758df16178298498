"""The training GPU's throughput for the cost model (`measure.device`): measured where a process
trains on its own GPU, agreed as the slowest rank's, read by the cost model, and named in the
plan. The figures themselves are timings, never asserted; tests/test_gpu.py measures them."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_plan import AMPLE, make_inputs

import autoshard
from autoshard import Strategy
from autoshard._world import Memory, RankReport
from autoshard.decide.cost import step_seconds
from autoshard.decide.hardware import Throughput, hardware_for
from autoshard.measure import device as device_module
from autoshard.measure.device import _fsdp_host_times, device_throughput, with_device

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


@pytest.fixture
def plausible(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's steps run for real (the units sharded, each stack's forward and backward), but
    their timings are given: a timing is never asserted (a busy host makes them contradict
    themselves, and then the probe gives None, `test_..._contradict_themselves`)."""

    def ran(device: torch.device, runs: list) -> list[float]:
        for run in runs:
            run()
            run()  # a second step: the gradients were dropped after the first
        return [1.0, 9.0, 13.0]

    monkeypatch.setattr(device_module, "_fastest_each", ran)


def test_fsdp2_s_host_times_are_measured_outside_a_job_and_leave_nothing_behind(
    plausible: None,
) -> None:
    # measured on CUDA only at prepare; the same code runs on any device
    state, stream = random.getstate(), torch.get_rng_state()
    for dtype in (torch.bfloat16, None):
        assert _fsdp_host_times(torch.device("cpu"), dtype) == (0.5, 0.5)
    assert not dist.is_initialized()  # its fake group is gone
    # the caller's random streams: torch's (the units' weights) and Python's (fake collectives)
    assert random.getstate() == state
    assert torch.equal(torch.get_rng_state(), stream)


def _caller_modes() -> tuple[Any, ...]:
    """Modes `prepare` may be called from under: the first two lost the FSDP2 figure (a forward
    without gradients), the third too (units on meta)."""
    return (
        torch.no_grad(),
        torch.inference_mode(),
        torch.device("meta"),
        torch.autocast("cpu", dtype=torch.bfloat16),
    )


def test_fsdp2_s_host_times_are_measured_under_the_caller_s_modes(plausible: None) -> None:
    # prepare may be called under no_grad, inference_mode, a default device or autocast: the
    # first two lost the figure (a forward without gradients), the third too (units on meta)
    for mode in _caller_modes():
        with mode:
            assert _fsdp_host_times(torch.device("cpu"), torch.bfloat16) == (0.5, 0.5), mode
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_the_timed_runs_pass_through_no_default_device_the_caller_did_not_set() -> None:
    """A default device is a torch function mode every timed call would pass through: entered
    only over the caller's own, which made tensors elsewhere than on the CPU."""
    import contextlib

    from autoshard.measure.device import cpu_by_default

    assert isinstance(cpu_by_default(), contextlib.nullcontext)
    with torch.device("meta"), cpu_by_default():
        assert torch.empty(1).device.type == "cpu"


def test_fsdp2_s_host_times_timed_for_real_are_two_times_or_none() -> None:
    figures = _fsdp_host_times(torch.device("cpu"), torch.bfloat16)
    assert figures is None or all(math.isfinite(f) and f > 0 for f in figures), figures


def test_fsdp2_s_host_times_are_none_where_the_timings_contradict_themselves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the unwrapped stack, ZeRO-2's, ZeRO-3's: a disturbed host can time any of them slow
    for timings in ([1.0, 0.5, 3.0], [1.0, 1.5, 3.0], [1.0, 3.0, 2.9], [1.0, 9.0, 17.0]):
        monkeypatch.setattr(device_module, "_fastest_each", lambda device, runs, t=timings: t)
        assert _fsdp_host_times(torch.device("cpu"), None) is None, timings
    monkeypatch.setattr(device_module, "_fastest_each", lambda device, runs: [1.0, 9.0, 13.0])
    unit, gather = _fsdp_host_times(torch.device("cpu"), None)  # type: ignore[misc]
    # 8 units: ZeRO-3 gathers each once more (4 s / 8); the rest per unit, less ZeRO-2's gather
    assert (unit, gather) == (8.0 / 8 - 0.5, 0.5)


def test_fsdp2_s_host_times_are_measured_inside_a_job_without_touching_its_group(
    plausible: None,
) -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        group = dist.group.WORLD
        assert _fsdp_host_times(torch.device("cpu"), torch.bfloat16) == (0.5, 0.5)
        assert dist.group.WORLD is group and dist.get_world_size() == 1
        x = torch.ones(1)
        dist.all_reduce(x)  # the job's own group still works
        assert x.item() == 1
    finally:
        dist.destroy_process_group()


def _measured(*fsdp: tuple[float, float] | None) -> list[RankReport]:
    """One report per rank, alike but for FSDP2's host times (per unit, per all-gather)."""
    where = "measured on cuda:{} (H100): a 4096x4096 bfloat16 matmul"
    return [
        _report(rank, Throughput(8e14, 3e12, where.format(rank), 4e-6, *(times or (None, None))))
        for rank, times in enumerate(fsdp)
    ]


def test_fsdp2_s_host_times_are_charged_per_unit_and_per_all_gather() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    taken = with_device(inputs, _measured((1e-4, 2e-5), (3e-4, 1e-5)))
    assert (taken.hardware.fsdp_unit_s, taken.hardware.fsdp_gather_s) == (3e-4, 2e-5)  # slowest
    source = taken.hardware.source
    assert source.startswith("FLOP/s, memory bandwidth, operator launch time and FSDP2's host")
    less = with_device(inputs, _measured((1e-4, 1e-5), (1e-4, 1e-5)))
    # every unit (each block and the root) pays its own; each block's all-gathers (ZeRO-3
    # gathers twice) and the root's one pay theirs
    blocks = len(inputs.stats.block_numel)
    for strategy, gathers in ((Strategy.SHARD_GRAD_OP, 1), (Strategy.FULL_SHARD, 2)):
        added = step_seconds(taken, strategy, 0) - step_seconds(less, strategy, 0)
        expected = (blocks + 1) * 2e-4 + (blocks * gathers + 1) * 1e-5
        assert math.isclose(added, expected, rel_tol=1e-9), strategy
    for strategy in (Strategy.LOCAL, Strategy.DDP):  # no FSDP2 unit
        assert step_seconds(taken, strategy, 0) == step_seconds(less, strategy, 0)


def test_fsdp2_s_host_times_missing_on_a_rank_leave_their_constants_and_are_not_named() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    taken = with_device(inputs, _measured((3e-4, 1e-4), None))
    assert taken.hardware.fsdp_unit_s == GPU.fsdp_unit_s
    assert taken.hardware.fsdp_gather_s == GPU.fsdp_gather_s
    assert taken.hardware.kernel_launch_s == 4e-6  # the other figures still taken
    measured = taken.hardware.source.split(", otherwise")[0]
    assert measured.startswith("FLOP/s, memory bandwidth and operator launch time measured on")
    assert "FSDP2" not in measured, measured


# ---------------------------------------------------------------------------------------------
# DTensor's host time per operator: FSDP2's optimizer step pays it for every operator


def test_dtensor_s_host_time_per_operator_is_the_difference_of_two_loops_less_the_plain_one_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AdamW's loop over few and more parameters, plain then DTensor shards: what the shards
    add per parameter beyond the plain loop's, per operator the cost model counts."""
    from autoshard.decide.optimizer import step_traffic

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(device_module._MORE_SHARDS)]
    few = torch.optim.AdamW(params[: device_module._FEW_SHARDS], foreach=False)
    more = torch.optim.AdamW(params, foreach=False)
    operators = step_traffic(more, "cpu")[1] - step_traffic(few, "cpu")[1]
    assert operators == 8 * (device_module._MORE_SHARDS - device_module._FEW_SHARDS)
    monkeypatch.setattr(device_module, "_fastest_each", lambda device, runs: [1.0, 2.0, 3.0, 7.0])
    assert device_module._dtensor_op_time(torch.device("cpu")) == (4.0 - 1.0) / operators
    # a disturbed host: the plain loop not slower with more, the shards not slower than it
    for timings in ([2.0, 1.0, 3.0, 7.0], [1.0, 2.0, 3.0, 3.5], [1.0, 2.0, 3.0, 4.0]):
        monkeypatch.setattr(device_module, "_fastest_each", lambda device, runs, t=timings: t)
        assert device_module._dtensor_op_time(torch.device("cpu")) is None, timings


def test_dtensor_s_host_time_is_measured_for_real_under_the_caller_s_modes_leaving_nothing() -> (
    None
):
    state, stream = random.getstate(), torch.get_rng_state()
    for mode in _caller_modes():
        with mode:
            figure = device_module._dtensor_op_time(torch.device("cpu"))
        assert figure is None or (math.isfinite(figure) and figure > 0), (mode, figure)
    assert not dist.is_initialized()  # its fake group is gone
    assert random.getstate() == state and torch.equal(torch.get_rng_state(), stream)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:  # inside a job: the job's group untouched
        group = dist.group.WORLD
        device_module._dtensor_op_time(torch.device("cpu"))
        assert dist.group.WORLD is group and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_dtensor_s_host_time_is_charged_for_every_operator_of_a_sharded_optimizer_step() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    stats = dataclasses.replace(inputs.stats, step_operators=800)
    inputs = dataclasses.replace(inputs, stats=stats)
    where = "measured on cuda:{} (H100): a 4096x4096 bfloat16 matmul"
    slow, fast = (
        _report(rank, Throughput(8e14, 3e12, where.format(rank), 4e-6, 1e-4, 1e-5, dtensor_op_s=t))
        for rank, t in enumerate((5e-5, 1e-5))
    )
    taken = with_device(inputs, [slow, fast])
    assert taken.hardware.dtensor_op_s == 5e-5  # the slowest rank's
    assert "DTensor's host time per operator" in taken.hardware.source
    less = with_device(inputs, [fast, fast])
    for strategy in (Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD, Strategy.CPU_OFFLOAD):
        added = step_seconds(taken, strategy, 0) - step_seconds(less, strategy, 0)
        assert math.isclose(added, 800 * (5e-5 - 1e-5), rel_tol=1e-9), strategy
    for strategy in (Strategy.LOCAL, Strategy.DDP):  # plain tensors
        assert step_seconds(taken, strategy, 0) == step_seconds(less, strategy, 0)
    # measured on one rank only: the constant stands, and is not named
    missing = with_device(inputs, [slow, _report(1, Throughput(8e14, 3e12, "m", 4e-6))])
    assert missing.hardware.dtensor_op_s == GPU.dtensor_op_s
    assert "DTensor" not in missing.hardware.source
