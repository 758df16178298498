"""The user's own `torch.autocast` around a prepared model (the loop of many mixed-precision
scripts: `with torch.autocast(...): loss = model(batch); loss.backward()`).

Autocast keeps a cast copy of each trained parameter in a cache until the outermost autocast
exits. Under LOCAL and DDP autoshard runs the forward under autocast of its own, whose exit is the
outermost one only where the user has none: inside the user's, every parameter's copy stayed
alive to the user's exit, through backward where it runs inside, beside every gradient, and
every checkpointed block's recomputation added its copies again. The plan counts each copy only
while autograd saves it."""

from __future__ import annotations

import contextlib
import gc
import sys
from typing import Any

import pytest
import torch
from _dist import REPO
from torch import nn

import autoshard
from autoshard.strategies.strategy import Strategy

sys.path.insert(0, str(REPO / "benchmarks"))
from _live_bytes import AllocatorProfile  # noqa: E402
from test_compiled_training import Tower  # noqa: E402

WIDTH, BLOCKS, ROWS = 256, 4, 8  # parameters outweigh activations: their copies show


def _prepared(checkpointed: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = Tower(WIDTH, BLOCKS)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(ROWS, WIDTH)
    model, optimizer, plan = autoshard.prepare(
        model, optimizer, batch, strategy="local", mixed_precision="bf16",
        activation_checkpointing=checkpointed,
    )  # fmt: skip
    assert plan.strategy == Strategy.LOCAL and plan.mixed_precision.value == "bf16"
    assert plan.activation_checkpointing == (BLOCKS if checkpointed else 0)
    return model, optimizer, batch


def _loop_peak(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_of: Any,
    users_autocast: bool,
) -> int:
    """The allocator's peak over real steps 2 and 3 of the loop, above what was alive before it;
    with `users_autocast`, forward and backward run inside the user's `torch.autocast`."""
    gc.collect()
    with AllocatorProfile() as prof:
        for step in range(3):  # the first creates AdamW's state
            with prof.window(f"step{step}"):
                context = (
                    torch.autocast("cpu", dtype=torch.bfloat16)
                    if users_autocast
                    else contextlib.nullcontext()
                )
                with context:
                    loss_of(model, batch).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return max(prof.live_bytes(f"step{step}").peak for step in (1, 2))


def _output(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_the_user_s_autocast_keeps_no_cast_parameters_the_plan_does_not_count(
    checkpointed: bool,
) -> None:
    """Before: 131,580 B more inside the user's autocast (plain and checkpointed alike), 2.8% of
    the estimate, at the optimizer's step; a model whose step adds less peaks at the end of
    backward with half its parameters' bytes more."""
    model, optimizer, batch = _prepared(checkpointed)
    theirs = _loop_peak(model, optimizer, batch, _output, users_autocast=True)
    model, optimizer, batch = _prepared(checkpointed)
    plain = _loop_peak(model, optimizer, batch, _output, users_autocast=False)
    assert theirs == plain, (theirs, plain)


def test_a_transformers_layer_s_recomputation_lets_its_casts_go() -> None:
    """transformers' layers checkpoint through their own call (`_checkpointed_without_cache`):
    the same inside the user's autocast, with every layer checkpointed."""
    transformers = pytest.importorskip("transformers")

    def prepared() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, 64, (1, 16))
        batch = {"input_ids": ids, "labels": ids}
        model, optimizer, plan = autoshard.prepare(
            model, optimizer, batch, strategy="local", mixed_precision="bf16",
            activation_checkpointing=True,
        )  # fmt: skip
        assert plan.activation_checkpointing == 4
        return model, optimizer, batch

    def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    theirs = _loop_peak(*prepared(), loss_of, users_autocast=True)
    plain = _loop_peak(*prepared(), loss_of, users_autocast=False)
    assert theirs == plain, (theirs, plain)


def test_a_prepared_model_inside_another_s_forward_leaves_the_outer_casts_cached() -> None:
    """The cache is cleared as the outermost prepared model returns, not as one called inside
    another's forward does: the outer model's weight, used before and after the inner call, is
    cast once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoshard.strategies.engines import autocast_hooks

    class Casts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.count += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    class Outer(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.layer = nn.Linear(WIDTH, WIDTH)
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(self.inner(self.layer(x)))

    inner = nn.Linear(WIDTH, WIDTH)
    outer = Outer(inner)
    for model in (inner, outer):
        autocast_hooks(model, "cpu", torch.bfloat16)
    x = torch.randn(2, WIDTH)
    with Casts() as casts:
        outer(x)
    # x and the outer layer's weight and bias (3), the inner's weight and bias (2), the inner's
    # output to fp32 and back to bf16 for the outer layer (2), the outer output to fp32 (1): 8;
    # with the outer's casts cleared as the inner returns, its weight and bias again: 10
    assert casts.count == 8, casts.count
