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
    stat = f"anon {2 * GiB}\nfile {2 * GiB}\nactive_file {GiB}\ninactive_file {GiB // 2}\nshmem 0"
    group(root, "sys/fs/cgroup", **{"memory.max": str(8 * GiB), "memory.current": str(4 * GiB)})
    write(root, {"sys/fs/cgroup/memory.stat": stat})
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert limit.limit_bytes == 8 * GiB
    # 4 GiB in use, of which 1.5 GiB file cache (active or not) the kernel reclaims before it kills
    assert limit.headroom_bytes == 8 * GiB - (4 * GiB - 3 * GiB // 2)
    assert (limit.where, limit.level) == ("cgroup v2 memory.max", root / "sys/fs/cgroup")


def test_every_level_counts_the_least_headroom_and_the_lowest_limit_apart(root: Path) -> None:
    # the host's cgroup namespace (Kubernetes, systemd driver): the group's full path
    pod, container = "kubepods.slice/pod1", "kubepods.slice/pod1/ctr"
    cgroup = f"0::/{container}"
    write(root, {"proc/self/cgroup": cgroup, "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    group(root, "sys/fs/cgroup", **{"memory.current": str(60 * GiB)})  # the root: no memory.max
    group(root, "sys/fs/cgroup/kubepods.slice", **{"memory.max": "max", "memory.current": "1"})
    # the pod: the higher limit, but its other containers leave it the least to spare
    group(
        root, f"sys/fs/cgroup/{pod}", **{"memory.max": str(4 * GiB), "memory.current": str(3 * GiB)}
    )
    ctr = {"memory.max": str(7 * GiB // 2), "memory.current": str(GiB), "memory.high": "max"}
    group(root, f"sys/fs/cgroup/{container}", **ctr)
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert (limit.limit_bytes, limit.headroom_bytes) == (7 * GiB // 2, GiB)
    assert limit.level == root / f"sys/fs/cgroup/{pod}"


def test_v2_memory_high_throttles_and_counts_as_a_limit(root: Path) -> None:
    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    files = {"memory.max": "max", "memory.high": str(2 * GiB), "memory.current": str(GiB)}
    group(root, "sys/fs/cgroup", **files)
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert (limit.limit_bytes, limit.headroom_bytes) == (2 * GiB, GiB)
    assert limit.where == "cgroup v2 memory.high"


def test_the_walk_up_stops_at_the_mounts_root(root: Path) -> None:
    write(root, {"proc/self/cgroup": "0::/a/b", "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    group(root, "sys/fs", **{"memory.max": "1", "memory.current": "0"})  # not in the hierarchy
    group(root, "sys/fs/cgroup")
    group(root, "sys/fs/cgroup/a", **{"memory.max": str(2 * GiB), "memory.current": "0"})
    group(root, "sys/fs/cgroup/a/b", **{"memory.max": "max", "memory.current": "0"})
    limit = _cgroup.memory_limit()
    assert limit is not None and limit.limit_bytes == 2 * GiB


def test_cgroup_v1_reads_its_memory_hierarchy_and_ignores_unlimited_levels(root: Path) -> None:
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
    group(root, "sys/fs/cgroup/memory/docker/abc", **unlimited)
    assert _cgroup.memory_limit() is None  # v1 writes "no limit" as a number

    stat = f"active_file 0\ninactive_file 0\ntotal_active_file {GiB // 4}\n"
    stat += f"total_inactive_file {GiB // 4}\nhierarchical_memory_limit {V1_UNLIMITED}"
    files = {"memory.limit_in_bytes": str(2 * GiB), "memory.usage_in_bytes": str(3 * GiB // 2)}
    group(root, "sys/fs/cgroup/memory/docker/abc", **files, **{"memory.stat": stat})
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert (limit.limit_bytes, limit.headroom_bytes) == (2 * GiB, GiB)
    assert limit.where == "cgroup v1 memory.limit_in_bytes"


@pytest.mark.parametrize(
    ("files", "stat", "where"),
    [
        # a parent's limit the container cannot see: only memory.stat tells it
        (
            {"memory.limit_in_bytes": str(3 * GiB)},
            f"hierarchical_memory_limit {2 * GiB}",
            "cgroup v1 memory.stat hierarchical_memory_limit",
        ),
        # RAM and swap limited together, RAM alone not (Slurm's ConstrainSwapSpace)
        (
            {"memory.limit_in_bytes": V1_UNLIMITED, "memory.memsw.limit_in_bytes": str(2 * GiB)},
            "",
            "cgroup v1 memory.memsw.limit_in_bytes",
        ),
    ],
)
def test_v1_limits_set_elsewhere_count(
    root: Path, files: dict[str, str], stat: str, where: str
) -> None:
    # a v1 container: its own group bind-mounted where the hierarchy would be
    write(
        root,
        {
            "proc/self/cgroup": "4:memory:/docker/abc",
            "proc/self/mountinfo": V1_MOUNT.format(root="/docker/abc"),
        },
    )
    usage = {"memory.usage_in_bytes": str(GiB // 2), "memory.stat": stat}
    group(root, "sys/fs/cgroup/memory", **files, **usage)
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert (limit.limit_bytes, limit.headroom_bytes, limit.where) == (2 * GiB, 3 * GiB // 2, where)


@pytest.mark.parametrize(
    ("cgroup", "mount_root"),
    [
        ("4:memory:/docker/abc", "/docker/abc"),  # the group is the mount's root
        ("4:memory:/other", "/docker/abc"),  # a cgroup namespace: the path is not under the root
        ("4:memory:/docker/abc/gone", "/docker/abc"),  # under it, but not there
    ],
)
def test_a_group_not_found_under_the_mount_is_the_mount_itself(
    root: Path, cgroup: str, mount_root: str
) -> None:
    mountinfo = V1_MOUNT.format(root=mount_root)
    write(root, {"proc/self/cgroup": cgroup, "proc/self/mountinfo": mountinfo})
    files = {"memory.limit_in_bytes": str(GiB), "memory.usage_in_bytes": str(GiB // 4)}
    group(root, "sys/fs/cgroup/memory", **files)
    # a group of that name under the mount is another one: /docker/abc/other
    other = {"memory.limit_in_bytes": str(GiB // 2), "memory.usage_in_bytes": "0"}
    group(root, "sys/fs/cgroup/memory/other", **other)
    limit = _cgroup.memory_limit()
    assert limit is not None
    assert (limit.limit_bytes, limit.headroom_bytes) == (GiB, 3 * GiB // 4)


@pytest.mark.parametrize(
    ("written", "directory"), [("/cgroup\\040fs", "cgroup fs"), ("/c\\134g", "c\\g")]
)
def test_an_escaped_mount_point_is_read(root: Path, written: str, directory: str) -> None:
    line = f"30 23 0:26 / {written} rw shared:9 - cgroup2 cgroup2 rw"
    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": line})
    group(root, directory, **{"memory.max": str(GiB), "memory.current": "0"})
    limit = _cgroup.memory_limit()
    assert limit is not None and limit.limit_bytes == GiB


def test_a_group_over_its_limit_has_nothing_to_spare(root: Path) -> None:
    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    group(root, "sys/fs/cgroup", **{"memory.max": str(GiB), "memory.current": str(2 * GiB)})
    limit = _cgroup.memory_limit()
    assert limit is not None and limit.headroom_bytes == 0


def test_nothing_readable_limits_nothing(root: Path) -> None:
    assert _cgroup.memory_limit() is None
    assert _cgroup.cores() is None
    # mounted, but unlimited
    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    unlimited = {"memory.max": "max", "memory.current": "5", "cpu.max": "max 100000"}
    group(root, "sys/fs/cgroup", **unlimited)
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


def test_a_v1_cpu_quota_is_the_least_of_its_levels(root: Path) -> None:
    write(
        root,
        {
            "proc/self/cgroup": "5:cpu,cpuacct:/slurm/job1",
            "proc/self/mountinfo": V1_CPU.format(root="/"),
        },
    )
    none = {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"}
    group(root, "sys/fs/cgroup/cpu,cpuacct", **none)
    group(root, "sys/fs/cgroup/cpu,cpuacct/slurm", **none)
    job = {"cpu.cfs_quota_us": "400000", "cpu.cfs_period_us": "100000"}
    group(root, "sys/fs/cgroup/cpu,cpuacct/slurm/job1", **job)
    assert _cgroup.cores() == 4
    slurm = {"cpu.cfs_quota_us": "200000", "cpu.cfs_period_us": "100000"}
    group(root, "sys/fs/cgroup/cpu,cpuacct/slurm", **slurm)
    assert _cgroup.cores() == 2


class VirtualMemory:
    """psutil's view of a large host."""

    available = 500 * GiB
    total = 512 * GiB


def test_a_ranks_host_memory_is_its_containers(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    import autoshard._world as world_module
    from autoshard._world import Memory

    monkeypatch.setattr(psutil, "virtual_memory", VirtualMemory)
    unlimited = host_memory()
    assert (unlimited.available_bytes, unlimited.total_bytes) == (500 * GiB, 512 * GiB)
    assert unlimited.source == "host RAM available (psutil)"

    write(root, {"proc/self/cgroup": "0::/", "proc/self/mountinfo": V2_MOUNT.format(root="/")})
    group(root, "sys/fs/cgroup", **{"memory.max": str(16 * GiB), "memory.current": str(6 * GiB)})
    limited = host_memory()
    assert (limited.available_bytes, limited.total_bytes) == (10 * GiB, 16 * GiB)
    # what a CPU rank may use, shared among this node's 2 ranks, and where the figure came from
    cpu = World(0, 0, 2, 2, "gloo", torch.device("cpu"), True, (), 1)
    memory = local_memory(cpu)
    assert (memory.free_bytes, memory.total_bytes) == (5 * GiB, 8 * GiB)
    assert memory.source == (
        "host RAM available (psutil) within this container's limit of 16.00 GiB (cgroup v2 "
        "memory.max) / 2 rank(s) on this node"
    )
    # a GPU rank's host memory, what CPU offload may use
    gpu = Memory(80 * GiB, 80 * GiB, "pynvml")
    monkeypatch.setattr(world_module, "_gpu_memory", lambda device: gpu)
    cuda = World(0, 0, 2, 2, "nccl", torch.device("cuda", 0), True, (), 1)
    assert local_memory(cuda).host_free_bytes == 5 * GiB

    # the host itself has less to spare than the container's limit leaves
    monkeypatch.setattr(VirtualMemory, "available", 4 * GiB)
    assert host_memory().available_bytes == 4 * GiB
