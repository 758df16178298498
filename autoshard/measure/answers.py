"""Yes/no questions a step asks of its data, answered in the simulation as the real step answered.

Fake tensors hold no values, so a step that reads one back to decide what to do next stops there:
`nn.Transformer` checks whether its mask is causal (`bool((mask == causal).all())`), and the
simulation failed on it with `DataDependentOutputException`, leaving every strategy's estimate to
the formulas (26% above nn.Transformer's measured peak under FSDP2). Where the batch cannot be
traced on fake tensors, its activations are measured on real tensors instead (`measure.trace`);
that real step also records each boolean it read back and where in the code it was read
(`Recorder`). The simulation's fake kernel then gives the same answer at the same place
(`answering`).

Only booleans are answered, and only where every real step measured (one and two rows of the
batch) read the same value at that place: a yes/no that does not change with the rows (is the
mask causal, is there padding) takes the same branch at the batch's full size. A number read back
(a count of tokens, a size) is not answered: it can grow with the batch, and the simulation then
fails as before and falls back to the formulas, saying so.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

import torch

from autoshard._torch_compat import TorchDispatchMode, op_overload

READ_BACK = op_overload("_local_scalar_dense")  # what `bool(tensor)` and `.item()` run
# The frames that name a place in the code: the innermost ones of the model's own code, which is
# outside torch or in torch.nn (nn.Transformer's); not autoshard's, nor torch's machinery (dispatch,
# modes, hooks, `Module.__call__`, whose lines differ with the hooks a module has).
_FRAMES = 2
_AUTOSHARD = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_NN = os.path.join(_TORCH, "nn", "")
_MACHINERY = (_AUTOSHARD, os.path.join(_NN, "modules", "module.py"))


def _model_code(filename: str) -> bool:
    if filename.startswith(_MACHINERY):
        return False
    return not filename.startswith(_TORCH) or filename.startswith(_NN)


def asked_at() -> str:
    """Where the current read-back was asked for: the innermost frames of the model's code (the
    line and its caller), as "file:line < file:line"; none beyond autoshard's call of the model."""
    places: list[str] = []
    frame: FrameType | None = inspect.currentframe()
    while frame is not None and len(places) < _FRAMES:
        name = frame.f_code.co_filename
        if places and name.startswith(_AUTOSHARD):
            break
        if _model_code(name):
            places.append(f"{name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(places)


class Recorder(TorchDispatchMode):
    """Records each boolean a real step reads back from a tensor, by where it was read. A place
    read with both values is dropped (`answers`)."""

    def __init__(self) -> None:
        super().__init__()
        self._read: dict[str, set[bool]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if func is READ_BACK and args[0].dtype == torch.bool:
            self._read.setdefault(asked_at(), set()).add(bool(result))
        return result

    def answers(self) -> dict[str, bool]:
        return {place: next(iter(seen)) for place, seen in self._read.items() if len(seen) == 1}


def agreed(runs: Iterable[Mapping[str, bool]]) -> dict[str, bool]:
    """The answers every run gave alike (a place one run did not reach is left out)."""
    runs = list(runs)
    if not runs:
        return {}
    return {
        place: value
        for place, value in runs[0].items()
        if all(run.get(place) == value for run in runs[1:])
    }


def answering(answers: Mapping[str, bool]) -> Callable[..., Any]:
    """A fake kernel for `READ_BACK` (`_torch_compat.fake_kernel`): the recorded answer for a
    boolean read at a place the real step read it, else torch's own (which raises)."""

    def kernel(fake_mode: Any, func: Any, tensor: Any) -> Any:
        if tensor.dtype == torch.bool and (answer := answers.get(asked_at())) is not None:
            return answer
        return NotImplemented

    return kernel
