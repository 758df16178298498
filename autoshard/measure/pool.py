"""Simulated runs shared out to worker processes where this machine's cores are idle (issue 24).

A run (`measure.simulate._run`: one strategy, checkpointed or not, at one depth) is a fake training
step that depends on its inputs alone, so it gives the same bytes wherever it runs. `Pool.run_all`
puts a round's runs on one queue, which this process and the pool's workers all take from: each run
is done by whoever is free first. A worker that has not started when the round is over (a fresh
interpreter imports torch first: about 2 s) has cost only an idle core, and is stopped unused at the
end: nothing ever waits for a worker to start.

Workers are fresh interpreters (`python -m autoshard.measure.worker`), not forks: the caller may
hold threads, locks and CUDA state a fork does not carry safely. Nor are they multiprocessing's
spawned children, which run the caller's script again to find what it defines (a training script
without a `__main__` guard would start training in every worker). They receive, once, the model's
module tree on the meta device, its optimizer rebuilt over it, the example batch and the loss
function (`torch.save`); a model, optimizer or loss function defined in `__main__` cannot be
imported there, and the pool is not used. Whatever a worker cannot do (start, unpickle, reply) is
left undone and the caller runs it here: a result never depends on where it was run, and
`tests/test_pool.py` checks that a pool's results equal this process's.

Only simulations on fake CPU tensors are shared out. On CUDA a fake tensor's backward needs a real
CUDA context (torch's `init_gpu_context`; without one: "hasPrimaryContext expects a valid device
index"), so each worker would create one on the user's GPU, a few hundred MiB, while `prepare` is
measuring that GPU.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
import types
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any, BinaryIO, TypeVar

import torch

from autoshard._world import spare_processes

logger = logging.getLogger("autoshard")

# How many workers at most, whatever the load (0: none); unset: as many as this rank's idle cores
# and memory allow (`_world.spare_processes`).
WORKERS = "AUTOSHARD_SIMULATION_WORKERS"
# A worker's own entry point: `python -m` runs it as a script, never the caller's
_ENTRY = "autoshard.measure.worker"
_LENGTH = struct.Struct("<Q")  # each message: its length, then the pickled bytes
Job = TypeVar("Job", bound=Hashable)
Result = TypeVar("Result")


def worker_count(device: torch.device, runs: int) -> int:
    """How many workers to start for a planning whose first round has `runs` runs simulated on
    `device` (0: none). This process takes runs too: one run needs none."""
    if device.type != "cpu" or runs < 2:
        return 0
    chosen = os.environ.get(WORKERS, "").strip()
    if chosen:
        try:
            limit = int(chosen)
        except ValueError:
            raise ValueError(
                f"{WORKERS} must be a whole number of workers, got {chosen!r}"
            ) from None
        return max(0, min(limit, runs - 1))
    return max(0, min(spare_processes(), runs - 1))


def payload(entry: Callable[..., Any], state: Any) -> bytes | None:
    """`state` pickled for a worker, which opens `entry(state)` (a context manager giving the
    function that runs one job); None where it cannot be (what the pickle needs is defined in
    `__main__`, which a worker cannot import, or is not picklable at all)."""
    buffer = io.BytesIO()
    try:
        torch.save((entry, state), buffer, pickle_module=_NO_MAIN)
    except Exception as error:  # noqa: BLE001 - any object may refuse pickling: run here
        logger.debug("simulations not shared out: %s", error)
        return None
    return buffer.getvalue()


class _NoMainPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and obj.__module__ == "__main__":
            raise pickle.PicklingError(f"{obj.__qualname__} is defined in __main__")
        return NotImplemented


_NO_MAIN = types.ModuleType("autoshard_no_main_pickle")
_NO_MAIN.Pickler = _NoMainPickler  # type: ignore[attr-defined]


class Pool:
    """`count` workers, each sent `message` (`payload`) at start, that share out the jobs of each
    `run_all` with this process, until `close` (or the end of a `with` block) stops them.

    With `run_here` False, this process runs a job only once no worker is left (the tests make
    the workers do everything that way)."""

    def __init__(self, message: bytes, count: int, run_here: bool = True) -> None:
        self._changed = threading.Condition()
        self._queue: deque[Hashable] = deque()
        self._open: set[Hashable] = set()  # the round's jobs not yet done
        self._results: dict[Any, Any] = {}
        self._in_flight: set[Hashable] = set()  # jobs a worker is making now
        self._made_here: set[Hashable] = set()  # the round's jobs this process took
        self._closing = False
        self._run_here = run_here
        self._alive = count
        self.size = count
        self.done_by_workers = 0
        self._workers = [_Worker(message) for _ in range(count)]
        self._threads = [
            threading.Thread(target=self._serve, args=(w,), name="autoshard-pool", daemon=True)
            for w in self._workers
        ]
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_all(self, jobs: Iterable[Job], here: Callable[[Job], Result]) -> dict[Job, Result]:
        """Each job's result, by job, from whoever made it first: a worker, or `here(job)` in
        this process. With nothing left on the queue this process makes a job a worker is still
        making rather than wait for it: a round never takes longer than this process alone would
        (a worker slow or stuck costs nothing). A job that failed (raised here, or in a worker)
        is left out: the caller runs it again itself, and handles its failure as it would
        without a pool."""
        with self._changed:
            fresh = [job for job in dict.fromkeys(jobs) if job not in self._open]
            self._queue.extend(fresh)
            self._open.update(fresh)
            self._results = {}
            self._made_here = set()
            self._changed.notify_all()
        job: Any
        while True:
            with self._changed:
                while self._open and (job := self._next_here()) is None:
                    self._changed.wait()
                if not self._open:
                    return dict(self._results)
            try:
                result = here(job)
            except Exception:  # noqa: BLE001 - left out: the caller runs it again and says why
                logger.debug("a simulated run failed here", exc_info=True)
                result = None
            self._resolve(job, result)

    def close(self) -> None:
        """Stops every worker, busy or not (the jobs left are this process's)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        for worker in self._workers:
            worker.stop()
        for thread in self._threads:
            thread.join(timeout=10)

    def _next_here(self) -> Any:
        """The job this process makes next (None: wait), under the lock: the first queued, once
        no worker is left or with `run_here`; with nothing queued, one a worker is making."""
        if self._queue and (self._run_here or not self._alive):
            job = self._queue.popleft()
            self._made_here.add(job)
            return job
        if self._run_here:
            for job in self._in_flight:
                if job in self._open and job not in self._made_here:
                    self._made_here.add(job)
                    return job
        return None

    def _resolve(self, job: Hashable, result: Any, by_worker: bool = False) -> None:
        """The first answer for `job` stands (one made twice, here and by a worker, gives the
        same: the later is dropped)."""
        with self._changed:
            if job in self._open:
                self._open.discard(job)
                if result is not None:
                    self._results[job] = result
                    self.done_by_workers += by_worker
            self._changed.notify_all()

    def _serve(self, worker: _Worker) -> None:
        """One worker's thread: start it, then hand it jobs until the pool closes. A job the
        worker could not answer goes back on the queue, and the worker is stopped."""
        job = None
        try:
            worker.start()
            while True:
                with self._changed:
                    while not self._queue and not self._closing:
                        self._changed.wait()
                    if self._closing:
                        return
                    job = self._queue.popleft()
                    self._in_flight.add(job)
                outcome, value = worker.ask(job)
                with self._changed:
                    self._in_flight.discard(job)
                self._resolve(job, value if outcome == "ok" else None, by_worker=True)
                if outcome != "ok":
                    logger.debug("a simulated run failed in a worker: %s", value)
                job = None
        except Exception:  # noqa: BLE001 - a worker that fails leaves its jobs to the rest
            if not self._closing:
                logger.debug("a simulation worker stopped: %s", worker.said(), exc_info=True)
        finally:
            worker.stop()
            with self._changed:
                self._alive -= 1
                if job is not None:
                    self._in_flight.discard(job)
                    if job in self._open and job not in self._made_here:
                        self._queue.appendleft(job)
                self._changed.notify_all()


class _Worker:
    """One worker process and its pipes: messages are a length and pickled bytes."""

    def __init__(self, message: bytes) -> None:
        self._message = message
        self._process: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._stderr = tempfile.TemporaryFile()

    def start(self) -> None:
        """Starts the process, sends it the payload and waits until it has read it."""
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, *sys.path])}
        with self._lock:
            if self._stopped:
                raise RuntimeError("stopped before it started")
            self._process = subprocess.Popen(
                [sys.executable, "-m", _ENTRY],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=env,
            )
        send(self._pipes()[0], self._message)
        if receive(self._pipes()[1]) != b"ready":
            raise RuntimeError("the worker did not start")

    def ask(self, job: Hashable) -> tuple[str, Any]:
        """("ok", result) or ("failed", why) for one job."""
        stdin, stdout = self._pipes()
        send(stdin, pickle.dumps(job))
        reply = receive(stdout)
        if reply is None:
            raise RuntimeError("the worker ended")
        outcome: tuple[str, Any] = pickle.loads(reply)
        return outcome

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        if process is not None:
            process.wait()
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError, ValueError):  # another thread's, mid-write
                        pipe.close()
        with contextlib.suppress(OSError, ValueError):
            self._stderr.close()

    def said(self) -> str:
        """The end of what the worker wrote to its standard error."""
        try:
            self._stderr.seek(0)
            return self._stderr.read()[-2000:].decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def _pipes(self) -> tuple[BinaryIO, BinaryIO]:
        process = self._process
        if process is None or process.stdin is None or process.stdout is None:
            raise RuntimeError("not started")
        return process.stdin, process.stdout  # type: ignore[return-value]


def send(pipe: BinaryIO, data: bytes) -> None:
    pipe.write(_LENGTH.pack(len(data)))
    pipe.write(data)
    pipe.flush()


def receive(pipe: BinaryIO) -> bytes | None:
    """The next message, or None where the other end closed the pipe."""
    header = pipe.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(header)
    data = pipe.read(size)
    if len(data) < size:
        return None
    return data
