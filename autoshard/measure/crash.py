"""Candidates that would crash: no plan is offered whose own step fails.

A simulation can fail for two kinds of reasons: the wrapping itself cannot run (FSDP2 refuses a
parameter shared between two units; a checkpointed block saves other tensors when recomputed),
which a real step would hit too; or the memory tracker or fake tensors cannot follow an operation,
which says nothing about the real step. To tell them apart, a failed run is stepped again on fake
tensors without any tracker, beside one step of the plain model (unwrapped, nothing checkpointed):
only an error of the run where the plain model steps cleanly is the wrapping's own, and its
candidates are not offered (`candidates.decide`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn

from autoshard.strategies.recipes import recipe
from autoshard.strategies.strategy import Strategy

if TYPE_CHECKING:
    from autoshard.measure.simulate import Setup


def fake_step(model: nn.Module, setup: Setup, strategy: Strategy, mesh: Any) -> str | None:
    """One training step of `strategy` on a fake copy of `model`, wrapped as `wrap.apply` wraps it,
    with no memory tracker: None when it runs, else the error it raised."""
    from autoshard._batch import call_model, compute_loss
    from autoshard.measure.fake import fake_mode, wider_fake_kernels
    from autoshard.measure.simulate import wrapped_copy
    from autoshard.strategies.engines import autocast_hooks

    mode = fake_mode()
    try:
        fake, optimizer, batch = wrapped_copy(model, setup, strategy, mesh, setup.block_names, mode)
        # as the simulation runs it (fp32 torch._grouped_mm, the real step's answers)
        with (
            wider_fake_kernels(
                setup.device.type, dict(setup.answers), (setup.trains_on or setup.device).type
            ),
            mode,
        ):
            if not recipe(strategy).sharded and setup.dtype is not None:
                autocast_hooks(fake, setup.device.type, setup.dtype)
            compute_loss(call_model(fake, batch), batch, setup.loss_fn).backward()
            optimizer.step()
    except Exception as error:  # noqa: BLE001 - what the step raised is the answer
        return f"{type(error).__name__}: {error}"
    return None


def crash_of(
    model: nn.Module,
    setup: Setup,
    strategy: Strategy,
    mesh: Any,
    plain: dict[str, str | None],
) -> str | None:
    """The error a failed run's own step raises, where the plain model steps cleanly; else None
    (the failure was the tracker's or the fake tensors'). `plain` caches the plain model's step
    across the runs of one simulation round."""
    error = fake_step(model, setup, strategy, mesh)
    if error is None:
        return None
    if "error" not in plain:
        plain["error"] = fake_step(
            model, replace(setup, checkpoint_all=False), Strategy.LOCAL, mesh
        )
    return error if plain["error"] is None else None
