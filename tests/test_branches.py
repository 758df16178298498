"""Backward formulas' plain-tensor branches (`autoshard.wrap.branches`), in the simulation and in
the CPU trial step:
`index_select`'s, `gather`'s and advanced indexing's backward add the gradient into zeros in
place for plain tensors, out of place for a tensor subclass such as a fake tensor; the
simulation now takes the plain branch, and nothing else is run in place."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from _dist import REPO
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.wrap.branches import IN_PLACE, PlainBranches

sys.path.insert(0, str(REPO / "tests"))
from test_estimate_accuracy import WORST_TARGET  # noqa: E402
from test_workspace import _real_and_simulated  # noqa: E402


class _Picks(nn.Module):
    """Every eighth column of a wide projection, picked as XLNet's relative shift picks
    (`index_select`), as `gather`, advanced indexing or `masked_select` does: each backward adds
    or scatters the gradient into zeros of the projection's size, the largest tensor of the
    step."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 1024)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        columns = torch.arange(0, h.shape[-1], 8, device=x.device)
        if self.how == "index_select":
            picked = h.index_select(-1, columns)
        elif self.how == "gather":
            picked = h.gather(-1, columns.expand(h.shape[0], -1))
        elif self.how == "masked_select":
            keep = torch.zeros(h.shape[-1], dtype=torch.bool, device=x.device)
            keep[columns] = True
            picked = h.masked_select(keep.expand_as(h)).view(h.shape[0], -1)
        else:
            picked = h[:, columns]
        return picked.square().mean()


@pytest.mark.parametrize("how", ["index_select", "gather", "index"])
def test_the_estimate_holds_what_the_plain_branch_holds(how: str) -> None:
    """Out of place, the simulation held a second projection-sized tensor beside the zeros:
    about 40% over the allocator's peak."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = _Picks(how)
        return model, torch.optim.AdamW(model.parameters())

    real, simulated = _real_and_simulated(build, torch.randn(256, 16))
    assert real <= simulated <= real * (1 + WORST_TARGET), (simulated, real)


class _Calls(TorchDispatchMode):
    """Above `PlainBranches`: whether each out-of-place `index_add` it passed on returned its
    destination (run in place below) or a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.in_place: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if func in IN_PLACE:
            self.in_place.append(result is args[0])
        return result


def test_index_select_s_formula_adds_into_its_zeros_in_place() -> None:
    with FakeTensorMode(), PlainBranches(), _Calls() as calls:
        x = torch.randn(4, 8, requires_grad=True)
        x.index_select(-1, torch.tensor([0, 2, 4])).sum().backward()
    assert calls.in_place == [True]
    with FakeTensorMode(), _Calls() as calls:  # fake tensors take the subclass branch
        x = torch.randn(4, 8, requires_grad=True)
        x.index_select(-1, torch.tensor([0, 2, 4])).sum().backward()
    assert calls.in_place == [False]


@pytest.mark.parametrize("how", ["index_select", "gather", "index", "masked_select"])
def test_real_tensors_under_a_mode_take_the_plain_branch_again(how: str) -> None:
    """Under a dispatch mode (the CPU trial's meter) every real tensor counts as a subclass, and
    the formula copies: run in place again, with the same gradient."""
    torch.manual_seed(0)
    model = _Picks(how)
    x = torch.randn(8, 16)
    model(x).backward()
    expected = model.inp.weight.grad
    model.zero_grad()
    with PlainBranches(), _Calls() as calls:
        model(x).backward()
    assert calls.in_place == [True], calls.in_place
    assert torch.equal(model.inp.weight.grad, expected)
    with _Calls() as calls:  # without it, the mode alone
        model(x).backward()
    assert calls.in_place == [False], calls.in_place


class _Formula(torch.autograd.Function):
    """A backward of its own, in Python: zeros, then (with `between`, after another operator)
    an out-of-place `index_add` into them, which the real step runs out of place too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, between: bool) -> torch.Tensor:
        ctx.between = between
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rows = torch.arange(grad.shape[0])
        zeros = grad.new_zeros(grad.shape)
        if ctx.between:
            grad = grad * 1
        return zeros.index_add(0, rows, grad), None


@pytest.mark.parametrize("between", [False, True], ids=["right_after", "another_op_between"])
def test_a_python_backward_s_out_of_place_call_is_left_as_it_is(between: bool) -> None:
    with FakeTensorMode(), PlainBranches(), _Calls() as calls:
        x = torch.randn(4, 8, requires_grad=True)
        _Formula.apply(x, between).sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
    assert calls.in_place == [False]


def test_a_forward_s_out_of_place_call_is_left_as_it_is() -> None:
    """Grad mode on (a forward, a checkpointed block's recomputation): the caller may keep the
    zeros, so nothing is done in place, in backward or not."""
    with FakeTensorMode(), PlainBranches():
        src = torch.randn(4, 8, requires_grad=True)
        zeros = torch.zeros(4, 8)
        added = zeros.index_add(0, torch.arange(4), src)
        assert added is not zeros
        with torch.no_grad():  # outside backward
            zeros = torch.zeros(4, 8)
            assert zeros.index_add(0, torch.arange(4), src) is not zeros


@pytest.mark.parametrize(
    ("how", "kernel"),
    [
        ("masked_select", "masked_scatter_"),
        ("index", "index_put_"),
        ("index_select", "index_add_"),
        ("gather", "scatter_add_"),
    ],
)
def test_a_cuda_plan_probes_the_in_place_kernel_the_formula_calls(
    how: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's `masked_scatter_` holds an int64 prefix sum of its destination for the call (2x
    fp32 logits picked with a boolean mask), `index_put_` with `accumulate` int64 copies of its
    indices: each in-place kernel a formula's plain branch calls is probed where the plan is
    for CUDA (the probe stood in for here, which has no GPU). Out of place nothing was."""
    import autoshard
    from autoshard.measure import workspace

    probed: list[str] = []

    def probe(func: Any, args: Any, kwargs: Any, device: torch.device) -> int:
        probed.append(str(func))
        return 0

    monkeypatch.setattr(workspace, "why_not", lambda device: None)
    monkeypatch.setattr(workspace, "_probe", probe)
    monkeypatch.setenv("AUTOSHARD_CACHE", "0")
    torch.manual_seed(0)
    model = _Picks(how)
    autoshard.plan(
        model, torch.optim.AdamW(model.parameters()), torch.randn(256, 16),
        loss_fn=lambda out, batch: out, device="cuda", world_size=1, device_memory="80GiB",
        strategy="local", mixed_precision="no",
    )  # fmt: skip
    assert f"aten.{kernel}.default" in probed, probed
