"""How fast this host runs what CPU offload puts on it: the optimizer step over state in host
memory, and copies between pinned host memory and the GPU.

Under FSDP2's `CPUOffloadPolicy` the optimizer step runs on the CPU over every offloaded
parameter, gradient and state, and each unit's shard crosses the host link twice a step (its
gradient once back). Those two, not the GPU, set the offload rung's step time: on an H100 host a
0.4B decoder took 633 ms a step offloaded against 103 ms unwrapped. The cost model's constants
for them (`decide.hardware`) are round figures; a host with a few busy cores steps many times
slower than one with dozens. Where this process trains on its own GPU, both are measured once
(cached for the process) and every rank's figures are agreed (the slowest), so that each ranks
offload against checkpointing the same way.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from autoshard._torch_compat import disable_current_modes
from autoshard._units import human
from autoshard._world import RankReport
from autoshard.decide.plan import PlanInputs

logger = logging.getLogger("autoshard")

# The probe's parameters: large enough to leave the CPU caches (with gradients and AdamW's two
# states, 256 MiB touched per step), small enough for a fraction of a second.
_PROBE_TENSORS, _PROBE_NUMEL = 4, 2**22
_LINK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class HostThroughput:
    """One rank's host figures for the cost model (`Hardware`'s host terms).

    Attributes:
        step_bytes_per_s: parameters, gradients and optimizer state an optimizer step on the
            CPU goes through per second, counted as the cost model counts them (twice: read and
            written).
        link_bytes_per_s: pinned host-to-device copy bandwidth; None without a GPU.
        note: what was measured, how, for the plan's reasons.
    """

    step_bytes_per_s: float
    link_bytes_per_s: float | None
    note: str


_cache: dict[tuple[Any, ...], HostThroughput] = {}


def host_throughput(
    device: torch.device, optimizer: torch.optim.Optimizer
) -> HostThroughput | None:
    """The host's figures where this process trains on its own GPU (the only place CPU offload
    runs), measured once per process and optimizer class; None elsewhere, or where measuring
    failed (the constants stand)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    key = (device, type(optimizer), torch.get_num_threads())
    if key not in _cache:
        try:
            _cache[key] = measure_host(optimizer, device)
        except Exception:  # noqa: BLE001 - a failed probe leaves the constants, it stops nothing
            logger.debug("measuring the host's offload throughput failed", exc_info=True)
            return None
    return _cache[key]


def measure_host(
    optimizer: torch.optim.Optimizer, device: torch.device | None = None
) -> HostThroughput:
    """Time the caller's optimizer class (its defaults; AdamW where it cannot be built so) on
    CPU tensors, and pinned copies to `device` where one is given."""
    with disable_current_modes():
        step, which = _step_rate(optimizer)
        link = _link_rate(device) if device is not None and device.type == "cuda" else None
    note = (
        f"host throughput for CPU offload measured on this host: {which} step on the CPU "
        f"through {human(int(step))}/s of parameters, gradients and state"
    )
    if link is not None:
        note += f", pinned copies to {device} at {human(int(link))}/s"
    return HostThroughput(step, link, note)


def _step_rate(optimizer: torch.optim.Optimizer) -> tuple[float, str]:
    params = [torch.zeros(_PROBE_NUMEL, requires_grad=True) for _ in range(_PROBE_TENSORS)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    probe, which = _like(optimizer, params)
    probe.step()  # creates the state
    state = sum(
        t.numel() * t.element_size()
        for s in probe.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    touched = 2 * (state + 2 * sum(p.numel() * p.element_size() for p in params))
    seconds = fastest_of(probe.step, 2)
    return touched / seconds, which


def _like(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
) -> tuple[torch.optim.Optimizer, str]:
    """An optimizer of the caller's class and defaults over `params`, else AdamW's defaults. Only
    the defaults its constructor takes are given: AdamW's hold `decoupled_weight_decay`, which
    AdamW's constructor does not take (torch 2.11 to 2.15)."""
    cls = type(optimizer)
    try:
        taken = inspect.signature(cls).parameters
        keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values())
        defaults = {k: v for k, v in optimizer.defaults.items() if keywords or k in taken}
        return cls(params, **defaults), f"{cls.__name__}'s"
    except Exception:  # noqa: BLE001 - a class that needs more than its defaults
        return torch.optim.AdamW(params), f"AdamW's (standing in for {cls.__name__})"


def _link_rate(device: torch.device) -> float:
    host = torch.empty(_LINK_BYTES, dtype=torch.uint8).pin_memory()
    target = torch.empty(_LINK_BYTES, dtype=torch.uint8, device=device)

    def copy() -> None:
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    copy()
    return _LINK_BYTES / fastest_of(copy, 3)


def fastest_of(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` runs, in seconds: a busy host slows some runs, never speeds one."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def with_host(inputs: PlanInputs, reports: list[RankReport]) -> PlanInputs:
    """`inputs` with the slowest rank's host figures for CPU offload (`measure.host`), where
    every rank measured them; else as they are (the constants)."""
    measured: list[HostThroughput] = [
        r.offload_throughput for r in reports if r.offload_throughput is not None
    ]
    if not measured or len(measured) < len(reports):
        return inputs
    slowest = min(measured, key=lambda h: h.step_bytes_per_s)
    links = [h.link_bytes_per_s for h in measured]
    figures: dict[str, Any] = {"host_memory_bytes_per_s": slowest.step_bytes_per_s}
    if all(link is not None for link in links):
        figures["host_link_bytes_per_s"] = min(link for link in links if link is not None)
    hardware = inputs.hardware
    hardware = replace(
        hardware,
        **figures,
        source=f"{hardware.source} (the host's optimizer step and pinned link measured)",
    )
    where = f" (the slowest of {len(reports)} ranks)" if len(reports) > 1 else ""
    return replace(inputs, hardware=hardware, reasons=(*inputs.reasons, slowest.note + where))
