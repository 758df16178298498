"""What a decision is made from and what it gives: `PlanInputs`, `Candidate`, `Attempt`, `Plan`."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autoshard.decide.estimate import Footprint, ModelStats, Setting, Simulated
from autoshard.decide.hardware import Hardware
from autoshard.decide.precision import Precision
from autoshard.decide.profile import ActivationProfile
from autoshard.strategies.strategy import Strategy

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Candidate:
    """One way to train and what it would cost.

    Attributes:
        strategy: the wrapping.
        activation_checkpointing: number of blocks checkpointed (the first ones).
        footprint: estimated per-rank peak, by term.
        step_seconds: modelled step time; only its order among candidates matters.
        fits: the estimated peak plus reserve_bytes is within the usable memory (and, under
            CPU offload, host_bytes within the host memory).
        host_bytes: host memory per rank under CPU offload, else 0.
        reserve_bytes: memory kept free beside the estimated peak for what depends on timing
            (`reserve_bytes`); not part of the estimate.
        max_batch: the largest per-rank batch (rows along the example batch's batch dimension)
            with which it fits, found by simulation (`max_batch=True`); None where not searched
            or where not even one row fits (the plan's reasons say which).
    """

    strategy: Strategy
    activation_checkpointing: int
    footprint: Footprint
    step_seconds: float
    fits: bool
    host_bytes: int = 0
    reserve_bytes: int = 0
    max_batch: int | None = None

    @property
    def estimated_peak_bytes(self) -> int:
        return self.footprint.peak


@dataclass(frozen=True)
class PlanInputs:
    """Everything the decision depends on, measured or stated beforehand."""

    stats: ModelStats
    profile: ActivationProfile | None
    world_size: int
    num_nodes: int
    usable_bytes: int
    setting: Setting  # template: strategy and checkpointed are filled per candidate
    hardware: Hardware
    num_blocks: int
    mixed_precision: Precision
    reasons: tuple[str, ...] = ()
    simulated: dict[Strategy, Simulated] = field(default_factory=dict)  # per strategy, if run
    host_usable_bytes: int | None = None  # host RAM per rank for CPU offload (None: unknown)
    # runs whose own step failed in simulation (`measure.crash`): their candidates are not offered
    crashed: dict[tuple[Strategy, bool], str] = field(default_factory=dict)
    # strategies (as simulated) left unsimulated: slower than a candidate that fits (not shown)
    outweighed: tuple[Strategy, ...] = ()
    # why FSDP2 cannot shard this job over several ranks (`recipes.never_sharded`), or None
    unshardable: str | None = None

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.world_size // max(self.num_nodes, 1))


class Outcome(str, enum.Enum):
    """How a trial step ended; str-valued (`attempt.outcome == "fit"`)."""

    FIT = "fit"
    OUT_OF_MEMORY = "out_of_memory"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Attempt:
    """One trial step: the candidate tried, how it ended, and its measured per-rank peak.

    Attributes:
        strategy: the wrapping tried.
        activation_checkpointing: number of blocks checkpointed (the first ones).
        outcome: `Outcome.FIT`, or `Outcome.OUT_OF_MEMORY` on some rank (then every rank moved
            to a more frugal candidate).
        measured_peak_bytes: the largest per-rank peak measured, or None where none was.
        seconds: the step's wall time when it fit, else None.
        out_of_memory_ranks: the ranks that ran out of memory (empty when it fit).
    """

    strategy: Strategy
    activation_checkpointing: int
    outcome: Outcome
    measured_peak_bytes: int | None
    seconds: float | None = None
    out_of_memory_ranks: tuple[int, ...] = ()

    @property
    def description(self) -> str:
        """How it ended, in words: "fit (0.12s)" or "out of memory on rank(s) [1]"."""
        if self.outcome == Outcome.FIT:
            return "fit" if self.seconds is None else f"fit ({self.seconds:.2f}s)"
        return f"out of memory on rank(s) {list(self.out_of_memory_ranks)}"

    def __str__(self) -> str:
        return f"{self.strategy} AC {self.activation_checkpointing}: {self.description}"


@dataclass(frozen=True)
class Plan:
    """What autoshard chose, why, and what every candidate would have cost (per rank)."""

    strategy: Strategy
    mixed_precision: Precision
    activation_checkpointing: int
    cpu_offload: bool
    estimated_peak_bytes: int
    measured_peak_bytes: int | None
    device_memory_bytes: int
    world_size: int
    num_blocks: int
    candidates: tuple[Candidate, ...]
    reasons: tuple[str, ...]
    attempts: tuple[Attempt, ...] = field(default=())
    # Trainable parameters that got no gradient in the traced step: DDP must then look for them
    # every step (find_unused_parameters=True), or it fails on the second step.
    unused_parameters: tuple[str, ...] = field(default=())
    # Where the model skips layers at random in training (LayerDrop: "'encoder.layerdrop' is
    # 0.05"), leaving their parameters without a gradient in some steps whatever the traced one
    # did: DDP must look for unused parameters every step too.
    layer_drop: str | None = field(default=None)
    # Where mixed precision is on and the model's forward raises under autocast (`Job.
    # autocast_raises`): it trains in mixed precision only by FSDP2's cast parameters, never
    # under autocast (`accelerate_kwargs` turns accelerate's off).
    autocast_raises: str | None = field(default=None)

    @property
    def find_unused_parameters(self) -> bool:
        """Whether DDP must look for parameters without a gradient every step
        (`DistributedDataParallel(find_unused_parameters=...)`), as `prepare` builds it."""
        return bool(self.unused_parameters) or self.layer_drop is not None

    @property
    def max_batch(self) -> int | None:
        """The chosen candidate's largest per-rank batch (`Candidate.max_batch`)."""
        return self.chosen.max_batch

    @property
    def chosen(self) -> Candidate:
        """The candidate this plan trains with (its estimate, term by term)."""
        return next(
            c
            for c in self.candidates
            if c.strategy == self.strategy
            and c.activation_checkpointing == self.activation_checkpointing
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON types (`json.dumps(plan.to_dict())`), for scripts that read
        the decision: bytes per rank as ints, `strategy` as its lower-case value, the chosen
        candidate under `chosen`. The keys are stable; new ones may be added."""
        from autoshard.decide.render import plan_dict

        return plan_dict(self)

    def plot(
        self,
        path: str | os.PathLike[str],
        *,
        width_px: int = 1000,
        height_px: int | None = None,
    ) -> Figure:
        """Draw every candidate's estimated per-rank peak, stacked by term (`Footprint`), against
        the usable memory (`device_memory_bytes`, a dashed line), with the chosen candidate
        outlined and its label in bold, and the trial step's measured peak on its bar when there
        is one; write it to `path` as a PNG. Needs matplotlib (`pip install "autoshard[plot]"`);
        no window opens and pyplot is not used.

        Args:
            path: the PNG to write (its folder must exist).
            width_px: width of the image in pixels.
            height_px: height in pixels; None: 160 plus 40 per candidate, at least 400.

        Returns:
            The matplotlib `Figure` drawn, to show in a notebook or save in another format.

        Raises:
            ImportError: matplotlib is not installed (the message says how to install it).
            ValueError: a size that is not a positive number of pixels.
        """
        from autoshard.decide.plot import default_height_px, save

        if height_px is None:
            height_px = default_height_px(self)
        return save(self, path, width_px, height_px)

    def __str__(self) -> str:
        from autoshard.decide.render import render

        return render(self)
