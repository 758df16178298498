"""prepare() and plan(): both run the one decision pipeline (`pipeline.run`); prepare() then wraps
and proves the choice with a trial step."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader

from autoshard._batch import LossFn
from autoshard._units import parse_bytes
from autoshard._world import Memory, launched_world_size, local_memory, resolve
from autoshard.decide.candidates import after_trial
from autoshard.decide.plan import Plan
from autoshard.io.data import warn_if_unsharded
from autoshard.pipeline import Call, Target, progress, run
from autoshard.wrap.apply import start
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
    max_batch: bool = False,
    batch_size: int | None = None,
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
            model (with the attributes its forward keeps), optimizer and RNG are restored to
            what was passed in afterwards.
        dataloader: the training DataLoader, only checked: under several ranks a loader that
            is not sharded (see `shard_dataloader`) draws a warning, once per process.
        accumulation_steps: micro-batches (each like `example_batch`) whose gradients are
            summed before each optimizer step: the gradients accumulated so far are planned
            beside each micro-batch's activations, and the trial step runs that many, with
            gradient sync off (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`) on all
            but the last.
        max_batch: also find each candidate's largest per-rank batch that fits (`Plan.max_batch`,
            `Candidate.max_batch`), by simulating a few batch sizes (seconds each): the same
            figure on every rank, the least any rank found.
        batch_size: the example batch's size along its batch dimension, where its tensors'
            leading sizes differ (default: the leading size they share).

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
        max_batch=max_batch,
        batch_size=batch_size,
    )
    world = resolve(init=True)
    target = Target(world, world.world_size, world.distributed, world.device, in_job=True)
    call = Call(model, optimizer, example_batch, loss_fn, options, dataloader)
    decision, work = run(call, target)
    warn_if_unsharded(dataloader, world)
    plan_ = decision.plan
    progress(
        target,
        f"chose {plan_.strategy} with {plan_.activation_checkpointing}/{plan_.num_blocks} blocks "
        f"checkpointed; wrapping the model"
        + ("; running the trial step" if trial_step and example_batch is not None else ""),
    )
    grads = kept_grads(model)  # copied aside and cleared; put back whatever happens
    try:
        wrapping = start(
            model,
            list(decision.block_names),
            replace(world, num_nodes=decision.num_nodes),
            plan_.mixed_precision,
            decision.find_unused,
        )
        result = prove(wrapping, decision, work)
    finally:
        put_back_grads(model, grads)
    final = after_trial(plan_, result.chosen, result.attempts, result.measured_peak, result.notes)
    if world.rank == 0:
        _log(final)
    return Prepared(wrapping.model, optimizer, final, wrapping.scaler)


def _log(final: Plan) -> None:
    """The plan at INFO; a trial that measured more than the estimate as a WARNING too, unless
    the plan just logged carries it already (its reasons): said once either way."""
    logger.info("prepared:\n%s", final)
    if logger.isEnabledFor(logging.INFO):
        return
    for reason in final.reasons:
        if reason.startswith("warning: the trial step measured"):
            logger.warning(reason)


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
    max_batch: bool = False,
    batch_size: int | None = None,
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
        max_batch, batch_size: as for `prepare`: each candidate's largest per-rank batch.
    """
    options = dict(
        strategy=strategy,
        mixed_precision=mixed_precision,
        activation_checkpointing=activation_checkpointing,
        memory_limit=memory_limit,
        trial_step=False,
        accumulation_steps=accumulation_steps,
        max_batch=max_batch,
        batch_size=batch_size,
    )
    world = resolve(init=False)
    # Under torchrun or accelerate launch before any process group exists (an Accelerator is
    # built after planning), the job still has the launched number of ranks.
    job_size = world.world_size if world.distributed else launched_world_size()
    size = job_size if world_size is None else world_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    trains_on = _target_device(device, world.device)
    host = None if host_memory is None else parse_bytes(host_memory, what="host_memory")
    if host is None and trains_on.type == "cuda" and torch.cuda.is_available():
        host = local_memory(world).host_free_bytes
    if device_memory is None:
        memory = local_memory(world)
    else:
        free = parse_bytes(device_memory, what="device_memory")
        memory = Memory(free, free, "device_memory given by the caller")
    target = Target(
        world,
        size,
        world_size is not None or world.distributed or job_size > 1,
        trains_on,
        in_job=False,
        num_nodes=num_nodes,
        memory=replace(memory, host_free_bytes=host),
        simulate=not (world.distributed and size != world.world_size),
    )
    decision, _ = run(Call(model, optimizer, example_batch, loss_fn, options), target)
    return decision.plan


def _target_device(device: str | None, here: torch.device) -> torch.device:
    if device is None:
        return here
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and torch.cuda.is_available():
        # this rank's GPU (`_world.rank_device`), not the current one: GPU 0 for every rank
        # under torchrun before a process group
        return here if here.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)
