"""Backward formulas' plain-tensor branches (`autoshard.wrap.branches`), in the simulation and in
the CPU trial step:
`index_select`'s, `gather`'s and advanced indexing's backward add the gradient into zeros in
place for plain tensors, out of place for a tensor subclass such as a fake tensor; the
simulation now takes the plain branch, and nothing else is run in place."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import pytest
import torch
from _dist import REPO
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard._torch_compat import in_backward
from autoshard.wrap.branches import IN_PLACE, PlainBranches

aten = torch.ops.aten
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


# ---------------------------------------------------------------------------------------------
# The engine's sums of gradients reaching one input


class _Scan(nn.Module):
    """A whole-sequence projection read one step at a time, as Mamba's scan in torch reads it:
    each step's gradient is a tensor of the projection's size, zeros but that step, and autograd
    sums them into one buffer as they arrive, in place for plain tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # (rows, steps, width)
        state = torch.zeros_like(h[:, 0])
        for step in range(h.shape[1]):
            state = state * 0.5 + h[:, step]
        return state.square().mean()


def test_the_estimate_holds_what_the_engine_s_in_place_sums_hold() -> None:
    """Out of place, each sum held a second projection-sized tensor beside the first: 45% over
    the allocator's peak."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = _Scan()
        return model, torch.optim.AdamW(model.parameters())

    real, simulated = _real_and_simulated(build, torch.randn(64, 8, 16))
    assert real <= simulated <= real * (1 + WORST_TARGET), (simulated, real)


class _Below(TorchDispatchMode):
    """Below `PlainBranches`: the sums of same-shaped tensors it passes on in backward, each
    as "in place" or "out of place"."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (aten.add.Tensor, aten.add_.Tensor) and in_backward():
            if args[0].shape == args[1].shape:
                self.sums.append("in place" if func is aten.add_.Tensor else "out of place")
        return func(*args, **(kwargs or {}))


def _scan_grads(x: torch.Tensor, *modes: TorchDispatchMode) -> torch.Tensor:
    x = x.detach().requires_grad_()
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        h = x * 2
        sum(h[:, step].sin().sum() for step in range(4)).backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_gradients_formulas_make_fresh_are_summed_in_place(fake: bool) -> None:
    """Four selects' gradients into the buffer of `h`: three sums, each in place, with the
    gradient a run without any mode gives (in the CPU trial, real tensors under the meter)."""
    x = torch.randn(8, 4)
    expected = _scan_grads(x)
    with FakeTensorMode() if fake else contextlib.nullcontext() as mode:
        below = _Below()
        grad = _scan_grads(mode.from_tensor(x) if fake else x, below, PlainBranches())
    assert below.sums == ["in place"] * 3
    if not fake:
        assert torch.equal(grad, expected)
    below = _Below()
    _scan_grads(x, below)  # the mode alone: out of place, as for a subclass
    assert below.sums == ["out of place"] * 3


class _Keeps(torch.autograd.Function):
    """A backward that keeps the gradient it returns: the engine must not sum into it."""

    kept: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        doubled = grad * 2
        _Keeps.kept.append(doubled)
        return doubled


def test_a_gradient_something_else_holds_is_summed_out_of_place() -> None:
    """The kept gradient arrives first (its node was made last), so the sum would go into it:
    the engine sums out of place, and so does the trial, leaving the kept tensor as it was."""
    _Keeps.kept.clear()
    x = torch.randn(4, 8, requires_grad=True)
    below = _Below()
    with below, PlainBranches():
        y = x * 3
        (y.sin().sum() + _Keeps.apply(y).sum()).backward()
    assert below.sums == ["out of place"]
    assert torch.equal(_Keeps.kept[0], torch.full((4, 8), 2.0))
    assert x.grad is not None and torch.equal(x.grad, 3 * (y.detach().cos() + 2))


def test_a_gradient_passed_on_as_it_is_is_summed_out_of_place() -> None:
    """`a + b` hands one tensor to both inputs' nodes: summed into at `a` while `b`'s node
    still holds it, the engine sums out of place (`b`'s gradient would change); `x`'s two
    gradients after, each made fresh by a product's formula, in place."""
    x = torch.randn(4, 8, requires_grad=True)
    below = _Below()
    with below, PlainBranches():
        a, b = x * 2, x * 3
        (a.sin().sum() + (a + b).exp().sum()).backward()
    assert below.sums == ["out of place", "in place"]
    expected = 2 * a.detach().cos() + 5 * (a + b).detach().exp()
    assert x.grad is not None and torch.allclose(x.grad, expected)


def test_no_sum_is_in_place_under_a_mode_above_it() -> None:
    """A mode entered after `PlainBranches` adds a reference to every argument: no gradient
    looks held by the engine alone, and every sum stays out of place."""
    below = _Below()
    _scan_grads(torch.randn(8, 4), below, PlainBranches(), _Calls())
    assert below.sums == ["out of place"] * 3


def test_without_torch_s_counts_every_sum_stays_out_of_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from autoshard.wrap import branches

    monkeypatch.setattr(branches, "engine_sums_seen", lambda: False)
    below = _Below()
    _scan_grads(torch.randn(8, 4), below, PlainBranches())
    assert below.sums == ["out of place"] * 3


def test_a_formula_s_own_sum_stays_out_of_place() -> None:
    """`atan2`'s formula adds two tensors it made (`self * self + other * other`): the engine
    has nothing to do with it, and the real step allocates the sum beside them."""
    x = torch.randn(4, 5, requires_grad=True)
    below = _Below()
    with below, PlainBranches():
        torch.atan2(x, torch.randn(4, 5)).backward(torch.ones(4, 5))
    assert below.sums == ["out of place"]


class _VarMean(nn.Module):
    """`var_mean`'s formula sums its two gradients' terms (out of place, a tensor of the
    projection's size beside two more); summed in place, the estimate read 24% under."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(self.inp(x), -1)
        return var.mean() + mean.mean()


def test_the_estimate_holds_a_formula_s_own_sum() -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = _VarMean()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    real, simulated = _real_and_simulated(build, torch.randn(256, 16))
    assert real <= simulated <= real * (1 + WORST_TARGET), (simulated, real)


def test_sparse_gradients_are_summed_as_the_engine_sums_them() -> None:
    """A sparse embedding's gradients have no storage to count: summed as they are."""
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, sparse=True)
    first, second = torch.tensor([1, 3]), torch.tensor([3, 5])
    (embedding(first).sum() + embedding(second).sum()).backward()
    expected = embedding.weight.grad
    assert expected is not None
    embedding.weight.grad = None
    with PlainBranches():
        (embedding(first).sum() + embedding(second).sum()).backward()
    grad = embedding.weight.grad
    assert grad is not None and torch.equal(grad.to_dense(), expected.to_dense())


def test_a_tensor_subclass_s_gradients_are_summed_out_of_place() -> None:
    """The engine sums out of place where either gradient is a subclass (its `add_` may not
    exist or may mean something else)."""
    from torch.testing._internal.two_tensor import TwoTensor

    x = TwoTensor(torch.randn(64), torch.randn(64)).requires_grad_()
    below = _Below()
    with below, PlainBranches():
        y = x * 2
        (y.sin() + y.cos()).sum().backward()
    assert below.sums == ["out of place"]
