"""Jobs for tests/test_pool.py's workers: importable by name, as a worker needs them."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def squares(caller: int) -> Iterator[Callable[[Any], Any]]:
    """Each job's square and the pid that made it. In a worker (not in `caller`, the pid of the
    process that made the pool), "die" ends the process at once and "raise" raises."""

    def run(job: Any) -> Any:
        if os.getpid() != caller and job == "die":
            os._exit(3)
        if os.getpid() != caller and job == "raise":
            raise ValueError("this job fails in a worker")
        return (job * 2 if isinstance(job, str) else job * job), os.getpid()

    yield run


@contextlib.contextmanager
def stuck(caller: int) -> Iterator[Callable[[Any], Any]]:
    """Each job's square; in a worker (not in `caller`), job 3 hangs (an hour)."""

    def run(job: Any) -> Any:
        if os.getpid() != caller and job == 3:
            time.sleep(3600)
        return job * job

    yield run
