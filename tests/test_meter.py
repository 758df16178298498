"""The CPU trial step's meter (`meter.LiveBytes`): the same peak as torch's MemTracker, without
keeping the model alive afterwards (MemTracker's ModTracker does, on torch 2.13)."""

from __future__ import annotations

import gc
import weakref

import torch

import autoshard
from autoshard.cli.demo import GPT, GPTConfig
from autoshard.wrap.meter import LiveBytes, held_tensors


def _gpt() -> tuple[torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=64, n_layer=2))
    tokens = torch.randint(0, 256, (4, 33))
    return model, torch.optim.AdamW(model.parameters()), (tokens[:, :-1], tokens[:, 1:])


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> None:
    model(*batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_peak_equals_memtrackers() -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optimizer, batch = _gpt()
    _step(model, optimizer, batch)  # the optimizer state exists from here on
    meter = LiveBytes(held_tensors(model, optimizer))
    with meter:
        _step(model, optimizer, batch)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        _step(model, optimizer, batch)
    expected = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    assert meter.peak == expected
    assert meter.current == sum(
        t.untyped_storage().nbytes() for t in held_tensors(model, optimizer)
    )  # back to what it started with: the step's tensors are gone


def test_prepare_with_a_trial_step_leaves_nothing_alive() -> None:
    model, optimizer, batch = _gpt()
    params = [weakref.ref(p) for p in model.parameters()]
    prepared = autoshard.prepare(model, optimizer, batch)
    assert prepared.plan.measured_peak_bytes is not None
    del prepared, model, optimizer
    gc.collect()
    assert sum(ref() is not None for ref in params) == 0
