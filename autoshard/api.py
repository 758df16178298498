"""prepare() and plan(): measure, agree across ranks, decide, wrap, prove."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader

from autoshard._batch import LossFn, batch_for_meta
from autoshard._units import parse_bytes
from autoshard._world import (
    Memory,
    RankReport,
    World,
    launched_world_size,
    local_memory,
    resolve,
)
from autoshard.collective import agree
from autoshard.decide.blocks import blocks_and_notes
from autoshard.decide.candidates import after_trial, all_candidates, decide, strategies_for
from autoshard.decide.consistent import (
    buffer_digests,
    fingerprint,
    raise_if_inconsistent,
    warn_if_buffers_differ,
)
from autoshard.decide.plan import Candidate, Plan
from autoshard.decide.validate import (
    Request,
    check_batch_device,
    check_model,
    check_optimizer,
    check_request,
)
from autoshard.io.data import check_dataloader, warn_if_unsharded
from autoshard.measure.facts import (
    blocks_reason,
    forced_checkpointing,
    measure,
    plan_inputs,
    resolve_mixed_precision,
    usable_host_memory,
    usable_memory,
    with_resident,
    with_simulation,
    worst,
)
from autoshard.wrap.apply import DTYPES, start
from autoshard.wrap.snapshot import kept_grads, put_back_grads
from autoshard.wrap.trial import prove

logger = logging.getLogger("autoshard")


class _PreparedFields(NamedTuple):
    model: nn.Module
    optimizer: torch.optim.Optimizer
    plan: Plan


class Prepared(_PreparedFields):
    """What `prepare` returns: unpack as `model, optimizer, plan = prepare(...)`.

    Attributes:
        model: DistributedDataParallel, an FSDP2 module (the module passed in), or the module
            itself.
        optimizer: the optimizer passed in, re-bound in place to the wrapped parameters.
        plan: what was chosen and why.
        scaler: a gradient scaler when fp16 mixed precision is on (use it as
            `scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()`), else None.
    """

    scaler: Any

    def __new__(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, scaler: Any = None
    ) -> Prepared:
        self = super().__new__(cls, model, optimizer, plan)
        self.scaler = scaler
        return self


def _validate(
    model: Any, optimizer: Any, loss_fn: Any, options: dict[str, Any], allow_meta: bool = False
) -> Request:
    check_model(model, allow_meta=allow_meta)
    check_optimizer(model, optimizer)
    return check_request(loss_fn=loss_fn, **options)


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: Any = None,
    *,
    loss_fn: LossFn | None = None,
    strategy: str = "auto",
    mixed_precision: str = "auto",
    activation_checkpointing: str | int | bool = "auto",
    memory_limit: int | str | None = None,
    trial_step: bool = True,
    dataloader: DataLoader[Any] | None = None,
    accumulation_steps: int = 1,
) -> Prepared:
    """Choose the fastest wrapping that fits, apply it, prove it with one trial step.

    Args:
        model: the unwrapped module, identical on every rank (parameters are broadcast from
            rank 0 before sharding, as DDP does).
        optimizer: built on `model.parameters()`; returned as the same object, re-bound in place.
        example_batch: one batch as this rank feeds it: a Mapping is passed as keyword arguments,
            a tuple/list as positional ones, a tensor as the only argument. Its activations are
            traced (no real memory) and the trial step trains on it.
        loss_fn: `loss_fn(output, batch) -> loss`; default `output.loss`, else the output summed.
        strategy: "auto", "ddp", "shard_grad_op", "full_shard" (or a `Strategy`).
        mixed_precision: "auto" (bf16 where supported, fp16 + scaler on older GPUs), "bf16",
            "fp16" or "no".
        activation_checkpointing: "auto" (as few blocks as needed to fit), a number of blocks,
            True (all) or False (none).
        memory_limit: caps the usable memory per rank: bytes or a string such as "20GiB".
        trial_step: run one real training step on `example_batch` and fall back on OOM; the
            model, optimizer and RNG are restored to what was passed in afterwards.
        dataloader: the training DataLoader, only checked: under several ranks a loader that
            is not sharded (see `shard_dataloader`) draws a warning, once per process.
        accumulation_steps: micro-batches (each like `example_batch`) whose gradients are
            summed before each optimizer step: the gradients accumulated so far are planned
            beside each micro-batch's activations, and the trial step runs that many, with
            gradient sync off (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`) on all
            but the last.

    Returns:
        `Prepared(model, optimizer, plan)`, with `.scaler` for fp16.

    Raises:
        TypeError, ValueError: bad arguments, on any rank (raised on every rank, before anything
            is changed); `DoesNotFit` (a ValueError) when no candidate fits. Any exception raised
            on one rank before the trial is raised on every rank: the same type (or
            `PeerError`) naming the failing rank and its message.
        PeerTimeout: a rank did not reach an agreement point within the agreement timeout
            (`autoshard.set_agreement_timeout`, default 300 s); it names the rank.
    """
    options = dict(
        strategy=strategy,
        mixed_precision=mixed_precision,
        activation_checkpointing=activation_checkpointing,
        memory_limit=memory_limit,
        trial_step=trial_step,
        accumulation_steps=accumulation_steps,
    )
    world = resolve(init=True)
    decision = _decide_everywhere(
        model, optimizer, example_batch, loss_fn, world, options, dataloader
    )
    warn_if_unsharded(dataloader, world)
    plan_ = decision.plan
    _progress(
        world,
        f"chose {plan_.strategy} with {plan_.activation_checkpointing}/{plan_.num_blocks} blocks "
        f"checkpointed; wrapping the model"
        + ("; running the trial step" if trial_step and example_batch is not None else ""),
    )
    grads = kept_grads(model)  # copied aside and cleared; put back whatever happens
    try:
        wrapping = start(
            model, decision.block_names, world, decision.plan.mixed_precision, decision.find_unused
        )
        result = prove(
            wrapping,
            optimizer,
            decision.first,
            decision.rungs,
            example_batch,
            loss_fn,
            trial_step,
            decision.plan.device_memory_bytes,
            decision.memory_limit,
            decision.accumulation_steps,
        )
    finally:
        put_back_grads(model, grads)
    final = after_trial(
        decision.plan, result.chosen, result.attempts, result.measured_peak, result.notes
    )
    if world.rank == 0:
        logger.info("prepared:\n%s", final)
        for reason in final.reasons:
            if reason.startswith("warning: the trial step measured"):
                logger.warning(reason)
    return Prepared(wrapping.model, optimizer, final, wrapping.scaler)


def _progress(world: World, message: str) -> None:
    """What prepare is doing, once (rank 0), through the "autoshard" logger: INFO, so shown when
    the script enables it (`logging.basicConfig(level=logging.INFO)`; the demo does)."""
    if world.rank == 0:
        logger.info(message)


@dataclass(frozen=True)
class _Decision:
    """What every rank decided, from the same agreed data."""

    plan: Plan
    first: Candidate  # the chosen candidate: the trial's first rung
    rungs: list[Candidate]  # every rung the trial may fall back to
    block_names: list[str]
    memory_limit: int | None
    find_unused: bool  # some trainable parameters got no gradient on some rank's trace
    accumulation_steps: int


def _decide_everywhere(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: Any,
    loss_fn: LossFn | None,
    world: World,
    options: dict[str, Any],
    dataloader: Any,
) -> _Decision:
    """Check and measure here, agree with every rank (every rank raises if any rank's arguments
    were bad or its checks failed, whatever the exception), then decide from the agreed data, the
    same everywhere."""
    here: dict[str, Any] = {}

    def measure_here() -> RankReport:
        request = _validate(model, optimizer, loss_fn, options)
        check_dataloader(dataloader)
        check_batch_device(example_batch, request_trial=bool(options["trial_step"]))
        found, block_notes = blocks_and_notes(model)
        names, blocks = [n for n, _ in found], [m for _, m in found]
        mp, mp_reason = resolve_mixed_precision(request.mixed_precision, world.device, model)
        _progress(world, "tracing one step of the example batch for its activations")
        measured = measure(model, blocks, example_batch, loss_fn, DTYPES[mp], names)
        if measured.user_error is not None:
            raise ValueError(measured.user_error)
        reasons = [*world.reasons, mp_reason, blocks_reason(model, names), *block_notes]
        here.update(request=request, names=names, blocks=blocks, mp=mp, reasons=reasons)
        return RankReport(
            world.rank,
            socket.gethostname(),
            with_resident(local_memory(world), model, optimizer, world.device),
            fingerprint(model, optimizer, example_batch, request, loss_fn, options["trial_step"]),
            None,
            measured,
            buffer_digests(model),
        )

    reports = agree(world, "prepare()", measure_here)
    raise_if_inconsistent(reports)
    differing = warn_if_buffers_differ(reports, world.rank)
    request, names, blocks, mp = here["request"], here["names"], here["blocks"], here["mp"]
    measured = reports[world.rank].measured
    reasons: list[str] = here["reasons"]
    if differing:
        reasons.append(
            f"{len(differing)} buffer(s) differed between ranks (e.g. '{differing[0]}'): every "
            f"rank now holds rank 0's"
        )
    usable, usable_reason = usable_memory(reports, request.memory_limit)
    unused = sorted(
        {n for r in reports if r.measured.profile for n in r.measured.profile.unused_parameters}
    )
    if unused:
        reasons.append(
            f"{len(unused)} trainable parameter(s) got no gradient in the traced step (e.g. "
            f"'{unused[0]}'): under DDP, find_unused_parameters=True"
        )
    inputs = plan_inputs(
        model,
        optimizer,
        blocks,
        example_batch,
        worst([r.measured.profile for r in reports]),
        world.world_size,
        _nodes(reports, world),
        usable,
        world.device,
        mp,
        [*reasons, usable_reason, measured.trace_note],
        request.accumulation_steps,
    )
    forced_ac = forced_checkpointing(request, len(blocks))
    strategies = strategies_for(
        world.world_size, world.distributed, inputs.num_nodes, world.device.type
    )
    inputs = replace(inputs, host_usable_bytes=usable_host_memory(reports))
    if world.distributed:  # one process: the simulation says so, run by run
        _progress(world, f"simulating {', '.join(map(str, strategies))} on fake tensors")
    inputs = with_simulation(
        inputs,
        model,
        optimizer,
        names,
        example_batch,
        loss_fn,
        world.device,
        request,
        strategies,
        shared=True,
    )
    plan = replace(
        decide(inputs, strategies, request.strategy, forced_ac), unused_parameters=tuple(unused)
    )
    chosen = (plan.strategy, plan.activation_checkpointing)
    first = next(c for c in plan.candidates if (c.strategy, c.activation_checkpointing) == chosen)
    rungs = all_candidates(inputs, strategies, request.strategy, forced_ac)
    return _Decision(
        plan, first, rungs, names, request.memory_limit, bool(unused), request.accumulation_steps
    )


def plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: Any = None,
    *,
    world_size: int | None = None,
    num_nodes: int = 1,
    device_memory: int | str | None = None,
    loss_fn: LossFn | None = None,
    strategy: str = "auto",
    mixed_precision: str = "auto",
    activation_checkpointing: str | int | bool = "auto",
    memory_limit: int | str | None = None,
    device: str | None = None,
    host_memory: int | str | None = None,
    accumulation_steps: int = 1,
) -> Plan:
    """Decide only: no process group is needed and nothing is wrapped (what-if planning).

    Args:
        model, optimizer, example_batch, loss_fn, strategy, mixed_precision,
        activation_checkpointing, memory_limit: as for `prepare`.
        world_size: ranks to plan for (default: the current process group's size, else the
            number of processes torchrun or accelerate launch started, else 1).
        num_nodes: nodes the ranks span (for the bandwidth the cost model assumes).
        device_memory: free memory of each rank's device, bytes or "80GiB" (default: measured
            on this machine).
        device: "cuda" or "cpu", what the ranks train on (default: this machine's device). A
            "cuda" plan made without a GPU assumes bf16-capable GPUs (capability 8.0 or newer).
        host_memory: host RAM per rank for CPU offload, bytes or "64GiB" (default: measured on
            this machine when it trains on its own GPUs, else not checked).
        accumulation_steps: as for `prepare`: micro-batches per optimizer step.
    """
    request = _validate(
        model,
        optimizer,
        loss_fn,
        dict(
            strategy=strategy,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            memory_limit=memory_limit,
            trial_step=False,
            accumulation_steps=accumulation_steps,
        ),
        allow_meta=True,
    )
    world = resolve(init=False)
    # Under torchrun or accelerate launch before any process group exists (an Accelerator is
    # built after planning), the job still has the launched number of ranks.
    job_size = world.world_size if world.distributed else launched_world_size()
    size = job_size if world_size is None else world_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if device_memory is None:
        memory = local_memory(world)
    else:
        free = parse_bytes(device_memory, what="device_memory")
        memory = Memory(free, free, "device_memory given by the caller")
    target = _target_device(device, world.device)
    host = None if host_memory is None else parse_bytes(host_memory, what="host_memory")
    if host is None and target.type == "cuda" and torch.cuda.is_available():
        host = local_memory(world).host_free_bytes
    found, block_notes = blocks_and_notes(model)
    names, blocks = [n for n, _ in found], [m for _, m in found]
    mp, mp_reason = resolve_mixed_precision(request.mixed_precision, target, model)
    example_batch, meta_note = batch_for_meta(model, example_batch)
    logger.info("tracing one step of the example batch for its activations")
    measured = measure(model, blocks, example_batch, loss_fn, DTYPES[mp], names)
    if measured.user_error is not None:
        raise ValueError(measured.user_error)
    report = RankReport(0, "planner", memory, (), None, measured)
    usable, usable_reason = usable_memory([report], request.memory_limit)
    inputs = plan_inputs(
        model,
        optimizer,
        blocks,
        example_batch,
        measured.profile,
        size,
        num_nodes,
        usable,
        target,
        mp,
        [
            mp_reason,
            blocks_reason(model, names),
            *block_notes,
            usable_reason,
            *([meta_note] if meta_note else []),
            measured.trace_note,
        ],
        request.accumulation_steps,
    )
    inputs = replace(inputs, host_usable_bytes=host)
    forced_ac = forced_checkpointing(request, len(blocks))
    strategies = strategies_for(
        size, world_size is not None or world.distributed or job_size > 1, num_nodes, target.type
    )
    if world.distributed and size != world.world_size:
        note = f"estimates are analytic: a what-if for {size} ranks in a job of {world.world_size}"
        inputs = replace(inputs, reasons=(*inputs.reasons, note))
    else:
        inputs = with_simulation(
            inputs,
            model,
            optimizer,
            names,
            example_batch,
            loss_fn,
            target,
            request,
            strategies,
        )
    decided = decide(inputs, strategies, request.strategy, forced_ac)
    unused = measured.profile.unused_parameters if measured.profile is not None else ()
    return replace(decided, unused_parameters=unused)


def _target_device(device: str | None, here: torch.device) -> torch.device:
    if device is None:
        return here
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def _nodes(reports: list[RankReport], world: World) -> int:
    """Nodes the job spans: distinct hosts, or as the launcher laid the ranks out
    (WORLD_SIZE / LOCAL_WORLD_SIZE), whichever is more."""
    return max(len({r.host for r in reports}), world.world_size // max(world.local_world_size, 1))
