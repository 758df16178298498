"""The training GPU's own throughput for the cost model: matmul FLOP/s in the compute dtype and
memory bandwidth, measured once per process where `prepare` (or `plan` on a GPU machine) trains
on this device.

The cost model's constants (`decide.hardware`) are round figures for a device class: on the H100
of the first GPU run bf16 matmul measured 797 TFLOP/s against 400 assumed, memory 3.0 TB/s
against 2.0, and every modelled step was 3 to 10 times below the measured one. The constants
stay for what-if plans (no device to measure); a plan made on the device uses what it measured,
agreed across ranks (the slowest rank's), and says which it used (`Plan.cost_model`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from autoshard._torch_compat import disable_current_modes
from autoshard._world import RankReport
from autoshard.decide.hardware import Throughput
from autoshard.decide.plan import PlanInputs
from autoshard.measure.host import fastest_of
from autoshard.wrap.meter import caller_peak_kept

logger = logging.getLogger("autoshard")

# A matmul large enough to run at the device's sustained rate (a few ms on a current GPU) and a
# copy large enough to leave every cache.
_MATMUL = 4096
_COPY_BYTES = 256 * 2**20
_REPEATS = 5
# A run of operators on one element each: their time is the host's dispatch and launch alone
_TINY_OPERATORS = 200

_cache: dict[tuple[int, torch.dtype], Throughput] = {}


def device_throughput(device: torch.device, dtype: torch.dtype | None) -> Throughput | None:
    """This rank's GPU figures (matmuls in `dtype`, else fp32), measured once per process and
    dtype; None off CUDA, or where measuring failed (the constants stand)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, dtype or torch.float32)
    if key not in _cache:
        try:
            _cache[key] = _measure(torch.device("cuda", index), key[1])
        except Exception:  # noqa: BLE001 - an OOM or a driver error leaves the constants
            logger.debug("measuring the device's throughput failed", exc_info=True)
            return None
    return _cache[key]


def _measure(device: torch.device, dtype: torch.dtype) -> Throughput:
    with disable_current_modes(), caller_peak_kept(device):
        flops = _matmul_rate(device, dtype)
        bandwidth = _copy_rate(device)
        launch = _launch_time(device)
    name = torch.cuda.get_device_name(device)
    where = (
        f"measured on {device} ({name}): a {_MATMUL}x{_MATMUL} {str(dtype).removeprefix('torch.')} "
        f"matmul, a {_COPY_BYTES >> 20} MiB copy and {_TINY_OPERATORS} one-element additions"
    )
    return Throughput(flops, bandwidth, where, launch)


def _matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(_MATMUL, _MATMUL, device=device, dtype=dtype)
    b = torch.randn(_MATMUL, _MATMUL, device=device, dtype=dtype)
    return 2 * _MATMUL**3 / _fastest(device, lambda: torch.mm(a, b))


def _copy_rate(device: torch.device) -> float:
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * _COPY_BYTES / _fastest(device, lambda: dst.copy_(src))  # each byte read, written


def _launch_time(device: torch.device) -> float:
    x = torch.zeros(1, device=device)

    def run() -> None:
        for _ in range(_TINY_OPERATORS):
            x.add_(1)

    return _fastest(device, run) / _TINY_OPERATORS


def _fastest(device: torch.device, run: Callable[[], object]) -> float:
    """The fastest of a few runs, each synchronised, after a warm-up, in seconds."""

    def synchronised() -> None:
        run()
        torch.cuda.synchronize(device)

    synchronised()
    return fastest_of(synchronised, _REPEATS)


def with_device(inputs: PlanInputs, reports: list[RankReport]) -> PlanInputs:
    """`inputs` with the slowest rank's measured FLOP/s and memory bandwidth in the cost model,
    where every rank measured them; else as they are (the constants)."""
    measured: list[Throughput] = [
        r.device_throughput for r in reports if r.device_throughput is not None
    ]
    if not measured or len(measured) < len(reports):
        return inputs
    constants = inputs.hardware
    slowest = min(measured, key=lambda t: t.flops_per_s or constants.flops_per_s)
    bandwidth = min(t.memory_bytes_per_s or constants.memory_bytes_per_s for t in measured)
    launch = max(t.kernel_launch_s or constants.kernel_launch_s for t in measured)
    where = slowest.where + (f", the slowest of {len(reports)} ranks" if len(reports) > 1 else "")
    hardware = replace(
        constants,
        flops_per_s=slowest.flops_per_s or constants.flops_per_s,
        memory_bytes_per_s=bandwidth,
        kernel_launch_s=launch,
        source=(
            f"FLOP/s, memory bandwidth and operator launch time {where}, otherwise "
            f"{constants.source}"
        ),
    )
    return replace(inputs, hardware=hardware)
