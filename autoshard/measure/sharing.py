"""Simulated runs shared out to worker processes where this machine's cores are idle (issue 24):
what a worker is sent, how it makes a run, and the round it makes with this process
(`measure.pool` runs them).

A run at a depth (`simulate.run_at_depth`) is a fake training step that depends on what it is
given. A worker is sent the model's module tree on the meta device (no tensor memory, ties kept),
its optimizer rebuilt over it, the example batch, the loss function, and the settings of this
process that change what a step allocates (default dtype, deterministic algorithms, float32
matmul precision, attention kernels allowed). Anything else this process changed and a fresh
interpreter does not see (a function patched at run time, a warning filter, autocast) is caught
by the pool's check: of each run (a strategy, checkpointed or not) this process makes the first
depth, and a worker makes the run's other depths only once its own make of that depth was the
same to the byte. A model simulated whole (one depth per run) is therefore made here alone.

Only simulations on fake CPU tensors are shared out (`pool.worker_count`), and none while a
profiler runs here (kernel workspace is then left unmeasured here, and a worker would measure
it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autoshard._torch_compat import profiler_enabled, tree_map, view_base
from autoshard.measure.fake import fake_mesh, fake_optimizer, shallow_copy, unavailable
from autoshard.measure.layout import SHALLOW, Layout
from autoshard.measure.pool import Pool, payload, worker_count
from autoshard.measure.quiet import failed_run_unheard, own_runs_quiet
from autoshard.measure.simulate import (
    Job,
    Run,
    Setup,
    Steps,
    run_at_depth,
    simulated_layout,
    simulated_world,
)
from autoshard.measure.step import autograd_on
from autoshard.measure.workspace import merge_unmeasured, take_unmeasured

logger = logging.getLogger("autoshard")


class Shared:
    """A rank's workers for one planning (`workers`), which `simulate_all` shares its runs with:
    started at the first round with runs left to make (none where the cache had them all)."""

    def __init__(self, message: Callable[[], bytes | None], count: int, run_here: bool) -> None:
        self._message, self._count, self._run_here = message, count, run_here
        self._pool: Pool | None = None
        self._started = False

    @property
    def size(self) -> int:
        """The workers that started (one whose payload cannot be read there never does)."""
        return self._pool.started if self._pool is not None else 0

    @property
    def distrusted(self) -> str | None:
        return self._pool.distrusted if self._pool is not None else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def ahead(
        self, model: nn.Module, setup: Setup, runs: list[Run], mesh: Any, in_job: bool
    ) -> tuple[dict[Run, dict[int | None, Steps | BaseException]], int]:
        """The steps `simulate` starts each run from (its first depths, or the whole model),
        made by this process and the workers together, by run and depth, with the number the
        workers made. A step that failed here is its exception (`simulate` raises it); one that
        failed in a worker, or was left out once another depth of its run failed, is missing:
        `simulate` makes it again where it needs it, and handles a failure as it always does."""
        pool = self._pool_for(runs)
        if pool is None or not runs:
            return {}, 0
        repeats = simulated_layout(model, setup)
        depths = SHALLOW if repeats is not None else (None,)
        jobs: list[Job] = [(strategy, ck, k) for strategy, ck in runs for k in depths]
        if pool.distrusted is None:
            report = logger.debug if in_job else logger.info  # the planner CLI shows INFO
            report(f"sharing {len(jobs)} fake step(s) out with {pool.size} worker process(es)")

        def here(job: Job) -> tuple[Steps, dict[Any, str]]:
            return run_at_depth(model, setup, mesh, repeats, job), {}  # notes: this process's

        made = pool.run_all(jobs, here, same=_same_steps, family=_family, kind=_family)
        found: dict[Run, dict[int | None, Steps | BaseException]] = {}
        for (strategy, ck, k), (steps, unmeasured) in made.made.items():
            merge_unmeasured(unmeasured)
            found.setdefault((strategy, ck), {})[k] = steps
        for (strategy, ck, k), error in made.failed.items():
            if isinstance(error, BaseException):
                found.setdefault((strategy, ck), {})[k] = error
        return found, made.by_workers

    def _pool_for(self, runs: list[Run]) -> Pool | None:
        if not self._started and runs:
            self._started = True
            message = self._message()
            if message is not None:
                self._pool = Pool(message, self._count, self._run_here)
        return self._pool


def _family(job: Job) -> Run:
    """A run's depths. Once one fails, `simulate` makes the whole model instead. And what a change
    of the caller's may touch alike (`Pool`'s kind): each strategy runs code of its own (FSDP2's
    wrapping with or without resharding, a 2-D mesh, offloading; DDP is simulated unwrapped), so
    does checkpointing, and a change may touch any one of them (a patched `fully_shard` forcing
    one resharding changed FULL_SHARD's bytes alone). A run's first depth is made here, and a
    worker makes a run's other depths only once its own make of the first matched it."""
    return job[0], job[1]


def _same_steps(ours: tuple[Steps, Any], theirs: tuple[Steps, Any]) -> bool:
    return ours[0] == theirs[0]


@contextlib.contextmanager
def workers(
    model: nn.Module, setup: Setup, world_size: int, runs: int, run_here: bool = True
) -> Iterator[Shared | None]:
    """Worker processes for `simulate_all`'s runs on this rank, where the first round's `runs`
    (on this rank) leave some to share out and this machine's cores are idle; None where not.
    They start at the first round with runs left, unless what a run needs cannot be sent to
    them (then none does). (With `run_here` False this process leaves every run it can to
    them: `Pool`.)"""
    depths = len(SHALLOW) if simulated_layout(model, setup) is not None else 1
    count = worker_count(setup.device, runs * depths)
    if count == 0 or unavailable() is not None or profiler_enabled():
        yield None
        return
    size, rank = simulated_world(world_size)

    def message() -> bytes | None:
        try:
            return payload(serving, (*_portable(model, setup), _settings(), size, rank))
        except Exception:  # noqa: BLE001 - e.g. an optimizer that cannot be rebuilt: made here
            logger.debug("not shared out with worker processes", exc_info=True)
            return None

    shared = Shared(message, count, run_here)
    try:
        yield shared
    finally:
        shared.close()


def _portable(model: nn.Module, setup: Setup) -> tuple[nn.Module, Setup]:
    """The model's module tree on the meta device (no tensor memory, ties kept) and the setup with
    its optimizer rebuilt over it: what a worker simulates exactly as this process would."""
    meta: dict[int, Any] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    meta.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
    copy, _ = shallow_copy(model, setup.block_names, setup.block_names, meta)
    # the choice of implementation is left to the worker's `wrapped_copy`, which knows the
    # strategy, over these Parameters: for parameters of another class the worker may choose
    # otherwise, which the first depth's byte check then catches (`pool`)
    optimizer = fake_optimizer(setup.optimizer, model, copy, None)
    return copy, replace(setup, optimizer=optimizer, batch=tree_map(_View.of, setup.batch))


@dataclass(frozen=True)
class _View:
    """A view of a batch tensor, as its base and its place in it. Pickling keeps a view's offset
    into its storage but not that it is a view, and a fake copy of a view holds its base's whole
    storage where a copy of a plain tensor holds only what it spans: a batch sliced out of a
    larger one (each rank's rows of a global batch) was counted half as large in a worker."""

    base: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(x: Any) -> Any:
        base = view_base(x) if isinstance(x, torch.Tensor) else None
        if base is None or base.dtype != x.dtype:  # a view as another dtype stays as it is
            return x
        return _View(base, tuple(x.size()), x.stride(), int(x.storage_offset()))

    @staticmethod
    def made(x: Any) -> Any:
        if not isinstance(x, _View):
            return x
        return x.base.as_strided(x.size, x.stride, x.offset)


_Settings = tuple[torch.dtype, bool, bool, str, tuple[bool, bool, bool, bool]]


def _settings() -> _Settings:
    """This process's settings that change what a fake step allocates (a script that made
    float64 the default dtype creates float64 tensors in its forward; the attention kernel the
    switches allow decides what attention saves), for a worker to take."""
    cuda = torch.backends.cuda
    return (
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
        (
            cuda.flash_sdp_enabled(),
            cuda.mem_efficient_sdp_enabled(),
            cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled(),
        ),
    )


def _take(settings: _Settings) -> None:
    dtype, deterministic, warn_only, precision, (flash, efficient, math, cudnn) = settings
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_float32_matmul_precision(precision)
    cuda = torch.backends.cuda
    cuda.enable_flash_sdp(flash)
    cuda.enable_mem_efficient_sdp(efficient)
    cuda.enable_math_sdp(math)
    cuda.enable_cudnn_sdp(cudnn)


@contextlib.contextmanager
def serving(
    state: tuple[nn.Module, Setup, _Settings, int, int],
) -> Iterator[Callable[[Job], tuple[Steps, dict[Any, str]]]]:
    """A worker's side (`measure.worker`): the caller's settings, the fake process group
    `simulate_all` would use, and the function making one run there, which gives its steps and
    the kernel workspaces it met that could not be measured (for the caller's note)."""
    model, setup, settings, size, rank = state
    _take(settings)
    setup = replace(setup, batch=tree_map(_View.made, setup.batch))
    repeats: Layout | None = simulated_layout(model, setup)

    def run(job: Job) -> tuple[Steps, dict[Any, str]]:
        with failed_run_unheard():
            return run_at_depth(model, setup, mesh, repeats, job), take_unmeasured()

    with own_runs_quiet(), autograd_on(), fake_mesh(size, rank, setup.device.type) as mesh:
        yield run
