"""The only code that wraps modules. Applied in a fixed order, as torchtitan does:

1. activation checkpointing on the first k blocks (composable `checkpoint`: hooks, no change to
   the module tree or parameter names, and more blocks can be checkpointed later in place);
2. one of: FSDP2 `fully_shard` per block, then the root (each call moves only that unit to the
   device, so the unsharded model never sits on the GPU whole) | the model moved to the device,
   then DDP or nothing (one process); mixed precision is FSDP2's `MixedPrecisionPolicy` under
   FSDP, autocast hooks otherwise;
3. re-bind the optimizer, in place, to the parameters as they now are.

`Wrapping` keeps what has been applied so that the trial step can move to a more frugal rung
without starting over: more checkpointed blocks in place, ZeRO-2 -> ZeRO-3 in place with
`set_reshard_after_forward`, and DDP -> FSDP by unwrapping DDP (which leaves the module as it was).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from autoshard._world import World
from autoshard.strategies.strategy import Strategy
from autoshard.wrap.optim import parameter_names, rebind

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


@dataclass
class Wrapping:
    """What has been applied to one model so far."""

    module: nn.Module  # the user's module, mutated in place by checkpoint / fully_shard
    block_names: list[str]
    world: World
    mixed_precision: str
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
    mixed_precision: str,
    find_unused: bool,
) -> Wrapping:
    names = parameter_names(module)
    return Wrapping(module, block_names, world, mixed_precision, names, find_unused=find_unused)


def apply(
    wrapping: Wrapping, optimizer: torch.optim.Optimizer, strategy: Strategy, checkpointed: int
) -> None:
    """Move `wrapping` to (strategy, checkpointed). Only escalations are possible once applied:
    more checkpointed blocks, and DDP -> SHARD_GRAD_OP -> FULL_SHARD."""
    checkpoint_blocks(wrapping, checkpointed)
    if wrapping.strategy == strategy:
        if strategy == Strategy.DDP and wrapping.ddp is None:  # dropped after a failed attempt
            wrapping.ddp = ddp(wrapping)
        return
    dtype = DTYPES[wrapping.mixed_precision]
    if wrapping.strategy == Strategy.SHARD_GRAD_OP and strategy == Strategy.FULL_SHARD:
        for name in wrapping.block_names:  # the root stays gathered, as fully_shard sets it
            wrapping.module.get_submodule(name).set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]
    elif strategy.sharded:
        _unwrap_ddp(wrapping)
        _fully_shard(wrapping, strategy, dtype)
    else:
        wrapping.module.to(wrapping.world.device)
        if dtype is not None and not wrapping.autocast:
            wrapping.autocast = autocast_hooks(wrapping.module, wrapping.world.device.type, dtype)
        if strategy == Strategy.DDP:
            wrapping.ddp = ddp(wrapping)
    wrapping.strategy = strategy
    wrapping.scaler = grad_scaler(wrapping)
    rebind(optimizer, wrapping.names, dict(wrapping.module.named_parameters()))
    wrapping.names = parameter_names(wrapping.module)  # the optimizer now holds these objects


def checkpoint_blocks(wrapping: Wrapping, count: int) -> None:
    """Checkpoint the first `count` blocks (those not checkpointed yet)."""
    for name in wrapping.block_names[wrapping.checkpointed : count]:
        checkpoint_block(wrapping.module.get_submodule(name))
    wrapping.checkpointed = max(wrapping.checkpointed, count)


def is_transformers_layer(module: nn.Module) -> bool:
    """A transformers layer that checkpoints itself (`GradientCheckpointingLayer`)."""
    return any(
        cls.__name__ == "GradientCheckpointingLayer" and cls.__module__.startswith("transformers")
        for cls in type(module).__mro__
    )


def checkpoint_block(module: nn.Module) -> None:
    """Activation-checkpoint one block. A transformers layer is checkpointed the way transformers
    does it (`gradient_checkpointing_enable` with `use_reentrant=False`), for this layer only:
    while training, its checkpointed forward also drops the KV cache, whose update in the
    recomputation would make it save other tensors than the forward did (T5, Whisper:
    "CheckpointError: ... A different number of tensors was saved"). Anything else gets torch's
    composable `checkpoint` (hooks: the module tree and parameter names stay as they are)."""
    if is_transformers_layer(module):
        from torch.utils.checkpoint import checkpoint as checkpointed

        setattr(module, "gradient_checkpointing", True)  # noqa: B010 - not a module attribute
        setattr(  # noqa: B010
            module,
            "_gradient_checkpointing_func",
            functools.partial(checkpointed, use_reentrant=False),
        )
        return
    from torch.distributed._composable import checkpoint

    checkpoint(module)


class _Autocast:
    """Forward hooks that run a module under autocast and return floating outputs in fp32 (as
    accelerate does), so a loss computed outside the model keeps full precision. Hooks rather
    than a patched `forward`: the module still deep-copies (EMA, eval copies) and pickles."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.active: list[Any] = []  # one context per forward in flight (re-entrant calls)

    def enter(self, module: nn.Module, args: Any) -> None:
        context = torch.autocast(self.device_type, dtype=self.dtype)
        context.__enter__()
        self.active.append(context)

    def leave(self, module: nn.Module, args: Any, output: Any) -> Any:
        self.active.pop().__exit__(None, None, None)
        return tree_map(_to_fp32, output)


def autocast_hooks(module: nn.Module, device_type: str, dtype: torch.dtype) -> list[Any]:
    """Run `module` under autocast; returns the hook handles that undo it."""
    hooks = _Autocast(device_type, dtype)
    return [
        module.register_forward_pre_hook(hooks.enter, prepend=True),
        # always_call: the context is left even when forward raises (an OOM in the trial step)
        module.register_forward_hook(hooks.leave, always_call=True),
    ]


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    return x


def ddp(wrapping: Wrapping) -> nn.Module:
    world = wrapping.world
    device_ids = [world.device.index] if world.device.type == "cuda" else None
    # gradient_as_bucket_view: gradients are views into the all-reduce buckets, saving one full
    # copy of the gradients (DESIGN.md section 3 measured that copy on gloo).
    # find_unused_parameters costs a graph walk every step: only when the trace found
    # parameters without a gradient, which otherwise make DDP fail on the second step.
    return nn.parallel.DistributedDataParallel(
        wrapping.module,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
        find_unused_parameters=wrapping.find_unused,
    )


def _unwrap_ddp(wrapping: Wrapping) -> None:
    """Drop the DDP wrapper (its reducer and hooks go with it) and the autocast forward."""
    wrapping.ddp = None
    for handle in wrapping.autocast:
        handle.remove()
    wrapping.autocast = []
    for param in wrapping.module.parameters():
        param.grad = None  # bucket views would keep DDP's buckets alive


def _fully_shard(wrapping: Wrapping, strategy: Strategy, dtype: torch.dtype | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    module, world = wrapping.module, wrapping.world
    sync_from_rank0(module, world.device)
    # An explicit mesh: without it FSDP2 may pick CUDA on a CPU/gloo job (DESIGN.md section 3).
    if strategy == Strategy.HYBRID_SHARD:  # replicate across nodes, shard within each
        nodes = world.world_size // world.local_world_size
        mesh = init_device_mesh(
            world.device.type,
            (nodes, world.local_world_size),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh(world.device.type, (world.world_size,))
    shard_module(module, wrapping.block_names, mesh, strategy, dtype)


def shard_module(
    module: nn.Module,
    block_names: list[str],
    mesh: Any,
    strategy: Strategy,
    dtype: torch.dtype | None,
) -> None:
    """`fully_shard` each block, then the root, over `mesh` (also `measure.simulate`'s fake mesh); a
    2-D mesh (replicate, shard) makes it HSDP."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    reshard = strategy.reshards
    offload = CPUOffloadPolicy() if strategy == Strategy.CPU_OFFLOAD else OffloadPolicy()
    reduce = torch.float32 if dtype is not None else None
    # Blocks keep their outputs in the compute dtype; only the root casts back to fp32, so a loss
    # computed outside the model is in full precision as under autocast, without fp32 copies
    # between blocks. A loss computed inside forward (Hugging Face style) runs in param_dtype.
    inner = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce)
    outer = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce, output_dtype=reduce)
    if dtype is not None:
        # Batch norm keeps its running statistics in fp32, and its kernel wants input, weight and
        # statistics in one dtype: cast to param_dtype it fails ("expected scalar type BFloat16
        # but found Float"). As autocast does, it runs in fp32: each one its own FSDP2 unit that
        # keeps fp32 parameters, takes its input in fp32 and hands its output back in dtype.
        norm = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=dtype
        )
        for sub in module.modules():
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) and any(
                True for _ in sub.parameters(recurse=False)
            ):
                fully_shard(
                    sub,
                    mesh=mesh,
                    reshard_after_forward=reshard,
                    mp_policy=norm,
                    offload_policy=offload,
                )
    for name in block_names:
        fully_shard(
            module.get_submodule(name),
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=inner,
            offload_policy=offload,
        )
    fully_shard(
        module, mesh=mesh, reshard_after_forward=reshard, mp_policy=outer, offload_policy=offload
    )


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


def sync_from_rank0(module: nn.Module, device: torch.device) -> None:
    """Broadcast parameters and buffers from rank 0 before sharding, as DDP does on construction:
    FSDP2 takes each rank's own slice, so ranks initialised differently would train a mixture.
    NCCL moves only CUDA tensors: a tensor still on the host goes through a device copy, one at a
    time, so the whole model is never on the device at once."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if device.type == "cpu" or tensor.device == device:
                dist.broadcast(tensor.data, src=0)
                continue
            staged = tensor.data.to(device)
            dist.broadcast(staged, src=0)
            tensor.data.copy_(staged)
            del staged


def grad_scaler(wrapping: Wrapping) -> Any:
    """A fresh gradient scaler for fp16, else None."""
    if wrapping.mixed_precision != "fp16":
        return None
    device_type = wrapping.world.device.type
    if wrapping.strategy is not None and wrapping.strategy.sharded:
        # Each rank sees only its gradient shard: the scaler must agree on inf/NaN across ranks.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type)
    return torch.amp.GradScaler(device_type)
