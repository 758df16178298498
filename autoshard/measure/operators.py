"""Whether blocks the layout calls alike run the same operators (issue 24): the check that lets a
model be traced and simulated with a few periods of its blocks and extended.

`measure.alike` compares blocks by what they hold (classes, attributes, parameter shapes), which
tells sliding- from global-attention layers where each layer keeps its kind. A block can also
compute by its position alone: a forward that reads `self.layer_idx % 4`, a parent that calls
every sixth block with a longer sequence. Such blocks hold the same, and a shallow copy would run
only the first positions' kind: the extension would stand for blocks it never ran. So the whole
model's forward runs once on fake tensors (no memory, no backward), and each block's operators
are recorded (name, and each output's shape and dtype) with what autograd saves for backward (a
parent checkpointing its first blocks, or running some without gradients, runs the same
operators in them but saves otherwise: Megatron's "block" recomputation), with those the model
runs after it before the next (a parent adding a mid-depth head after one block): every block,
and what follows it, must run what the block one period before it ran, from the third period on
(the first two always run in the shallow copies, so they may differ: a first layer fed by the
embedding's dtype). What follows a list's last block (the head, the next list) is its own."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoshard._batch import split_batch
from autoshard._torch_compat import TorchDispatchMode, tree_leaves
from autoshard.measure.fake import fake_mode, wider_fake_kernels
from autoshard.measure.layout import SHALLOW, Layout
from autoshard.measure.trace import autocast_for, device_type_of, fake_state
from autoshard.wrap.snapshot import attributes_kept

# A block's operators: each operator's name with its outputs' shapes and dtypes, in order
Operators = tuple[tuple[str, tuple[tuple[tuple[int, ...], str], ...]], ...]


def first_unlike(
    model: nn.Module,
    blocks: list[nn.Module],
    names: list[str],
    repeats: Layout,
    batch: Any,
    autocast_dtype: torch.dtype | None,
    device: torch.device | None = None,
) -> str | None:
    """Where two blocks that `repeats` extends one from the other run different operators, or
    the model runs different ones after them (a parent acting after the middle block): a
    sentence naming them and the first operator that differs; None where every block, and what
    follows it, runs its period's. Raises what the forward raises (the caller then trusts the
    attributes). `device`: where a model on meta runs (`trace.fake_state`)."""
    inside, after = operators_by_block(model, blocks, batch, autocast_dtype, device)
    at = {name: i for i, name in enumerate(names)}
    for stretch in repeats.stretches:
        if stretch.periods == 0:
            continue  # all lead: every block of it runs in each copy
        first = stretch.lead + (SHALLOW[0] - 1) * stretch.period  # the third period
        for i in range(first + stretch.period, len(stretch.names)):
            block, before = stretch.names[i], stretch.names[i - stretch.period]
            mine, theirs = inside[at[block]], inside[at[before]]
            if mine != theirs:
                return (
                    f"blocks {before} and {block} hold the same but run different operators "
                    f"({_first_difference(theirs, mine)})"
                )
            last = i == len(stretch.names) - 1  # what follows a list's last block is its own
            mine, theirs = after[at[block]], after[at[before]]
            if not last and mine != theirs:
                return (
                    f"the model runs different operators after blocks {before} and {block}, "
                    f"which hold the same ({_first_difference(theirs, mine)})"
                )
    return None


def operators_by_block(
    model: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    autocast_dtype: torch.dtype | None,
    device: torch.device | None = None,
) -> tuple[list[Operators], list[Operators]]:
    """The operators each of `blocks` runs in one forward of `batch`, and those run after it
    until the next block begins, each with what autograd saved (on fake tensors, no backward:
    no memory is used and nothing of the model changes, its attributes put back)."""
    mode = fake_mode()
    state, fake_batch = fake_state(mode, model, batch, device)
    recorder = _Recorder(len(blocks))
    handles = [
        hook
        for index, block in enumerate(blocks)
        for hook in (
            block.register_forward_pre_hook(lambda *_, i=index: recorder.enter(i)),
            block.register_forward_hook(lambda *_, i=index: recorder.leave(i)),
        )
    ]
    device_type = device_type_of(model, device)
    autocast = autocast_for(device_type, autocast_dtype)
    try:
        # with autograd, and what it saves recorded: a block the parent checkpoints or runs
        # without gradients by its position runs the same operators but saves otherwise
        with (
            attributes_kept(model),
            wider_fake_kernels(device_type),
            mode,
            recorder,
            torch.autograd.graph.saved_tensors_hooks(recorder.saved, _nothing),
            autocast,
        ):
            args, kwargs = split_batch(fake_batch)
            torch.func.functional_call(model, state, args, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return [tuple(ran) for ran in recorder.inside], [tuple(ran) for ran in recorder.after]


class _Recorder(TorchDispatchMode):
    """Records each operator run inside a block under that block, and each run between blocks
    under the block before."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.inside: list[list[Any]] = [[] for _ in range(n_blocks)]
        self.after: list[list[Any]] = [[] for _ in range(n_blocks)]
        self.ran: list[Any] | None = None  # where the operator run now goes; None: before any

    def enter(self, index: int) -> None:
        self.ran = self.inside[index]

    def leave(self, index: int) -> None:
        self.ran = self.after[index]

    def saved(self, tensor: torch.Tensor) -> None:
        """Saved for backward (nothing is kept: no backward runs)."""
        if self.ran is not None:
            self.ran.append(("saved for backward", ((tuple(tensor.shape), str(tensor.dtype)),)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.ran is not None:
            outputs = tuple(
                (tuple(t.shape), str(t.dtype))
                for t in tree_leaves(out)
                if isinstance(t, torch.Tensor)
            )
            self.ran.append((str(func), outputs))
        return out


def _first_difference(a: Operators, b: Operators) -> str:
    for x, y in zip(a, b, strict=False):
        if x != y:
            return f"{_said(x)} against {_said(y)}"
    longer, count = (a, len(b)) if len(a) > len(b) else (b, len(a))
    return f"{len(longer) - count} more operator(s), the first {_said(longer[count])}"


def _said(op: tuple[str, tuple[tuple[tuple[int, ...], str], ...]]) -> str:
    name, outputs = op
    return f"{name} -> " + ", ".join(f"{list(shape)} {dtype}" for shape, dtype in outputs)


def _nothing(packed: None) -> torch.Tensor:
    raise RuntimeError("the operator check runs no backward")
