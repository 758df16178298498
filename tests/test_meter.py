"""The CPU trial step's meter (`meter.LiveBytes`): the same peak as torch's MemTracker, without
keeping the model alive afterwards (MemTracker's ModTracker does, on torch 2.13)."""

from __future__ import annotations

import gc
import weakref

import pytest
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


def test_the_batch_counts_as_the_estimate_counts_it() -> None:
    """The trial's meter starts with the batch: a slice of a dataset kept whole in memory as its
    slice, also where the step makes a view of it (the view's storage is the dataset's), and a
    tensor the model itself holds once."""
    model = torch.nn.Linear(64, 64)
    dataset = torch.randn(10_000, 64)
    batch = {"x": dataset[:32], "also": dataset[:32], "w": model.weight.detach()}
    meter = LiveBytes(held_tensors(model, torch.optim.SGD(model.parameters(), lr=0.1)), batch)
    held = (64 * 64 + 64) * 4
    assert meter.current == held + 32 * 64 * 4 * 2  # both slices, as the estimate counts them
    with meter:
        view = batch["x"].view(-1)  # a view of the dataset's storage: counted already
        assert meter.current == held + 32 * 64 * 4 * 2
    del view


def test_prepare_with_a_trial_step_leaves_nothing_alive() -> None:
    model, optimizer, batch = _gpt()
    params = [weakref.ref(p) for p in model.parameters()]
    prepared = autoshard.prepare(model, optimizer, batch)
    assert prepared.plan.measured_peak_bytes is not None
    del prepared, model, optimizer
    gc.collect()
    assert sum(ref() is not None for ref in params) == 0


class _Refused(Exception):
    pass


def _refuse(*args: object, **kwargs: object) -> None:
    raise _Refused


def test_resize_patch_follows_resizes_and_is_undone_on_exit_and_on_error() -> None:
    original = torch.UntypedStorage.resize_
    storage = torch.zeros(0, dtype=torch.uint8).untyped_storage()
    meter = LiveBytes([])
    with meter:
        assert torch.UntypedStorage.resize_ is not original
        storage.resize_(4096)
    assert torch.UntypedStorage.resize_ is original
    assert meter.peak >= 4096  # counted through the patch: no operator ran
    with pytest.raises(_Refused), LiveBytes([]):
        _refuse()
    assert torch.UntypedStorage.resize_ is original


def test_resize_patch_undone_when_entering_the_mode_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    original = torch.UntypedStorage.resize_
    monkeypatch.setattr(LiveBytes.__bases__[0], "__enter__", _refuse)  # TorchDispatchMode's
    with pytest.raises(_Refused), LiveBytes([]):
        pass
    assert torch.UntypedStorage.resize_ is original


def test_resize_patch_undone_when_leaving_the_mode_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    original = torch.UntypedStorage.resize_
    mode = LiveBytes.__bases__[0]
    meter = LiveBytes([])
    meter.__enter__()
    monkeypatch.setattr(mode, "__exit__", _refuse)
    try:
        with pytest.raises(_Refused):
            meter.__exit__(None, None, None)
        assert torch.UntypedStorage.resize_ is original
    finally:
        monkeypatch.undo()
        mode.__exit__(meter, None, None, None)  # off the dispatch mode stack again
