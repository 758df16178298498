"""The two sides of a decision: what the caller hands over and asks for (`Work`, with its
`Request`), and what every rank decided from the agreed facts (`Decision`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard._batch import LossFn
from autoshard.decide.plan import Candidate, Plan
from autoshard.decide.validate import Request


@dataclass(frozen=True)
class Work:
    """What is to be trained, and the caller's choices for it (validated)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any  # the example batch, or None
    loss_fn: LossFn | None
    request: Request
    trial_step: bool = False


@dataclass(frozen=True)
class Decision:
    """What every rank decided, from the same agreed facts."""

    plan: Plan
    first: Candidate  # the chosen candidate: the trial's first rung
    rungs: tuple[Candidate, ...]  # every rung the trial may fall back to
    block_names: tuple[str, ...]
    find_unused: bool  # some trainable parameters got no gradient on some rank's trace
    num_nodes: int  # the nodes the plan counted, which HYBRID_SHARD's mesh replicates across
    unshardable: str | None = None  # why FSDP2 cannot shard it over several ranks


@dataclass(frozen=True)
class Ranks:
    """The ranks a decision is for."""

    world_size: int
    num_nodes: int
    usable_bytes: int  # device memory each rank may use
    device: torch.device  # what they train on
