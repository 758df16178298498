"""The largest batch that fits (`decide.batch.largest_batches`) against needs whose answer is
known: linear, quadratic (attention over a sequence that grows with the batch), and stepped
(padding to a multiple). The search must only ever answer a batch its probe found to fit, end
within its 2% bracket or its probe budget, and share probes between candidates."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pytest

from autoshard.decide.batch import CLOSE_ENOUGH, MAX_PROBES, largest_batches

USABLE = 10_000


def _true_largest(need: Callable[[int], int]) -> int | None:
    """By bisection: every need here grows with the rows."""
    if need(1) > USABLE:
        return None
    low, high = 1, 2**40
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if need(middle) <= USABLE else (low, middle)
    return low


NEEDS: dict[str, Callable[[int], int]] = {
    "linear": lambda n: 1_000 + 7 * n,
    "quadratic": lambda n: 500 + 3 * n + n * n // 40,
    "stepped": lambda n: 2_000 + 90 * (-(-n // 16) * 16),  # padded to 16 rows
    "fixed": lambda n: 4_000 + n // 100,  # the batch hardly matters
}


def _search(
    needs: dict[Hashable, Callable[[int], int]], rows: int
) -> tuple[dict, list[int], list[int]]:
    calls: list[int] = []

    def probe(n: int) -> dict[Hashable, tuple[int, bool]]:
        calls.append(n)
        return {k: (f(n), f(n) <= USABLE) for k, f in needs.items()}

    at_rows = {k: (f(rows), f(rows) <= USABLE) for k, f in needs.items()}
    answers, probed = largest_batches(needs, rows, at_rows, probe, USABLE)
    return answers, probed, calls


@pytest.mark.parametrize("name", list(NEEDS))
@pytest.mark.parametrize("rows", [8, 64, 4096])
def test_the_answer_fits_and_is_within_the_bracket_or_the_budget(name: str, rows: int) -> None:
    need = NEEDS[name]
    answers, probed, calls = _search({name: need}, rows)
    answer = answers[name]
    assert probed == calls and len(calls) <= MAX_PROBES
    true = _true_largest(need)
    assert answer.rows is not None and true is not None
    assert need(answer.rows) <= USABLE  # it fits: it was probed or is the example batch
    assert answer.rows in (*calls, rows)
    if answer.bound is not None:
        assert need(answer.bound) > USABLE and answer.bound in (*calls, rows)
    # never more than the truth, and within 10% of it (the batch-size issue's target), unless
    # the search stopped at its budget still open above (the answer is then a lower bound)
    assert answer.rows <= true, (answer, true, calls)
    if answer.bound is not None:
        assert answer.rows >= 0.9 * true, (answer, true, calls)
    else:
        assert len(calls) == MAX_PROBES, (answer, true, calls)
    if answer.bound is not None and len(calls) < MAX_PROBES:
        assert answer.bound - answer.rows <= max(1, int(answer.rows * CLOSE_ENOUGH))


def test_one_search_serves_every_candidate() -> None:
    answers, probed, _ = _search(dict(NEEDS), 64)
    assert len(probed) <= MAX_PROBES
    for name, need in NEEDS.items():
        true = _true_largest(need)
        assert true is not None and answers[name].rows is not None
        assert need(answers[name].rows) <= USABLE and answers[name].rows <= true


def test_not_even_one_row_fits() -> None:
    answers, probed, _ = _search({"huge": lambda n: USABLE + n}, 32)
    assert answers["huge"].rows is None and answers["huge"].bound == 1
    assert probed == [1]  # nothing to search once one row does not fit


def test_a_batch_of_one_row_that_does_not_fit_probes_nothing() -> None:
    answers, probed, _ = _search({"huge": lambda n: USABLE + n}, 1)
    assert answers["huge"].rows is None and probed == []
