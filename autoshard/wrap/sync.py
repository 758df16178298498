"""The trial step's sync points inside each engine's own collectives: before every FSDP2
all-gather and reduce-scatter, and before DDP's forward and each bucket's all-reduce, every rank
reaches a `collective.Agreement` first, so that an OOM on one rank stops every rank before the
next collective instead of leaving the others waiting in it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autoshard._torch_compat import fsdp_comms_wrapped, fsdp_param_groups
from autoshard.collective import Agreement


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


@contextlib.contextmanager
def fsdp_sync_points(module: nn.Module, agreement: Agreement) -> Iterator[bool]:
    """Wrap every FSDP2 unit's all-gather and reduce-scatter with a sync point, as
    `FSDPModule.set_custom_all_gather` would (it refuses units with several param groups);
    yields whether this torch has pluggable comms."""
    from torch.distributed.fsdp import FSDPModule

    groups = [
        g for m in module.modules() if isinstance(m, FSDPModule) for g in fsdp_param_groups(m)
    ]
    # FSDP2 before pluggable comms yields False: only the step-level sync points remain
    with fsdp_comms_wrapped(groups, lambda comm: _Synced(comm, agreement)) as pluggable:
        yield pluggable


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
