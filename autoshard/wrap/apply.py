"""Wrapping the user's model, the one way for every route: `apply` moves a model to (strategy,
checkpointed blocks) the first time and for each of the trial's fallbacks, reading what to do from
the strategy's recipe (`strategies.recipes`) and calling its engine (`strategies.engines`), in a
fixed order, as torchtitan does:

1. activation checkpointing on the first k blocks (each block's forward run inside
   `torch.utils.checkpoint`, `engines.checkpoint_block`: no change to the module tree or
   parameter names, and more blocks can be checkpointed later in place);
2. one of: FSDP2 `fully_shard` per block, then the root (each call moves only that unit to the
   device, so the unsharded model never sits on the GPU whole) | the model moved to the device,
   then DDP or nothing (one process); mixed precision is FSDP2's `MixedPrecisionPolicy` under
   FSDP, autocast hooks otherwise;
3. re-bind the optimizer, in place, to the parameters as they now are.

`Wrapping` keeps what has been applied so that the trial step can move to a more frugal rung
without starting over, as far as the recipe's `falls_back_to` allows: more checkpointed blocks in
place, ZeRO-2 -> ZeRO-3 in place (`engines.set_unit_resharding`), and DDP -> FSDP by unwrapping
DDP (which leaves the module as it was). tests/test_routes.py checks that every route to a
strategy builds the same model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoshard._world import World, own_group
from autoshard.collective import agree_here
from autoshard.decide.precision import Precision
from autoshard.strategies.engines import (
    autocast_hooks,
    checkpoint_block,
    make_ddp,
    make_mesh,
    set_unit_resharding,
    shard_module,
    sync_from_rank0,
)
from autoshard.strategies.recipes import Engine, recipe
from autoshard.strategies.strategy import Strategy
from autoshard.wrap.optim import parameter_names, rebind


@dataclass
class Wrapping:
    """What has been applied to one model so far."""

    module: nn.Module  # the user's module, mutated in place by checkpoint / fully_shard
    block_names: list[str]
    world: World
    mixed_precision: Precision
    names: dict[int, str]  # id(original parameter) -> qualified name, taken before anything
    strategy: Strategy | None = None
    checkpointed: int = 0
    ddp: nn.Module | None = None
    scaler: Any = None
    autocast: list[Any] = field(default_factory=list)  # hook handles
    find_unused: bool = False  # some parameters get no gradient (from the trace)
    notes: list[str] = field(default_factory=list)

    @property
    def model(self) -> nn.Module:
        """What the caller trains: the DDP wrapper, or the (possibly sharded) module itself."""
        return self.ddp if self.ddp is not None else self.module


def start(
    module: nn.Module,
    block_names: list[str],
    world: World,
    mixed_precision: Precision,
    find_unused: bool,
) -> Wrapping:
    names = parameter_names(module)
    return Wrapping(module, block_names, world, mixed_precision, names, find_unused=find_unused)


def apply(
    wrapping: Wrapping, optimizer: torch.optim.Optimizer, strategy: Strategy, checkpointed: int
) -> None:
    """Move `wrapping` to (strategy, checkpointed): the one way a model is wrapped, the first time
    and by the trial's fallbacks. Once applied, only the moves the current recipe allows in
    place (`Recipe.falls_back_to`) are possible, and more checkpointed blocks.

    Whatever fails on one rank is raised on every rank before the next collective: the steps
    each rank takes alone run inside an agreement (`collective.agree_here`), and the collectives
    between them (rank 0's parameters broadcast, the mesh, DDP's construction) only once every
    rank got there."""
    target = recipe(strategy)
    current = recipe(wrapping.strategy) if wrapping.strategy is not None else None
    assert current is None or current.can_fall_back_to(strategy), (current, strategy)
    if target.engine is not Engine.NONE and not wrapping.world.distributed:
        # one process under plain python, and a wrapper that helps it alone (CPU offload)
        wrapping.world = own_group(wrapping.world, str(strategy))
        wrapping.notes.append(wrapping.world.reasons[-1])
    world = wrapping.world
    what = f"wrapping the model as {strategy}"
    agree_here(world, what, lambda: _before_collectives(wrapping, strategy, checkpointed))
    mesh = None
    if target.sharded and not (current is not None and current.sharded):
        sync_from_rank0(wrapping.module, world.device)
        mesh = make_mesh(target, world)
    elif target.engine is Engine.DDP and wrapping.ddp is None:  # also after a failed attempt
        wrapping.ddp = ddp(wrapping)  # its construction broadcasts rank 0's parameters
    agree_here(world, what, lambda: _after_collectives(wrapping, optimizer, strategy, mesh))


def _before_collectives(wrapping: Wrapping, strategy: Strategy, checkpointed: int) -> None:
    checkpoint_blocks(wrapping, checkpointed)
    current, target = wrapping.strategy, recipe(strategy)
    if current == strategy or (current is not None and recipe(current).sharded):
        return
    if target.sharded:
        _unwrap_ddp(wrapping)
        return
    wrapping.module.to(wrapping.world.device)
    dtype = wrapping.mixed_precision.dtype
    if dtype is not None and not wrapping.autocast:
        wrapping.autocast = autocast_hooks(wrapping.module, wrapping.world.device.type, dtype)


def _after_collectives(
    wrapping: Wrapping, optimizer: torch.optim.Optimizer, strategy: Strategy, mesh: Any
) -> None:
    if wrapping.strategy == strategy:
        return
    target = recipe(strategy)
    if mesh is not None:
        dtype = wrapping.mixed_precision.dtype
        shard_module(wrapping.module, wrapping.block_names, mesh, strategy, dtype)
    elif target.sharded:  # FSDP2 in place: only resharding can change
        set_unit_resharding(wrapping.module, target.reshard_after_forward)
    wrapping.strategy = strategy
    wrapping.scaler = grad_scaler(wrapping)
    rebind(optimizer, wrapping.names, dict(wrapping.module.named_parameters()))
    wrapping.names = parameter_names(wrapping.module)  # the optimizer now holds these objects


def checkpoint_blocks(wrapping: Wrapping, count: int) -> None:
    """Checkpoint the first `count` blocks (those not checkpointed yet)."""
    for name in wrapping.block_names[wrapping.checkpointed : count]:
        checkpoint_block(wrapping.module.get_submodule(name))
    wrapping.checkpointed = max(wrapping.checkpointed, count)


def ddp(wrapping: Wrapping) -> nn.Module:
    return make_ddp(wrapping.module, wrapping.world.device, wrapping.find_unused)


def _unwrap_ddp(wrapping: Wrapping) -> None:
    """Drop the DDP wrapper (its reducer and hooks go with it) and the autocast forward."""
    wrapping.ddp = None
    for handle in wrapping.autocast:
        handle.remove()
    wrapping.autocast = []
    for param in wrapping.module.parameters():
        param.grad = None  # bucket views would keep DDP's buckets alive


@contextlib.contextmanager
def gradient_sync(model: nn.Module, on: bool) -> Iterator[None]:
    """Gradient sync across ranks on or off for the backward passes inside, as a training loop
    accumulating gradients does it: DDP's `no_sync()`, FSDP2's `set_requires_gradient_sync`
    (back on afterwards); nothing to do for one process."""
    from torch.distributed.fsdp import FSDPModule

    if on:
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def grad_scaler(wrapping: Wrapping) -> Any:
    """A fresh gradient scaler for fp16, else None."""
    if wrapping.mixed_precision != Precision.FP16:
        return None
    device_type = wrapping.world.device.type
    if wrapping.strategy is not None and recipe(wrapping.strategy).sharded:
        # Each rank sees only its gradient shard: the scaler must agree on inf/NaN across ranks.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type)
    return torch.amp.GradScaler(device_type)
