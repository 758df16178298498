"""The training GPU's own throughput for the cost model: matmul FLOP/s in the compute dtype,
memory bandwidth, the time per operator launch and FSDP2's own host times, measured once per
process where `prepare` (or `plan` on a GPU machine) trains on this device.

The cost model's constants (`decide.hardware`) are round figures for a device class: on the H100
of the first GPU run bf16 matmul measured 797 TFLOP/s against 400 assumed, memory 3.0 TB/s
against 2.0, and every modelled step was 3 to 10 times below the measured one. The constants
stay for what-if plans (no device to measure); a plan made on the device uses what it measured,
agreed across ranks (the slowest rank's), and says which it used (`Plan.cost_model`).

FSDP2's own host work (its hooks, copy-in and copy-out, casts and bookkeeping, which the step
waits on) is what made the first GPU run's FSDP2 steps slow: at 8 fake ranks (no real
collective) FULL_SHARD stepped 13 to 79 ms slower than the unwrapped model, 0.3 to 1.1 ms per
collective of a unit, where the cost model charged 20 us (benchmarks/RESULTS.md). It is
measured on a stack of small units shaped like a transformer block (a norm and four linear
layers: ten parameters), whose collectives carry almost nothing and whose kernels take almost no
time, sharded over a fake group under ZeRO-2 and ZeRO-3, against the same stack unwrapped: what
every unit costs a step, and what each all-gather adds (`_fsdp_host_times`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from autoshard._torch_compat import disable_current_modes
from autoshard._world import RankReport
from autoshard.decide.hardware import Throughput
from autoshard.decide.optimizer import step_traffic
from autoshard.decide.plan import PlanInputs
from autoshard.measure.fake import fake_mesh
from autoshard.strategies.engines import shard_module
from autoshard.strategies.strategy import Strategy
from autoshard.wrap.meter import caller_peak_kept

logger = logging.getLogger("autoshard")

# A matmul large enough to run at the device's sustained rate (a few ms on a current GPU) and a
# copy large enough to leave every cache.
_MATMUL = 4096
_COPY_BYTES = 256 * 2**20
_REPEATS = 5
# A run of operators on one element each: their time is the host's dispatch and launch alone
_TINY_OPERATORS = 200
# FSDP2's host work: a stack of units this small does almost nothing else (`_fsdp_host_times`)
_UNITS = 8
_UNIT_WIDTH = 64
# DTensor's host time per operator: AdamW's loop over this many parameters of this many elements
_FEW_SHARDS, _MORE_SHARDS = 8, 24
_SHARD_NUMEL = 16

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
    # the caller's random streams as they were: the figures draw random tensors and weights
    with (
        disable_current_modes(),
        caller_peak_kept(device),
        torch.random.fork_rng(devices=[device]),
    ):
        flops = _matmul_rate(device, dtype)
        bandwidth = _copy_rate(device)
        launch = _launch_time(device)
        try:
            unit, gather = _fsdp_host_times(device, dtype) or (None, None)
        except Exception:  # noqa: BLE001 - the constants stand for these figures alone
            logger.debug("measuring FSDP2's host time failed", exc_info=True)
            unit = gather = None
        try:
            dtensor = _dtensor_op_time(device)
        except Exception:  # noqa: BLE001 - the constant stands for this figure alone
            logger.debug("measuring DTensor's host time failed", exc_info=True)
            dtensor = None
    name = torch.cuda.get_device_name(device)
    where = (
        f"measured on {device} ({name}): a {_MATMUL}x{_MATMUL} {str(dtype).removeprefix('torch.')} "
        f"matmul, a {_COPY_BYTES >> 20} MiB copy and {_TINY_OPERATORS} one-element additions"
    )
    return Throughput(flops, bandwidth, where, launch, unit, gather, dtensor_op_s=dtensor)


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


def _fsdp_host_times(device: torch.device, dtype: torch.dtype | None) -> tuple[float, float] | None:
    """Seconds of FSDP2's own host work a step on `device`: per unit (its hooks in forward and
    backward, the reduce-scatter's copy-in, casts and bookkeeping) and per all-gather of a unit
    (copy-in, copy-out, casts). A forward and backward of `_UNITS` block-shaped units, each its
    own unit, sharded under ZeRO-2 (gathered once) and ZeRO-3 (twice) over a fake group
    (`fake.fake_mesh`: of the job's size inside a job, where each rank makes it alone; of 2
    outside one), computing in `dtype`, against the same stack unwrapped; the runs interleaved,
    the fastest of each taken. The fake collectives do nothing: their launches are the cost
    model's `collective_latency_s`. None where the timings contradict themselves (the sharded
    stack is not clearly slower than the unwrapped one, nor ZeRO-3 than ZeRO-2: a busy host).

    Runs whatever the caller's grad mode, default device or autocast: `prepare` may be called
    from under any of them."""
    world, rank = _fake_world()
    names = [str(i) for i in range(_UNITS)]
    with _as_measured(device):
        x = torch.randn(8, _UNIT_WIDTH, device=device)
        plain, zero2, zero3 = (_units(device) for _ in range(3))
        with fake_mesh(world, rank, device.type) as mesh:
            shard_module(zero2, names, mesh, Strategy.SHARD_GRAD_OP, dtype)
            shard_module(zero3, names, mesh, Strategy.FULL_SHARD, dtype)
            runs = [functools.partial(_step, model, x) for model in (plain, zero2, zero3)]
            alone, once, twice = _fastest_each(device, runs)
    # a unit's hooks, copies and casts are tens of operators against a small block's few: a
    # sharded stack less than twice the unwrapped one was timed on a disturbed host
    if once < 2 * alone or twice <= once:
        return None
    gather = (twice - once) / _UNITS
    unit = (once - alone) / _UNITS - gather
    return (unit, gather) if unit > 0 else None


def _fake_world() -> tuple[int, int]:
    """The fake group's size and this rank in it: the job's inside a job (each rank makes its own
    alone), else rank 0 of 2."""
    in_job = dist.is_available() and dist.is_initialized()
    return (dist.get_world_size(), dist.get_rank()) if in_job else (2, 0)


@contextlib.contextmanager
def _as_measured(device: torch.device) -> Iterator[None]:
    """Whatever the caller's grad mode, default device or autocast (`prepare` may be called from
    under any of them), with the caller's random streams kept as they were. Tensors made without
    a device go to the CPU, as without a default device: torch 2.11's AdamW makes its `step` so,
    and under a caller's `torch.device("meta")` read it back from meta."""
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autocast(device.type, enabled=False),
        cpu_by_default(),
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
    ):
        yield


def cpu_by_default() -> contextlib.AbstractContextManager[object]:
    """The CPU as the default device where the caller set another; else nothing. A default
    device is a torch function mode, which every torch call in the timed runs would pass through
    (1.6 to 3.5 us each on this host's CPU, torch 2.11 and 2.13): under FSDP2 about 168 more calls
    per unit than unwrapped, some 0.3 to 0.6 ms added to the unit's measured host time, about
    the figure itself."""
    if torch.get_default_device().type == "cpu":
        return contextlib.nullcontext()
    return torch.device("cpu")


def _dtensor_op_time(device: torch.device) -> float | None:
    """Seconds of host time one operator on DTensors takes beyond a plain operator on `device`:
    DTensor's dispatch and sharding propagation, which FSDP2's optimizer step pays for every
    operator (its parameters, gradients and states are DTensor shards). AdamW's per-parameter
    loop over `_FEW_SHARDS` and `_MORE_SHARDS` tiny parameters, plain and as shards over a fake
    group, the runs interleaved and the fastest of each taken; the difference between the
    counts leaves out each step's fixed cost. Per operator as the cost model counts them
    (`optimizer.step_traffic`). None where the timings contradict themselves (a busy host)."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = _fake_world()
    with _as_measured(device), fake_mesh(world, rank, device.type) as mesh:

        def parameters(count: int, sharded: bool) -> list[nn.Parameter]:
            made = []
            for _ in range(count):
                local = torch.zeros(_SHARD_NUMEL, device=device)
                tensor = (
                    DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
                    if sharded
                    else local
                )
                param = nn.Parameter(tensor)
                param.grad = torch.ones_like(param)
                made.append(param)
            return made

        optimizers = [
            torch.optim.AdamW(parameters(count, sharded), foreach=False)
            for sharded in (False, True)
            for count in (_FEW_SHARDS, _MORE_SHARDS)
        ]
        plain_few, plain_more, few, more = _fastest_each(device, [o.step for o in optimizers])
        operators = (
            step_traffic(optimizers[1], device.type)[1]
            - step_traffic(optimizers[0], device.type)[1]
        )
    plain = plain_more - plain_few
    extra = (more - few) - plain
    if plain <= 0 or extra <= 0 or operators <= 0:
        return None
    return extra / operators


class _Block(nn.Module):
    """A transformer block's parameters in miniature: a norm and four linear layers."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_UNIT_WIDTH, device=device)
        self.linears = nn.ModuleList(
            nn.Linear(_UNIT_WIDTH, _UNIT_WIDTH, device=device) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for linear in self.linears:
            x = linear(x)
        return x


def _units(device: torch.device) -> nn.Module:
    return nn.Sequential(*(_Block(device) for _ in range(_UNITS)))


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().sum().backward()
    for param in model.parameters():
        param.grad = None


def _fastest_each(device: torch.device, runs: Sequence[Callable[[], object]]) -> list[float]:
    """The fastest time of each of `runs`, in seconds: each run once to warm up, then all of
    them in turn `_REPEATS` times (a busy spell slows them alike), each synchronised."""
    best = [math.inf] * len(runs)
    for repeat in range(_REPEATS + 1):
        for i, run in enumerate(runs):
            started = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if repeat:  # the first round warms up
                best[i] = min(best[i], time.perf_counter() - started)
    return best


def _fastest(device: torch.device, run: Callable[[], object]) -> float:
    """The fastest of a few runs, each synchronised, after a warm-up, in seconds."""
    return max(_fastest_each(device, [run])[0], 1e-9)


def with_device(inputs: PlanInputs, reports: list[RankReport]) -> PlanInputs:
    """`inputs` with the slowest rank's measured figures in the cost model, where every rank
    measured them; else as they are (the constants). FSDP2's host times, which a rank may have
    failed to measure (`_fsdp_host_times`), are taken where every rank measured them, as is the
    model's own FLOP/s (`measure.rates`), which stands for the large matmul's, and its own
    operators' bandwidth, which stands for the large copy's in its forward and backward bytes."""
    measured: list[Throughput] = [
        r.device_throughput for r in reports if r.device_throughput is not None
    ]
    if not measured or len(measured) < len(reports):
        return inputs
    constants = inputs.hardware
    slowest = min(measured, key=lambda t: t.flops_per_s or constants.flops_per_s)
    bandwidth = min(t.memory_bytes_per_s or constants.memory_bytes_per_s for t in measured)
    launch = max(t.kernel_launch_s or constants.kernel_launch_s for t in measured)
    # FSDP2's host times, which one rank may have failed to measure, where every rank did
    units = [t.fsdp_unit_s for t in measured if t.fsdp_unit_s is not None]
    gathers = [t.fsdp_gather_s for t in measured if t.fsdp_gather_s is not None]
    everywhere = len(units) == len(gathers) == len(measured)
    dtensors = [t.dtensor_op_s for t in measured if t.dtensor_op_s is not None]
    own = [t for t in measured if t.model_flops_per_s is not None]
    where = slowest.where + (f", the slowest of {len(reports)} ranks" if len(reports) > 1 else "")
    names = (
        f"FLOP/s, memory bandwidth, operator launch time and FSDP2's host times ({_UNITS} small "
        f"units over a fake group)"
        if everywhere
        else "FLOP/s, memory bandwidth and operator launch time"
    )
    flops = slowest.flops_per_s or constants.flops_per_s
    source = f"{names} {where}"
    if len(dtensors) == len(measured):
        source += (
            f"; DTensor's host time per operator from AdamW's loop over {_FEW_SHARDS} and "
            f"{_MORE_SHARDS} shards"
        )
    # the slowest rank's own figures, each where every rank measured it
    moving = [t for t in measured if t.model_memory_bytes_per_s is not None]
    model = min(own, key=lambda t: t.model_flops_per_s or 0.0) if own else None
    operators = min(moving, key=lambda t: t.model_memory_bytes_per_s or 0.0) if moving else None
    taken = Throughput(
        model_flops_per_s=model.model_flops_per_s if model and len(own) == len(measured) else None,
        model_where=model.model_where if model else "",
        model_memory_bytes_per_s=(
            operators.model_memory_bytes_per_s
            if operators and len(moving) == len(measured)
            else None
        ),
        model_memory_where=operators.model_memory_where if operators else "",
    )
    flops = taken.model_flops_per_s or flops
    if taken.model_figures is not None:
        source += f"; {taken.model_figures}"
    hardware = replace(
        constants,
        flops_per_s=flops,
        memory_bytes_per_s=bandwidth,
        kernel_launch_s=launch,
        fsdp_unit_s=max(units) if everywhere else constants.fsdp_unit_s,
        fsdp_gather_s=max(gathers) if everywhere else constants.fsdp_gather_s,
        dtensor_op_s=max(dtensors) if len(dtensors) == len(measured) else constants.dtensor_op_s,
        operator_bytes_per_s=taken.model_memory_bytes_per_s,
        source=f"{source}, otherwise {constants.source}",
    )
    return replace(inputs, hardware=hardware)
