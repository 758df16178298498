"""`torch.compile` and autoshard: a compiled model handed to `plan`/`prepare` still compiles in
training, and a prepared model compiled afterwards (`torch.compile(model)`, as torch's DDP
documents) trains, mixed precision and checkpointed blocks included, as the eager one does.

CPU only, no C++ compiler needed: a backend that counts the graphs dynamo hands it, and
AOTAutograd's `aot_eager` (what inductor builds on: where checkpointed blocks broke)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import launch
from torch import nn

import autoshard

WIDTH, BLOCKS, ROWS = 32, 4, 8


class Tower(nn.Module):
    """`blocks` of a linear layer and a tanh each."""

    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def built() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = Tower()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(ROWS, WIDTH)


class _Counted:
    """A dynamo backend that runs each graph as traced, counting them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return graph.forward


def prepared_and_trained(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    compile_it: bool,
    **options: Any,
) -> list[float]:
    """The losses of three steps of `model` prepared with `options` (every block checkpointed
    where they ask for it), compiled afterwards with `compile_it`."""
    model, optimizer, plan = autoshard.prepare(model, optimizer, batch, **options)
    assert plan.activation_checkpointing == (BLOCKS if options["activation_checkpointing"] else 0)
    run = torch.compile(model, backend="aot_eager") if compile_it else model
    losses = []
    for _ in range(3):
        loss = run(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def dynamo_reset() -> Any:
    """Each test's compiled code from scratch, and none left for the next test."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.parametrize("call", ["plan", "prepare"])
def test_a_compiled_model_still_compiles_after_autoshard_ran_it(call: str) -> None:
    """Dynamo refuses a frame it meets under a torch dispatch mode (every fake step of the
    planning, the CPU trial's meter) and remembers the refusal for the frame's code for good:
    the model autoshard had planned never compiled again (0 graphs in training), nor a fresh
    model of its class."""
    model, optimizer, batch = built()
    backend = _Counted()
    compiled = torch.compile(model, backend=backend)
    if call == "plan":
        autoshard.plan(compiled, optimizer, batch, world_size=1, mixed_precision="no")
    else:
        compiled, optimizer, plan = autoshard.prepare(
            compiled, optimizer, batch, strategy="local", mixed_precision="no"
        )
        assert plan.measured_peak_bytes is not None  # its trial step ran (eagerly, on CPU)
    assert backend.graphs == 0  # nothing compiled under autoshard's modes
    compiled(batch).backward()
    assert backend.graphs >= 1
    fresh = _Counted()
    torch.compile(Tower(), backend=fresh)(batch)
    assert fresh.graphs >= 1


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_prepared_model_compiled_afterwards_trains_as_the_eager_one(
    precision: str, checkpointed: bool
) -> None:
    """Before: with mixed precision, dynamo traced the autocast hook's `__enter__` without
    running it and the forward hook's `__exit__` raised "'autocast' object has no attribute
    'prev'"; with checkpointed blocks (torch's composable, hook-based checkpoint, from torch
    2.13) backward raised "CheckpointError: ... Recomputed values for the following tensors
    have different metadata". Now both train, their losses and parameters those of the same
    model trained eagerly."""
    trained = []
    for compile_it in (False, True):
        model, optimizer, batch = built()
        losses = prepared_and_trained(
            model, optimizer, batch, compile_it, strategy="local", mixed_precision=precision,
            activation_checkpointing=checkpointed,
        )  # fmt: skip
        trained.append((losses, copy.deepcopy(model.state_dict())))
    (eager_losses, eager_state), (losses, state) = trained
    # equal here; the tolerance leaves room for a decomposition's rounding, far below what
    # computing in fp32 instead of bf16 moves this loss (3e-4)
    assert losses == pytest.approx(eager_losses, rel=1e-5, abs=0)
    for name, value in eager_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_prepared_model_compiled_afterwards_trains_on_two_ranks(tmp_path: Path) -> None:
    """DDP (compiled through its DDPOptimizer) and FSDP2 FULL_SHARD, bf16, every block
    checkpointed, on 2 gloo ranks: the compiled model's losses are the eager one's."""
    run = launch("compiled", tmp_path)
    for strategy in ("ddp", "full_shard"):
        for losses in run.case(strategy):
            assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5, abs=0), (
                strategy,
                losses,
            )
