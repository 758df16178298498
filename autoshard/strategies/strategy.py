"""The ways autoshard can wrap a model."""

from __future__ import annotations

import enum


class Strategy(str, enum.Enum):
    """How a model is wrapped. Each one's facts (engine, mesh, memory and cost terms, fallbacks,
    accelerate mapping) are its recipe in `strategies.recipes.RECIPES`; from the least to the
    most memory-frugal: LOCAL/DDP, SHARD_GRAD_OP, HYBRID_SHARD, FULL_SHARD, CPU_OFFLOAD.

    LOCAL: one process, no wrapper (plain `python`, or a process group of one rank).
    DDP: `DistributedDataParallel`; every rank holds the whole model, gradients and optimizer state.
    SHARD_GRAD_OP: ZeRO-2 with FSDP2 `fully_shard(reshard_after_forward=False)`; gradients and
        optimizer state are sharded, parameters stay gathered from forward to backward.
    FULL_SHARD: ZeRO-3 with FSDP2 `fully_shard(reshard_after_forward=True)`; parameters are
        resharded after each block's forward and gathered again in backward (about 1.5x the
        traffic of DDP).
    HYBRID_SHARD: FULL_SHARD within each node, replicated across nodes (HSDP: FSDP2 over a 2-D
        `DeviceMesh`); parameter traffic stays on the fast intra-node links, and only the sharded
        gradients cross nodes. A candidate when the ranks span more than one node.
    CPU_OFFLOAD: FULL_SHARD with FSDP2's `CPUOffloadPolicy`: sharded parameters, gradients and
        optimizer state live in host memory and the optimizer steps on the CPU. The last rung on
        GPU, when nothing else fits.
    """

    LOCAL = "local"
    DDP = "ddp"
    SHARD_GRAD_OP = "shard_grad_op"
    FULL_SHARD = "full_shard"
    HYBRID_SHARD = "hybrid_shard"
    CPU_OFFLOAD = "cpu_offload"

    def __str__(self) -> str:
        return self.name
