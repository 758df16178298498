"""What the trace counts as saved for backward (`measure.trace`): storages freed in forward are
not, and a storage that takes a freed one's key is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoshard.measure import trace


class _Block(nn.Module):
    def __init__(self, dropped_branch: bool) -> None:
        super().__init__()
        self.dropped_branch = dropped_branch
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropped_branch:
            # sin saves x * 3, a storage of its own; argmax's output needs no gradient, so the
            # branch's graph, and what it saved, is freed at once (routing scores reduced to
            # expert indices)
            self.picked = (x * 3).sin().argmax(-1)
        return torch.relu(self.linear(x))


class _Net(nn.Module):
    def __init__(self, dropped_branch: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(dropped_branch) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_what_forward_frees_is_not_saved_for_backward() -> None:
    saved = {}
    for dropped in (False, True):
        model = _Net(dropped)
        profile = trace.profile_step(model, list(model.blocks), torch.randn(8, 64), None, None)
        saved[dropped] = profile.block_saved_bytes
    assert saved[True] == saved[False]
    assert min(saved[False]) > 0


def test_a_storage_taking_a_freed_one_s_key_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys are storages' addresses: a freed storage's may be taken by the next one allocated
    (the allocator reuses it), which must be counted, as the freed one must not."""
    monkeypatch.setattr(trace, "storage_key", lambda storage: 0)
    attribution = trace._Attribution(1, existing=set())
    attribution.enter(0)
    small = torch.zeros(4)
    attribution.pack(small)
    del small  # freed: its key is free to be taken
    large = torch.zeros(1024)
    attribution.pack(large)
    attribution.pack(large[:8])  # a view of the same storage, alive: counted once
    attribution.forward_done()
    assert attribution.saved_by(0) == large.untyped_storage().nbytes()
