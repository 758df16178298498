"""What both benchmark scripts share: the process group, one timed training step, a per-rank
peak-memory measurement, and gathering per-rank figures onto every rank."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import autoshard

MiB = 2**20

# Benchmarks plan as a first launch does, every fake step run: their prepare times stay
# comparable and nothing is read from autoshard's cache (AUTOSHARD_CACHE=1 opts in).
os.environ.setdefault("AUTOSHARD_CACHE", "0")


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun asked for (gloo on CPU, NCCL on GPU); (rank, world, device).

    Initialised here rather than by `prepare`, because budgets are agreed (broadcast) before the
    first `prepare`. A collective timeout turns a desynchronised run into an error, not a hang.
    """
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --standalone --nproc-per-node 2 ...")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    return dist.get_rank(), dist.get_world_size(), device


def shutdown() -> None:
    """Free every wrapper first: destroying the group while a DDP wrapper is alive can hang the
    exit (torch 2.13, gloo)."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast(value: Any) -> Any:
    """Rank 0's `value`, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def train_step(
    prepared: autoshard.Prepared,
    batch: tuple[torch.Tensor, ...],
    loss_fn: Callable[..., Any],
    held: list[Any],
) -> None:
    """One step as a user's loop runs it (with the gradient scaler when the plan uses fp16),
    holding the output through backward and the optimizer step, and in `held` (a list of one
    item) until the next step's forward returns its own."""
    model, optimizer, _ = prepared
    optimizer.zero_grad(set_to_none=True)
    held[0] = model(*batch)
    loss = loss_fn(held[0], batch)
    if prepared.scaler is None:
        loss.backward()
        optimizer.step()
    else:
        prepared.scaler.scale(loss).backward()
        prepared.scaler.step(optimizer)
        prepared.scaler.update()


def timed_steps(
    prepared: autoshard.Prepared,
    batch: tuple[torch.Tensor, ...],
    loss_fn: Callable[..., Any],
    warmup: int,
    steps: int,
    device: torch.device,
) -> tuple[list[float], bool]:
    """Warm up, then time `steps` steps. Returns the step times (s), each the slowest rank's, and
    whether any rank ran out of memory (agreed after every step, outside the timing)."""
    times: list[float] = []
    held: list[Any] = [None]
    for index in range(warmup + steps):
        oom = False
        start = time.perf_counter()
        try:
            train_step(prepared, batch, loss_fn, held)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as error:  # classified outside the except block
            if not is_oom(error):
                raise
            oom = True
        elapsed = time.perf_counter() - start
        if oom:
            held[0] = None
            prepared.optimizer.zero_grad(set_to_none=True)
            gc.collect()
        flags = torch.tensor([float(oom), elapsed], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item():
            return times, True
        if index >= warmup:
            times.append(flags[1].item())
    return times, False


def step_peak_bytes(
    prepared: autoshard.Prepared,
    batch: tuple[torch.Tensor, ...],
    loss_fn: Callable[..., Any],
    device: torch.device,
) -> int:
    """This rank's peak during one more training step, the output of the step before it held
    until its forward returns: the CUDA allocator's peak, or on CPU the tensor bytes torch's
    MemTracker sees (what `prepare`'s trial step measures there too; buffers allocated inside
    C++, such as DDP's gradient buckets, are invisible to it)."""
    held: list[Any] = [None]
    train_step(prepared, batch, loss_fn, held)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(prepared, batch, loss_fn, held)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    from torch.distributed._tools.mem_tracker import MemTracker

    from autoshard._batch import tensors_reached

    model = prepared.model
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    tracker = MemTracker()
    tracker.track_external(module, prepared.optimizer, *tensors_reached(held[0]))
    with tracker:
        train_step(prepared, batch, loss_fn, held)
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(sum(v.get("Total", 0) for v in snapshot.values()))


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def machine() -> dict[str, Any]:
    """Where the figures come from."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "backend": str(dist.get_backend()) if dist.is_initialized() else None,
        "omp_num_threads": torch.get_num_threads(),
    }
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


def mib(value: int | float | None) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"
