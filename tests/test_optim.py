"""Optimizer-state bytes (`optimizer_state_bytes`): each expected value is a formula with a comment
per term, then checked against the state a real `optimizer.step()` on CPU allocates.

The library counts, per trainable parameter, `states x numel x element_size` (full-size state
tensors in the parameter's dtype) plus 4 bytes for a scalar `step`. Real state is compared in two
parts: the full-size tensors must match exactly; the 0-dim scalars are where the 4-byte convention
is only approximate (SGD has no `step`, NAdam/ASGD/Rprop keep more than one scalar).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from autoshard.decide.optimizer import optimizer_state_bytes

FP32 = 4  # bytes per fp32 element
STEP = 4  # bytes of one 0-dim fp32 `step` tensor


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def numel(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def step_once(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(3, 8, dtype=next(model.parameters()).dtype)
    model(x).float().pow(2).sum().backward()
    optimizer.step()


def real_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of full-size state tensors, bytes of 0-dim scalar state tensors) actually held."""
    full = scalar = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                nbytes = value.numel() * value.element_size()
                if value.dim() == 0:
                    scalar += nbytes
                else:
                    full += nbytes
    return full, scalar


def test_adam_two_states() -> None:
    model = make_model()
    params = trainable(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    total, reason = optimizer_state_bytes(optimizer)
    expected = (
        2 * numel(params) * FP32  # exp_avg + exp_avg_sq, each the size of the param, fp32
        + STEP * len(params)  # a 0-dim fp32 step per param
    )
    assert total == expected
    assert reason == "Adam: 2 state(s) per parameter"
    step_once(model, optimizer)
    # Adam's real state is exactly that: the two moments and a fp32 `step` tensor per param.
    assert real_state_bytes(optimizer) == (2 * numel(params) * FP32, STEP * len(params))


def test_adamw_amsgrad_three_states() -> None:
    model = make_model()
    params = trainable(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    total, reason = optimizer_state_bytes(optimizer)
    expected = (
        3 * numel(params) * FP32  # exp_avg + exp_avg_sq + max_exp_avg_sq, fp32
        + STEP * len(params)  # step per param
    )
    assert total == expected
    assert reason == "AdamW: 3 state(s) per parameter"
    step_once(model, optimizer)
    assert real_state_bytes(optimizer) == (3 * numel(params) * FP32, STEP * len(params))


def test_state_is_counted_in_the_parameter_dtype() -> None:
    model = make_model(torch.bfloat16)
    params = trainable(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    total, _ = optimizer_state_bytes(optimizer)
    expected = (
        2 * numel(params) * 2  # exp_avg + exp_avg_sq in bf16 (zeros_like the bf16 param)
        + STEP * len(params)  # step stays a fp32 scalar
    )
    assert total == expected
    step_once(model, optimizer)
    assert real_state_bytes(optimizer) == (2 * numel(params) * 2, STEP * len(params))


def test_sgd_with_momentum_one_state() -> None:
    model = make_model()
    params = trainable(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    total, reason = optimizer_state_bytes(optimizer)
    expected = 1 * numel(params) * FP32  # momentum_buffer, fp32; SGD keeps no `step`
    assert total == expected
    assert reason == "SGD: 1 state(s) per parameter"
    step_once(model, optimizer)
    full, scalar = real_state_bytes(optimizer)
    assert full == numel(params) * FP32
    assert scalar == 0  # no step: the estimate and the real state agree exactly


def test_sgd_without_momentum_no_state() -> None:
    model = make_model()
    params = trainable(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    total, reason = optimizer_state_bytes(optimizer)
    expected = 0 * numel(params) * FP32  # no buffers and no step
    assert total == expected
    assert reason == "SGD: 0 state(s) per parameter"
    step_once(model, optimizer)
    assert real_state_bytes(optimizer) == (0, 0)  # plain SGD allocates nothing


def test_adagrad_one_state() -> None:
    model = make_model()
    params = trainable(model)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    total, reason = optimizer_state_bytes(optimizer)
    expected = (
        1 * numel(params) * FP32  # sum (of squared gradients), fp32
        + STEP * len(params)  # step per param
    )
    assert total == expected
    assert reason == "Adagrad: 1 state(s) per parameter"
    step_once(model, optimizer)
    assert real_state_bytes(optimizer) == (numel(params) * FP32, STEP * len(params))


@pytest.mark.parametrize(
    ("options", "states"),
    [
        ({}, 1),  # square_avg
        ({"momentum": 0.9}, 2),  # square_avg + momentum_buffer
        ({"centered": True}, 2),  # square_avg + grad_avg
        ({"momentum": 0.9, "centered": True}, 3),  # square_avg + momentum_buffer + grad_avg
    ],
)
def test_rmsprop_states(options: dict[str, object], states: int) -> None:
    model = make_model()
    params = trainable(model)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.01, **options)
    total, reason = optimizer_state_bytes(optimizer)
    expected = (
        states * numel(params) * FP32  # the full-size buffers listed above, fp32
        + STEP * len(params)  # step per param
    )
    assert total == expected
    assert reason == f"RMSprop: {states} state(s) per parameter"
    step_once(model, optimizer)
    assert real_state_bytes(optimizer) == (states * numel(params) * FP32, STEP * len(params))


# The remaining optimizers the library knows, with their full-size state count and the scalar
# bytes torch really keeps per parameter (the library allows STEP for all of them).
OTHERS: list[tuple[Callable[..., torch.optim.Optimizer], int, int]] = [
    (torch.optim.Adamax, 2, STEP),  # exp_avg, exp_inf; step
    (torch.optim.NAdam, 2, 2 * STEP),  # exp_avg, exp_avg_sq; step and mu_product
    (torch.optim.RAdam, 2, STEP),  # exp_avg, exp_avg_sq; step
    (torch.optim.Adadelta, 2, STEP),  # square_avg, acc_delta; step
    (torch.optim.Rprop, 2, STEP),  # prev, step_size; step
    (torch.optim.ASGD, 1, 3 * STEP),  # ax; step, eta and mu
]


@pytest.mark.parametrize(
    ("factory", "states", "real_scalar_per_param"), OTHERS, ids=[f.__name__ for f, _, _ in OTHERS]
)
def test_other_known_optimizers(
    factory: Callable[..., torch.optim.Optimizer], states: int, real_scalar_per_param: int
) -> None:
    model = make_model()
    params = trainable(model)
    optimizer = factory(model.parameters(), lr=0.01)
    total, reason = optimizer_state_bytes(optimizer)
    expected = (
        states * numel(params) * FP32  # full-size buffers, fp32
        + real_scalar_per_param * len(params)  # scalar state per param (see OTHERS)
    )
    assert total == expected
    assert reason == f"{factory.__name__}: {states} state(s) per parameter"
    step_once(model, optimizer)
    full, scalar = real_state_bytes(optimizer)
    assert full == states * numel(params) * FP32
    assert scalar == real_scalar_per_param * len(params)  # the estimate matches reality


def test_frozen_parameters_are_excluded() -> None:
    model = make_model()
    first, last = model[0], model[2]
    first.requires_grad_(False)
    frozen_numel = first.weight.numel() + first.bias.numel()
    params = trainable(model)
    assert params == [last.weight, last.bias]
    # The optimizer is handed every parameter, frozen ones included (torch accepts that).
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    total, _ = optimizer_state_bytes(optimizer)
    expected = (
        2 * numel(params) * FP32  # exp_avg + exp_avg_sq of the trainable params only
        + STEP * len(params)  # step per trainable param
    )
    assert total == expected
    assert frozen_numel > 0 and numel(params) < numel(list(model.parameters()))
    step_once(model, optimizer)
    # Frozen parameters get no gradient, so torch allocates no state for them either.
    assert real_state_bytes(optimizer) == (2 * numel(params) * FP32, STEP * len(params))


def test_param_groups_with_different_settings() -> None:
    model = make_model()
    first = [model[0].weight, model[0].bias]
    last = [model[2].weight, model[2].bias]
    optimizer = torch.optim.Adam(
        [{"params": first, "amsgrad": True}, {"params": last, "lr": 1e-4}], lr=1e-3
    )
    total, reason = optimizer_state_bytes(optimizer)
    expected = (
        3 * numel(first) * FP32  # group 0 (amsgrad): exp_avg + exp_avg_sq + max_exp_avg_sq
        + 2 * numel(last) * FP32  # group 1: exp_avg + exp_avg_sq
        + STEP * (len(first) + len(last))  # step per param
    )
    assert total == expected
    assert reason == "Adam: 2/3 state(s) per parameter"
    step_once(model, optimizer)
    assert real_state_bytes(optimizer) == (
        (3 * numel(first) + 2 * numel(last)) * FP32,
        STEP * (len(first) + len(last)),
    )


def test_sgd_groups_with_and_without_momentum() -> None:
    model = make_model()
    first = [model[0].weight, model[0].bias]
    last = [model[2].weight, model[2].bias]
    optimizer = torch.optim.SGD(
        [{"params": first, "momentum": 0.9}, {"params": last}], lr=0.1, momentum=0.0
    )
    total, reason = optimizer_state_bytes(optimizer)
    expected = (
        1 * numel(first) * FP32  # group 0: momentum_buffer
        + 0 * numel(last) * FP32  # group 1: no buffer; SGD keeps no step in either
    )
    assert total == expected
    assert reason == "SGD: 0/1 state(s) per parameter"
    step_once(model, optimizer)
    assert real_state_bytes(optimizer) == (numel(first) * FP32, 0)  # SGD keeps no step


class SignMomentum(torch.optim.Optimizer):
    """A custom optimizer the library cannot know: one momentum buffer per parameter."""

    def __init__(self, params: object, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["beta"]).add_(p.grad)
                p.add_(buf.sign(), alpha=-group["lr"])


def test_unknown_optimizer_is_assumed_to_hold_two_states_and_says_so() -> None:
    model = make_model()
    params = trainable(model)
    optimizer = SignMomentum(model.parameters())
    total, reason = optimizer_state_bytes(optimizer)
    expected = (
        2 * numel(params) * FP32  # two assumed full-size states (Adam-like), fp32
        + STEP * len(params)  # step allowance per param
    )
    assert total == expected
    assert "SignMomentum" in reason
    assert "unknown optimizer" in reason
    assert "assumed 2" in reason
    step_once(model, optimizer)
    # Difference: this optimizer really holds one buffer, so the assumption is conservative here.
    assert real_state_bytes(optimizer) == (1 * numel(params) * FP32, 0)


def test_adafactor_holds_a_factored_second_moment() -> None:
    """torch.optim.Adafactor keeps a row and a column per matrix and a full state per vector:
    assumed two full states before, a held-out sweep's MLP read +86% against its measured peak."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 2), nn.Conv1d(2, 3, 5))
    optimizer = torch.optim.Adafactor(model.parameters())
    total, reason = optimizer_state_bytes(optimizer)
    assert reason == "Adafactor: a row and a column per matrix, a full state per vector"
    x = torch.randn(3, 8)
    model[3](model[:3](x).unsqueeze(-1).expand(3, 2, 7)).sum().backward()
    optimizer.step()
    full, scalar = real_state_bytes(optimizer)
    assert total == full + scalar
    assert full == ((6 + 8) + 6 + (2 + 6) + 2 + (3 * 2 + 3 * 5) + 3) * FP32  # rows, columns, bias


def test_adafactor_is_not_sharded(one_rank_group: None) -> None:
    """Its step fails on FSDP2's sharded parameters (torch 2.11 to 2.15): a held-out sweep's
    forced FULL_SHARD raised in the trial step, and under a limit auto chose it. The plan now
    leaves FSDP2 out; real FSDP2 fails as the rule says."""
    from torch.distributed.fsdp import fully_shard

    import autoshard
    from autoshard import Strategy

    model = make_model()
    optimizer = torch.optim.Adafactor(model.parameters())
    batch = torch.randn(4, 8)

    def plan(**options: object) -> autoshard.Plan:
        loss = lambda out, _: out.square().mean()  # noqa: E731
        return autoshard.plan(model, optimizer, batch, loss_fn=loss, world_size=2, **options)

    chosen = plan(mixed_precision="no")
    assert {c.strategy for c in chosen.candidates} == {Strategy.DDP}
    assert any(r.startswith("torch's Adafactor step fails on FSDP2's") for r in chosen.reasons)
    with pytest.raises(ValueError, match="strategy FULL_SHARD cannot train this job: torch's"):
        plan(strategy="full_shard")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    sharded = torch.optim.Adafactor(model.parameters())
    model(batch).square().mean().backward()
    with pytest.raises(RuntimeError, match="aten.pow_.Scalar: in-place operations"):
        sharded.step()


def test_rebinding_moves_a_scalar_parameter_s_state_but_not_its_step_count() -> None:
    """`wrap.optim.rebind` moves state to the wrapped parameter's device, but for its shape:
    a parameter of no dimension (kept whole under FSDP2, moved to the device) has state of the
    same shape as Adam's `step`, which must stay where torch's optimizers keep it (on the CPU,
    unless `capturable`)."""
    from autoshard.wrap.optim import parameter_names, rebind

    model = nn.Module()
    model.scale = nn.Parameter(torch.tensor(1.5))
    optimizer = torch.optim.Adam(model.parameters())
    model.scale.grad = torch.tensor(0.25)
    optimizer.step()
    names = parameter_names(model)
    moved = nn.Parameter(torch.empty((), device="meta"))
    rebind(optimizer, names, {"scale": moved})
    assert optimizer.param_groups[0]["params"] == [moved]
    state = optimizer.state[moved]
    assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
    assert state["step"].device.type == "cpu" and float(state["step"]) == 1.0
