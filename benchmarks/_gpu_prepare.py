"""GPU suite, what `prepare` costs before training starts (`gpu_suite.py` section "prepare").

The first GPU run's `prepare()` took 7 to 44 s before the first step (issue 24's target: "on a
GPU `prepare()` of each external family within 5 s plus its trial step"), and its plan's
modelled step was 3 to 10 times below the measured one (issue 26). Nothing but a GPU host
measures either: `benchmarks/prepare_cost.py` times the decision's fake steps on a CPU, without
the device's calibration, the cuBLAS probe, simulation workers on many cores or the trial.

Each of the suite's models (`_gpu_models`, most telling first: the section's budget skips what it
cannot hold) is prepared as a `torchrun --nproc-per-node 1` user's script prepares it: one rank
of a one-rank process group (NCCL; gloo on the CPU dry run), the model on the device, AdamW with
its defaults, `autoshard.prepare(model, optimizer, batch, loss_fn=...)` with every option left
to autoshard and its trial step. As a first launch: autoshard's cache on (its default) in an
empty directory, and the device's and the host's measured figures forgotten before each model;
but in a process where torch, CUDA and NCCL have started already (their start is not
autoshard's). A restart reading the cache is measured on the CPU (`planner.py --warm`).

Per model: the whole of `prepare`, split into the decision (`pipeline.run`: checks, trace,
calibration, simulations, agreement), of it the trace and the simulations with the fake steps
made in this process (not those of simulation workers), then the wrapping (`wrap.apply.start`)
and the trial (`prove`: its steps, any fall-back, the state put back); the trial's own steps'
time (two steps with a fresh optimizer, the first of a model's life: lazy initialisations in
it); the plan chosen; and its modelled step (the cost model with the throughput `prepare`
measured), one step, beside them (the accuracy section compares it with steady steps).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from _gpu_accuracy import one_rank_group
from _gpu_models import build, models_for

import autoshard
import autoshard.api as api_module
from autoshard.decide.plan import Outcome
from autoshard.measure import device as device_module
from autoshard.measure import facts, fake, simulate, simulated, workspace
from autoshard.measure import host as host_module

# Issue 24: the decision within this, the trial step on top
DECISION_TARGET_S = 5.0
# In the order they run, most telling first: the first GPU run's slowest (BART-large-shaped 44 s,
# 0.4-1.4B decoders 15-30 s, Swin-B-shaped 36 s), then the other families
ORDER = (
    "llama_1b",
    "enc_dec",
    "qwen_gqa",
    "vit_large",
    "moe",
    "big_vocab",
    "lora",
    "gpt2_medium",
    "resnet",
)
# The dry run (CPU, tiny sizes): one decoder and the encoder-decoder, every code path
DRY_ORDER = ("llama_1b", "enc_dec")


def run(
    device: torch.device,
    dry_run: bool,
    deadline: float,
    progress: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Each model's row, as many as `deadline` (time.time()) holds; `progress` gets the result
    so far after each."""
    models = models_for(dry_run)
    entries = [
        ({"model": name}, functools.partial(measure, name, models, device))
        for name in (DRY_ORDER if dry_run else ORDER)
    ]
    return rows_within(entries, device, deadline, progress, _result)


Row = dict[str, Any]


def rows_within(
    entries: list[tuple[Row, Callable[[], Row]]],
    device: torch.device,
    deadline: float,
    progress: Callable[[Row], None],
    result: Callable[[list[Row], list[str]], Row],
) -> Row:
    """Each entry's row (`measure()` in a one-rank group of its own), or its fields and why it
    failed, as many as `deadline` (time.time()) holds: the rest are listed as skipped.
    `progress` gets `result(rows, skipped)` so far after each row; the last is returned."""
    rows: list[Row] = []
    skipped: list[str] = []
    longest = 0.0  # the longest row so far: the next may take as long
    for fields, measure_one in entries:
        if time.time() + longest > deadline:
            what = " ".join(str(value) for value in fields.values())
            skipped.append(f"{what}: the section's time budget would be exceeded")
            continue
        started = time.time()
        try:
            with one_rank_group(device):
                rows.append(measure_one())
        except Exception as error:  # recorded; the next row still runs
            rows.append({**fields, "failed": f"{type(error).__name__}: {error}"[:1000]})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        longest = max(longest, time.time() - started)
        progress(result(rows, skipped))
    return result(rows, skipped)


def measure(name: str, models: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """`prepare` of a fresh copy of model `name` as a first launch, timed by phase (autoshard's
    cache on, in an empty directory); the copy freed after."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    built = build(name, models, device)
    timer = _Phases()
    prepared, total = timed_prepare(timer, built)
    plan = prepared.plan
    fit = next(a for a in plan.attempts if a.outcome == Outcome.FIT)
    decision = timer.seconds["decision"]
    row = {
        "model": name,
        "params": sum(p.numel() for p in built.model.parameters()),
        "strategy": plan.strategy.value,
        "checkpointed": plan.activation_checkpointing,
        "num_blocks": plan.num_blocks,
        "mixed_precision": plan.mixed_precision.value,
        "attempts": [str(a) for a in plan.attempts],
        "fake_steps": timer.fake_steps,
        "modelled_step_s": plan.chosen.step_seconds,
        "trial_steps_s": fit.seconds,  # its two steps (a fresh optimizer)
        "cost_model": _cost_model(plan.reasons),
        "prepare_s": total,
        **{f"{phase}_s": value for phase, value in timer.seconds.items()},
        "decision_within_target": decision <= DECISION_TARGET_S,
    }
    del prepared, built, plan
    return row


def timed_prepare(
    timer: _Phases, built: Any, *, first_launch: bool = True, **options: Any
) -> tuple[Any, float]:
    """`autoshard.prepare(...)` of `built` (a `zoo.ZooModel`) with `options`, its phases timed
    into `timer`; returns what it prepared and its wall seconds. As a first launch: autoshard's
    cache on in an empty directory, and what a process measures once and keeps (the device's and
    the host's figures, kernels' workspaces) measured again. Otherwise (`first_launch=False`) the
    cache off and the process's figures kept: the plan made again, but not the calibration."""
    env = {"AUTOSHARD_CACHE": "0"}
    with tempfile.TemporaryDirectory() as kept:
        if first_launch:
            device_module._cache.clear()
            host_module._cache.clear()
            workspace._measured.clear()
            fake._rnn_workspaces.clear()
            env = {"AUTOSHARD_CACHE": "1", "AUTOSHARD_CACHE_DIR": kept}
        with mock.patch.dict(os.environ, env), timer.patched():
            started = time.perf_counter()
            prepared = autoshard.prepare(
                built.model, built.optimizer, built.batch, loss_fn=built.loss_fn, **options
            )
            return prepared, time.perf_counter() - started


def _cost_model(reasons: tuple[str, ...]) -> str | None:
    """Where the plan's step times came from, as its reason for the choice says: "(step times
    modelled from X)", X the device's measured throughput or the constants."""
    marker = "times modelled from "
    for reason in reasons:
        if marker in reason:
            text, depth = reason.split(marker, 1)[1], 0
            for i, char in enumerate(text):
                depth += {"(": 1, ")": -1}.get(char, 0)
                if depth < 0:  # the parenthesis the marker opened closes
                    return text[:i]
            return text
    return None


class _Phases:
    """Wall seconds in each phase of `prepare` and the fake steps it made, by wrapping the
    functions that do them for the duration (`patched`)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(("decision", "trace", "simulations", "wrap", "trial"), 0.0)
        self.fake_steps = 0

    def timed(self, original: Callable[..., Any], phase: str | None) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.fake_steps += phase is None or phase == "trace"
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if phase is not None:
                    self.seconds[phase] += time.perf_counter() - started

        return wrapper

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for owner, name, phase in (
                (api_module, "run", "decision"),
                (api_module, "start", "wrap"),
                (api_module, "prove", "trial"),
                (facts, "_measure", "trace"),
                (simulated, "simulate_all", "simulations"),
                (simulate, "_run", None),  # a simulated run in this process (workers: not seen)
            ):
                wrapper = self.timed(getattr(owner, name), phase)
                stack.enter_context(mock.patch.object(owner, name, wrapper))
            yield


def _result(rows: list[Row], skipped: list[str]) -> Row:
    done = [r for r in rows if "failed" not in r]
    return {
        "rows": rows,
        "skipped": skipped,
        "target_s": DECISION_TARGET_S,
        "summary": {"models": len(done), "failed": len(rows) - len(done), **decisions(done)},
    }


def decisions(rows: list[Row]) -> Row:
    """The median and the slowest decision of `rows` (measured ones), and how many were within
    the target."""
    seconds = [r["decision_s"] for r in rows]
    return {
        "median_decision_s": statistics.median(seconds) if seconds else None,
        "slowest_decision_s": max(seconds, default=None),
        "within_target": sum(r["decision_within_target"] for r in rows),
    }
