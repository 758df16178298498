"""The agreement (`autoshard.collective`) on four ranks: values in rank order, one rank's error
raised on every rank with its type, the lowest failing rank named when several fail, many rounds
in a row, and a stalled rank named by the others within the timeout. Two-rank jobs cannot show
that every rank reads every other rank's entry, nor which of several failures is reported.

Usage (from tests/_dist.py, 4 ranks started directly): agree4.py OUT_DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from _common import Cases, error_of, rank

import autoshard
from autoshard._world import resolve
from autoshard.collective import agree

TIMEOUT_S = 20.0
STALL_TIMEOUT_S = 3.0
cases = Cases()
OUT = Path(".")
autoshard.set_agreement_timeout(TIMEOUT_S)


@cases.case
def values_in_rank_order() -> list[int]:
    return agree(resolve(init=False), "a test", lambda: 10 * rank())


def _fail_on(failing: set[int]) -> Any:
    def compute() -> int:
        if rank() in failing:
            raise KeyError(f"injected on rank {rank()}")
        return rank()

    return error_of(lambda: agree(resolve(init=False), "a test", compute))


@cases.case
def error_on_rank2() -> dict[str, Any]:
    return _fail_on({2})


@cases.case
def errors_on_ranks_1_and_3() -> dict[str, Any]:
    return _fail_on({1, 3})


@cases.case
def many_rounds() -> bool:
    world = resolve(init=False)
    return all(
        agree(world, "a test", lambda i=i: (i, rank())) == [(i, r) for r in range(4)]
        for i in range(50)
    )


@cases.case
def rank3_stalls() -> dict[str, Any]:
    """Last: rank 3 arrives after the others have given up on it."""
    autoshard.set_agreement_timeout(STALL_TIMEOUT_S)

    def compute() -> int:
        if rank() == 3:
            time.sleep(3 * STALL_TIMEOUT_S)
        return rank()

    started = time.perf_counter()
    result = error_of(lambda: agree(resolve(init=False), "a test", compute))
    result["seconds"] = time.perf_counter() - started
    # Rank 0 hosts the store: it stays until rank 3 has arrived and read its answer.
    arrived = OUT / "rank3_arrived"
    if rank() == 3:
        arrived.touch()
    deadline = time.monotonic() + 10 * STALL_TIMEOUT_S
    while not arrived.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return result


if __name__ == "__main__":
    OUT = Path(sys.argv[1])
    cases.main()
