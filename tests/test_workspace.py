"""Kernel workspace (`autoshard.measure.workspace`): a convolution's scratch memory, which fake
tensors and dispatch-level trackers never see, measured once for real and counted in the
simulation at the moment of the call."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from _dist import REPO
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import autoshard
from autoshard.measure import workspace
from autoshard.measure.workspace import Workspace, unmeasured_note

sys.path.insert(0, str(REPO / "benchmarks"))
from _live_bytes import AllocatorProfile  # noqa: E402

CPU = torch.device("cpu")
# A bf16 3x3 convolution: on a CPU without native bf16 its kernel holds several times its output
# in scratch (4.5 MiB beside a 0.5 MiB output on torch 2.13); with native bf16, less.
SHAPE, WEIGHT = (16, 16, 32, 32), (16, 16, 3, 3)


def _conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.conv2d(x, w, padding=1)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    workspace._measured.clear()
    workspace._unmeasured.clear()


def _tracked_peak(workspace: bool) -> int:
    """The tracker's peak over one fake convolution (input and weight count as external)."""
    with FakeTensorMode():
        x = torch.zeros(SHAPE, dtype=torch.bfloat16)
        w = torch.zeros(WEIGHT, dtype=torch.bfloat16)
        tracker = MemTracker()
        tracker.track_external(x, w)
        with tracker:
            if workspace:
                with Workspace(CPU):
                    out = _conv(x, w)
            else:
                out = _conv(x, w)
        del out
    return sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())


def test_simulated_peak_equals_the_allocators_peak_of_the_real_call() -> None:
    x = torch.randn(SHAPE, dtype=torch.bfloat16)
    w = torch.randn(WEIGHT, dtype=torch.bfloat16)
    _conv(x, w)  # kernels built before the measured call, as in a warmed-up step
    gc.collect()
    with AllocatorProfile() as prof:
        with prof.window("call"):
            out = _conv(x, w)
        del out
    real = prof.live_bytes("call").peak  # counted from the profile's start: inputs excluded
    inputs = x.nbytes + w.nbytes
    output = 16 * 16 * 32 * 32 * 2  # bf16

    assert _tracked_peak(workspace=False) == inputs + output  # what the tracker alone sees
    assert real > output  # this kernel does hold scratch memory here
    assert _tracked_peak(workspace=True) == inputs + real  # all of it, at the call


def test_other_operators_pass_through_unmeasured() -> None:
    with FakeTensorMode():
        layer = nn.Linear(8, 8)
        with Workspace(CPU):
            layer(torch.zeros(4, 8)).sum().backward()
    assert workspace._measured == {}
    assert unmeasured_note(CPU) is None


def test_a_running_profiler_is_reported_and_not_remembered() -> None:
    from torch.profiler import profile

    with profile(), FakeTensorMode():
        x, w = torch.zeros(SHAPE), torch.zeros(WEIGHT)
        with Workspace(CPU):
            _conv(x, w)
    note = unmeasured_note(CPU)
    assert note is not None and "a profiler is running" in note and "1 distinct" in note
    assert workspace._measured == {}  # measured next time, once the profiler has stopped
    assert unmeasured_note(CPU) is None  # a note covers the calls since the last one


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)) for _ in range(2))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what-if planning for CUDA without a GPU")
def test_what_if_cuda_plan_says_workspace_is_not_counted() -> None:
    model = _ConvNet()
    optimizer = torch.optim.AdamW(model.parameters())
    plan = autoshard.plan(
        model,
        optimizer,
        torch.randn(4, 8, 16, 16),
        loss_fn=lambda out, batch: out.float().pow(2).mean(),
        world_size=2,
        device="cuda",
        device_memory="80GiB",
    )
    notes = [r for r in plan.reasons if "kernel workspace" in r]
    assert notes and "no CUDA device here" in notes[0], plan.reasons


# Both sides of the CPU split forced, whatever this CPU is: "auto" picks bf16 on CPUs with native
# bf16 (autocast, where batch norm takes a bf16 input and fp32 weights) and fp32 elsewhere.
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_cpu_plan_counts_workspace_in_the_estimate(mixed_precision: str) -> None:
    model = _ConvNet()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(16, 8, 32, 32)

    def loss_fn(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return out.mean()  # no temporaries of its own: the peak falls in backward

    def estimate() -> int:
        plan = autoshard.plan(
            model,
            optimizer,
            batch,
            loss_fn=loss_fn,
            strategy="ddp",
            world_size=2,
            mixed_precision=mixed_precision,
        )
        assert not any("kernel workspace" in r for r in plan.reasons), plan.reasons
        return plan.estimated_peak_bytes

    with_workspace = estimate()
    measured = [v for v in workspace._measured.values() if v is not None]
    assert len(measured) == len(workspace._measured) > 0
    # the same plan with every measured workspace taken as zero: what the tracker alone sees
    workspace._measured.update(dict.fromkeys(workspace._measured, 0))
    without = estimate()
    # one call's workspace at a time is alive: the peak grows by at most the largest
    assert 0 < with_workspace - without <= max(measured)
