"""gloo's own buffers during FSDP2's collectives, measured with the profiler on 2 real gloo ranks:
what `measure.workspace.GLOO_BUFFERS` holds in the simulation. Each case returns the most bytes
allocated at once inside the collective beyond its output (which the caller allocates), and what
GLOO_BUFFERS says; tests/test_workspace.py compares them, so a torch whose gloo copies otherwise
fails there.

Usage (from tests/_dist.py, 2 ranks started directly): gloo_buffers.py OUT_DIR
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _common import Cases
from torch.profiler import ProfilerActivity, profile

from autoshard._torch_compat import allocation_tag
from autoshard.measure.workspace import ALL_GATHER, GLOO_BUFFERS, REDUCE_SCATTER

cases = Cases()
NUMEL = 1 << 14
# torch 2.13 names them *_single; 2.11 has only the older names, deprecated since
GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _held_inside(call: Any) -> int:
    """The most bytes allocated at once, on any thread, while `call` runs, counted from zero."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == allocation_tag():
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
    live = most = 0
    for _, size in sorted(events):
        live += size
        most = max(most, live)
    return most


def _case(func: Any, output: torch.Tensor, input: torch.Tensor, call: Any) -> dict[str, int]:
    return {"measured": _held_inside(call), "modelled": GLOO_BUFFERS[func](output, input)}


@cases.case
def all_gather() -> dict[str, int]:
    input = torch.randn(NUMEL)
    output = torch.empty(NUMEL * dist.get_world_size())
    return _case(
        ALL_GATHER,
        output,
        input,
        lambda: GATHER(output, input),
    )


@cases.case
def reduce_scatter() -> dict[str, int]:
    input = torch.randn(NUMEL)
    output = torch.empty(NUMEL // dist.get_world_size())
    return _case(
        REDUCE_SCATTER,
        output,
        input,
        lambda: SCATTER(output, input),
    )


@cases.case
def all_reduce() -> int:
    tensor = torch.randn(NUMEL)
    return _held_inside(lambda: dist.all_reduce(tensor))


if __name__ == "__main__":
    cases.main()
