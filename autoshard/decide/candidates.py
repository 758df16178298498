"""From estimates to a decision: every candidate's estimate and cost, the choice among them, and
the plan as the trial step leaves it. Pure: no process group, no module is touched, so the whole
decision table is testable in milliseconds."""

from __future__ import annotations

from dataclasses import replace

from autoshard._units import human
from autoshard.decide.cost import reserve_bytes, step_seconds
from autoshard.decide.crashes import candidate_crash, caused_by_precision, not_offered_note
from autoshard.decide.estimate import estimate, host_bytes
from autoshard.decide.fit import DoesNotFit
from autoshard.decide.plan import Attempt, Candidate, Plan, PlanInputs
from autoshard.decide.precision import Precision
from autoshard.strategies.recipes import Job, available, recipe
from autoshard.strategies.strategy import Strategy


def strategies_for(
    world_size: int,
    distributed: bool,
    num_nodes: int = 1,
    device_type: str = "cpu",
    own_group: bool = False,
) -> tuple[Strategy, ...]:
    """The wrappings this job can use (`strategies.recipes.available`): without a process group
    LOCAL, and CPU_OFFLOAD on a GPU where prepare can create a one-rank group of its own
    (`own_group`); with one rank `auto` weighs only those that help alone (`searched`) while a
    forced wrapper is still obeyed."""
    return available(Job(world_size, distributed, num_nodes, device_type, own_group))


def check_forced(strategies: tuple[Strategy, ...], forced: Strategy | None, job: Job) -> None:
    """Raise the recipe's own ValueError when the caller forced a strategy this job cannot use."""
    if forced is not None and forced not in strategies:
        unavailable = recipe(forced).unavailable(job)
        raise ValueError(unavailable or f"strategy {forced} cannot train this job")


def searched(
    strategies: tuple[Strategy, ...], world_size: int, forced: Strategy | None
) -> tuple[Strategy, ...]:
    """The strategies a decision weighs among those available: the forced one, else all of them,
    except that with one rank only those that help alone (`Recipe.helps_alone`: unwrapped, or
    offloaded to host memory); sharding over one rank or DDP only adds work, unless the model
    cannot train unwrapped (its forward raises under autocast: `Job.autocast_raises`)."""
    if forced is not None:
        return tuple(s for s in strategies if s == forced)
    if world_size == 1 and Strategy.LOCAL in strategies:
        return tuple(s for s in strategies if recipe(s).helps_alone)
    return strategies


def candidate(inputs: PlanInputs, strategy: Strategy, checkpointed: int) -> Candidate:
    r = recipe(strategy)
    degree = r.shard_degree(inputs.world_size, inputs.ranks_per_node) if r.sharded else None
    setting = replace(
        inputs.setting, strategy=strategy, checkpointed=checkpointed, shard_degree=degree
    )
    simulated = inputs.simulated.get(r.simulation)
    footprint = estimate(inputs.stats, inputs.profile, setting, simulated)
    seconds = step_seconds(inputs, strategy, checkpointed)
    host = host_bytes(inputs.stats, setting)
    reserve = reserve_bytes(inputs, strategy)
    fits = footprint.peak + reserve <= inputs.usable_bytes and (
        inputs.host_usable_bytes is None or host <= inputs.host_usable_bytes
    )
    return Candidate(strategy, checkpointed, footprint, seconds, fits, host, reserve)


def crash(inputs: PlanInputs, strategy: Strategy, checkpointed: int) -> str | None:
    """Why this candidate's step would fail (its simulation failed for its own sake), or None."""
    return candidate_crash(inputs.crashed, recipe(strategy).simulation, checkpointed)


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
        for s in searched(strategies, inputs.world_size, forced_strategy)
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
    """Choose the fastest candidate whose estimated peak fits; forced choices are obeyed (a forced
    strategy the job cannot use is refused earlier, by `check_forced`)."""
    if forced_strategy is not None and forced_strategy not in strategies:
        raise ValueError(f"strategy {forced_strategy} cannot train this job")
    strategies = tuple(
        s
        for s in searched(strategies, inputs.world_size, forced_strategy)
        if recipe(s).simulation not in inputs.outweighed
    )
    shown: list[Candidate] = []
    for strategy in strategies:
        error = crash(inputs, strategy, forced_ac or 0)
        if error is not None and forced_strategy is not None:
            precision = (
                ", mixed_precision='no'"
                if caused_by_precision(error) and inputs.mixed_precision is not Precision.NO
                else ""
            )
            raise RuntimeError(
                f"strategy {strategy} was forced, but its step with {forced_ac or 0} block(s) "
                f"checkpointed fails in the planning simulation ({error}); choose another "
                f"strategy or activation_checkpointing{precision}, or 'auto'"
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
    note = not_offered_note(inputs.crashed, inputs.mixed_precision is not Precision.NO)
    if inputs.crashed:
        reasons.append(note)
    if not shown:
        raise RuntimeError(f"no candidate can train this model: {note}")
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
            raise DoesNotFit.from_estimate(inputs, shown)
        chosen = min(fitting, key=lambda c: c.step_seconds)
        reasons.append(_why(chosen, shown, inputs.hardware.source))
    return Plan(
        strategy=chosen.strategy,
        mixed_precision=inputs.mixed_precision,
        activation_checkpointing=chosen.activation_checkpointing,
        cpu_offload=recipe(chosen.strategy).offload,
        estimated_peak_bytes=chosen.estimated_peak_bytes,
        measured_peak_bytes=None,
        device_memory_bytes=inputs.usable_bytes,
        world_size=inputs.world_size,
        num_blocks=inputs.num_blocks,
        candidates=tuple(shown),
        reasons=tuple(reasons),
    )


def _why(chosen: Candidate, shown: list[Candidate], cost_model: str) -> str:
    faster = [c for c in shown if c.step_seconds < chosen.step_seconds and not c.fits]
    ac = (
        f" with {chosen.activation_checkpointing} block(s) checkpointed"
        if chosen.activation_checkpointing
        else ""
    )
    text = (
        f"chose {chosen.strategy}{ac}: the fastest candidate whose estimated peak fits (step "
        f"times modelled from {cost_model})"
    )
    if chosen.reserve_bytes:
        text += (
            f", with {human(chosen.reserve_bytes)} per rank kept free beside it (a unit's "
            f"reduce-scatter output may be allocated before its input is freed)"
        )
    if faster:
        names = ", ".join(sorted({str(c.strategy) for c in faster}))
        text += f" ({names} would be faster but do not fit)"
    return text
