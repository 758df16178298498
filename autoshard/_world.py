"""Who this process is and how much memory it has: the only module that reads the environment.

rank, local rank, world size, backend and training device come from the process group (or
the variables torchrun and `accelerate launch` set); free memory from pynvml on GPU (falling back
to `torch.cuda.mem_get_info`) and from psutil on CPU, within the limits of the process's control
group (`_cgroup`). What must hold on every rank is agreed with one agreement (`collective.agree`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from autoshard import _cgroup
from autoshard._teardown import destroy_at_exit
from autoshard._torch_compat import clear_cublas_workspaces, default_group
from autoshard._units import human

logger = logging.getLogger("autoshard")

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    """This process's place in the job.

    Attributes:
        rank, local_rank, world_size, local_world_size: as torchrun defines them.
        backend: the process group's backend, or None when there is none.
        device: where training runs: `cuda:<local_rank>` on GPU, else `cpu`.
        distributed: a process group exists (even of one rank).
        reasons: what was detected or done (a process group initialised, and how).
        num_nodes: the nodes the ranks span (`spanning`): what the plan's candidates assume and
            what HYBRID_SHARD's mesh replicates across.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str | None
    device: torch.device
    distributed: bool
    reasons: tuple[str, ...] = ()
    num_nodes: int = 1

    @property
    def has_peers(self) -> bool:
        """Other processes to agree with: a process group that is not the fake one, with which
        the measurements stand one process in for a rank of a larger job (it has no peers)."""
        return self.distributed and self.backend != "fake"


def launched_by_torchrun() -> bool:
    return all(var in os.environ for var in _LAUNCHER_VARS)


def launched_world_size() -> int:
    """The number of processes torchrun (or accelerate launch) started, else 1."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def resolve(*, init: bool) -> World:
    """Describe this process; with `init`, initialise the process group torchrun asked for."""
    reasons: list[str] = []
    if not dist.is_initialized() and init and launched_by_torchrun():
        reasons.append(_init_process_group())
    if not dist.is_initialized():
        # under torchrun before any group (`plan`, an Accelerator built after it): this rank's
        # GPU and its node's share of the host, not GPU 0 and all of it for every rank
        launched = launched_by_torchrun()
        local_rank = int(os.environ["LOCAL_RANK"]) if launched else -1
        device = rank_device(local_rank) if _cuda() else torch.device("cpu")
        reasons.append(
            f"one process, no process group, training on {device}: unwrapped, unless its state "
            f"must be offloaded to host memory or it trains only sharded (prepare then creates "
            f"a one-rank group)"
        )
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched else 1
        return World(0, max(local_rank, 0), 1, per_node, None, device, False, tuple(reasons))
    backend = str(dist.get_backend())
    on_gpu = _cuda() and "nccl" in backend
    local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    if on_gpu:
        # NCCL's object collectives use the current device: it must be this rank's, also when
        # the caller initialised the process group without setting it.
        device = rank_device(local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if _cuda():
            reasons.append(f"the process group's backend is {backend}: training on the CPU")
    local_rank = max(local_rank, 0)
    world_size = dist.get_world_size()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    return World(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        backend=backend,
        device=device,
        distributed=True,
        reasons=tuple(reasons),
        num_nodes=max(1, world_size // max(local_world_size, 1)),  # until `spanning` sees hosts
    )


def spanning(world: World, hosts: int) -> World:
    """`world` with the nodes its ranks span: the distinct hosts they run on, or as the launcher
    laid them out (WORLD_SIZE / LOCAL_WORLD_SIZE), whichever is more. The one count the plan and
    HYBRID_SHARD's mesh both use."""
    return replace(world, num_nodes=max(hosts, world.num_nodes))


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def rank_device(local_rank: int) -> torch.device:
    """This rank's GPU: the one its process group is bound to (`init_process_group(device_id=)`,
    which does not make it current), else the `local_rank`-th where this process sees that many,
    else the current one (no launcher said, as under `mp.spawn`; or each process sees only its
    own GPUs, as under Slurm's `--gpus-per-task`, and LOCAL_RANK counts GPUs it cannot see)."""
    if dist.is_initialized():
        bound = getattr(default_group(), "bound_device_id", None)
        if isinstance(bound, torch.device) and bound.type == "cuda" and bound.index is not None:
            return bound
    if 0 <= local_rank < torch.cuda.device_count():
        return torch.device("cuda", local_rank)
    return torch.device("cuda", torch.cuda.current_device())


def _init_process_group() -> str:
    local_rank = int(os.environ["LOCAL_RANK"])
    # accelerate launch starts the ranks through torchrun and adds its own ACCELERATE_* settings.
    launcher = (
        "accelerate launch" if any(k.startswith("ACCELERATE_") for k in os.environ) else "torchrun"
    )
    if _cuda():
        device = rank_device(local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        destroy_at_exit()
        return f"launched by {launcher}: initialised the process group (nccl, {device})"
    dist.init_process_group("gloo")
    destroy_at_exit()
    return f"launched by {launcher} with no GPU: initialised the process group (gloo, cpu)"


def own_group(world: World, strategy: str) -> World:
    """Give a process without a process group (plain `python`) a one-rank group of its own, for
    a wrapper that helps one process alone (CPU offload): NCCL on a GPU, gloo on the CPU, over an
    in-process store (no port, no rendezvous). It is destroyed at exit like the one prepare
    initialises for torchrun (`_teardown`)."""
    assert not dist.is_initialized() and world.world_size == 1, world
    on_gpu = world.device.type == "cuda"
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=world.device if on_gpu else None,
    )
    destroy_at_exit()
    note = (
        f"one process without a process group: prepare created a one-rank group of its own "
        f"({backend}, in-process store) for {strategy}; it is destroyed at exit"
    )
    return replace(
        world, backend=backend, distributed=True, reasons=(*world.reasons, note), num_nodes=1
    )


def own_group_note(strategy: str) -> str:
    """What a plan made for one process without a process group says of a wrapper it chose."""
    return (
        f"{strategy} needs a process group: prepare creates a one-rank group of its own for this "
        f"one process (plain python), destroyed at exit"
    )


@dataclass(frozen=True)
class Memory:
    """Memory one rank may use.

    Attributes:
        free_bytes: free now: GPU memory free on this rank's device, or on CPU the host RAM
            available divided among this node's ranks (they share it).
        total_bytes: the device's total (host RAM on CPU).
        source: where the figure came from, for the plan's reasons.
        host_free_bytes: on GPU, the host RAM available divided among this node's ranks (what
            CPU offload may use); None on CPU, where it is free_bytes itself.
    """

    free_bytes: int
    total_bytes: int
    source: str
    host_free_bytes: int | None = None


def local_memory(world: World) -> Memory:
    host = host_memory()
    share = max(world.local_world_size, 1)
    if world.device.type == "cuda":
        return replace(_gpu_memory(world.device), host_free_bytes=host.available_bytes // share)
    source = f"{host.source} / {share} rank(s) on this node"
    return Memory(host.available_bytes // share, host.total_bytes // share, source)


@dataclass(frozen=True)
class HostMemory:
    """The host memory this process may use: psutil's figures for the machine, within its control
    group's limit (a container's) where one is set."""

    available_bytes: int
    total_bytes: int
    source: str  # where the figures came from, for the plan's reasons


def host_memory() -> HostMemory:
    import psutil

    vm = psutil.virtual_memory()
    limit = _cgroup.memory_limit()
    if limit is None or (limit.headroom_bytes >= vm.available and limit.limit_bytes >= vm.total):
        return HostMemory(vm.available, vm.total, "host RAM available (psutil)")
    source = (
        f"host RAM available (psutil) within this container's limit of "
        f"{limit.limit_bytes / 2**30:.2f} GiB ({limit.where})"
    )
    available = min(vm.available, limit.headroom_bytes)
    return HostMemory(available, min(vm.total, limit.limit_bytes), source)


def _gpu_memory(device: torch.device) -> Memory:
    """The device's free memory as this process's training will find it: the driver's figure,
    which counts what torch's caching allocator holds as used, plus the blocks it holds free for
    this process to reuse, cuBLAS's workspaces among them once freed (the trial step frees them
    before its step, `trial._workspaces_freed`, and the estimate counts the training's own:
    left allocated, a caller's matmuls before `prepare` had them counted twice)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    clear_cublas_workspaces()  # torch makes them again at the next matmul
    driver = _driver_memory(index)
    cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    if cached <= 0:
        return driver
    source = f"{driver.source} + {human(cached)} torch's allocator holds free for reuse"
    return Memory(driver.free_bytes + cached, driver.total_bytes, source)


def _driver_memory(index: int) -> Memory:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return Memory(int(info.free), int(info.total), f"pynvml, GPU {uuid}")
        finally:
            pynvml.nvmlShutdown()
    except Exception as error:  # NVML missing or refused: the CUDA runtime can still tell
        free, total = torch.cuda.mem_get_info(index)
        return Memory(free, total, f"torch.cuda.mem_get_info (pynvml unavailable: {error})")


@dataclass(frozen=True)
class RankReport:
    """What one rank contributes to the agreement collective."""

    rank: int
    host: str
    memory: Memory
    fingerprint: tuple[Any, ...]
    error: str | None
    measured: Any
    buffers: dict[str, str] = field(default_factory=dict)  # name -> digest of its values
    # the cuBLAS workspaces a step allocates on this rank (`measure.cublas`); None off CUDA
    cublas: Any = None
    # this host's throughput for CPU offload (`measure.host`); None where offload is not weighed
    offload_throughput: Any = None
    # this rank's GPU throughput for the cost model (`measure.device`); None off CUDA
    device_throughput: Any = None


def spare_processes() -> int:
    """How many processes this rank may start beside itself without slowing anything down: its
    share of the cores no process is using (the cores it may run on, within its cgroup's quota,
    less the load: at least this node's ranks, busy planning) and of half the memory available,
    a process taking as much as this one does."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = min(cores or 1, _cgroup.cores() or 1 << 20)
    ranks = _ranks_on_this_node()
    try:
        load = math.ceil(os.getloadavg()[0])
    except (AttributeError, OSError):  # no load average (Windows): no core is known idle
        return 0
    idle = max(0, cores - max(load, ranks)) // ranks
    each = max(1, psutil.Process().memory_info().rss)
    return min(idle, host_memory().available_bytes // 2 // each // ranks)


def _ranks_on_this_node() -> int:
    """This node's ranks, as torchrun, Slurm or Open MPI say (1: none says)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1
