"""The forward's FLOP-bound operators as the trace meets them (`trace._Traffic`), one record per
distinct call, written so that `measure.rates` can run each again on the device: the operator's
name and its arguments, tensors by shape, strides, dtype and whether they require a gradient,
dtypes and memory formats by name.

Recording never fails the trace (the activations matter more than a call's timing): a call whose
arguments cannot be written is kept with "" for them, under its own FLOPs, and not run again."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from autoshard.decide.profile import PricedCall

logger = logging.getLogger("autoshard")

_MEMORY_FORMATS = {
    str(f): f
    for f in (
        torch.contiguous_format,
        torch.channels_last,
        torch.channels_last_3d,
        torch.preserve_format,
    )
}


class _Unwritable(Exception):
    """An argument of a kind JSON cannot hold here (a device, a nested or sparse tensor)."""


class PricedCalls:
    """The calls met so far, by operator and arguments: their FLOPs, and where they ran."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.flops: dict[tuple[str, str, int], int] = {}
        self.calls: dict[tuple[str, str, int], list[int]] = {}  # per block, then outside them

    def record(
        self, func: Any, args: Any, kwargs: Any, flops: int, block: int | None, grad: bool
    ) -> None:
        """One call of `func`, of `flops` forward FLOPs, in `block` (None: outside the blocks),
        run with gradients on or off (`grad`)."""
        try:
            arguments = arguments_json(args, kwargs, grad)
        except Exception:  # noqa: BLE001 - see the module's docstring
            logger.debug("the arguments of %s were not written", func, exc_info=True)
            arguments = ""
        # calls not written are told apart by their FLOPs alone, so that each keeps its own
        key = (str(func), arguments, flops if not arguments else 0)
        calls = self.calls.setdefault(key, [0] * (self.n_blocks + 1))
        calls[self.n_blocks if block is None else block] += 1
        # equal arguments, equal FLOPs; but a formula that failed once counted 0 there
        self.flops[key] = max(self.flops.get(key, 0), flops)

    def result(self) -> tuple[PricedCall, ...]:
        """The calls, the most FLOPs first (ties by operator and arguments: the same order
        whatever order they were met in)."""
        made = [
            PricedCall(key[0], key[1], self.flops[key], tuple(c[:-1]), c[-1])
            for key, c in self.calls.items()
        ]
        return tuple(sorted(made, key=order))


def order(call: PricedCall) -> tuple[int, str, str]:
    return -call.total_flops, call.operator, call.arguments


def arguments_json(args: Any, kwargs: Any, grad: bool = True) -> str:
    """The arguments as JSON (`PricedCall.arguments`), or "" where one cannot be written.

    Run with gradients off (`grad`), a floating-point tensor is written as requiring one: in a
    training step's forward that is a block checkpointed with `use_reentrant=True`, whose
    forward runs again in backward, with gradients, and whose backward runs."""
    try:
        written = {
            "args": _written(args, grad),
            "kwargs": {k: _written(v, grad) for k, v in kwargs.items()},
        }
        return json.dumps(written, sort_keys=True)
    except (_Unwritable, TypeError, ValueError):  # a symbolic size, a value JSON refuses
        return ""


def _written(value: Any, grad: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_nested:
            raise _Unwritable
        dtype = str(value.dtype).removeprefix("torch.")
        needs = value.requires_grad or (not grad and value.is_floating_point())
        return {"tensor": [list(value.shape), list(value.stride()), dtype, needs]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_written(v, grad) for v in value]
    raise _Unwritable


def read(value: Any, tensor: Any) -> Any:
    """An argument as written, back: each tensor made by `tensor(shape, stride, dtype,
    requires_grad)`, dtypes and memory formats by name."""
    if isinstance(value, list):
        return [read(v, tensor) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"tensor"}:
        shape, stride, dtype, requires_grad = value["tensor"]
        return tensor(shape, stride, _dtype(dtype), bool(requires_grad))
    if set(value) == {"dtype"}:
        return _dtype(value["dtype"])
    if set(value) == {"memory_format"}:
        return _MEMORY_FORMATS[value["memory_format"]]
    raise ValueError(f"not an argument as written: {value!r}")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return dtype
