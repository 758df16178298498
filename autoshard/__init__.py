"""autoshard: one call picks DDP, FSDP2 ZeRO-2 or ZeRO-3, mixed precision and activation
checkpointing from the memory every GPU really has free, and proves the choice with a trial step.

    model, optimizer, plan = autoshard.prepare(model, optimizer, example_batch=batch)
"""

from autoshard.api import Prepared, plan, prepare
from autoshard.collective import PeerError, PeerTimeout, set_agreement_timeout
from autoshard.decide.fit import DoesNotFit
from autoshard.decide.plan import Attempt, Candidate, Outcome, Plan
from autoshard.decide.precision import Precision
from autoshard.io.accelerate import accelerate_kwargs
from autoshard.io.checkpoint import load, save
from autoshard.io.data import shard_dataloader
from autoshard.strategies.strategy import Strategy

__all__ = [
    "Attempt",
    "Candidate",
    "DoesNotFit",
    "PeerError",
    "PeerTimeout",
    "Outcome",
    "Plan",
    "Precision",
    "Prepared",
    "Strategy",
    "accelerate_kwargs",
    "load",
    "plan",
    "prepare",
    "save",
    "set_agreement_timeout",
    "shard_dataloader",
]
__version__ = "0.1.0"
