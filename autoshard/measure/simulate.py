"""Per-candidate simulation: a training step of the real wrapping, on fake tensors, measured by
torch's own memory trackers (DESIGN.md section 3).

For each strategy the model is copied with fake parameters (`FakeTensorMode`: no real memory), the
copy is wrapped exactly as `wrap.apply` wraps the real one (FSDP2 `fully_shard` per block and root,
mixed-precision policy included) over a *fake* process group (its collectives do nothing), and a
step runs under `MemTracker` / `FSDPMemTracker`. The tracker's breakdown at two moments is kept:
the forward/backward peak and the optimizer step's peak, as in a steady step (with the optimizer
state alive: `measure.step`). Kernel workspace, which no tracker sees, is measured for real once per
distinct convolution call and held as a fake block during each (`measure.workspace`).

What is derived instead of simulated again:

- activation checkpointing: every block checkpointed is simulated (forward and backward only)
  where it matters; k < L checkpointed blocks are derived from it and from the unchecked run:
  what the two hold as the k-th block's forward begins differs by what checkpointing the first
  k frees (`step.Moments.starts`, `estimate.checkpointing_frees`), taken off the unchecked
  run's moments, the checkpointed blocks' own backward being the checkpointed run's; where
  that was not recorded (a block run twice), from what `ActivationProfile` says each block
  saves (`estimate.estimate`);
- depth: a model whose blocks repeat (`measure.layout`: 16 or more alike blocks, or lists of
  them, periods of unlike ones) is simulated with 3, 4 and 5 periods of every list and extended
  to its own number moment by moment (`step.Moments`: each block's forward and backward, the
  head's), each moment's bytes after each operator extended linearly (a sum over periods plus
  a constant) and the largest taken: the peak's moment moves with depth;
- sharding degree: sharded parameters, gradients and optimizer state are rescaled from the degree
  simulated to the one planned (`estimate.shard_ratio`), so a 1024-rank job is simulated on 8.

Where this machine's cores are idle, a run's depths after its first may be made by worker
processes (`measure.sharing`), once their own make of the first matched this process's to the
byte.

DDP is simulated unwrapped with every gradient allocated before the step and zeroed in place:
with `gradient_as_bucket_view=True` the gradients are views of DDP's buckets, which live from
construction on. The trackers see tensors only; C++-side buffers (gloo/NCCL) are not in it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard._batch import LossFn
from autoshard._torch_compat import sharding_propagation_untracked, tree_map
from autoshard.collective import exchange_in_group
from autoshard.decide.estimate import (
    ModelStats,
    Phase,
    Simulated,
    besides_grads,
    per_parameter_ratio,
    shard_bytes,
)
from autoshard.measure import cache
from autoshard.measure.crash import crash_of
from autoshard.measure.fake import (
    fake_copy,
    fake_mesh,
    fake_mode,
    fake_optimizer,
    fake_tensor,
    per_parameter_step,
    unavailable,
    wider_fake_kernels,
)
from autoshard.measure.layout import INTERIOR, SHALLOW, Layout, layout
from autoshard.measure.quiet import failed_run_unheard, own_runs_quiet
from autoshard.measure.step import (
    BlockStart,
    autograd_on,
    of_forward,
    peak_of,
    peaks,
    total,
    tracked_step,
)
from autoshard.measure.workspace import unmeasured_note
from autoshard.strategies.engines import shard_module
from autoshard.strategies.recipes import recipe
from autoshard.strategies.strategy import Strategy

if TYPE_CHECKING:
    from autoshard.measure.sharing import Shared

logger = logging.getLogger("autoshard")

# The largest sharding degree simulated directly; larger degrees are rescaled from it. Sharding
# each parameter into N fake chunks costs O(N) per parameter: a 7B model took 24 s at N=1024.
MAX_SIMULATED_DEGREE = 8
# Where 3, 4 and 5 periods are off one line, 4, 5 and 6 are tried before the whole model: at 3
# the FSDP2 windows of a list's two ends overlap (a GPT-shaped model under FULL_SHARD: the
# second-last block's backward ran 41 operators at 3 periods, 45 at 4 and 5).
_DEEPEST = 6
# How far the third depth may lie off the line through the first two (of its total).
_LINEARITY_TOLERANCE = 0.01


@dataclass(frozen=True)
class Setup:
    """What the simulation needs besides the model: the same for every strategy."""

    block_names: list[str]
    batch: Any
    loss_fn: LossFn | None
    optimizer: torch.optim.Optimizer
    dtype: torch.dtype | None  # mixed-precision compute dtype
    device: torch.device
    checkpoint_all: bool = False  # every block activation-checkpointed, as `wrap.apply` does it
    # the device the ranks train on, where kernel workspaces are measured (None: `device`)
    trains_on: torch.device | None = None
    # yes/no values the real step read back, by place (`ActivationProfile.answers`)
    answers: tuple[tuple[str, bool], ...] = ()
    # what the real step's `nonzero` found, by place (`ActivationProfile.nonzero_found`)
    nonzero_found: tuple[tuple[str, int, int], ...] = ()
    # the trace found blocks alike in all they hold running different operators
    # (`ActivationProfile.unlike_blocks`): the model is simulated whole
    unlike_blocks: bool = False


# A run's moments of forward and backward, its optimizer step's peak, and what checkpointing may
# free and keep as each block's forward begins (`step.Moments.starts`)
Steps = tuple[dict[str, list[Phase]], Phase, dict[str, BlockStart]]


def simulate(
    model: nn.Module,
    setup: Setup,
    strategy: Strategy,
    mesh: Any,
    done: Mapping[int | None, Steps | BaseException] | None = None,
) -> Simulated:
    """Two steps of `strategy` on a fake copy of `model`, depth-reduced where the blocks allow.
    `done` has the runs already made (`sharing.Shared.ahead`), by their number of periods (None:
    the whole model), or the exception one raised; the others are made here."""
    done = done or {}

    def run(repeats: Layout | None, periods: int | None) -> Steps:
        if periods in done:
            made = done[periods]
            if isinstance(made, BaseException):
                raise made
            return made
        if repeats is None or periods is None:
            return _run(model, setup, strategy, mesh)
        return _run(model, setup, strategy, mesh, repeats, periods)

    repeats = simulated_layout(model, setup)
    sharded = recipe(strategy).sharded
    degree = mesh.size() if sharded else 1
    trains_on = (setup.trains_on or setup.device).type
    loop = per_parameter_step(setup.optimizer, trains_on, sharded)
    if repeats is not None:
        try:
            found = _by_periods(run, strategy, repeats, setup.block_names)
        except Exception:  # noqa: BLE001 - a copy with fewer blocks may fail where the model runs
            logger.debug("%s: a shallow copy failed; simulating the whole model", strategy)
            found = None
        if found is not None:
            instants, step, forward, (starts, let_go) = found
            return Simulated(
                max(instants, key=total),
                step,
                degree,
                per_parameter_step=loop,
                accumulating=max(instants, key=besides_grads),
                forward=forward,
                peaks=peaks(instants),
                starts=starts,
                let_go_at_return=let_go,
            )
    moments, step, held = run(None, None)
    forwards = of_forward(moments)
    return Simulated(
        peak_of(moments),
        step,
        degree,
        per_parameter_step=loop,
        accumulating=peak_of(moments, besides_grads),
        forward=peak_of(forwards) if forwards else None,
        peaks=peaks(phase for phases in moments.values() for phase in phases),
        starts=tuple(held[name].held for name in setup.block_names) if held else (),
        let_go_at_return=tuple(held[name].let_go for name in setup.block_names) if held else (),
    )


def simulated_layout(model: nn.Module, setup: Setup) -> Layout | None:
    """How the model's blocks repeat where its runs are simulated shallow and extended
    (`layout.layout`); None where they are simulated whole, as also where the trace found blocks
    alike that run different operators."""
    return None if setup.unlike_blocks else layout(model, setup.block_names)


def _by_periods(
    run: Callable[[Layout, int], Steps], strategy: Strategy, repeats: Layout, names: list[str]
) -> tuple[list[Phase], Phase, Phase | None, tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """The instants of forward and backward, the step's peak, the forward's peak and what
    checkpointing may free and keep as each of the blocks `names` begins (`_extended_starts`,
    of `BlockStart`'s two) from copies of 3, 4, 5 (then 6) periods of every list (`run`),
    extended (`_extended`); None where they are not on one line."""
    runs = {k: run(repeats, k) for k in SHALLOW}
    while True:
        k1, k2, k3 = sorted(runs)[-3:]
        found = _extended(runs[k1], runs[k2], runs[k3], (k1, k2, k3), repeats.periods)
        if found is not None:
            at = runs[k3][2]
            held = _extended_starts({n: s.held for n, s in at.items()}, repeats, k3, names)
            let_go = _extended_starts({n: s.let_go for n, s in at.items()}, repeats, k3, names)
            return (*found, (held, let_go))
        if k3 >= _DEEPEST or k3 + 1 >= repeats.periods:
            logger.debug("%s: terms not linear in depth; simulating the whole model", strategy)
            return None
        runs[k3 + 1] = run(repeats, k3 + 1)


def _extended(
    p1: Steps, p2: Steps, p3: Steps, depths: tuple[int, int, int], full: int
) -> tuple[list[Phase], Phase, Phase | None] | None:
    """The instants of forward and backward (`_instants`), the step's peak and the forward's
    peak (None: no moment of it met at both depths) at `full` periods from runs at three
    `depths`, or None where the third is off the line through the first two.

    Each moment of forward and backward is extended on its own and the largest taken at the full
    depth: the peak's moment can move with depth (the head's backward with few blocks, the end
    of backward, gradients accumulated, with many). Where the third depth is off the line
    through the first two, the terms are not linear over this range. The line covers the
    moments met at both first depths (the second-last period's first appears at 4 periods), and
    an interior block's, which must not rise above it."""
    k1, k2, k3 = depths
    line = _extend_moments(p1[0], p2[0], k1, k2, k3)
    met = {label: p3[0][label] for label in p3[0] if label in p1[0] or label == INTERIOR}
    actual = peak_of(met)
    extended = _instants(p2[0], p3[0], k2, k3, full)
    if line is None or extended is None:
        return None
    if abs(total(line) - total(actual)) > _LINEARITY_TOLERANCE * total(actual):
        return None
    forward = _extend_moments(of_forward(p2[0]), of_forward(p3[0]), k2, k3, full)
    return extended, _extend(p2[1], p3[1], k2, k3, full), forward


def _extended_starts(
    held: dict[str, int], repeats: Layout, k: int, names: list[str]
) -> tuple[int, ...]:
    """What checkpointing may free (or keep: one of `step.BlockStart`'s) as each of the
    model's blocks `names` begins its forward (`step.Moments.starts`), from the copy with k
    periods (`held`, by its blocks' names): each block adds what the copy's block standing for
    it (`Layout.source`, the one a block's backward reads: blocks follow it in the copy too)
    added up to the next one's start; for a list's last block that is the copy's list's last,
    which adds what runs before the next list's first block, as the model's does. Empty where
    the copy's were not kept, its first block is not the model's, or a block before the
    model's last stands for the copy's last (which no start follows)."""
    kept = repeats.kept(k)
    source = repeats.source(k, backward=True)
    if not held or not names or kept[0] != names[0]:
        return ()
    pairs = zip(kept[:-1], kept[1:], strict=True)
    added = {name: held[after] - held[name] for name, after in pairs}
    if any(source.get(name) not in added for name in names[:-1]):
        return ()
    starts = [held[kept[0]]]
    for name in names[:-1]:
        starts.append(starts[-1] + added[source[name]])
    return tuple(starts)


def _extend_moments(
    a: dict[str, list[Phase]], b: dict[str, list[Phase]], d1: int, d2: int, depth: int
) -> Phase | None:
    """The forward/backward peak at `depth` periods: the largest of the `_instants`."""
    instants = _instants(a, b, d1, d2, depth)
    return None if instants is None else max(instants, key=total)


def _instants(
    a: dict[str, list[Phase]], b: dict[str, list[Phase]], d1: int, d2: int, depth: int
) -> list[Phase] | None:
    """The instants of forward and backward at `depth` periods: each moment met at both d1 and
    d2 extended instant by instant (its k-th operator at d1 with its k-th at d2, `_extend`).
    A moment's peak is the largest of lines in depth, one per instant, so extending its peak
    alone falls short once a steeper instant overtakes it (a Llama's head: the loss's
    temporaries with few blocks, the last block's output beside every block's cast weights
    with many). An interior block's moment is left out, its largest sitting at an end
    (`layout.Stretch.label`). None where a moment ran a different number of operators at the two
    depths (the model is then simulated whole), or no moment is met at both."""
    common = [label for label in b if label in a and not label.endswith(INTERIOR)]
    if not common or any(len(a[label]) != len(b[label]) for label in common):
        return None
    return [
        _extend(x, y, d1, d2, depth)
        for label in common
        for x, y in zip(a[label], b[label], strict=True)
    ]


def _extend(a: Phase, b: Phase, d1: int, d2: int, depth: int) -> Phase:
    """Each term at `depth` periods from the terms at d1 and d2 periods (linear in depth)."""
    scale = (depth - d1) / (d2 - d1)
    return Phase(
        *(
            max(0, round(getattr(a, f.name) + scale * (getattr(b, f.name) - getattr(a, f.name))))
            for f in fields(Phase)
        )
    )


def _run(
    model: nn.Module,
    setup: Setup,
    strategy: Strategy,
    mesh: Any,
    repeats: Layout | None = None,
    periods: int = 0,
) -> Steps:
    """One step of the model (with `repeats`, of its copy with `periods` periods of every list:
    each moment's bytes after each operator recorded, to be extended; else the whole model's,
    each moment's peak)."""
    mode = fake_mode()
    kept = setup.block_names if repeats is None else repeats.kept(periods)
    fake, optimizer, batch = wrapped_copy(model, setup, strategy, mesh, kept, mode)
    named = [(fake.get_submodule(name), name) for name in kept]
    labelled = (
        []
        if repeats is None
        else [
            (fake.get_submodule(name), label)
            for name, label in zip(kept, repeats.labels(periods), strict=True)
        ]
    )
    with (
        wider_fake_kernels(
            setup.device.type,
            dict(setup.answers),
            (setup.trains_on or setup.device).type,
            setup.nonzero_found,
        ),
        sharding_propagation_untracked(),
        mode,
    ):
        return tracked_step(fake, optimizer, batch, setup, strategy, labelled, named)


def wrapped_copy(
    model: nn.Module,
    setup: Setup,
    strategy: Strategy,
    mesh: Any,
    kept: list[str],
    mode: Any,
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A fake copy of `model` with only the blocks `kept` of its blocks, checkpointed and sharded
    as `wrap.apply` does it, its optimizer and the batch, all fake tensors of `mode`."""
    fake, names = fake_copy(model, mode, setup.device, setup.block_names, kept)
    with mode:
        batch = tree_map(lambda x: fake_tensor(mode, x, setup.device), setup.batch)
        if setup.checkpoint_all:
            from autoshard.strategies.engines import checkpoint_block

            for name in names:
                checkpoint_block(fake.get_submodule(name))
        if recipe(strategy).sharded:
            shard_module(fake, names, mesh, strategy, setup.dtype)
        device_type = (setup.trains_on or setup.device).type
        sharded = recipe(strategy).sharded
        return fake, fake_optimizer(setup.optimizer, model, fake, device_type, sharded), batch


# One simulation: a strategy, and whether every block is checkpointed (forward and backward only)
Run = tuple[Strategy, bool]


@own_runs_quiet()
@autograd_on()
def simulate_all(
    model: nn.Module,
    setup: Setup,
    strategies: tuple[Strategy, ...],
    stats: ModelStats,
    world_size: int,
    *,
    checkpointed: tuple[Strategy, ...] = (),
    shared: bool = False,
    crashes: dict[Run, str] | None = None,
    tally: Tally | None = None,
    workers: Shared | None = None,
) -> tuple[dict[Run, Simulated], str]:
    """Simulate each strategy, and each of `checkpointed` with every block checkpointed; returns
    the simulations by run (as rank 0 sees them: its shard is the largest) and a note for the
    plan's reasons (`combine` puts a strategy's two runs together).

    Inside a job, with `shared` (`prepare`), every rank must call this at the same point: the
    runs are shared out among the ranks, each simulates its own at the real world size, and one
    exchange through the job's store (`collective.exchange_in_group`) gives every rank the same
    results. Without `shared` (`plan`, which may
    run on one rank only) nothing is exchanged: this rank simulates every run. Outside a job a
    fake default group of at most MAX_SIMULATED_DEGREE ranks is used, and the estimate rescales.
    A run whose simulation fails (an optimizer that cannot be rebuilt on fake parameters, an
    operation fake tensors do not support) is left to the analytic estimate (or, checkpointed,
    to the derivation from the unchecked one), and the note says so; where the run's own
    wrapping is what fails (`crash.crash_of`), it is added to `crashes`. Calls made in waves
    (fastest strategies first, `measure.simulated`) pass one `tally`: the note then says what
    all of them ran. With `workers` (`sharing.workers`), this rank's runs are shared out with
    worker processes.
    """
    reason = unavailable()
    if reason is not None:
        return {}, f"estimates are analytic: {reason}"
    in_job = dist.is_initialized()
    size, rank = simulated_world(world_size)
    shared = shared and in_job
    runs = (*((s, False) for s in strategies), *((s, True) for s in checkpointed))
    tally = tally if tally is not None else Tally()
    digests = _digests(model, setup, runs, size)
    # run -> (its simulation, the workspace it left out); what any rank kept serves every rank
    kept = {
        run: entry for run in runs if (entry := cache.load("run", digests[run], _entry)) is not None
    }
    if shared:  # the same runs are left to share out on every rank
        # through the job's store, not an object collective (`collective.exchange_in_group`)
        for theirs in exchange_in_group("the simulations kept on disk", kept):
            kept.update(theirs)
    left = [run for run in runs if run not in kept]
    mine = [run for i, run in enumerate(left) if not shared or i % size == rank]
    results: dict[Run, Simulated] = {}
    failures: dict[Run, str] = {}
    crashed: dict[Run, str] = {}
    plain: dict[str, Any] = {}  # the plain model's fake step, once a run has failed
    try:
        context = fake_mesh(size, rank, setup.device.type)
        mesh = context.__enter__()
    except Exception as error:  # noqa: BLE001 - e.g. TORCH_DISTRIBUTED_DEBUG=DETAIL refuses it
        # raised alike on every rank (the same torch and environment), so all fall back together
        return {}, f"estimates are analytic: no fake process group ({error})"[:300]
    try:
        ahead, by_workers = workers.ahead(model, setup, mine, mesh, in_job) if workers else ({}, 0)
        for strategy, all_blocks in mine:
            report = logger.debug if in_job else logger.info  # the planner CLI shows INFO
            how = ", every block checkpointed" if all_blocks else ""
            report(f"simulating {strategy}{how} at {size} rank(s) on fake tensors")
            run_setup = replace(setup, checkpoint_all=all_blocks)
            try:
                with failed_run_unheard():
                    simulated = simulate(
                        model, run_setup, strategy, mesh, ahead.get((strategy, all_blocks))
                    )
            except Exception as error:  # noqa: BLE001 - reported in the plan; analytic instead
                logger.debug("simulating %s failed", strategy, exc_info=True)
                failures[strategy, all_blocks] = f"{type(error).__name__}: {error}"[:160]
                crash = crash_of(model, run_setup, strategy, mesh, plain)
                if crash is not None:
                    crashed[strategy, all_blocks] = crash
                continue
            results[strategy, all_blocks] = _as_rank0(simulated, stats, strategy, rank)
    finally:
        context.__exit__(None, None, None)
    if shared:
        gathered = exchange_in_group("the simulations", (results, failures, crashed))
        for theirs, failed, theirs_crashed in gathered:
            results.update(theirs)
            failures.update(failed)
            crashed.update(theirs_crashed)
    if crashes is not None:
        crashes.update(crashed)
    # what the workspace left out is said with the runs read back too (one note for them all)
    missing = unmeasured_note(setup.trains_on or setup.device)
    for run, simulated in results.items():
        value = {"simulated": cache.simulated_to_json(simulated), "unmeasured": missing}
        cache.store("run", digests[run], value)
    results.update({run: simulated for run, (simulated, _) in kept.items()})
    missing = missing or next((m for _, m in kept.values() if m), None)
    tally.add(runs, failures, len(kept), missing)
    if workers is not None and workers.size:
        tally.shared_out(workers.size, by_workers, workers.distrusted)
    return dict(sorted(results.items())), tally.note(size, shared)


def simulated_world(world_size: int) -> tuple[int, int]:
    """The fake process group's size and this process's rank in it: the job's inside one, else
    at most MAX_SIMULATED_DEGREE ranks (the estimate rescales) with this process rank 0."""
    if dist.is_initialized():
        return world_size, dist.get_rank()
    return min(world_size, MAX_SIMULATED_DEGREE), 0


# One run at one depth: its strategy, whether every block is checkpointed, its number of periods
# (None: the whole model)
Job = tuple[Strategy, bool, int | None]


def run_at_depth(
    model: nn.Module, setup: Setup, mesh: Any, repeats: Layout | None, job: Job
) -> Steps:
    """One run at one depth (`Job`), as `simulate` makes it: of a copy with that many periods of
    every list (`repeats`), or of the whole model."""
    strategy, all_blocks, periods = job
    run_setup = replace(setup, checkpoint_all=all_blocks)
    if periods is None:
        return _run(model, run_setup, strategy, mesh)
    return _run(model, run_setup, strategy, mesh, repeats, periods)


def _entry(value: dict[str, Any]) -> tuple[Simulated, str | None]:
    return cache.simulated_from_json(value["simulated"]), value["unmeasured"]


def _digests(
    model: nn.Module, setup: Setup, runs: tuple[Run, ...], size: int
) -> dict[Run, str | None]:
    """Each run's name in autoshard's cache (None: not kept): what its simulation depends on."""
    base = cache.digest(
        lambda: [
            "run",
            cache.describe_model(model),
            cache.describe_optimizer(setup.optimizer, model),
            cache.describe_batch(setup.batch),
            cache.describe_callable(setup.loss_fn),
            str(setup.dtype),
            cache.describe_device(setup.device),
            cache.describe_device(setup.trains_on or setup.device),
            setup.block_names,
            setup.answers,
            setup.nonzero_found,
            setup.unlike_blocks,
            size,
        ]
    )
    if base is None:
        return dict.fromkeys(runs)

    def name(run: Run) -> str | None:
        return cache.digest(lambda: [base, str(run[0]), run[1]])

    return {run: name(run) for run in runs}


@dataclass
class Tally:
    """What one round of simulations ran, over its waves: the runs, those that failed (and why),
    how many were read from the cache, what the workspace left out, since when, and what worker
    processes made (`measure.sharing`)."""

    runs: list[Run] = field(default_factory=list)
    failures: dict[Run, str] = field(default_factory=dict)
    kept: int = 0
    missing: str | None = None
    started: float = field(default_factory=time.perf_counter)
    workers: int = 0  # worker processes started
    by_workers: int = 0  # fake steps they made
    distrusted: str | None = None  # why they were stopped, if they were

    def add(
        self, runs: tuple[Run, ...], failures: dict[Run, str], kept: int, missing: str | None
    ) -> None:
        self.runs += runs
        self.failures.update(failures)
        self.kept += kept
        self.missing = self.missing or missing

    def shared_out(self, workers: int, by_workers: int, distrusted: str | None) -> None:
        self.workers = workers
        self.by_workers += by_workers
        self.distrusted = self.distrusted or distrusted

    def note(self, size: int, shared: bool) -> str:
        """The plan's reason for the round."""
        seconds = time.perf_counter() - self.started
        shared_out = f", shared out among {size} ranks" if shared and size > 1 else ""
        if self.workers:
            shared_out += (
                f", {self.by_workers} of the fake steps made by {self.workers} worker process(es)"
            )
        if self.distrusted:
            shared_out += (
                f", the others here: {self.distrusted} (a fresh interpreter does not see what "
                f"this process changed, e.g. a function patched at run time)"
            )
        if self.kept:
            shared_out += f", {self.kept} read from autoshard's cache: {cache.directory()}"
        checkpointed = ", ".join(str(s) for s, ck in self.runs if ck)
        also = f"; with every block checkpointed: {checkpointed}" if checkpointed else ""
        note = (
            f"estimates from simulated steps on fake tensors at {size} rank(s) "
            f"({len(self.runs)} run(s), {seconds:.1f}s{shared_out}){also}"
        )
        if self.failures:
            listed = "; ".join(
                f"{s}{' checkpointed' if ck else ''} ({e})"
                for (s, ck), e in sorted(self.failures.items())
            )
            note += f"; not simulated: {listed}"
        if self.missing:
            note += f"; {self.missing}"
        return note


def combine(runs: dict[Run, Simulated]) -> dict[Strategy, Simulated]:
    """Each strategy's unchecked simulation, with the forward/backward peak (and the moment with
    the most bytes besides gradients) of its checkpointed one where that ran too, its optimizer
    state the unchecked one's: a checkpointed run takes no step, so it holds only the state an
    optimizer makes as it is built (Adagrad's sums: all of it, which was counted twice)."""

    def with_plain_state(phase: Phase, plain: Simulated) -> Phase:
        return replace(phase, optimizer_state=plain.backward.optimizer_state)

    def checkpointed(plain: Simulated, run: Simulated) -> Simulated:
        return replace(
            plain,
            checkpointed_backward=with_plain_state(run.backward, plain),
            checkpointed_accumulating=(
                None if run.accumulating is None else with_plain_state(run.accumulating, plain)
            ),
            checkpointed_peaks=tuple(with_plain_state(phase, plain) for phase in run.peaks),
            checkpointed_starts=run.starts,
        )

    return {
        strategy: checkpointed(plain, runs[strategy, True]) if (strategy, True) in runs else plain
        for (strategy, checkpointed_run), plain in runs.items()
        if not checkpointed_run
    }


def _as_rank0(simulated: Simulated, stats: ModelStats, strategy: Strategy, rank: int) -> Simulated:
    """A simulation run as `rank`, with its sharded terms as rank 0's (larger) shard has them."""
    if not recipe(strategy).sharded or rank == 0:
        return simulated
    own = shard_bytes(stats, simulated.degree, rank)
    if own == 0:
        return simulated
    ratio = shard_bytes(stats, simulated.degree, 0) / own
    degree = simulated.degree
    return simulated.scaled(ratio, per_parameter_ratio(stats, (degree, rank), (degree, 0)))
