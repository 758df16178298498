"""Tear down at exit the process group `prepare` created, so that a script needs no ritual.

A script that exits with the gloo group still alive lets the interpreter destroy it during
finalisation, in whatever order objects go; with torch 2.13 that aborted about 1 exit in 10
(`terminate called without an active exception`). `destroy_process_group` shuts the backend down
first (its threads joined), so what finalisation destroys later is inert. No collective runs here:
a rank that exits after a failure must not wait for the others (it waits at most
`_WORKER_WAIT_S` for a gloo worker still in a collective, below).

`destroy_process_group` joins gloo's threads only when it drops the group's last reference, and a
DDP wrapper or an FSDP2 mesh the script still holds keeps the group alive. A gloo worker thread
releases a finished collective's tensors after it has woken the caller (`ProcessGroupGloo::
runLoop`), and releasing a tensor Python also holds takes the GIL. If that release comes after
finalisation has begun, the thread is made to exit inside a noexcept destructor and the process
aborts with the same message (pytorch/pytorch#190489; CI hit it once, torch 2.11, the README's
checkpoint snippet on 2 ranks; made to happen on 2.11, 2.13 and 2.15 by starving the workers). So
the teardown also waits, the GIL released, until every gloo worker thread sleeps waiting for work
(`_wait_for_gloo_workers`).

A script may destroy the group itself, as the README's example does. autoshard's record of the
group is a weak reference, so that destroying drops the last reference there and then when nothing
else holds it. FSDP2's mesh is held on by torch's caches of DTensor specs, and a wrapper the script
keeps holds the group too, so the exit teardown waits for gloo's workers in that case as well (CI
hit the abort once so, torch 2.13, the example on 2 ranks under `accelerate launch`).
"""

from __future__ import annotations

import atexit
import gc
import platform
import time
import weakref
from pathlib import Path

import torch.distributed as dist

# The default group prepare created, if any: a weak reference, so that a script that destroys the
# group itself drops its last reference there (joining gloo's threads), not at finalisation.
_created: list[weakref.ref[dist.ProcessGroup]] = []

_WORKER_NAME = "pt_gloo_runloop"  # the name torch gives gloo's worker threads (tests check it)
_WORKER_WAIT_S = 2.0  # a worker busy this long is in a collective that will not end at exit
# futex(2)'s number; /proc/<pid>/task/<tid>/syscall gives it with the arguments of the call
_FUTEX = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAIT, _FUTEX_WAIT_BITSET = 0, 9  # glibc's condition variables wait with either
_LOCKED_CONTENDED = 2  # the value a glibc mutex waits on: a lock taken on the way somewhere
_UNREADABLE = "unreadable"  # what `_idle_wait` says where /proc will not tell


def destroy_at_exit() -> None:
    """Register the teardown of the default process group, created by autoshard just now."""
    group = dist.group.WORLD
    if group is None:
        return
    if not _created:
        atexit.register(_teardown)
    _created[:] = [weakref.ref(group)]


def _teardown() -> None:
    created = _created[0]() if _created else None
    _created.clear()
    # Only the group autoshard made: a script that destroyed it (or made another) keeps its own.
    ours = created is not None and dist.is_initialized() and dist.group.WORLD is created
    del created
    if ours:
        gc.collect()  # wrappers the script dropped go first, with their hooks on the group
        dist.destroy_process_group()
    # Also where the script destroyed the group itself: a wrapper it still holds keeps gloo's
    # threads alive into finalisation.
    _wait_for_gloo_workers(_WORKER_WAIT_S)


def _wait_for_gloo_workers(limit_s: float, tasks: Path = Path("/proc/self/task")) -> list[Path]:
    """Sleep in 1 ms steps (the GIL free) until every gloo worker thread of this process is idle at
    once, on the same wait, in two polls in a row, or `limit_s` has passed; returns the workers
    busy at the last poll. Only where Linux's /proc says what a thread waits in; elsewhere, or
    where it cannot be read, returns at once."""
    futex = _FUTEX.get(platform.machine())
    if futex is None or not tasks.is_dir():
        return []
    workers = [t for t in tasks.iterdir() if _read(t / "comm") == _WORKER_NAME]
    deadline = time.monotonic() + limit_s
    seen: dict[Path, str | None] = {}
    while workers:
        waits = {t: _idle_wait(t, futex) for t in workers if (t / "comm").exists()}
        workers = list(waits)  # a thread that has exited is not waited for
        if any(wait is _UNREADABLE for wait in waits.values()):
            return []  # /proc does not say (a sandbox): nothing to wait on
        busy = [t for t, wait in waits.items() if wait is None or seen.get(t) != wait]
        if not busy or time.monotonic() >= deadline:
            return busy
        seen = waits
        time.sleep(0.001)
    return []


def _idle_wait(task: Path, futex: int) -> str | None:
    """The futex address `task` sleeps on, waiting for work: asleep (state S) in a futex wait on a
    condition variable without a timeout. None when it runs or is runnable (woken, not yet
    scheduled), waits with a timeout (as for the GIL) or on a contended mutex; `_UNREADABLE` when
    /proc will not say."""
    syscall, stat = _read(task / "syscall"), _read(task / "stat")
    if syscall is None or stat is None:
        return None if not task.exists() else _UNREADABLE
    return _idle_in(syscall, stat.rpartition(")")[2].split()[:1] == ["S"], futex)


def _idle_in(syscall: str, asleep: bool, futex: int) -> str | None:
    """`_idle_wait` from a /proc `syscall` line (`nr uaddr op val timeout ...`) and whether the
    thread is asleep."""
    fields = syscall.split()
    if not asleep or len(fields) < 5 or fields[0] != str(futex):
        return None
    command = int(fields[2], 16) & 0x7F  # without FUTEX_PRIVATE_FLAG
    value, timeout = int(fields[3], 16), int(fields[4], 16)
    if command not in (_FUTEX_WAIT, _FUTEX_WAIT_BITSET) or timeout != 0:
        return None
    if command == _FUTEX_WAIT and value == _LOCKED_CONTENDED:
        return None
    return fields[1]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # the thread has exited, or /proc will not say
        return None
