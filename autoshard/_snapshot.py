"""What one training step mutates, copied aside and put back bitwise: parameters and buffers (only
this rank's shards, copied to host memory so the snapshot itself cannot exhaust the device), the
optimizer's state and hyper-parameters, and the CPU and CUDA RNG states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Snapshot:
    """Host copies of what one training step mutates."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # (live local tensor, host copy)
    optimizer_state: dict[Any, dict[str, Any]]
    group_options: list[dict[str, Any]]
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _host_copy(value: Any) -> Any:
    return _local(value).detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def take_snapshot(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    module_tensors: bool = True,
) -> Snapshot:
    """`module_tensors=False` leaves parameters and buffers out: a caller that restores them by
    broadcast from a rank that kept them (DDP's replicas) copies nothing on the other ranks."""
    live = [_local(t) for t in [*module.parameters(), *module.buffers()]] if module_tensors else []
    return Snapshot(
        tensors=[(t, t.detach().to("cpu", copy=True)) for t in live],
        optimizer_state={
            p: {k: _host_copy(v) for k, v in s.items()} for p, s in optimizer.state.items()
        },
        group_options=[
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ],
        cpu_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    )


def restore(
    snapshot: Snapshot, module: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> None:
    """Copy the snapshot back in place; state the step created (a fresh optimizer's) is dropped.
    The optimizer updates its state tensors in place, so those that existed are still the ones
    it holds, on their own device (fused/capturable Adam keeps `step` on the GPU)."""
    with torch.no_grad():
        for live, copy in snapshot.tensors:
            live.copy_(copy)
        for param in list(optimizer.state):
            saved = snapshot.optimizer_state.get(param)
            if saved is None:
                del optimizer.state[param]
                continue
            state = optimizer.state[param]
            for key in [k for k in state if k not in saved]:
                del state[key]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                    _local(state[key]).copy_(value)
                else:
                    state[key] = value
    for param in module.parameters():
        param.grad = None
    for group, options in zip(optimizer.param_groups, snapshot.group_options, strict=True):
        group.update(options)
    torch.set_rng_state(snapshot.cpu_rng)
    if snapshot.cuda_rng is not None:
        torch.cuda.set_rng_state(snapshot.cuda_rng, device)
