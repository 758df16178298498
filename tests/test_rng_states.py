"""The generator states a checkpointed step keeps (`autoshard.measure.rng`): 5,056 bytes of CPU
memory per checkpointed block, which a fake step never allocated, counted where the CPU is the
device trained on, and torch's own generator untouched everywhere else."""

from __future__ import annotations

import gc
import sys
import threading
from contextlib import nullcontext
from typing import Any

import torch
from _dist import REPO
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

import autoshard
from autoshard.measure import rng
from autoshard.measure.fake import fake_mode

sys.path.insert(0, str(REPO / "benchmarks"))
from _live_bytes import AllocatorProfile  # noqa: E402

BLOCKS = 8
WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Net(nn.Module):
    """Narrow blocks: what each saves for backward is small beside a generator state."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def test_a_checkpointed_model_on_the_cpu_is_estimated_with_its_generator_states() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, WIDTH)
    options: dict[str, Any] = dict(
        loss_fn=_loss, strategy="local", mixed_precision="no", activation_checkpointing=True
    )
    plan = autoshard.plan(model, optimizer, (x,), **options)
    assert plan.activation_checkpointing == BLOCKS
    prepared = autoshard.prepare(model, optimizer, (x,), trial_step=False, **options)

    def step() -> None:
        _loss(prepared.model(x), (x,)).backward()
        prepared.optimizer.step()
        prepared.optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    before = sum(p.nbytes for p in model.parameters()) * 3 + x.nbytes  # weights, AdamW, batch
    gc.collect()
    with AllocatorProfile() as prof:
        with prof.window("step"):
            step()
    measured = before + prof.live_bytes("step").peak
    # each block's state is held from its forward to its backward (without them: -75%)
    assert plan.chosen.footprint.activations >= BLOCKS * rng.state_bytes()
    assert measured <= plan.estimated_peak_bytes <= 1.02 * measured, (
        plan.estimated_peak_bytes,
        measured,
        plan.chosen.footprint,
    )


def _tracked_peak(counted: bool) -> int:
    """The tracker's peak over a fake forward and backward of `BLOCKS` checkpointed blocks."""
    torch.manual_seed(0)
    model = Net()
    with fake_mode() as mode:
        x = mode.from_tensor(torch.randn(4, WIDTH))
        tracker = MemTracker()
        tracker.track_external(model, x)
        with tracker, rng.states_counted(torch.device("cpu")) if counted else nullcontext():
            h = x
            for block in model.blocks:
                h = checkpoint(block, h, use_reentrant=False)
            model.head(h).sum().backward()
    return int(sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values()))


def test_a_fake_step_holds_a_state_per_checkpointed_block() -> None:
    added = _tracked_peak(counted=True) - _tracked_peak(counted=False)
    # all BLOCKS kept as backward starts; the recomputation forks one more while it runs
    assert BLOCKS * rng.state_bytes() <= added <= (BLOCKS + 1) * rng.state_bytes()


def test_torchs_generator_is_its_own_outside_and_where_the_fake_mode_is_set_aside() -> None:
    own = torch.get_rng_state
    torch.manual_seed(1)
    expected = torch.rand(3)
    from_thread: list[torch.Tensor] = []
    with fake_mode(), rng.states_counted(torch.device("cpu")):
        assert torch.get_rng_state is not own
        assert torch.get_rng_state().nbytes == rng.state_bytes()  # a fake block
        with _disable_current_modes():  # a kernel run for real inside the step
            torch.manual_seed(1)
            state = torch.get_rng_state()
            assert state.nbytes == rng.state_bytes()
            torch.rand(3)
            torch.set_rng_state(state)  # a real state is set back for real
            assert torch.equal(torch.rand(3), expected)
        thread = threading.Thread(target=lambda: from_thread.append(torch.get_rng_state()))
        thread.start()
        thread.join()
    assert torch.get_rng_state is own
    assert from_thread[0].device.type == "cpu" and not from_thread[0].is_meta
    torch.set_rng_state(from_thread[0])  # another thread got the real state

    with rng.states_counted(torch.device("cuda")):  # host memory there: nothing replaced
        assert torch.get_rng_state is own
