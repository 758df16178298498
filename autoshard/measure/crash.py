"""Candidates that would crash: no plan is offered whose own step fails.

A simulation can fail for two kinds of reasons: the wrapping itself cannot run (FSDP2 refuses a
parameter shared between two units; a checkpointed block saves other tensors when recomputed),
which a real step would hit too; or the memory tracker or fake tensors cannot follow an operation,
which says nothing about the real step. To tell them apart, a failed run is stepped again on fake
tensors without any tracker, beside one step of the plain model (unwrapped, nothing checkpointed):
only an error of the run where the plain model steps cleanly is the wrapping's own, and its
candidates are not offered (`candidates.decide`).

A forward that converts one of its own modules (`self.router.to(torch.float32)`, as Switch
Transformers' and NLLB-MoE's routers do) is found apart, as the plain model's step runs
(`_Conversions`): torch converts a fake parameter by swapping it for the converted one, which a
tracker's weak reference to it refuses, so whether its fake steps fail, and where, says little.
A real step converts in place (`param.data = ...`). Real FSDP2 then trains it without mixed
precision; with it, a conversion to another dtype takes that module's gathered parameters out of
FSDP2's dtype, and up to torch 2.14 its reduce-scatter refuses gradients of two dtypes: there
those candidates are not offered (`ConvertedInForward`). FSDP2 of torch 2.15 reduces them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autoshard._torch_compat import fsdp_reduces_mixed_dtypes
from autoshard.measure.quiet import failed_run_unheard
from autoshard.strategies.recipes import recipe
from autoshard.strategies.strategy import Strategy

if TYPE_CHECKING:
    from autoshard.measure.simulate import Setup


class ConvertedInForward(RuntimeError):
    """The forward converts one of the model's modules to a dtype that FSDP2's mixed precision
    cannot follow (see the module's docstring)."""


# The conversions Module.to, .float(), .half(), .bfloat16() and .double() make of each parameter
_CONVERTING = {
    torch.Tensor.to,
    torch.Tensor.float,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.double,
}


class _Conversions(TorchFunctionMode):
    """Records the dtypes a forward converts the model's parameters to as Module._apply does it:
    a parameter converted without autograd (a cast in the forward's arithmetic keeps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if (
            func in _CONVERTING
            and args
            and isinstance(args[0], nn.Parameter)
            and not torch.is_grad_enabled()
            and isinstance(result, torch.Tensor)
            and (func is not torch.Tensor.to or _names_a_dtype(args[1:], kwargs))
        ):
            self.dtypes.add(result.dtype)
        return result


def _names_a_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether Tensor.to's arguments ask for a dtype (Module.to(device) passes None for it)."""
    return any(isinstance(a, (torch.dtype, torch.Tensor)) for a in (*args, *kwargs.values()))


def fake_step(
    model: nn.Module,
    setup: Setup,
    strategy: Strategy,
    mesh: Any,
    forward_mode: TorchFunctionMode | None = None,
) -> str | None:
    """One training step of `strategy` on a fake copy of `model`, wrapped as `wrap.apply` wraps it,
    with no memory tracker: None when it runs, else the error it raised. `forward_mode` is active
    while the forward runs."""
    try:
        with failed_run_unheard():
            _step(model, setup, strategy, mesh, forward_mode)
    except Exception as error:  # noqa: BLE001 - what the step raised is the answer
        return f"{type(error).__name__}: {error}"
    return None


def _step(
    model: nn.Module,
    setup: Setup,
    strategy: Strategy,
    mesh: Any,
    forward_mode: TorchFunctionMode | None,
) -> None:
    from autoshard._batch import call_model, compute_loss
    from autoshard.measure.fake import fake_mode, wider_fake_kernels
    from autoshard.measure.simulate import wrapped_copy
    from autoshard.strategies.engines import autocast_hooks

    mode = fake_mode()
    fake, optimizer, batch = wrapped_copy(model, setup, strategy, mesh, setup.block_names, mode)
    # as the simulation runs it (fp32 torch._grouped_mm, the real step's answers)
    with (
        wider_fake_kernels(
            setup.device.type,
            dict(setup.answers),
            (setup.trains_on or setup.device).type,
            setup.nonzero_found,
        ),
        mode,
    ):
        if not recipe(strategy).sharded and setup.dtype is not None:
            autocast_hooks(fake, setup.device.type, setup.dtype)
        with forward_mode or contextlib.nullcontext():
            loss = compute_loss(call_model(fake, batch), batch, setup.loss_fn)
        loss.backward()
        optimizer.step()


def crash_of(
    model: nn.Module,
    setup: Setup,
    strategy: Strategy,
    mesh: Any,
    plain: dict[str, Any],
) -> str | None:
    """The error a failed run's own step raises, where the plain model steps cleanly, or, for a
    sharded run under mixed precision, the plain model's forward converting a module to another
    dtype (`ConvertedInForward`); else None (the failure was the tracker's or the fake tensors').
    `plain` caches the plain model's step (its error, the dtypes its forward converts modules to)
    across the runs of one simulation round."""
    if "error" not in plain:
        conversions = _Conversions()
        plain["error"] = fake_step(
            model, replace(setup, checkpoint_all=False), Strategy.LOCAL, mesh, conversions
        )
        plain["converts"] = frozenset(conversions.dtypes)
    others = sorted(str(d) for d in plain["converts"] if d != setup.dtype)
    sharded = recipe(strategy).sharded and setup.dtype is not None
    if others and sharded and not fsdp_reduces_mixed_dtypes():
        # said before FSDP2's own step fails on it (which prints a stack trace to stderr)
        return (
            f"{ConvertedInForward.__name__}: the forward converts a module's parameters to "
            f"{', '.join(others)} (Module.to or .float() in forward), which FSDP2's "
            f"{setup.dtype} parameters cannot follow: their gradients would reach its "
            f"reduce-scatter in two dtypes"
        )
    error = fake_step(model, setup, strategy, mesh)
    if error is None or plain["error"] is not None:
        return None
    return f"{error[:CRASH_CHARS]}{_cache_updated_twice(model, setup, strategy, mesh)}"


# What a crash keeps of the error, besides `_cache_updated_twice`'s note
CRASH_CHARS = 300


def _cache_updated_twice(model: nn.Module, setup: Setup, strategy: Strategy, mesh: Any) -> str:
    """Where a checkpointed run crashed, the model keeps a cache (a Hugging Face config's
    `use_cache=True`) and the same step runs with `use_cache=False` in the batch: a note saying
    so, to append to the crash; else "". A checkpointed block that updates a cache of keys and
    values, or a recurrent state, updates it again when recomputed (CTRL, RecurrentGemma: keys of
    256 positions for 128 tokens), as the real step does; Hugging Face's own checkpointing turns
    the cache off, torch's does not."""
    config = getattr(model, "config", None)
    batch = setup.batch
    if (
        not setup.checkpoint_all
        or getattr(config, "use_cache", None) is not True
        or not isinstance(batch, Mapping)
        or "use_cache" in batch
    ):
        return ""
    if fake_step(model, replace(setup, batch={**batch, "use_cache": False}), strategy, mesh):
        return ""
    return (
        "; the model keeps a cache (config.use_cache=True), which a checkpointed block updates "
        "again when recomputed, and with use_cache=False in the batch (or model.config.use_cache "
        "= False) the step runs"
    )
