"""The largest per-rank batch each candidate fits, searched with simulated probes.

Pure: `largest_batches` is handed a `probe(rows)` that plans the example batch cut or tiled to
that many rows (the pipeline's simulation, `pipeline.batch_probe`) and returns every candidate's
need and whether it fits; it decides where to probe. Memory is not linear in the rows everywhere
(attention over a sequence, MoE routing, padding), so nothing is extrapolated into an answer:
every figure returned is a batch that was simulated and found to fit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

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


Probe = Callable[[int], dict[Hashable, tuple[int, bool]]]


def largest_batches(
    keys: Iterable[Hashable],
    rows: int,
    at_rows: dict[Hashable, tuple[int, bool]],
    probe: Probe,
    usable: int,
) -> tuple[dict[Hashable, Largest], list[int]]:
    """Each key's largest fitting batch, and the batches probed, in order.

    `at_rows` is every key's (need, fits) at the example batch's `rows`, known already. Each probe
    serves every key: the next one is chosen for the key whose bracket is widest, where the line
    through its bracket's needs meets `usable` (regula falsi), beyond its largest fitting batch
    by at most GROWTH times where nothing above it was probed yet.
    """
    keys = list(keys)
    seen: dict[int, dict[Hashable, tuple[int, bool]]] = {rows: at_rows}
    probed: list[int] = []
    # Illinois' regula falsi: where a probe moved the same end of a key's bracket as the one
    # before, the other end's distance from the usable memory counts half as much in the next
    # chord (and again, each time), so that a curved need (attention) is not crept up on
    weights: dict[Hashable, dict[str, float]] = {k: {"low": 1.0, "high": 1.0} for k in keys}
    last: dict[Hashable, str | None] = dict.fromkeys(keys)

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
    key: Hashable, seen: dict[int, dict[Hashable, tuple[int, bool]]]
) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(rows, need) of the largest batch seen to fit and of the smallest seen not to."""
    fit = [(n, r[key][0]) for n, r in seen.items() if r[key][1]]
    fail = [(n, r[key][0]) for n, r in seen.items() if not r[key][1]]
    return max(fit, default=None), min(fail, default=None)


def _next(
    key: Hashable,
    seen: dict[int, dict[Hashable, tuple[int, bool]]],
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


def _answer(key: Hashable, seen: dict[int, dict[Hashable, tuple[int, bool]]]) -> Largest:
    low, high = _bracket(key, seen)
    return Largest(low[0] if low else None, high[0] if high else None)
