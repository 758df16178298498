"""A simulation worker (`measure.pool`): `python -m autoshard.measure.worker`, talking over its
standard input and output only.

It reads one payload, `(entry, state)`, opens `entry(state)` (a context manager giving the function
that runs one job), says it is ready, then answers each job with ("ok", result) or ("failed",
why), until its input closes. What the caller's code prints goes to standard error: standard
output carries the replies alone."""

from __future__ import annotations

import io
import os
import pickle
import sys


def main() -> None:
    from autoshard.measure.pool import receive, send

    _die_with_the_caller()
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    jobs = sys.stdin.buffer
    message = receive(jobs)
    if message is None:
        return
    import torch

    entry, state = torch.load(io.BytesIO(message), weights_only=False)  # from the caller: trusted
    with entry(state) as run:
        send(replies, b"ready")
        while (job := receive(jobs)) is not None:
            try:
                reply = pickle.dumps(("ok", run(pickle.loads(job))))
            except Exception as error:  # noqa: BLE001 - the caller runs it again and says why
                reply = pickle.dumps(("failed", f"{type(error).__name__}: {error}"[:300]))
            send(replies, reply)


def _die_with_the_caller() -> None:
    """On Linux, the kernel kills this process when the thread that started it ends (its caller
    killed without running its clean-up: a worker must not outlive it busy)."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
