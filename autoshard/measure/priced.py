"""The forward's FLOP-bound operators and the step's memory-bound ones as the trace meets them
(`traffic.Traffic`), one record per distinct call, written so that `measure.rates` can run each
again on the device: the operator's name and its arguments, tensors by shape, strides, dtype and
whether they require a gradient, dtypes, layouts and memory formats by name, devices by type.

Recording never fails the trace (the activations matter more than a call's timing): a call whose
arguments cannot be written is kept with "" for them, under its own FLOPs, and not run again."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from autoshard.decide.profile import MovingCall, PricedCall

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


# Memory-bound calls kept, the most bytes first: `measure.rates` times a few of them, those it
# can run again; the many small ones left are priced at a large copy's bandwidth.
_KEPT = 32


class _Unwritable(Exception):
    """An argument of a kind JSON cannot hold here (a generator, a nested or sparse tensor)."""


class PricedCalls:
    """The calls met so far, by operator and arguments: their FLOPs, and where they ran.

    A call a block makes with gradients off in forward is held apart: where the block's
    backward runs it again with gradients on (a checkpoint with `use_reentrant=True`, of the
    block or of part of it), the first call of the same operator and shapes met there after
    the one before's twin gives the gradients its tensors need (`recomputed`); where nothing
    runs it again (a teacher, an EMA or a reference model run under `no_grad`), it needs none,
    as written."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.flops: dict[tuple[str, str, int], int] = {}
        self.calls: dict[tuple[str, str, int], list[int]] = {}  # per block, then outside them
        # per block: its calls made without gradients, and those its recomputation made
        self.without: dict[int, list[tuple[str, str, str, int]]] = {}
        self.again: dict[int, list[tuple[str, str, str]]] = {}

    def record(
        self, func: Any, args: Any, kwargs: Any, flops: int, block: int | None, grad: bool
    ) -> None:
        """One call of `func`, of `flops` forward FLOPs, in `block` (None: outside the blocks),
        run with gradients on or off (`grad`)."""
        if not grad and block is not None:  # as it runs without a twin: forward only
            alone, shapes = _both(func, args, kwargs, needs=False)
            self.without.setdefault(block, []).append((str(func), alone, shapes, flops))
        else:
            self._add(str(func), _safely(func, args, kwargs, True), flops, block)

    def recomputed(self, func: Any, args: Any, kwargs: Any, block: int) -> None:
        """One call of `func` in `block`'s backward: of its forward run again, or of backward's
        own (kept only for a block that made calls without gradients in forward)."""
        if block in self.without:
            arguments, shapes = _both(func, args, kwargs)
            self.again.setdefault(block, []).append((str(func), arguments, shapes))

    def result(self) -> tuple[PricedCall, ...]:
        """The calls, the most FLOPs first (ties by operator and arguments: the same order
        whatever order they were met in)."""
        for block, calls in self.without.items():
            again = iter(self.again.get(block, []))
            for name, arguments, shapes, flops in calls:
                twin = next((a for n, a, s in again if (n, s) == (name, shapes)), None)
                self._add(name, arguments if twin is None else twin, flops, block)
        self.without.clear()
        made = [
            PricedCall(key[0], key[1], self.flops[key], tuple(c[:-1]), c[-1])
            for key, c in self.calls.items()
        ]
        return tuple(sorted(made, key=order))

    def _add(self, name: str, arguments: str, flops: int, block: int | None) -> None:
        # calls not written are told apart by their FLOPs alone, so that each keeps its own
        key = (name, arguments, flops if not arguments else 0)
        calls = self.calls.setdefault(key, [0] * (self.n_blocks + 1))
        calls[self.n_blocks if block is None else block] += 1
        # equal arguments, equal FLOPs; but a formula that failed once counted 0 there
        self.flops[key] = max(self.flops.get(key, 0), flops)


class MovingCalls:
    """The memory-bound calls met so far, forward and backward, by operator and arguments (each
    tensor written as needing no gradient: a call runs again alone, as it was dispatched): the
    bytes each moves, and where it ran: as the trace's bytes are counted (`traffic.Traffic`), a
    call the forward makes outside the blocks is the next block's (the parent's work between
    blocks runs once a block; before the first, the embedding's), after the last the model's
    own."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.calls: dict[tuple[str, str, int], list[int]] = {}  # per block, then outside them
        self.pending: list[tuple[str, str, int]] = []  # the forward's since the last block

    def record(
        self, func: Any, args: Any, kwargs: Any, moved: int, block: int | None, forward: bool
    ) -> None:
        """One call of `func`, moving `moved` bytes, in `block`'s forward or backward (None:
        outside the blocks)."""
        # bytes in the key: equal arguments may move different bytes (an expanded tensor's
        # storage), and calls not written are told apart by them alone
        key = (str(func), _safely(func, args, kwargs, False), moved)
        if block is None and forward:
            self.pending.append(key)
        else:
            self._count(key, block)

    def entered(self, block: int) -> None:
        """The forward enters `block`: the calls since the last one's end are its."""
        for key in self.pending:
            self._count(key, block)
        self.pending.clear()

    def _count(self, key: tuple[str, str, int], block: int | None) -> None:
        calls = self.calls.setdefault(key, [0] * (self.n_blocks + 1))
        calls[self.n_blocks if block is None else block] += 1

    def result(self) -> tuple[MovingCall, ...]:
        """Every call, the most bytes in all first (ties by operator and arguments)."""
        for key in self.pending:  # after the last block: the head's, the loss's
            self._count(key, None)
        self.pending.clear()
        made = [MovingCall(*key, tuple(c[:-1]), c[-1]) for key, c in self.calls.items()]
        return tuple(sorted(made, key=moving_order))


def most_moving(calls: tuple[MovingCall, ...]) -> tuple[MovingCall, ...]:
    """The `_KEPT` calls moving the most bytes in all, the most first: cut once a shallow trace's
    calls are extended to the model's blocks, where the blocks' weigh more than the head's."""
    return tuple(sorted(calls, key=moving_order)[:_KEPT])


def _both(func: Any, args: Any, kwargs: Any, needs: bool = True) -> tuple[str, str]:
    """The arguments as written (every tensor needing no gradient where `needs` is False), and
    as written without whether tensors need one."""
    return _safely(func, args, kwargs, needs), _safely(func, args, kwargs, None)


def _safely(func: Any, args: Any, kwargs: Any, needs: bool | None) -> str:
    """`arguments_json`, "" where writing failed (see the module's docstring)."""
    try:
        return arguments_json(args, kwargs, needs)
    except Exception:  # noqa: BLE001 - see the module's docstring
        logger.debug("the arguments of %s were not written", func, exc_info=True)
        return ""


def order(call: PricedCall) -> tuple[int, int, str, str]:
    return -call.total_flops, -call.flops, call.operator, call.arguments


def moving_order(call: MovingCall) -> tuple[int, int, str, str]:
    return -call.total_bytes, -call.moved, call.operator, call.arguments


def arguments_json(args: Any, kwargs: Any, needs: bool | None = True) -> str:
    """The arguments as JSON (`PricedCall.arguments`), or "" where one cannot be written; each
    tensor needing no gradient where `needs` is False, and without saying where it is None."""
    try:
        written = {
            "args": _written(args, needs),
            "kwargs": {k: _written(v, needs) for k, v in kwargs.items()},
        }
        return json.dumps(written, sort_keys=True)
    except (_Unwritable, TypeError, ValueError):  # a symbolic size, a value JSON refuses
        return ""


def _written(value: Any, needs: bool | None) -> Any:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_nested:
            raise _Unwritable
        written = [list(value.shape), list(value.stride()), str(value.dtype).removeprefix("torch.")]
        if needs is None:
            return {"tensor": written}
        return {"tensor": [*written, needs and value.requires_grad]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):  # its type: the call runs again on the device timed
        return {"device": value.type}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_written(v, needs) for v in value]
    raise _Unwritable


def read(value: Any, tensor: Any, device: Any = None) -> Any:
    """An argument as written, back: each tensor made by `tensor(shape, stride, dtype,
    requires_grad)`, each device by `device(type)`, dtypes, layouts and memory formats by
    name."""
    if isinstance(value, list):
        return [read(v, tensor, device) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"tensor"}:
        shape, stride, dtype, requires_grad = value["tensor"]
        return tensor(shape, stride, _dtype(dtype), bool(requires_grad))
    if set(value) == {"dtype"}:
        return _dtype(value["dtype"])
    if set(value) == {"memory_format"}:
        return _MEMORY_FORMATS[value["memory_format"]]
    if set(value) == {"layout"}:
        return _layout(value["layout"])
    if set(value) == {"device"} and device is not None:
        return device(value["device"])
    raise ValueError(f"not an argument as written: {value!r}")


def _layout(name: str) -> torch.layout:
    layout = getattr(torch, name)
    if not isinstance(layout, torch.layout):
        raise ValueError(f"not a layout: {name!r}")
    return layout


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return dtype
