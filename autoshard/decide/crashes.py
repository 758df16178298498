"""Candidates whose own step fails in the planning simulation (`measure.crash` finds them): the
planner does not offer them, and says why."""

from __future__ import annotations

from autoshard.strategies.strategy import Strategy

# One simulation: a strategy, and whether every block is checkpointed (as `simulate.Run`)
Run = tuple[Strategy, bool]


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
    return (
        f"not offered, as their step fails in its planning simulation (a real step would "
        f"fail alike): {listed}"
    )
