"""The decision (`decide`, `candidate`, `strategies_for`, `step_seconds`), its rendering, and the
what-if `autoshard.plan(...)`. Decision inputs are built by hand: no trace, no process group."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace

import pytest
import torch
from torch import nn

import autoshard
from autoshard import DoesNotFit, Strategy
from autoshard._units import human
from autoshard.decide.candidates import candidate, check_forced, decide, strategies_for
from autoshard.decide.cost import step_seconds
from autoshard.decide.estimate import ModelStats, Setting
from autoshard.decide.hardware import Hardware, hardware_for
from autoshard.decide.plan import Attempt, Candidate, Outcome, Plan, PlanInputs
from autoshard.decide.precision import Precision
from autoshard.decide.profile import ActivationProfile
from autoshard.strategies.recipes import Job, available

MiB = 2**20
GiB = 2**30
M = 2**20  # a million-ish elements
BLOCKS = 8
AMPLE = 2**50
SHARDED = (Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD)
ALL = (Strategy.DDP, Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD)

# A 144M-parameter fp32 model: 8 blocks of 16M elements and a 16M-element root, trained by Adam.
STATS = ModelStats(
    param_bytes=144 * M * 4,
    trainable_bytes=144 * M * 4,
    floating_numel=144 * M,
    block_numel=(16 * M,) * BLOCKS,
    optimizer_bytes=2 * 144 * M * 4,
    optimizer_reason="Adam: 2 state(s) per parameter",
    input_bytes=MiB,
)


def profile(saved: int, kept: int, other: int, block_flops: int) -> ActivationProfile:
    return ActivationProfile(
        block_saved_bytes=(saved,) * BLOCKS,
        block_input_bytes=(kept,) * BLOCKS,
        before_saved_bytes=0,  # embeddings save nothing new here
        after_saved_bytes=other,  # the head's and the loss's
        largest_saved_bytes=saved // 4,
        block_forward_flops=(block_flops,) * BLOCKS,
        total_forward_flops=BLOCKS * block_flops + block_flops // 10,
        compute_dtype=torch.bfloat16,
    )


# Activations dominate (a long sequence): checkpointing decides whether it fits.
BIG_ACTIVATIONS = profile(256 * MiB, 16 * MiB, 64 * MiB, 10**12)
# Activations are small: model states decide.
SMALL_ACTIVATIONS = profile(8 * MiB, MiB, 2 * MiB, 10**12)
CPU = hardware_for("cpu", None, False)


def make_inputs(
    world_size: int,
    usable: int,
    prof: ActivationProfile | None = BIG_ACTIVATIONS,
    *,
    compute_bytes: int = 2,
    hardware: Hardware = CPU,
    num_nodes: int = 1,
    mixed_precision: Precision = Precision.BF16,
) -> PlanInputs:
    template = Setting(
        strategy=Strategy.LOCAL,
        checkpointed=0,
        world_size=world_size,
        compute_bytes=compute_bytes,
        param_element_bytes=4,
        device_type="cpu",
        cuda_context_pending=False,
    )
    return PlanInputs(
        stats=STATS,
        profile=prof,
        world_size=world_size,
        num_nodes=num_nodes,
        usable_bytes=usable,
        setting=template,
        hardware=hardware,
        num_blocks=BLOCKS,
        mixed_precision=mixed_precision,
        reasons=("a reason given beforehand",),
    )


def peak(inputs: PlanInputs, strategy: Strategy, k: int = 0) -> int:
    """What a candidate needs to fit: its estimated peak and what is kept free beside it."""
    c = candidate(inputs, strategy, k)
    return c.estimated_peak_bytes + c.reserve_bytes


def min_peak(inputs: PlanInputs, strategy: Strategy) -> int:
    return min(peak(inputs, strategy, k) for k in range(BLOCKS + 1))


def chosen_of(plan: Plan) -> Candidate:
    return next(
        c
        for c in plan.candidates
        if c.strategy == plan.strategy
        and c.activation_checkpointing == plan.activation_checkpointing
    )


# --- strategies_for ------------------------------------------------------------------------------


def test_strategies_for() -> None:
    assert strategies_for(1, False) == (Strategy.LOCAL,)
    # A process group of one rank: the wrappers work (a forced one is obeyed), LOCAL too.
    assert strategies_for(1, True) == (Strategy.LOCAL, *ALL)
    # One process without a group that prepare could give one: only a wrapper that helps alone
    # (CPU offload, on a GPU); on the CPU there is nothing to offload to.
    assert strategies_for(1, False, device_type="cuda", own_group=True) == (
        Strategy.LOCAL,
        Strategy.CPU_OFFLOAD,
    )
    assert strategies_for(1, False, device_type="cpu", own_group=True) == (Strategy.LOCAL,)
    assert strategies_for(1, True, device_type="cuda") == (
        Strategy.LOCAL,
        *ALL,
        Strategy.CPU_OFFLOAD,
    )
    assert strategies_for(8, False) == (Strategy.LOCAL,)  # not distributed: nothing to shard over
    assert strategies_for(2, True) == ALL
    assert strategies_for(8, True) == ALL


# --- decide --------------------------------------------------------------------------------------


def test_ample_memory_chooses_ddp_at_world_size_above_one() -> None:
    inputs = make_inputs(8, AMPLE)
    plan = decide(inputs, strategies_for(8, True), None, None)
    assert plan.strategy == Strategy.DDP
    assert plan.activation_checkpointing == 0
    assert plan.estimated_peak_bytes == peak(inputs, Strategy.DDP)
    assert plan.device_memory_bytes == AMPLE
    assert (plan.world_size, plan.num_blocks, plan.mixed_precision) == (8, BLOCKS, "bf16")
    assert plan.cpu_offload is False and plan.measured_peak_bytes is None
    # Everything fits, so no checkpointed alternative is listed: one row per strategy.
    assert [(c.strategy, c.activation_checkpointing) for c in plan.candidates] == [
        (s, 0) for s in ALL
    ]
    assert all(c.fits for c in plan.candidates)
    assert plan.reasons[0] == "a reason given beforehand"
    assert plan.reasons[-1].startswith("chose DDP")


@pytest.mark.parametrize(("world_size", "distributed"), [(1, True), (1, False), (8, False)])
def test_ample_memory_chooses_local_without_ranks_to_shard_over(
    world_size: int, distributed: bool
) -> None:
    inputs = make_inputs(world_size, AMPLE)
    plan = decide(inputs, strategies_for(world_size, distributed), None, None)
    assert plan.strategy == Strategy.LOCAL
    assert plan.activation_checkpointing == 0
    assert [c.strategy for c in plan.candidates] == [Strategy.LOCAL]


def test_between_full_shard_and_ddp_an_fsdp_strategy_is_chosen() -> None:
    probe = make_inputs(8, AMPLE, SMALL_ACTIVATIONS)
    low, high = peak(probe, Strategy.FULL_SHARD), min_peak(probe, Strategy.DDP)
    assert low < high  # the window exists for this model
    for usable in (low, (low + high) // 2, high - 1):
        plan = decide(make_inputs(8, usable, SMALL_ACTIVATIONS), ALL, None, None)
        assert plan.strategy in SHARDED, usable
        assert plan.estimated_peak_bytes <= usable
        assert not any(c.fits for c in plan.candidates if c.strategy == Strategy.DDP)
        assert "DDP" in plan.reasons[-1] and "do not fit" in plan.reasons[-1]


def test_shard_grad_op_when_it_fits_full_shard_when_only_it_fits() -> None:
    probe = make_inputs(8, AMPLE, SMALL_ACTIVATIONS)
    zero3 = peak(probe, Strategy.FULL_SHARD)
    zero2 = peak(probe, Strategy.SHARD_GRAD_OP)
    zero2_min = min_peak(probe, Strategy.SHARD_GRAD_OP)
    ddp_min = min_peak(probe, Strategy.DDP)
    assert zero3 < zero2_min and zero2 < ddp_min
    # ZeRO-2 fits (DDP does not): it is faster than ZeRO-3, so it is chosen.
    plan = decide(make_inputs(8, zero2, SMALL_ACTIVATIONS), ALL, None, None)
    assert (plan.strategy, plan.activation_checkpointing) == (Strategy.SHARD_GRAD_OP, 0)
    # Only ZeRO-3 fits.
    plan = decide(make_inputs(8, zero2_min - 1, SMALL_ACTIVATIONS), ALL, None, None)
    assert plan.strategy == Strategy.FULL_SHARD


@pytest.mark.parametrize("world_size", [1, 8])
def test_checkpoints_the_fewest_blocks_that_fit(world_size: int) -> None:
    strategies = strategies_for(world_size, True)
    probe = make_inputs(world_size, AMPLE)
    # Usable memory a little below the most frugal strategy's plain peak: no plain candidate fits.
    for target in (1, 3, 5):
        best = min(strategies, key=lambda s: peak(probe, s, target))
        usable = peak(probe, best, target)
        inputs = make_inputs(world_size, usable)
        plan = decide(inputs, strategies, None, None)
        chosen = chosen_of(plan)
        assert chosen.fits and chosen.activation_checkpointing >= 1
        assert not any(c.fits for c in plan.candidates if c.activation_checkpointing == 0)
        # k - 1 blocks checkpointed would not fit ...
        assert not candidate(inputs, chosen.strategy, chosen.activation_checkpointing - 1).fits
        # ... and no fitting candidate of any strategy and any k is faster.
        fitting = [candidate(inputs, s, k) for s in strategies for k in range(BLOCKS + 1)]
        fastest = min(c.step_seconds for c in fitting if c.fits)
        assert chosen.step_seconds == fastest
        assert f"with {chosen.activation_checkpointing} block(s) checkpointed" in plan.reasons[-1]


def test_local_checkpoints_exactly_as_many_blocks_as_the_memory_needs() -> None:
    probe = make_inputs(1, AMPLE)
    peaks = [peak(probe, Strategy.LOCAL, k) for k in range(BLOCKS + 1)]
    # By hand, in MiB (STATS: 144M fp32 params, Adam; BIG_ACTIVATIONS: each block saves 256 and
    # keeps 16, nothing before the blocks, 64 after them, largest saved tensor 64):
    params, grads, adam = 576, 576, 1152
    largest_unit_grads = 16 * 4  # LOCAL backward: a 16M-element unit's fp32 grads
    batch, backward_temp = 1, 2 * 64

    def activations(k: int) -> int:
        forward_end = 64 + BLOCKS * 256 - k * (256 - 16)  # checkpointed blocks keep 16 each
        recompute = 0 + 16 * (k - 1) + 256 if k else 0  # worst j = k - 1: inputs + its 256
        return max(forward_end, recompute)

    # all grads + Adam's foreach intermediates + the batch, which the caller's loop holds = 2881
    step = params + grads + adam + grads + batch
    for k in range(BLOCKS + 1):
        backward = params + largest_unit_grads + adam + batch + activations(k) + backward_temp
        tensors = max(backward, step) * MiB
        assert peaks[k] == tensors, k  # no overheads on the CPU
    # backward = 1921 + activations(k): 4033, 3793, 3553, 3313, 3073 for k = 0..4, then 2833 at
    # k = 5, below the step's 2881: from there on the optimizer step is the peak.
    assert 1921 + activations(4) > step > 1921 + activations(5)
    flat_from = 5
    # Non-increasing overall, strictly falling while backward dominates, then flat.
    assert all(a >= b for a, b in zip(peaks, peaks[1:], strict=False))
    assert all(a > b for a, b in zip(peaks[:flat_from], peaks[1 : flat_from + 1], strict=True))
    assert len(set(peaks[flat_from:])) == 1
    for k in range(1, BLOCKS + 1):
        plan = decide(make_inputs(1, peaks[k]), (Strategy.LOCAL,), None, None)
        # The fewest blocks that fit: k itself, or the first k of the flat stretch.
        assert (plan.strategy, plan.activation_checkpointing) == (
            Strategy.LOCAL,
            min(k, flat_from),
        )
        assert plan.estimated_peak_bytes == peaks[k]


REGIMES = {
    # CPU throughput, long forward: compute hides the traffic.
    "cpu-compute-bound": (hardware_for("cpu", None, False), 10**12, 2, 1),
    # Tiny forward: traffic dominates; fp32 compute dtype (no mixed precision).
    "cpu-comm-bound-fp32": (hardware_for("cpu", None, False), 10**3, 4, 1),
    # Tiny forward, bf16 compute dtype: ZeRO gathers bf16 parameters.
    "cpu-comm-bound-bf16": (hardware_for("cpu", None, True), 10**3, 2, 1),
    # H100-class figures, two nodes, a small batch.
    "cuda-two-nodes-bf16": (hardware_for("cuda", (9, 0), True), 10**9, 2, 2),
}


@pytest.mark.parametrize("regime", ["cpu-compute-bound", "cpu-comm-bound-fp32"])
def test_step_time_orders_ddp_then_zero2_then_zero3(regime: str) -> None:
    # Compute-bound, or communication-bound without mixed precision (ZeRO gathers fp32 params:
    # 4 + 4 bytes per parameter on the wire for ZeRO-2, against DDP's 2 x 4).
    hardware, block_flops, compute_bytes, nodes = REGIMES[regime]
    prof = profile(256 * MiB, 16 * MiB, 64 * MiB, block_flops)
    inputs = make_inputs(
        8, AMPLE, prof, compute_bytes=compute_bytes, hardware=hardware, num_nodes=nodes
    )
    for k in (0, 4, BLOCKS):
        ddp = step_seconds(inputs, Strategy.DDP, k)
        zero2 = step_seconds(inputs, Strategy.SHARD_GRAD_OP, k)
        zero3 = step_seconds(inputs, Strategy.FULL_SHARD, k)
        assert ddp <= zero2 <= zero3, (k, ddp, zero2, zero3)


def hand_step_seconds(regime: str, strategy: Strategy, k: int) -> float:
    """The cost model's step time for the 144M-parameter STATS at 8 ranks, written out."""
    hw, block_flops, compute_bytes, nodes = REGIMES[regime]
    forward = BLOCKS * block_flops + block_flops // 10  # the blocks + the rest (profile())
    compute = (3 * forward + k * block_flops) / hw.flops_per_s  # fwd + bwd (2x) + recompute
    ring = 7 / 8  # a ring over N = 8 ranks moves (N - 1) / N of the payload per pass
    bandwidth = hw.inter_node_bytes_per_s if nodes > 1 else hw.intra_node_bytes_per_s
    grads = 144 * M * 4  # fp32 gradients, all-reduced or reduce-scattered
    gathered = 144 * M * compute_bytes  # parameters all-gathered in the compute dtype
    units = BLOCKS + 1  # FSDP units: each block and the root
    if strategy == Strategy.DDP:
        buckets = -(-grads // (25 * MiB))  # 576 MiB in 25 MiB buckets: 24 all-reduces
        traffic = 2 * grads * ring / bandwidth  # all-reduce: reduce-scatter + all-gather
        return max(compute, traffic) + buckets * hw.collective_latency_s
    passes = 1 if strategy == Strategy.SHARD_GRAD_OP else 2  # ZeRO-3 gathers again in backward
    traffic = (passes * gathered + grads) * ring / bandwidth
    copies = 2 * passes * gathered / hw.memory_bytes_per_s  # FSDP2 copy-in/copy-out
    launches = (passes + 1) * units * hw.collective_latency_s  # all-gathers + reduce-scatter
    # FSDP2's host work: every unit's, and each all-gather's (the root gathers once)
    launches += units * hw.fsdp_unit_s + (BLOCKS * passes + 1) * hw.fsdp_gather_s
    return max(compute, traffic) + copies + launches


@pytest.mark.parametrize("regime", ["cpu-comm-bound-bf16", "cuda-two-nodes-bf16"])
def test_step_time_when_bf16_traffic_dominates(regime: str) -> None:
    # Under bf16 mixed precision ZeRO-2 sends 2 (bf16 all-gather) + 4 (fp32 reduce-scatter)
    # = 6 bytes per parameter, DDP all-reduces fp32 gradients, 2 x 4 = 8 bytes: when the step is
    # communication-bound ZeRO-2 models faster than DDP. ZeRO-3 gathers twice: 2 + 2 + 4 = 8.
    hardware, block_flops, compute_bytes, nodes = REGIMES[regime]
    prof = profile(256 * MiB, 16 * MiB, 64 * MiB, block_flops)
    inputs = make_inputs(
        8, AMPLE, prof, compute_bytes=compute_bytes, hardware=hardware, num_nodes=nodes
    )
    # FSDP2's own host work (none assumed on the CPU, whose collective latency holds it) can
    # outweigh the traffic saved at this size on a GPU (it does at k = 0): without it, the
    # traffic decides
    traffic_only = replace(inputs, hardware=replace(hardware, fsdp_unit_s=0.0, fsdp_gather_s=0.0))
    for k in (0, 4, BLOCKS):
        times = {s: step_seconds(inputs, s, k) for s in ALL}
        for strategy, seconds in times.items():
            assert math.isclose(seconds, hand_step_seconds(regime, strategy, k), rel_tol=1e-12)
        assert times[Strategy.SHARD_GRAD_OP] <= times[Strategy.FULL_SHARD], (k, times)
        zero2, ddp = (
            step_seconds(traffic_only, s, k) for s in (Strategy.SHARD_GRAD_OP, Strategy.DDP)
        )
        assert zero2 < ddp, (k, zero2, ddp)


def test_step_time_cpu_bf16_by_the_numbers() -> None:
    # CPU figures: 2e9 B/s between ranks, 1e10 B/s memory, 4e-3 s per collective; 1e3 FLOPs per
    # block makes compute negligible (3 * 8100 / 5e10 s).
    inputs = make_inputs(
        8,
        AMPLE,
        profile(256 * MiB, 16 * MiB, 64 * MiB, 10**3),
        hardware=hardware_for("cpu", None, True),
    )
    # DDP: 2 x 576 MiB x 7/8 / 2e9 = 0.528482304 s + 24 buckets x 4e-3.
    assert math.isclose(step_seconds(inputs, Strategy.DDP, 0), 0.528482304 + 0.096)
    # ZeRO-2: (288 + 576) MiB x 7/8 / 2e9 = 0.396361728 s + copies 2 x 288 MiB / 1e10
    # = 0.0603979776 s + 2 x 9 launches x 4e-3.
    assert math.isclose(
        step_seconds(inputs, Strategy.SHARD_GRAD_OP, 0), 0.396361728 + 0.0603979776 + 0.072
    )
    # ZeRO-3: (2 x 288 + 576) MiB x 7/8 / 2e9 = 0.528482304 s + copies 4 x 288 MiB / 1e10
    # = 0.1207959552 s + 3 x 9 launches x 4e-3.
    assert math.isclose(
        step_seconds(inputs, Strategy.FULL_SHARD, 0), 0.528482304 + 0.1207959552 + 0.108
    )


@pytest.mark.parametrize("regime", list(REGIMES))
def test_more_checkpointing_is_never_faster(regime: str) -> None:
    hardware, block_flops, compute_bytes, nodes = REGIMES[regime]
    prof = profile(256 * MiB, 16 * MiB, 64 * MiB, block_flops)
    inputs = make_inputs(
        8, AMPLE, prof, compute_bytes=compute_bytes, hardware=hardware, num_nodes=nodes
    )
    for strategy in (Strategy.LOCAL, *ALL):
        times = [step_seconds(inputs, strategy, k) for k in range(BLOCKS + 1)]
        assert times == sorted(times), strategy


def test_more_checkpointing_is_slower_when_compute_bound() -> None:
    inputs = make_inputs(8, AMPLE)  # CPU figures, 1e12 FLOPs per block: compute-bound
    for strategy in (Strategy.LOCAL, *ALL):
        times = [step_seconds(inputs, strategy, k) for k in range(BLOCKS + 1)]
        assert all(a < b for a, b in zip(times, times[1:], strict=False)), strategy
        # Each checkpointed block costs one more forward of it at the modelled throughput.
        extra = BIG_ACTIVATIONS.block_forward_flops[0] / CPU.flops_per_s
        assert math.isclose(times[1] - times[0], extra, rel_tol=1e-9)


def test_forced_strategy_is_obeyed_when_it_does_not_fit() -> None:
    probe = make_inputs(8, AMPLE)
    usable = peak(probe, Strategy.FULL_SHARD)  # FULL_SHARD fits; DDP does not, even with AC
    assert min_peak(probe, Strategy.DDP) > usable
    inputs = make_inputs(8, usable)
    plan = decide(inputs, ALL, Strategy.DDP, None)
    assert plan.strategy == Strategy.DDP
    chosen = chosen_of(plan)
    assert not chosen.fits
    # The most frugal DDP: the smallest peak over every number of checkpointed blocks.
    assert plan.estimated_peak_bytes == min_peak(probe, Strategy.DDP)
    assert "strategy DDP forced by the caller" in plan.reasons
    warning = next(r for r in plan.reasons if r.startswith("warning:"))
    assert "DDP" in warning
    assert human(plan.estimated_peak_bytes) in warning and human(usable) in warning


def test_forced_strategy_that_fits_is_obeyed_without_warning() -> None:
    plan = decide(make_inputs(8, AMPLE), ALL, Strategy.FULL_SHARD, None)
    assert (plan.strategy, plan.activation_checkpointing) == (Strategy.FULL_SHARD, 0)
    assert [c.strategy for c in plan.candidates] == [Strategy.FULL_SHARD]  # the only candidate
    assert "strategy FULL_SHARD forced by the caller" in plan.reasons
    assert not any(r.startswith("warning") for r in plan.reasons)


def test_forced_checkpointing_is_obeyed_by_every_candidate() -> None:
    plan = decide(make_inputs(8, AMPLE), ALL, None, 3)
    assert plan.activation_checkpointing == 3
    assert {c.activation_checkpointing for c in plan.candidates} == {3}
    assert plan.strategy == Strategy.DDP
    # Where only more blocks than forced would fit, no frugal alternative is tried: nothing fits.
    probe = make_inputs(8, AMPLE)
    usable = peak(probe, Strategy.FULL_SHARD, 4)
    assert not any(candidate(make_inputs(8, usable), s, 2).fits for s in ALL)
    with pytest.raises(DoesNotFit, match="2/8 blocks checkpointed"):
        decide(make_inputs(8, usable), ALL, None, 2)


@pytest.mark.parametrize("forced", ALL)
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_forced_wrapper_without_a_process_group_is_a_value_error(
    forced: Strategy, device_type: str
) -> None:
    # a group of its own only for what helps one process alone: these need peers to mean anything
    job = Job(1, False, 1, device_type, own_group=True)
    with pytest.raises(ValueError, match="needs a process group.*torchrun"):
        check_forced(available(job), forced, job)
    with pytest.raises(ValueError, match=f"strategy {forced} cannot train this job"):
        decide(make_inputs(1, AMPLE), available(job), forced, None)


@pytest.mark.parametrize("forced", ALL)
def test_forced_wrapper_on_a_one_rank_group_is_obeyed(forced: Strategy) -> None:
    plan = decide(make_inputs(1, AMPLE), strategies_for(1, True), forced, None)
    assert plan.strategy == forced
    assert [c.strategy for c in plan.candidates] == [forced]
    assert f"strategy {forced} forced by the caller" in plan.reasons


def test_nothing_fits_raises_does_not_fit_with_the_missing_amount() -> None:
    usable = 64 * MiB
    inputs = make_inputs(8, usable)
    with pytest.raises(DoesNotFit) as info:
        decide(inputs, ALL, None, None)
    error = info.value
    assert isinstance(error, ValueError)  # callers catching ValueError see it too
    best = min(min_peak(inputs, s) for s in ALL)
    assert error.missing_bytes == best - usable
    frugal = min(
        (candidate(inputs, s, k) for s in ALL for k in range(BLOCKS + 1)),
        key=lambda c: c.estimated_peak_bytes + c.reserve_bytes,
    )
    message = str(error)
    assert f"{human(best - usable)} missing" in message
    assert human(frugal.estimated_peak_bytes) in message and human(usable) in message
    assert f"and {human(frugal.reserve_bytes)} kept free" in message
    assert "FULL_SHARD" in message  # the most frugal candidate is named
    assert "smaller per-rank batch" in message  # what would help
    assert "more ranks" in message
    assert "memory_limit" in message


def test_nothing_fits_names_the_candidates_left_out_as_crashing() -> None:
    """DoesNotFit weighs only the candidates offered: those whose step would crash are named, so
    that "no strategy fits" does not read as if FULL_SHARD had been weighed too."""
    crashed = {(Strategy.FULL_SHARD, False): "ValueError: shared with another FSDP group"}
    inputs = replace(make_inputs(8, MiB, None), crashed=crashed)
    with pytest.raises(DoesNotFit) as info:
        decide(inputs, ALL, None, None)
    message = str(info.value)
    assert "not offered, as their step fails" in message, message
    assert "FULL_SHARD (ValueError: shared with another FSDP group)" in message, message
    with pytest.raises(DoesNotFit) as plain:
        decide(make_inputs(8, MiB, None), ALL, None, None)
    assert "not offered" not in str(plain.value)


def test_nothing_fits_without_a_profile() -> None:
    with pytest.raises(DoesNotFit, match="missing"):
        decide(make_inputs(1, MiB, None), (Strategy.LOCAL,), None, None)


def test_candidates_are_not_listed_twice() -> None:
    # No trace (no example batch): checkpointing cannot be estimated, so the "frugal" alternative
    # of a candidate that does not fit is the same candidate.
    plan = decide(make_inputs(8, MiB, None), ALL, Strategy.FULL_SHARD, None)
    keys = [(c.strategy, c.activation_checkpointing) for c in plan.candidates]
    assert len(keys) == len(set(keys)), keys
    assert sum(line.startswith("* ") for line in str(plan).splitlines()) == 1


# --- rendering -----------------------------------------------------------------------------------

HEADER = [
    "candidate",
    "AC",
    "params",
    "grads",
    "optim",
    "activ",
    "comm",
    "temp",
    "wksp",
    "other",
    "peak",
    "step",
    "fits",
]


def test_str_plan_renders_a_table_of_every_candidate() -> None:
    probe = make_inputs(8, AMPLE)
    plan = decide(make_inputs(8, peak(probe, Strategy.FULL_SHARD, 2)), ALL, None, None)
    assert len(plan.candidates) == 6  # each strategy plain, and its frugal alternative
    lines = str(plan).splitlines()
    assert lines[0].startswith("autoshard plan: ")
    assert str(plan.strategy) in lines[0] and "world size 8" in lines[0]
    assert f"{plan.activation_checkpointing}/{BLOCKS} blocks" in lines[0]
    assert "usable memory per rank" in lines[1] and "measured" not in lines[1]
    header = lines[2]
    assert header.split() == HEADER
    rows = lines[3 : 3 + len(plan.candidates)]
    marked = [row for row in rows if row.startswith("* ")]
    assert len(marked) == 1
    for row, c in zip(rows, plan.candidates, strict=True):
        cells = row.lstrip("* ").split()
        assert len(cells) == len(HEADER)
        assert cells[0] == str(c.strategy)
        assert cells[1] == f"{c.activation_checkpointing}/{BLOCKS}"
        assert cells[8] == f"{c.footprint.workspace / GiB:.2f}"
        assert cells[10] == f"{c.estimated_peak_bytes / GiB:.2f}"
        # no activation alive at the peak (the optimizer step's): "-", not a misleading 0.00
        activ = "-" if c.footprint.activations == 0 else f"{c.footprint.activations / GiB:.2f}"
        assert cells[5] == activ
        assert cells[11].endswith("ms")
        assert cells[12] == ("yes" if c.fits else "no")
        is_chosen = c == chosen_of(plan)
        assert row.startswith("* ") == is_chosen
    assert any(c.fits for c in plan.candidates) and not all(c.fits for c in plan.candidates)
    tail = lines[3 + len(plan.candidates) :]
    legend = tail[: next(i for i, line in enumerate(tail) if line.startswith("- "))]
    reasons = tail[len(legend) :]
    # the columns explained under the table, so that it reads without the README
    assert legend[0].startswith("GiB per rank at each candidate's estimated peak")  # > 1 GiB here
    for term in (
        "activ:",
        "comm:",
        "temp:",
        "wksp:",
        "other:",
        "'-': the peak is the optimizer step",
    ):
        assert term in " ".join(legend)
    assert " ".join(" ".join(reasons).split()) == " ".join(f"- {r}" for r in plan.reasons)
    assert len([line for line in reasons if line.startswith("- ")]) == len(plan.reasons)
    assert max(map(len, lines)) <= 100, max(lines, key=len)


def test_str_plan_shows_the_measured_peak_and_the_trials() -> None:
    plan = decide(make_inputs(1, AMPLE), (Strategy.LOCAL,), None, None)
    plan = dataclasses.replace(
        plan,
        measured_peak_bytes=3 * GiB,
        attempts=(
            Attempt(Strategy.DDP, 0, Outcome.OUT_OF_MEMORY, 5 * GiB, None, (0, 1)),
            Attempt(Strategy.FULL_SHARD, 2, Outcome.OUT_OF_MEMORY, None, None, (1,)),
            Attempt(Strategy.LOCAL, 0, Outcome.FIT, 3 * GiB, 0.104),
        ),
    )
    text = str(plan)
    lines = text.splitlines()
    assert "measured 3.00 GiB" in lines[1]
    trials = [line for line in lines if line.startswith("trial: ")]
    assert trials == [
        "trial: DDP AC 0: out of memory on rank(s) [0, 1], measured peak 5.00 GiB",
        "trial: FULL_SHARD AC 2: out of memory on rank(s) [1]",
        "trial: LOCAL AC 0: fit (0.10s), measured peak 3.00 GiB",
    ]


def test_to_dict_carries_the_attempts_typed_fields_as_json_types() -> None:
    plan = decide(make_inputs(1, AMPLE), (Strategy.LOCAL,), None, None)
    attempts = (
        Attempt(Strategy.DDP, 1, Outcome.OUT_OF_MEMORY, 5 * GiB, None, (1,)),
        Attempt(Strategy.LOCAL, 0, Outcome.FIT, 3 * GiB, 0.25),
    )
    plan = dataclasses.replace(plan, attempts=attempts)
    decoded = json.loads(json.dumps(plan.to_dict()))["attempts"]
    assert decoded == [
        {
            "strategy": "ddp",
            "activation_checkpointing": 1,
            "outcome": "out_of_memory",
            "measured_peak_bytes": 5 * GiB,
            "seconds": None,
            "out_of_memory_ranks": [1],
        },
        {
            "strategy": "local",
            "activation_checkpointing": 0,
            "outcome": "fit",
            "measured_peak_bytes": 3 * GiB,
            "seconds": 0.25,
            "out_of_memory_ranks": [],
        },
    ]
    rebuilt = tuple(
        Attempt(
            Strategy(a["strategy"]),
            a["activation_checkpointing"],
            Outcome(a["outcome"]),
            a["measured_peak_bytes"],
            a["seconds"],
            tuple(a["out_of_memory_ranks"]),
        )
        for a in decoded
    )
    assert rebuilt == attempts
    assert attempts[1].outcome == "fit" and attempts[0].outcome is Outcome.OUT_OF_MEMORY


# --- autoshard.plan: what-if, one process, no process group --------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Tower(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture
def tower() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = Tower()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(4, 8)


def test_a_compiled_model_is_planned_and_prepared_as_the_model_it_compiles(
    tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor],
) -> None:
    """`torch.compile(model)` hands autoshard an OptimizedModule: its blocks are found under it,
    every estimate is the model's own, and dynamo's warning about global module hooks (the
    trackers' during planning, printed once per rank) is not passed on. (Dynamo runs nothing
    under autoshard's dispatch modes: no compiler is needed here.)"""
    import warnings

    model, optimizer, batch = tower
    compiled = torch.compile(model)
    options = dict(world_size=2, mixed_precision="no")
    plain = autoshard.plan(model, optimizer, batch, **options)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = autoshard.plan(compiled, optimizer, batch, **options)  # type: ignore[arg-type]
        wrapped, _, prepared = autoshard.prepare(compiled, optimizer, batch, mixed_precision="no")
    assert not [w for w in caught if "global hooks" in str(w.message)], [
        str(w.message) for w in caught
    ]
    assert planned.num_blocks == plain.num_blocks == 4
    assert [(c.strategy, c.estimated_peak_bytes) for c in planned.candidates] == [
        (c.strategy, c.estimated_peak_bytes) for c in plain.candidates
    ]
    assert wrapped is compiled and prepared.strategy == Strategy.LOCAL
    alone = autoshard.plan(model, optimizer, batch, world_size=1, mixed_precision="no")
    assert prepared.estimated_peak_bytes == alone.estimated_peak_bytes
    assert prepared.measured_peak_bytes is not None  # its trial step ran


def test_plan_what_if_eight_ranks(
    tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor],
) -> None:
    model, optimizer, batch = tower
    before = [p.detach().clone() for p in model.parameters()]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = autoshard.plan(model, optimizer, batch, world_size=8, device_memory="80GiB")
    assert isinstance(plan, autoshard.Plan)
    assert plan.world_size == 8
    assert plan.device_memory_bytes == 80 * GiB
    assert plan.num_blocks == 4
    assert plan.strategy == Strategy.DDP  # a small model: everything fits, DDP is fastest
    by_strategy = {c.strategy: c for c in plan.candidates}
    assert set(by_strategy) == set(ALL)
    # rank 0's FSDP2 shard: torch.chunk gives it ceil(rows / 8) rows of every parameter
    shard = sum(-(-p.shape[0] // 8) * p[0].numel() * p.element_size() for p in model.parameters())
    assert total // 8 <= shard < total // 8 + 1024
    assert by_strategy[Strategy.FULL_SHARD].footprint.params == shard
    assert by_strategy[Strategy.SHARD_GRAD_OP].footprint.params == shard
    assert by_strategy[Strategy.DDP].footprint.params == total
    # Nothing was touched.
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param, old) and param.grad is None
    assert not optimizer.state


def test_plan_what_if_one_rank_is_local(
    tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor],
) -> None:
    model, optimizer, batch = tower
    plan = autoshard.plan(model, optimizer, batch, world_size=1, device_memory="80GiB")
    assert plan.strategy == Strategy.LOCAL
    assert [c.strategy for c in plan.candidates] == [Strategy.LOCAL]


def test_plan_memory_limit_caps_device_memory(
    tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor],
) -> None:
    model, optimizer, batch = tower
    plan = autoshard.plan(
        model, optimizer, batch, world_size=8, device_memory="80GiB", memory_limit="1GiB"
    )
    assert plan.device_memory_bytes == GiB
    assert any("capped by memory_limit" in r for r in plan.reasons)


def test_plan_what_if_does_not_fit(
    tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor],
) -> None:
    model, optimizer, batch = tower
    with pytest.raises(DoesNotFit, match="missing"):
        autoshard.plan(model, optimizer, batch, world_size=2, device_memory=1024)


@pytest.mark.parametrize("world_size", [0, -2, True, 2.0, "8"])
def test_plan_rejects_a_bad_world_size(
    world_size: object, tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]
) -> None:
    model, optimizer, batch = tower
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        autoshard.plan(model, optimizer, batch, world_size=world_size, device_memory="80GiB")  # type: ignore[arg-type]


def test_plan_rejects_a_bad_device_memory(
    tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor],
) -> None:
    model, optimizer, batch = tower
    with pytest.raises(ValueError, match="device_memory='lots'"):
        autoshard.plan(model, optimizer, batch, world_size=8, device_memory="lots")


@pytest.mark.parametrize("strategy", ["ddp", "shard_grad_op", "full_shard"])
def test_plan_forcing_a_wrapper_on_one_rank_plans_a_one_rank_group(
    strategy: str, tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]
) -> None:
    model, optimizer, batch = tower
    plan = autoshard.plan(
        model, optimizer, batch, world_size=1, device_memory="80GiB", strategy=strategy
    )
    assert plan.strategy == Strategy(strategy)
    assert plan.world_size == 1
    assert [c.strategy for c in plan.candidates] == [Strategy(strategy)]
    assert f"strategy {Strategy(strategy)} forced by the caller" in plan.reasons
    # One rank: a "shard" is the whole model.
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan.candidates[0].footprint.params == total


def test_plan_forcing_a_strategy_what_if(
    tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor],
) -> None:
    model, optimizer, batch = tower
    plan = autoshard.plan(
        model, optimizer, batch, world_size=8, device_memory="80GiB", strategy="full_shard"
    )
    assert plan.strategy == Strategy.FULL_SHARD
    assert "strategy FULL_SHARD forced by the caller" in plan.reasons


# ---------------------------------------------------------------------------------------------
# Multi-node: HYBRID_SHARD; and CPU offload as the last rung on GPU (what-if plans, no GPU here)


def test_two_nodes_of_four_add_hybrid_shard_sharded_within_a_node() -> None:
    # built on meta: a what-if plan needs only shapes (16M parameters per block, no memory)
    with torch.device("meta"):
        model = Tower(width=2048, depth=4)
        batch = torch.randn(4, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    plan = autoshard.plan(
        model, optimizer, batch, world_size=8, num_nodes=2, device="cuda", device_memory="80GiB"
    )
    by_strategy = {c.strategy: c for c in plan.candidates}
    assert Strategy.HYBRID_SHARD in by_strategy
    # sharded over the 4 ranks of a node, not all 8
    shard4 = sum(-(-p.shape[0] // 4) * p[0].numel() * p.element_size() for p in model.parameters())
    shard8 = sum(-(-p.shape[0] // 8) * p[0].numel() * p.element_size() for p in model.parameters())
    assert by_strategy[Strategy.HYBRID_SHARD].footprint.params == shard4
    assert by_strategy[Strategy.FULL_SHARD].footprint.params == shard8
    # parameter traffic stays inside a node: faster than a flat FULL_SHARD across nodes
    assert (
        by_strategy[Strategy.HYBRID_SHARD].step_seconds
        < by_strategy[Strategy.FULL_SHARD].step_seconds
    )


def test_hybrid_is_chosen_over_full_shard_when_only_sharding_fits() -> None:
    """A model whose state needs sharding: across 2 nodes x 4 HYBRID fits and beats a flat
    FULL_SHARD (inter-node links are the slow ones)."""
    with torch.device("meta"):
        model = Tower(width=2048, depth=4)
        batch = torch.randn(4, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    ddp = autoshard.plan(
        model, optimizer, batch, world_size=8, num_nodes=2, device="cuda", device_memory="80GiB"
    )
    ddp_peak = next(c for c in ddp.candidates if c.strategy == Strategy.DDP).estimated_peak_bytes
    hybrid_peak = next(
        c for c in ddp.candidates if c.strategy == Strategy.HYBRID_SHARD
    ).estimated_peak_bytes
    # a limit between HYBRID's peak and DDP's: DDP does not fit, HYBRID does
    limit = (ddp_peak + hybrid_peak) // 2
    plan = autoshard.plan(
        model,
        optimizer,
        batch,
        world_size=8,
        num_nodes=2,
        device="cuda",
        device_memory="80GiB",
        memory_limit=limit,
    )
    assert plan.strategy == Strategy.HYBRID_SHARD, str(plan)


def test_hybrid_needs_more_than_one_node(
    tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor],
) -> None:
    model, optimizer, batch = tower
    plan = autoshard.plan(model, optimizer, batch, world_size=8, device_memory="80GiB")
    assert Strategy.HYBRID_SHARD not in {c.strategy for c in plan.candidates}
    with pytest.raises(ValueError, match="HYBRID_SHARD.*1 node"):
        autoshard.plan(
            model, optimizer, batch, world_size=8, device_memory="80GiB", strategy="hybrid_shard"
        )


def test_cpu_offload_is_the_last_rung_on_gpu() -> None:
    torch.manual_seed(0)
    model = Tower(width=256, depth=4)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(4, 8)
    common = dict(world_size=2, device="cuda", device_memory="80GiB", host_memory="64GiB")
    free = autoshard.plan(model, optimizer, batch, **common)
    assert free.strategy != Strategy.CPU_OFFLOAD and not free.cpu_offload
    offload = next(c for c in free.candidates if c.strategy == Strategy.CPU_OFFLOAD)
    others = [c for c in free.candidates if c.strategy != Strategy.CPU_OFFLOAD]
    assert offload.footprint.params == offload.footprint.optimizer_state == 0
    assert offload.host_bytes > 0
    assert offload.step_seconds > max(c.step_seconds for c in others)  # PCIe and a CPU step
    # a device limit only offload fits under
    limit = (offload.estimated_peak_bytes + min(c.estimated_peak_bytes for c in others)) // 2
    assert offload.estimated_peak_bytes < limit < min(c.estimated_peak_bytes for c in others)
    plan = autoshard.plan(model, optimizer, batch, memory_limit=limit, **common)
    assert plan.strategy == Strategy.CPU_OFFLOAD and plan.cpu_offload


def test_does_not_fit_with_offload_says_what_host_memory_is_missing() -> None:
    torch.manual_seed(0)
    model = Tower(width=256, depth=4)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(4, 8)
    free = autoshard.plan(
        model, optimizer, batch, world_size=2, device="cuda", device_memory="80GiB"
    )
    offload = next(c for c in free.candidates if c.strategy == Strategy.CPU_OFFLOAD)
    with pytest.raises(DoesNotFit) as caught:
        autoshard.plan(
            model,
            optimizer,
            batch,
            world_size=2,
            device="cuda",
            device_memory="80GiB",
            # offload alone fits the device
            memory_limit=offload.estimated_peak_bytes + offload.reserve_bytes + 1024,
            host_memory=offload.host_bytes // 2,  # but not the host
        )
    message = str(caught.value)
    assert "host memory" in message and "CPU_OFFLOAD" in message
    assert caught.value.missing_bytes == offload.host_bytes - offload.host_bytes // 2


def test_cpu_offload_is_refused_on_cpu(
    tower: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor],
) -> None:
    model, optimizer, batch = tower
    with pytest.raises(ValueError, match="CPU_OFFLOAD.*CPU"):
        autoshard.plan(model, optimizer, batch, world_size=2, device="cpu", strategy="cpu_offload")


def test_fsdp_keeps_one_units_sharded_gradient_free() -> None:
    """FSDP2 candidates fit only with the largest unit's sharded gradient free beside their
    estimated peak (a reduce-scatter's output may come before its input is freed); DDP's
    reduce is in place."""
    probe = make_inputs(8, AMPLE, SMALL_ACTIVATIONS)
    largest = max((*STATS.block_numel, STATS.root_numel))
    element = STATS.param_bytes / STATS.floating_numel
    for strategy in SHARDED:
        c = candidate(probe, strategy, 0)
        assert c.reserve_bytes == round(-(-largest // 8) * element) > 0
        tight = make_inputs(8, c.estimated_peak_bytes, SMALL_ACTIVATIONS)
        assert not candidate(tight, strategy, 0).fits
        enough = make_inputs(8, c.estimated_peak_bytes + c.reserve_bytes, SMALL_ACTIVATIONS)
        assert candidate(enough, strategy, 0).fits
    assert candidate(probe, Strategy.DDP, 0).reserve_bytes == 0
    plan = decide(
        make_inputs(8, peak(probe, Strategy.SHARD_GRAD_OP), SMALL_ACTIVATIONS), ALL, None, None
    )
    assert plan.strategy == Strategy.SHARD_GRAD_OP
    assert "kept free beside it" in plan.reasons[-1]


class _SkipsLayers(nn.Module):
    """LayerDrop as transformers' M2M100 and SpeechT5 keep it: a probability in `layerdrop`."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if not (self.training and torch.rand([]) < self.layerdrop):
                x = torch.tanh(block(x))
        return x.square().mean()


def test_a_model_that_skips_layers_at_random_is_not_sharded_over_several_ranks() -> None:
    """A rank that skips a block neither gathers its parameters in backward nor reduce-scatters
    its gradients, while the others do: on 2 gloo ranks, a FULL_SHARD step in which one rank
    skipped a block aborted with "Is there a distributed collective mismatch" (torch 2.13,
    2026-11-28); NCCL would hang. DDP trains it (test_distributed's LayerDrop case)."""
    model = _SkipsLayers(0.1)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(8, 64)
    plan = autoshard.plan(model, optimizer, batch, world_size=4, mixed_precision="no")
    assert {c.strategy for c in plan.candidates} == {Strategy.DDP}, plan
    assert any(
        "FSDP2, whose collectives every rank must join, is not weighed" in r for r in plan.reasons
    )
    for forced in ("full_shard", "shard_grad_op"):
        with pytest.raises(
            ValueError,
            match=f"strategy {forced.upper()} shards each block .* "
            r"\('layerdrop' is 0.1\), each rank its own.*Use 'ddp'",
        ):
            autoshard.plan(model, optimizer, batch, world_size=4, strategy=forced)
    with pytest.raises(ValueError, match="strategy HYBRID_SHARD shards each block"):
        autoshard.plan(model, optimizer, batch, world_size=4, num_nodes=2, strategy="hybrid_shard")
    # with the probability at 0, or one rank alone, every rank runs every block: sharded again
    model.layerdrop = 0.0
    plain = autoshard.plan(model, optimizer, batch, world_size=4, mixed_precision="no")
    assert Strategy.FULL_SHARD in {c.strategy for c in plain.candidates}
    model.layerdrop = 0.1
    job = Job(1, True, 1, "cuda", skips_layers="'layerdrop' is 0.1")
    assert Strategy.CPU_OFFLOAD in available(job)


class _SparseTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(512, 32, mode="sum", sparse=True)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.table(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.square().mean()


def test_a_model_with_sparse_gradients_is_not_sharded() -> None:
    """FSDP2 reduce-scatters each gradient as a dense tensor (`fsdp::chunk_cat` has no sparse
    kernel): a held-out sweep's DLRM-style model was given FULL_SHARD under a memory limit and
    its trial step raised "Could not run 'fsdp::chunk_cat' with arguments from the 'SparseCPU'
    backend". Sparse gradients train under DDP."""
    model = _SparseTable()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(512, (8, 4))
    plan = autoshard.plan(model, optimizer, ids, world_size=2, mixed_precision="no")
    assert {c.strategy for c in plan.candidates} == {Strategy.DDP}, plan
    note = "'table' (EmbeddingBag, sparse=True) makes sparse gradients"
    assert any(r.startswith(note) for r in plan.reasons), plan.reasons
    with pytest.raises(ValueError, match=r"strategy FULL_SHARD .* 'table' \(EmbeddingBag, spar"):
        autoshard.plan(model, optimizer, ids, world_size=2, strategy="full_shard")
    model.table.sparse = False
    dense = autoshard.plan(model, optimizer, ids, world_size=2, mixed_precision="no")
    assert Strategy.FULL_SHARD in {c.strategy for c in dense.candidates}


def test_what_helps_a_job_fsdp2_cannot_train_names_no_full_shard() -> None:
    """Nothing fits: the advice said that more ranks shrink the model's state under FULL_SHARD,
    which this job can never use; DDP keeps the state whole on every rank."""
    model = _SparseTable()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(512, (8, 4))
    options = dict(world_size=2, mixed_precision="no", device_memory="16KiB")
    with pytest.raises(DoesNotFit) as sparse:
        autoshard.plan(model, optimizer, ids, **options)  # type: ignore[arg-type]
    assert "under FULL_SHARD" not in str(sparse.value), sparse.value
    assert (
        "do not shrink with more ranks here: FSDP2 cannot shard this job over several ranks "
        "('table' (EmbeddingBag, sparse=True) makes sparse gradients"
    ) in str(sparse.value)
    model.table.sparse = False  # the control: FSDP2 weighed, and more ranks would help
    with pytest.raises(DoesNotFit) as dense:
        autoshard.plan(model, optimizer, ids, **options)  # type: ignore[arg-type]
    assert "shrink with more ranks (GPUs) under FULL_SHARD" in str(dense.value), dense.value


def test_an_embedding_renormalised_in_the_forward_is_not_sharded() -> None:
    """`nn.Embedding(max_norm=...)` writes the rows it looks up in place (embedding_renorm_): under
    FSDP2 into the gathered copy, lost at reshard. A held-out sweep's model trained on under
    FULL_SHARD with no error, its loss drifting from eager's from the second step (1.34857
    against 1.32803 at the eighth)."""
    model = _SparseTable()
    model.table = nn.EmbeddingBag(512, 32, mode="sum", max_norm=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(512, (8, 4))
    plan = autoshard.plan(model, optimizer, ids, world_size=2, mixed_precision="no")
    assert {c.strategy for c in plan.candidates} == {Strategy.DDP}, plan
    assert any(r.startswith("'table' (max_norm=1.0) renormalises") for r in plan.reasons)
    with pytest.raises(ValueError, match="strategy FULL_SHARD cannot train this job: 'table'"):
        autoshard.plan(model, optimizer, ids, world_size=2, strategy="full_shard")


def test_parameters_another_optimizer_trains_keep_the_model_off_fsdp2() -> None:
    """A GAN's discriminator trained by an optimizer of its own, built before prepare: FSDP2
    replaces every parameter with its shard, and that optimizer went on updating the old ones,
    so the discriminator never trained, silently (a held-out sweep). DDP keeps the parameters."""
    model = _SparseTable()
    model.table = nn.EmbeddingBag(512, 32, mode="sum")
    optimizer = torch.optim.SGD(model.blocks[0].parameters(), lr=0.1)  # blocks.1: another's
    ids = torch.randint(512, (8, 4))
    plan = autoshard.plan(model, optimizer, ids, world_size=2, mixed_precision="no")
    assert {c.strategy for c in plan.candidates} == {Strategy.DDP}, plan
    said = "3 trainable parameter(s) are in no optimizer given to prepare (e.g. 'table.weight')"
    assert any(r.startswith(said) for r in plan.reasons), plan.reasons
    with torch.no_grad():
        for p in [*model.table.parameters(), *model.blocks[1].parameters()]:
            p.requires_grad_(False)
    frozen = autoshard.plan(model, optimizer, ids, world_size=2, mixed_precision="no")
    assert Strategy.FULL_SHARD in {c.strategy for c in frozen.candidates}
