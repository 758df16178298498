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
