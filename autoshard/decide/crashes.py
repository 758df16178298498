"""Candidates whose own step fails in the planning simulation (`measure.crash` finds them): the
planner does not offer them, and says why."""

from __future__ import annotations

from autoshard.strategies.strategy import Strategy

# One simulation: a strategy, and whether every block is checkpointed (as `simulate.Run`)
Run = tuple[Strategy, bool]

# Errors that mixed precision causes in a candidate's step (`measure.fake.MixedDtypes`: two dtypes
# a kernel refuses; `measure.crash.ConvertedInForward`: a module the forward converts), and the
# low-precision dtypes a kernel names when it refuses one (torch.fft on CPU: "Unsupported dtype
# BFloat16"): the advice then names mixed_precision='no'
PRECISION_ERRORS = ("MixedDtypes", "ConvertedInForward", "bfloat16", "float16", "half")


def caused_by_precision(error: str) -> bool:
    """Whether a candidate's crash (as `measure.crash.crash_of` words it) is mixed precision's:
    its kind, or a low-precision dtype it names (only candidates under mixed precision carry
    one: the model's own parameters in bf16 turn it off, `measure.facts`)."""
    lowered = error.lower()
    return any(name.lower() in lowered for name in PRECISION_ERRORS)


def candidate_crash(
    crashed: dict[Run, str], simulated_as: Strategy, checkpointed: int
) -> str | None:
    """Why the candidate of `simulated_as` with `checkpointed` blocks would crash, or None: its
    strategy's step fails, or (with any block checkpointed) its checkpointed step does."""
    error = crashed.get((simulated_as, False))
    if error is None and checkpointed:
        error = crashed.get((simulated_as, True))
    return error


def not_offered_note(crashed: dict[Run, str], mixed_precision: bool) -> str:
    """What the plan says of the candidates not offered; with `mixed_precision` on, whether
    turning it off would let some of them run."""
    listed = "; ".join(
        f"{s}{' with blocks checkpointed' if ck else ''} ({error})"
        for (s, ck), error in sorted(crashed.items())
    )
    advice = (
        " (those that mixed precision makes fail would run with mixed_precision='no')"
        if mixed_precision and any(caused_by_precision(error) for error in crashed.values())
        else ""
    )
    return (
        f"not offered, as their step fails in its planning simulation (a real step would "
        f"fail alike): {listed}{advice}"
    )
