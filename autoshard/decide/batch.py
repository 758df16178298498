"""The largest per-rank batch each candidate fits, searched with simulated probes.

Pure: `largest_batches` is handed a `probe(rows)` that plans the example batch cut or tiled to
that many rows (the pipeline's simulation, `pipeline.batch_probe`) and returns every candidate's
need and whether it fits; it decides where to probe. Memory is not linear in the rows everywhere
(attention over a sequence, MoE routing, padding), so nothing is extrapolated into an answer:
every figure returned is a batch that was simulated and found to fit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from autoshard.strategies.strategy import Strategy

if TYPE_CHECKING:
    from autoshard.decide.plan import Candidate, Plan

# simulations a search may run, all candidates together
MAX_PROBES = 8
# a bracket this narrow (the largest batch known to fit against the smallest known not to) ends
# a candidate's search
CLOSE_ENOUGH = 0.02
# how far above the largest batch known to fit an open-ended guess may reach
GROWTH = 4


@dataclass(frozen=True)
class Largest:
    """One candidate's answer.

    Attributes:
        rows: the largest batch simulated and found to fit; None where not even one row does.
        bound: the smallest batch simulated and found not to fit (None: none was, the search
            stopped first, at its budget of probes: `rows` is a lower bound).
    """

    rows: int | None
    bound: int | None


K = TypeVar("K", bound=Hashable)
Key = tuple[Strategy, int]  # a candidate: its strategy and checkpointed blocks
Probe = Callable[[int], dict[Key, tuple[int, bool]]]


def largest_batches(
    keys: Iterable[K],
    rows: int,
    at_rows: dict[K, tuple[int, bool]],
    probe: Callable[[int], dict[K, tuple[int, bool]]],
    usable: int,
) -> tuple[dict[K, Largest], list[int]]:
    """Each key's largest fitting batch, and the batches probed, in order.

    `at_rows` is every key's (need, fits) at the example batch's `rows`, known already. Each probe
    serves every key: the next one is chosen for the key whose bracket is widest, where the line
    through its bracket's needs meets `usable` (regula falsi), beyond its largest fitting batch
    by at most GROWTH times where nothing above it was probed yet.
    """
    keys = list(keys)
    seen: dict[int, dict[K, tuple[int, bool]]] = {rows: at_rows}
    probed: list[int] = []
    # Illinois' regula falsi: where a probe moved the same end of a key's bracket as the one
    # before, the other end's distance from the usable memory counts half as much in the next
    # chord (and again, each time), so that a curved need (attention) is not crept up on
    weights: dict[K, dict[str, float]] = {k: {"low": 1.0, "high": 1.0} for k in keys}
    last: dict[K, str | None] = dict.fromkeys(keys)

    def run(n: int) -> None:
        before = {k: _bracket(k, seen) for k in keys}
        probed.append(n)
        seen[n] = probe(n)
        for k in keys:
            (low, high), (old_low, old_high) = _bracket(k, seen), before[k]
            moved = "low" if low != old_low else "high" if high != old_high else None
            if moved is None:
                continue
            kept = "high" if moved == "low" else "low"
            weights[k][moved] = 1.0
            if last[k] == moved:
                weights[k][kept] /= 2
            last[k] = moved

    if rows > 1 and any(not at_rows[k][1] for k in keys):
        run(1)
    while len(probed) < MAX_PROBES:
        steps = [
            step
            for k in keys
            if (step := _next(k, seen, usable, weights[k])) and step[1] not in seen
        ]
        if not steps:
            break
        run(max(steps)[1])  # the widest bracket first; open ones (width inf) before all
    return {k: _answer(k, seen) for k in keys}, probed


def _bracket(
    key: K, seen: dict[int, dict[K, tuple[int, bool]]]
) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(rows, need) of the largest batch seen to fit and of the smallest seen not to."""
    fit = [(n, r[key][0]) for n, r in seen.items() if r[key][1]]
    fail = [(n, r[key][0]) for n, r in seen.items() if not r[key][1]]
    return max(fit, default=None), min(fail, default=None)


def _next(
    key: K,
    seen: dict[int, dict[K, tuple[int, bool]]],
    usable: int,
    weights: dict[str, float],
) -> tuple[float, int] | None:
    """(how open the key's bracket is, the batch to probe next), or None when it is closed."""
    low, high = _bracket(key, seen)
    if low is None:
        return None  # not even the smallest batch probed fits (one row once probed)
    if high is not None and high[0] - low[0] <= max(1, int(low[0] * CLOSE_ENOUGH)):
        return None
    reach = low[0] * GROWTH if high is None else high[0] - 1
    if high is None:  # open above: the line through the two largest batches seen to fit
        fits = sorted((n, r[key][0]) for n, r in seen.items() if r[key][1])
        guess = _meets(fits[-2] if len(fits) > 1 else (0, 0), low, usable, reach)
    else:  # the chord across the bracket, each end's distance from usable weighted
        below = (low[0], usable - (usable - low[1]) * weights["low"])
        above = (high[0], usable + (high[1] - usable) * weights["high"])
        guess = _meets(below, above, usable, reach)
    guess = min(max(guess, low[0] + 1), reach)
    width = float("inf") if high is None else (high[0] - low[0]) / low[0]
    return width, guess


def _meets(a: tuple[int, float], b: tuple[int, float], usable: int, reach: int) -> int:
    """Where the line through (rows, need) points `a` and `b` meets `usable` (`reach` where it
    does not rise)."""
    slope = (b[1] - a[1]) / (b[0] - a[0]) if b[0] != a[0] else 0.0
    return reach if slope <= 0 else b[0] + int((usable - b[1]) / slope)


def _answer(key: K, seen: dict[int, dict[K, tuple[int, bool]]]) -> Largest:
    low, high = _bracket(key, seen)
    return Largest(low[0] if low else None, high[0] if high else None)


def with_batches(
    plan: Plan,
    rows: int | None,
    how: str,
    answers: list[dict[Key, Largest]],
    probed: list[int],
) -> Plan:
    """`plan` with each candidate's largest batch: the least of the ranks' `answers` (one dict
    per rank), and the reason that says how they were found (or, `rows` None, why not)."""
    if rows is None:
        return replace(plan, reasons=(*plan.reasons, f"largest batch not searched: {how}"))
    candidates, open_ = [], []
    for c in plan.candidates:
        found = [a[(c.strategy, c.activation_checkpointing)].rows for a in answers]
        fitting = [n for n in found if n is not None]
        least = min(fitting) if len(fitting) == len(found) else None
        bounds = [a[(c.strategy, c.activation_checkpointing)].bound for a in answers]
        if least is not None and any(b is None for b in bounds):
            open_.append(f"{c.strategy} {c.activation_checkpointing}/{plan.num_blocks}")
        candidates.append(replace(c, max_batch=least))
    reason = (
        f"largest per-rank batch each candidate fits: along {how} ({rows} rows in the example "
        f"batch), simulated at {_listed(probed)} rows"
    )
    if open_:
        reason += (
            f"; at least that for {', '.join(open_)} (the search stopped at its {MAX_PROBES} "
            f"simulations before finding a batch that does not fit)"
        )
    if len(answers) > 1:
        reason += f"; the least of the {len(answers)} ranks' figures"
    return replace(plan, candidates=tuple(candidates), reasons=(*plan.reasons, reason))


def batch_for(
    rung: Candidate,
    rows: int | None,
    how: str,
    answers: list[Largest],
    probed: list[int],
    accumulation_steps: int,
) -> tuple[int | None, str]:
    """For `DoesNotFit`: the largest batch `rung` fits (the least of the ranks' `answers`) and
    the sentence that says it, with the accumulation steps that keep the global batch; or None
    and why no smaller batch fits."""
    if rows is None:
        return None, how
    if rows == 1:
        return None, "the example batch is already one row"
    under = f"{rung.strategy} with {rung.activation_checkpointing} block(s) checkpointed"
    if any(a.rows is None for a in answers):
        return None, f"not even one of its {rows} rows fits under {under}"
    low = min(a.rows for a in answers if a.rows is not None)
    keep = -(-rows * accumulation_steps // low)
    return low, (
        f"{low} of its {rows} rows, under {under} (simulated at {_listed(probed)} rows); "
        f"accumulation_steps={keep} keeps at least the {rows * accumulation_steps} rows per rank "
        f"per optimizer step"
    )


def _listed(probed: list[int]) -> str:
    return ", ".join(map(str, sorted(probed)))
