"""Candidates whose own step fails in the planning simulation (`measure.crash` finds them): the
planner does not offer them, and says why."""

from __future__ import annotations

from autoshard.strategies.strategy import Strategy

# One simulation: a strategy, and whether every block is checkpointed (as `simulate.Run`)
Run = tuple[Strategy, bool]

# Errors that mixed precision causes in a candidate's step (`measure.fake.MixedDtypes`: two dtypes
# a kernel refuses; `measure.crash.ConvertedInForward`: a module the forward converts): the advice
# for a forced strategy then names mixed_precision='no'
PRECISION_ERRORS = ("MixedDtypes", "ConvertedInForward")


def caused_by_precision(error: str) -> bool:
    """Whether a candidate's crash (as `measure.crash.crash_of` words it) is mixed precision's."""
    return any(name in error for name in PRECISION_ERRORS)


def candidate_crash(
    crashed: dict[Run, str], simulated_as: Strategy, checkpointed: int
) -> str | None:
    """Why the candidate of `simulated_as` with `checkpointed` blocks would crash, or None: its
    strategy's step fails, or (with any block checkpointed) its checkpointed step does."""
    error = crashed.get((simulated_as, False))
    if error is None and checkpointed:
        error = crashed.get((simulated_as, True))
    return error


def not_offered_note(crashed: dict[Run, str]) -> str:
    listed = "; ".join(
        f"{s}{' with blocks checkpointed' if ck else ''} ({error})"
        for (s, ck), error in sorted(crashed.items())
    )
    advice = (
        " (those that mixed precision makes fail would run with mixed_precision='no')"
        if any(caused_by_precision(error) for error in crashed.values())
        else ""
    )
    return (
        f"not offered, as their step fails in its planning simulation (a real step would "
        f"fail alike): {listed}{advice}"
    )
