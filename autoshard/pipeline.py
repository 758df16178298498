"""The one decision pipeline that `prepare` and `plan` both run:

    gather (this rank's facts) -> agree (every rank's; a no-op for plan) -> simulate -> decide

`prepare` runs it on every rank of a live job (`Target.in_job`): whatever fails on one rank
while gathering is raised on every rank (`collective.agree`), the ranks' facts are checked
against each other, and the simulations are shared out among them. `plan` runs it in one
process, for any world size (what-if).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard._batch import batch_for_meta, batch_rows, resized
from autoshard._torch_compat import compiled_runs_eagerly
from autoshard._world import Memory, RankReport, World, local_memory, own_group_note, spanning
from autoshard.collective import agree
from autoshard.decide.batch import Key, Largest, Probe, batch_for, largest_batches, with_batches
from autoshard.decide.blocks import blocks_and_notes
from autoshard.decide.candidates import (
    all_candidates,
    candidate,
    check_forced,
    decide,
    searched,
)
from autoshard.decide.consistent import (
    buffer_digests,
    fingerprint,
    raise_if_inconsistent,
    warn_if_buffers_differ,
)
from autoshard.decide.fit import DoesNotFit
from autoshard.decide.job import Decision, Ranks, Work
from autoshard.decide.plan import Plan, PlanInputs
from autoshard.decide.precision import Precision
from autoshard.decide.validate import (
    Request,
    check_batch_device,
    check_model,
    check_optimizer,
    check_request,
)
from autoshard.io.data import check_dataloader
from autoshard.measure.cublas import cublas_workspaces, with_cublas
from autoshard.measure.device import device_throughput, with_device
from autoshard.measure.facts import (
    autocast_raises,
    blocks_reason,
    fails_cast_too,
    forced_checkpointing,
    measure,
    plan_inputs,
    precision_off,
    resolve_mixed_precision,
    usable_host_memory,
    usable_memory,
    with_resident,
    worst,
)
from autoshard.measure.fake import caches_emptied, simulated_on
from autoshard.measure.host import host_throughput, with_host
from autoshard.measure.rates import with_model_rate
from autoshard.measure.simulated import with_simulation
from autoshard.strategies.engines import cannot_shard, layer_drop
from autoshard.strategies.recipes import Engine, Job, available, never_sharded, recipe
from autoshard.strategies.strategy import Strategy

logger = logging.getLogger("autoshard")


@dataclass(frozen=True)
class Call:
    """What the caller passed, not validated yet (validating is part of gathering)."""

    model: Any
    optimizer: Any
    batch: Any
    loss_fn: Any
    options: dict[str, Any]  # strategy, mixed_precision, ..., as `check_request` takes them
    dataloader: Any = None


@dataclass(frozen=True)
class Target:
    """Facts about the job decided for, known before anything is measured."""

    world: World  # this process
    world_size: int  # ranks decided for
    distributed: bool  # the ranks run under a process group (a what-if assumes one)
    device: torch.device  # what the ranks train on
    in_job: bool  # every rank of a live job runs the pipeline together (prepare)
    num_nodes: int | None = None  # None: from the ranks' hosts and the launcher's layout
    memory: Memory | None = None  # the device memory per rank; None: measured on each rank
    simulate: bool = True  # False: a what-if for another size inside a job, by formula
    probe: bool = False  # a batch-size probe (`_probe`): silent, and no search of its own


@dataclass(frozen=True)
class _Gathered:
    """One rank's facts: its report to the others, and what stays here."""

    report: RankReport
    work: Work
    blocks: list[tuple[str, nn.Module]]
    mixed_precision: Precision
    reasons: list[str]
    meta_note: tuple[str, ...]  # the batch was moved to meta for a model on meta


def run(call: Call, target: Target) -> tuple[Decision, Work]:
    """Gather, agree, simulate, decide: the same decision on every rank of a job. What the
    model's code cached in function caches on fake tensors meanwhile is forgotten, and a
    compiled model runs eagerly throughout, where dynamo could not compile it (every step runs
    under a dispatch mode) and would have refused its code for good (`compiled_runs_eagerly`)."""
    with caches_emptied(call.model), compiled_runs_eagerly():
        return _run(call, target)


def _run(call: Call, target: Target, search_batch: bool = True) -> tuple[Decision, Work]:
    """`run`; where nothing fits, the largest batch that would is searched with `search_batch`
    (`largest_batch`), and under "auto" mixed precision that made sharded candidates fail, the
    decision is made again without it (`_without_precision`)."""
    here: dict[str, _Gathered] = {}

    def gather_here() -> RankReport:
        here["gathered"] = gather(call, target)
        return here["gathered"].report

    world = target.world
    if target.in_job:
        reports = agree(world, "prepare()", gather_here)
        raise_if_inconsistent(reports)
        differing = warn_if_buffers_differ(reports, world.rank)
    else:
        reports, differing = [gather_here()], []
    gathered = here["gathered"]
    reasons = list(gathered.reasons)
    if differing:
        reasons.append(
            f"{len(differing)} buffer(s) differed between ranks (e.g. '{differing[0]}'): every "
            f"rank now holds rank 0's"
        )
    unused = tuple(
        dict.fromkeys(
            n for r in reports if r.measured.profile for n in r.measured.profile.unused_parameters
        )
    )
    if unused and target.in_job:
        reasons.append(
            f"{len(unused)} trainable parameter(s) got no gradient in the traced step (e.g. "
            f"'{unused[0]}'): under DDP, find_unused_parameters=True"
        )
    drop = skips_layers(call.model, reports)
    if drop is not None and target.world_size > 1:
        reasons.append(
            f"{drop}: the model skips layers at random in training (LayerDrop, stochastic "
            f"depth), leaving their parameters without a gradient in some steps on some ranks: "
            f"under DDP, find_unused_parameters=True; FSDP2, whose collectives every rank must "
            f"join, is not weighed"
        )
    try:
        decision = _decide(call, gathered, reports, target, reasons, unused, drop)
    except DoesNotFit as error:
        if not error.tried or target.probe or not search_batch:
            raise
        failed = error
    else:
        return decision, gathered.work
    if failed.precision_failed and gathered.work.request.mixed_precision is None:
        try:
            return _without_precision(call, target, gathered.mixed_precision, failed)
        except DoesNotFit:
            pass  # the error under mixed precision says what would help
    raise failed.with_batch(*largest_batch(call, target, failed)) from None


def _without_precision(
    call: Call, target: Target, chosen: Precision, failed: DoesNotFit
) -> tuple[Decision, Work]:
    """The decision made again without mixed precision, where "auto" chose `chosen` and nothing
    fit under it, some strategies failing because of it (`DoesNotFit.precision_failed`): every
    rank alike, as every rank met the same failure. Its plan says why precision is off."""
    off = replace(call, options=call.options | {"mixed_precision": Precision.NO})
    decision, work = _run(off, target, search_batch=False)
    requested = f"mixed precision {Precision.NO} requested by the caller"
    why = (
        f"mixed precision off (auto chose {chosen}): under it {failed.precision_failed} failed "
        f"(their step, as the planning simulation ran it, refuses {chosen}) and no other "
        f"candidate fit; without it {decision.plan.strategy} fits"
    )
    reasons = tuple(why if r == requested else r for r in decision.plan.reasons)
    return replace(decision, plan=replace(decision.plan, reasons=reasons)), work


def gather(call: Call, target: Target) -> _Gathered:
    """Check the call and measure on this rank: blocks, mixed precision, the traced step, the
    memory free."""
    world = target.world
    check_model(call.model, allow_meta=not target.in_job)  # a what-if needs only shapes
    check_optimizer(call.model, call.optimizer)
    request = check_request(loss_fn=call.loss_fn, **call.options)
    check_dataloader(call.dataloader)
    check_batch_device(call.batch, request_trial=bool(call.options["trial_step"]))
    model, optimizer = call.model, call.optimizer
    blocks, block_notes = blocks_and_notes(model)
    names = [n for n, _ in blocks]
    mp, mp_reason = resolve_mixed_precision(request.mixed_precision, target.device, model)
    batch, meta_note = batch_for_meta(model, call.batch)
    progress(target, "tracing one step of the example batch for its activations")
    traced_on = simulated_on(target.device)  # a model on meta: traced where it is simulated
    traced = [m for _, m in blocks]
    measured = measure(model, traced, batch, call.loss_fn, mp.dtype, names, traced_on)
    raised = measured.under_autocast
    reasons = [mp_reason]
    if raised is not None and mp.dtype is not None:
        # The forward raises under autocast and runs without it: LOCAL and DDP, which compute
        # under autocast, cannot train it in this precision; FSDP2's cast parameters may. Where
        # they cannot either, or this job cannot use FSDP2, "auto" turns mixed precision off.
        cast = _cast_instead(target, model, optimizer, request, autocast_raises(mp.dtype, raised))
        if cast is not None:
            by_cast = measure(model, traced, batch, call.loss_fn, mp.dtype, names, traced_on, True)
            if by_cast.profile is not None:
                measured = replace(by_cast, under_autocast=raised)
                reasons.append(cast)
            elif request.mixed_precision is not None:
                raise ValueError(fails_cast_too(mp.dtype, raised, by_cast.trace_note))
        if measured.profile is None:  # "auto", no FSDP2's cast parameters: traced without
            off = precision_off(mp, measured)
            assert off is not None
            mp, mp_reason = off
            reasons = [mp_reason]
            measured = measure(model, traced, batch, call.loss_fn, None, names, traced_on)
    if measured.user_error is not None:
        raise ValueError(measured.user_error)
    memory = target.memory or with_resident(
        local_memory(world), model, optimizer, world.device, batch
    )
    in_job = target.in_job
    report = RankReport(
        world.rank,
        socket.gethostname(),
        memory,
        fingerprint(model, optimizer, batch, request, call.loss_fn, call.options["trial_step"])
        if in_job
        else (),
        None,
        measured,
        buffer_digests(model) if in_job else {},
        cublas_workspaces(target.device, mp.dtype),  # after the free memory was read
        host_throughput(target.device, optimizer) if _weighs_offload(target, request) else None,
        # the model's own FLOP/s and operators' bandwidth too, at its traced shapes (a
        # largest-batch probe's plans weigh memory alone)
        with_model_rate(
            device_throughput(target.device, mp.dtype),
            target.device,
            None if target.probe else measured.profile,
        ),
    )
    work = Work(model, optimizer, batch, call.loss_fn, request, call.options["trial_step"])
    reasons = [*(world.reasons if in_job else ()), *reasons, blocks_reason(model, names)]
    meta = () if meta_note is None else (meta_note,)
    return _Gathered(report, work, blocks, mp, [*reasons, *block_notes], meta)


def _cast_instead(
    target: Target, model: nn.Module, optimizer: Any, request: Request, raised: str
) -> str | None:
    """Where the model's forward raises under mixed precision's autocast (`raised`, as
    `autocast_raises` says it) and runs without it: why FSDP2 trains it instead, its parameters
    cast to the compute dtype, and LOCAL and DDP are not weighed; None where "auto" mixed
    precision should be off instead, this job being unable to use FSDP2 (or the caller forcing
    a strategy that computes under autocast). A mixed precision the caller asked for that no
    strategy can give raises, on every rank, the forced or unsharded strategy's ValueError."""
    job = _job(target, 1, layer_drop(model), cannot_shard(model, optimizer), raised)
    sharded = [s for s in available(job) if recipe(s).sharded]
    forced = request.strategy
    usable = [s for s in sharded if forced in (None, s)]
    if usable:
        alone = (
            ", on one rank too (it only adds FSDP2's work there)" if target.world_size == 1 else ""
        )
        return (
            f"{raised}, though it runs without it (an operator of the model mixes dtypes "
            f"autocast leaves apart): LOCAL and DDP, which compute mixed precision under "
            f"autocast, are not weighed; FSDP2 casts the parameters to the compute dtype instead "
            f"(no autocast), under which the step was traced and runs{alone}"
        )
    if request.mixed_precision is None:
        return None
    unsharded = Strategy.LOCAL if target.world_size == 1 else Strategy.DDP
    refused = recipe(forced or unsharded).unavailable(job)
    raise ValueError(refused or f"{raised}; pass mixed_precision='no'")


def _decide(
    call: Call,
    gathered: _Gathered,
    reports: list[RankReport],
    target: Target,
    reasons: list[str],
    unused: tuple[str, ...],
    drop: str | None,
) -> Decision:
    """Simulate and decide from the agreed reports (the same on every rank)."""
    request = gathered.work.request
    inputs, strategies, job, num_nodes = _simulated(gathered, reports, target, reasons, drop)
    forced_ac = forced_checkpointing(request, inputs.num_blocks)
    plan = replace(
        decide(inputs, strategies, request.strategy, forced_ac),
        unused_parameters=unused,
        layer_drop=drop,
        autocast_raises=job.autocast_raises,
    )
    if job.own_group and recipe(plan.strategy).engine is not Engine.NONE and not target.in_job:
        plan = replace(plan, reasons=(*plan.reasons, own_group_note(str(plan.strategy))))
    if request.max_batch and not target.probe:
        plan = _with_max_batch(call, target, plan, inputs.host_usable_bytes)
    first = plan.chosen
    rungs = all_candidates(inputs, strategies, request.strategy, forced_ac)
    names = tuple(n for n, _ in gathered.blocks)
    return Decision(
        plan,
        first,
        tuple(rungs),
        names,
        plan.find_unused_parameters,
        num_nodes,
        inputs.unshardable,
    )


def _simulated(
    gathered: _Gathered,
    reports: list[RankReport],
    target: Target,
    reasons: list[str],
    drop: str | None,
) -> tuple[PlanInputs, tuple[Strategy, ...], Job, int]:
    """The agreed facts with every strategy weighed simulated: the plan's inputs, those
    strategies, the job and the nodes it spans. `drop`: where the model skips layers at
    random (`layer_drop`)."""
    work, request = gathered.work, gathered.work.request
    unshardable = cannot_shard(work.model, work.optimizer)
    if unshardable is not None and (target.world_size > 1 or target.device.type == "cuda"):
        reasons = [*reasons, f"{unshardable}: FSDP2 is not weighed"]  # else it never is
    blocks = [m for _, m in gathered.blocks]
    usable, usable_reason = usable_memory(reports, request.memory_limit)
    num_nodes = target.num_nodes or spanning(target.world, len({r.host for r in reports})).num_nodes
    inputs = plan_inputs(
        work,
        blocks,
        worst([r.measured.profile for r in reports]),
        Ranks(target.world_size, num_nodes, usable, target.device),
        gathered.mixed_precision,
        [*reasons, usable_reason, *gathered.meta_note, gathered.report.measured.trace_note],
    )
    # DDP as `prepare` builds it (`Plan.find_unused_parameters`), which the estimate's buckets
    # depend on (`estimate.retired_bucket_bytes`)
    unused = any(r.measured.profile and r.measured.profile.unused_parameters for r in reports)
    setting = replace(inputs.setting, find_unused=unused or drop is not None)
    inputs = replace(inputs, setting=setting, host_usable_bytes=usable_host_memory(reports))
    inputs = with_cublas(inputs, reports)
    inputs = with_device(with_host(inputs, reports), reports)
    raised = next((r.measured.under_autocast for r in reports if r.measured.under_autocast), None)
    mp = gathered.mixed_precision
    autocast = None if raised is None or mp.dtype is None else autocast_raises(mp.dtype, raised)
    job = _job(target, num_nodes, drop, unshardable, autocast)
    inputs = replace(inputs, unshardable=never_sharded(job))
    available_ = available(job)
    if not available_:  # nothing computes without autocast here (FSDP2 cannot be used either)
        unsharded = Strategy.LOCAL if target.world_size == 1 else Strategy.DDP
        raise ValueError(recipe(request.strategy or unsharded).unavailable(job))
    check_forced(available_, request.strategy, job)  # before any simulation
    strategies = searched(available_, target.world_size, request.strategy)
    names = [n for n, _ in gathered.blocks]
    if not target.simulate:
        note = (
            f"estimates are analytic: a what-if for {target.world_size} ranks in a job of "
            f"{target.world.world_size}"
        )
        inputs = replace(inputs, reasons=(*inputs.reasons, note))
    else:
        if target.in_job and target.world.distributed:  # one process: the simulation says so
            weighed = ", ".join(map(str, strategies))
            progress(target, f"simulating on fake tensors, the fastest first, of: {weighed}")
        # prepare needs the fastest candidate that fits; a what-if plan shows every one, and each
        # candidate's own largest batch needs each simulated
        every = not target.in_job or target.probe or request.max_batch
        inputs = with_simulation(
            inputs, work, names, target.device, strategies, target.in_job, every
        )
    return inputs, strategies, job, num_nodes


def _probe(
    call: Call, target: Target, rows: int, keys: list[Key], usable: int, host: int | None
) -> Probe:
    """Plans of the example batch cut or tiled to n rows (`_batch.resized`), in this process
    alone with the usable memory fixed: each key's need and whether it fits. Where every key
    is of one strategy, only it is simulated."""
    strategies = {s for s, _ in keys}
    one = next(iter(strategies)).value if len(strategies) == 1 else call.options["strategy"]
    options = call.options | dict(
        strategy=one, memory_limit=None, trial_step=False, max_batch=False
    )
    memory = Memory(usable, usable, "the plan's usable memory", host)
    alone = replace(target, in_job=False, memory=memory, probe=True)

    def probe(n: int) -> dict[Key, tuple[int, bool]]:
        cut = replace(call, batch=resized(call.batch, rows, n), options=options, dataloader=None)
        gathered = gather(cut, alone)
        drop = skips_layers(call.model, [gathered.report])
        inputs = _simulated(gathered, [gathered.report], alone, [], drop)[0]
        needs = {}
        for key in keys:
            c = candidate(inputs, *key)
            needs[key] = (c.estimated_peak_bytes + c.reserve_bytes, c.fits)
        return needs

    return probe


def _search(
    call: Call, target: Target, at_rows: dict[Key, tuple[int, bool]], usable: int, host: int | None
) -> tuple[int | None, str, list[dict[Key, Largest]], list[int]]:
    """Each key's largest fitting batch on every rank (one dict per rank; in a job each rank
    searches alike and the agreement gathers them), the batches probed, and the batch's rows and
    dimension (rows None: nothing searched, and why)."""
    rows, how = batch_rows(call.batch, call.options["batch_size"])
    if rows is None:
        return None, how, [], []
    keys = list(at_rows)
    probe = _probe(call, target, rows, keys, usable, host)

    def search() -> tuple[dict[Key, Largest], list[int]]:
        return largest_batches(keys, rows, at_rows, probe, usable)

    found = agree(target.world, "the largest batch", search) if target.in_job else [search()]
    return rows, how, [answers for answers, _ in found], found[0][1]


def _with_max_batch(call: Call, target: Target, plan: Plan, host: int | None) -> Plan:
    """`plan` with each candidate's largest per-rank batch (`decide.batch`), the least any rank
    of a job found, and a reason saying how it was found."""
    at_rows = {
        (c.strategy, c.activation_checkpointing): (c.estimated_peak_bytes + c.reserve_bytes, c.fits)
        for c in plan.candidates
    }
    rows, how, answers, probed = _search(call, target, at_rows, plan.device_memory_bytes, host)
    return with_batches(plan, rows, how, answers, probed)


def largest_batch(call: Call, target: Target, error: DoesNotFit) -> tuple[int | None, str]:
    """The largest per-rank batch with which a rung of a plan that does not fit would fit, and
    how it was found: for the rung the host can hold that needs least of the device (rows shrink
    the device's activations, never the offloaded state on the host)."""
    host = error.host_usable
    hosted = [c for c in error.tried if host is None or c.host_bytes <= host] or error.tried
    rung = min(hosted, key=lambda c: c.estimated_peak_bytes + c.reserve_bytes)
    key = (rung.strategy, rung.activation_checkpointing)
    at_rows = {key: (rung.estimated_peak_bytes + rung.reserve_bytes, False)}
    rows, how, answers, probed = _search(call, target, at_rows, error.usable, host)
    steps = call.options["accumulation_steps"]
    return batch_for(rung, rows, how, [a[key] for a in answers], probed, steps)


def skips_layers(model: nn.Module, reports: list[RankReport]) -> str | None:
    """Where the model skips layers at random in training: a layer-drop probability it keeps
    (`layer_drop`), else a random branch its traced step took on any rank
    (`ActivationProfile.random_reads`); None where neither."""
    drop = layer_drop(model)
    if drop is not None:
        return drop
    for report in reports:
        profile = report.measured.profile
        if profile is not None and profile.random_reads:
            place, what = profile.random_reads[0]
            return f"'{what}' read back at {place}"
    return None


def _job(
    target: Target,
    num_nodes: int,
    drop: str | None = None,
    unshardable: str | None = None,
    autocast: str | None = None,
) -> Job:
    """What decides which strategies the target can use (`strategies.recipes.available`):
    `drop` where the model skips layers at random, `unshardable` where FSDP2 cannot train the
    model and optimizer (`cannot_shard`), `autocast` where mixed precision is on and the model's
    forward raises under autocast (`autocast_raises`)."""
    return Job(
        target.world_size,
        target.distributed,
        num_nodes,
        target.device.type,
        own_group=target.world_size == 1 and not target.distributed and dist.is_available(),
        skips_layers=drop,
        cannot_shard=unshardable,
        autocast_raises=autocast,
    )


def _weighs_offload(target: Target, request: Request) -> bool:
    """Whether CPU offload may be weighed (the node count does not change that)."""
    offload = Strategy.CPU_OFFLOAD
    return request.strategy in (None, offload) and offload in available(_job(target, 1))


def progress(target: Target, message: str) -> None:
    """What the pipeline is doing, once (rank 0 of a job), through the "autoshard" logger: INFO,
    so shown when the script enables it (`logging.basicConfig(level=logging.INFO)`)."""
    if target.probe:
        return
    if not target.in_job or target.world.rank == 0:
        logger.info(message)
