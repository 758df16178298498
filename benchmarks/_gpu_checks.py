"""GPU suite sections besides estimate accuracy: the torch features autoshard checks for at run
time (compat), the cost model's throughput measured (calibration), and a real out-of-memory
under `memory_limit` with the fallback (oom). Each runs on CPU too, small, for the dry run."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn

import autoshard
from autoshard.decide.hardware import Throughput, hardware_for
from autoshard.measure.device import _fsdp_host_times

DISAGREEMENT = 0.20  # beyond this the measured figure replaces the constant

# ---------------------------------------------------------------------------------------------
# calibration


def _timed(device: torch.device, fn: Callable[[], Any], repeats: int) -> float:
    """Seconds per call, the fastest of three runs of `repeats` calls after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def calibrate(device: torch.device, dry_run: bool) -> dict[str, Any]:
    """Measured matmul FLOP/s (bf16 on CUDA, fp32 on the CPU dry run), memory bandwidth, time
    per operator launch and FSDP2's host times (per unit, per all-gather) beside `hardware_for`'s
    constants; a figure off by more than DISAGREEMENT, or measured where none is assumed, is
    taken from the measurement (`Throughput`), and the resulting `Hardware` is reported."""
    low = device.type == "cuda"
    dtype = torch.bfloat16 if low else torch.float32
    n = 256 if dry_run else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _timed(device, functools.partial(torch.mm, a, b), 2 if dry_run else 20)
    flops = 2 * n**3 / seconds
    del a, b
    nbytes = (16 if dry_run else 2048) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(device, functools.partial(dst.copy_, src), 2 if dry_run else 10)
    bandwidth = 2 * nbytes / seconds  # each byte read once and written once
    del src, dst
    x, tiny = torch.zeros(1, device=device), 200  # one-element additions: their launches alone
    seconds = _timed(device, lambda: [x.add_(1) for _ in range(tiny)], 2 if dry_run else 10)
    launch = seconds / tiny
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    constants = hardware_for(device.type, capability, low)
    figures = {}
    taken: dict[str, float | None] = {}
    # FSDP2's own host times, as `prepare` measures them on the device (None: the timings
    # contradicted themselves, and the constants stand)
    fsdp = _fsdp_host_times(device, dtype if low else None) or (None, None)
    measured = (
        ("flops_per_s", flops),
        ("memory_bytes_per_s", bandwidth),
        ("kernel_launch_s", launch),
        ("fsdp_unit_s", fsdp[0]),
        ("fsdp_gather_s", fsdp[1]),
    )
    for name, value in measured:
        taken[name] = None
        constant = getattr(constants, name)
        # off by: None where nothing was measured or nothing is assumed (a constant of 0)
        off = value / constant - 1 if value is not None and constant else None
        figures[name] = {"constant": constant, "measured": value, "off_by": off}
        if value is not None and (off is None or abs(off) > DISAGREEMENT):
            taken[name] = value
    where = (
        f"measured on {_device_name(device)} ({dtype} {n}x{n} matmul, {nbytes >> 20} MiB copy, "
        f"{tiny} one-element additions, small FSDP2 units over a fake group)"
    )
    throughput = Throughput(**taken, where=where)
    hardware = hardware_for(device.type, capability, low, throughput)
    return {
        "dtype": str(dtype),
        "figures": figures,
        "throughput": dataclasses.asdict(throughput),
        "hardware": dataclasses.asdict(hardware),
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"


# ---------------------------------------------------------------------------------------------
# oom: a real out-of-memory under memory_limit, the fallback, and the caller's state afterwards


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# Activations dominate (width x rows x 4 bytes, about 13 saved per block): on GPU about 12 GiB
# unchecked against 5 GiB with every block checkpointed; on the dry run a few MiB.
GPU_SIZE = dict(width=2048, blocks=8, rows=16384)
DRY_SIZE = dict(width=64, blocks=4, rows=512)


def setup(device: torch.device, width: int, blocks: int, rows: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = Net(width, blocks).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, torch.randn(rows, width, device=device)


def loss_fn(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return output.float().pow(2).mean()


@contextlib.contextmanager
def estimate_missing_activations() -> Iterator[None]:
    """The estimator is conservative, so on its own it never picks a rung that really runs out of
    memory: this stands in an estimate that misses 99% of the activations (and no simulation,
    which would trace them again), so that the plan keeps every block unchecked."""
    from autoshard.measure import facts

    real = facts.measure

    def missing(*args: Any, **kwargs: Any) -> Any:
        measured = real(*args, **kwargs)
        p = measured.profile
        assert p is not None, measured.trace_note  # the net traces: a profile always comes back
        shrunk = dataclasses.replace(
            p,
            block_saved_bytes=tuple(b // 100 for b in p.block_saved_bytes),
            block_input_bytes=tuple(b // 100 for b in p.block_input_bytes),
            before_saved_bytes=0,
            after_saved_bytes=0,
            largest_saved_bytes=p.largest_saved_bytes // 100,
        )
        return dataclasses.replace(measured, profile=shrunk)

    with (
        mock.patch("autoshard.pipeline.measure", missing),
        mock.patch(
            "autoshard.measure.simulated.simulate_all",
            lambda *a, **k: ({}, "not simulated (stand-in)"),
        ),
    ):
        yield


def limit_between(model: nn.Module, optimizer: Any, batch: Any, blocks: int) -> int:
    """A memory limit halfway between the estimates with no and with every block checkpointed:
    the plan must checkpoint some blocks to fit under it."""

    def estimate(checkpointed: int) -> int:
        return autoshard.plan(
            model,
            optimizer,
            batch,
            loss_fn=loss_fn,
            device_memory="1TiB",
            mixed_precision="no",
            activation_checkpointing=checkpointed,
        ).estimated_peak_bytes

    return (estimate(0) + estimate(blocks)) // 2


CALLER_FRACTION = 0.9


def caller_state(device: torch.device) -> dict[str, Any]:
    """The caller's memory fraction and allocated peak, as prepare() must leave them."""
    if device.type != "cuda":
        return {}
    return {
        "fraction": torch.cuda.get_per_process_memory_fraction(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
    }


def set_caller_state(device: torch.device, peak: int) -> dict[str, Any]:
    """As a caller might leave the device: its own memory fraction set, a peak of `peak` bytes
    reached and freed again (the block stays cached in the allocator)."""
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(CALLER_FRACTION, device)
        high = torch.empty(peak, dtype=torch.uint8, device=device)
        del high
    return caller_state(device)


def oom_fallback(device: torch.device, size: dict[str, int]) -> dict[str, Any]:
    """prepare() under a memory_limit between what no and full checkpointing need, with an
    estimate that misses the activations: the first rung runs out of memory for real (on CUDA
    under the per-process memory fraction; on CPU the trial's measured peak exceeds the limit),
    the trial falls back to checkpointing, and training goes on. On CUDA the caller first sets its
    own memory fraction and leaves a peak above anything the trial needs; both are read back."""
    model, optimizer, batch = setup(device, **size)
    limit = limit_between(model, optimizer, batch, size["blocks"])
    try:
        before = set_caller_state(device, 2 * limit)
        with estimate_missing_activations():
            prepared = autoshard.prepare(
                model, optimizer, batch, loss_fn=loss_fn, mixed_precision="no", memory_limit=limit
            )
        after = caller_state(device)
        losses = []
        for _ in range(2):
            loss = loss_fn(prepared.model(batch), batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    plan = prepared.plan
    cuda = device.type == "cuda"
    return {
        "limit_bytes": limit,
        "attempts": [
            {
                "strategy": a.strategy.value,
                "checkpointed": a.activation_checkpointing,
                "outcome": a.outcome.value,
                "description": a.description,
                "measured_peak_bytes": a.measured_peak_bytes,
            }
            for a in plan.attempts
        ],
        "final_checkpointed": plan.activation_checkpointing,
        "num_blocks": plan.num_blocks,
        "measured_peak_bytes": plan.measured_peak_bytes,
        "losses": losses,
        "caller_before": before,
        "caller_after": after,
        # the allocator keeps the cap in whole bytes: read back, a fraction differs by a byte
        "fraction_restored": _same(after["fraction"], before["fraction"]) if cuda else None,
        "peak_restored": after["peak_allocated"] >= before["peak_allocated"] if cuda else None,
    }


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)
