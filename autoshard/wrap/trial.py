"""The trial step: one real training step with the chosen wrapping; on an OOM on any rank, every
rank moves to the same more frugal rung; afterwards everything is put back.

What the step changes is snapshotted first and restored after (`wrap.snapshot`), so training after
`prepare` starts from exactly what the caller passed in, down to the attributes the model's forward
keeps on its modules (a step counter, a cache). What the forward's hooks record outside the model
(a list a user's hook appends to) is not the model's and is not put back.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.distributed import DistBackendError

from autoshard._batch import batch_to, call_model, compute_loss
from autoshard._torch_compat import (
    clear_cublas_workspaces,
    compiled_runs_eagerly,
    fsdp_reset_iter_state,
)
from autoshard._units import human
from autoshard.collective import (
    ERROR,
    FINE,
    OOM,
    Agreement,
    PeerFailed,
    exchange,
    settle,
)
from autoshard.decide.job import Decision, Work
from autoshard.decide.plan import Attempt, Candidate, Outcome
from autoshard.strategies.recipes import Engine, recipe
from autoshard.strategies.strategy import Strategy
from autoshard.wrap.apply import Wrapping, apply, ddp, gradient_sync
from autoshard.wrap.branches import PlainBranches
from autoshard.wrap.meter import (
    LiveBytes,
    caller_peak_kept,
    held_bytes,
    held_tensors,
    memory_cap,
)
from autoshard.wrap.snapshot import attributes_kept, restore, take_snapshot
from autoshard.wrap.sync import ddp_sync_points, fsdp_sync_points

MAX_ATTEMPTS = 4
# What a rung whose step died of OOM is assumed to have needed, relative to the usable memory.
ABORTED_OVERSHOOT = 1.25


def is_oom(error: BaseException) -> bool:
    """Out of memory, by type: CUDA's OutOfMemoryError, or by message a RuntimeError from the
    CPU allocator (c10's DefaultCPUAllocator raises a plain one) or a CUDA library that could
    not allocate its own memory outside torch's allocator (`CUBLAS_STATUS_ALLOC_FAILED` when a
    handle is created, cuDNN's, cuSOLVER's, cuFFT's: a step at the edge of the memory fails
    there as often as in torch's allocator). Not NCCL's: its communicator is unusable after
    one (a `DistBackendError`, re-raised)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError) or isinstance(error, DistBackendError):
        return False
    message = str(error)
    return "can't allocate memory" in message or any(m in message for m in _LIBRARY_OOM)


# How the CUDA libraries say they could not allocate (cublas, cudnn, cusolver, cusparse: the
# `*_STATUS_ALLOC_FAILED` statuses; cufft: `CUFFT_ALLOC_FAILED`), and CUDA where one allocated
# with `cudaMalloc` itself (torch's `AcceleratorError`, a RuntimeError)
_LIBRARY_OOM = ("_STATUS_ALLOC_FAILED", "CUFFT_ALLOC_FAILED", "CUDA error: out of memory")


def run_step(
    model: nn.Module,
    work: Work,
    scaler: Any,
    agreement: Agreement | None = None,
    kept: list[Any] | None = None,
) -> float:
    """Forward and backward on `accumulation_steps` micro-batches (gradient sync off on all but
    the last), optimizer step, gradients cleared: one step as a training loop runs it
    (`outputs = model(**batch); outputs.loss.backward()`), holding each micro-batch's output
    through its backward and until the next one's forward has returned it, the last one's
    through the optimizer step. With `kept` (a list of one item, the previous step's output or
    None), the last output is left there, alive through the next step's forward as a loop
    keeps it; else let go."""
    optimizer, batch, loss_fn = work.optimizer, work.batch, work.loss_fn
    accumulation_steps = work.request.accumulation_steps
    held: list[Any] = kept if kept is not None else [None]
    for micro in range(accumulation_steps):
        with gradient_sync(model, on=micro == accumulation_steps - 1):
            held[0] = call_model(model, batch)  # the previous output let go once it returns
            loss = compute_loss(held[0], batch, loss_fn)
            value = float(loss.detach())
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
    if agreement is not None:
        agreement.check()  # backward done everywhere before any optimizer collective
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if kept is None:
        held[0] = None
    return value


@dataclass
class Agreed:
    """How one attempt ended, as every rank agreed on it."""

    codes: list[int]  # every rank's code: FINE, OOM or ERROR
    peak: int | None  # the largest measured per-rank peak any rank reported
    error: Exception | None  # what this rank itself raised first (None if a peer failed first)
    seconds: float
    losses: list[float]  # this rank's loss at each step it completed


@contextlib.contextmanager
def _sync_points(wrapping: Wrapping, agreement: Agreement) -> Iterator[None]:
    engine = recipe(wrapping.strategy).engine if wrapping.strategy is not None else Engine.NONE
    if engine is Engine.FSDP2:
        with fsdp_sync_points(wrapping.module, agreement) as supported:
            note = (
                "this torch's FSDP2 has no pluggable comms: ranks agree only before the "
                "optimizer step and after the trial step"
            )
            if not supported and note not in wrapping.notes:
                wrapping.notes.append(note)
            yield
    elif wrapping.ddp is not None:
        handle = ddp_sync_points(wrapping.ddp, agreement)
        try:
            yield
        finally:
            handle.remove()
    else:
        yield


@contextlib.contextmanager
def _peak_meter(
    wrapping: Wrapping, optimizer: torch.optim.Optimizer, batch: Any, box: list[int | None]
) -> Iterator[Callable[[], None]]:
    """Measure the step's peak: the CUDA allocator's, or on CPU the live tensor bytes
    (`meter.LiveBytes`: it follows FSDP2's storage resizes; C++-side buffers are invisible)."""
    device = wrapping.world.device
    if device.type == "cuda":
        # Only what this training holds counts: other tensors of the process (a teacher model, a
        # cached dataset) were already missing from the free memory the plan was fitted to.
        unrelated = torch.cuda.memory_allocated(device) - held_bytes(
            wrapping.module, optimizer, device, batch
        )
        torch.cuda.reset_peak_memory_stats(device)  # the caller's peak: `caller_peak_kept`
        try:
            yield lambda: None
        finally:
            box[0] = torch.cuda.max_memory_allocated(device) - max(unrelated, 0)
        return
    meter = LiveBytes(held_tensors(wrapping.module, optimizer), batch)
    try:
        # above the meter, whose mode would make backward formulas copy as for a subclass; a
        # compiled model eagerly, as under the meter's mode it would run anyway, without dynamo
        # refusing its code for the training after (`compiled_runs_eagerly`)
        with compiled_runs_eagerly(), meter, PlainBranches():
            yield lambda: None
    finally:
        box[0] = meter.peak


def attempt(wrapping: Wrapping, work: Work, usable: int) -> Agreed:
    """The trial under sync points (two steps); every rank leaves with the same codes."""
    optimizer, limit = work.optimizer, work.request.memory_limit
    agreement = Agreement(wrapping.world)
    error: Exception | None = None
    box: list[int | None] = [None]
    losses: list[float] = []
    # Two steps, as a loop's later ones run: a fresh optimizer creates its state in the first,
    # and only the second runs forward and backward next to it; and the second's forward runs
    # beside the first one's output, which a loop holds until the model returns the next (an
    # optimizer with its state already made needs the second for that alone).
    steps = 2
    started = time.perf_counter()
    # The caller's peak statistics are given back after the cap is lifted (the block restoring
    # them may be larger than the cap).
    peak_kept = caller_peak_kept(wrapping.world.device)
    _workspaces_freed(wrapping.world.device)
    held = held_bytes(wrapping.module, optimizer, wrapping.world.device, work.batch)
    cap = memory_cap(wrapping.world.device, limit, held)
    with peak_kept, _sync_points(wrapping, agreement), cap:
        with _peak_meter(wrapping, optimizer, work.batch, box) as between_steps:
            # the first step's output alive through the second's forward, as a loop keeps it
            previous: list[Any] = [None]
            try:
                for index in range(steps):
                    if index:
                        between_steps()
                    losses.append(
                        run_step(wrapping.model, work, wrapping.scaler, agreement, previous)
                    )
            except PeerFailed:
                pass
            except Exception as caught:  # classified below, outside the except block
                error = caught
            previous.clear()
    seconds = time.perf_counter() - started
    learned = agreement.rows is not None  # a peer failed first: our own exception followed it
    code = FINE
    if error is not None and not learned:
        code = OOM if is_oom(error) else ERROR
    elif error is None and not learned and box[0] is not None and box[0] > usable:
        code = OOM  # CPU: the tracked peak exceeded the usable memory
    # Keep only an error to re-raise: an OOM's traceback holds the step's frames, and with them
    # its activations and (under DDP) the reducer, which must be freed before the next rung, and
    # before the restore where the sync below raises (a peer that never came).
    kept = error if code == ERROR else None
    del error
    rows = agreement.sync(code, box[0] or 0)  # this rank's last sync point of the step
    peak = max(p for _, p in rows) or None
    return Agreed([c for c, _ in rows], peak, kept, seconds, losses)


def _workspaces_freed(device: torch.device) -> None:
    """Free cuBLAS's workspaces before a CUDA trial step, so that the step allocates them again
    where its cap and meter count them as the training's: the estimate counts them (its `wksp`
    term), and whatever ran matmuls before the trial (the calibration at `prepare`, after the
    workspace probe had freed them; or the caller) left them allocated as memory unrelated to the
    training. On an H200 the demo's trial measured 33.68 MiB against 100.06 MiB estimated, the
    65 MiB of workspaces missing from the measurement; the cap would have let the step exceed a
    memory_limit by as much."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # no kernel may still be using one
        clear_cublas_workspaces()


def _clean_up(wrapping: Wrapping, optimizer: torch.optim.Optimizer, failed: bool) -> str | None:
    """Free what an aborted step left behind, outside any except block (a live traceback would
    keep the step's tensors alive). Returns why training cannot go on in place, if it cannot."""
    optimizer.zero_grad(set_to_none=True)
    problem = None
    if failed and wrapping.strategy is not None and recipe(wrapping.strategy).sharded:
        # FSDP2's state after an aborted step cannot be trusted unless reset (it crashed or hung)
        if not fsdp_reset_iter_state(wrapping.module):
            problem = (
                f"the trial step ran out of memory under {wrapping.strategy}, and this torch "
                f"({torch.__version__}) has neither FSDPModule.reset_iter_state nor the FSDP2 "
                f"fields autoshard resets in its place (torch 2.11, 2.12) to recover FSDP2 from "
                f"it; use torch 2.11 to 2.15, or choose a memory_limit/strategy that fits "
                f"(plan() shows the estimates)"
            )
    if failed and wrapping.ddp is not None:
        # The reducer of an aborted backward expects that backward to finish: drop it; the next
        # rung builds a fresh one if it is DDP again (apply), none if it shards.
        wrapping.ddp = None
    gc.collect()
    if wrapping.world.device.type == "cuda":
        torch.cuda.empty_cache()
    return problem


def reachable(failed: Strategy, to: Strategy) -> bool:
    """Whether the trial can move from `failed` to `to` in place (`apply.apply`), as the failed
    strategy's recipe says (`Recipe.falls_back_to`)."""
    return recipe(failed).can_fall_back_to(to)


def next_rung(
    options: list[Candidate],
    failed: Candidate,
    tried: set[tuple[str, int]],
    usable: int,
    peak: int | None,
) -> Candidate | None:
    """The next rung after `failed` ran out of memory, the same on every rank.

    Reachable rungs are further up the ladder by construction (at least as sharded, at least as
    many blocks checkpointed, not tried yet), whatever their estimates say: the estimate just
    proved wrong. Every estimate is scaled by how far the failed one fell short of what the
    rung really needed, and the fastest rung that then fits is next; if none does, the most
    frugal rung left. What it needed is its measured peak when the step completed over the
    limit (CPU); when an OOM aborted the step it is unknown beyond "more than usable", and a
    25% overshoot is assumed, so that each attempt moves by a real step rather than by one
    checkpointed block at a time.
    """
    needed = peak if peak is not None and peak > usable else ABORTED_OVERSHOOT * usable
    shortfall = max(1.0, needed / max(failed.estimated_peak_bytes, 1))
    rungs = [
        c
        for c in options
        if reachable(failed.strategy, c.strategy)
        and c.activation_checkpointing >= failed.activation_checkpointing
        and (c.strategy.value, c.activation_checkpointing) not in tried
    ]
    fitting = [c for c in rungs if c.estimated_peak_bytes * shortfall + c.reserve_bytes < usable]
    if fitting:
        return min(fitting, key=lambda c: c.step_seconds)
    return min(
        rungs,
        key=lambda c: (
            c.estimated_peak_bytes,
            -recipe(c.strategy).frugality,
            -c.activation_checkpointing,
        ),
        default=None,
    )


@dataclass(frozen=True)
class TrialResult:
    """Where the trial ended: the rung kept, every attempt, and the measured peak."""

    chosen: Candidate
    attempts: tuple[Attempt, ...]
    measured_peak: int | None
    notes: tuple[str, ...]


def prove(wrapping: Wrapping, decision: Decision, work: Work) -> TrialResult:
    """Apply the decision's first rung; with a trial step, train one step, fall back together on
    OOM, restore."""
    optimizer, first, options = work.optimizer, decision.first, list(decision.rungs)
    usable = decision.plan.device_memory_bytes
    apply(wrapping, optimizer, first.strategy, first.activation_checkpointing)
    if not work.trial_step or work.batch is None:
        why = (
            "trial step off (trial_step=False)"
            if not work.trial_step
            else "no example_batch: no trial step"
        )
        return TrialResult(first, (), None, (*wrapping.notes, why))
    work = replace(work, batch=batch_to(work.batch, wrapping.world.device))
    current, attempts, tried = first, [], set()
    while True:
        snapshot = take_snapshot(wrapping.module, optimizer, wrapping.world.device)
        try:
            with attributes_kept(wrapping.module, engines_run=True):  # a counter its forward keeps
                outcome = attempt(wrapping, work, usable)
        except BaseException:
            # The agreement itself failed (a peer died or stalled): this rank still goes back to
            # what the caller passed in before raising.
            _clean_up(wrapping, optimizer, True)
            restore(snapshot, wrapping.module, optimizer, wrapping.world.device)
            raise
        failed = any(outcome.codes)
        problem = _clean_up(wrapping, optimizer, failed)
        restore(snapshot, wrapping.module, optimizer, wrapping.world.device)
        del snapshot
        if ERROR in outcome.codes:
            _raise_error(outcome, wrapping)
        label = (current.strategy, current.activation_checkpointing)
        if not failed:
            attempts.append(Attempt(*label, Outcome.FIT, outcome.peak, outcome.seconds))
            _note_non_finite(wrapping, outcome.losses)
            _drop_trial_hooks(wrapping)
            return TrialResult(current, tuple(attempts), outcome.peak, tuple(wrapping.notes))
        if problem is not None:  # the same on every rank: all raise it
            raise RuntimeError(problem)
        ranks = tuple(r for r, c in enumerate(outcome.codes) if c == OOM)
        attempts.append(Attempt(*label, Outcome.OUT_OF_MEMORY, outcome.peak, None, ranks))
        tried.add((current.strategy.value, current.activation_checkpointing))
        following = None
        if len(attempts) < MAX_ATTEMPTS:
            following = next_rung(options, current, tried, usable, outcome.peak)
        if following is None:
            raise _exhausted(attempts, current, usable, decision.unshardable)
        apply(wrapping, optimizer, following.strategy, following.activation_checkpointing)
        current = following


def _drop_trial_hooks(wrapping: Wrapping) -> None:
    """DDP comm hooks cannot be removed: re-create the wrapper (it broadcasts rank 0's
    parameters, identical on every rank after the restore). A fresh scaler too."""
    if wrapping.ddp is not None:
        wrapping.ddp = None
        gc.collect()  # the old reducer must be gone before a new one hooks the same parameters
        wrapping.ddp = ddp(wrapping)
    from autoshard.wrap.apply import grad_scaler

    wrapping.scaler = grad_scaler(wrapping)


def _raise_error(outcome: Agreed, wrapping: Wrapping) -> None:
    """A non-OOM failure: re-raised, unchanged, where it happened; elsewhere the same type (or a
    PeerError) naming the rank that failed and its message (`collective.settle`)."""
    settle(wrapping.world, "prepare()'s trial step", outcome.error)
    rank = outcome.codes.index(ERROR)  # settle raised unless that rank's error was lost
    raise RuntimeError(f"rank {rank} failed during prepare()'s trial step; see its traceback")


def _note_non_finite(wrapping: Wrapping, losses: list[float]) -> None:
    """A loss that is nan or inf trains nothing: say so in the plan's reasons and warn."""
    bad = [not math.isfinite(v) for v in losses]
    flags = exchange(wrapping.world, "prepare()'s trial step", any(bad))
    ranks = [r for r, flag in enumerate(flags) if flag]
    if not ranks:
        return
    note = (
        f"the trial step's loss was not finite (nan or inf) on rank(s) {ranks}: the model, its "
        f"initialisation, the learning rate or the batch produce "
        f"nan/inf, and training would not learn; check the loss of one plain step"
    )
    wrapping.notes.append(note)
    warnings.warn(note, RuntimeWarning, stacklevel=4)


def _exhausted(
    attempts: list[Attempt], last: Candidate, usable: int, unshardable: str | None
) -> Exception:
    from autoshard.decide.fit import DoesNotFit, more_ranks

    tried = "; ".join(map(str, attempts))
    activations = last.footprint.activations / max(last.estimated_peak_bytes, 1)
    return DoesNotFit(
        f"the trial step ran out of memory on every rung it could try ({tried}). The last, "
        f"{last.strategy} with {last.activation_checkpointing} block(s) checkpointed, was "
        f"estimated at {human(last.estimated_peak_bytes)} per rank against {human(usable)} "
        f"usable. Activations were {activations:.0%} of that estimate (a smaller per-rank batch "
        f"shrinks them); {more_ranks(unshardable)}; or raise memory_limit if it is set below "
        f"what the device has.",
        missing_bytes=None,
    )
