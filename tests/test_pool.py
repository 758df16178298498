"""Simulations shared out to worker processes (`measure.pool`): the same results as this process
alone, whatever a worker does, and workers only where cores are idle and never on CUDA.

Each pool here starts fresh interpreters (about 2 s each on an idle core); the tests make the
workers do every run (`run_here=False`), so that what is compared was really made by them."""

from __future__ import annotations

import operator
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _pool_jobs import squares, stuck
from test_simulate import MLP, STRATEGIES, _gpt
from torch import nn

import autoshard
import autoshard._world as world_module
import autoshard.measure.pool as pool_module
from autoshard import _cgroup
from autoshard.decide.estimate import model_stats
from autoshard.measure.fake import unavailable
from autoshard.measure.pool import WORKERS, Pool, payload, worker_count
from autoshard.measure.sharing import workers
from autoshard.measure.simulate import Setup, simulate_all

TESTS = Path(__file__).resolve().parent
CPU = torch.device("cpu")
REPO = TESTS.parent


def _value(made: tuple[object, int], other: tuple[object, int]) -> bool:
    return made[0] == other[0]  # the pid that made it aside


def test_workers_make_the_jobs_and_report_what_they_cannot() -> None:
    """The first job is made here, and each worker makes it too before any other (its check);
    the workers make the rest. One that fails in a worker is reported failed with why; one that
    kills its worker goes back to the queue (and kills the next worker that takes it), and is
    made here once no worker is left."""
    here = os.getpid()
    with Pool(payload(squares, here) or b"", 2, run_here=False) as pool:
        first = pool.run_all([2, 3, 4], lambda job: (job * job, here), same=_value)
        failed = pool.run_all([5, "raise"], lambda job: (job * 2, here), same=_value)
        died = pool.run_all(
            ["die", 6], lambda job: ("made here" if job == "die" else 36, here), same=_value
        )
    assert {job: value for job, (value, _) in first.made.items()} == {2: 4, 3: 9, 4: 16}
    assert first.made[2][1] == here and first.by_workers == 2
    assert all(first.made[job][1] != here for job in (3, 4))
    assert set(failed.made) == {5} and failed.by_workers == 1
    assert failed.failed == {"raise": "ValueError: this job fails in a worker"}
    assert died.made["die"] == ("made here", here)
    assert died.made[6][0] == 36
    assert pool.distrusted is None


def test_a_worker_whose_first_job_differs_is_not_trusted() -> None:
    """Something this process changed that a fresh interpreter does not see: the first job,
    made in both, differs, and this process makes every job."""
    here = os.getpid()
    with Pool(payload(squares, here) or b"", 2, run_here=False) as pool:
        made = pool.run_all([2, 3, 4], lambda job: (job * job + 1, here), same=_value)
    assert made.made == {2: (5, here), 3: (10, here), 4: (17, here)}
    assert made.by_workers == 0
    assert pool.distrusted == "a worker's step differed from this process's"


def test_a_failure_leaves_its_family_out() -> None:
    """Once a job fails, the queued jobs of its family are left out (the caller needs none)."""

    def here(job: tuple[str, int]) -> int:
        if job == ("x", 2):
            raise RuntimeError("no")
        return job[1]

    with Pool(b"", 0) as pool:
        made = pool.run_all(
            [("x", 1), ("x", 2), ("y", 1), ("x", 3)], here, same=_value, family=lambda j: j[0]
        )
    assert made.made == {("x", 1): 1, ("y", 1): 1}
    assert list(made.failed) == [("x", 2)] and isinstance(made.failed["x", 2], RuntimeError)


def test_a_stuck_worker_costs_nothing() -> None:
    """With nothing left on the queue, this process makes the job a worker is still making
    instead of waiting for it (here, for ever), and the pool stops the worker."""
    here = os.getpid()
    with Pool(payload(stuck, here) or b"", 1, run_here=False) as pool:
        checked = pool.run_all([2], lambda job: job * job, same=operator.eq)
        watcher = threading.Thread(
            target=_let_this_process_work_once_a_worker_is_busy, args=(pool,)
        )
        watcher.start()
        made = pool.run_all([3], lambda job: job * job, same=operator.eq)
        watcher.join()
    assert checked.made == {2: 4}
    assert made.made == {3: 9} and made.by_workers == 0


def test_a_failure_drops_what_a_worker_makes_of_its_family() -> None:
    """Once a job fails here, a job of its family a worker is still making is not made again
    here (nor waited for): the caller needs none of them."""
    here = os.getpid()

    def made_here(job: int) -> int:
        if job == 1:
            raise RuntimeError("no")
        return job * job

    with Pool(payload(stuck, here) or b"", 1, run_here=False) as pool:
        watcher = threading.Thread(
            target=_let_this_process_work_once_a_worker_is_busy, args=(pool,)
        )
        watcher.start()
        made = pool.run_all([0, 3, 1], made_here, same=operator.eq, family=lambda job: "one")
        watcher.join()
    assert made.made == {0: 0}
    assert list(made.failed) == [1]


def test_a_kind_whose_first_job_fails_here_is_made_here() -> None:
    """No worker can check itself against a first job that failed here: the jobs of its kind are
    this process's, and nothing is distrusted."""
    here = os.getpid()

    def made_here(job: int) -> tuple[int, int]:
        if job == 0:
            raise RuntimeError("no")
        return job * job, here

    with Pool(payload(squares, here) or b"", 1, run_here=False) as pool:
        made = pool.run_all([0, 2], made_here, same=_value)
    assert made.made == {2: (4, here)} and list(made.failed) == [0]
    assert made.by_workers == 0 and pool.distrusted is None


def _let_this_process_work_once_a_worker_is_busy(pool: Pool) -> None:
    """From when a worker has taken a job (stuck: job 3), this process may make jobs as a
    user's does (`run_here`)."""
    for _ in range(1200):
        if pool._in_flight:
            break
        time.sleep(0.1)
    with pool._changed:
        pool._run_here = True
        pool._changed.notify_all()


def test_a_model_defined_in_main_is_simulated_here() -> None:
    """A worker cannot import what the caller's script defines: no payload, no pool."""

    class Script(nn.Linear):
        pass

    Script.__module__ = "__main__"
    assert payload(squares, Script(2, 2)) is None
    assert payload(squares, nn.Linear(2, 2)) is not None


def test_a_worker_never_runs_the_callers_script(tmp_path: Path) -> None:
    """multiprocessing's spawn would run a script without a `__main__` guard again in each
    worker (and start its training there); a worker runs only autoshard's entry."""
    marks = tmp_path / "marks"
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        f"open({str(marks)!r}, 'a').write('ran\\n')\n"
        "from autoshard.measure.pool import Pool, payload\n"
        "from _pool_jobs import squares\n"
        "same = lambda a, b: a[0] == b[0]\n"
        "with Pool(payload(squares, os.getpid()), 1, run_here=False) as pool:\n"
        "    made = pool.run_all([6, 7], lambda job: (job * job, os.getpid()), same).made\n"
        "print(made[7][0], made[7][1] != os.getpid())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["49", "True"]
    assert marks.read_text() == "ran\n"


def test_how_many_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(WORKERS, raising=False)
    monkeypatch.setattr(pool_module, "spare_processes", lambda: 3)
    assert worker_count(cpu, 9) == 3
    assert worker_count(cpu, 3) == 2  # this process makes one
    assert worker_count(cpu, 1) == 0
    assert worker_count(cuda, 9) == 0  # each worker would take a CUDA context on the user's GPU
    monkeypatch.setattr(pool_module, "spare_processes", lambda: 0)
    assert worker_count(cpu, 9) == 0
    monkeypatch.setenv(WORKERS, "5")  # whatever the load
    assert worker_count(cpu, 9) == 5
    assert worker_count(cpu, 4) == 3
    assert worker_count(cuda, 9) == 0
    monkeypatch.setenv(WORKERS, "0")
    monkeypatch.setattr(pool_module, "spare_processes", lambda: 3)
    assert worker_count(cpu, 9) == 0
    monkeypatch.setenv(WORKERS, "many")
    with pytest.raises(
        ValueError, match=f"{WORKERS} must be a whole number of workers, got 'many'"
    ):
        worker_count(cpu, 9)


def test_spare_processes_are_the_idle_cores_and_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import psutil

    class Memory:
        available = 64 << 30
        total = 128 << 30

    class Process:
        def memory_info(self) -> object:
            return type("Info", (), {"rss": 1 << 30})()

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    monkeypatch.setattr(psutil, "Process", Process)
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_cgroup, "_ROOT", tmp_path)  # no control group limits this host
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert world_module.spare_processes() == 15  # this process is busy
    monkeypatch.setattr(os, "getloadavg", lambda: (12.5, 0.0, 0.0))
    assert world_module.spare_processes() == 3
    monkeypatch.setattr(os, "getloadavg", lambda: (16.0, 0.0, 0.0))
    assert world_module.spare_processes() == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 ranks planning: 8 cores idle, 1 each
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 0.0, 0.0))
    assert world_module.spare_processes() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")  # srun's ranks: 12 idle cores, 3 each
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0, 0.0, 0.0))
    assert world_module.spare_processes() == 3
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    monkeypatch.setattr(_cgroup, "cores", lambda: 4)  # a container's CPU quota
    assert world_module.spare_processes() == 0
    monkeypatch.setattr(_cgroup, "cores", lambda: 8)
    assert world_module.spare_processes() == 4
    Memory.available = 6 << 30  # half of it for 1 GiB processes
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 0.0, 0.0))
    assert world_module.spare_processes() == 3
    # a container's memory limit leaves 4 GiB to spare: half of it for 1 GiB processes
    cgroup = tmp_path / "sys/fs/cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{4 << 30}\n")
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")
    mount = "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    (tmp_path / "proc/self/mountinfo").write_text(mount)
    assert world_module.spare_processes() == 2


simulation = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def _deep_mlp() -> tuple[nn.Module, torch.optim.Optimizer, object, list[str]]:
    """Simulated at 3, 4 and 5 blocks and extended. Its batch is this rank's rows of a larger
    one: a view, whose fake copy holds the larger storage (pickled, it would not be a view)."""
    torch.manual_seed(0)
    model = MLP(width=32, depth=16)
    return (
        model,
        torch.optim.Adam(model.parameters()),
        torch.randn(128, 16)[:64],
        [f"blocks.{i}" for i in range(16)],
    )


class _ConvBlocks(nn.Module):
    """A stem, 16 convolution blocks (simulated at 3, 4 and 5 and extended), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            for _ in range(16)
        )
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.flatten(1))


def _convnet() -> tuple[nn.Module, torch.optim.Optimizer, object, list[str]]:
    torch.manual_seed(0)
    model = _ConvBlocks()
    names = [f"blocks.{i}" for i in range(16)]
    return model, torch.optim.SGD(model.parameters()), torch.randn(4, 3, 8, 8), names


# The heaviest of these tests (a 16-block plan of every strategy, checked twice) run on every
# torch CI runs once (fp32) and otherwise on the main torch only (`slow`: README, "Run the test
# suite"); what workers do is this package's code, the same on every torch
MAIN_TORCH_ONLY = pytest.mark.slow


@simulation
@pytest.mark.parametrize(
    "case,dtype,trains_on",
    [
        pytest.param("mlp", None, "cpu", id="fp32"),
        pytest.param("mlp", torch.bfloat16, "cpu", id="bf16", marks=MAIN_TORCH_ONLY),
        pytest.param(
            "convnet", None, "cuda", id="convolutions-what-if-cuda", marks=MAIN_TORCH_ONLY
        ),
    ],
)
def test_runs_made_by_workers_equal_this_process_s(
    monkeypatch: pytest.MonkeyPatch, case: str, dtype: torch.dtype | None, trains_on: str
) -> None:
    """Every strategy, unchecked and checkpointed, each made at its first depth here and at the
    two others by workers: the same simulations, and the same note (kernel workspaces measured
    in bf16 on CPU, or left unmeasured for CUDA, included) but for its seconds and its count of
    the workers' steps."""
    model, optimizer, batch, names = {"mlp": _deep_mlp, "convnet": _convnet}[case]()
    stats = model_stats(model, [model.get_submodule(n) for n in names], 0, "", 0)
    setup = Setup(names, batch, None, optimizer, dtype, CPU, trains_on=torch.device(trains_on))
    alone, note = simulate_all(model, setup, STRATEGIES, stats, 2, checkpointed=STRATEGIES)
    monkeypatch.setenv(WORKERS, "2")
    with workers(model, setup, 2, 2 * len(STRATEGIES), run_here=False) as helpers:
        assert helpers is not None
        shared, shared_note = simulate_all(
            model, setup, STRATEGIES, stats, 2, checkpointed=STRATEGIES, workers=helpers
        )
    assert shared == alone
    # 6 runs at 3 depths each: the first depth of each run made here, the other 12 by workers
    assert ", 12 of the fake steps made by 2 worker process(es)" in shared_note, shared_note
    if trains_on == "cuda":
        assert "not counted (no CUDA device here)" in note
    seconds = re.compile(r"\d+\.\ds|, \d+ of the fake steps made by 2 worker process\(es\)")
    assert seconds.sub("", shared_note) == seconds.sub("", note)


def _shared_out(
    model: nn.Module, batch: object, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict, str, dict, str]:
    """SHARD_GRAD_OP's and FULL_SHARD's runs, unchecked and checkpointed (16 blocks, at 3, 4 and
    5), in this process alone and with a worker making all it can: each's simulations and note."""
    names = [f"blocks.{i}" for i in range(16)]
    stats = model_stats(model, [model.get_submodule(n) for n in names], 0, "", 0)
    setup = Setup(names, batch, None, torch.optim.SGD(model.parameters()), None, CPU)
    sharded = STRATEGIES[1:]
    alone, note = simulate_all(model, setup, sharded, stats, 2, checkpointed=sharded)
    monkeypatch.setenv(WORKERS, "1")
    with workers(model, setup, 2, 4, run_here=False) as helpers:
        assert helpers is not None
        shared, shared_note = simulate_all(
            model, setup, sharded, stats, 2, checkpointed=sharded, workers=helpers
        )
    return alone, note, shared, shared_note


class _Scratch(nn.Module):
    """16 blocks, then a tensor of the default dtype allocated in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * torch.ones(x.shape).to(x.dtype)


def _caught(model: nn.Module, made: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a change this process made that a worker cannot see: the same simulations, `made`
    steps by the worker, and a note saying why it made no more."""
    alone, _, shared, shared_note = _shared_out(model, torch.randn(32, 16), monkeypatch)
    assert shared == alone
    differed = (
        f", {made} of the fake steps made by 1 worker process(es), the others here: a worker's "
        f"step differed from this process's"
    )
    assert differed in shared_note, shared_note


@simulation
def test_a_worker_takes_the_caller_s_default_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings a worker is sent: trusted (each run's first depth the same), it makes the
    others."""
    torch.set_default_dtype(torch.float64)
    try:
        # an fp32 model and batch: only what its forward allocates takes the default dtype (a
        # float64 batch would meet the fp32 weights in a matmul, which real kernels refuse)
        batch = torch.randn(32, 16, dtype=torch.float32)
        alone, _, shared, note = _shared_out(_Scratch().float(), batch, monkeypatch)
    finally:
        torch.set_default_dtype(torch.float32)
    assert shared == alone
    assert ", 8 of the fake steps made by 1 worker process(es)" in note, note


@simulation
def test_what_a_worker_cannot_see_leaves_every_step_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward patched at run time (as kernel libraries patch transformers' models) is not
    the forward a fresh interpreter imports: the worker's first step differs, every step is made
    here, and the note says why."""

    def wider(self: _Scratch, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.cat([x, x * 2, x * 3]).sum(0)

    monkeypatch.setattr(_Scratch, "forward", wider)
    _caught(_Scratch(), 0, monkeypatch)


@simulation
@MAIN_TORCH_ONLY
def test_a_change_only_checkpointed_runs_see_is_caught_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checkpointing patched at run time (here: made a no-op) leaves the unchecked runs alike,
    and the worker makes their other depths; the checkpointed ones differ, and are made here."""
    import autoshard.strategies.engines as engines

    monkeypatch.setattr(engines, "checkpoint_block", lambda module: None)
    _caught(MLP(width=32, depth=16), 4, monkeypatch)


@simulation
@MAIN_TORCH_ONLY
def test_a_change_only_one_strategy_sees_is_caught_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each strategy's runs are checked apart: `fully_shard` patched at run time to keep
    FULL_SHARD's parameters gathered after forward changes FULL_SHARD alone, whose other depths
    are then made here (SHARD_GRAD_OP's, alike, by the worker)."""
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard

    def gathered(module: nn.Module, **kwargs: object) -> object:
        return original(module, **{**kwargs, "reshard_after_forward": False})

    monkeypatch.setattr(fsdp, "fully_shard", gathered)
    _caught(MLP(width=32, depth=16), 2, monkeypatch)


@simulation
@MAIN_TORCH_ONLY
def test_a_what_if_plan_with_workers_is_the_plan_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """`autoshard.plan` with a worker (whoever makes each step first) and without one."""
    plans = []
    for count in ("0", "1"):
        monkeypatch.setenv(WORKERS, count)
        model, optimizer, batch, _ = _deep_mlp()
        plans.append(
            autoshard.plan(
                model, optimizer, batch, world_size=4, device_memory="1GiB", mixed_precision="no"
            )
        )
    assert plans[0].candidates == plans[1].candidates
    assert plans[0].chosen == plans[1].chosen


@simulation
def test_no_worker_starts_where_the_cache_has_every_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AUTOSHARD_CACHE", "1")
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(WORKERS, "1")
    model, optimizer, batch, names = _gpt()
    stats = model_stats(model, [model.get_submodule(n) for n in names], 0, "", 0)
    setup = Setup(names, batch, None, optimizer, None, CPU)
    simulate_all(model, setup, STRATEGIES, stats, 2)  # kept in the cache
    with workers(model, setup, 2, len(STRATEGIES)) as helpers:
        assert helpers is not None
        _, note = simulate_all(model, setup, STRATEGIES, stats, 2, workers=helpers)
        assert helpers.size == 0
    assert "3 read from autoshard's cache" in note and "worker process" not in note, note
