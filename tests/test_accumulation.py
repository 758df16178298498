"""Gradient accumulation as a planning input (issue 12): `accumulation_steps` is checked, each
candidate's gradients grow by what earlier micro-batches leave alive, and the trial step runs that
many micro-batches per optimizer step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import autoshard
from autoshard import Strategy
from autoshard.decide.estimate import ModelStats, Setting, analytic
from autoshard.decide.profile import ActivationProfile
from autoshard.decide.validate import check_request

FP32 = 4


def _request(steps: object) -> object:
    return check_request(
        strategy="auto",
        mixed_precision="no",
        activation_checkpointing="auto",
        memory_limit=None,
        loss_fn=None,
        trial_step=True,
        accumulation_steps=steps,
    )


def test_accumulation_steps_is_checked() -> None:
    assert _request(4).accumulation_steps == 4  # type: ignore[attr-defined]
    with pytest.raises(ValueError) as raised:
        _request(0)
    assert str(raised.value) == (
        "accumulation_steps=0 must be at least 1 (1: no gradient accumulation); write the "
        "number of micro-batches whose gradients are summed before each optimizer step"
    )
    for bad in (True, 2.0, "4"):
        with pytest.raises(TypeError, match="accumulation_steps must be an int"):
            _request(bad)


STATS = ModelStats(
    param_bytes=40_000 * FP32,
    trainable_bytes=40_000 * FP32,
    floating_numel=40_000,
    block_numel=(10_000, 10_000, 10_000),
    optimizer_bytes=2 * 40_000 * FP32,
    optimizer_reason="AdamW",
    input_bytes=0,
)


def _grads(strategy: Strategy, steps: int) -> int:
    s = Setting(strategy, 0, 2, FP32, FP32, "cpu", False, accumulation_steps=steps)
    # activations large enough that the backward phase is the peak (saved by the head; the
    # batch is held at the step as well)
    profile = ActivationProfile((), (), 0, 10**7, 0, (), 0, torch.float32)
    return analytic(STATS, profile, s).grads


def test_accumulated_gradients_by_strategy() -> None:
    trainable = STATS.trainable_bytes
    # Unwrapped, backward holds about the largest unit's gradients beside the activations (10,000
    # elements, the root's and each block's); accumulating, every gradient is alive by then.
    assert _grads(Strategy.LOCAL, 1) == 10_000 * FP32
    assert _grads(Strategy.LOCAL, 4) == trainable
    # DDP's buckets hold every gradient from construction on; under no_sync autograd
    # accumulates into gradients of its own beside them.
    assert _grads(Strategy.DDP, 1) == trainable
    assert _grads(Strategy.DDP, 4) == 2 * trainable
    # FSDP2 without gradient sync keeps every unit's unsharded gradient beside the sharded ones.
    for strategy in (Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD):
        assert _grads(strategy, 1) == trainable // 2
        assert _grads(strategy, 4) == trainable // 2 + trainable


def test_accumulated_gradients_join_the_simulated_backward_peak() -> None:
    from autoshard.decide.estimate import Phase, Simulated, from_simulation

    backward = Phase(100, 0, 30, 200, 5_000, 50, 0)  # FULL_SHARD at 2 ranks, by term
    step = Phase(100, 0, 100, 200, 0, 0, 4_000)
    simulated = Simulated(backward, step, degree=2)
    stats = dataclasses.replace(STATS, trainable_bytes=200, param_rows=())

    def grads(steps: int) -> int:
        s = Setting(Strategy.FULL_SHARD, 0, 2, FP32, FP32, "cpu", False, accumulation_steps=steps)
        return from_simulation(stats, None, s, simulated).grads

    assert grads(1) == 30  # the backward phase is the peak either way
    assert grads(2) == 30 + 200  # + every unsharded gradient


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.square().mean()


def test_plan_states_accumulation_and_counts_it() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(16, 256)
    kwargs = dict(world_size=2, device_memory="1GiB", mixed_precision="no", strategy="full_shard")
    once = autoshard.plan(model, optimizer, batch, **kwargs)  # type: ignore[arg-type]
    four = autoshard.plan(model, optimizer, batch, accumulation_steps=4, **kwargs)  # type: ignore[arg-type]
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())
    # every gradient whole (unsharded, until the last micro-batch reduces it), standing in for
    # the sharded ones the simulated moment held
    assert four.candidates[0].footprint.grads == trainable
    assert four.estimated_peak_bytes > once.estimated_peak_bytes
    assert any(r.startswith("gradient accumulation over 4 micro-batches") for r in four.reasons)
    assert not any(r.startswith("gradient accumulation") for r in once.reasons)


def test_trial_step_runs_every_micro_batch_and_the_estimate_holds_it() -> None:
    """Issue 12: accumulating cost 13-17% more than the plan, which could not be told about it.
    One process, unwrapped: the gradients of earlier micro-batches live beside the activations."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(512, 256)  # activations enough that backward is the peak
    _, _, plain = autoshard.prepare(model, optimizer, batch, mixed_precision="no")
    forwards: list[bool] = []  # real forwards only, not the planning trace's
    model.register_forward_pre_hook(lambda _, args: forwards.append(not is_fake(args[0])))
    _, _, plan = autoshard.prepare(
        model, optimizer, batch, mixed_precision="no", accumulation_steps=3
    )
    assert sum(forwards) == 2 * 3  # a fresh AdamW: two trial steps of three micro-batches each
    assert plan.measured_peak_bytes is not None and plain.measured_peak_bytes is not None
    assert plan.measured_peak_bytes > plain.estimated_peak_bytes  # what the plan missed
    assert plan.estimated_peak_bytes >= plan.measured_peak_bytes


class Embedded(nn.Module):
    """An embedding, wide blocks, a small head, a short batch: FSDP2's backward peaks late, with
    the blocks' gradients reduced to their shards already."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 512)
        self.blocks = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))
        self.head = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h).square().mean()


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_fsdp2_accumulating_counts_each_gradient_once(
    one_rank_group: None, mixed_precision: str
) -> None:
    """FSDP2 with gradient sync off keeps each unit's gradient whole until the last micro-batch
    reduce-scatters it. The plan added every gradient to the simulated backward peak, which held
    the shards of the units reduced by then: those counted twice, +14% on two gloo ranks (a random
    eight-block model, bf16, every block checkpointed), +12% of this model's peak at one rank.
    Every gradient whole now stands in for the moment's own (never fewer: a unit holds its whole
    gradient or its shard). Held to less than one block's gradient above the trial's peak, which
    the shards counted twice exceeded two to three times over (2.6 MB fp32, 3.2 MB bf16; now
    16 KB fp32 and 296 KB bf16, 1.5%, not traced: RESULTS.md names a likely cause)."""
    torch.manual_seed(0)
    model = Embedded()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randint(0, 64, (8, 16))
    _, _, plan = autoshard.prepare(
        model,
        optimizer,
        batch,
        strategy="full_shard",
        mixed_precision=mixed_precision,
        activation_checkpointing=False,
        accumulation_steps=3,
    )
    measured, estimated = plan.measured_peak_bytes, plan.estimated_peak_bytes
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    assert measured is not None
    assert measured <= estimated < measured + block, (estimated, measured)
