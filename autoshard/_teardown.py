"""Tear down at exit the process group `prepare` created, so that a script needs no ritual.

A script that exits with the gloo group still alive lets the interpreter destroy it during
finalisation, in whatever order objects go; with torch 2.13 that aborted about 1 exit in 10
(`terminate called without an active exception`). `destroy_process_group` shuts the backend down
first (its threads joined), so what finalisation destroys later is inert. No collective runs here:
a rank that exits after a failure must not wait for the others.

`destroy_process_group` joins gloo's threads only when it drops the group's last reference, and a
DDP wrapper or an FSDP2 mesh the script still holds keeps the group alive. A gloo worker thread
releases a finished collective's tensors after it has woken the caller (`ProcessGroupGloo::
runLoop`), and releasing a tensor Python also holds takes the GIL. If that release comes after
finalisation has begun, the thread is made to exit inside a noexcept destructor and the process
aborts with the same message (pytorch/pytorch#190489; CI hit it once, torch 2.11, the README's
checkpoint snippet on 2 ranks; made to happen on 2.11, 2.13 and 2.15 by starving the workers). So
the teardown also waits, the GIL released, until every gloo worker thread sleeps waiting for work
(`_wait_for_gloo_workers`).
"""

from __future__ import annotations

import atexit
import gc
import platform
import time
from pathlib import Path

import torch.distributed as dist

_created: list[object] = []  # the default group prepare created, if any

_WORKER_NAME = "pt_gloo_runloop"  # the name torch gives gloo's worker threads (tests check it)
_WORKER_WAIT_S = 2.0  # a worker busy this long is in a collective that will not end at exit
# futex(2)'s number; /proc/<pid>/task/<tid>/syscall gives it with the arguments of the call
_FUTEX = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAITS = {0, 9}  # FUTEX_WAIT, FUTEX_WAIT_BITSET (glibc's condition variables)


def destroy_at_exit() -> None:
    """Register the teardown of the default process group, created by autoshard just now."""
    if not _created:
        atexit.register(_teardown)
    _created[:] = [dist.group.WORLD]


def _teardown() -> None:
    # Only the group autoshard made: a script that destroyed it (or made another) is left alone.
    if not _created or not dist.is_initialized() or dist.group.WORLD is not _created[0]:
        return
    _created.clear()
    gc.collect()  # wrappers the script dropped go first, with their hooks on the group
    dist.destroy_process_group()
    _wait_for_gloo_workers(_WORKER_WAIT_S)


def _wait_for_gloo_workers(limit_s: float, tasks: Path = Path("/proc/self/task")) -> list[Path]:
    """Sleep in 1 ms steps (the GIL free) until every gloo worker thread of this process is idle
    in two polls running, or `limit_s` has passed; returns the workers still busy. Only where
    Linux's /proc says what a thread waits in; elsewhere returns at once."""
    futex = _FUTEX.get(platform.machine())
    if futex is None or not tasks.is_dir():
        return []
    busy = [t for t in tasks.iterdir() if _read(t / "comm") == _WORKER_NAME]
    deadline = time.monotonic() + limit_s
    seen: dict[Path, str] = {}  # each worker's idle wait at the last poll
    while busy and time.monotonic() < deadline:
        time.sleep(0.001)
        waits = {t: _idle_wait(_read(t / "syscall"), futex) for t in busy}
        # the same wait twice: not a mutex taken for a moment on the way to release its work
        busy = [t for t in busy if waits[t] is None or seen.get(t) != waits[t]]
        seen = {t: w for t, w in waits.items() if w is not None}
    return busy


def _idle_wait(syscall: str | None, futex: int) -> str | None:
    """The futex address a thread sleeps on without a timeout (a condition variable's wait for
    work), from its /proc `syscall` line (`nr uaddr op val timeout ...`); None when it runs, is
    runnable, or waits with a timeout (as for the GIL), or the line cannot be read."""
    fields = (syscall or "").split()
    if len(fields) < 5 or fields[0] != str(futex):
        return None
    command = int(fields[2], 16) & 0x7F  # without FUTEX_PRIVATE_FLAG
    if command not in _FUTEX_WAITS or int(fields[4], 16) != 0:
        return None
    return fields[1]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # the thread has exited
        return None
