"""One training step of a fake model under torch's memory trackers (`measure.simulate`): the
breakdown at the forward/backward peak and at the optimizer step's peak, as in a steady step."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoshard._batch import call_model, compute_loss, tensors_in
from autoshard._torch_compat import (
    mem_trackers,
    tracker_frozen_safe,
    tracker_global_peak_only,
    tracker_reset_peak,
)
from autoshard.decide.estimate import Phase
from autoshard.measure.workspace import Workspace
from autoshard.strategies.recipes import recipe
from autoshard.strategies.strategy import Strategy

if TYPE_CHECKING:
    from autoshard.measure.simulate import Setup

# Optimizers whose step creates all of its state before any arithmetic (`_init_group`), so that
# a first step's peak is a steady step's: the measured step may be the first. Any other optimizer
# takes one unmeasured step first.
_STATE_FIRST = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def tracked_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    setup: Setup,
    strategy: Strategy,
) -> tuple[Phase, Phase]:
    """The breakdowns at the forward/backward peak and at the optimizer step's peak of a steady
    step.

    The optimizer state is alive and unchanged through forward and backward, so it adds to
    that peak without moving it: for the optimizers in `_STATE_FIRST` the one measured step
    creates it, and it is added to the forward/backward peak afterwards. Any other optimizer first
    takes an unmeasured step from zero gradients (which allocates what a full first step would).
    With every block checkpointed (`setup.checkpoint_all`) only forward and backward run: the
    step is the unchecked simulation's, and the caller adds its state (`with_state`)."""
    FSDPMemTracker, MemTracker = mem_trackers()

    from autoshard.strategies.engines import autocast_hooks

    if not recipe(strategy).sharded and setup.dtype is not None:
        autocast_hooks(model, setup.device.type, setup.dtype)
    in_place = strategy == Strategy.DDP  # DDP's buckets: every gradient lives from construction
    # the exact classes: a subclass may override step()
    stepped = not setup.checkpoint_all and type(optimizer) not in _STATE_FIRST
    if stepped:
        _first_step(model, optimizer, keep_grads=in_place)
    elif in_place:
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    inputs = tensors_in(batch)
    tracker: Any
    if recipe(strategy).sharded:
        tracker = frozen_safe(FSDPMemTracker(model, optimizer))
        tracker.track_inputs(tuple(inputs))
        tracker.track_external(optimizer)
    else:
        tracker = frozen_safe(MemTracker())
        tracker.track_external(model, optimizer, *inputs)  # the batch counts as "Other": inputs
    tracker_global_peak_only(tracker)
    # inside the tracker, which so sees the workspace blocks
    with tracker, Workspace(setup.trains_on or setup.device):
        loss = compute_loss(call_model(model, batch), batch, setup.loss_fn)
        loss.backward()
        del loss
        backward = _phase(tracker, "peak")
        if setup.checkpoint_all:
            return backward, Phase(**dict.fromkeys(_TERMS, 0))
        # The step's peak: what is alive as it starts (parameters, gradients, state), plus the
        # most its intermediates add. Taken as a difference of totals, not from the tracker's
        # breakdown at its peak, which files optimizer state under other names mid-step.
        before = _phase(tracker, "current")
        tracker_reset_peak(tracker)
        optimizer.step()
        added = max(0, total(tracker, "peak") - total(before))
        created = 0 if stepped else _phase(tracker, "current").optimizer_state
        step = replace(
            before,
            optimizer_state=before.optimizer_state + created,
            temporaries=before.temporaries + added - created,
        )
        optimizer.zero_grad(set_to_none=not in_place)
    return with_state(backward, created), step


def with_state(phase: Phase, state: int) -> Phase:
    """`phase` with `state` more bytes of optimizer state alive."""
    return replace(phase, optimizer_state=phase.optimizer_state + state)


_TERMS = tuple(f.name for f in fields(Phase))


def _first_step(model: nn.Module, optimizer: torch.optim.Optimizer, keep_grads: bool) -> None:
    """Create the optimizer's state with one update from zero gradients, in foreach form where the
    optimizer has it (one fake dispatch per list rather than per tensor)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    saved = [g.get("foreach") for g in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            if "foreach" in group and not group.get("fused"):
                group["foreach"] = True
        optimizer.step()
    except Exception:  # noqa: BLE001 - no foreach form: the plain step creates the same state
        for group, value in zip(optimizer.param_groups, saved, strict=True):
            group["foreach"] = value
        optimizer.step()
    finally:
        for group, value in zip(optimizer.param_groups, saved, strict=True):
            if "foreach" in group:
                group["foreach"] = value
    if keep_grads:
        for param in params:
            param.grad.zero_()  # type: ignore[union-attr]
    else:
        optimizer.zero_grad(set_to_none=True)


def frozen_safe(tracker: Any) -> Any:
    """`tracker`, made to track models with frozen parameters (LoRA, frozen embeddings): its
    gradient hooks go on trainable parameters only (`_torch_compat.tracker_frozen_safe`)."""
    return tracker_frozen_safe(tracker)


def total(source: Any, kind: str = "") -> int:
    if isinstance(source, Phase):
        return sum(getattr(source, f.name) for f in fields(Phase))
    return sum(s.get("Total", 0) for s in source.get_tracker_snapshot(kind).values())


def _phase(tracker: Any, kind: str) -> Phase:
    """The tracker's breakdown ("peak" or "current"), summed over devices, in autoshard's
    terms."""
    by_name: dict[str, int] = {}
    for snapshot in tracker.get_tracker_snapshot(kind).values():
        for key, value in snapshot.items():
            name = getattr(key, "value", key)
            by_name[name] = by_name.get(name, 0) + value

    def get(*names: str) -> int:
        return sum(by_name.get(n, 0) for n in names)

    return Phase(
        params=get("Parameter", "Sharded Param"),
        buffers=get("Buffer"),
        grads=get("Gradient", "Sharded Grad"),
        optimizer_state=get("Optstate", "OptState"),
        activations=get("Activation", "Inputs", "Other"),
        comm_buffers=get("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
        temporaries=get("Temp"),
    )
