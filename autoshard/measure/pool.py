"""Jobs shared out to worker processes where this machine's cores are idle (issue 24): the pool
under `measure.sharing`, which gives it simulated runs.

`Pool.run_all` puts a round's jobs on one queue, which this process and the pool's workers all
take from: each job is made by whoever is free first, and with nothing left on the queue this
process makes a job a worker is still making rather than wait for it. A round therefore never
takes longer than this process alone would take (a worker slow to start, about 2 s to import
torch, or stuck, costs an idle core and nothing else), and workers are stopped at the end.

A job must give the same result wherever it is made. A worker is a fresh interpreter, which sees
what it is sent and nothing else this process changed (a patched function, a switch of torch's, a
warning filter): so for each kind of job (what such a change may touch alike) each worker first
makes the kind's first job, which this process makes first, and takes that kind's jobs only
where its result is the same (`same`). Where it differs, every worker is stopped and this
process makes the rest (`distrusted` says why).

Workers are started as `python -m autoshard.measure.worker`, not forked (the caller may hold
threads, locks and CUDA state a fork does not carry safely), nor as multiprocessing's spawned
children, which run the caller's script again to find what it defines (a training script without
a `__main__` guard would start training in every worker). They receive one payload (`payload`),
which refuses what a worker cannot import (anything defined in `__main__`) and tensors off the
CPU (a worker loading one would create a CUDA context on the user's GPU).
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
from typing import Any, BinaryIO, Generic, TypeVar

import torch

from autoshard._world import spare_processes

logger = logging.getLogger("autoshard")

# How many workers, whatever the load (0: none; at most one fewer than the jobs); unset: as many
# as this rank's idle cores and memory allow (`_world.spare_processes`).
WORKERS = "AUTOSHARD_SIMULATION_WORKERS"
# A worker's own entry point: `python -m` runs it as a script, never the caller's
_ENTRY = "autoshard.measure.worker"
_LENGTH = struct.Struct("<Q")  # each message: its length, then the pickled bytes
_LAUNCHER_VARIABLES = frozenset(
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
    + ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
)
Job = TypeVar("Job", bound=Hashable)
Result = TypeVar("Result")


def worker_count(device: torch.device, jobs: int) -> int:
    """How many workers to start for a first round of `jobs` jobs on `device` (0: none). This
    process makes jobs too: one job needs none. None on CUDA: a fake tensor's backward needs a
    real CUDA context (torch's `init_gpu_context`), which each worker would create on the user's
    GPU, a few hundred MiB, while `prepare` is measuring it."""
    chosen = os.environ.get(WORKERS, "").strip()
    try:
        limit = int(chosen) if chosen else None
    except ValueError:
        raise ValueError(f"{WORKERS} must be a whole number of workers, got {chosen!r}") from None
    if device.type != "cpu" or jobs < 2:
        return 0
    return max(0, min(spare_processes() if limit is None else limit, jobs - 1))


def payload(entry: Callable[..., Any], state: Any) -> bytes | None:
    """`state` pickled for a worker, which opens `entry(state)` (a context manager giving the
    function that makes one job); None where it cannot be: what it needs is defined in
    `__main__` (a worker cannot import it), holds a tensor off the CPU, or does not pickle."""
    buffer = io.BytesIO()
    try:
        torch.save((entry, state), buffer, pickle_module=_PORTABLE)
    except Exception as error:  # noqa: BLE001 - any object may refuse pickling: made here
        logger.debug("not shared out with worker processes: %s", error)
        return None
    return buffer.getvalue()


class _PortablePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and obj.__module__ == "__main__":
            raise pickle.PicklingError(f"{obj.__qualname__} is defined in __main__")
        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            raise pickle.PicklingError(f"a tensor on {obj.device}")
        return NotImplemented


_PORTABLE = types.ModuleType("autoshard_portable_pickle")
_PORTABLE.Pickler = _PortablePickler  # type: ignore[attr-defined]


class Round(Generic[Job, Result]):
    """What `Pool.run_all` gives back: each job's result, by job, and the jobs that failed (the
    exception where it was raised here, what a worker said where it failed there). A job in
    neither was left out: another of its `family` failed first."""

    def __init__(self) -> None:
        self.made: dict[Job, Result] = {}
        self.failed: dict[Job, BaseException | str] = {}
        self.by_workers = 0  # of `made`


class Pool:
    """`count` workers, each sent `message` (`payload`) at start, that share out the jobs of each
    `run_all` with this process, until `close` (or the end of a `with` block) stops them.

    Jobs come in kinds (`run_all`'s `kind`: what a change of this process's may touch alike).
    The first job of each kind is this process's, its reference: a worker makes it too before
    any other job of that kind, and takes that kind's jobs only where its result is the same.
    With `run_here` False this process makes, besides the references, only the jobs no worker
    is left to make (the tests make the workers do the rest)."""

    def __init__(self, message: bytes, count: int, run_here: bool = True) -> None:
        self._changed = threading.Condition()
        self._queue: deque[Any] = deque()
        self._round: Round[Any, Any] = Round()
        self._open: set[Any] = set()  # the round's jobs not yet made nor failed
        self._in_flight: set[Any] = set()  # jobs a worker is making now
        self._made_here: set[Any] = set()  # the round's jobs this process took
        self._family: Callable[[Any], Hashable] = lambda job: job
        self._kind: Callable[[Any], Hashable] = lambda job: None
        self._same: Callable[[Any, Any], bool] = lambda a, b: bool(a == b)
        self._references: dict[Hashable, Any] = {}  # kind -> its first job, made here
        self._outcomes: dict[Hashable, tuple[bool, Any]] = {}  # kind -> its reference's outcome
        self._closing = False
        self._run_here = run_here
        self._alive = count
        self.size = count
        self.started = 0  # workers that started and read their payload
        self.distrusted: str | None = None  # why the workers were stopped, if they were
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

    def run_all(
        self,
        jobs: Iterable[Job],
        here: Callable[[Job], Result],
        same: Callable[[Result, Result], bool],
        family: Callable[[Job], Hashable] = lambda job: job,
        kind: Callable[[Job], Hashable] = lambda job: None,
    ) -> Round[Job, Result]:
        """The jobs made by whoever takes them first: a worker, or `here(job)` in this process
        (each `kind`'s first job always here, first: workers check themselves against it with
        `same`). Once a job fails, the other jobs of its `family` not yet made are left out:
        the caller, which makes or explains them itself, needs none of them."""
        with self._changed:
            fresh = [job for job in dict.fromkeys(jobs) if job not in self._open]
            self._round = Round()
            self._made_here = set()
            self._family, self._kind, self._same = family, kind, same
            self._queue.extend(fresh)
            self._open.update(fresh)
            references: list[Any] = []
            for new in fresh:
                if kind(new) not in self._references:
                    self._references[kind(new)] = new
                    references.append(new)
                    self._queue.remove(new)
                    self._made_here.add(new)
            self._changed.notify_all()
        job: Any
        while True:
            if references:
                job = references.pop(0)
            else:
                with self._changed:
                    while self._open and (job := self._next_here()) is None:
                        self._changed.wait()
                    if not self._open:
                        return self._round
            try:
                result: Any = here(job)
                outcome: tuple[bool, Any] = (True, result)
            except Exception as error:  # noqa: BLE001 - handed back: the caller says why
                logger.debug("a job failed here", exc_info=True)
                outcome = (False, error)
            with self._changed:
                if self._references.get(kind(job)) == job:
                    self._outcomes.setdefault(kind(job), outcome)
                self._settle(job, outcome, by_worker=False)

    def close(self) -> None:
        """Stops every worker, busy or not."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        for worker in self._workers:
            worker.stop()
        for thread in self._threads:
            thread.join(timeout=10)

    def _next_here(self) -> Any:
        """The job this process makes next (None: wait), under the lock: the first queued, with
        `run_here` or once no worker is left (or none may make it: its kind's reference failed
        here); with nothing queued, one a worker is making."""
        for job in self._queue:
            kind = self._kind(job)
            unverifiable = kind in self._outcomes and not self._outcomes[kind][0]
            if self._run_here or not self._alive or unverifiable:
                self._queue.remove(job)
                self._made_here.add(job)
                return job
        if self._run_here or not self._alive:
            for job in self._in_flight:
                if job in self._open and job not in self._made_here:
                    self._made_here.add(job)
                    return job
        return None

    def _settle(self, job: Any, outcome: tuple[bool, Any], by_worker: bool) -> None:
        """Under the lock: the first outcome for `job` stands (one made twice, here and by a
        worker, is the same: the later is dropped). A failure leaves out its family's other
        jobs, queued or being made by a worker (whose answer is then dropped)."""
        if job not in self._open:
            return
        self._open.discard(job)
        made, value = outcome
        if made:
            self._round.made[job] = value
            self._round.by_workers += by_worker
        else:
            self._round.failed[job] = value
            family = self._family(job)
            for other in [j for j in self._open if self._family(j) == family]:
                self._open.discard(other)
                if other in self._queue:
                    self._queue.remove(other)
        self._changed.notify_all()

    def _serve(self, worker: _Worker) -> None:
        """One worker's thread: start it, then hand it jobs of the kinds it has checked (`_take`)
        until the pool closes. A job a worker could not answer goes back on the queue, and the
        worker is stopped; a reference it makes otherwise stops them all."""
        job = None
        checked: set[Hashable] = set()
        try:
            worker.start()
            with self._changed:
                self.started += 1
            while (job := self._take(worker, checked)) is not None:
                made, value = worker.ask(job)
                with self._changed:
                    self._in_flight.discard(job)
                    self._settle(job, (made, value), by_worker=True)
                job = None
        except Exception:  # noqa: BLE001 - a worker that fails leaves its jobs to the rest
            if not self._closing:
                logger.debug("a worker process stopped: %s", worker.said(), exc_info=True)
        finally:
            worker.stop()
            with self._changed:
                self._alive -= 1
                if job is not None:
                    self._in_flight.discard(job)
                    if job in self._open and job not in self._made_here:
                        self._queue.appendleft(job)
                self._changed.notify_all()

    def _take(self, worker: _Worker, checked: set[Hashable]) -> Any:
        """The next job for `worker` (None: stop): the first queued of a kind it has checked;
        where none is, it checks itself against the reference of a queued job's kind first."""
        while True:
            with self._changed:
                while True:
                    if self._closing or self.distrusted is not None:
                        return None
                    kinds = [self._kind(job) for job in self._queue]
                    ready = [
                        job for job, kind in zip(self._queue, kinds, strict=True) if kind in checked
                    ]
                    if ready:
                        self._queue.remove(ready[0])
                        self._in_flight.add(ready[0])
                        return ready[0]
                    # a kind whose reference is made (and succeeded) here: check against it
                    unchecked = [
                        k for k in kinds if self._outcomes.get(k, (False,))[0] and k not in checked
                    ]
                    if unchecked:
                        kind = unchecked[0]
                        break
                    self._changed.wait()
                reference, (_, ours) = self._references[kind], self._outcomes[kind]
            made, theirs = worker.ask(reference)
            with self._changed:
                if made and self._same(ours, theirs):
                    checked.add(kind)
                    continue
                self.distrusted = self.distrusted or (
                    "a worker's step differed from this process's"
                    if made
                    else f"a step failed in a worker that did not here ({theirs})"
                )
                self._changed.notify_all()
                return None


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
        # the caller's environment, less a launcher's rank variables (a module the payload
        # imports may act on them), with no workers of its own
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
        env.update({"PYTHONPATH": os.pathsep.join([package_root, *sys.path]), WORKERS: "0"})
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

    def ask(self, job: Hashable) -> tuple[bool, Any]:
        """(True, result) or (False, why it failed) for one job; raises where the worker ended."""
        stdin, stdout = self._pipes()
        send(stdin, pickle.dumps(job))
        reply = receive(stdout)
        if reply is None:
            raise RuntimeError("the worker ended")
        kind, value = pickle.loads(reply)
        return kind == "ok", value

    def stop(self) -> None:
        """Kills the process and closes its pipes. Called by `Pool.close` and by the worker's
        own thread, maybe at once: the kill comes first, so a thread blocked on a pipe wakes with
        an error (which its thread ends on) before the pipe is closed under it."""
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
