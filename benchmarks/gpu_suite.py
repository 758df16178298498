"""The GPU proof in one command: autoshard's CUDA paths, its estimates against the caching
allocator, a real out-of-memory and its fallback, the cost model's constants against measured
throughput, and which private torch features this torch has.

    python benchmarks/gpu_suite.py --out DIR            # one CUDA GPU, at most 9.5 minutes
    python benchmarks/gpu_suite.py --out DIR --dry-run  # CPU, small sizes: the same code paths

Writes DIR/report.md and DIR/report.json. Sections, in order, each with its own time budget and
a hard stop (a section past its budget is killed and recorded; the next one still runs):

- tests: `pytest -m gpu tests/test_gpu.py` (on the dry run they skip: no CUDA);
- compat: every torch feature autoshard checks for at run time, present or absent, and what
  falls back without it (`_gpu_compat.FEATURES`);
- calibration: bf16 matmul FLOP/s and memory bandwidth measured beside `hardware_for`'s
  constants; a figure off by more than 20% is taken from the measurement (`Throughput`);
- accuracy: the estimate of each strategy against `torch.cuda.max_memory_allocated` on
  GPU-sized models, at world size 1 (one-rank NCCL group) and 8 (fake group: allocations real,
  collectives free); reserved peak against the usable memory; modelled against measured step
  time (`_gpu_accuracy.py`);
- oom: a real CUDA OOM under `memory_limit`, the fallback, and the caller's memory fraction and
  peak statistics afterwards (`_gpu_checks.oom_fallback`);
- prepare: `autoshard.prepare` under auto, as a first launch of a one-GPU torchrun job, timed by
  phase per model (decision, trace, simulations, wrapping, trial) against issue 24's 5 s, with
  the plan's modelled step beside the trial's (`_gpu_prepare.py`); with the suite's budget
  spent it is not run; `--sections prepare --budget prepare=300` runs it alone, over every model
  (`--budget SECTION=SECONDS` sets any section's for one run).
- external: the external zoo's families (`zoo_external.py`, the held-out kind: transformers,
  peft, plain torch) prepared under auto as a first launch (timed, against the same 5 s), then
  forced to FULL_SHARD, DDP and checkpointed FULL_SHARD, each stepped and its estimate measured
  against the allocator (`_gpu_external.py`). Last, as it is the newest: its budget holds the
  first few families; `--sections external --budget external=540` runs it alone, over more.

The sections other than tests run in one worker process (`--worker`), which is started again
after a section that was killed or crashed it; the tests run first, while no other process of
the suite holds GPU memory. Nothing needs installing: this process and every one it starts
import autoshard and the benchmarks' modules from this checkout (`on_path`, `_env`), from
whatever directory it was started in.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# pytest and its dependencies as pure-Python wheels, for a GPU machine without pytest
WHEELS = HERE / "wheels"
# Seconds each section may run (GPU, dry run); their GPU sum is TOTAL_BUDGET_S, which the worker's
# start-up (importing torch) counts within, against the first section it runs. The total stays
# under the 10 minutes one command may hold a GPU machine for, with room for the report.
# Taken on one H100 (torch 2.11): tests 78 s, compat 5 s (the worker's start included),
# calibration 0.4 s, accuracy about 7 s a configuration, oom 11 s. On one H200 (torch 2.11,
# 2026-12-04): tests 96 s alone and past 110 s in the suite (the first test's set-up, CUDA's
# start and the model's build, 38 s), compat 6 s, accuracy 33 of the 52 configurations in 297 s
# (9 s each), oom 16 s, prepare 104 s for all 9 models (12 s each, the build included); the
# external section never ran on a GPU (2026-12-07: 60 s taken from accuracy's 320 for it). The
# sections run what their budgets hold, most telling first, and list the rest as skipped;
# `--sections accuracy --budget accuracy=570` (or prepare, external) runs one section alone.
BUDGETS = {
    "tests": (150, 120),
    "compat": (15, 60),
    "calibration": (10, 60),
    "accuracy": (260, 180),
    "oom": (20, 90),
    "prepare": (55, 120),
    "external": (60, 150),
}
TOTAL_BUDGET_S = 570
ORDER = tuple(BUDGETS)
WORKER_SECTIONS = ORDER[1:]


# ---------------------------------------------------------------------------------------------
# The parent: runs the tests, supervises the worker, writes the report


def run_tests(out: Path, budget: float) -> dict[str, Any]:
    """`pytest -m gpu tests/test_gpu.py`: each test's outcome from its JUnit XML, or, when pytest
    was stopped at the budget before writing it, from the verbose log so far."""
    xml, log = out / "tests.xml", out / "tests.log"
    command = [
        sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-v", "-rA",
        "-p", "no:cacheprovider", f"--junitxml={xml}", "-o", "junit_logging=all",
    ]  # fmt: skip
    extra, source = pytest_path(out)
    completed = _run(command, budget, log, extra)
    from _gpu_report import junit_cases, log_cases

    cases = junit_cases(xml) if xml.exists() else log_cases(log)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    result = {
        "returncode": completed,
        "counts": counts,
        "cases": cases,
        "command": " ".join(command),
        "pytest": source,
    }
    if completed is None:
        return {"status": "timed out", "error": f"pytest stopped at its {budget:.0f}s budget; "
                f"the tests that finished before are listed", "result": result}  # fmt: skip
    if completed != 0:
        return {"status": "failed", "error": f"pytest exited with {completed}", "result": result}
    return {"status": "ok", "result": result}


def pytest_path(out: Path) -> tuple[list[str], str]:
    """Where pytest comes from: this Python's own, else the wheels that travel with the project
    (`benchmarks/wheels`, pure Python), unpacked into DIR/_pytest and put on the path."""
    if importlib.util.find_spec("pytest") is not None:
        return [], "this Python's"
    target = unpack_wheels(out / "_pytest")
    return [str(target)], f"unpacked from {WHEELS.relative_to(REPO)} into {target}"


def unpack_wheels(target: Path) -> Path:
    """A pure-Python wheel is a zip of its packages and metadata: unpacked, it imports as
    installed (entry points included), with no pip needed."""
    for wheel in sorted(WHEELS.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    return target


def _run(command: list[str], budget: float, log: Path, extra: list[str]) -> int | None:
    """Run `command` in its own process group; None if it was killed at `budget` seconds."""
    process = _start(command, log, extra)
    try:
        return process.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        _kill(process)
        return None


def _start(
    command: list[str], log: Path, extra: tuple[str, ...] | list[str] = ()
) -> subprocess.Popen[Any]:
    """`command` in the repository, in a process group of its own, its output appended to `log`."""
    with log.open("a") as sink:
        return subprocess.Popen(
            command,
            cwd=REPO,
            env=_env(extra),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _env(extra: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """This environment with the repository (and `extra`) first on PYTHONPATH."""
    paths = [str(REPO), *extra, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _kill(process: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the group this suite started for it
    except ProcessLookupError:
        pass
    process.wait()


def supervise(
    out: Path, dry_run: bool, sections: list[str], started: float, budgets: tuple[str, ...] = ()
) -> None:
    """Run `sections` in worker processes (each told the `--budget`s given); kill one at a
    section's hard stop and go on."""
    state = out / "sections"
    pending = list(sections)
    while pending:
        if not _within_total(pending[0], dry_run, started, state):
            return
        command = [sys.executable, __file__, "--worker", "--out", str(out), "--sections"]
        command.append(",".join(pending))
        command += ["--dry-run"] if dry_run else []
        command += [arg for given in budgets for arg in ("--budget", given)]
        worker = _start(command, out / "worker.log")
        pending = _watch(worker, pending, state, dry_run, time.time())


def _within_total(section: str, dry_run: bool, started: float, state: Path) -> bool:
    if dry_run or time.time() - started + BUDGETS[section][0] <= TOTAL_BUDGET_S:
        return True
    for name in ORDER[ORDER.index(section) :]:
        if not (state / f"{name}.json").exists():
            why = f"the suite's {TOTAL_BUDGET_S}s budget would be exceeded"
            _record(state, name, "not run", error=why)
    return False


def _watch(
    worker: subprocess.Popen[Any], pending: list[str], state: Path, dry_run: bool, launched: float
) -> list[str]:
    """Wait for the worker; returns the sections still to run (after a kill or a crash)."""
    while True:
        exited = worker.poll() is not None  # read before the results, which it wrote first
        current = next((s for s in pending if not (state / f"{s}.json").exists()), None)
        if current is None:
            worker.wait()
            return []
        began = _started_at(state, current) or launched
        budget = BUDGETS[current][1 if dry_run else 0]
        if exited:  # without finishing `current`: it crashed there
            why = f"the worker exited with {worker.returncode} during this section"
            _record(state, current, "crashed", error=f"{why} (see worker.log)", began=began)
            return pending[pending.index(current) + 1 :]
        if time.time() - began > budget:
            _kill(worker)
            if not (state / f"{current}.json").exists():  # it may have finished meanwhile
                why = f"stopped at its {budget}s budget (see worker.log)"
                _record(state, current, "timed out", error=why, began=began)
            return pending[pending.index(current) + 1 :]
        time.sleep(0.2)


def _started_at(state: Path, section: str) -> float | None:
    try:
        return float((state / f"{section}.started").read_text())
    except (OSError, ValueError):  # not there yet (a suite from before _write: maybe empty)
        return None


def _write(path: Path, text: str) -> None:
    """Write `text` whole or not at all, as the supervisor and the worker read each other's files
    while they run (a marker read between its creation and its write was empty: the dry run
    failed on it, torch 2.13, 2 busy cores)."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def _record(state: Path, name: str, status: str, *, error: str, began: float | None = None) -> None:
    entry: dict[str, Any] = {"status": status, "error": error}
    if began is not None:
        entry["seconds"] = round(time.time() - began, 1)
    partial = state / f"{name}.partial.json"
    if partial.exists():  # what the section finished before it was stopped
        entry["result"] = json.loads(partial.read_text())
    _write(state / f"{name}.json", json.dumps(entry, indent=1))


# ---------------------------------------------------------------------------------------------
# The worker: one section after another, each result written as it finishes


def worker(out: Path, dry_run: bool, sections: list[str]) -> None:
    import _gpu_accuracy
    import _gpu_checks
    import _gpu_compat
    import torch

    state = out / "sections"
    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    _write(state / "machine.json", json.dumps(_worker_machine(torch, cuda)))

    def calibration() -> Any:
        return _gpu_checks.calibrate(device, dry_run)

    def accuracy() -> Any:
        from autoshard.decide.hardware import Throughput

        budget = BUDGETS["accuracy"][1 if dry_run else 0]
        deadline = time.time() + budget - 10  # leave time to write what finished
        calibrated = _result(state, "calibration")
        throughput = Throughput(**calibrated["throughput"]) if calibrated else None

        def progress(result: Any) -> None:
            _write(state / "accuracy.partial.json", json.dumps(result, indent=1))

        return _gpu_accuracy.run(device, dry_run, deadline, throughput, progress)

    def oom() -> Any:
        size = _gpu_checks.DRY_SIZE if dry_run else _gpu_checks.GPU_SIZE
        return _gpu_checks.oom_fallback(device, size)

    def prepare() -> Any:
        import _gpu_prepare

        deadline = time.time() + BUDGETS["prepare"][1 if dry_run else 0] - 5

        def progress(result: Any) -> None:
            _write(state / "prepare.partial.json", json.dumps(result, indent=1))

        return _gpu_prepare.run(device, dry_run, deadline, progress)

    def external() -> Any:
        import _gpu_external

        deadline = time.time() + BUDGETS["external"][1 if dry_run else 0] - 5

        def progress(result: Any) -> None:
            _write(state / "external.partial.json", json.dumps(result, indent=1))

        return _gpu_external.run(device, dry_run, deadline, progress)

    bodies = {
        "compat": _gpu_compat.compat,
        "calibration": calibration,
        "accuracy": accuracy,
        "oom": oom,
        "prepare": prepare,
        "external": external,
    }
    for name in sections:
        if not dry_run and not cuda:
            body = _no_cuda
        else:
            body = bodies[name]
        run_section(state, name, body)


def _no_cuda() -> Any:
    raise RuntimeError("no CUDA device here: run with --dry-run on a CPU")


def run_section(state: Path, name: str, body: Any) -> None:
    """Run one section in the worker and record its result (or its error: the next section
    still runs). A default process group the section left behind is destroyed after it, as a
    script's exit would: under plain `python` on one GPU, `prepare` creates one where it offloads
    (the oom section's last rung does), and the prepare section, which makes its own, then failed
    with "trying to initialize the default process group twice!" for every model (on an H200)."""
    import torch.distributed as dist

    _write(state / f"{name}.started", repr(time.time()))
    began = time.time()
    had_group = dist.is_available() and dist.is_initialized()
    try:
        entry = {"status": "ok", "result": body()}
    except Exception as error:  # recorded; the next section still runs
        entry = {
            "status": "failed",
            "error": f"{type(error).__name__}: {error}"[:1000],
            "traceback": traceback.format_exc()[-4000:],
        }
    finally:
        if not had_group and dist.is_available() and dist.is_initialized():
            gc.collect()  # the section's wrapped models first: nothing may use the group after
            dist.destroy_process_group()
    entry["seconds"] = round(time.time() - began, 1)
    _write(state / f"{name}.json", json.dumps(entry, indent=1, default=str))


def _result(state: Path, name: str) -> Any:
    path = state / f"{name}.json"
    if not path.exists():
        return None
    entry = json.loads(path.read_text())
    return entry.get("result") if entry.get("status") == "ok" else None


# ---------------------------------------------------------------------------------------------
# Main


def machine(state: Path) -> dict[str, Any]:
    """The host, and the torch and GPU the worker saw (if it ran)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    seen = state / "machine.json"
    if seen.exists():
        info.update(json.loads(seen.read_text()))
    return info


def _worker_machine(torch: Any, cuda: bool) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": props.name if props else None,
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "gpu_memory_bytes": props.total_memory if props else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for report.md/report.json")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, small sizes")
    p.add_argument("--sections", default=",".join(ORDER), help=f"comma-separated, of {ORDER}")
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="SECTION=SECONDS",
        help="a section's time budget for this run (e.g. --sections prepare --budget prepare=300: "
        "every model of the prepare section); the suite's own limit still holds",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in args.sections if s not in ORDER]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(ORDER)}")
    for given in args.budget:
        name, _, seconds = given.partition("=")
        try:
            budget = float(seconds)
        except ValueError:
            budget = -1.0
        if name not in ORDER or not 0 < budget <= TOTAL_BUDGET_S:
            p.error(
                f"--budget {given!r}: SECTION=SECONDS with a section of {', '.join(ORDER)} and "
                f"0 < SECONDS <= {TOTAL_BUDGET_S}"
            )
        gpu, dry = BUDGETS[name]
        BUDGETS[name] = (gpu, budget) if args.dry_run else (budget, dry)
    return args


def on_path() -> None:
    """This checkout's autoshard and the benchmarks' modules importable here, installed or not
    (`python benchmarks/gpu_suite.py` puts only `benchmarks/` on the path)."""
    for path in (str(REPO), str(HERE)):
        if path not in sys.path:
            sys.path.insert(0, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_path()
    os.environ.setdefault("AUTOSHARD_CACHE", "0")  # every plan made cold, as in _bench.py
    out: Path = args.out.resolve()
    if args.worker:
        worker(out, args.dry_run, args.sections)
        return 0
    state = out / "sections"
    state.mkdir(parents=True, exist_ok=True)
    for stale in state.iterdir():  # a previous run's results must not be read as this one's
        stale.unlink()
    started = time.time()
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if "tests" in args.sections:
        began = time.time()
        try:
            entry = run_tests(out, BUDGETS["tests"][int(args.dry_run)])
        except Exception as error:  # recorded; the other sections still run
            entry = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
        entry["seconds"] = round(time.time() - began, 1)
        _write(state / "tests.json", json.dumps(entry, indent=1))
    worker_sections = [s for s in WORKER_SECTIONS if s in args.sections]
    supervise(out, args.dry_run, worker_sections, started, tuple(args.budget))
    from _gpu_report import write

    report = {
        "date": date,
        "dry_run": args.dry_run,
        "seconds": round(time.time() - started, 1),
        "machine": machine(state),
        "budgets_s": {s: BUDGETS[s][int(args.dry_run)] for s in args.sections},
        "sections": {
            s: json.loads((state / f"{s}.json").read_text())
            for s in args.sections
            if (state / f"{s}.json").exists()
        },
    }
    write(report, out)
    print(f"report written to {out / 'report.md'} and {out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
