"""A container's control group limits the host memory and cores a rank may use
(autoshard/_cgroup.py). Each case is a tree of its own standing in for / (its /proc/self files
and the cgroup files the kernel shows), laid out as Docker, Kubernetes and Slurm lay them out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoshard import _cgroup
from autoshard._world import World, host_memory, local_memory

GiB = 1 << 30
V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 shows where no limit is set


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def group(root: Path, directory: str, **files: str) -> None:
    """A cgroup directory: a cgroup.procs, as the kernel gives every group, and `files`."""
    write(
        root, {f"{directory}/cgroup.procs": "", **{f"{directory}/{k}": v for k, v in files.items()}}
    )


V2_MOUNT = "30 23 0:26 {root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
V1_MOUNT = "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"
V1_CPU = "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct"


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(_cgroup, "_ROOT", tmp_path)
    return tmp_path


def test_docker_on_cgroup_v2_limits_memory_less_what_its_processes_use(root: Path) -> None:
    # Docker's own cgroup namespace: the container's group is the mount's root
    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    stat = f"anon {2 * GiB}\nfile {2 * GiB}\ninactive_file {GiB}\nactive_file {GiB}"
    group(root, "sys/fs/cgroup", **{"memory.max": str(8 * GiB), "memory.current": str(4 * GiB)})
    write(root, {"sys/fs/cgroup/memory.stat": stat})
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert limit.limit_bytes == 8 * GiB
    # 4 GiB in use, of which 1 GiB inactive page cache the kernel reclaims before it kills
    assert limit.headroom_bytes == 8 * GiB - (4 * GiB - GiB)
    assert (limit.where, limit.level) == ("cgroup v2 memory.max", root / "sys/fs/cgroup")


def test_a_kubernetes_pods_limit_binds_the_container_inside_it(root: Path) -> None:
    # the host's cgroup namespace: the group's full path, under the hierarchy's root
    pod, container = "kubepods.slice/pod1", "kubepods.slice/pod1/ctr"
    write(
        root,
        {
            "proc/self/cgroup": f"0::/{container}",
            "proc/self/mountinfo": V2_MOUNT.format(root="/"),
        },
    )
    group(root, "sys/fs/cgroup")  # the hierarchy's root: no memory.max
    group(root, "sys/fs/cgroup/kubepods.slice", **{"memory.max": "max", "memory.current": "1"})
    pod_files = {"memory.max": str(4 * GiB), "memory.current": str(3 * GiB)}
    group(root, f"sys/fs/cgroup/{pod}", **pod_files, **{"memory.stat": "inactive_file 0"})
    ctr_files = {"memory.max": "max", "memory.current": str(2 * GiB)}
    group(root, f"sys/fs/cgroup/{container}", **ctr_files)
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert (limit.limit_bytes, limit.headroom_bytes) == (4 * GiB, GiB)
    assert limit.level == root / f"sys/fs/cgroup/{pod}"


def test_cgroup_v1_reads_its_memory_hierarchy_and_ignores_the_unlimited_levels(root: Path) -> None:
    write(
        root,
        {
            "proc/self/cgroup": "5:cpu,cpuacct:/\n4:memory:/docker/abc\n1:name=systemd:/",
            "proc/self/mountinfo": V1_MOUNT.format(root="/"),
        },
    )
    unlimited = {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": str(20 * GiB)}
    group(root, "sys/fs/cgroup/memory", **unlimited)
    group(root, "sys/fs/cgroup/memory/docker", **unlimited)
    stat = f"inactive_file 0\ntotal_inactive_file {GiB // 2}"
    files = {"memory.limit_in_bytes": str(2 * GiB), "memory.usage_in_bytes": str(3 * GiB // 2)}
    group(root, "sys/fs/cgroup/memory/docker/abc", **files, **{"memory.stat": stat})
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert (limit.limit_bytes, limit.headroom_bytes) == (2 * GiB, GiB)
    assert limit.where == "cgroup v1 memory.limit_in_bytes"


def test_a_group_outside_the_mounts_root_is_the_mount_itself(root: Path) -> None:
    # a v1 container: its own group bind-mounted where the hierarchy would be, its
    # /proc/self/cgroup naming the host's path
    write(
        root,
        {
            "proc/self/cgroup": "4:memory:/docker/abc",
            "proc/self/mountinfo": V1_MOUNT.format(root="/docker/abc"),
        },
    )
    files = {"memory.limit_in_bytes": str(GiB), "memory.usage_in_bytes": str(GiB // 4)}
    group(root, "sys/fs/cgroup/memory", **files)
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert (limit.limit_bytes, limit.headroom_bytes) == (GiB, 3 * GiB // 4)


def test_an_escaped_mount_point_is_read(root: Path) -> None:
    line = "30 23 0:26 / /cgroup\\040fs rw - cgroup2 cgroup2 rw"
    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": line})
    group(root, "cgroup fs", **{"memory.max": str(GiB), "memory.current": "0"})
    limit = _cgroup.memory_limit()
    assert limit is not None and limit.limit_bytes == GiB


def test_nothing_readable_limits_nothing(root: Path) -> None:
    assert _cgroup.memory_limit() is None
    assert _cgroup.cores() is None
    # mounted, but unlimited
    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    group(
        root,
        "sys/fs/cgroup",
        **{"memory.max": "max", "memory.current": "5", "cpu.max": "max 100000"},
    )
    assert _cgroup.memory_limit() is None
    assert _cgroup.cores() is None


@pytest.mark.parametrize(
    ("quota", "period", "cores"),
    [("200000", "100000", 2), ("150000", "100000", 1), ("50000", "100000", 1)],
)
def test_a_cpu_quota_allows_its_cores_rounded_down(
    root: Path, quota: str, period: str, cores: int
) -> None:
    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    group(root, "sys/fs/cgroup", **{"cpu.max": f"{quota} {period}"})
    assert _cgroup.cores() == cores


def test_a_v1_cpu_quota_and_its_absence(root: Path) -> None:
    write(
        root,
        {
            "proc/self/cgroup": "5:cpu,cpuacct:/slurm/job1",
            "proc/self/mountinfo": V1_CPU.format(root="/"),
        },
    )
    group(
        root,
        "sys/fs/cgroup/cpu,cpuacct",
        **{"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
    )
    job = {"cpu.cfs_quota_us": "400000", "cpu.cfs_period_us": "100000"}
    group(
        root,
        "sys/fs/cgroup/cpu,cpuacct/slurm",
        **{"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
    )
    group(root, "sys/fs/cgroup/cpu,cpuacct/slurm/job1", **job)
    assert _cgroup.cores() == 4


class VirtualMemory:
    """psutil's view of a large host."""

    available = 500 * GiB
    total = 512 * GiB


def test_a_ranks_host_memory_is_its_containers(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", VirtualMemory)
    unlimited = host_memory()
    assert (unlimited.available_bytes, unlimited.total_bytes) == (500 * GiB, 512 * GiB)
    assert unlimited.source == "host RAM available (psutil)"

    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    group(root, "sys/fs/cgroup", **{"memory.max": str(16 * GiB), "memory.current": str(6 * GiB)})
    limited = host_memory()
    assert (limited.available_bytes, limited.total_bytes) == (10 * GiB, 16 * GiB)
    # what a CPU rank may use, shared among this node's 2 ranks, and where the figure came from
    world = World(0, 0, 2, 2, "gloo", torch.device("cpu"), True, (), 1)
    memory = local_memory(world)
    assert (memory.free_bytes, memory.total_bytes) == (5 * GiB, 8 * GiB)
    assert memory.source == (
        "host RAM available (psutil) within this container's limit of 16.00 GiB (cgroup v2 "
        "memory.max) / 2 rank(s) on this node"
    )
