"""Harness of the multi-process tier: launch a worker under real torchrun (2 gloo ranks on CPU),
with a hard timeout, and hand its per-rank, per-case results to the tests.

A worker (tests/workers/*.py, see tests/workers/_common.py) runs many sub-cases in one launch and
writes `rank<r>.json` ({case: {"ok", "data" | "error", "traceback"}}) and `rank<r>.log` (its
stdout and stderr) into the output directory. A module-scoped fixture launches each worker once;
each test function reads one case with `Launch.case`, which fails with both ranks' log tails
when the case is missing or raised on any rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
NPROC = 2
# A launch takes about 5-15 s on 2 idle cores; the limit only exists so that a hang (a rank stuck
# in a collective its peer never entered) fails the tests instead of blocking CI. It is no speed
# target: it must hold on a 2-core machine that is busy with other work (launches took 5-10 times
# longer at a load average of 8), so it is far above the idle figures.
SLOW_MACHINE = 10  # how much slower than idle a busy machine may run before a launch counts as hung
TIMEOUT_S = 60 * SLOW_MACHINE
TAIL_CHARS = 4000


@dataclass
class Launch:
    """One torchrun launch of one worker: what it printed and what each rank recorded."""

    worker: str
    out_dir: Path
    returncode: int | None
    timed_out: bool
    timeout: float
    seconds: float
    torchrun_output: str
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def case(self, name: str) -> list[Any]:
        """Every rank's data for case `name`; fails the calling test if any rank lacks it."""
        problems = []
        for r, results in enumerate(self.ranks):
            entry = results.get(name)
            if entry is None:
                problems.append(f"rank {r}: case {name!r} never finished")
            elif not entry["ok"]:
                problems.append(f"rank {r}: case {name!r} raised {entry['error']}")
        if problems:
            pytest.fail(self.report("; ".join(problems), name), pytrace=False)
        return [results[name]["data"] for results in self.ranks]

    def report(self, problem: str, name: str | None = None) -> str:
        status = (
            f"timed out after {self.timeout:g}s and was killed"
            if self.timed_out
            else f"exited with {self.returncode} after {self.seconds:.1f}s"
        )
        parts = [f"{problem}\nworker {self.worker}.py under torchrun {status}"]
        for r, results in enumerate(self.ranks):
            entry = results.get(name) if name else None
            if entry is not None and not entry["ok"]:
                parts.append(f"--- rank {r} traceback ---\n{entry['traceback']}")
        for r in range(NPROC):
            log = self.out_dir / f"rank{r}.log"
            text = log.read_text(errors="replace") if log.exists() else "(no log written)"
            parts.append(f"--- rank {r} stdout+stderr (tail) ---\n{text[-TAIL_CHARS:]}")
        parts.append(f"--- torchrun (tail) ---\n{self.torchrun_output[-TAIL_CHARS:]}")
        return "\n".join(parts)


# How a worker is started: torchrun itself, or `accelerate launch` (which starts the ranks through
# torchrun; `--multi_gpu` is what gives 2 processes on a machine without GPUs, and port 0 makes it
# pick a free port, as torchrun's --standalone does).
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC))
ACCELERATE = (
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",
    "--num_processes",
    str(NPROC),
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
    "--main_process_port",
    "0",
)


def plans_kept(directory: Path) -> dict[str, str]:
    """The environment that turns autoshard's cache on in `directory`, for a launch that plans
    the same model with the same settings more than once (the suite turns it off elsewhere)."""
    return {"AUTOSHARD_CACHE": "1", "AUTOSHARD_CACHE_DIR": str(directory)}


def run_torchrun(
    script: Path,
    *args: str,
    timeout: float,
    launcher: tuple[str, ...] = TORCHRUN,
    environment: dict[str, str] | None = None,
) -> tuple[int, str, bool]:
    """Run `script` on NPROC CPU ranks under real torchrun (or another `launcher`) with a hard
    timeout, `environment` over this process's; on expiry the whole process tree is killed.
    Returns (return code, the launcher's output, timed out)."""
    command = [sys.executable, *launcher, str(script), *args]
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",  # 2 ranks on a 2-core machine: no oversubscription
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",  # this tier is CPU/gloo even on a GPU machine
    )
    env.update(environment or {})
    env.pop("TORCHELASTIC_RUN_ID", None)
    return run_tree(command, REPO, env, timeout)


def run_tree(
    command: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> tuple[int, str, bool]:
    """Run `command` with a hard timeout, killing its whole process tree on expiry. Returns
    (return code, stdout and stderr together, timed out)."""
    proc = _start(command, env, cwd)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc)
        output, _ = proc.communicate()
    return proc.returncode, output or "", timed_out


def run_plain_python(
    script: str, cwd: Path, timeout: float, cuda: bool = False
) -> tuple[int, str, bool]:
    """Run `script` (its text) as `python script.py` from `cwd`, outside any launcher: no rank
    variables, this checkout importable, and unless `cuda` no GPU. Returns as `run_tree`."""
    path = cwd / "script.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return run_tree([sys.executable, str(path)], cwd, env, timeout)


def _start(command: list[str], env: dict[str, str], cwd: Path = REPO) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_ranks(
    script: Path, *args: str, timeout: float, nproc: int = NPROC
) -> tuple[int, str, bool]:
    """Start NPROC ranks of `script` directly, without torchrun, with the variables torchrun
    would set: a rank that dies (SIGKILL) then leaves the others running, as on a real cluster
    whose launcher is slower to react than autoshard's agreement. Returns (the worst return
    code, their output, timed out)."""
    import socket

    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for r in range(nproc):
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
            PYTHONUNBUFFERED="1",
            CUDA_VISIBLE_DEVICES="",
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(_start([sys.executable, str(script), *args], env))
    deadline = time.monotonic() + timeout
    outputs, codes, timed_out = [], [], False
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc)
            output, _ = proc.communicate()
        outputs.append(output or "")
        codes.append(proc.returncode)
    return max(codes, key=abs), "\n".join(outputs), timed_out


def launch(
    worker: str,
    out_dir: Path,
    *args: str,
    timeout: float = TIMEOUT_S,
    launcher: tuple[str, ...] | None = TORCHRUN,
    nproc: int = NPROC,
) -> Launch:
    """Run tests/workers/<worker>.py on NPROC gloo ranks under torchrun (or `launcher`; None
    starts the ranks directly, see `run_ranks`, and `nproc` of them) and collect results."""
    assert launcher is None or nproc == NPROC, "torchrun launches start NPROC ranks"
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    script = WORKERS / f"{worker}.py"
    if launcher is None:
        returncode, output, timed_out = run_ranks(
            script, str(out_dir), *args, timeout=timeout, nproc=nproc
        )
    else:
        returncode, output, timed_out = run_torchrun(
            script, str(out_dir), *args, timeout=timeout, launcher=launcher
        )
    ranks = [_read_results(out_dir / f"rank{r}.json") for r in range(nproc)]
    return Launch(
        worker=worker,
        out_dir=out_dir,
        returncode=returncode,
        timed_out=timed_out,
        timeout=timeout,
        seconds=time.perf_counter() - started,
        torchrun_output=output,
        ranks=ranks,
    )


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    """Kill torchrun and its workers. torchrun starts each worker in a session of its own, so
    killing torchrun's process group alone would leave the ranks running: find them first."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for pid in [proc.pid, *(c.pid for c in children)]:
        try:
            os.killpg(pid, signal.SIGKILL)  # each is the leader of its own group
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _read_results(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:  # killed mid-write: the runner writes atomically, but be safe
        return {}
