"""How far a candidate is from fitting, and the error that says so when none fits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from autoshard._units import human

if TYPE_CHECKING:
    from autoshard.decide.plan import Candidate, PlanInputs


class DoesNotFit(ValueError):
    """No candidate fits the usable memory; the message says how much is missing and what helps.

    Attributes:
        missing_bytes: per-rank bytes the most frugal candidate lacks (None when a trial step,
            not the estimate, showed that nothing fits).
        largest_batch: the largest per-rank batch (rows of the example batch's leading
            dimension) with which a rung would fit, found by simulation; None where none does or
            it was not searched (the message says which).
    """

    def __init__(
        self,
        message: str,
        missing_bytes: int | None,
        tried: Sequence[Candidate] = (),
        usable: int = 0,
        host_usable: int | None = None,
    ) -> None:
        super().__init__(message)
        self.missing_bytes = missing_bytes
        # what the decision weighed, for the batch-size search that completes the message
        self.tried = tuple(tried)
        self.usable = usable
        self.host_usable = host_usable
        # the largest per-rank batch that would fit (`with_batch`); None: not searched, or none
        self.largest_batch: int | None = None
        # the strategies not offered for a failure mixed precision caused
        # (`crashes.caused_by_precision`), which might fit without it (`pipeline`), or None
        self.precision_failed: str | None = None

    def with_batch(self, largest: int | None, how: str) -> DoesNotFit:
        """This error with the largest per-rank batch that would fit said (`pipeline`)."""
        said = (
            "The largest per-rank batch that fits"
            if largest
            else "No smaller per-rank batch was found to fit"
        )
        error = DoesNotFit(
            f"{self} {said}: {how}.", self.missing_bytes, (), self.usable, self.host_usable
        )
        error.largest_batch = largest
        error.precision_failed = self.precision_failed
        return error

    @classmethod
    def from_estimate(cls, inputs: PlanInputs, tried: Sequence[Candidate]) -> DoesNotFit:
        """The error for a decision where none of the rungs `tried` fits: the closest one's
        shortfall first, then every rung with what it needs, then what would help."""
        best = min(tried, key=lambda c: shortfall(inputs, c))
        device_missing = best.estimated_peak_bytes + best.reserve_bytes - inputs.usable_bytes
        host_missing = host_shortfall(inputs, best)
        activation_share = best.footprint.activations / max(best.estimated_peak_bytes, 1)
        if device_missing > 0:
            reserved = (
                f" (and {human(best.reserve_bytes)} kept free for a reduce-scatter's timing)"
                if best.reserve_bytes
                else ""
            )
            need = (
                f"needs {human(best.estimated_peak_bytes)} per rank{reserved} but "
                f"{human(inputs.usable_bytes)} is usable: {human(device_missing)} missing"
            )
        else:
            need = (
                f"fits the device but needs {human(best.host_bytes)} of host memory per rank for "
                f"the offloaded state, and {human(inputs.host_usable_bytes or 0)} is available: "
                f"{human(host_missing)} missing"
            )
        error = cls(
            f"no strategy fits: the most frugal candidate, {best.strategy} with "
            f"{best.activation_checkpointing}/{inputs.num_blocks} blocks checkpointed, {need}. "
            f"Every rung weighed, with what it needs per rank: {_rungs(inputs, tried)}. "
            f"Activations are {activation_share:.0%} of its device peak (a smaller per-rank "
            f"batch shrinks them); {more_ranks(inputs.unshardable)}; or raise memory_limit if "
            f"it is set below what the device has.{_not_offered(inputs)}",
            max(device_missing, host_missing),
            tried,
            inputs.usable_bytes,
            inputs.host_usable_bytes,
        )
        error.precision_failed = _precision_failed(inputs)
        return error


def more_ranks(unshardable: str | None) -> str:
    """What more ranks would do for parameters, gradients and optimizer state: shrink them under
    FULL_SHARD, unless FSDP2 trains the job at no world size (`unshardable`: why)."""
    if unshardable is None:
        return (
            "parameters, gradients and optimizer state shrink with more ranks (GPUs) under "
            "FULL_SHARD"
        )
    return (
        f"parameters, gradients and optimizer state do not shrink with more ranks here: FSDP2 "
        f"cannot shard this job over several ranks ({unshardable}), and DDP keeps them whole "
        f"on every rank"
    )


def _precision_failed(inputs: PlanInputs) -> str | None:
    """The strategies not offered for a failure mixed precision caused, as "FULL_SHARD,
    SHARD_GRAD_OP", or None."""
    from autoshard.decide.crashes import caused_by_precision
    from autoshard.decide.precision import Precision

    if inputs.mixed_precision is Precision.NO:
        return None
    failed = sorted({str(s) for (s, _), e in inputs.crashed.items() if caused_by_precision(e)})
    return ", ".join(failed) or None


def _rungs(inputs: PlanInputs, tried: Sequence[Candidate]) -> str:
    """Each rung tried and its need: device bytes (with what is kept free beside them), and the
    host memory an offloading rung needs against what the host has."""
    host = inputs.host_usable_bytes
    available = f"{human(host)} available" if host is not None else "not checked"
    said = []
    for c in sorted(tried, key=lambda c: -(c.estimated_peak_bytes + c.reserve_bytes)):
        text = f"{c.strategy} {c.activation_checkpointing}/{inputs.num_blocks} "
        text += human(c.estimated_peak_bytes + c.reserve_bytes)
        if c.host_bytes:
            text += f" and {human(c.host_bytes)} of host memory ({available})"
        said.append(text)
    return "; ".join(said)


def _not_offered(inputs: PlanInputs) -> str:
    """The candidates left out of the search because their step would crash: without a word of
    them, "no strategy fits" reads as if every strategy had been weighed."""
    if not inputs.crashed:
        return ""
    from autoshard.decide.crashes import not_offered_note
    from autoshard.decide.precision import Precision

    mixed = inputs.mixed_precision is not Precision.NO
    return f" Also {not_offered_note(inputs.crashed, mixed)}."


def host_shortfall(inputs: PlanInputs, c: Candidate) -> int:
    if inputs.host_usable_bytes is None or not c.host_bytes:
        return 0
    return c.host_bytes - inputs.host_usable_bytes


def shortfall(inputs: PlanInputs, c: Candidate) -> int:
    """How far a candidate is from fitting: device or host memory, whichever lacks more."""
    device = c.estimated_peak_bytes + c.reserve_bytes - inputs.usable_bytes
    return max(device, host_shortfall(inputs, c))
