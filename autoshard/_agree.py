"""Agreement across ranks during the trial step, so that a failure on one rank never leaves the
others waiting in a collective.

A sync point all-reduces (MAX) a vector with one slot per rank, holding that rank's failure code
(0 fine, OOM, ERROR). Sync points sit immediately before every collective of the step: inside
FSDP2's all-gather and reduce-scatter (custom comm objects, called after FSDP2 allocated the
buffers, so an OOM while allocating them is caught before the collective), in a DDP comm hook
before each bucket's all-reduce, before DDP's forward (buffer broadcast) and before the optimizer
step. A rank whose step raised posts its code at its next sync instead; the others are at their
own next sync point, so the collectives still pair up and every rank learns the same codes.
Composer's automatic microbatching keeps ranks in step the same way (DESIGN.md section 4).
Everything is removed after the trial: training pays nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard._world import World

FINE, OOM, ERROR = 0, 1, 2


class PeerFailed(Exception):
    """Raised at a sync point when another rank reported a failure; ends this rank's step."""


class Agreement:
    """The sync points of one trial step."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.rows: list[tuple[int, int]] | None = None  # set once any rank reported a failure

    def sync(self, code: int = FINE, peak: int = 0) -> list[tuple[int, int]]:
        """One collective unless a failure is already known; returns (code, peak bytes) of every
        rank. Each rank fills only its own row, so the MAX all-reduce is a gather."""
        if self.rows is not None:
            return self.rows
        if not self.world.distributed:
            rows = [(code, peak)]
        else:
            device = self.world.device if self.world.device.type == "cuda" else torch.device("cpu")
            flags = torch.zeros(self.world.world_size, 2, dtype=torch.int64, device=device)
            flags[self.world.rank, 0] = code
            flags[self.world.rank, 1] = peak
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            rows = [(int(c), int(p)) for c, p in flags.tolist()]
        if any(c for c, _ in rows):
            self.rows = rows
        return rows

    def check(self) -> None:
        if any(c for c, _ in self.sync()):
            raise PeerFailed


class _Synced:
    """An FSDP2 comm object that reaches a sync point before the collective it wraps."""

    def __init__(self, inner: Any, agreement: Agreement) -> None:
        self.inner = inner
        self.agreement = agreement

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.agreement.check()
        return self.inner(*args, **kwargs)


def _param_groups(module: nn.Module) -> list[Any]:
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older FSDP2 keeps a single group
        groups = [getattr(state, "_fsdp_param_group", None)]
    return [g for g in groups if g is not None]


@contextlib.contextmanager
def fsdp_sync_points(module: nn.Module, agreement: Agreement) -> Iterator[bool]:
    """Wrap every FSDP2 unit's all-gather and reduce-scatter with a sync point, as
    `FSDPModule.set_custom_all_gather` would (it refuses units with several param groups);
    yields whether this torch has pluggable comms."""
    from torch.distributed.fsdp import FSDPModule

    groups = [g for m in module.modules() if isinstance(m, FSDPModule) for g in _param_groups(m)]
    if not all(
        hasattr(g, "_all_gather_comm") and hasattr(g, "_reduce_scatter_comm") for g in groups
    ):
        yield False  # FSDP2 before pluggable comms: only the step-level sync points remain
        return
    originals = [(g, g._all_gather_comm, g._reduce_scatter_comm) for g in groups]
    for group, all_gather, reduce_scatter in originals:
        group._all_gather_comm = _Synced(all_gather, agreement)
        group._reduce_scatter_comm = _Synced(reduce_scatter, agreement)
    try:
        yield True
    finally:
        for group, all_gather, reduce_scatter in originals:
            group._all_gather_comm = all_gather
            group._reduce_scatter_comm = reduce_scatter


def ddp_sync_points(ddp: nn.Module, agreement: Agreement) -> Any:
    """A sync point before DDP's forward and before each bucket's all-reduce. A comm hook cannot
    be removed: the caller re-creates the DDP wrapper after the trial."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # Unannotated on purpose: DDP rejects a `bucket` annotation other than the GradBucket class,
    # and postponed annotations (PEP 563) would turn it into a string.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        agreement.check()
        return allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(None, hook)  # type: ignore[operator]
    return ddp.register_forward_pre_hook(lambda module, args: agreement.check())
