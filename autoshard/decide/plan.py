"""From estimates to a decision: candidates, the cost model, and the Plan. Pure: no process group,
no module is touched, so the whole decision table is testable in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from autoshard._units import human
from autoshard.decide.estimate import (
    Footprint,
    ModelStats,
    Setting,
    Simulated,
    estimate,
    host_bytes,
)
from autoshard.decide.fit import DoesNotFit, shortfall

# re-exported: the cost model's inputs are imported from here (Throughput, hardware_for)
from autoshard.decide.hardware import Hardware, Throughput, hardware_for  # noqa: F401
from autoshard.measure.crash import candidate_crash, not_offered_note
from autoshard.measure.trace import ActivationProfile
from autoshard.strategies.strategy import Strategy


@dataclass(frozen=True)
class Candidate:
    """One way to train and what it would cost.

    Attributes:
        strategy: the wrapping.
        activation_checkpointing: number of blocks checkpointed (the first ones).
        footprint: estimated per-rank peak, by term.
        step_seconds: modelled step time; only its order among candidates matters.
        fits: the estimated peak plus reserve_bytes is within the usable memory (and, under
            CPU offload, host_bytes within the host memory).
        host_bytes: host memory per rank under CPU offload, else 0.
        reserve_bytes: memory kept free beside the estimated peak for what depends on timing
            (`reserve_bytes`); not part of the estimate.
    """

    strategy: Strategy
    activation_checkpointing: int
    footprint: Footprint
    step_seconds: float
    fits: bool
    host_bytes: int = 0
    reserve_bytes: int = 0

    @property
    def estimated_peak_bytes(self) -> int:
        return self.footprint.peak


@dataclass(frozen=True)
class PlanInputs:
    """Everything the decision depends on, measured or stated beforehand."""

    stats: ModelStats
    profile: ActivationProfile | None
    world_size: int
    num_nodes: int
    usable_bytes: int
    setting: Setting  # template: strategy and checkpointed are filled per candidate
    hardware: Hardware
    num_blocks: int
    mixed_precision: str
    reasons: tuple[str, ...] = ()
    simulated: dict[Strategy, Simulated] = field(default_factory=dict)  # per strategy, if run
    host_usable_bytes: int | None = None  # host RAM per rank for CPU offload (None: unknown)
    # runs whose own step failed in simulation (`measure.crash`): their candidates are not offered
    crashed: dict[tuple[Strategy, bool], str] = field(default_factory=dict)

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.world_size // max(self.num_nodes, 1))


@dataclass(frozen=True)
class Attempt:
    """One trial step: the candidate tried, how it ended, and its measured per-rank peak."""

    strategy: Strategy
    activation_checkpointing: int
    outcome: str
    measured_peak_bytes: int | None


@dataclass(frozen=True)
class Plan:
    """What autoshard chose, why, and what every candidate would have cost (per rank)."""

    strategy: Strategy
    mixed_precision: str
    activation_checkpointing: int
    cpu_offload: bool
    estimated_peak_bytes: int
    measured_peak_bytes: int | None
    device_memory_bytes: int
    world_size: int
    num_blocks: int
    candidates: tuple[Candidate, ...]
    reasons: tuple[str, ...]
    attempts: tuple[Attempt, ...] = field(default=())
    # Trainable parameters that got no gradient in the traced step: DDP must then look for them
    # every step (find_unused_parameters=True), or it fails on the second step.
    unused_parameters: tuple[str, ...] = field(default=())

    @property
    def chosen(self) -> Candidate:
        """The candidate this plan trains with (its estimate, term by term)."""
        return next(
            c
            for c in self.candidates
            if c.strategy == self.strategy
            and c.activation_checkpointing == self.activation_checkpointing
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON types (`json.dumps(plan.to_dict())`), for scripts that read
        the decision: bytes per rank as ints, `strategy` as its lower-case value, the chosen
        candidate under `chosen`. The keys are stable; new ones may be added."""
        from autoshard.decide.render import plan_dict

        return plan_dict(self)

    def __str__(self) -> str:
        from autoshard.decide.render import render

        return render(self)


def strategies_for(
    world_size: int, distributed: bool, num_nodes: int = 1, device_type: str = "cpu"
) -> tuple[Strategy, ...]:
    """The wrappings possible here. Without a process group only LOCAL; with one rank the
    wrappers work but buy nothing, so auto keeps LOCAL while a forced wrapper is still obeyed.
    HYBRID_SHARD needs ranks on more than one node, the same number on each; CPU offload needs a
    device apart from the host."""
    if not distributed:
        return (Strategy.LOCAL,)
    wrappers: tuple[Strategy, ...] = (Strategy.DDP, Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD)
    if 1 < num_nodes <= world_size and world_size % num_nodes == 0:
        wrappers += (Strategy.HYBRID_SHARD,)
    if device_type == "cuda":
        wrappers += (Strategy.CPU_OFFLOAD,)
    return (Strategy.LOCAL, *wrappers) if world_size == 1 else wrappers


def step_seconds(inputs: PlanInputs, strategy: Strategy, checkpointed: int) -> float:
    """Modelled step time: compute (3x forward, plus one forward of each checkpointed block),
    overlapped with gradient/parameter traffic, plus collective launches and FSDP2's copies.

    Traffic per rank for a ring over N ranks moves (N-1)/N of the payload per pass: DDP
    all-reduces gradients (2 passes), ZeRO-2 all-gathers parameters once and reduce-scatters
    gradients (2 passes), ZeRO-3 all-gathers again in backward (3 passes).
    """
    hw, stats, s = inputs.hardware, inputs.stats, inputs.setting
    forward = inputs.profile.total_forward_flops if inputs.profile is not None else 0
    recompute = inputs.profile.recompute_flops(checkpointed) if inputs.profile else 0
    compute = (3 * forward + recompute) / hw.flops_per_s
    n = inputs.world_size
    ring = (n - 1) / n if n > 1 else 0.0
    bandwidth = hw.intra_node_bytes_per_s if inputs.num_nodes <= 1 else hw.inter_node_bytes_per_s
    gathered = stats.floating_numel * s.compute_bytes
    reduced = stats.trainable_bytes
    units = len(stats.block_numel) + 1
    if strategy == Strategy.LOCAL:
        return compute
    if strategy == Strategy.DDP:
        buckets = max(1, -(-reduced // (25 * 2**20)))  # DDP's default bucket_cap_mb=25
        return max(compute, 2 * reduced * ring / bandwidth) + buckets * hw.collective_latency_s
    passes = 2 if strategy.reshards else 1
    copies = 2 * passes * gathered / hw.memory_bytes_per_s
    launches = (passes + 1) * units * hw.collective_latency_s
    if strategy == Strategy.HYBRID_SHARD:
        # all-gathers and reduce-scatters within a node; then each rank all-reduces its gradient
        # shard (1/ranks_per_node of them) with its peers on the other nodes
        local = inputs.ranks_per_node
        local_ring = (local - 1) / local
        nodes_ring = (inputs.num_nodes - 1) / inputs.num_nodes
        traffic = (passes * gathered + reduced) * local_ring / hw.intra_node_bytes_per_s
        traffic += 2 * (reduced / local) * nodes_ring / hw.inter_node_bytes_per_s
        return max(compute, traffic) + copies + launches + units * hw.collective_latency_s
    traffic = (passes * gathered + reduced) * ring / bandwidth
    seconds = max(compute, traffic) + copies + launches
    if strategy == Strategy.CPU_OFFLOAD:
        # each unit's shard goes to the device twice (forward, backward), its gradient comes
        # back, and the optimizer reads and writes parameters, gradients and state on the CPU
        shard = stats.param_bytes / n
        seconds += (2 * shard + stats.trainable_bytes / n) / hw.host_link_bytes_per_s
        state = stats.param_bytes + stats.trainable_bytes + stats.optimizer_bytes
        seconds += 2 * state / n / hw.host_memory_bytes_per_s
    return seconds


# Strategies estimated from another one's simulation: the same FSDP2 step at another sharding
# degree (HSDP shards within a node) or with the state moved to the host.
SIMULATED_AS = {
    Strategy.HYBRID_SHARD: Strategy.FULL_SHARD,
    Strategy.CPU_OFFLOAD: Strategy.FULL_SHARD,
}


def candidate(inputs: PlanInputs, strategy: Strategy, checkpointed: int) -> Candidate:
    degree = inputs.ranks_per_node if strategy == Strategy.HYBRID_SHARD else None
    setting = replace(
        inputs.setting, strategy=strategy, checkpointed=checkpointed, shard_degree=degree
    )
    simulated = inputs.simulated.get(SIMULATED_AS.get(strategy, strategy))
    footprint = estimate(inputs.stats, inputs.profile, setting, simulated)
    seconds = step_seconds(inputs, strategy, checkpointed)
    host = host_bytes(inputs.stats, setting)
    reserve = reserve_bytes(inputs, strategy)
    fits = footprint.peak + reserve <= inputs.usable_bytes and (
        inputs.host_usable_bytes is None or host <= inputs.host_usable_bytes
    )
    return Candidate(strategy, checkpointed, footprint, seconds, fits, host, reserve)


def reserve_bytes(inputs: PlanInputs, strategy: Strategy) -> int:
    """Memory kept free under FSDP2 beside the estimated peak: one FSDP unit's sharded gradient.

    The simulation's collectives complete at once; real ones complete when they do, and a unit's
    reduce-scatter output can then be allocated while the gradients it reduces still count. On 2
    gloo ranks, ZeRO-3 over a 6-block MLP peaked at one of two values from step to step, the
    higher one by exactly one block's sharded gradient more (compare.py, mlp `ac_only`:
    64,968,336 or 66,746,768 bytes). Reserving the largest unit's keeps such a step within the
    limit; DDP reduces in place and needs none."""
    if not strategy.sharded:
        return 0
    stats = inputs.stats
    degree = inputs.ranks_per_node if strategy == Strategy.HYBRID_SHARD else inputs.world_size
    largest = max((*stats.block_numel, stats.root_numel), default=0)
    element = stats.param_bytes / max(stats.floating_numel, 1)  # gradients in the stored dtype
    return round(-(-largest // max(degree, 1)) * element)


def crash(inputs: PlanInputs, strategy: Strategy, checkpointed: int) -> str | None:
    """Why this candidate's step would fail (its simulation failed for its own sake), or None."""
    return candidate_crash(inputs.crashed, SIMULATED_AS.get(strategy, strategy), checkpointed)


def frugal_candidate(inputs: PlanInputs, strategy: Strategy) -> Candidate:
    """The candidate of `strategy` that checkpoints as few blocks as fit, else the smallest peak.

    A linear scan: activation bytes are not monotone in the count (checkpointing every block
    raises the recompute peak above checkpointing most of them), and each estimate is arithmetic.
    """
    counts = range(inputs.num_blocks + 1) if inputs.profile is not None else range(1)
    options = [candidate(inputs, strategy, k) for k in counts if not crash(inputs, strategy, k)]
    return next((c for c in options if c.fits), min(options, key=lambda c: c.estimated_peak_bytes))


def all_candidates(
    inputs: PlanInputs,
    strategies: tuple[Strategy, ...],
    forced_strategy: Strategy | None,
    forced_ac: int | None,
) -> list[Candidate]:
    """Every rung the trial step may fall back to, within what the caller forced."""
    counts = range(inputs.num_blocks + 1) if inputs.profile is not None else range(1)
    return [
        candidate(inputs, s, k)
        for s in strategies
        if forced_strategy in (None, s)
        for k in (counts if forced_ac is None else (forced_ac,))
        if not crash(inputs, s, k)
    ]


def after_trial(
    plan: Plan,
    chosen: Candidate,
    attempts: tuple[Attempt, ...],
    peak: int | None,
    notes: tuple[str, ...],
) -> Plan:
    """The plan as the trial step left it: the rung kept, the attempts, the measured peak."""
    candidates = plan.candidates
    if chosen not in candidates:
        candidates = (*candidates, chosen)
    reasons = list(plan.reasons) + list(notes)
    if peak is not None and peak > chosen.estimated_peak_bytes:
        reasons.append(above_estimate(peak, chosen.estimated_peak_bytes))
    if len(attempts) > 1:
        reasons.append(
            f"the trial step fell back to {chosen.strategy} with "
            f"{chosen.activation_checkpointing} block(s) checkpointed after running out of memory"
        )
    return replace(
        plan,
        strategy=chosen.strategy,
        activation_checkpointing=chosen.activation_checkpointing,
        estimated_peak_bytes=chosen.estimated_peak_bytes,
        measured_peak_bytes=peak,
        candidates=candidates,
        attempts=attempts,
        reasons=tuple(reasons),
    )


def above_estimate(peak: int, estimate: int) -> str:
    """The reason a trial step that measured more than the estimate adds to the plan."""
    over = 100 * (peak - estimate) / max(estimate, 1)
    return (
        f"warning: the trial step measured {human(peak)} per rank, {over:.1f}% above the "
        f"estimate of {human(estimate)}: the estimate misses a term (see the reasons above); "
        f"leave that much more headroom in memory_limit"
    )


def decide(
    inputs: PlanInputs,
    strategies: tuple[Strategy, ...],
    forced_strategy: Strategy | None,
    forced_ac: int | None,
) -> Plan:
    """Choose the fastest candidate whose estimated peak fits; forced choices are obeyed."""
    if forced_strategy == Strategy.LOCAL and forced_strategy not in strategies:
        raise ValueError(
            f"strategy LOCAL trains one process unwrapped, but this job has "
            f"{inputs.world_size} ranks; choose 'ddp', 'shard_grad_op', 'full_shard' or 'auto'"
        )
    if forced_strategy == Strategy.HYBRID_SHARD and forced_strategy not in strategies:
        raise ValueError(
            f"strategy HYBRID_SHARD shards within a node and replicates across nodes, but the "
            f"{inputs.world_size} rank(s) are on {inputs.num_nodes} node(s) (it needs more than "
            f"one, each with the same number of ranks); use 'full_shard'"
        )
    if forced_strategy == Strategy.CPU_OFFLOAD and inputs.setting.device_type != "cuda":
        raise ValueError(
            "strategy CPU_OFFLOAD moves state from GPU memory to host memory, but this job "
            "trains on the CPU already; use 'full_shard'"
        )
    if forced_strategy is not None and forced_strategy not in strategies:
        raise ValueError(
            f"strategy {forced_strategy} needs a process group; launch with torchrun or "
            f"accelerate launch (or use strategy='auto', which trains one process unwrapped)"
        )
    if forced_strategy is not None:
        strategies = (forced_strategy,)
    elif Strategy.LOCAL in strategies:
        strategies = (Strategy.LOCAL,)  # one rank: a wrapper only adds work
    shown: list[Candidate] = []
    for strategy in strategies:
        error = crash(inputs, strategy, forced_ac or 0)
        if error is not None and forced_strategy is not None:
            raise RuntimeError(
                f"strategy {strategy} was forced, but its step with {forced_ac or 0} block(s) "
                f"checkpointed fails in the planning simulation ({error}); choose another "
                f"strategy or activation_checkpointing, or 'auto'"
            )
        if error is not None:
            continue
        plain = candidate(inputs, strategy, forced_ac if forced_ac is not None else 0)
        shown.append(plain)
        if forced_ac is None and not plain.fits and inputs.num_blocks:
            frugal = frugal_candidate(inputs, strategy)
            if frugal != plain:
                shown.append(frugal)
    reasons = list(inputs.reasons)
    if inputs.crashed:
        reasons.append(not_offered_note(inputs.crashed))
    if not shown:
        raise RuntimeError(f"no candidate can train this model: {not_offered_note(inputs.crashed)}")
    if forced_strategy is not None:
        pool = [c for c in shown if c.strategy == forced_strategy]
        chosen = next((c for c in pool if c.fits), pool[-1])
        reasons.append(f"strategy {forced_strategy} forced by the caller")
        if not chosen.fits:
            reasons.append(
                f"warning: {forced_strategy} is estimated at {human(chosen.estimated_peak_bytes)} "
                f"per rank, above the usable {human(inputs.usable_bytes)}"
            )
    else:
        fitting = [c for c in shown if c.fits]
        if not fitting:
            raise DoesNotFit.from_estimate(inputs, min(shown, key=lambda c: shortfall(inputs, c)))
        chosen = min(fitting, key=lambda c: c.step_seconds)
        reasons.append(_why(chosen, shown))
    return Plan(
        strategy=chosen.strategy,
        mixed_precision=inputs.mixed_precision,
        activation_checkpointing=chosen.activation_checkpointing,
        cpu_offload=chosen.strategy == Strategy.CPU_OFFLOAD,
        estimated_peak_bytes=chosen.estimated_peak_bytes,
        measured_peak_bytes=None,
        device_memory_bytes=inputs.usable_bytes,
        world_size=inputs.world_size,
        num_blocks=inputs.num_blocks,
        candidates=tuple(shown),
        reasons=tuple(reasons),
    )


def _why(chosen: Candidate, shown: list[Candidate]) -> str:
    faster = [c for c in shown if c.step_seconds < chosen.step_seconds and not c.fits]
    ac = (
        f" with {chosen.activation_checkpointing} block(s) checkpointed"
        if chosen.activation_checkpointing
        else ""
    )
    text = f"chose {chosen.strategy}{ac}: the fastest candidate whose estimated peak fits"
    if chosen.reserve_bytes:
        text += (
            f", with {human(chosen.reserve_bytes)} per rank kept free beside it (a unit's "
            f"reduce-scatter output may be allocated before its input is freed)"
        )
    if faster:
        names = ", ".join(sorted({str(c.strategy) for c in faster}))
        text += f" ({names} would be faster but do not fit)"
    return text
