"""The trial step: one real training step with the chosen wrapping, then everything put back.

What the step changes is snapshotted first and restored after: parameters and buffers (only this
rank's shards, copied to host memory so the snapshot itself cannot exhaust the device), the
optimizer's state and hyper-parameters, and the CPU and CUDA RNG states. So training after
`prepare` starts from exactly what the caller passed in.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard._apply import apply
from autoshard._batch import LossFn, batch_to, call_model, compute_loss
from autoshard._plan import Attempt, Plan
from autoshard._world import World

logger = logging.getLogger("autoshard")


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


def take_snapshot(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> Snapshot:
    live = [_local(t) for t in [*model.parameters(), *model.buffers()]]
    state = {
        param: {
            k: _local(v).detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in s.items()
        }
        for param, s in optimizer.state.items()
    }
    return Snapshot(
        tensors=[(t, t.detach().to("cpu", copy=True)) for t in live],
        optimizer_state=state,
        group_options=[
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ],
        cpu_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    )


def restore(
    snapshot: Snapshot, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> None:
    with torch.no_grad():
        for live, copy in snapshot.tensors:
            live.copy_(copy)
    for param in model.parameters():
        param.grad = None
    current = dict(optimizer.state.items())
    optimizer.state.clear()
    for param, saved in snapshot.optimizer_state.items():
        optimizer.state[param] = {
            k: _restored(current.get(param, {}).get(k), v) for k, v in saved.items()
        }
    for group, options in zip(optimizer.param_groups, snapshot.group_options, strict=True):
        group.update(options)
    torch.set_rng_state(snapshot.cpu_rng)
    if snapshot.cuda_rng is not None:
        torch.cuda.set_rng_state(snapshot.cuda_rng, device)


def _restored(live: Any, saved: Any) -> Any:
    if not isinstance(saved, torch.Tensor):
        return saved
    if isinstance(live, torch.Tensor):
        with torch.no_grad():
            _local(live).copy_(saved)
        return live
    return saved


def run_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn | None,
    scaler: Any,
) -> float:
    output = call_model(model, batch)
    loss = compute_loss(output, batch, loss_fn)
    value = float(loss.detach())
    del output
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def wrap_and_prove(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    world: World,
    block_names: list[str],
    batch: Any,
    loss_fn: LossFn | None,
    trial_step: bool,
) -> tuple[nn.Module, Any, Plan]:
    """Apply `plan`, then (with `trial_step` and a batch) train one step and restore."""
    wrapped, scaler = apply(model, optimizer, plan, world, block_names)
    if not trial_step or batch is None:
        why = (
            "trial step off (trial_step=False)"
            if not trial_step
            else "no trial step: no example_batch"
        )
        return wrapped, scaler, dataclasses.replace(plan, reasons=(*plan.reasons, why))
    snapshot = take_snapshot(model, optimizer, world.device)
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    started = time.perf_counter()
    run_step(wrapped, optimizer, batch_to(batch, world.device), loss_fn, scaler)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(world.device) if world.device.type == "cuda" else None
    restore(snapshot, model, optimizer, world.device)
    attempt = Attempt(plan.strategy, plan.activation_checkpointing, f"ok in {seconds:.2f}s", peak)
    return (
        wrapped,
        _fresh(scaler),
        dataclasses.replace(plan, measured_peak_bytes=peak, attempts=(attempt,)),
    )


def _fresh(scaler: Any) -> Any:
    """A scaler as if no step had run (the trial's update() moved its scale)."""
    return type(scaler)(scaler._device) if scaler is not None else None
