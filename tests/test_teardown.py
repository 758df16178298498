"""The exit teardown waits for gloo's worker threads before the interpreter finalises: a worker
that releases a collective's tensors after finalisation has begun aborts the process
(`terminate called without an active exception`), see autoshard/_teardown.py."""

from __future__ import annotations

import platform
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_plain_python

from autoshard import _teardown
from autoshard._teardown import _FUTEX, _WORKER_NAME, _idle_in, _wait_for_gloo_workers

TASKS = Path("/proc/self/task")
LIMIT_S = 30.0  # far beyond any wait these tests make, short of a hang
linux_proc = pytest.mark.skipif(
    platform.machine() not in _FUTEX or not TASKS.is_dir(),
    reason="reads threads' waits from Linux's /proc on x86_64 or aarch64",
)


CONDITION = "202 0x55a0c715e310 0x189 0x0 0x0 0x0 0xffffffff 0x7ffd 0x7f67"  # glibc >= 2.34


@pytest.mark.parametrize(
    ("line", "asleep", "idle"),
    [
        (CONDITION, True, "0x55a0c715e310"),
        ("202 0x55a0c715e310 0x80 0x0 0x0 0x0 0x0 0x7ffd 0x7f67", True, "0x55a0c715e310"),
        (CONDITION, False, None),  # woken, not yet scheduled
        ("202 0x7f1c 0x80 0x2 0x0 0x0 0x0 0x7ffd 0x7f67", True, None),  # a contended mutex
        ("202 0x7f1c 0x189 0x0 0x7f6758213b10 0x0 0xffffffff 0x7ffd 0x7f67", True, None),  # timed
        ("202 0x7f1c 0x81 0x1 0x0 0x0 0x0 0x7ffd 0x7f67", True, None),  # a wake, not a wait
        ("232 0x6 0x7f6758213b80 0x40 0xa 0x0 0x0 0x7ffd 0x7f67", True, None),  # epoll_wait
        ("running", False, None),
        ("-1 0x7ffd 0x7f67", True, None),
    ],
)
def test_idle_is_asleep_on_a_condition_variable_without_a_timeout(
    line: str, asleep: bool, idle: str | None
) -> None:
    assert _idle_in(line, asleep, 202) == idle


def _name_thread(name: str) -> None:
    (TASKS / str(threading.get_native_id()) / "comm").write_text(name)


@pytest.fixture
def stand_in() -> Iterator[tuple[threading.Event, list[str]]]:
    """A thread named as a gloo worker: busy (a timed wait, as for the GIL) until `release` is
    set, then idle (an untimed wait); `log` holds its /proc task, then "idle" once it went idle."""
    release, done, named = threading.Event(), threading.Event(), threading.Event()
    log: list[str] = []

    def run() -> None:
        _name_thread(_WORKER_NAME)
        log.append(str(threading.get_native_id()))
        named.set()
        while not release.wait(timeout=60):
            pass
        log.append("idle")
        done.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    named.wait()
    yield release, log
    release.set()
    done.set()
    thread.join()


@linux_proc
def test_the_wait_returns_only_once_every_worker_is_idle(
    stand_in: tuple[threading.Event, list[str]],
) -> None:
    release, log = stand_in
    threading.Timer(0.05, release.set).start()  # however late it comes, the wait outlasts it
    assert _wait_for_gloo_workers(LIMIT_S) == []
    assert log[1:] == ["idle"]


@linux_proc
def test_a_worker_seen_idle_is_looked_at_again_until_all_are_idle_at_once() -> None:
    """B sleeps for work while A is busy; A then hands B something (as the second gloo worker,
    blocked behind the first, gets the lock when the first goes idle) and goes idle itself. The
    wait must not end on B's earlier idleness."""
    to_b, b_done, named = threading.Event(), threading.Event(), threading.Barrier(3)
    release_a = threading.Event()
    log: list[str] = []

    def a() -> None:
        _name_thread(_WORKER_NAME)
        named.wait()
        while not release_a.wait(timeout=60):  # busy
            pass
        to_b.set()
        b_done.wait()  # idle

    def b() -> None:
        _name_thread(_WORKER_NAME)
        named.wait()
        to_b.wait()  # idle, before and while A is busy
        threading.Event().wait(timeout=0.2)  # busy: releasing its work
        log.append("B released")
        b_done.wait()  # idle

    threads = [threading.Thread(target=f, daemon=True) for f in (a, b)]
    for thread in threads:
        thread.start()
    named.wait()
    threading.Timer(0.05, release_a.set).start()
    try:
        assert _wait_for_gloo_workers(LIMIT_S) == []
        assert log == ["B released"]
    finally:
        release_a.set()
        to_b.set()
        b_done.set()
        for thread in threads:
            thread.join()


@linux_proc
def test_a_worker_busy_past_the_limit_is_given_up_on(
    stand_in: tuple[threading.Event, list[str]],
) -> None:
    _, log = stand_in
    busy = _wait_for_gloo_workers(0.02)
    assert TASKS / log[0] in busy
    assert log[1:] == []


@linux_proc
def test_real_gloo_workers_are_found_and_go_idle_after_a_collective() -> None:
    """The thread name and the wait this module reads are torch's, on every torch it supports."""
    group: Any = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=60))
    try:
        tensor = torch.ones(1024)
        group.allreduce([tensor]).wait()
        workers = [t for t in TASKS.iterdir() if _teardown._read(t / "comm") == _WORKER_NAME]
        assert workers, f"no thread named {_WORKER_NAME}: torch renamed gloo's workers"
        assert _wait_for_gloo_workers(LIMIT_S) == []
    finally:
        del group


EXIT_SCRIPT = """
import atexit, threading, torch.distributed as dist
from autoshard import _teardown

# registered before the teardown, so it runs after it (atexit runs last-in, first-out)
atexit.register(lambda: print("after teardown", flush=True))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
_teardown.destroy_at_exit()  # as prepare does when it created the group
_teardown._WORKER_WAIT_S = 30.0  # the stand-in's busy spell ends first, however slow the machine
keep = dist.group.WORLD  # as a DDP wrapper: destroy_process_group cannot join gloo's threads
named, exiting = threading.Event(), threading.Event()
atexit.register(exiting.set)  # registered after the teardown: runs just before it

def worker():  # a gloo worker still releasing its last collective as the script ends
    path = f"/proc/self/task/{threading.get_native_id()}/comm"
    open(path, "w").write(_teardown._WORKER_NAME)
    named.set()
    exiting.wait()
    threading.Event().wait(timeout=0.5)  # busy: a timed wait, as for the GIL
    print("worker idle", flush=True)
    threading.Event().wait()

threading.Thread(target=worker, daemon=True).start()
named.wait()
"""


@linux_proc
@pytest.mark.parametrize("script_destroys", [False, True], ids=["group-left", "script-destroys"])
def test_exit_waits_for_a_worker_that_is_still_busy(tmp_path: Path, script_destroys: bool) -> None:
    """Also where the script destroyed the group itself, as the README's example does: a wrapper
    it still holds (or one of torch's caches, which hold FSDP2's mesh) keeps gloo's threads
    alive into finalisation all the same."""
    script = EXIT_SCRIPT + ("dist.destroy_process_group()\n" if script_destroys else "")
    returncode, output, _ = run_plain_python(script, tmp_path, 120)
    assert returncode == 0, output
    lines = [line for line in output.splitlines() if line in ("worker idle", "after teardown")]
    assert lines == ["worker idle", "after teardown"], output


DESTROY_SCRIPT = """
import threading
from pathlib import Path
import torch, torch.distributed as dist
from autoshard import _teardown

def workers():
    tasks = Path("/proc/self/task").iterdir()
    return sum(_teardown._read(t / "comm") == _teardown._WORKER_NAME for t in tasks)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
_teardown.destroy_at_exit()  # as prepare does when it created the group
dist.all_reduce(torch.ones(4))
print("workers before", workers())
dist.destroy_process_group()  # the script's own teardown, nothing else holding the group
print("workers after", workers(), flush=True)
"""


@linux_proc
def test_a_script_that_destroys_the_group_itself_joins_its_threads_there(tmp_path: Path) -> None:
    """autoshard's record of the group it created does not keep the group alive: the script's own
    `destroy_process_group` drops the last reference and joins gloo's threads then, not during
    finalisation, where a worker still releasing tensors aborts the process."""
    returncode, output, _ = run_plain_python(DESTROY_SCRIPT, tmp_path, 120)
    assert returncode == 0, output
    before = [line for line in output.splitlines() if line.startswith("workers ")]
    assert before[0] != "workers before 0", output  # the check reads real threads
    assert before[1:] == ["workers after 0"], output
