"""Re-binding the optimizer, in place, to the parameters as wrapping left them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first qualified name, taken before wrapping changes anything."""
    return {id(p): name for name, p in model.named_parameters()}


def rebind(
    optimizer: torch.optim.Optimizer,
    old_names: dict[int, str],
    new_params: dict[str, torch.Tensor],
) -> None:
    """Point every param group at the wrapped parameters, in place, and re-key its state.

    The optimizer object, its param_groups dicts and every hyper-parameter in them stay as they
    are, so an LR scheduler built on this optimizer keeps working. State already held is moved to
    the new parameter's device and, for a sharded (DTensor) parameter, sharded like it; without
    the re-keying the state would silently stay attached to the old tensors (accelerate #3855).
    """
    mapping: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        rebound = []
        for param in group["params"]:
            new = new_params[old_names[id(param)]]
            mapping[id(param)] = new
            rebound.append(new)
        group["params"] = rebound
    old_state = list(optimizer.state.items())
    optimizer.state.clear()
    for param, state in old_state:
        target = mapping.get(id(param))
        if target is not None:
            optimizer.state[target] = {
                # the step count keeps its device, a parameter of no dimension's shape or not
                k: v if k == "step" else _like(v, param, target)
                for k, v in state.items()
            }


def _like(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor) or value.shape != old.shape:
        return value  # scalars such as `step` keep their device and dtype
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(new, DTensor):
        # each rank's shard of its own state, with no collective (`src_data_rank=None`): on NCCL
        # a scatter is enqueued, and a rank failing between two of them (an OOM in `.to`) left
        # its peers' scatters unmatched under the agreement that reports it
        return distribute_tensor(
            value.to(new.device), new.device_mesh, new.placements, src_data_rank=None
        )
    return value.to(new.device)
