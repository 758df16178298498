"""The only code that wraps modules. Applied in a fixed order, as torchtitan does:

1. move the model to the training device;
2. activation checkpointing on the first k blocks (before sharding, so FSDP2 shards the wrapper);
3. one of: FSDP2 `fully_shard` per block, then the root | DDP | nothing (one process);
   mixed precision is FSDP2's `MixedPrecisionPolicy` under FSDP, autocast otherwise;
4. re-bind the optimizer, in place, to the parameters as they now are.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from autoshard._optim import parameter_names, rebind
from autoshard._plan import Plan
from autoshard._strategy import Strategy
from autoshard._world import World

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


def apply(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    world: World,
    block_names: list[str],
) -> tuple[nn.Module, Any]:
    """Wrap `model` as `plan` says and re-bind `optimizer`; return (model, gradient scaler|None)."""
    names = parameter_names(model)
    model.to(world.device)
    blocks = checkpoint_blocks(model, block_names[: plan.activation_checkpointing], block_names)
    dtype = DTYPES[plan.mixed_precision]
    if plan.strategy.sharded:
        wrapped = _fully_shard(model, blocks, plan.strategy, dtype, world)
    else:
        if dtype is not None:
            autocast_forward(model, world.device.type, dtype)
        wrapped = _ddp(model, world) if plan.strategy == Strategy.DDP else model
    rebind(optimizer, names, wrapped_parameters(model))
    return wrapped, _grad_scaler(plan, world)


def checkpoint_blocks(model: nn.Module, names: list[str], all_names: list[str]) -> list[nn.Module]:
    """Wrap the named blocks in `checkpoint_wrapper` (non-reentrant) where they sit in their
    parent; return every block, wrapped or not, in order."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    for name in names:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        block = getattr(parent, attribute)
        setattr(
            parent,
            attribute,
            checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        )
    return [model.get_submodule(name) for name in all_names]


def wrapped_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by their original qualified name (checkpoint wrappers add a path component)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return {name.replace(_CHECKPOINT_PREFIX, ""): p for name, p in model.named_parameters()}


def autocast_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run `module.forward` under autocast and return floating outputs in fp32 (as accelerate
    does), so a loss computed outside the model keeps full precision. Undone by
    `del module.forward`."""
    forward = module.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            output = forward(*args, **kwargs)
        return tree_map(_to_fp32, output)

    module.forward = autocast_forward  # type: ignore[method-assign]


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    return x


def _ddp(model: nn.Module, world: World) -> nn.Module:
    device_ids = [world.device.index] if world.device.type == "cuda" else None
    # gradient_as_bucket_view: gradients are views into the all-reduce buckets, saving one full
    # copy of the gradients (DESIGN.md section 3 measured that copy on gloo).
    return nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, gradient_as_bucket_view=True
    )


def _fully_shard(
    model: nn.Module,
    blocks: list[nn.Module],
    strategy: Strategy,
    dtype: torch.dtype | None,
    world: World,
) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _sync_from_rank0(model)
    # An explicit mesh: without it FSDP2 may pick CUDA on a CPU/gloo job (DESIGN.md section 3).
    mesh = init_device_mesh(world.device.type, (world.world_size,))
    reshard = strategy == Strategy.FULL_SHARD
    # Blocks keep their outputs in the compute dtype; only the root casts back to fp32, so the
    # loss is computed in full precision as under autocast, without fp32 copies between blocks.
    inner = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    outer = MixedPrecisionPolicy(
        param_dtype=dtype,
        reduce_dtype=torch.float32 if dtype else None,
        output_dtype=torch.float32 if dtype else None,
    )
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=inner)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=outer)
    return model


def _sync_from_rank0(model: nn.Module) -> None:
    """Broadcast parameters and buffers from rank 0 before sharding, as DDP does on construction:
    FSDP2 takes each rank's own slice, so ranks initialised differently would train a mixture."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _grad_scaler(plan: Plan, world: World) -> Any:
    if plan.mixed_precision != "fp16":
        return None
    if plan.strategy.sharded:
        # Each rank sees only its gradient shard: the scaler must agree on inf/NaN across ranks.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(world.device.type)
    return torch.amp.GradScaler(world.device.type)
