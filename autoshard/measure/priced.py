"""The forward's FLOP-bound operators as the trace meets them (`trace._Traffic`), one record per
distinct call, written so that `measure.rates` can run each again on the device: the operator's
name and its arguments, tensors by shape, strides, dtype and whether they require a gradient."""

from __future__ import annotations

import json
from typing import Any

import torch

from autoshard.decide.profile import PricedCall


class _Unwritable(Exception):
    """An argument of a kind JSON cannot hold (a device, a dtype, a sparse tensor)."""


class PricedCalls:
    """The calls met so far, by operator and arguments: their FLOPs, and where they ran."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.flops: dict[tuple[str, str], int] = {}
        self.calls: dict[tuple[str, str], list[int]] = {}  # per block, then outside them

    def record(self, func: Any, args: Any, kwargs: Any, flops: int, block: int | None) -> None:
        key = (str(func), arguments_json(args, kwargs))
        calls = self.calls.setdefault(key, [0] * (self.n_blocks + 1))
        calls[self.n_blocks if block is None else block] += 1
        # one call's FLOPs: the largest met (equal arguments, equal FLOPs, but a formula that
        # failed once counts 0 there)
        self.flops[key] = max(self.flops.get(key, 0), flops)

    def result(self) -> tuple[PricedCall, ...]:
        """The calls, the most FLOPs first."""
        made = [
            PricedCall(name, arguments, self.flops[name, arguments], tuple(c[:-1]), c[-1])
            for (name, arguments), c in self.calls.items()
        ]
        return tuple(sorted(made, key=lambda c: -c.total_flops))


def arguments_json(args: Any, kwargs: Any) -> str:
    """The arguments as JSON (`PricedCall.arguments`), or "" where one cannot be written."""
    try:
        written = {"args": _written(args), "kwargs": {k: _written(v) for k, v in kwargs.items()}}
        return json.dumps(written, sort_keys=True)
    except _Unwritable:
        return ""


def _written(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise _Unwritable
        dtype = str(value.dtype).removeprefix("torch.")
        return {"tensor": [list(value.shape), list(value.stride()), dtype, value.requires_grad]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_written(v) for v in value]
    raise _Unwritable
