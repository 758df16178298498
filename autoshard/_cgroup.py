"""What the control group this process runs in allows it: host memory, and cores.

A container sees its whole host in /proc/meminfo and /proc/cpuinfo (what psutil and os.cpu_count
read), but its control group limits it: Docker's `--memory` and `--cpus`, a Kubernetes pod's
limits, a Slurm job's cgroup. Past the memory limit the kernel kills the process, with no
exception for a trial step to catch. Both cgroup versions are read (v1 is still common on
clusters): the groups this process is in come from /proc/self/cgroup, where they are mounted from
/proc/self/mountinfo, and every level from the process's group up to the mount's root counts (a
parent's limit binds its children). Where none of it can be read (no Linux, no cgroup), nothing
is limited.

What a level has to spare is its limit less what its processes use that the kernel cannot
reclaim: usage less the file cache (both its active and inactive lists, as /proc/meminfo's
MemAvailable counts it; a file read twice sits on the active list, and the kernel still reclaims
it before it kills). The limit is the lowest that applies: v2's `memory.max` and `memory.high`
(past which the group is throttled to a crawl), v1's limit with and without swap and the
`hierarchical_` limits that `memory.stat` gives for ancestors a container cannot see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
_ROOT = Path("/")  # where /proc and /sys are (tests point it at a tree of their own)
_UNLIMITED = 1 << 60  # v1 writes "no limit" as the largest page-aligned 64-bit value


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest memory limit of this process's control groups.

    Attributes:
        limit_bytes: the lowest limit of the levels that have one.
        headroom_bytes: the least, over those levels, of the limit less what the level's processes
            use and the kernel cannot reclaim (its usage less its file cache).
        where: what sets the level with the least headroom (the cgroup version and file).
        level: that level's directory.
    """

    limit_bytes: int
    headroom_bytes: int
    where: str
    level: Path


def memory_limit() -> MemoryLimit | None:
    """This process's control groups' memory limit, or None where none is set or readable."""
    found = _each_level("memory", _read_limit)
    if not found:
        return None
    tightest = min(found, key=lambda f: f.headroom_bytes)
    return replace(tightest, limit_bytes=min(f.limit_bytes for f in found))


def cores() -> int | None:
    """The cores the control groups' CPU quota allows (rounded down, at least 1), or None where
    no quota is set or readable."""
    quotas = _each_level("cpu", _read_quota)
    return min(quotas) if quotas else None


def _each_level(controller: str, read: Callable[[int, Path], T | None]) -> list[T]:
    """What `read` finds at each level of each of this process's groups with `controller`."""
    found = (
        read(version, level)
        for version, group, mount_point in _groups(controller)
        for level in _levels(group, mount_point)
    )
    return [f for f in found if f is not None]


def _read_limit(version: int, level: Path) -> MemoryLimit | None:
    stat = _stat(level / "memory.stat")
    files = ("memory.max", "memory.high") if version == 2 else _V1_LIMITS
    limits = {name: _number(level / name) for name in files}
    if version == 2:
        usage = _number(level / "memory.current")
        cache = stat.get("active_file", 0) + stat.get("inactive_file", 0)
    else:
        usage = _number(level / "memory.usage_in_bytes")
        # the limits of ancestors, visible or not (a container sees its own group as the root)
        limits.update({f"memory.stat {k}": stat.get(k) for k in _V1_HIERARCHICAL})
        # v1's total_ figures cover the level's descendants, as its usage does (v2's always do)
        cache = stat.get("total_active_file", 0) + stat.get("total_inactive_file", 0)
    set_limits = {k: v for k, v in limits.items() if v is not None and v < _UNLIMITED}
    if usage is None or not set_limits:
        return None  # "max" or unlimited everywhere, or no such level or file
    name, limit = min(set_limits.items(), key=lambda item: item[1])
    in_use = max(0, usage - cache)
    return MemoryLimit(limit, max(0, limit - in_use), f"cgroup v{version} {name}", level)


_V1_LIMITS = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")  # memsw: RAM and swap
_V1_HIERARCHICAL = ("hierarchical_memory_limit", "hierarchical_memsw_limit")


def _read_quota(version: int, level: Path) -> int | None:
    if version == 2:
        quota, period = ((_read(level / "cpu.max") or "").split() + ["", ""])[:2]
    else:
        quota = _read(level / "cpu.cfs_quota_us") or ""
        period = _read(level / "cpu.cfs_period_us") or ""
    if not quota.isdigit() or not period.isdigit():
        return None  # "max" (v2), -1 (v1): no quota
    return max(1, int(quota) // max(1, int(period)))


def _groups(controller: str) -> list[tuple[int, Path, Path]]:
    """The directories of this process's groups with `controller`, each with its cgroup version
    (v1 where the controller is mounted on its own hierarchy, else v2's unified one) and where
    that hierarchy is mounted."""
    memberships = _memberships()
    found = []
    for mount_root, mount_point, version, controllers in _mounts():
        if version == 1 and controller not in controllers:
            continue
        path = memberships.get(controller if version == 1 else "")
        if path is None:
            continue
        # A group outside the mount's root (a container given its own cgroup namespace, or
        # a bind mount of its group) is the mount itself. One under it that is not there has
        # only its parents read (`_levels`).
        group = Path(path)
        inside = group.relative_to(mount_root) if group.is_relative_to(mount_root) else Path()
        found.append((version, mount_point / inside, mount_point))
    return found


def _levels(group: Path, mount_point: Path) -> list[Path]:
    """`group` and its parents up to the mount's root."""
    levels = [group]
    while levels[-1] != mount_point and levels[-1].is_relative_to(mount_point):
        levels.append(levels[-1].parent)
    return levels


def _memberships() -> dict[str, str]:
    """The group path of each v1 controller this process is in, and of v2 under ""."""
    text = _read(_ROOT / "proc/self/cgroup") or ""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and not controllers:
            paths[""] = path
        for name in controllers.split(","):
            if name:
                paths[name] = path
    return paths


def _mounts() -> list[tuple[str, Path, int, set[str]]]:
    """Each cgroup mount: its root within the hierarchy, where it is mounted, the version and
    (v1) its controllers."""
    text = _read(_ROOT / "proc/self/mountinfo") or ""
    mounts = []
    for line in text.splitlines():
        mount, _, filesystem = line.partition(" - ")
        fields, kind = mount.split(), filesystem.split()
        if len(fields) < 5 or len(kind) < 3 or kind[0] not in ("cgroup", "cgroup2"):
            continue
        root, point = _unescape(fields[3]), _ROOT / _unescape(fields[4]).lstrip("/")
        controllers = set(kind[2].split(","))
        mounts.append((root, point, 2 if kind[0] == "cgroup2" else 1, controllers))
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    for escaped, plain in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escaped, plain)
    return field


def _number(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text is not None and text.isdigit() else None  # None too for "max"


def _stat(path: Path) -> dict[str, int]:
    pairs = (line.split() for line in (_read(path) or "").splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
