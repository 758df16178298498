"""The nodes a job spans: one count, the plan's and HYBRID_SHARD's mesh's (pure, no process
group: the mesh is captured, not built)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autoshard._world import World, spanning
from autoshard.strategies.engines import make_mesh
from autoshard.strategies.recipes import recipe
from autoshard.strategies.strategy import Strategy

CPU = torch.device("cpu")


def world(world_size: int, local_world_size: int) -> World:
    nodes = world_size // local_world_size  # as `resolve` counts them from the launcher
    return World(0, 0, world_size, local_world_size, "gloo", CPU, True, (), nodes)


@pytest.mark.parametrize(
    ("world_size", "local_world_size", "hosts", "expected"),
    [
        (8, 4, 1, 2),  # laid out as 2 nodes by the launcher, on one host: 2
        (8, 8, 2, 2),  # no LOCAL_WORLD_SIZE (mp.spawn, srun): the 2 hosts count
        (8, 2, 2, 4),  # 4 nodes by the launcher, 2 hosts: whichever is more
        (4, 4, 1, 1),
    ],
)
def test_the_nodes_are_hosts_or_the_launchers_layout_whichever_is_more(
    world_size: int, local_world_size: int, hosts: int, expected: int
) -> None:
    assert spanning(world(world_size, local_world_size), hosts).num_nodes == expected


def test_hybrid_shards_mesh_has_the_plans_node_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 ranks without LOCAL_WORLD_SIZE on 2 hosts: the plan counts 2 nodes of 2 ranks
    # (PlanInputs.ranks_per_node), so the mesh must replicate across 2 and shard within 2 (it
    # took LOCAL_WORLD_SIZE's 1 node of 4 before).
    meshes: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        "torch.distributed.device_mesh.init_device_mesh",
        lambda device_type, shape, **kwargs: meshes.append((device_type, shape, kwargs)),
    )
    make_mesh(recipe(Strategy.HYBRID_SHARD), spanning(world(4, 4), hosts=2))
    assert meshes == [("cpu", (2, 2), {"mesh_dim_names": ("replicate", "shard")})]


def test_free_gpu_memory_counts_the_blocks_torch_holds_free_for_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver counts torch's cached blocks as used, though this process's training reuses
    them; cuBLAS's workspaces a caller's matmuls left are freed first (the trial frees them
    before its step, and the estimate counts the training's own): left allocated, they were
    missing from the free memory and counted in the estimate as well."""
    import sys
    import types

    from autoshard import _world

    gib, mib = 2**30, 2**20
    info = types.SimpleNamespace(free=10 * gib, total=80 * gib)
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetMemoryInfo=lambda handle: info,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="GPU-0")
    )
    held = {"allocated": 3 * gib + 64 * mib, "reserved": 4 * gib, "workspaces": 64 * mib}

    def clear() -> bool:
        held["allocated"] -= held["workspaces"]
        held["workspaces"] = 0
        return True

    monkeypatch.setattr(_world, "clear_cublas_workspaces", clear)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index=None: held["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: held["reserved"])
    memory = _world._gpu_memory(torch.device("cuda", 0))
    assert memory.free_bytes == 10 * gib + 1 * gib
    assert memory.source == "pynvml, GPU GPU-0 + 1.00 GiB torch's allocator holds free for reuse"
    held["reserved"] = held["allocated"]  # nothing cached: the driver's figure as it is
    assert _world._gpu_memory(torch.device("cuda", 0)).free_bytes == 10 * gib


def _launched(monkeypatch: pytest.MonkeyPatch, local_rank: int, per_node: int) -> None:
    """torchrun's variables for this process, without a process group."""
    for var, value in [
        ("RANK", str(local_rank)),
        ("WORLD_SIZE", str(per_node)),
        ("LOCAL_RANK", str(local_rank)),
        ("LOCAL_WORLD_SIZE", str(per_node)),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ]:
        monkeypatch.setenv(var, value)


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0) -> list[object]:
    """This process sees `count` GPUs, `current` the current one; returns where set_device was
    pointed."""
    from autoshard import _world

    moved: list[object] = []
    monkeypatch.setattr(_world, "_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device", moved.append)
    return moved


def test_plan_under_torchrun_before_a_group_takes_this_rank_s_gpu_and_host_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`plan` under torchrun or accelerate launch before any process group (an Accelerator is
    built after it): every rank traced, calibrated and read free memory on GPU 0, and took the
    whole host for itself. Nothing is made current: `plan` changes nothing of the caller's."""
    import torch.distributed as dist

    from autoshard._world import resolve

    assert not dist.is_initialized()
    _launched(monkeypatch, local_rank=3, per_node=8)
    moved = _gpus(monkeypatch, count=8)
    world = resolve(init=False)
    assert (world.device, world.local_rank, world.local_world_size) == (
        torch.device("cuda", 3),
        3,
        8,
    )
    assert not world.distributed and moved == []


def test_a_rank_that_sees_only_its_own_gpu_takes_it_not_local_rank_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slurm's `--gpus-per-task=1` gives each process one visible GPU while LOCAL_RANK counts
    the node's: `set_device(LOCAL_RANK)` raised "invalid device ordinal" on every rank but the
    first, before any agreement."""
    from autoshard._world import rank_device

    _gpus(monkeypatch, count=1)
    assert rank_device(3) == torch.device("cuda", 0)
    _gpus(monkeypatch, count=8, current=2)
    assert rank_device(3) == torch.device("cuda", 3)
    assert rank_device(-1) == torch.device("cuda", 2)  # no launcher said: the current one


def test_a_group_bound_to_a_gpu_gives_that_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`init_process_group(device_id=cuda:5)` under `mp.spawn` binds the group without making
    the device current: every rank took cuda:0 for its object collectives and DDP."""
    import types

    import torch.distributed as dist

    from autoshard import _world

    _gpus(monkeypatch, count=8)
    bound = types.SimpleNamespace(bound_device_id=torch.device("cuda", 5))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(_world, "default_group", lambda: bound)
    assert _world.rank_device(-1) == torch.device("cuda", 5)
    assert _world.rank_device(2) == torch.device("cuda", 5)
