"""Both routes to each strategy build the same model: wrapped fresh, or reached by the trial's
in-place fallbacks (DDP -> any FSDP2 strategy, ZeRO-2 -> ZeRO-3), through `wrap.apply`. Compared:
which parameters are sharded after forward (the resharding of every FSDP2 unit, the root's
included, which is left to torch's default), the wrapper, the mesh and placements, the autocast
hooks, the checkpointed blocks, and the parameters after one step, bitwise. The model has batch
norms, which bf16 makes FSDP2 units of their own.

Usage (from tests/_dist.py): torchrun --nproc-per-node 2 routes.py OUT_DIR
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from _common import Cases, build, local_batches
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard._world import resolve
from autoshard.decide.blocks import find_blocks
from autoshard.decide.precision import Precision
from autoshard.strategies.strategy import Strategy
from autoshard.wrap.apply import Wrapping, apply, start

CHECKPOINTED = 2
# (case name, strategy, the strategies applied before it; () is the fresh route)
ROUTES = [
    ("shard_grad_op_fresh", "shard_grad_op", ()),
    ("shard_grad_op_via_ddp", "shard_grad_op", ("ddp",)),
    ("full_shard_fresh", "full_shard", ()),
    ("full_shard_via_ddp", "full_shard", ("ddp",)),
    ("full_shard_via_shard_grad_op", "full_shard", ("shard_grad_op",)),
    ("full_shard_via_ddp_and_shard_grad_op", "full_shard", ("ddp", "shard_grad_op")),
    ("hybrid_shard_fresh", "hybrid_shard", ()),
    ("hybrid_shard_via_ddp", "hybrid_shard", ("ddp",)),
]
cases = Cases()


def _wrapped(strategy: str, before: tuple[str, ...]) -> tuple[Wrapping, torch.optim.Optimizer]:
    model, optimizer = build(batchnorm=True)
    world = resolve(init=False)
    if strategy == "hybrid_shard":  # each rank its own node: a (2, 1) mesh
        world = dataclasses.replace(world, local_world_size=1)
    names = [n for n, _ in find_blocks(model)]
    wrapping = start(model, names, world, Precision.BF16, find_unused=False)
    for earlier in before:  # as the trial gets there: an attempt ran, then the next rung
        apply(wrapping, optimizer, Strategy(earlier), 0)
    apply(wrapping, optimizer, Strategy(strategy), CHECKPOINTED)
    return wrapping, optimizer


def _sharded(module: nn.Module) -> dict[str, bool]:
    return {n: isinstance(p, DTensor) for n, p in module.named_parameters()}


def _route(strategy: str, before: tuple[str, ...]) -> dict[str, Any]:
    wrapping, optimizer = _wrapped(strategy, before)
    model, module = wrapping.model, wrapping.module
    batch = local_batches(1)[0]
    loss = model(**batch)["loss"]
    after_forward = _sharded(module)  # a unit that reshards after forward shows DTensors here
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = {
        n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in module.named_parameters()
    }
    some = next(p for p in module.parameters() if isinstance(p, DTensor))
    return {
        "wrapper": type(model).__name__,
        "module": type(module).__name__,
        "after_forward": after_forward,
        "mesh": list(some.device_mesh.shape),
        "placements": [str(p) for p in some.placements],
        "autocast_hooks": len(wrapping.autocast),
        "checkpointed": wrapping.checkpointed,
        "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
        "loss": float(loss.detach()),
        "params": {n: p.detach().float().flatten().tolist() for n, p in params.items()},
    }


for _name, _strategy, _before in ROUTES:
    cases.case(lambda s=_strategy, b=_before: _route(s, b), name=_name)


if __name__ == "__main__":
    cases.main()
