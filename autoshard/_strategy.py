"""The ways autoshard can wrap a model."""

from __future__ import annotations

import enum


class Strategy(str, enum.Enum):
    """How a model is wrapped, from the least to the most memory-frugal.

    LOCAL: one process, no wrapper (plain `python`, or a process group of one rank).
    DDP: `DistributedDataParallel`; every rank holds the whole model, gradients and optimizer state.
    SHARD_GRAD_OP: ZeRO-2 with FSDP2 `fully_shard(reshard_after_forward=False)`; gradients and
        optimizer state are sharded, parameters stay gathered from forward to backward.
    FULL_SHARD: ZeRO-3 with FSDP2 `fully_shard(reshard_after_forward=True)`; parameters are
        resharded after each block's forward and gathered again in backward (about 1.5x the
        traffic of DDP).
    """

    LOCAL = "local"
    DDP = "ddp"
    SHARD_GRAD_OP = "shard_grad_op"
    FULL_SHARD = "full_shard"

    @property
    def sharded(self) -> bool:
        return self in (Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD)

    def __str__(self) -> str:
        return self.name
