"""The plan's inputs with every candidate worth it simulated (`measure.simulate`): which strategies,
which of them also with every block checkpointed, and in how many rounds."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from autoshard._torch_compat import compiled_module
from autoshard.decide.candidates import candidate, crash
from autoshard.decide.estimate import Simulated
from autoshard.decide.job import Work
from autoshard.decide.plan import PlanInputs
from autoshard.decide.validate import Request
from autoshard.measure.facts import forced_checkpointing
from autoshard.measure.fake import simulated_on
from autoshard.measure.sharing import workers
from autoshard.measure.simulate import Setup, Tally, combine, simulate_all
from autoshard.strategies.recipes import recipe
from autoshard.strategies.strategy import Strategy


def with_simulation(
    inputs: PlanInputs,
    work: Work,
    block_names: list[str],
    device: torch.device,
    strategies: tuple[Strategy, ...],
    shared: bool = False,
    every: bool = False,
) -> PlanInputs:
    """`inputs` with every strategy that may be chosen simulated (`measure.simulate`), fastest
    first; with `every`, every strategy that may be tried. With `shared` (inside a job, from
    `prepare`) every rank calls this at the same point: the simulations are shared out and
    gathered."""
    model, block_names = uncompiled(work.model, block_names)
    optimizer, batch = work.optimizer, work.batch
    loss_fn, request = work.loss_fn, work.request
    if batch is None:
        note = "estimates are analytic: no example_batch to simulate a step with"
        return replace(inputs, reasons=(*inputs.reasons, note))
    wanted = tuple(
        dict.fromkeys(recipe(s).simulation for s in strategies if request.strategy in (None, s))
    )
    # A strategy whose parameters, gradients and optimizer state alone exceed the usable memory
    # does not fit whatever its activations: not worth simulating (unless forced). The most
    # frugal one is simulated all the same: when nothing fits, DoesNotFit quotes its estimate,
    # which must not switch to the formulas' as the limit falls (it did: 10.33 MiB needed at
    # 8 MiB, 14.10 MiB at 4 MiB, for the same candidate).
    stats = inputs.stats
    state = stats.param_bytes + stats.trainable_bytes + stats.optimizer_bytes
    hopeless = [
        s
        for s in wanted[:-1]
        if request.strategy is None
        and state // (inputs.world_size if recipe(s).sharded else 1) > inputs.usable_bytes
    ]
    here = simulated_on(device)
    dtype = inputs.mixed_precision.dtype
    answers = inputs.profile.answers if inputs.profile is not None else ()
    found = inputs.profile.nonzero_found if inputs.profile is not None else ()
    unlike = inputs.profile is not None and inputs.profile.unlike_blocks is not None
    setup = Setup(
        block_names,
        batch,
        loss_fn,
        optimizer,
        dtype,
        here,
        trains_on=device,
        answers=answers,
        nonzero_found=found,
        unlike_blocks=unlike,
    )
    # Checkpointing moves the peak later into backward, which deriving from the unchecked peak
    # misses: where checkpointed candidates matter, a strategy is simulated with every block
    # checkpointed too (`_first_round` says which of those runs wait for a second round).
    checkpointable = inputs.num_blocks > 0 and request.activation_checkpointing != 0
    simulating = tuple(s for s in wanted if s not in hopeless)
    ranks = inputs.world_size if shared else 1
    first: tuple[Strategy, ...] = ()
    if checkpointable:
        picked = _to_checkpoint(inputs, strategies, request, simulating)
        forced = request.activation_checkpointing is not None
        first = _first_round(picked, forced, len(simulating), ranks)
    crashes: dict[tuple[Strategy, bool], str] = {}
    runs: dict[tuple[Strategy, bool], Simulated] = {}
    notes: list[str] = []
    forced_ac = forced_checkpointing(request, inputs.num_blocks)
    # Under auto, the fastest strategies are simulated first, as many at once as there are
    # ranks to share them out: those slower than a candidate already found to fit cannot be
    # chosen, and are left to the formulas (`_slower`). Every strategy is simulated where each
    # candidate's own figure is asked for (the largest batch of each, and its probes).
    order = sorted(simulating, key=lambda s: _seconds(inputs, strategies, s, forced_ac or 0))
    wave = len(order) if every or request.strategy is not None else ranks
    # this rank's share of the first wave's runs, which may go to idle cores (`measure.sharing`)
    share = -(-(len(order[:wave]) + len(first)) // ranks)
    with workers(model, setup, inputs.world_size, share) as helpers:
        pending = order
        skipped: list[Strategy] = []
        tally = Tally()  # the waves' one note
        while pending:
            now, pending = pending[:wave], pending[wave:]
            more, note = simulate_all(
                model,
                setup,
                tuple(now),
                stats,
                inputs.world_size,
                checkpointed=tuple(s for s in first if s in now),
                shared=shared,
                crashes=crashes,
                tally=tally,
                workers=helpers,
            )
            runs.update(more)
            inputs = replace(inputs, simulated=combine(runs), crashed=crashes)
            done = [s for s in order if s not in pending]
            slower = [s for s in pending if _slower(inputs, strategies, s, done, forced_ac or 0)]
            skipped += slower
            pending = [s for s in pending if s not in slower]
            if not pending:
                notes.append(note)
        if checkpointable:
            simulated = tuple(s for s, checkpointed in runs if not checkpointed)
            again = tuple(
                s for s in _to_checkpoint(inputs, strategies, request, simulated) if s not in first
            )
            if again:  # decided from agreed data: the same on every rank of a job
                more, more_note = simulate_all(
                    model,
                    setup,
                    (),
                    stats,
                    inputs.world_size,
                    checkpointed=again,
                    shared=shared,
                    crashes=crashes,
                    workers=helpers,
                )
                runs.update(more)
                notes.append(more_note)
                inputs = replace(inputs, simulated=combine(runs), crashed=crashes)
    if skipped:
        names = ", ".join(str(s) for s in strategies if recipe(s).simulation in skipped)
        notes.append(
            f"{names} not simulated nor shown: slower than a candidate that fits (force one "
            f"with strategy= to see its estimate; the trial step may still fall back to them, "
            f"by their formulas' estimates)"
        )
        inputs = replace(inputs, outweighed=tuple(skipped))
    if hopeless:
        names = ", ".join(str(s) for s in hopeless)
        notes.append(
            f"{names} not simulated (estimated by formula): parameters, gradients and "
            f"optimizer state alone exceed the usable memory"
        )
    return replace(inputs, reasons=(*inputs.reasons, *notes))


def _seconds(
    inputs: PlanInputs, strategies: tuple[Strategy, ...], simulation: Strategy, checkpointed: int
) -> float:
    """The modelled step time of the fastest strategy simulated as `simulation` (which the
    simulation does not change: it depends on the model, the hardware and the strategy)."""
    return min(
        candidate(inputs, s, checkpointed).step_seconds
        for s in strategies
        if recipe(s).simulation == simulation
    )


def _slower(
    inputs: PlanInputs,
    strategies: tuple[Strategy, ...],
    simulation: Strategy,
    done: list[Strategy],
    checkpointed: int,
) -> bool:
    """Whether every strategy simulated as `simulation` is slower than a candidate of the
    simulated strategies (`done`) that fits with `checkpointed` blocks (0 under auto: a
    candidate checkpointing more blocks is no faster). Such a strategy cannot be chosen; ties
    are simulated, so that the choice among equals is the one a full simulation makes."""
    fitting = [
        c.step_seconds
        for s in strategies
        if recipe(s).simulation in done
        and (c := candidate(inputs, s, checkpointed)).fits
        and not crash(inputs, s, checkpointed)
    ]
    return bool(fitting) and min(fitting) < _seconds(inputs, strategies, simulation, checkpointed)


def _first_round(
    picked: tuple[Strategy, ...], forced: bool, unchecked: int, ranks: int
) -> tuple[Strategy, ...]:
    """The checkpointed runs (`picked` by formula) simulated beside the `unchecked` runs, in the
    first round; the others are judged again from the simulated unchecked peaks, in a second.

    Where checkpointing is forced every strategy needs it: all go first. Under auto the formula's
    picks are mostly wasted: a trace on meta tensors sees attention decomposed into matmul and
    softmax, several times the activations the simulation does (a 22-layer Llama under auto: 19
    fake steps, 10 with its picks left out, the same plan). They go first only where they cost no
    time: inside a job whose `ranks` (the runs are shared out among them) outnumber every run."""
    if forced or ranks >= unchecked + len(picked):
        return picked
    return ()


def _to_checkpoint(
    inputs: PlanInputs,
    strategies: tuple[Strategy, ...],
    request: Request,
    among: tuple[Strategy, ...],
) -> tuple[Strategy, ...]:
    """The strategies (of `among`) worth simulating with every block checkpointed: all where
    checkpointing is forced; under auto, those whose unchecked candidate does not fit yet which
    could still be the fastest (checkpointing only adds time): faster than the fastest unchecked
    candidate that fits. Judged on the estimates `inputs` has (simulated, or by formula)."""
    plain = [candidate(inputs, s, 0) for s in strategies if request.strategy in (None, s)]
    fastest = min((c.step_seconds for c in plain if c.fits), default=float("inf"))
    return tuple(
        dict.fromkeys(
            recipe(c.strategy).simulation
            for c in plain
            if recipe(c.strategy).simulation in among
            and (
                request.activation_checkpointing is not None
                or (not c.fits and c.step_seconds < fastest)
            )
        )
    )


def uncompiled(model: nn.Module, block_names: list[str]) -> tuple[nn.Module, list[str]]:
    """A `torch.compile`d model (an OptimizedModule) as the module it compiles, and the blocks'
    names in it; any other model as it is. The compiled step is the module's own step here:
    dynamo compiles nothing under a dispatch mode, and every fake step runs under one. torch's
    module tracker skips what runs inside an OptimizedModule, so FSDP2's memory tracker, finding
    no name for the sharded root, failed every FSDP2 simulation of a compiled model ("not
    simulated: FULL_SHARD (AssertionError)"), whose estimates fell to the formulas."""
    inner = compiled_module(model)
    if inner is None:
        return model, block_names
    names = {id(module): name for name, module in inner.named_modules()}
    return inner, [names[id(model.get_submodule(name))] for name in block_names]
