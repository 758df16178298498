"""measure.answers: the yes/no values a real step reads back from its tensors, recorded by place and
given back to the fake step at the same place; numbers and places read both ways are not."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from autoshard.measure.answers import Recorder, agreed
from autoshard.measure.fake import wider_fake_kernels


class _Branches(nn.Module):
    """Takes a branch on a yes/no read from its input; with `count`, also reads a number."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.count = count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > -100).all()):  # a yes/no that does not change with the rows
            x = x * 2
        if self.count:
            return x[: int((x > 0).sum())]  # a number read back: grows with the batch
        return x


def _call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The one place both runs call the model from, as autoshard's trace and simulation do."""
    return model(x)


def _fake_run(model: nn.Module, answers: dict[str, bool] | None) -> torch.Size:
    with wider_fake_kernels("cpu", answers), FakeTensorMode() as mode:
        return _call(model, mode.from_tensor(torch.randn(4, 3))).shape


def _answers(model: nn.Module, x: torch.Tensor) -> dict[str, bool]:
    with Recorder() as recorder:
        _call(model, x)
    return recorder.answers()


def test_a_yes_no_the_real_step_read_is_answered_alike_in_the_fake_step() -> None:
    model = _Branches()
    with pytest.raises(DataDependentOutputException):
        _fake_run(model, None)
    answers = _answers(model, torch.randn(2, 3))
    assert list(answers.values()) == [True]
    (place,) = answers
    assert place.startswith(f"{__file__}:")  # the model's own line, not the dispatch machinery
    assert _fake_run(model, answers) == (4, 3)


def test_a_number_read_back_is_not_answered() -> None:
    model = _Branches(count=True)
    answers = _answers(model, torch.randn(2, 3))
    assert list(answers.values()) == [True]  # the yes/no only
    with pytest.raises(DataDependentOutputException):
        _fake_run(model, answers)


def test_a_place_read_both_ways_or_differing_between_runs_is_not_answered() -> None:
    model = _Branches()
    with Recorder() as recorder:
        for x in (torch.ones(1), torch.full((1,), -1000.0)):
            _call(model, x)
    assert recorder.answers() == {}
    assert agreed([{"a": True, "b": False}, {"a": True, "b": True}]) == {"a": True}
    assert agreed([{"a": True}, {}]) == {}
