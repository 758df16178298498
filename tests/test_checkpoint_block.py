"""`engines.checkpoint_block` on a block that is no transformers layer: its forward runs inside
torch's non-reentrant `checkpoint` (`engines.CheckpointedForward`), set as the block's own
forward. What a user does with a prepared model still works on it: a deep copy (an EMA copy)
runs its own parameters, pickling keeps the checkpointing, the block's hooks run once per
forward, its signature is its forward's; checkpointing it again changes nothing."""

from __future__ import annotations

import copy
import functools
import inspect
import io
from typing import Any

import torch
from torch import nn

from autoshard.strategies.engines import CheckpointedForward, checkpoint_block

WIDTH = 8


class Counted(nn.Linear):
    """A linear layer that counts its forwards: once per forward, once more per recomputation."""

    def __init__(self) -> None:
        super().__init__(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Counted()

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.inner(x)) * scale


def _step(block: nn.Module, **kwargs: Any) -> torch.Tensor:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
    out = block(x, **kwargs)
    out.sum().backward()
    return out.detach()


def _checkpointed(block: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    checkpoint_block(block)
    assert isinstance(vars(block)["forward"], CheckpointedForward)
    return block


def test_the_forward_is_recomputed_and_the_block_s_hooks_run_once() -> None:
    """The composable checkpoint ran the block's forward pre-hooks again in the recomputation."""
    block = _checkpointed(Block())
    seen: list[str] = []
    block.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    block.register_forward_hook(lambda module, args, output: seen.append("post"))
    block.inner.calls = 0
    _step(block, scale=2.0)  # a keyword argument reaches the forward
    assert block.inner.calls == 2  # forward, and again in backward
    assert seen == ["pre", "post"]
    assert inspect.signature(block.forward) == inspect.signature(Block().forward)


def test_a_deep_copy_runs_its_own_parameters() -> None:
    """Also where the block's forward was its own callable (a partial of the block): a closure
    over it had run the original's parameters in the copy."""
    for own in (False, True):
        block = Block()
        if own:
            block.forward = functools.partial(Block.forward, block, scale=3.0)  # type: ignore[method-assign]
        _checkpointed(block)
        twin = copy.deepcopy(block)
        assert vars(twin)["forward"].module is twin
        with torch.no_grad():
            twin.inner.weight.zero_()
            twin.inner.bias.zero_()
        assert torch.equal(_step(twin), torch.zeros(4, WIDTH)), own
        assert not torch.equal(_step(block), torch.zeros(4, WIDTH)), own
        assert block.inner.weight.grad is not None and twin.inner.weight.grad is not None


def test_pickling_keeps_the_checkpointing() -> None:
    block = _checkpointed(Block())
    buffer = io.BytesIO()
    torch.save(block, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(vars(loaded)["forward"], CheckpointedForward)
    assert vars(loaded)["forward"].module is loaded
    loaded.inner.calls = 0
    torch.testing.assert_close(_step(loaded), _step(block))
    assert loaded.inner.calls == 2


def test_checkpointing_a_block_again_changes_nothing() -> None:
    """`prepare` on a prepared model checkpoints its blocks again: one checkpoint, not two
    nested (before, torch's composable checkpoint raised on a second application)."""
    block = _checkpointed(Block())
    wrapper = vars(block)["forward"]
    checkpoint_block(block)
    assert vars(block)["forward"] is wrapper
    block.inner.calls = 0
    _step(block)
    assert block.inner.calls == 2
